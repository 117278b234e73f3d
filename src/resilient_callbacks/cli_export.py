"""``resilient-ckpt export``: a checkpoint's model written where other tools load it (a
Transformers run's as a ``from_pretrained`` directory; a Lightning, DeepSpeed or sharded run's
as consolidated safetensors)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from .cli_format import DIR_OR_ONE_HELP, PROG


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """The ``export`` command's arguments (also ``python -m resilient_callbacks.transformers``)."""
    p.add_argument("dir", metavar="DIR", help=DIR_OR_ONE_HELP)
    p.add_argument(
        "out",
        metavar="OUT",
        help="the directory to write (must not exist, unless --force); never DIR, a folder "
        "holding it, or one inside it",
    )
    p.add_argument(
        "--step", metavar="N", type=int, help="export this step (default: the newest valid one)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it is an empty folder or an earlier export (its export.json); "
        "any other folder is refused",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="write the floating-point weights in this dtype (default: as saved: fp32 for the "
        "masters of ZeRO 1-3); integer tensors stay as they are",
    )
    p.add_argument(
        "--key",
        metavar="KEY",
        help="a plain Checkpointer state: the entry to write (a module, or a dict of tensors; "
        "'train.model' in a nested dict); default: the one module in the state",
    )
    p.add_argument(
        "--merged",
        action="store_true",
        help="a PEFT model: its base model with the adapters merged in (default: the adapters)",
    )


def _earlier_export(out: str) -> str | None:
    """What the earlier export in ``out`` was (its ``export.json``: step and source), which
    ``--force`` replaces; None where there is none."""
    import json
    import os

    from .export_target import EXPORT_MARKER, is_export

    if not is_export(out):
        return None
    with open(os.path.join(out, EXPORT_MARKER), encoding="utf-8") as f:
        info = json.load(f)
    return f"step {info['step']} of {info['source']}"


def cmd_export(args: argparse.Namespace) -> int:
    """``export``; a checkpoint that the retention of a run writing to DIR deletes while it is
    read is gone, not broken: without ``--step`` the newest valid one is exported instead (said
    on stderr), with ``--step`` a one-line error says so."""
    import os

    from .errors import CheckpointNotFoundError

    had_out = os.path.exists(args.out)
    earlier = _earlier_export(args.out) if getattr(args, "force", False) else None
    for attempt in range(3):
        try:
            done = _export(args)
            if done == 0 and earlier:  # (--force deleted it: said, as gc says what it deletes)
                print(
                    f"{PROG} export: --force replaced the earlier export in {args.out}: {earlier}",
                    file=sys.stderr,
                )
            return done
        except FileNotFoundError as e:
            gone = _deleted_checkpoint(args.dir, e.filename)
            if gone is None:
                raise
            if args.step is not None or attempt == 2 or (os.path.exists(args.out) and not had_out):
                raise CheckpointNotFoundError(
                    f"{gone} was deleted while export read it (the retention of a run writing "
                    f"to {args.dir}): export a checkpoint it keeps, or the newest (no --step)"
                ) from None
            print(
                f"{PROG} export: {gone} was deleted while it was read (the retention of a run "
                "writing there); exporting the newest valid checkpoint instead",
                file=sys.stderr,
            )
    raise AssertionError("unreachable")


def _deleted_checkpoint(dirpath: str, filename: object) -> str | None:
    """The checkpoint folder of ``dirpath`` that held ``filename`` (a file not found), if that
    folder is gone; else None."""
    import os

    if not isinstance(filename, str):
        return None
    root = os.path.abspath(dirpath)
    if os.path.exists(os.path.join(root, "manifest.json")) or not os.path.isdir(root):
        root = os.path.dirname(root)  # DIR was one checkpoint
    rel = os.path.relpath(os.path.abspath(filename), root)
    if rel.startswith(os.pardir) or os.sep not in rel:
        return None
    folder = os.path.join(root, rel.split(os.sep)[0])
    return None if os.path.isdir(folder) else folder


def _export(args: argparse.Namespace) -> int:
    import os

    from .cli_scan import no_checkpoints, resolve
    from .export_target import check_export_target

    resolve(args.dir)  # a URL, a missing path, a file: said as ls and inspect say it
    # before anything is read: OUT must not be, hold or lie in DIR, and --force replaces only
    # an empty folder or an earlier export
    force = bool(getattr(args, "force", False))
    check_export_target(args.dir, args.out, overwrite=force, force_name="--force")
    if os.path.isdir(args.dir) and not os.path.exists(os.path.join(args.dir, "manifest.json")):
        from . import catalog

        if not catalog.committed(catalog.scan(args.dir, catalog.Depth.NONE)):
            raise no_checkpoints(args.dir)
    if getattr(args, "key", None):
        return _export_entry(args, args.key)
    done = _export_weights(args)
    if done is not None:
        return done
    path = _not_exportable(args)
    if path is not None:  # a plain Checkpointer state: its one module
        return _export_entry(args, None)
    if "transformers" not in sys.modules and importlib.util.find_spec("transformers"):
        # its import alone takes seconds (15 on a loaded machine), which passed in silence
        print(
            f"{PROG} export: a Trainer run's checkpoint: loading transformers to write a "
            "from_pretrained directory ...",
            file=sys.stderr,
            flush=True,
        )
    try:
        from .transformers.export import cli_export
    except ImportError as e:
        hint = (
            "" if "pip install" in str(e) else "; pip install 'resilient-callbacks[transformers]'"
        )
        print(
            f"{PROG} export: a Trainer run's checkpoint needs transformers ({e}){hint}",
            file=sys.stderr,
        )
        return 1
    return int(cli_export(args))


