"""Whole tensors out of a :class:`Sharded` part, for export: every rank's saved boxes of each
model tensor, verified and laid side by side, in one process, without a process group or the model
(``resilient-ckpt export``, and the Transformers adapter's ``from_pretrained`` export of a run
under the Trainer's FSDP).

Which ranks call what: one process, any number of ranks saved it; nothing here is collective.
"""

from __future__ import annotations

import logging

import torch

from ..errors import CheckpointCorruptError, warn_and_log
from ..manifest import Manifest
from ..part_names import PARTS_EXTRA, stored_dir
from ..part_reads import read_part_tensors
from .assemble import assemble, tensor_file
from .chunks import Box, unescape
from .views import MODEL

log = logging.getLogger("resilient_callbacks")


def model_tensors(path: str, manifest: Manifest, part_id: str) -> dict[str, torch.Tensor]:
    """The model's whole tensors (state dict keys as ``get_model_state_dict`` gives them, dtypes
    as saved) from every rank's boxes of part ``part_id`` of the checkpoint at ``path``, and
    the tensors that were not sharded (buffers, a tensor-parallel plan's replicated layers,
    DDP) from rank 0's file; each rank file read is verified first, and a tensor the boxes do
    not cover exactly is an error."""
    index = manifest.extra[PARTS_EXTRA][part_id].get("tensors")
    if not isinstance(index, dict):
        raise CheckpointCorruptError(f"{path}: part {part_id!r} records no tensor index")
    names = sorted(n for n in index if n.startswith(MODEL))
    entries = {f.path: f for f in manifest.files}
    files: dict[int, dict[str, torch.Tensor]] = {}

    def read(r: int) -> dict[str, torch.Tensor]:
        if r not in files:
            rel = f"{stored_dir(manifest, part_id)}/{tensor_file(r)}"
            if rel not in entries:
                raise CheckpointCorruptError(f"{path}: the manifest does not list {rel}")
            files[r] = read_part_tensors(path, manifest, entries[rel])
        return files[r]

    for name in names:
        for r, *_ in index[name]["chunks"]:
            read(int(r))
    chunk_keys = {str(c[-1]) for n in index.values() for c in n.get("chunks", [])}
    plain = sorted(k for k in read(0) if k.startswith(MODEL) and k not in chunk_keys)
    if not names and not plain:
        raise CheckpointCorruptError(f"{path}: part {part_id!r} holds no model tensors")
    mapped = {id(v) for f in files.values() for v in f.values()}
    out: dict[str, torch.Tensor] = {}
    for name in plain:  # the same on every rank (or rank 0's, as a DDP export takes it)
        out[unescape(name[len(MODEL) :])] = files[0][name].clone()
    _say_differing(plain, files)
    for name in names:
        entry = index[name]
        whole = Box.of([0] * len(entry["shape"]), [int(d) for d in entry["shape"]])
        # assemble's copy when pieces are laid together; a clone when one chunk is the whole
        # tensor (a view of the mapped file, which is closed after export)
        t = assemble(name, whole, entry, files)
        out[unescape(name[len(MODEL) :])] = t.clone() if id(t) in mapped else t
    return out


def _say_differing(plain: list[str], files: dict[int, dict[str, torch.Tensor]]) -> None:
    """Warn naming the unsharded tensors whose copies in the rank files read differ from rank
    0's, which the export takes (BatchNorm's statistics, which FSDP does not synchronise)."""
    differ = sorted(
        f"{n} (rank {r})"
        for r, f in files.items()
        for n in plain
        if r and n in f and not _same_bits(f[n], files[0][n])
    )
    if differ:
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        warn_and_log(
            log,
            f"tensors that are not sharded differ between the ranks' files: {', '.join(differ[:5])}"
            f"{more}; the export holds rank 0's",
        )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
