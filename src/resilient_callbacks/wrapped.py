"""Wrapped modules: what is saved for a model inside ``torch.compile``'s wrapper or (Distributed)
DataParallel, and how a module's saved keys are matched with a live module wrapped otherwise.

A checkpoint holds the module a wrapper wraps (:func:`plain_module`), so a run may turn compiling
or DDP on or off between restarts. What a restore still has to match (:func:`unwrapped_keys`):
a state dict saved *from* a wrapper (by versions before that), and a submodule compiled on its
own (``model.encoder = torch.compile(model.encoder)``, or an ``AveragedModel`` of a compiled
model), whose keys carry ``_orig_mod.`` inside (``encoder._orig_mod.fc.weight``) on one side
and not on the other.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

from .rng import GeneratorState

WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's and (Distributed)DataParallel's
_COMPILED = re.compile(r"(?:^|(?<=\.))_orig_mod\.")  # torch.compile's segment, at any depth


def plain_module(obj: Any) -> Any:
    """What is saved and loaded for ``obj``: the module a wrapper wraps (``torch.compile``'s,
    ``DistributedDataParallel``, ``DataParallel``), so a checkpoint of a compiled or DDP run
    loads into a plain module (an evaluation, a run on one process) and the other way; a
    :class:`GeneratorState` for a ``torch.Generator``; else ``obj``."""
    if isinstance(obj, torch.Generator):
        return GeneratorState(obj)
    while isinstance(obj, torch.nn.Module):
        inner = getattr(obj, "_orig_mod", None) if _is_compiled(obj) else None
        if not isinstance(inner, torch.nn.Module) and isinstance(
            obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
        ):
            inner = obj.module
        if not isinstance(inner, torch.nn.Module):
            return obj
        obj = inner
    return obj


def _is_compiled(obj: Any) -> bool:
    """Whether ``obj`` is torch.compile's wrapper (``OptimizedModule``), not a user's module
    with a child named ``_orig_mod`` (whose other children a checkpoint would leave out)."""
    return any(
        c.__name__ == "OptimizedModule" and c.__module__.startswith("torch._dynamo")
        for c in type(obj).__mro__
    )


def unwrapped_keys(sd: Mapping[str, Any], live: Collection[str]) -> Mapping[str, Any]:
    """A module's state dict with its keys as the live module (keys ``live``) names them: without
    the wrappers' key prefixes where every key has one and none is a live key (a wrapper saved
    by earlier versions); then each key that is not a live key but is one once torch.compile's
    ``_orig_mod.`` segments are left out of both (a submodule compiled in one run and not in
    the other) renamed to that live key. Keys that stay unmatched are left for the caller's
    check to name."""
    live = set(live)
    while sd and not live & set(sd):
        prefix = next((p for p in WRAPPER_PREFIXES if all(str(k).startswith(p) for k in sd)), None)
        if prefix is None:
            break
        sd = with_metadata(sd, {str(k)[len(prefix) :]: v for k, v in sd.items()}, prefix)
    return with_metadata(sd, _compiled_inside(sd, live))


def with_metadata(src: Mapping[str, Any], dst: Mapping[str, Any], strip: str = "") -> Any:
    """``dst`` (``src`` with other keys or values) with ``src``'s ``_metadata`` (the submodules'
    versions, :mod:`.module_versions`), its prefixes without ``strip`` (a wrapper's key prefix
    left out of the keys)."""
    meta = getattr(src, "_metadata", None)
    if meta is None or dst is src:
        return dst
    out = collections.OrderedDict(dst)
    if strip:
        bare = strip.rstrip(".")
        meta = collections.OrderedDict(
            ("" if p == bare else p[len(strip) :], m)
            for p, m in meta.items()
            if p == bare or p.startswith(strip)
        )
    out._metadata = meta  # type: ignore[attr-defined]
    return out


def _compiled_inside(sd: Mapping[str, Any], live: set[str]) -> Mapping[str, Any]:
    if all(k in live for k in sd) or not any("_orig_mod." in str(k) for k in (*sd, *live)):
        return sd
    by_plain: dict[str, list[str]] = {}
    for k in live:
        by_plain.setdefault(_COMPILED.sub("", k), []).append(k)
    out: dict[str, Any] = {}
    for k, v in sd.items():
        name = by_plain.get(_COMPILED.sub("", str(k)), [])
        to = name[0] if k not in live and len(name) == 1 and name[0] not in sd else k
        if to in out:  # two saved keys for one live key: leave all as saved
            return sd
        out[to] = v
    return out


def plain_name(key: str) -> str:
    """``key`` without torch.compile's ``_orig_mod.`` segments: one name for a parameter of a
    submodule compiled in one run and not in another."""
    return _COMPILED.sub("", key)
