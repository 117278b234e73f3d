"""Turn a checkpoint written by ``ResilientCheckpoint`` into a Hugging Face model directory
(``config.json``, ``model.safetensors``, ``generation_config.json``) that
``AutoModel.from_pretrained`` and friends load.

The checkpoint is verified (sizes and checksums) before anything is written; a corrupt newest
checkpoint is skipped with a :class:`~resilient_callbacks.ResumeFallbackWarning`, as on resume.
The model class is taken from the ``transformers`` namespace by the name recorded at save time
(no module named by a checkpoint is ever imported); pass ``model_class`` for your own classes.
The directory is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from typing import Any

import transformers

from .. import layout, module_versions, reader, structure_decode
from ..consolidate import (
    EXPORT_DTYPES,
    check_fits,
    consolidated,
    export_staging,
    publish_export,
    trainer_model_info,
)
from ..errors import (
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    ResumeFallbackWarning,
)
from ..export_target import EXPORT_MARKER, check_export_target
from ..inplace import versioned
from ..manifest import read_manifest


def export_pretrained(
    source: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    overwrite: bool = False,
    model_class: type | None = None,
    merged: bool = False,
) -> str:
    """Write the model of a checkpoint as a ``from_pretrained`` directory; return its path.

    ``source``: a ResilientCheckpoint directory (its newest valid checkpoint is used, or the one
    of ``step``) or one checkpoint directory (``.../step_000000200``). ``output_dir`` must not
    exist unless ``overwrite=True``.

    A PEFT model (a LoRA fine-tune) is written as ``PeftModel.save_pretrained`` writes it (the
    adapters: ``adapter_config.json``, ``adapter_model.safetensors``), or with ``merged=True``
    as its base model with the adapters merged in, for ``from_pretrained``; ``model_class``
    then names the base model's class."""
    return _export(source, output_dir, step, overwrite, model_class, merged)[0]


def _export(
    source: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    step: int | None,
    overwrite: bool,
    model_class: type | None,
    merged: bool = False,
    dtype: str | None = None,
) -> tuple[str, str]:
    src = os.fspath(source)
    out = check_export_target(src, output_dir, overwrite=overwrite)
    path, part = _read_checkpoint(src, step)
    full = structure_decode.inline_per_rank(part.structure, part.per_rank)
    if (
        not isinstance(full, dict)
        or "trainer" not in full
        or not ("model" in full or "sharded" in full or "engine" in full)
    ):
        raise CheckpointMismatchError(
            f"{path} was not written by resilient_callbacks.transformers.ResilientCheckpoint "
            "(no 'model'/'trainer' entries); export needs the model class and config it records"
        )
    info = trainer_model_info(full, part.tensors)
    if info is None or not info.get("config"):
        raise CheckpointMismatchError(
            f"{path} records no model configuration (its model is not a PreTrainedModel): "
            "there is no from_pretrained directory to write; `resilient-ckpt export` writes its "
            "weights as model.safetensors"
        )
    if merged and not info.get("peft"):
        raise ConfigError(
            f"{path} holds no PEFT model ({info['class']}): merged=True (--merged) merges a "
            "PEFT model's adapters into its base model; export it without"
        )
    cls = None
    if not info.get("peft"):
        cls = model_class or getattr(transformers, str(info["class"]), None)
        if not isinstance(cls, type):
            raise ConfigError(
                f"the checkpoint's model class {info['module']}.{info['class']} is not part of "
                "transformers; pass model_class=<the class> to export it"
            )
    if "model" in full:
        node = full["model"]  # its submodules' versions too: they say how to read it
        state_dict = module_versions.attach(structure_decode.decode(node, part.tensors), node)
    elif "sharded" in full:  # under the Trainer's FSDP: every rank's shards, laid together
        from ..dcp.whole import model_tensors

        state_dict = model_tensors(path, read_manifest(path), "sharded")
    else:  # under DeepSpeed: the engine's weights (fp32 masters at ZeRO 1-3), consolidated
        state_dict = consolidated(path, part)
    model = load_weights(
        _empty_model(info, cls, model_class), state_dict, merged=merged, where=path
    )
    if (
        info.get("generation_config")
        and isinstance(model, transformers.PreTrainedModel)
        and model.generation_config is not None
    ):
        model.generation_config = transformers.GenerationConfig.from_dict(
            json.loads(info["generation_config"])
        )

    if dtype is not None:  # (export --dtype) floating-point weights and buffers
        for name, t in model.state_dict().items():
            check_fits(name, t, dtype)
        model = model.to(EXPORT_DTYPES[dtype])
    staging = export_staging(out)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        info_out = {"source": path, "step": read_manifest(path).step, "class": info["class"]}
        with open(os.path.join(staging, EXPORT_MARKER), "w", encoding="utf-8") as f:
            json.dump(info_out | ({"merged": True} if merged else {}), f, indent=1)
        publish_export(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out, path


def load_weights(model: Any, state_dict: dict[str, Any], *, merged: bool, where: str) -> Any:
    """Assign ``state_dict`` to the meta-device ``model``, tie its tied weights and, with
    ``merged``, merge a PEFT model's adapters into its base model; raise
    :class:`CheckpointMismatchError` naming what does not fit. Tied weights are tied before the
    merge: assigned apart (or one absent, as DeepSpeed saves a tied weight once), PEFT would find
    them untied and write ``tie_word_embeddings: false``.

    The submodules' versions (``_version``) it is loaded by are those ``state_dict`` carries
    (:func:`.module_versions.attach`: the checkpoint's) where it has them, else the model's own
    (:func:`..inplace.versioned`): a module whose ``_load_from_state_dict`` upgrades an older
    layout reads the entries by the version of the code that wrote them, never as its oldest."""
    name = type(model).__name__
    try:
        result = model.load_state_dict(
            versioned(state_dict, model.state_dict()), strict=False, assign=True
        )
    except RuntimeError as e:
        raise CheckpointMismatchError(f"the weights in {where} do not fit {name}: {e}") from None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "tie_weights"):
        base.tie_weights()  # a tied weight (saved once, under its owner's name) is set here
    if merged:
        model = model.merge_and_unload()  # the base model, each adapter's update added in
    unset = [k for k, v in model.state_dict().items() if v.is_meta]
    if result.unexpected_keys or unset:
        raise CheckpointMismatchError(
            f"the weights in {where} do not fit {name}: "
            + (f"not in the model: {result.unexpected_keys[:5]} " if result.unexpected_keys else "")
            + (f"missing from the checkpoint: {unset[:5]}" if unset else "")
        )
    return model


