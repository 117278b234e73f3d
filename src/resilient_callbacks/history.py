"""The run's own history in its checkpoint directory: starts and restarts, with their times.

Every restore that resumes from a checkpoint is a failure event (the run stopped before it
finished); the adaptive save policy learns the mean time between failures from these.
``<dirpath>/history.jsonl`` holds one JSON object per line, appended by the coordinator only:
``{"event": "start" | "restart", "time": <unix seconds>, "step": N, "run_id": "...",
"world_size": W}``. A torn last line (a crash while appending) is ignored.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

HISTORY_NAME = "history.jsonl"


@dataclass(frozen=True)
class Event:
    event: str
    time: float
    step: int
    run_id: str | None
    world_size: int


def append(root: str, event: str, step: int, run_id: str | None, world_size: int) -> None:
    rec = {
        "event": event,
        "time": time.time(),
        "step": step,
        "run_id": run_id,
        "world_size": world_size,
    }
    with open(os.path.join(root, HISTORY_NAME), "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read(root: str) -> list[Event]:
    try:
        with open(os.path.join(root, HISTORY_NAME)) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            d: dict[str, Any] = json.loads(line)
            out.append(
                Event(
                    str(d["event"]),
                    float(d["time"]),
                    int(d.get("step", 0)),
                    d.get("run_id"),
                    int(d.get("world_size", 1)),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue  # torn or foreign line
    return out


def failures(events: list[Event], run_id: str | None) -> tuple[float | None, list[float]]:
    """(time the run started, times of its restarts) for the lineage ``run_id``."""
    mine = [e for e in events if run_id is None or e.run_id in (run_id, None)]
    start = next((e.time for e in mine if e.event == "start"), None)
    restarts = [e.time for e in mine if e.event == "restart"]
    if start is None and mine:
        start = mine[0].time
    return start, restarts
