"""The versions (``_version``) of a module's submodules: recorded at a save, given to
``load_state_dict`` at a restore.

A module reads a state dict by the version of the code that wrote it: ``state_dict()`` keeps
each submodule's ``_version`` in the ``_metadata`` attribute of the dict it returns (``torch.save``
pickles it with the dict), and ``_load_from_state_dict`` gets it as
``local_metadata["version"]``, to upgrade an older layout (BatchNorm's version 1 had no
``num_batches_tracked``; a user's module of version 2 renames the keys of version 1). Without
it a module takes the state dict for its oldest layout (a torch.ao observer then replaces its
saved ``eps`` with the default; a float16 dynamic-quantized ``Linear`` fails).

A checkpoint records them (:func:`recorded`, the ``"versions"`` of a module's node: ``{prefix:
version}``); a restore passes them (:func:`merged`), so a module whose version changed between
the save and the restore (another torch, a user's module of a new version) upgrades the saved
entries as it would from ``torch.load``. A checkpoint written before they were recorded gets
the live module's versions: it was written by the same code. Which ranks call what: nothing
here communicates.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from .wrapped import plain_name

FIELD = "versions"
"""The key of a module's node in the structure (``shared.json``) that holds the versions."""


def recorded(sd: Any) -> dict[str, int | None] | None:
    """``{prefix: version}`` of the submodules of a ``state_dict()`` result (its ``_metadata``);
    ``None`` where it has none (not a module's, or a module of its own ``state_dict``)."""
    meta = getattr(sd, "_metadata", None)
    if not isinstance(meta, Mapping):
        return None
    out: dict[str, int | None] = {}
    for prefix, local in meta.items():
        if isinstance(prefix, str) and isinstance(local, Mapping) and "version" in local:
            v = local["version"]
            if v is None or (isinstance(v, int) and not isinstance(v, bool)):
                out[prefix] = v
    return out


def attach(value: Any, node: Any, live: Mapping[str, int | None] | None = None) -> Any:
    """``value`` -- a module's decoded state dict -- carrying the versions of its structure
    ``node`` as ``_metadata`` (as ``torch.load`` gives it). With ``live`` (the live module's
    :func:`recorded`, for a caller that loads without :func:`merged`): under the live module's
    names (:func:`merged`: a submodule compiled in one run only), and where the node recorded
    none (a checkpoint written before they were), the live ones (the same code wrote it).
    ``value`` itself where there are none."""
    versions = node.get(FIELD) if isinstance(node, Mapping) else None
    if isinstance(versions, Mapping) and isinstance(live, Mapping):
        meta = merged(_carrying(versions), _carrying(live))
        versions = {p: m.get("version") for p, m in meta.items()}
    versions = live if versions is None else versions
    if not isinstance(versions, Mapping) or not isinstance(value, Mapping):
        return value
    return _carrying(versions, value)


def _carrying(versions: Mapping[str, int | None], value: Mapping[str, Any] | None = None) -> Any:
    """``value``'s items in a dict whose ``_metadata`` holds ``versions``."""
    out = collections.OrderedDict(value or {})
    out._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
        (p, {"version": v}) for p, v in versions.items()
    )
    return out


def merged(saved: Any, live: Any) -> Any:
    """The ``_metadata`` to load by: the live module's (``live``, its ``state_dict()``'s), each
    submodule's version replaced by the saved one (``saved``, the decoded state dict's
    ``_metadata``; by its name, or by its name without torch.compile's ``_orig_mod``: a
    submodule compiled in one run only; torch.compile's wrapper keeps its own, unless it was
    compiled when saved too). Fresh dicts: ``load_state_dict`` writes into them. ``None``
    where the live module has none."""
    live_meta = getattr(live, "_metadata", None)
    if live_meta is None:
        return None
    saved_meta = getattr(saved, "_metadata", None)
    saved_meta = saved_meta if isinstance(saved_meta, Mapping) else {}
    # torch.compile's wrappers' own entries hold the wrapper's version, not the module's
    wrappers = _wrappers(saved_meta)
    real = {p: m for p, m in saved_meta.items() if isinstance(p, str) and p not in wrappers}
    by_plain = {_plain(p): m for p, m in real.items()}
    live_wrappers = _wrappers(live_meta)
    out = collections.OrderedDict()
    for prefix, local in live_meta.items():
        local = dict(local)
        if prefix in live_wrappers:  # its own version, or the saved wrapper's (both compiled)
            found = saved_meta.get(prefix) if prefix in wrappers else None
        else:
            found = real.get(prefix, by_plain.get(_plain(prefix)))
        if isinstance(found, Mapping) and "version" in found:
            local["version"] = found["version"]
        out[prefix] = local
    return out


def _wrappers(meta: Mapping[Any, Any]) -> set[str]:
    """The prefixes of torch.compile's wrappers (``OptimizedModule``) in a ``_metadata``: those
    with a child ``_orig_mod``, the module compiled, whose version is the one that counts."""
    return {
        p for p in meta if isinstance(p, str) and (f"{p}._orig_mod" if p else "_orig_mod") in meta
    }


def upgraded(saved: Any, live: Any) -> list[str]:
    """The prefixes of the submodules whose saved version differs from the live one: their
    loading code may upgrade the saved entries (rename keys, reshape), so a check by name
    and shape before loading leaves the entries under them to it."""
    meta = merged(saved, live)
    live_meta = getattr(live, "_metadata", None)
    if meta is None or live_meta is None or getattr(saved, "_metadata", None) is None:
        return []
    return [p for p, m in meta.items() if m.get("version") != live_meta[p].get("version")]


def under(key: str, prefixes: list[str]) -> bool:
    """Whether ``key`` (a state dict's, torch.compile's ``_orig_mod.`` left out or not) is an
    entry of one of the submodules ``prefixes`` (:func:`upgraded`)."""
    names = (key, plain_name(key))
    return any(
        p == "" or n.startswith(_plain(p) + ".") or n.startswith(p + ".")
        for p in prefixes
        for n in names
    )


def _plain(prefix: str) -> str:
    """A submodule's prefix without torch.compile's ``_orig_mod`` segments."""
    return plain_name(prefix + ".")[:-1] if prefix else ""
