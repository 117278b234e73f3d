"""Whole tensors out of a :class:`Sharded` part, for export: every rank's saved boxes of each
model tensor, verified and laid side by side, in one process, without a process group or the model
(``resilient-ckpt export``, and the Transformers adapter's ``from_pretrained`` export of a run
under the Trainer's FSDP).

Which ranks call what: one process, any number of ranks saved it; nothing here is collective.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointCorruptError
from ..filepart import PARTS_EXTRA, part_dir, parts_of_format, read_part_tensors
from ..manifest import Manifest
from .assemble import assemble, tensor_file
from .chunks import Box, unescape
from .sharded import FORMAT

MODEL = "model/"  # the names of the model's tensors in a Sharded part's index


def sharded_part_ids(manifest: Manifest) -> list[str]:
    """The parts of a checkpoint written by :class:`Sharded`."""
    return parts_of_format(manifest, FORMAT)


def model_tensors(path: str, manifest: Manifest, part_id: str) -> dict[str, torch.Tensor]:
    """The model's whole tensors (state dict keys as ``get_model_state_dict`` gives them, dtypes
    as saved) from every rank's boxes of part ``part_id`` of the checkpoint at ``path``; each
    rank file read is verified first, and a tensor the boxes do not cover exactly is an error."""
    index = manifest.extra[PARTS_EXTRA][part_id].get("tensors")
    if not isinstance(index, dict):
        raise CheckpointCorruptError(f"{path}: part {part_id!r} records no tensor index")
    names = sorted(n for n in index if n.startswith(MODEL))
    if not names:
        raise CheckpointCorruptError(f"{path}: part {part_id!r} holds no model tensors")
    entries = {f.path: f for f in manifest.files}
    files: dict[int, dict[str, torch.Tensor]] = {}
    for name in names:
        for r, *_ in index[name]["chunks"]:
            r = int(r)
            if r in files:
                continue
            rel = f"{part_dir(part_id)}/{tensor_file(r)}"
            if rel not in entries:
                raise CheckpointCorruptError(f"{path}: the manifest does not list {rel}")
            files[r] = read_part_tensors(path, manifest, entries[rel])
    mapped = {id(v) for f in files.values() for v in f.values()}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        entry = index[name]
        whole = Box.of([0] * len(entry["shape"]), [int(d) for d in entry["shape"]])
        # assemble's copy when pieces are laid together; a clone when one chunk is the whole
        # tensor (a view of the mapped file, which is closed after export)
        t = assemble(name, whole, entry, files)
        out[unescape(name[len(MODEL) :])] = t.clone() if id(t) in mapped else t
    return out
