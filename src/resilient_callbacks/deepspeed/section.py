"""The ``"resilient_checkpoint"`` section of a DeepSpeed JSON config: read, validated, removed.

The section holds :class:`~resilient_callbacks.Checkpointer` options (``dirpath`` required)::

    "resilient_checkpoint": {"dirpath": "/shared/ckpt/run1", "adaptive": true,
                             "mtbf_hours": 12, "keep_last": 3, "remote": "s3://bucket/run1"}

It is removed before DeepSpeed sees the config: DeepSpeed writes its config into every
checkpoint it saves and logs it, and remote options (credentials) must not end up there.
"""

from __future__ import annotations

import base64
import binascii
import copy
import difflib
import inspect
import json
import os
from collections.abc import Mapping
from typing import Any

from ..config import CheckpointerConfig
from ..errors import ConfigError, UnknownOptionError

SECTION = "resilient_checkpoint"


def checkpointer_options() -> list[str]:
    """The option names a section may hold: the Checkpointer's keyword arguments (not
    ``read_only``: the engine's Checkpointer saves)."""
    from ..checkpointer import Checkpointer

    params = inspect.signature(Checkpointer.__init__).parameters
    return [n for n in params if n not in ("self", "read_only")]


def _hint(name: str) -> str:
    """``name`` quoted, with the valid option it is closest to (a typo, another case)."""
    valid = checkpointer_options()
    lower = {v.lower(): v for v in valid}
    close = difflib.get_close_matches(str(name).lower(), list(lower), n=1)
    return f"{name!r} (did you mean {lower[close[0]]!r}?)" if close else repr(name)


def _named(where: str) -> str:
    """What the messages call the options checked in ``where``: ``attach()``'s are keywords
    (it told a user of ``rcds.attach(every_n_step=5)`` of a config section he does not have),
    ``checkpoint=`` is ``rcds.initialize``'s dict (merged into the section, if any)."""
    if where == "attach()":
        return "rcds.attach()'s keywords"
    if where == "checkpoint=":
        return f'rcds.initialize(checkpoint=...) (with the config\'s "{SECTION}", if any)'
    return f'"{SECTION}" in {where}'


def validate(section: Any, where: str = "the DeepSpeed config") -> dict[str, Any]:
    """The section's options, checked: a JSON object with known keys and a ``dirpath``."""
    named = _named(where)
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"{named} must be a JSON object of Checkpointer options, got {type(section).__name__}"
        )
    valid = checkpointer_options()
    unknown = sorted(k for k in section if k not in valid)
    if unknown:  # an UnknownOptionError (a ConfigError and a TypeError), as for the Checkpointer
        raise UnknownOptionError(
            f"{named}: unknown option(s) {', '.join(map(_hint, unknown))}; "
            f"valid options are: {', '.join(valid)}"
        )
    if not section.get("dirpath"):
        raise ConfigError(f'{named} needs "dirpath": where to write checkpoints')
    options = dict(section)
    signals = options.get("signals")
    if isinstance(signals, list):
        options["signals"] = tuple(signals)
    # the values too, before DeepSpeed builds the engine (minutes for a large model), with
    # the section named (the same checks run again when the Checkpointer is made)
    checked = dict(options)
    if isinstance(signals, (str, int)):
        checked["signals"] = (signals,)
    try:
        CheckpointerConfig(**checked)
    except ConfigError as e:
        raise ConfigError(f"{named}: {e}") from None
    return options


def _parse(text: str) -> Any:
    """A config's text as DeepSpeed reads it: JSON, or Hjson (comments, unquoted keys), which
    DeepSpeed also accepts."""
    try:
        return json.loads(text)
    except ValueError as not_json:
        try:
            import hjson  # DeepSpeed's own dependency
        except ImportError:
            raise not_json from None
        return hjson.loads(text)


def _base64(config: str) -> Any:
    """A base64-encoded config (DeepSpeed takes one in place of a path) decoded, else None."""
    try:
        return _parse(base64.urlsafe_b64decode(config).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, binascii.Error):
        return None


def load_config(config: Any) -> tuple[Any, str]:
    """``config`` as DeepSpeed takes it (a dict, the path of a JSON or Hjson file, or a base64
    encoding of one) as a dict, and a description of where it came from. Anything else is
    returned as is."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), "the DeepSpeed config"
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                return _parse(f.read()), path
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if isinstance(config, str):
        decoded = _base64(config)
        if isinstance(decoded, dict):
            return decoded, "the DeepSpeed config (base64)"
    return config, "the DeepSpeed config"


def split(config: Any) -> tuple[Any, dict[str, Any] | None]:
    """``(config without the section, the section's validated options or None)``. A config
    that is not a dict, a JSON file or a base64 encoding of one is returned unchanged, with no
    section; one with the section is returned as a dict."""
    loaded, where = load_config(config)
    if not isinstance(loaded, dict) or SECTION not in loaded:
        return (loaded if isinstance(loaded, dict) else config), None
    options = validate(loaded.pop(SECTION), where)
    return loaded, options


def without_section(config: Any, launched: bool) -> str | None:
    """What to say of a config that reaches ``initialize`` without the section: under the
    launcher (run to checkpoint), or when a key is a near miss of the section's name (a typo
    that would otherwise train with nothing saved, in silence); None otherwise."""
    loaded, where = load_config(config)
    keys = [k for k in loaded if isinstance(k, str)] if isinstance(loaded, dict) else []
    near = difflib.get_close_matches(SECTION, keys, n=1, cutoff=0.75)
    if not near and not launched:
        return None
    said = f'{where} has no "{SECTION}" section, so this engine is not checkpointed'
    if near:
        return f'{said}: did you mean "{SECTION}" where it says "{near[0]}"?'
    return f"{said}, although the script was launched through resilient_callbacks.deepspeed.run"
