"""A small plain-loop training run for the monitoring tests: ``Checkpointer(telemetry=...)``,
restore, train, save every ``--every`` steps, and optionally SIGKILL itself at ``--kill-at``.

    python tests/monitor_train.py DIR --steps 40 --every 5 [--kill-at 23] [--telemetry SPEC ...]
        [--sleep 0.02] [--mlflow-uri URI] [--log-checkpoint final] [--register-model NAME]

Prints ``RESTORED <step>`` and ``DONE <step>``; writes ``<DIR>/../metrics_<pid>.json`` (the last
``Checkpointer.metrics()``) when it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

from resilient_callbacks import Checkpointer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--telemetry", action="append", default=[])
    ap.add_argument("--sleep", type=float, default=0.02)
    ap.add_argument("--mlflow-uri", default=None)
    ap.add_argument("--log-checkpoint", default=None)
    ap.add_argument("--register-model", default=None)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()
    sinks: list = list(args.telemetry)
    if args.mlflow_uri:
        sinks.append(
            {
                "kind": "mlflow",
                "tracking_uri": args.mlflow_uri,
                "experiment": "monitoring-test",
                "log_checkpoint": args.log_checkpoint,
                "register_model": args.register_model,
            }
        )
    torch.manual_seed(0)
    model = torch.nn.Linear(args.width, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt}
    with Checkpointer(
        args.dir, every_n_steps=args.every, keep_last=3, telemetry=sinks or None
    ) as ck:
        start = ck.restore(state)
        print(f"RESTORED {start}", flush=True)
        for step in range(start + 1, args.steps + 1):
            loss = model(torch.randn(8, args.width)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(args.sleep)
            ck.step(step, state, {"loss": float(loss)}, final=step == args.steps)
            if step == args.kill_at:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        values = ck.metrics()
    out = os.path.join(os.path.dirname(os.path.abspath(args.dir)), f"metrics_{os.getpid()}.json")
    with open(out, "w") as f:
        json.dump(values, f)
    print(f"DONE {args.steps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
