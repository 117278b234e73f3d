"""Not a test module. With this folder on ``PYTHONPATH`` and ``RC_HOLD_AT_STEP=N`` set, every
Checkpointer of a Python process waits, once its ``step(N)`` returned, until a preemption signal
arrives (a SIGKILL ends the wait too): a test's signal then lands at step N however loaded the
machine, in a training script the test does not change (integrations/train.py). No signal in
300 s: exit 3. Without ``RC_HOLD_AT_STEP`` it does nothing."""

from __future__ import annotations

import os

if os.environ.get("RC_HOLD_AT_STEP"):
    import sys
    import time
    from typing import Any

    from resilient_callbacks import checkpointer as _checkpointer

    _AT = int(os.environ["RC_HOLD_AT_STEP"])
    _step = _checkpointer.Checkpointer.step

    def _held_step(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        out = _step(self, step, *args, **kwargs)
        if step == _AT:
            print(f"HOLD at step {step}", file=sys.stderr, flush=True)
            if self.watcher is not None:
                got = self.watcher.wait(300)
            else:  # no preemption handling: only a SIGKILL ends the wait
                time.sleep(300)
                got = False
            if not got:
                print(f"HOLD at step {step}: no signal in 300 s", file=sys.stderr, flush=True)
                sys.exit(3)
        return out

    _checkpointer.Checkpointer.step = _held_step  # type: ignore[method-assign]