def _empty_model(info: dict[str, Any], cls: type | None, model_class: type | None) -> Any:
    """The recorded model, built on the meta device (the checkpoint's weights are assigned)."""
    if info.get("peft"):
        from .peft_export import empty_peft_model, peft_base_class

        base = model_class or peft_base_class(info)
        config = base.config_class.from_dict(json.loads(info["config"]))  # type: ignore[attr-defined]
        return empty_peft_model(info, config, base)
    assert cls is not None
    config = cls.config_class.from_dict(json.loads(info["config"]))  # type: ignore[attr-defined]
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls(config)


def _read_checkpoint(source: str, step: int | None) -> tuple[str, layout.LoadedPart]:
    """The chosen checkpoint's path and its rank-0 part, verified (:func:`..reader.select`:
    the newest valid one, or the one of ``step``; each newer one skipped is warned about)."""
    sel = reader.select(source, step)
    for e in sel.skipped:
        warnings.warn(
            f"skipping checkpoint {e.path}: {e.problem}; falling back to an older checkpoint",
            ResumeFallbackWarning,
            stacklevel=3,
        )
    return sel.path, reader.open_checkpoint(sel.path).part


def cli_export(args: argparse.Namespace) -> int:
    """``resilient-ckpt export`` of a Trainer run's checkpoint (also ``python -m
    resilient_callbacks.transformers export``): prints what it wrote; returns the exit code."""
    try:
        # first, so that its refusals name the CLI's --force (not the Python API's overwrite)
        force = bool(getattr(args, "force", False))
        check_export_target(args.dir, args.out, overwrite=force, force_name="--force")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResumeFallbackWarning)
            out, path = _export(
                args.dir,
                args.out,
                args.step,
                bool(getattr(args, "force", False)),
                None,
                bool(getattr(args, "merged", False)),
                getattr(args, "dtype", None),
            )
        for w in caught:
            print(f"resilient-ckpt export: warning: {w.message}", file=sys.stderr)
    except CheckpointError as e:
        from ..cli_export import node_part_hint

        print(f"resilient-ckpt export: {e}{node_part_hint(args)}", file=sys.stderr)
        return 1
    print(f"exported {path} (step {read_manifest(path).step}) to {out}")
    return 0
