"""Wall time of each ``resilient-ckpt`` command on a small checkpoint, and whether it imports torch.

    python benchmarks/bench_cli_startup.py [--reps 5] [--src DIR] [--src-before DIR]

Writes a small run (a ``Linear(4, 3)``, three saves, keep_last=2) with the library, pushes it
to a local ``file://`` store, then runs every command as a user runs it (the ``resilient-ckpt``
executable of this Python, ``--src`` put first on ``PYTHONPATH``), ``--reps`` times each, the
commands in turn; prints the median and the fastest time of each. With ``--src-before`` (the
``src`` of an earlier checkout, e.g. a ``git worktree`` of the commit before a change) the same
commands are timed with that code too, in the same rounds, side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import med

HERE = os.path.dirname(os.path.abspath(__file__))
EXE = os.path.join(os.path.dirname(sys.executable), "resilient-ckpt")


def make_run(root: str, src: str) -> None:
    code = (
        "import torch\nfrom resilient_callbacks import Checkpointer\n"
        "torch.manual_seed(0)\nm = torch.nn.Linear(4, 3)\n"
        f"with Checkpointer({root!r}, keep_last=2) as ck:\n"
        "    for s in (10, 20, 30):\n"
        "        ck.save(s, {'model': m, 'extra': {'epoch': 1}}, metrics={'loss': 1.0 / s})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(src))


def _env(src: str, profile: bool = False) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": src}
    if profile:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    return env


def commands(work: str) -> list[tuple[str, list[str]]]:
    ck, url = os.path.join(work, "ck"), "file://" + os.path.join(work, "remote")
    return [
        ("--help", ["--help"]),
        ("ls DIR", ["ls", ck]),
        ("verify DIR", ["verify", ck]),
        ("gc DIR --dry-run", ["gc", ck, "--dry-run"]),
        ("push DIR URL", ["push", ck, url]),
        ("pull URL DIR2", ["pull", url, os.path.join(work, "pulled")]),
        ("inspect DIR", ["inspect", ck]),
        ("export DIR OUT", ["export", ck, os.path.join(work, "out"), "--force"]),
    ]


def run_once(args: list[str], src: str) -> float:
    t = time.perf_counter()
    subprocess.run([EXE, *args], check=True, env=_env(src), capture_output=True)
    return time.perf_counter() - t


def imports_torch(args: list[str], src: str) -> bool:
    r = subprocess.run([EXE, *args], env=_env(src, True), capture_output=True, text=True)
    return any(line.split("|")[-1].strip() == "torch" for line in r.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--src", default=os.path.join(os.path.dirname(HERE), "src"))
    ap.add_argument("--src-before", help="an earlier checkout's src, timed side by side")
    a = ap.parse_args()
    srcs = {"after": os.path.abspath(a.src)}
    if a.src_before:
        srcs = {"before": os.path.abspath(a.src_before), **srcs}
    work = tempfile.mkdtemp(prefix="bench-cli-")
    try:
        make_run(os.path.join(work, "ck"), srcs["after"])
        cmds = commands(work)
        subprocess.run([EXE, *cmds[4][1]], check=True, env=_env(srcs["after"]))  # the store
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(a.reps):
            for name, args in cmds:
                for which, src in srcs.items():
                    shutil.rmtree(os.path.join(work, "pulled"), ignore_errors=True)
                    times.setdefault((name, which), []).append(run_once(args, src))
        head = "".join(f" | {w} median (min) s | {w} imports torch" for w in srcs)
        print(f"| command{head} |")
        print("|---" * (1 + 2 * len(srcs)) + "|")
        for name, args in cmds:
            cells = ""
            for which, src in srcs.items():
                ts = times[(name, which)]
                shutil.rmtree(os.path.join(work, "pulled"), ignore_errors=True)
                torch = "yes" if imports_torch(args, src) else "no"
                cells += f" | {med(ts):.2f} ({min(ts):.2f}) | {torch}"
            print(f"| `resilient-ckpt {name}`{cells} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
