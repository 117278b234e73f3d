"""Loading a decoded checkpoint into the live objects of a state, in place.

One job: after :func:`.fit.check_fits` has found that a checkpoint fits, put its values into the
objects the training loop holds: ``copy_`` into tensors, ``load_state_dict`` into modules,
optimizers and other stateful objects, and plain containers (dicts, lists, at every depth)
updated rather than replaced, so a reference the loop keeps to ``state["extra"]["history"]``
sees the restored history and keeps feeding the next checkpoint.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import mapped, module_versions, notices, scheduler_settings, statetree
from .errors import CheckpointMismatchError, caller_stacklevel, warn_and_log
from .filepart import FilePart
from .optim import relink_param_groups, shared_param_groups
from .state_marks import PerRank
from .structure import _has_live_objects, _qualname, is_stateful, path_str
from .structure_decode import _node_items, _node_seq
from .values import same_value
from .wrapped import plain_module, unwrapped_keys


@dataclass(frozen=True)
class Advice:
    """What a restore's warnings tell the user to do, in the words of the framework that calls
    :meth:`.Checkpointer.restore`, and where they point. The defaults speak to a user who calls
    ``restore()`` themselves; an adapter whose framework calls it (Transformers) sets its own
    on its ``Checkpointer`` (``restore_advice``)."""

    #: how to keep a key new code adds to a dict of plain values (the removed-keys warning)
    new_key: str = "set it after restore() (e.g. state['extra'].setdefault(key, default))"
    #: how to resume with new LR scheduler settings (:func:`.scheduler_settings.message`)
    new_settings: str = "set them on the scheduler after restore() (see the guide)"
    #: the resumes that load schedulers as this one does (:func:`.scheduler_settings.message`)
    like: str = scheduler_settings.LIKE
    #: the framework's directories between the user's line and the library, passed over
    through: tuple[str, ...] = ()


def apply(
    state: Any,
    structure: Any,
    resolve: Callable[[Any], Any],
    advice: Advice = Advice(),
    *,
    coordinator: bool = True,
    rollback: bool = False,
) -> None:
    """Load a checkpoint into the live objects of ``state`` in place. ``resolve(node)`` decodes
    a structure node (tensors already loaded). Containers are updated, not replaced, so
    references the training loop holds stay valid. Keys a plain dict had and the checkpoint's
    did not are removed (the saved run had dropped them, or new code adds them): a warning
    names them, and one names the LR scheduler settings the checkpoint's replace, both at the
    user's line and in the words of ``advice``; the latter on the ``coordinator`` only (rank 0:
    said once, :func:`.scheduler_settings.say`). A ``rollback`` (a restore again in the running
    process) keeps the settings the run's schedulers have (those its user may have set after
    the first restore's warning) and loads where they are from the checkpoint
    (:func:`.scheduler_settings.kept`); a log line names them."""
    removed: list[str] = []  # of the replicated state: the same on every rank, said once
    removed_here: list[str] = []  # of this rank's PerRank state: said by this rank
    into = [removed]  # where merge_plain adds: removed_here while inside a PerRank
    settings: list[str] = []  # LR scheduler settings the checkpoint's replace (scheduler_settings)
    kept: list[str] = []  # those a roll-back keeps
    # optimizers sharing their parameter groups (a SAM wrapper and its base): shared again after
    links = shared_param_groups([obj for _, obj in statetree.leaves(state)])
    loaded: list[Any] = []  # the objects given load_state_dict, in order
    # values put in the state's containers are the state's: not views of the mapped checkpoint
    # files (its disk space would stay in use after retention), one copy per aliased tensor
    memo: dict[int, Any] = {}

    def fresh(n: Any) -> Any:
        return mapped.private(resolve(n), memo)

    def load_into(obj: Any, n: Any, path: tuple[Any, ...]) -> Any:
        """Returns the value that should replace ``obj`` in its container (``obj`` itself if it
        was updated in place)."""
        if isinstance(obj, PerRank):
            into.append(removed_here)
            try:
                obj.obj = load_into(obj.obj, n, path)
            finally:
                into.pop()
            return obj
        if isinstance(obj, FilePart):
            return obj  # loaded from its own verified files (see restore_load.py)
        if isinstance(obj, torch.Tensor):
            value = resolve(n)
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(value)
            with torch.no_grad():
                if obj.shape != value.shape:
                    raise CheckpointMismatchError(
                        f"{path_str(path)}: shape {list(value.shape)} in checkpoint, "
                        f"{list(obj.shape)} here"
                    )
                obj.copy_(value)
            return obj
        if is_stateful(obj):
            target = plain_module(obj)  # a wrapper (compile, DDP): into the module it wraps
            value = module_versions.attach(resolve(n), n)
            load = target.load_state_dict
            sched = scheduler_settings.held(target)
            if sched is not None and isinstance(value, Mapping):
                diff = scheduler_settings.changed(sched, value)
                where = getattr(target, "settings_name", None) or path_str(path)
                said = [f"{where} ({type(sched).__name__}): {', '.join(diff)}"] if diff else []
                (kept if rollback else settings).extend(said)
                if diff and rollback:
                    value = scheduler_settings.kept(sched, value)
            if isinstance(target, torch.nn.Module) and isinstance(value, Mapping):
                live_sd = target.state_dict()
                value = unwrapped_keys(value, live_sd.keys())
                load = with_versions(target, live_sd)
            try:  # what it keeps must not hold the file (mapped.py)
                result = mapped.load_state(target, value, load)
                loaded.append(target)
            except CheckpointMismatchError:
                raise
            except Exception as e:  # the object's own validation: report with its key path
                raise CheckpointMismatchError(
                    f"{path_str(path)} ({_qualname(obj)}) rejected the checkpoint: "
                    f"{type(e).__name__}: {e}. Objects of the state restored before it hold "
                    "the checkpoint's values now: build them afresh before training from scratch"
                ) from e
            _check_load_result(result, path)
            return obj
        if not _has_live_objects(obj):  # plain data: merged in place, at every depth
            value = fresh(n)
            return obj if merge_plain(obj, value, path, into[-1]) else value
        if isinstance(obj, MutableMapping):
            items = _node_items(n)
            assert items is not None  # check_fits ran first
            for k in list(obj.keys()):
                if k in items:
                    new = load_into(obj[k], items[k], (*path, k))
                    if new is not obj[k]:
                        obj[k] = new
            return obj
        if isinstance(obj, MutableSequence):
            seq = _node_seq(n)
            assert seq is not None
            for i, s in enumerate(seq):
                new = load_into(obj[i], s, (*path, i))
                if new is not obj[i]:
                    obj[i] = new
            return obj
        if isinstance(obj, tuple):
            seq = _node_seq(n)
            assert seq is not None
            for i, s in enumerate(seq):
                new = load_into(obj[i], s, (*path, i))
                if not same_value(new, obj[i]):
                    raise CheckpointMismatchError(
                        f"{path_str((*path, i))} is inside a tuple and cannot be restored in "
                        "place; use a list or a dict for values that change during training"
                    )
            return obj
        return fresh(n)

    try:
        new_root = load_into(state, structure, ())
        relink_param_groups(links, loaded)
    finally:
        # (a closure that refers to itself: the cycle kept ``resolve``'s tensors alive)
        load_into = fresh = None  # type: ignore[assignment]
        memo.clear()
    for keys, said in ((removed, coordinator), (removed_here, None)):
        if not keys:
            continue
        msg = (
            f"restore: {', '.join(keys[:10])}{' ...' if len(keys) > 10 else ''} not in "
            "the checkpoint: removed, so the state is the saved one. A key your new code adds "
            f"to a dict of plain values is not in checkpoints of the old code: {advice.new_key}"
        )
        level = caller_stacklevel(*advice.through)
        if said is None:  # this rank's own state: said here, naming the rank
            warnings.warn(notices.on_this_rank(msg), UserWarning, stacklevel=level)
        else:  # the replicated state: the same on every rank, said once (notices.py)
            warn_and_log(notices.log, msg, UserWarning, stacklevel=level, warn=said)
    if settings:
        msg = scheduler_settings.message(settings, advice.new_settings, advice.like)
        scheduler_settings.say("restore: " + msg, coordinator, advice.through)
    if kept and coordinator:
        scheduler_settings.log.info(
            "roll-back: the LR schedulers keep the settings this run uses, the checkpoint's "
            "differ: %s",
            "; ".join(kept),
        )
    if not same_value(new_root, state):
        raise CheckpointMismatchError(
            "the state passed to restore() must be a container (dict/list) or an object with "
            "load_state_dict(); a bare value cannot be restored in place"
        )


def merge_plain(
    obj: Any, value: Any, path: tuple[Any, ...] = (), removed: list[str] | None = None
) -> bool:
    """Make the plain container ``obj`` equal to the decoded ``value`` in place (a ``dict``'s keys
    in ``value``'s order too), recursing into the dicts and lists both hold at the same key or
    index, so nested containers keep their identity too. Returns False where ``obj`` is not a
    container of ``value``'s kind (the caller puts ``value`` in its place). The paths of dict
    keys removed are added to ``removed``; those a mapping's ``missing_allowed`` allows it to
    lack (:class:`~.state_marks.OptionalKeys`) keep their live values, unsaid."""
    if isinstance(obj, MutableMapping) and isinstance(value, Mapping):
        missing = [k for k in obj if k not in value]
        allowed = getattr(obj, "missing_allowed", None)  # (OptionalKeys: they keep live values)
        if not (missing and allowed is not None and allowed(list(missing))):
            for k in missing:
                del obj[k]
                if removed is not None:
                    removed.append(path_str((*path, k)))
        for k, v in value.items():
            if not (k in obj and merge_plain(obj[k], v, (*path, k), removed)):
                obj[k] = v
        if isinstance(obj, dict) and list(obj) != list(value):
            # the saved order: a loop over it (a sum) goes as saved. Only a dict (subclasses
            # too) keeps its keys in insertion order; another mapping orders them itself (sorted)
            # or cannot lose a key (a config with fixed keys), so it is left in its order
            for k in value:
                obj[k] = obj.pop(k)
        return True
    if isinstance(obj, list) and isinstance(value, list):
        del obj[len(value) :]
        for i, v in enumerate(value):
            if i == len(obj):
                obj.append(v)
            elif not merge_plain(obj[i], v, (*path, i), removed):
                obj[i] = v
        return True
    return False


def _check_load_result(result: Any, path: tuple[Any, ...]) -> None:
    missing = getattr(result, "missing_keys", None)
    unexpected = getattr(result, "unexpected_keys", None)
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{path_str(path)}: missing keys {list(missing or [])}, "
            f"unexpected keys {list(unexpected or [])}"
        )


def with_versions(module: torch.nn.Module, live_sd: Any) -> Callable[[Any], Any]:
    """``module.load_state_dict`` given the versions of :func:`versioned`."""

    def load(sd: Any) -> Any:
        return module.load_state_dict(versioned(sd, live_sd) if isinstance(sd, Mapping) else sd)

    return load


def versioned(sd: Mapping[str, Any], live_sd: Any) -> Any:
    """``sd`` with the submodules' versions (``_version``) that ``state_dict()`` keeps in its
    ``_metadata`` attribute and ``torch.save`` pickles with it: modules read a state dict by its
    version, and without one take it for their oldest layout (:mod:`.module_versions`). They
    are those ``sd`` carries (the checkpoint's, :func:`.module_versions.attach`) where it
    recorded them, else the live module's (``live_sd``, its ``state_dict()``): a checkpoint
    written before versions were recorded was written by the same code."""
    meta = module_versions.merged(sd, live_sd)
    if meta is None:
        return sd
    out = collections.OrderedDict(sd)
    out._metadata = meta  # type: ignore[attr-defined]
    return out


def as_live_keys(sd: Mapping[str, Any], module: torch.nn.Module) -> Any:
    """``sd`` with its keys as ``module`` names them (:func:`.wrapped.unwrapped_keys`) and its
    submodules' versions (:func:`versioned`): for a framework that loads it itself."""
    live_sd = module.state_dict()
    return versioned(unwrapped_keys(sd, live_sd.keys()), live_sd)
