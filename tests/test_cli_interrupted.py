"""The CLI stopped part-way, as a user stops it (Ctrl-C, SIGINT) or a node kills it (SIGKILL):
what it leaves behind is consistent. Real processes, real signals."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap

from test_cli import flip_byte, make_run

ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(["src", "tests", os.environ.get("PYTHONPATH", "")]),
}


def _sigint_default() -> None:
    """In the child before it starts: SIGINT as a terminal gives it. A suite started in the
    background of a non-interactive shell ignores SIGINT, and its children inherit that (their
    Ctrl-C would be ignored, as the CLI rightly leaves an ignored SIGINT alone)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_gc_killed_mid_way_never_leaves_latest_naming_a_deleted_checkpoint(tmp_path):
    """``gc --remove-corrupt`` killed (SIGKILL) right after it deleted the corrupt newest
    checkpoint (and the corrupt one before it): the advisory ``latest`` file still named it (gc re-pointed it only after every
    deletion). It is re-pointed before anything is deleted now."""
    root = tmp_path / "ck"
    make_run(str(root), steps=(10, 20, 30), keep_last=None)
    assert (root / "latest").read_text().strip() == "step_000000030"
    flip_byte(str(root / "step_000000030" / "shared.safetensors"))
    flip_byte(str(root / "step_000000020" / "shared.safetensors"))
    script = textwrap.dedent(
        """
        import os, signal, sys
        from resilient_callbacks import cli, cli_local
        real = cli_local.remove_checkpoint
        def remove_then_die(path, *a, **k):
            real(path, *a, **k)
            if path.endswith("step_000000030"):  # the one latest names: deleted, then killed
                os.kill(os.getpid(), signal.SIGKILL)
        cli_local.remove_checkpoint = remove_then_die
        sys.exit(cli.main(["gc", sys.argv[1], "--remove-corrupt"]))
        """
    )
    r = subprocess.run([sys.executable, "-c", script, str(root)], env=ENV, timeout=120)
    assert r.returncode == -signal.SIGKILL
    left = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert left == ["step_000000010"]
    assert (root / "latest").read_text().strip() == "step_000000010"


def test_ls_json_interrupted_while_printing_prints_whole_json_and_exits_130(tmp_path):
    """``ls --json`` piped into a reader that is slower than it, Ctrl-C while it prints: the
    reader got cut-off JSON (the rest of the write was dropped). It finishes printing (the
    reader gets valid JSON), then says it was interrupted and exits 130."""
    root = tmp_path / "ck"
    make_run(str(root), steps=tuple(range(1, 21)), keep_last=None)  # ~8 KB of JSON
    # a pipe of one page (F_SETPIPE_SZ), made so before the child starts: set after it, a
    # child that ran ahead of this process could have written everything into a larger pipe
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "resilient_callbacks", "ls", str(root), "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=ENV,
            preexec_fn=_sigint_default,
        )
    finally:
        os.close(write_end)
    assert p.stderr is not None
    with os.fdopen(read_end, "rb") as stdout:
        first = stdout.read(1)  # printing began; the rest does not fit the pipe: it waits
        p.send_signal(signal.SIGINT)
        rest = stdout.read()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 130, err
    rows = json.loads(first + rest)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert "interrupted" in err and "Traceback" not in err, err


_SWALLOWS_CTRL_C = """
import importlib.abc, os, signal, sys, time

class SwallowsCtrlC(importlib.abc.MetaPathFinder):  # as torch's import of numpy
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # (the handler runs at once)
            except BaseException:
                pass
        return None

sys.meta_path.insert(0, SwallowsCtrlC())
from resilient_callbacks import cli
rc = cli.main(sys.argv[1:])
print("torch imported" if "torch" in sys.modules else "no torch", file=sys.stderr)
sys.exit(rc)
"""


def test_ctrl_c_while_torch_imports_stops_export_before_it_writes(tmp_path):
    """A Ctrl-C in the second the CLI imports torch was lost: torch's import loads numpy from
    C and clears whatever error that raised, a KeyboardInterrupt too, so the command went on
    (a gc deleted, an export wrote), exit 0. Only the commands that handle tensors import torch
    now, when they reach that point; here the import of torch swallows a real SIGINT as torch
    does; export must stop before it writes anything, exit 130."""
    root, out = tmp_path / "ck", tmp_path / "out"
    make_run(str(root), steps=(10, 20, 30), keep_last=None)
    r = subprocess.run(
        [sys.executable, "-c", _SWALLOWS_CTRL_C, "export", str(root), str(out)], env=ENV,
        capture_output=True, text=True, timeout=120, preexec_fn=_sigint_default,
    )  # fmt: skip
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert "interrupted" in r.stderr and not out.exists(), r.stderr


def test_gc_imports_no_torch_so_no_ctrl_c_is_swallowed(tmp_path):
    """gc, which deleted after a swallowed Ctrl-C, needs no torch at all now: the finder that
    would swallow one is never asked for torch, and gc does its work, exit 0."""
    root = tmp_path / "ck"
    make_run(str(root), steps=(10, 20, 30), keep_last=None)
    r = subprocess.run(
        [sys.executable, "-c", _SWALLOWS_CTRL_C, "gc", str(root), "--keep-last", "1"], env=ENV,
        capture_output=True, text=True, timeout=120, preexec_fn=_sigint_default,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "no torch" in r.stderr, r.stderr
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000000030"]
