"""Capture and restore every random number generator a training step can touch, without pickle.

Python's ``random``, NumPy's global legacy generator, torch's CPU generator and, when CUDA is
initialized, every CUDA device's generator. States become JSON values and uint8 tensors. Each
rank saves its own generators (they differ between ranks) into its own file.

A ``torch.Generator`` the state holds (a ``DataLoader``'s, say) is saved as a stateful object,
:class:`GeneratorState`.
"""

from __future__ import annotations

import logging
import random
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from . import notices
from .global_rngs import preserved

log = logging.getLogger(__name__)


def capture() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    kind, keys, pos, has_gauss, cached = np_state
    info: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cuda_devices": 0,
    }
    tensors = {
        "@rng/numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        "@rng/torch_cpu": torch.get_rng_state().clone(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        info["cuda_devices"] = len(states)
        for i, s in enumerate(states):
            tensors[f"@rng/cuda_{i}"] = s.cpu().clone()
    return info, tensors


def restore(info: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[str]:
    """Restore the generators; returns warnings for states that could not be applied (this
    rank's: each names it). A Checkpointer's restore says what :func:`replacing` finds once
    every rank's restore succeeded."""
    warnings: list[str] = []
    py = info["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npi = info["numpy"]
    keys = tensors["@rng/numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((npi["kind"], keys, npi["pos"], npi["has_gauss"], npi["cached_gaussian"]))
    torch.set_rng_state(tensors["@rng/torch_cpu"].to(torch.uint8).clone())
    n = int(info.get("cuda_devices", 0))
    if n:
        if torch.cuda.is_available() and torch.cuda.device_count() == n:
            torch.cuda.set_rng_state_all([tensors[f"@rng/cuda_{i}"].clone() for i in range(n)])
        else:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            warnings.append(  # (the devices this rank sees: said by the rank, naming it)
                notices.on_this_rank(
                    f"the checkpoint holds RNG states of {n} CUDA device(s) but {have} are "
                    "visible; CUDA random streams are not restored"
                )
            )
    return warnings


def restore_saved(
    info: dict[str, Any] | None, tensors: dict[str, torch.Tensor], rank: int, saved_world_size: int
) -> tuple[list[str], list[str]]:
    """A Checkpointer's restore (``capture_rng``): this rank's generators from the states of
    its part of the checkpoint (``info``; None: it holds none). Returns this rank's warnings
    (each naming it) and the notices the same on every rank, for rank 0 to say once."""
    if info is not None:
        return restore(info, tensors), []
    if rank >= saved_world_size:
        return [
            f"rank {rank} has no RNG state in this checkpoint (written by {saved_world_size} "
            "rank(s)); its random streams start fresh"
        ], []
    return [], [
        "the checkpoint was saved without RNG states (capture_rng=False); random streams are "
        "not restored"
    ]


# the RNG states this process's restores set: the Checkpointer (weakly) -> its dirpath, step
_restored_by: weakref.WeakKeyDictionary[Any, tuple[str, int]] = weakref.WeakKeyDictionary()


def replacing(owner: Any, where: str, step: int) -> list[str]:
    """Every rank, once the ranks agreed that ``owner``'s restore succeeded (its RNG states
    are set from its checkpoint of ``step``): record that; a warning, to say once on rank 0
    (the same on every rank), when another open Checkpointer set them from another step
    before (two of one loop, a model's and an EMA's, killed between their saves of one step):
    the random streams then continue from this step, and the run does not continue exactly.
    (Said after the ranks compared their restores: one that failed on a rank replaced nothing.)"""
    others = [
        (w, s)
        for o, (w, s) in list(_restored_by.items())
        if o is not owner and not getattr(o, "_closed", True) and s != step
    ]
    _restored_by[owner] = (where, step)
    return [
        f"the RNG states restored from step {step} of {where} replace those restored from "
        f"step {s} of {w} by another Checkpointer of this process (each captures the "
        "process's random streams): the run continues with the streams of step "
        f"{step}, not exactly. Let one Checkpointer capture them (capture_rng=False for the "
        "others, e.g. an EMA's), and resume both at the same step (one Checkpointer over one "
        "state holding both, or resume=<step> for the other)"
        for w, s in others[:1]
    ]


def check(info: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Raise (``KeyError``, ``TypeError``, ``ValueError``, ...) where :func:`restore` could not
    apply these states, before anything is restored; the generators are left as they are."""
    if not isinstance(info, dict):
        raise TypeError(f"RNG states: a mapping expected, got {type(info).__name__}")
    with preserved():
        restore({**info, "cuda_devices": 0}, tensors)
    for i in range(int(info.get("cuda_devices", 0))):
        t = tensors[f"@rng/cuda_{i}"]
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise ValueError(f"CUDA RNG state {i}: {t.dtype} of shape {list(t.shape)}")


class GeneratorState:
    """A ``torch.Generator`` as a stateful object: its state (``get_state()``, a byte tensor)
    and its device. Loaded with ``set_state`` into the live generator, which a ``DataLoader`` or
    the training loop holds; a generator's state loads only into one of its device type."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"device": str(self.generator.device), "state": self.generator.get_state()}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        saved, here = torch.device(sd["device"]).type, self.generator.device.type
        if saved != here:
            raise ValueError(
                f"the checkpoint holds a {saved} generator's state; this one is {here}"
            )
        self.generator.set_state(sd["state"])
