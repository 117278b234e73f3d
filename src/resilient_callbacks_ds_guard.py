"""Warn when a DeepSpeed config with a ``"resilient_checkpoint"`` section reaches plain
``deepspeed.initialize``: nothing would be checkpointed by resilient_callbacks, and silence
would let a user believe otherwise.

Installed as ``resilient_callbacks_ds_guard.pth`` so it runs at interpreter start-up. It costs
one entry on ``sys.meta_path`` that answers only for the name ``deepspeed``: it imports nothing
(no torch, no DeepSpeed) until the program itself imports DeepSpeed; then it wraps
``deepspeed.initialize`` once. ``RESILIENT_CALLBACKS_NO_DS_GUARD=1`` turns it off.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

SECTION = "resilient_checkpoint"
ENV_OFF = "RESILIENT_CALLBACKS_NO_DS_GUARD"


class SectionIgnoredWarning(UserWarning):
    """A ``"resilient_checkpoint"`` section reached plain ``deepspeed.initialize``."""


_claims: list[str] = []  # adapters in this process that read the section after initialize
_taken: list[dict[str, Any]] = []  # sections removed from configs on their behalf


def claim(adapter: str) -> None:
    """An adapter that reads the section itself, after ``deepspeed.initialize`` (the Hugging Face
    Trainer callback) says so: from then on a section in a config *dict* reaching
    ``deepspeed.initialize`` is removed from that dict in place (DeepSpeed never logs it or
    writes it into a checkpoint) and kept for :func:`take`, without a warning."""
    if adapter not in _claims:
        _claims.append(adapter)


def claimed() -> bool:
    """Whether an adapter in this process reads the section itself (see :func:`claim`)."""
    return bool(_claims)


def take() -> dict[str, Any] | None:
    """The section removed by the newest claimed ``deepspeed.initialize`` call, once."""
    return _taken.pop() if _taken else None


def _section_in(config: Any) -> bool:
    if isinstance(config, dict):
        return SECTION in config
    if not isinstance(config, (str, os.PathLike)):
        return False
    import json

    try:
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                text = f.read()
        elif isinstance(config, str):  # DeepSpeed also takes a base64-encoded config
            import base64

            text = base64.urlsafe_b64decode(config).decode("utf-8")
        else:
            return False
    except (OSError, ValueError):  # binascii.Error and UnicodeDecodeError are ValueErrors
        return False
    try:
        data = json.loads(text)
    except ValueError:  # Hjson, which DeepSpeed reads too: the key's name is enough here
        return f'"{SECTION}"' in text or f"{SECTION}:" in text
    return isinstance(data, dict) and SECTION in data


def has_section(args: Any = None, config: Any = None, config_params: Any = None) -> bool:
    """Whether any of ``deepspeed.initialize``'s config sources holds the section."""
    candidates = [config, config_params]
    if args is not None:  # (--deepscale_config: the deprecated name DeepSpeed still takes)
        candidates.append(getattr(args, "deepspeed_config", None))
        candidates.append(getattr(args, "deepscale_config", None))
    return any(_section_in(c) for c in candidates if c is not None)


def _warning() -> str:
    return (
        f'this DeepSpeed config has a "{SECTION}" section, but it reached deepspeed.initialize '
        "directly: nothing is being checkpointed by resilient_callbacks. Call "
        "resilient_callbacks.deepspeed.initialize(...) instead, or launch the unchanged script "
        "with `python -m resilient_callbacks.deepspeed.run train.py ...` (also as `torchrun "
        "--nproc_per_node N -m resilient_callbacks.deepspeed.run train.py ...` and `deepspeed "
        "--module resilient_callbacks.deepspeed.run train.py ...`); with the Hugging Face Trainer "
        "add resilient_callbacks.transformers.ResilientCheckpoint to its callbacks. "
        f"{ENV_OFF}=1 silences this warning."
    )


def guard(initialize: Any) -> Any:
    """``initialize`` wrapped: the same call, plus the warning when the section is present."""
    if getattr(initialize, "__resilient_guard__", False):
        return initialize

    import functools
    import warnings

    @functools.wraps(initialize)
    def guarded(*a: Any, **kw: Any) -> Any:
        try:
            found = has_section(
                a[0] if a else kw.get("args"), kw.get("config"), kw.get("config_params")
            )
            if found and _claims:
                given = [kw.get(k) for k in ("config", "config_params")]
                dicts = [d for d in given if isinstance(d, dict) and SECTION in d]
                for d in dicts:
                    _taken.append(d.pop(SECTION))
                found = not dicts
        except Exception:  # never in the way of the user's call
            found = False
        if found:
            warnings.warn(_warning(), SectionIgnoredWarning, stacklevel=2)
            sys.stderr.write(f"resilient_callbacks WARNING: {_warning()}\n")
        return initialize(*a, **kw)

    guarded.__resilient_guard__ = True  # type: ignore[attr-defined]
    return guarded


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        _uninstall()  # DeepSpeed is being loaded: the real finders answer from now on
        self.inner.exec_module(module)
        with contextlib.suppress(Exception):  # a DeepSpeed without initialize: nothing to guard
            module.initialize = guard(module.initialize)


class _Finder(importlib.abc.MetaPathFinder):
    """Answers for ``deepspeed`` alone, with the real spec whose loader wraps ``initialize``.
    It stays until DeepSpeed is loaded, not only until first asked: accelerate (imported by
    transformers' models and by lightning) asks ``importlib.util.find_spec("deepspeed")``
    whether it is installed, without loading it, long before the program imports it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "deepspeed":
            return None
        if "deepspeed" in sys.modules:  # loaded past this finder (a reload): nothing to wrap
            _uninstall()
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def _uninstall() -> None:
    for f in [f for f in sys.meta_path if isinstance(f, _Finder)]:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(f)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once; not when turned off or DeepSpeed is loaded)."""
    if os.environ.get(ENV_OFF, "") not in ("", "0"):
        return
    if "deepspeed" in sys.modules:
        mod: Any = sys.modules["deepspeed"]
        if hasattr(mod, "initialize"):
            mod.initialize = guard(mod.initialize)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
