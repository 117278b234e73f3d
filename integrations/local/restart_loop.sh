#!/usr/bin/env bash
# restart_loop.sh: re-launch a resumable training command until it finishes, like a scheduler.
#
#   integrations/local/restart_loop.sh [--max-restarts N] [--delay SECONDS] -- COMMAND [ARGS...]
#   integrations/local/restart_loop.sh --max-restarts 5 -- \
#       python integrations/train.py --ckpt-dir ckpts/run1 --steps 1000
#
# The command must resume by itself when re-run (a Checkpointer with resume="auto" does). Exit
# status of the command decides what happens next:
#   0          finished: the loop exits 0.
#   75         resumable (EX_TEMPFAIL: the Checkpointer made an emergency checkpoint on
#              SIGTERM/SIGUSR1): re-launched at once; does not use up a restart.
#   any other  a crash (an exception, OOM, kill -9 = 137, ...): re-launched after --delay seconds
#              while restarts are left (--max-restarts, default 3), else the loop exits with it.
#
# Signals sent to the loop (SIGTERM, SIGINT, SIGHUP, SIGUSR1) mean "the machine is going away":
# the loop passes SIGTERM (SIGUSR1 as is) to the running command, waits for it to finish its
# emergency save, does NOT re-launch, and exits with the command's status (75 after a save; 75
# too when the command died of the signal passed on: it had no handler yet, still starting), so
# an outer scheduler (Slurm, a Kubernetes Job) sees the resumable exit code. That also makes it
# usable as a container entrypoint: crashes restart inside the pod, preemptions go to the Job.
# Started with `restart_loop.sh ... &` from a script (or under nohup), bash itself ignores
# SIGINT (and nohup SIGHUP) for the loop, so no trap can see it: stop it with SIGTERM or SIGUSR1.
#
# The command runs with RESTART_ATTEMPT=0, 1, 2, ... in its environment (like torchrun's
# TORCHELASTIC_RESTART_COUNT). Environment defaults: MAX_RESTARTS, RESTART_DELAY.
set -uo pipefail

readonly RESUMABLE_EXIT_CODE=75
max_restarts="${MAX_RESTARTS:-3}"
delay="${RESTART_DELAY:-1}"

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
    --max-restarts) max_restarts="${2:?--max-restarts needs a value}"; shift 2 ;;
    --max-restarts=*) max_restarts="${1#*=}"; shift ;;
    --delay) delay="${2:?--delay needs a value}"; shift 2 ;;
    --delay=*) delay="${1#*=}"; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "restart_loop.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
    esac
done
if [[ $# -eq 0 ]]; then
    echo "restart_loop.sh: no command given" >&2
    usage >&2
    exit 2
fi
if ! [[ $max_restarts =~ ^[0-9]+$ ]]; then
    echo "restart_loop.sh: --max-restarts must be a whole number, got '$max_restarts'" >&2
    exit 2
fi
if ! [[ $delay =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "restart_loop.sh: --delay must be a number of seconds, got '$delay'" >&2
    exit 2
fi

log() { printf '[restart_loop %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

child=""
stopping=""    # set once we were told to stop: no more re-launches
forwarded=""   # the signals passed on to the command
interrupted=0  # a trap ran while we were in `wait`

on_signal() {
    local sig="$1" to_child="TERM"
    stopping="$sig"
    interrupted=1
    # Commands started in the background by a non-interactive shell ignore SIGINT, so INT (and
    # HUP) are passed on as TERM; USR1 is passed on as it is (Slurm's --signal convention).
    [[ $sig == USR1 ]] && to_child="USR1"
    if [[ -n $child ]]; then
        log "got SIG$sig: sending SIG$to_child to pid $child and waiting for it (no re-launch)"
        kill -s "$to_child" "$child" 2>/dev/null && forwarded+=" $to_child"
    fi
}
for sig in TERM INT HUP USR1; do
    # shellcheck disable=SC2064
    trap "on_signal $sig" "$sig"
done

attempt=0
restarts=0
while :; do
    export RESTART_ATTEMPT="$attempt"
    log "attempt $attempt: $*"
    "$@" &
    child=$!
    while :; do
        interrupted=0
        wait "$child"
        rc=$?
        # `wait` returns early (status > 128) when a trap runs; wait again for the real status.
        [[ $interrupted -eq 1 ]] || break
    done
    child=""

    if [[ $rc -eq 0 ]]; then
        log "attempt $attempt finished (exit 0)"
        exit 0
    fi
    if [[ -n $stopping ]]; then
        for sig in $forwarded; do
            [[ $rc -eq $((128 + $(kill -l "$sig"))) ]] || continue
            # it died of the signal (no handler yet: importing, building the model): nothing
            # was written that a re-run does not resume from; 143 read as a crash outside
            log "attempt $attempt died of SIG$sig before it could save; exiting" \
                "$RESUMABLE_EXIT_CODE (re-run to resume from the newest checkpoint)"
            exit "$RESUMABLE_EXIT_CODE"
        done
        log "attempt $attempt exited $rc after SIG$stopping; stopping (re-run to resume)"
        exit "$rc"
    fi
    attempt=$((attempt + 1))
    if [[ $rc -eq $RESUMABLE_EXIT_CODE ]]; then
        log "exit $rc: checkpoint saved, resumable; re-launching"
        continue
    fi
    if [[ $restarts -ge $max_restarts ]]; then
        log "exit $rc: crashed and no restarts left ($restarts of $max_restarts used); giving up"
        exit "$rc"
    fi
    restarts=$((restarts + 1))
    log "exit $rc: crashed; restart $restarts of $max_restarts in ${delay}s"
    sleep "$delay" &
    wait $! || true
    if [[ -n $stopping ]]; then
        log "told to stop (SIG$stopping) while waiting to restart; exiting $rc"
        exit "$rc"
    fi
done
