"""A data collator's own random generator: found, read, set and written as plain JSON values.

``DataCollatorForLanguageModeling(..., seed=s)`` (and its subclasses: whole-word masking, SOP)
draws its masks from a generator of its own, a ``torch.Generator`` (``np.random.Generator``
with ``return_tensors="np"``) it creates at its first call in the main process. No snapshot of
the global random streams holds it: the Transformers adapter saves it with every checkpoint
(its state at the save, and the one the batch fetched ahead of the save was collated from,
:mod:`.data`), and a resumed run gives it back. Nothing here draws a random number.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch


def holder(collate_fn: Any) -> Any:
    """The collator with a ``generator`` attribute of its own (``None`` until its first call),
    or None; looks through the Trainer's ``RemoveColumnsCollator`` (``.data_collator``)."""
    for obj in (collate_fn, getattr(collate_fn, "data_collator", None)):
        g = getattr(obj, "generator", False)
        if g is None or isinstance(g, (torch.Generator, np.random.Generator)):
            return obj
    return None


def get(collator: Any) -> Any:
    """The state of ``collator``'s generator: a byte tensor, a NumPy bit generator's state
    (a dict), or None (not created yet)."""
    g = collator.generator
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    return None


def put(collator: Any, state: Any) -> None:
    """Give ``collator``'s generator ``state`` (from :func:`get`); None leaves it to be created
    from the collator's seed at its next call, as it was at that point."""
    if state is None:
        collator.generator = None
    elif isinstance(state, torch.Tensor):
        g = collator.generator
        if not isinstance(g, torch.Generator):
            g = collator.generator = torch.Generator()
        g.set_state(state.clone())
    else:
        g = collator.generator
        if not isinstance(g, np.random.Generator):
            bits = getattr(np.random, str(state.get("bit_generator", "PCG64")))
            g = collator.generator = np.random.Generator(bits())
        g.bit_generator.state = state


def encode(state: Any) -> dict[str, Any]:
    """:func:`get`'s value as plain JSON values (no pickle)."""
    if isinstance(state, torch.Tensor):
        return {"torch": b64(state)}
    if isinstance(state, dict):  # a NumPy bit generator's (its integers exceed 64 bits)
        return {"numpy": json.dumps(state)}
    return {}


def decode(saved: dict[str, Any]) -> Any:
    if saved.get("torch"):
        return from_b64(saved["torch"])
    if saved.get("numpy"):
        return json.loads(saved["numpy"])
    return None


def b64(t: torch.Tensor) -> str:
    """A CPU byte tensor (a generator's state) as base64 text, for a JSON value."""
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def from_b64(text: str) -> torch.Tensor:
    """:func:`b64`'s tensor back."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
