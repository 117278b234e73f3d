"""The scripts under ``examples/`` run as their docstrings say, and resume.

Each runs as a user would start it (``torchrun`` for the multi-process ones), in a fresh working
directory (every example writes under ``./demo_output``). The self-checking examples (they kill
a run, resume it and compare with an uninterrupted one) must report bit-identical results; the
``torchrun`` loops are run to step 20, then run again to step 40, and must continue from step
20 with the same losses as a run that was never stopped.

The runs are marked ``slow`` (about 3.5 minutes together; the paths they take are covered by the default
suite's own tests): ``scripts/test.sh -m slow tests/test_examples.py``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(argv: list[str], cwd: Path, timeout: float = 240.0) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    r = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{argv} exited {r.returncode}\n{out[-4000:]}"
    return out


def torchrun(script: str, nproc: int, cwd: Path, *args: str) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return run([*launcher, f"--nproc_per_node={nproc}", str(EXAMPLES / script), *args], cwd)


def run_stalled(argv: list[str], cwd: Path, killed: Path, kill_at: int) -> str:
    """``run(argv, cwd)`` for an example that SIGKILLs a run of its own (its losses logged to
    ``killed``) at step ``kill_at``, the example's process stopped (SIGSTOP, as a loaded
    machine's scheduler may leave it) from that run's start until the run has gone past
    ``kill_at`` or waits there to be killed (it says so: ``waiting_to_be_killed`` beside its
    log). The kill lands at ``kill_at`` however late the example looks; the examples killed
    the run at whichever step it had reached when they looked (polling its log)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    waiting = killed.parent / "waiting_to_be_killed"

    def until(done: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
        for _ in range(40000):  # (a hang's guard: 400 s)
            if done() or proc.poll() is not None:
                return
            time.sleep(0.01)
        raise AssertionError(f"{argv} did not get past step {kill_at}")

    def past_or_waiting() -> bool:
        steps = re.findall(r'"step": (\d+)', killed.read_text())
        return waiting.exists() or any(int(s) > kill_at for s in steps)

    with (
        (cwd / "output.txt").open("w+") as out,
        subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            until(killed.exists, proc)  # the run to kill has started
            os.kill(proc.pid, signal.SIGSTOP)
            until(past_or_waiting, proc)
            os.kill(proc.pid, signal.SIGCONT)
            proc.wait(timeout=400)
        finally:
            proc.kill()
        out.seek(0)
        said = out.read()
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{said[-4000:]}"
    return said


def losses(out: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("script", ["fsdp_resume.py", "ddp_loop.py"])
def test_torchrun_example_continues_where_it_stopped_with_the_same_losses(tmp_path, script):
    straight = torchrun(script, 2, tmp_path, "--dir", "straight", "--steps", "40")
    first = torchrun(script, 2, tmp_path, "--dir", "stopped", "--steps", "20")
    again = torchrun(script, 2, tmp_path, "--dir", "stopped", "--steps", "40")
    assert "starting at step 0" in first
    assert "starting at step 20" in again, again[-2000:]
    assert sorted(losses(again)) == [30, 40]
    assert {s: losses(straight)[s] for s in (30, 40)} == losses(again)
    if script == "ddp_loop.py":  # the DDP-wrapped model, evaluated in one plain process
        import torch

        from resilient_callbacks import Checkpointer

        models = []
        for d in ("straight", "stopped"):
            torch.manual_seed(1)
            net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
            )
            with Checkpointer(tmp_path / d, read_only=True) as ck:
                assert ck.restore({"model": net}) == 40
            models.append(net)
        for a, b in zip(*(m.state_dict().values() for m in models), strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_example_resumes_on_one_rank(tmp_path):
    torchrun("fsdp_resume.py", 2, tmp_path, "--dir", "ck", "--steps", "20")
    out = torchrun("fsdp_resume.py", 1, tmp_path, "--dir", "ck", "--steps", "30")
    assert "starting at step 20 on 1 rank(s)" in out, out[-2000:]
    assert sorted(losses(out)) == [30]


# the examples that kill a run of their own: its folder and log, the step, what they say
KILLED = {
    "demo_resume.py": (
        "plain/interrupted",
        "log.jsonl",
        37,
        "killed (exit -9) after step 37; last checkpoint taken: step 30",
    ),
    "lightning_resume.py": (
        "lightning/interrupted",
        "losses.jsonl",
        27,
        "killed with SIGKILL during step 27",
    ),
    "transformers_resume.py": (
        "transformers/interrupted",
        "losses.jsonl",
        12,
        "killed with SIGKILL after step 12",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "verdict"),
    [
        (
            "deepspeed_resume.py",
            '"per-step losses identical": true, "final fp32 weights identical": true',
        ),
        ("lightning_resume.py", "final weights identical: True"),
        ("transformers_resume.py", "per-step losses and final weights bit-identical: True"),
        ("demo_resume.py", None),
    ],
)
def test_self_checking_example_reports_an_exact_resume(tmp_path, script, verdict):
    argv = [sys.executable, str(EXAMPLES / script)]
    if script in KILLED:  # killed at the step it names, however late the example looks
        folder, log, step, said = KILLED[script]
        out = run_stalled(argv, tmp_path, tmp_path / "demo_output" / folder / log, step)
        assert said in out, out[-3000:]
    else:
        out = run(argv, tmp_path, timeout=400.0)
    if verdict is not None:
        assert verdict in out, out[-3000:]
    if script == "lightning_resume.py":
        assert re.search(r"all \d+ per-step losses identical: True", out), out[-3000:]
    # the command it suggests runs as printed, from where the example ran, without an activated
    # venv (found 2026-12-06: the Lightning and Transformers examples said `resilient-ckpt ls`)
    # nor the PYTHONPATH the example had (examples/cli_hint.py)
    hint = re.search(r"try: (\S.* ls \S+)$", out, re.M)
    if script != "deepspeed_resume.py":
        assert hint, out[-2000:]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        r = subprocess.run(
            ["bash", "-c", hint.group(1)],
            cwd=tmp_path,
            env=dict(env, PATH="/usr/bin:/bin"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and "valid" in r.stdout, r.stdout + r.stderr


def test_the_examples_hint_runs_the_code_the_example_imported(tmp_path):
    """With a venv set up by another checkout (RESILIENT_VENV shared; scripts/this_checkout.sh
    puts this checkout's src on PYTHONPATH for the example) the hint said
    ``.venv/bin/resilient-ckpt ls DIR``, whose console script runs the other checkout's code. A
    stand-in checkout here: its package's ``__main__`` says where it runs from."""
    pkg = tmp_path / "other" / "src" / "resilient_callbacks"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import sys; print('RAN', __file__, sys.argv[1:])\n")
    code = f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); import cli_hint; "
    code += "print(cli_hint.cli_command('ls', 'my dir'))"
    no_path = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def hint(**env: str) -> str:
        r = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(no_path, **env),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return r.stdout.strip()

    said = hint(PYTHONPATH=str(pkg.parent))
    assert said.startswith("PYTHONPATH=other/src ") and said.endswith(
        " -m resilient_callbacks ls 'my dir'"
    ), said
    r = subprocess.run(
        ["bash", "-c", said],
        env=dict(no_path, PATH="/usr/bin:/bin"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert r.stdout.strip() == f"RAN {pkg / '__main__.py'} ['ls', 'my dir']", r.stdout + r.stderr
    # the venv's own install imported: its console script, as before
    script = Path(sys.executable).parent / "resilient-ckpt"
    if script.is_file():
        assert hint() == f"{os.path.relpath(script, tmp_path)} ls 'my dir'"


@pytest.mark.parametrize(
    ("script", "module"),
    [
        ("deepspeed_resume.py", "deepspeed"),
        ("lightning_resume.py", "lightning"),
        ("transformers_resume.py", "transformers"),
    ],
)
def test_an_example_says_what_it_needs_before_deleting_anything(tmp_path, script, module):
    """Run with the demo's set-up (the core only), an example deleted its earlier results and
    then failed: a bare AssertionError (DeepSpeed's, its cause in a rank's log) or a
    ModuleNotFoundError (a user probe, 2026-12-05). It says which set-up it needs, first."""
    out = tmp_path / "demo_output"
    (out / "keep").mkdir(parents=True)
    code = (
        f"import sys; sys.modules[{module!r}] = None; sys.argv = ['x']; import runpy; "
        f"runpy.run_path({str(EXAMPLES / script)!r}, run_name='__main__')"
    )
    # forked from the session's zygote (torch imported once); the module blocked as before
    r = spawn_ranks.run_python([sys.executable, "-c", code], cwd=tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"this example needs {module}: set up with `bash scripts/setup.sh test`" in r.stderr
    assert (out / "keep").is_dir()


def test_the_demo_refuses_arguments_that_would_break_it_or_delete_files(tmp_path):
    """--kill-at past --steps printed "killed" and crashed on a JSONDecodeError; --out named a
    folder of one's own files (``--out .``) and emptied it."""
    demo = [sys.executable, str(EXAMPLES / "demo_resume.py")]  # (forked: run_python)
    r = spawn_ranks.run_python(
        [*demo, "--out", str(tmp_path / "o"), "--steps", "20", "--kill-at", "30"]
    )
    assert r.returncode == 2 and "--kill-at must be between 1 and --steps - 1" in r.stderr
    (tmp_path / "mine.txt").write_text("x")
    r = spawn_ranks.run_python([*demo, "--out", str(tmp_path)])
    assert r.returncode == 2 and "holds other files (mine.txt)" in r.stderr, r.stderr
    assert (tmp_path / "mine.txt").exists()


@pytest.mark.slow
def test_the_demo_killed_before_its_first_checkpoint_says_it_starts_over(tmp_path):
    """``--kill-at`` before the first checkpoint said "last checkpoint taken: step 0" and marked
    the re-run's first step "resumes here, from the checkpoint of step 0": there was none.

    The kill lands at ``--kill-at`` (step 9, the last before the checkpoint of step 10) however
    late the demo's own process looks: it is stopped here (SIGSTOP, a loaded machine's
    scheduler) from the start of the run it kills until that run has gone past step 9 or
    waits at it. The demo killed the run at the step it saw when it looked (polling the log):
    step 10, after its checkpoint, or the run had finished ('killed (exit 0)')."""
    argv = [sys.executable, str(EXAMPLES / "demo_resume.py"), "--steps", "12", "--every", "10"]
    killed = tmp_path / "demo_output" / "plain" / "interrupted" / "log.jsonl"
    out = run_stalled([*argv, "--kill-at", "9", "--delay", "0.1"], tmp_path, killed, 9)
    assert (
        "killed (exit -9) after step 9; no checkpoint taken yet (the first was due at step 10)"
        in out
    ), out[-3000:]
    assert "re-run starts here, from the beginning: no checkpoint was taken" in out, out[-3000:]
    assert "step 0" not in out.replace("at step 0 (fresh)", ""), out[-3000:]
    assert "per-step losses identical: True; final weights bit-for-bit identical: True" in out
