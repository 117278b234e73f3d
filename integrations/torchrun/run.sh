#!/usr/bin/env bash
# run.sh: single-node torchrun with elastic restarts around a resumable training script.
#
#   integrations/torchrun/run.sh --ckpt-dir ckpts/run1 --steps 1000 --out out/run1
#   NPROC=4 MAX_RESTARTS=5 integrations/torchrun/run.sh --ckpt-dir ckpts/run1
#
# Arguments go to the training script (TRAIN_SCRIPT, default integrations/train.py). When a
# worker dies (an exception, OOM, kill -9), torchrun stops every other worker and starts the
# whole group again, up to MAX_RESTARTS times; each new worker resumes from the newest valid
# checkpoint, so a restart only repeats the steps since that checkpoint.
#
# Environment:
#   NPROC             workers (one per GPU), default 2
#   NNODES            nodes, default 1; above 1 (a static rendezvous, ranks stay on their node)
#                     also NODE_RANK (this node, 0..NNODES-1) and MASTER_ADDR/MASTER_PORT (node
#                     0's address, default port 29500); MAX_RESTARTS then restarts this node's
#                     group only when every node does (torchrun's rule)
#   MAX_RESTARTS      group restarts before torchrun gives up, default 3 on one node and 0 on
#                     several (the static rendezvous's restarts can hang: see below; there the
#                     scheduler restarts the job on exit 75 or a failure)
#   SHUTDOWN_TIMEOUT  seconds torchrun gives workers between its SIGTERM/SIGUSR1 and SIGKILL,
#                     default 120: long enough for one emergency checkpoint (torchrun's own
#                     default, 30 s, can cut a large save short)
#   PYTHON            the Python whose torchrun to use, default python3 on PATH (e.g. .venv/bin/python)
#   TORCHRUN          the torchrun executable, default: torchrun next to PYTHON, else on PATH
#   TRAIN_SCRIPT      default: ../train.py next to this file
#
# Signals: SIGTERM, SIGINT, SIGHUP and SIGUSR1 sent to this script are passed to torchrun (SIGINT
# and SIGHUP as SIGTERM), which passes them to every worker (SIGUSR1 included: see
# --signals-to-handle below) so the Checkpointer can make its emergency checkpoint. torchrun itself exits 1 after such a
# shutdown; this script then exits 75 (RESUMABLE_EXIT_CODE) so that an outer scheduler
# requeues the job. Otherwise it exits with torchrun's status: 0 done, non-zero when the
# restarts ran out.
set -uo pipefail

readonly RESUMABLE_EXIT_CODE=75
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NPROC="${NPROC:-2}"
if [[ ${NNODES:-1} -gt 1 ]]; then MAX_RESTARTS="${MAX_RESTARTS:-0}"; else MAX_RESTARTS="${MAX_RESTARTS:-3}"; fi
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-120}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-$HERE/../train.py}"
if [[ -z ${TORCHRUN:-} ]]; then
    py_dir="$(dirname "$(command -v "${PYTHON:-python3}" 2>/dev/null || echo /nonexistent)")"
    if [[ -x $py_dir/torchrun ]]; then TORCHRUN="$py_dir/torchrun"; else TORCHRUN=torchrun; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# torchrun only forwards the signals it handles; add SIGUSR1 (Slurm's and the Checkpointer's
# "save and stop" signal). Set through the environment so older torchrun versions without
# --signals-to-handle / --shutdown-timeout still start (they ignore unknown PET_* variables).
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCHELASTIC_SIGNALS_TO_HANDLE="$PET_SIGNALS_TO_HANDLE"
export PET_SHUTDOWN_TIMEOUT="$SHUTDOWN_TIMEOUT"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$SHUTDOWN_TIMEOUT"
# Since torch 2.5 the workers share the agent's rendezvous TCPStore, and it outlives a restart:
# the restarted workers can read the previous attempt's process-group keys and dial ports of
# dead workers, so init_process_group hangs until its timeout (seen here in 3 of 6 restarts with
# torch 2.13; pytorch/pytorch#135712). A store per attempt (the pre-2.5 behaviour) avoids it.
# It acts on the c10d rendezvous (one node, below) only: the static one used for NNODES > 1
# shares its store regardless, so there MAX_RESTARTS defaults to 0: the scheduler restarts.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

child=""
signalled=""
interrupted=0
on_signal() {
    signalled="$1"
    interrupted=1
    # SIGINT (Ctrl-C) and SIGHUP (the terminal closed) reach the workers as SIGTERM, the
    # signal the Checkpointer answers with an emergency checkpoint by default
    local forward="$1"
    [[ $forward == INT || $forward == HUP ]] && forward=TERM
    [[ -n $child ]] && kill -s "$forward" "$child" 2>/dev/null
}
for sig in TERM INT HUP USR1; do
    # shellcheck disable=SC2064
    trap "on_signal $sig" "$sig"
done

# One node: --rdzv-endpoint=localhost:0 (what --standalone uses), a c10d rendezvous on a free
# port of this host, so several runs on one machine never collide. Several nodes: torchrun's
# static rendezvous, so a node's ranks stay on it after a restart (its disk holds their files).
NNODES="${NNODES:-1}"
if [[ $NNODES -gt 1 ]]; then
    rendezvous=(--nnodes="$NNODES" --node-rank="${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
        --master-addr="${MASTER_ADDR:?set MASTER_ADDR (node 0)}"
        --master-port="${MASTER_PORT:-29500}")
else
    rendezvous=(--nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=localhost:0)
fi
"$TORCHRUN" \
    "${rendezvous[@]}" \
    --nproc-per-node="$NPROC" \
    --max-restarts="$MAX_RESTARTS" \
    "$TRAIN_SCRIPT" "$@" &
child=$!
while :; do
    interrupted=0
    wait "$child"
    rc=$?
    [[ $interrupted -eq 1 ]] || break # a trap interrupted `wait`: wait for the real status
done

if [[ -n $signalled && $rc -ne 0 ]]; then
    echo "[run.sh] stopped by SIG$signalled (torchrun exit $rc): exiting $RESUMABLE_EXIT_CODE," \
        "re-run the same command to resume" >&2
    exit "$RESUMABLE_EXIT_CODE"
fi
exit "$rc"
