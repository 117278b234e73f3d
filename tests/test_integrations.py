"""The orchestrator recipes in integrations/ (Slurm, Kubernetes, torchrun, a local restart loop).

Static checks: every YAML manifest parses and carries the fields the recipes rely on (restart
policy, exit code 75 handling, grace period, a checkpoint volume mounted where --ckpt-dir
points); every shell script passes ``bash -n``; the sbatch file has its directives.

Behaviour, with real processes and real signals:
- the sbatch script's requeue decisions, run under bash with stand-ins for ``srun`` and
  ``scontrol`` on PATH (no Slurm here); and end to end with the real train.py: SIGUSR1 to the
  task, emergency checkpoint, exit 75, ``scontrol requeue``, the requeued run resumes;
- integrations/local/restart_loop.sh re-launching integrations/train.py while the test SIGKILLs
  it three times at seeded random moments (two at random steps, one at a random time after a
  re-launch, usually during start-up) and SIGTERMs it once (exit 75, re-launched at once,
  resumed at exactly that step): per-step losses and final weights equal an uninterrupted
  run's bit for bit;
- (slow) integrations/torchrun/run.sh with 2 CPU workers (gloo): one worker SIGKILLed mid-run,
  torchrun's --max-restarts relaunches both, they resume and finish equal to an uninterrupted
  2-worker run, per rank, bit for bit; and SIGTERM to run.sh: both workers save the same step,
  run.sh exits 75, the same command resumes and finishes equal to the uninterrupted run.

The preemption parts (SIGTERM/SIGUSR1 -> exit 75) run only when the installed package exports
``RESUMABLE_EXIT_CODE``; otherwise a SIGKILL stands in where it can. Kill points come from a
seeded RNG (override with RC_TEST_SEED).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTEG = ROOT / "integrations"
TRAIN = INTEG / "train.py"
LOOP = INTEG / "local" / "restart_loop.sh"
RUN_SH = INTEG / "torchrun" / "run.sh"
SBATCH = INTEG / "slurm" / "train.sbatch"
JOB_YAML = INTEG / "kubernetes" / "job.yaml"
PYTORCHJOB_YAML = INTEG / "kubernetes" / "pytorchjob.yaml"
SEED = int(os.environ.get("RC_TEST_SEED", "20240611"))
RESUMABLE_EXIT_CODE = 75
DEADLINE = 120.0  # seconds for one training run (all its restarts included)


def _yaml():
    return pytest.importorskip("yaml", reason="pyyaml is in the dev extra")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.update(extra)
    return env


# ============================================================================ static checks


def _shell_files() -> list[Path]:
    return sorted(p for p in INTEG.rglob("*") if p.suffix in {".sh", ".sbatch"})


def test_recipe_files_exist() -> None:
    for rel in [
        "train.py",
        "local/restart_loop.sh",
        "slurm/train.sbatch",
        "slurm/README.md",
        "kubernetes/job.yaml",
        "kubernetes/pytorchjob.yaml",
        "kubernetes/README.md",
        "torchrun/run.sh",
        "torchrun/README.md",
    ]:
        assert (INTEG / rel).is_file(), rel


@pytest.mark.parametrize("path", _shell_files(), ids=lambda p: str(p.relative_to(INTEG)))
def test_shell_scripts_parse(path: Path) -> None:
    p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert path.read_text().startswith("#!"), "needs a shebang line"
    if path.suffix == ".sh":
        assert path.stat().st_mode & stat.S_IXUSR, f"{path.name} is not executable"


def _sbatch_directives() -> dict[str, str]:
    """The #SBATCH options before the first command, as sbatch reads them."""
    opts: dict[str, str] = {}
    for line in SBATCH.read_text().splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            break  # sbatch stops reading directives at the first command
        m = re.match(r"#SBATCH\s+(--[\w-]+)(?:=(\S+))?", s)
        if m:
            opts[m.group(1)] = m.group(2) or ""
    return opts


def test_sbatch_directives() -> None:
    opts = _sbatch_directives()
    sig = re.fullmatch(r"(B:)?(USR1|SIGUSR1|TERM|SIGTERM|\d+)@(\d+)", opts.get("--signal", ""))
    assert sig, f"--signal=SIG@SECONDS expected, got {opts.get('--signal')!r}"
    assert int(sig.group(3)) >= 60, "the warning must leave time for one step and one save"
    assert "--requeue" in opts
    assert opts.get("--open-mode") == "append"
    assert "--output" in opts and "%j" in opts["--output"], "one log per job id across requeues"
    text = SBATCH.read_text()
    assert 'scontrol requeue "$JOB_REF"' in text
    assert "RESUMABLE_EXIT_CODE=75" in text
    assert re.search(r"^srun\b", text, re.M), "the training step runs under srun"
    assert "--resume" not in text, "re-running resumes by itself; no checkpoint path is passed"
    assert "CHANGE_ME" in text, "site-specific values are marked CHANGE_ME"