def _not_exportable(args: argparse.Namespace) -> str | None:
    """The path of the checkpoint ``export`` would read when it was not written by the
    Transformers callback (nothing to export), else None."""
    import json
    import os

    from . import reader
    from .layout import SHARED_STRUCTURE

    sel = reader.select(args.dir, args.step)
    try:
        with open(os.path.join(sel.path, SHARED_STRUCTURE), "rb") as f:
            structure = json.loads(f.read()).get("structure")
    except (OSError, ValueError):
        return None  # unreadable: the export's own checks say so
    return None if isinstance(structure, dict) and "trainer" in structure else sel.path


def _export_weights(args: argparse.Namespace) -> int | None:
    """``export`` of a checkpoint written by resilient_callbacks.deepspeed, or holding a
    ``dcp.Sharded`` part outside a Trainer run: consolidated weights (fp32 at ZeRO 1-3, as saved
    for Sharded) as OUT/model.safetensors. None if the checkpoint is not one of those."""
    from . import consolidate, reader
    from .errors import CheckpointError
    from .manifest import read_manifest

    try:
        sel = reader.select(args.dir, args.step)
        if not consolidate.exports_weights(read_manifest(sel.path), sel.path):
            return None
        if getattr(args, "merged", False):
            print(
                f"{PROG} export: --merged merges a PEFT model's adapters (a Trainer run's "
                f"checkpoint); {sel.path} holds consolidated weights: export it without",
                file=sys.stderr,
            )
            return 2
        return _write(args, sel)
    except CheckpointError as e:
        print(f"{PROG} export: {e}{node_part_hint(args)}", file=sys.stderr)
        return 1


def _export_entry(args: argparse.Namespace, key: str | None) -> int:
    """``export`` of a plain Checkpointer state's entry ``key`` (None: its one module) as
    OUT/model.safetensors, by the names of its state dict."""
    from . import consolidate, reader
    from .errors import CheckpointError

    try:
        sel = reader.select(args.dir, args.step)
        if getattr(args, "merged", False):  # (was ignored: the entry exported as it is)
            print(
                f"{PROG} export: --merged merges a PEFT model's adapters (a Trainer run's "
                f"checkpoint, without --key); {sel.path} is exported as a state's module: "
                "export it without --merged",
                file=sys.stderr,
            )
            return 2
        return _write(args, sel, *consolidate.entry_tensors(sel.path, key))
    except CheckpointError as e:
        print(f"{PROG} export: {e}{node_part_hint(args)}", file=sys.stderr)
        return 1


def node_part_hint(args: argparse.Namespace) -> str:
    """What to add to an export's error when the checkpoint it read is one node's part of a
    node-local checkpoint (docs/multinode.md): a file it needs is another node's, so "the
    manifest does not list rank_00000.json" is no damage; ``""`` otherwise."""
    from . import reader
    from .cli_scan import resolve
    from .errors import CheckpointError

    try:
        target = resolve(args.dir)
        entries = reader.committed(target.root)
        if target.only is not None:
            entries = [e for e in entries if e.name == target.only]
        e = reader.find(entries, target.root, args.step)
    except (CheckpointError, OSError):
        return ""
    node = e.manifest.extra.get("node") if e.manifest is not None else None
    if not isinstance(node, dict):
        return ""
    ranks = ", ".join(map(str, node.get("ranks") or []))
    return (
        f". {e.path} is one node's part of a node-local checkpoint (the files of rank(s) "
        f"{ranks} of {e.manifest.world_size if e.manifest else '?'}), not all of it: "
        "`resilient-ckpt pull URL NEW_DIR` fetches the whole checkpoint from the run's remote "
        "store; export NEW_DIR"
    )


def _write(args: argparse.Namespace, sel: Any, key: str | None = None, weights: Any = None) -> int:
    """Say which newer checkpoints ``sel`` skipped, write OUT/model.safetensors (``weights``;
    default: the checkpoint's consolidated model) and say so."""
    import warnings

    from . import consolidate

    for e in sel.skipped:
        msg = f"skipping checkpoint {e.path}: {e.problem}; falling back to an older one"
        print(f"{PROG} export: warning: {msg}", file=sys.stderr)
    from .cli_scan import NOT_LOADED, newer_without_manifest

    for name in newer_without_manifest(args.dir, sel.step) if args.step is None else []:
        print(f"{PROG} export: warning: skipping {name}: {NOT_LOADED}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # safetensors' non-writable buffer note
        out = consolidate.export_weights(
            sel.path,
            args.out,
            overwrite=bool(args.force),
            weights=weights,
            key=key,
            dtype=getattr(args, "dtype", None),
        )
    what = f"{key!r} of " if key is not None else ""
    print(f"exported {what}{sel.path} (step {sel.step}) to {out}/model.safetensors")
    return 0
