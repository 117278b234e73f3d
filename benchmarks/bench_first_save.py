"""The first background save's blocking time, with the host buffers allocated ahead (default)
and without (the buffers made by the first save on the training thread), in one run.

    .venv/bin/python benchmarks/bench_first_save.py [--mb 1536] [--rounds 3] [--step-seconds 1.0]

Per round and mode, in a fresh process: the MLP + AdamW state of ``bench_async.py`` (about
``--mb`` MB), ``Checkpointer(every_n_steps=5)``, five ``step()`` calls ``--step-seconds`` apart
(sleeping, standing in for training steps that leave the helper thread a core), and the
training-thread blocking of the save at step 5 (``ck.blocking_seconds``). Also the ``copy_``
floor: a ``copy_`` of the same tensors into buffers allocated and touched beforehand. Medians;
the ratio ahead / not-ahead is the figure. Writes ``bench_first_save.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from bench_async import build_state, state_tensors
from common import library_version, med, write_results

from resilient_callbacks import Checkpointer


def worker(mode: str, mb: int, step_seconds: float) -> dict[str, float]:
    model, opt = build_state(mb)
    state = {"model": model, "optimizer": opt}
    if mode == "floor":
        tensors = state_tensors(model, opt)
        bufs = [torch.empty_like(t) for t in tensors]
        for b in bufs:
            b.zero_()
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t)
        return {"blocking": time.perf_counter() - t0}
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(os.path.join(d, "ck"), every_n_steps=5, keep_last=1)
        if mode == "not_ahead":
            ck._saver.allocated_ahead = True  # as before: the first save allocates the buffers
        for step in range(1, 6):
            time.sleep(step_seconds)
            ck.step(step, state)
        blocking = ck.blocking_seconds[-1]
        ck.close()
    return {"blocking": blocking}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-seconds", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.mb, a.step_seconds)))
        return 0
    modes = ["ahead", "not_ahead", "floor"]
    got: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.rounds):
        for m in modes:
            cmd = [sys.executable, __file__, "--worker", m, "--mb", str(a.mb)]
            cmd += ["--step-seconds", str(a.step_seconds)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got[m].append(json.loads(out.strip().splitlines()[-1])["blocking"])
            print(f"{m}: {got[m][-1]:.3f} s", flush=True)
    m = {k: med(v) for k, v in got.items()}
    report = {
        "mb": a.mb,
        "rounds": a.rounds,
        "library": library_version(),
        "raw": got,
        "median": m,
        "ratio_ahead_vs_not": m["ahead"] / m["not_ahead"],
        "ratio_ahead_vs_floor": m["ahead"] / m["floor"],
    }
    md = (
        f"# First background save, {a.mb} MB, medians of {a.rounds} (library {report['library']})\n\n"
        "| mode | blocking (s) |\n|---|---|\n"
        + "".join(f"| {k} | {v:.3f} |\n" for k, v in m.items())
        + f"\nahead / not ahead: {report['ratio_ahead_vs_not']:.2f}; "
        f"ahead / copy_ floor: {report['ratio_ahead_vs_floor']:.2f}\n"
    )
    write_results(a.out, "bench_first_save", report, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