def _docs(path: Path) -> list[dict]:
    docs = [d for d in _yaml().safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name} holds no YAML document"
    for d in docs:
        assert isinstance(d, dict) and d.get("apiVersion") and d.get("kind"), d
    return docs


@pytest.mark.parametrize(
    "path",
    sorted(p for p in INTEG.rglob("*") if p.suffix in {".yaml", ".yml"}),
    ids=lambda p: str(p.relative_to(INTEG)),
)
def test_yaml_parses(path: Path) -> None:
    _docs(path)


def _pvc_names(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}


def _check_pod_spec(pod: dict, pvcs: dict[str, dict], container_name: str | None = None) -> dict:
    """Grace period, a PVC volume mounted where --ckpt-dir points; returns the container."""
    assert pod["terminationGracePeriodSeconds"] >= 60, "one step + one save must fit"
    (c,) = pod["containers"]
    if container_name:
        assert c["name"] == container_name
    assert isinstance(c["command"], list), "exec form, so python itself receives SIGTERM"
    args = c["args"]
    ckpt_dir = args[args.index("--ckpt-dir") + 1]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [m for m in c["volumeMounts"] if ckpt_dir.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"--ckpt-dir {ckpt_dir} is not on a mounted volume"
    claim = volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim in pvcs, f"the PVC {claim} is not defined next to the job"
    assert "--resume" not in args
    return c


def test_kubernetes_job() -> None:
    docs = _docs(JOB_YAML)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never", "podFailurePolicy requires restartPolicy Never"
    assert spec["backoffLimit"] >= 1
    c = _check_pod_spec(pod, _pvc_names(docs))
    rules = spec["podFailurePolicy"]["rules"]
    ignored = [r["onExitCodes"] for r in rules if r["action"] == "Ignore" and "onExitCodes" in r]
    assert any(e["operator"] == "In" and RESUMABLE_EXIT_CODE in e["values"] for e in ignored), (
        "exit 75 (checkpoint saved) must be retried without counting against backoffLimit"
    )
    for e in ignored:
        assert e.get("containerName", c["name"]) == c["name"]
    disruption = [
        r
        for r in rules
        if r["action"] == "Ignore"
        and any(pc["type"] == "DisruptionTarget" for pc in r.get("onPodConditions", []))
    ]
    assert disruption, "preemption/eviction must not count as a failure"
    # Rules apply in order: nothing before the 75 rule may fail the job on 75.
    for r in rules:
        codes = r.get("onExitCodes")
        if codes and RESUMABLE_EXIT_CODE in codes["values"]:
            assert r["action"] == "Ignore"
            break
        if codes and codes["operator"] == "NotIn":
            assert RESUMABLE_EXIT_CODE in codes["values"], r
    assert spec.get("podReplacementPolicy", "Failed") == "Failed"


def test_kubeflow_pytorchjob() -> None:
    docs = _docs(PYTORCHJOB_YAML)
    (job,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1
    pvcs = _pvc_names(docs)
    claims = set()
    ckpt_dirs = set()
    for spec in replicas.values():
        # The operator's ExitCode policy retries only exit codes >= 128, so 75 needs OnFailure.
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        c = _check_pod_spec(pod, pvcs, container_name="pytorch")
        claims |= {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        ckpt_dirs.add(c["args"][c["args"].index("--ckpt-dir") + 1])
    assert len(ckpt_dirs) == 1, "every rank must use the same checkpoint directory"
    (claim,) = claims
    assert "ReadWriteMany" in pvcs[claim]["spec"]["accessModes"], "ranks on several nodes share it"
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1


# ================================================================= helpers for process tests


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(d))
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    return " ".join(_argv(pid))


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _trainers(root: int) -> list[int]:
    """Live python processes running train.py under ``root``: not zombies, and not the
    short-lived forks of a bash script whose own command line names train.py."""
    out = []
    for p in _descendants(root):
        try:
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        argv = _argv(p)
        if (
            state != "Z"
            and argv
            and os.path.basename(argv[0]).startswith("python")
            and any(a.endswith("train.py") for a in argv[1:3])
        ):
            out.append(p)
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class _Proc:
    """A process group started for a test, with its output in a file; killed with every
    descendant (torchrun's workers run in sessions of their own) when the test ends."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "w") as f:
            self.p = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.seen: set[int] = set()

    def track(self) -> None:
        self.seen.update(_descendants(self.p.pid))

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.p.poll() is None:
            self.track()  # a full /proc scan: not too often on a 2-core machine
            if time.monotonic() > deadline:
                pytest.fail(f"{self.p.args} still running after {timeout} s:\n{self.output()}")
            time.sleep(0.25)
        return self.p.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-20000:]

    def cleanup(self) -> None:
        self.track()
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        for pid in self.seen:
            if "train.py" in _cmdline(pid) or "torchrun" in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _records(path: Path, offset: int = 0) -> list[dict]:
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().split(b"\n")[:-1]
    return [json.loads(line) for line in lines]  # each line is one write(2): never torn


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for r in _records(path):
        out[r["step"]] = r["loss"]  # a step replayed after a resume: the last line wins
    return out


def _assert_same_run(ref_out: Path, got_out: Path, steps: int, ranks: int = 1) -> None:
    for r in range(ranks):
        ref = _losses(ref_out / f"losses.rank{r}.jsonl")
        got = _losses(got_out / f"losses.rank{r}.jsonl")
        assert sorted(ref) == list(range(1, steps + 1)), f"rank {r}: reference incomplete"
        assert sorted(got) == list(range(1, steps + 1)), f"rank {r}: missing {set(ref) - set(got)}"
        diff = [s for s in ref if ref[s] != got[s]]
        assert not diff, (
            f"rank {r}: losses differ at {len(diff)} step(s), first at step {diff[0]}: "
            f"{float.fromhex(ref[diff[0]])!r} uninterrupted vs {float.fromhex(got[diff[0]])!r}"
        )
    a = (ref_out / "weights.safetensors").read_bytes()
    b = (got_out / "weights.safetensors").read_bytes()
    assert a == b, "final weights differ from the uninterrupted run's"


def _assert_valid_checkpoints(ckdir: Path, steps: list[int]) -> None:
    """The committed checkpoints are exactly ``steps`` (keep_last=3), all verified valid."""
    from resilient_callbacks import catalog

    committed = catalog.committed(catalog.scan(str(ckdir), catalog.Depth.FULL))
    assert [e.step for e in committed] == steps
    assert all(e.status is catalog.Status.VALID for e in committed), [
        (e.name, e.status, e.problem) for e in committed
    ]


def _train_args(workdir: Path, steps: int, every: int, sleep: float = 0.0) -> list[str]:
    args = [
        "--ckpt-dir",
        str(workdir / "ckpt"),
        "--out",
        str(workdir / "out"),
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--keep-last",
        "3",
        "--dist-timeout",
        "60",
    ]
    return [*args, "--sleep", str(sleep)] if sleep else args


def _wait_for(cond, what: str, proc: _Proc, poll: float = 0.003, timeout: float = DEADLINE):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if proc.p.poll() is not None:
            pytest.fail(
                f"exited (rc={proc.p.returncode}) while waiting for {what}:\n{proc.output()}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{proc.output()}")
        time.sleep(poll)


@pytest.fixture
def procs() -> Iterator[list[_Proc]]:
    started: list[_Proc] = []
    yield started
    for p in started:
        p.cleanup()


# =============================================================== sbatch, with stand-in Slurm


FAKE_SRUN = """#!/usr/bin/env bash
# stand-in srun: drop srun's own options, run the command here
echo "srun $*" >> "$FAKE_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# stand-in scontrol: hostnames, and a requeue that is only recorded
case "$1 $2" in
"show hostnames") echo fakenode1 ;;
"show job") echo "JobId=${SLURM_JOB_ID} JobName=x JobState=${FAKE_JOB_STATE:-RUNNING} Reason=None" ;;
requeue*) echo "requeue $2" >> "$FAKE_LOG"; exit "${FAKE_SCONTROL_RC:-0}" ;;
*) echo "unexpected scontrol $*" >&2; exit 1 ;;
esac
"""

FAKE_PYTHON = """#!/usr/bin/env bash
# stand-in for `python train.py ...`: record the arguments, wait until the file $FAKE_WAIT_FOR
# exists (if set), exit with $FAKE_RC
[[ $1 == -m ]] && exit 0
echo "python $*" >> "$FAKE_LOG"
[[ -n ${FAKE_NEW_STEP:-} ]] && mkdir -p "$CKPT_DIR/$FAKE_NEW_STEP"
while [[ -n ${FAKE_WAIT_FOR:-} && ! -e ${FAKE_WAIT_FOR:-} ]]; do sleep 0.02; done
touch "$FAKE_LOG.done"
exit "${FAKE_RC:-0}"
"""


def _fake_slurm(tmp: Path) -> dict[str, str]:
    bindir = tmp / "bin"
    bindir.mkdir()
    for name, text in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("python", FAKE_PYTHON)]:
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return _env(
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        FAKE_LOG=str(tmp / "calls.log"),
        PYTHON=str(bindir / "python"),
        CKPT_DIR=str(tmp / "ckpt"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="resilient-train",
        SLURM_JOB_NODELIST="fakenode1",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_RESTART_COUNT="0",
    )


def _calls(tmp: Path) -> list[str]:
    log = tmp / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(
    ("train_rc", "restart_count", "array", "requeued", "exit_code", "state"),
    [
        (0, "0", False, None, 0, "RUNNING"),  # finished
        (75, "0", False, "4242", 0, "RUNNING"),  # emergency checkpoint saved: requeue
        (75, "50", False, "4242", 0, "RUNNING"),  # preemptions are never limited
        (1, "0", False, "4242", 0, "RUNNING"),  # a crash: requeued
        (1, "50", False, "4242", 0, "RUNNING"),  # a crash after 50 preemptions: requeued
        (137, "3", False, "4242", 0, "RUNNING"),  # killed (OOM, kill -9): a crash
        (75, "0", True, "4200_7", 0, "RUNNING"),  # array task: requeue only that task
        (75, "0", False, None, 0, "CANCELLED"),  # scancel: saved, but stays cancelled
    ],
)
def test_sbatch_requeue_decisions(
    tmp_path: Path,
    train_rc: int,
    restart_count: str,
    array: bool,
    requeued: str | None,
    exit_code: int,
    state: str,
) -> None:
    env = _fake_slurm(tmp_path)
    env.update(FAKE_RC=str(train_rc), SLURM_RESTART_COUNT=restart_count, FAKE_JOB_STATE=state)
    if array:
        env.update(SLURM_ARRAY_JOB_ID="4200", SLURM_ARRAY_TASK_ID="7")
    p = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == exit_code, p.stdout + p.stderr
    calls = _calls(tmp_path)
    assert calls[0].startswith("srun --kill-on-bad-exit=1 "), calls
    assert f"--ckpt-dir {tmp_path / 'ckpt'} " in calls[1], calls
    requeues = [c.split()[1] for c in calls if c.startswith("requeue ")]
    assert requeues == ([requeued] if requeued else []), p.stdout


def test_sbatch_gives_up_after_crashes_in_a_row_without_progress(tmp_path: Path) -> None:
    """A crash loop stops after MAX_CRASHES (3) crashes with no new checkpoint between them;
    a crashed run that wrote a newer checkpoint, or a clean stop, starts the count again. (The
    limit was on SLURM_RESTART_COUNT, which preemptions use up too: a long run on a
    preemptible partition gave up at its first crash.)"""
    env = _fake_slurm(tmp_path)
    (tmp_path / "ckpt" / "step_000000010").mkdir(parents=True)

    def run(rc: int, new_step: str = "") -> tuple[int, str]:
        (tmp_path / "calls.log").unlink(missing_ok=True)
        env.update(FAKE_RC=str(rc), FAKE_NEW_STEP=new_step)
        p = subprocess.run(
            ["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60
        )
        requeued = any(c.startswith("requeue ") for c in _calls(tmp_path))
        return p.returncode, ("requeued" if requeued else "stopped") + ": " + p.stdout

    for n in (1, 2, 3):
        code, out = run(1)
        assert code == 0 and out.startswith("requeued"), out
        assert f"crash {n} in a row" in out, out
    code, out = run(1)
    assert code == 1 and out.startswith("stopped"), out
    assert "4 times in a row with no new checkpoint; giving up" in out, out
    # a crash after the run wrote a newer checkpoint is the first of a new count
    code, out = run(1, new_step="step_000000020")
    assert code == 0 and "crash 1 in a row" in out, out
    code, out = run(1)
    assert code == 0 and "crash 2 in a row" in out, out
    # a clean stop (exit 75) ends the count
    code, out = run(75)
    assert code == 0 and out.startswith("requeued"), out
    code, out = run(1)
    assert code == 0 and "crash 1 in a row" in out, out


def test_sbatch_waits_for_the_step_after_sigterm(tmp_path: Path) -> None:
    """Preemption: SIGTERM reaches the batch shell too. It must keep waiting for srun (the
    tasks are saving) and requeue afterwards, not exit and end the job mid-save.

    The task's step ends when the test says so, after the SIGTERM (it slept 1.5 s: a loaded
    machine that held the test back as long sent the SIGTERM after the step, to a shell that
    no longer waited, and the shell rightly said nothing of it)."""
    env = _fake_slurm(tmp_path)
    step_done = tmp_path / "step.done"
    env.update(FAKE_RC="143", FAKE_WAIT_FOR=str(step_done))
    p = subprocess.Popen(
        ["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not any(c.startswith("python ") for c in _calls(tmp_path)):
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()[0]
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # a shell that exits at SIGTERM is gone by now
        assert p.poll() is None, "the batch shell exited at SIGTERM while the step ran"
    finally:
        step_done.touch()  # the step ends (and its stand-in exits in any case)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert Path(f"{tmp_path / 'calls.log'}.done").exists(), "exited before the step finished"
    assert [c for c in _calls(tmp_path) if c.startswith("requeue")] == ["requeue 4242"], out
    assert "SIGTERM" in out


def test_sbatch_refuses_placeholder_ckpt_dir(tmp_path: Path) -> None:
    env = _fake_slurm(tmp_path)
    del env["CKPT_DIR"]
    p = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "CKPT_DIR" in p.stderr
    assert _calls(tmp_path) == []


def test_multinode_sbatch_passes_paths_as_literal_arguments(tmp_path: Path) -> None:
    """LOCAL_CKPT and REMOTE reach run.sh as one argument each, whatever they hold: they were
    pasted into the ``srun bash -c`` command, so a job name with a space split the path and a
    ``$(...)`` in it ran (found by a probe, with these stand-ins for srun and scontrol)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in {
        "srun": 'while [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
        "scontrol": '[[ "$1 $2" == "show hostnames" ]] && echo localhost; exit 0\n',
    }.items():
        (bin_ / name).write_text("#!/bin/bash\n" + body)
        (bin_ / name).chmod(0o755)
    run_sh = tmp_path / "integrations" / "torchrun" / "run.sh"
    run_sh.parent.mkdir(parents=True)
    run_sh.write_text('#!/bin/bash\nprintf "ARG[%s]\\n" "$@"\n')
    run_sh.chmod(0o755)
    env = _env(
        PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="1",
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="x",
        USER="me",
        SLURM_JOB_NAME="my run $(echo pwned)",
        REMOTE="s3://b/p q",
    )
    sbatch = INTEG / "slurm" / "multinode_nvme.sbatch"
    p = subprocess.run(
        ["bash", str(sbatch)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stdout + p.stderr
    args = re.findall(r"ARG\[(.*)\]", p.stdout)
    assert args[args.index("--ckpt-dir") + 1] == "/local_nvme/me/ckpts/my run $(echo pwned)"
    assert args[args.index("--remote") + 1] == "s3://b/p q"
    assert "pwned" not in p.stdout.replace("$(echo pwned)", "")


@pytest.mark.parametrize(
    "to",
    [pytest.param("task", marks=pytest.mark.slow), "batch shell"],  # (suite time)
)
def test_sbatch_preempted_requeued_resumed(tmp_path: Path, procs: list[_Proc], to: str) -> None:
    """End to end with the real train.py (one task, srun stand-in): SIGUSR1 to the task, as
    --signal=USR1@120 sends it, makes an emergency checkpoint and exit 75, and the script
    requeues the job; the requeued run (the same script and environment) resumes at that very
    step and finishes. Where the package does not handle preemption, a SIGKILL takes the
    crash path to the same requeue. SIGUSR1 to the batch shell (--signal=B:USR1@120, the form
    most Slurm guides show, or scancel --batch) was only noted there: the tasks trained on
    until the time limit's SIGTERM. The shell passes it on to srun now, which forwards it."""
    preemption = _library_handles_preemption()
    env = _fake_slurm(tmp_path)
    out_dir = tmp_path / "out"
    env.update(
        PYTHON=sys.executable,
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        TRAIN_ARGS="--steps 30 --every 5",
        OUT_DIR=str(out_dir),
    )
    losses = out_dir / "losses.rank0.jsonl"
    stop_at = random.Random(SEED + 2).randint(8, 22)
    # the trainer waits after step stop_at for the signal (tests/hold_site): it lands there
    # however loaded the machine (it had 0.03 s a step to land before the run ended; no sleep
    # per step since)
    held = dict(env, RC_HOLD_AT_STEP=str(stop_at))
    held["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "tests" / "hold_site"), env.get("PYTHONPATH")) if p
    )
    job = _Proc(["bash", str(SBATCH)], tmp_path / "run1.log", held)
    procs.append(job)
    _wait_for(lambda: any(r["step"] >= stop_at for r in _records(losses)), f"step {stop_at}", job)
    job.track()
    (pid,) = _trainers(job.p.pid)
    if to == "batch shell" and preemption:
        pid = job.p.pid
    os.kill(pid, signal.SIGUSR1 if preemption else signal.SIGKILL)
    assert job.wait(DEADLINE) == 0, job.output()
    assert "requeue 4242" in _calls(tmp_path), job.output()
    if preemption:
        assert "emergency checkpoint saved (exit 75)" in job.output(), job.output()
    last = _records(losses)[-1]["step"]
    if preemption:  # the step it waited at, or (the signal seen there) the next one's save
        assert last in (stop_at, stop_at + 1), (stop_at, last, job.output())

    env["SLURM_RESTART_COUNT"] = "1"  # what Slurm sets in the requeued job
    p = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "training finished" in p.stdout
    assert _calls(tmp_path).count("requeue 4242") == 1
    m = re.search(r"starting at step (\d+) \(resumed\)", p.stdout + p.stderr)
    assert m, p.stdout + p.stderr
    if preemption:
        assert int(m.group(1)) == last, "a preempted run resumes at the step it stopped"
    assert sorted(_losses(losses)) == list(range(1, 31))
    assert (out_dir / "weights.safetensors").is_file()
    # keep_last=3 of the commits: every 5th step, the emergency save, and the final step.
    commits = {*range(5, 31, 5), last} if preemption else set(range(5, 31, 5))
    _assert_valid_checkpoints(tmp_path / "ckpt", sorted(commits)[-3:])


# ========================================================= local restart loop under SIGKILL


def test_restart_loop_usage_errors() -> None:
    p = subprocess.run(["bash", str(LOOP)], capture_output=True, text=True)
    assert p.returncode == 2 and "no command" in p.stderr
    p = subprocess.run(
        ["bash", str(LOOP), "--max-restarts", "x", "--", "true"], capture_output=True, text=True
    )
    assert p.returncode == 2


def test_restart_loop_exit_codes(tmp_path: Path) -> None:
    """75 re-launches without using a restart; crashes use them up; 0 stops the loop."""
    script = (
        'echo "$RESTART_ATTEMPT" >> "$0.attempts"; '
        "case $RESTART_ATTEMPT in 0|1|2) exit 75;; 3) exit 1;; 4) kill -9 $$;; *) exit 0;; esac"
    )
    counter = tmp_path / "c"
    cmd = ["bash", str(LOOP), "--max-restarts", "2", "--delay", "0", "--", "bash", "-c", script]
    p = subprocess.run([*cmd, str(counter)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert Path(f"{counter}.attempts").read_text().split() == ["0", "1", "2", "3", "4", "5"]

    Path(f"{counter}.attempts").unlink()
    cmd[3] = "1"  # one restart: the crash at attempt 3 uses it, the kill at attempt 4 ends it
    p = subprocess.run([*cmd, str(counter)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGKILL, p.stderr
    assert "giving up" in p.stderr


def test_restart_loop_forwards_sigterm_and_stops(tmp_path: Path) -> None:
    """SIGTERM to the loop goes to the command, whose exit status (75) the loop returns
    without re-launching: the outer scheduler (Slurm, a Kubernetes Job) requeues."""
    child = 'trap "sleep 0.3; exit 75" TERM; echo up > "$0.up"; sleep 30 & wait'
    marker, errpath = tmp_path / "m", tmp_path / "loop.err"
    with open(errpath, "w") as errf:  # not a pipe: the command's `sleep` would hold it open
        p = subprocess.Popen(
            ["bash", str(LOOP), "--delay", "0", "--", "bash", "-c", child, str(marker)],
            stderr=errf,
        )
    deadline = time.monotonic() + 120
    while not Path(f"{marker}.up").exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    err = errpath.read_text()
    assert p.returncode == RESUMABLE_EXIT_CODE, err
    assert err.count("attempt 0:") == 1 and "attempt 1" not in err, err


@pytest.mark.parametrize(
    ("child", "code"),
    [
        ('echo up > "$0.up"; exec sleep 30', RESUMABLE_EXIT_CODE),  # dies of it: no handler yet
        ('trap "exit 1" TERM; echo up > "$0.up"; sleep 30 & wait', 1),  # fails after it
    ],
    ids=["dies of it", "fails after it"],
)
def test_restart_loop_stopped_before_the_command_could_save(
    tmp_path: Path, child: str, code: int
) -> None:
    """SIGTERM to the loop while the command has no handler yet (importing torch, building the
    model: no Checkpointer yet) kills the command by the signal: the loop exited 143, which a
    Kubernetes Job counts as a crash against backoffLimit, though nothing was lost and a
    re-run resumes. It exits 75 now; a command that fails after the signal (its emergency save
    failed: exit 1) keeps its status."""
    marker, errpath = tmp_path / "m", tmp_path / "loop.err"
    with open(errpath, "w") as errf:
        p = subprocess.Popen(
            ["bash", str(LOOP), "--delay", "0", "--", "bash", "-c", child, str(marker)],
            stderr=errf,
        )
    deadline = time.monotonic() + 120
    while not Path(f"{marker}.up").exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    err = errpath.read_text()
    assert p.returncode == code, err
    assert "attempt 1" not in err, err


def _library_handles_preemption() -> bool:
    """Whether the installed package makes an emergency save and exits 75 on SIGTERM."""
    import resilient_callbacks

    return getattr(resilient_callbacks, "RESUMABLE_EXIT_CODE", None) == RESUMABLE_EXIT_CODE


@pytest.mark.slow  # suite budget; the sbatch and launcher tests stay in the default run
def test_restart_loop_kill_and_preempt_exact_resume(tmp_path: Path, procs: list[_Proc]) -> None:
    """While restart_loop.sh re-launches the training process, SIGKILL it 3 times at seeded
    random moments (two at random steps, one at a random time after a re-launch) and, where
    the package handles preemption, SIGTERM it once (emergency save, exit 75, re-launched
    without using a restart, resumed at exactly the step it stopped): the result equals an
    uninterrupted run's, bit for bit."""
    steps, every, sleep = 60, 5, 0.03
    rng = random.Random(SEED)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    # The uninterrupted reference runs alongside (2 cores).
    ref = _Proc(
        [sys.executable, str(TRAIN), *_train_args(ref_dir, steps, every)],
        tmp_path / "ref.log",
        _env(),
    )
    procs.append(ref)
    loop = _Proc(
        [
            "bash",
            str(LOOP),
            "--max-restarts",
            "5",
            "--delay",
            "0",
            "--",
            sys.executable,
            str(TRAIN),
            *_train_args(run_dir, steps, every, sleep),
        ],
        tmp_path / "loop.log",
        _env(),
    )
    procs.append(loop)
    losses = run_dir / "out" / "losses.rank0.jsonl"

    first, term, last = rng.randint(8, 20), rng.randint(27, 38), rng.randint(45, 55)
    plan: list[tuple[str, float, signal.Signals]] = [
        ("step", first, signal.SIGKILL),
        ("time", rng.uniform(0.3, 2.0), signal.SIGKILL),  # usually during imports or restore
        ("step", term, signal.SIGTERM),  # a preemption
        ("step", last, signal.SIGKILL),
    ]
    if not _library_handles_preemption():
        plan = [p for p in plan if p[2] is signal.SIGKILL]
    stopped: list[int] = []
    preempted_at: list[int] = []
    for kind, when, sig in plan:
        offset = losses.stat().st_size if losses.exists() else 0

        def current() -> int | None:
            live = [p for p in _trainers(loop.p.pid) if p not in stopped]
            return live[0] if live else None

        pid = _wait_for(current, "the next training process", loop, poll=0.02)
        loop.track()
        if kind == "step":
            _wait_for(
                lambda offset=offset, when=when: any(
                    r["step"] >= when for r in _records(losses, offset)
                ),
                f"step {when}",
                loop,
            )
            time.sleep(rng.uniform(0, sleep))  # anywhere in the step, or in its save
        else:
            time.sleep(when)
        os.kill(pid, sig)
        stopped.append(pid)
        _wait_for(lambda pid=pid: _gone(pid), f"pid {pid} to end", loop, poll=0.01)
        if sig is signal.SIGTERM:  # it finished its step, saved it, and exited
            preempted_at.append(_records(losses, offset)[-1]["step"])

    assert loop.wait(DEADLINE) == 0, loop.output()
    assert ref.wait(DEADLINE) == 0, ref.output()
    out = loop.output()
    kills = sum(sig is signal.SIGKILL for _, _, sig in plan)
    assert out.count("exit 137: crashed; restart") == kills, out
    assert out.count("exit 75: checkpoint saved, resumable; re-launching") == len(preempted_at)
    for step in preempted_at:  # no step repeated after a preemption
        assert f"starting at step {step} (resumed)" in out, out
    assert f"attempt {len(plan)} finished (exit 0)" in out, out
    _assert_same_run(ref_dir / "out", run_dir / "out", steps)
    _assert_valid_checkpoints(run_dir / "ckpt", [50, 55, 60])


# ========================================================================= torchrun restarts


TORCHRUN_STEPS, TORCHRUN_EVERY, TORCHRUN_SLEEP = 30, 5, 0.05


def _torchrun_env(**extra: str) -> dict[str, str]:
    return _env(PYTHON=sys.executable, NPROC="2", MAX_RESTARTS="2", SHUTDOWN_TIMEOUT="30", **extra)


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-worker run through run.sh; returns its --out directory."""
    d = tmp_path_factory.mktemp("torchrun-ref")
    p = subprocess.run(
        ["bash", str(RUN_SH), *_train_args(d, TORCHRUN_STEPS, TORCHRUN_EVERY)],
        env=_torchrun_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return d / "out"


# Slow: two torchrun runs of 2 workers each take ~25 s on 2 cores, too much for the default set.
@pytest.mark.slow
def test_torchrun_worker_sigkill_restart_exact_resume(
    tmp_path: Path, procs: list[_Proc], torchrun_reference: Path
) -> None:
    """2 CPU workers under integrations/torchrun/run.sh; one is SIGKILLed mid-run; torchrun
    restarts the group (--max-restarts), both resume, and the result equals an uninterrupted
    2-worker run's, bit for bit, on each rank."""
    rng = random.Random(SEED + 1)
    run = _Proc(
        [
            "bash",
            str(RUN_SH),
            *_train_args(tmp_path, TORCHRUN_STEPS, TORCHRUN_EVERY, TORCHRUN_SLEEP),
        ],
        tmp_path / "run.log",
        _torchrun_env(),
    )
    procs.append(run)

    victim_rank = rng.randint(0, 1)
    kill_at = rng.randint(8, 20)
    log = tmp_path / "out" / f"losses.rank{victim_rank}.jsonl"
    _wait_for(lambda: any(r["step"] >= kill_at for r in _records(log)), f"step {kill_at}", run)
    time.sleep(rng.uniform(0, TORCHRUN_SLEEP))
    run.track()
    (pid,) = [p for p in _trainers(run.p.pid) if _environ(p).get("RANK") == str(victim_rank)]
    os.kill(pid, signal.SIGKILL)

    assert run.wait(DEADLINE) == 0, run.output()
    out = run.output()
    resumed = re.findall(r"\[rank (\d)/2\] starting at step (\d+) \(resumed\)", out)
    assert sorted(r for r, _ in resumed) == ["0", "1"], out
    (start,) = {int(s) for _, s in resumed}  # both ranks resume from the same checkpoint
    assert 0 < start <= kill_at + 1, out
    _assert_same_run(torchrun_reference, tmp_path / "out", TORCHRUN_STEPS, ranks=2)


@pytest.mark.slow
def test_torchrun_sigterm_exits_75_and_rerun_resumes(
    tmp_path: Path, procs: list[_Proc], torchrun_reference: Path
) -> None:
    """SIGTERM to run.sh (a preemption): torchrun passes it to both workers, they make one
    emergency checkpoint of the same step and exit, run.sh exits 75; running the same command
    again resumes at that step and ends equal to the uninterrupted run."""
    if not _library_handles_preemption():
        pytest.skip("the installed resilient_callbacks does not handle SIGTERM yet")
    cmd = [
        "bash",
        str(RUN_SH),
        *_train_args(tmp_path, TORCHRUN_STEPS, TORCHRUN_EVERY, TORCHRUN_SLEEP),
    ]
    run = _Proc(cmd, tmp_path / "run1.log", _torchrun_env())
    procs.append(run)
    stop_at = random.Random(SEED + 3).randint(8, 20)
    log0 = tmp_path / "out" / "losses.rank0.jsonl"
    _wait_for(lambda: any(r["step"] >= stop_at for r in _records(log0)), f"step {stop_at}", run)
    run.p.send_signal(signal.SIGTERM)
    assert run.wait(DEADLINE) == RESUMABLE_EXIT_CODE, run.output()
    saved = max(r["step"] for r in _records(log0))

    rerun = _Proc(cmd, tmp_path / "run2.log", _torchrun_env())
    procs.append(rerun)
    assert rerun.wait(DEADLINE) == 0, rerun.output()
    resumed = re.findall(r"\[rank (\d)/2\] starting at step (\d+) \(resumed\)", rerun.output())
    assert sorted(r for r, _ in resumed) == ["0", "1"], rerun.output()
    (start,) = {int(s) for _, s in resumed}
    # The ranks agree on the stop step at their next decision step: at or after the last
    # step rank 0 logged before the signal, never a replay of older steps.
    assert stop_at <= start <= saved, (start, saved, run.output())
    _assert_same_run(torchrun_reference, tmp_path / "out", TORCHRUN_STEPS, ranks=2)


@pytest.mark.parametrize("name", ["train.sbatch", "multinode_nvme.sbatch"])
def test_sbatch_grace_periods_match_its_signals(name: str) -> None:
    """The sbatch recipes tell the library each signal's grace period: SIGUSR1 the lead of
    --signal=USR1@N, SIGTERM Slurm's KillWait default (30 s), not N as one value for both."""
    from resilient_callbacks.watcher_setup import grace_from_env

    text = (INTEG / "slurm" / name).read_text()
    lead = re.search(r"^#SBATCH --signal=(?:B:)?USR1@(\d+)", text, re.M)
    env = re.search(r"RESILIENT_GRACE_PERIOD_S=\"?([^\"\s]+)", text)
    assert lead and env, name
    grace = grace_from_env(env.group(1))
    assert isinstance(grace, dict), grace
    assert grace["SIGTERM"] == 30 and 0 < grace["SIGUSR1"] <= int(lead.group(1)), grace
