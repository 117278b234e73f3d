"""Lightning checkpoint contents made saveable without pickle: :class:`Converter` turns paths,
enums, ``argparse.Namespace``, dataclasses, named tuples, classes and OmegaConf containers into
tensors and JSON values the core saves, and refuses anything else with an error naming its key
path, except hyper-parameters (:func:`lossy_keys`), stored as their ``repr`` with a
:class:`HparamsConversionWarning`. :mod:`.state` runs it on the ``"lightning"`` entry of each
save (and re-exports these names). Not distributed: each rank converts its own dictionary.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedStateError, warn_and_log
from ..state_marks import PerRank

log = logging.getLogger("resilient_callbacks.lightning")


def lossy_keys(*objs: Any) -> frozenset[str]:
    """The checkpoint keys of the hyper-parameters of ``objs`` (the LightningModule, the
    datamodule or ``None``): stored as ``repr`` where they cannot be saved (:class:`Converter`)."""
    names = (
        "CHECKPOINT_HYPER_PARAMS_KEY",
        "CHECKPOINT_HYPER_PARAMS_NAME",
        "CHECKPOINT_HYPER_PARAMS_TYPE",
    )
    return frozenset(
        getattr(obj, attr)
        for obj in objs
        if obj is not None
        for attr in names
        if isinstance(getattr(obj, attr, None), str)
    )


class HparamsConversionWarning(UserWarning):
    """A hyper-parameter could not be saved as it is and was stored as its ``repr`` string."""


# ----------------------------------------------------------------------------- conversion


class Converter:
    """Makes Lightning checkpoint contents saveable without pickle.

    Converted (and reported once, at INFO): ``pathlib`` paths -> ``str``, enums -> their value,
    ``argparse.Namespace`` and dataclasses -> ``dict``, named tuples -> ``dict``, classes ->
    their qualified name, OmegaConf containers -> plain containers. Tensors, NumPy arrays,
    JSON values, containers and objects with ``state_dict()`` pass through to the core.

    Anything else is an error (:class:`UnsupportedStateError` naming the key path), except under
    hyper-parameter keys (``lossy_keys``): hyper-parameters are only recorded, never needed to
    resume, so such a value is stored as its ``repr`` with a :class:`HparamsConversionWarning`.
    """

    def __init__(self) -> None:
        self._reported: set[str] = set()

    def convert(self, obj: Any, lossy_keys: frozenset[str] = frozenset()) -> Any:
        if not isinstance(obj, Mapping):
            return self._conv(obj, (), False)
        return {
            k: self._conv(v, (k,), isinstance(k, str) and k in lossy_keys) for k, v in obj.items()
        }

    def _note(self, path: tuple[Any, ...], what: str) -> None:
        key = _path(path)
        if key not in self._reported:
            self._reported.add(key)
            log.info("checkpoint[%s]: %s", key, what)

    def _conv(self, obj: Any, path: tuple[Any, ...], lossy: bool) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        if isinstance(obj, (torch.Tensor, np.ndarray, np.generic, torch.dtype, torch.device)):
            return obj
        if isinstance(obj, torch.Size):
            return obj
        if isinstance(obj, PerRank):
            return PerRank(self._conv(obj.obj, path, lossy))
        omega = _omegaconf_container(obj)
        if omega is not None:
            self._note(path, f"OmegaConf {type(obj).__name__} saved as a plain container")
            return self._conv(omega, path, lossy)
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                key = self._key(k, (*path, k), lossy)
                out[key] = self._conv(v, (*path, k), lossy)
            return out
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            self._note(path, f"named tuple {_qualname(obj)} saved as a dict")
            return {f: self._conv(getattr(obj, f), (*path, f), lossy) for f in obj._fields}
        if isinstance(obj, (list, tuple)):
            items = [self._conv(v, (*path, i), lossy) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, (set, frozenset)):
            conv = [self._conv(v, (*path, "<item>"), lossy) for v in obj]
            return set(conv) if isinstance(obj, set) else frozenset(conv)
        if isinstance(obj, pathlib.PurePath):
            self._note(path, "path saved as str")
            return str(obj)
        if isinstance(obj, enum.Enum):
            self._note(path, f"enum {_qualname(obj)} saved as its value")
            return self._conv(obj.value, path, lossy)
        if isinstance(obj, argparse.Namespace):
            self._note(path, "argparse.Namespace saved as a dict")
            return self._conv(vars(obj), path, lossy)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            self._note(path, f"dataclass {_qualname(obj)} saved as a dict")
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return self._conv(fields, path, lossy)
        if isinstance(obj, type):
            self._note(path, "class saved as its qualified name")
            return f"{obj.__module__}.{obj.__qualname__}"
        if callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            return obj  # the core saves its state_dict()
        if lossy:
            key = _path(path)
            if key not in self._reported:
                self._reported.add(key)
                msg = (
                    f"hyper-parameter checkpoint[{key}] has type {_qualname(obj)}, which cannot "
                    "be saved without pickle; it is stored as its repr() string and will not be "
                    "restored. Resuming does not need it. To keep it, pass JSON-able values to "
                    "save_hyperparameters() (or exclude it with ignore=[...])."
                )
                warn_and_log(log, msg, HparamsConversionWarning, stacklevel=2)
            return repr(obj)
        raise UnsupportedStateError(
            f"Lightning checkpoint entry checkpoint[{_path(path)}] has type {_qualname(obj)}, "
            "which cannot be saved without pickle. It comes from a callback's state_dict(), a "
            "datamodule's state_dict() or an on_save_checkpoint() hook: make it return tensors "
            "and JSON-able values (dict, list, tuple, str, int, float, bool, None), or an "
            "object with state_dict()/load_state_dict()."
        )

    def _key(self, k: Any, path: tuple[Any, ...], lossy: bool) -> Any:
        if k is None or isinstance(k, (bool, int, float, str, tuple)):
            return k
        if isinstance(k, (pathlib.PurePath, enum.Enum, type)):
            conv = self._conv(k, path, lossy)
            return conv if isinstance(conv, (str, int, float, bool)) else str(conv)
        if lossy:
            return repr(k)
        raise UnsupportedStateError(
            f"Lightning checkpoint entry checkpoint[{_path(path[:-1])}] has a key of type "
            f"{_qualname(k)}; only str, int, float, bool, None and tuples can be saved"
        )


def _omegaconf_container(obj: Any) -> Any:
    mod = type(obj).__module__
    if not mod.startswith("omegaconf"):
        return None
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # pragma: no cover
        return None
    if isinstance(obj, Container):
        return OmegaConf.to_container(obj, resolve=True)
    return None


def _qualname(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _path(path: tuple[Any, ...]) -> str:
    return "][".join(repr(p) for p in path) if path else ""
