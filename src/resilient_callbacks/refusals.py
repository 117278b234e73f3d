"""What a checkpoint cannot hold: each refusal raises :class:`~.errors.UnsupportedStateError`
at save, before anything is written, naming the value's key path (``where``) and saying what
to do, so that nothing fails inside the write or, worse, at a resume weeks later. ``where`` is
the key path as a str, or an object whose ``str()`` is it (:class:`~.structure.KeyPath`:
formatted only for an error, not for every value of every save)."""

from __future__ import annotations

import argparse
from dataclasses import is_dataclass
from typing import Any

import numpy as np
import torch

from .dtypes import DTYPE_TO_ST, unsupported
from .errors import UnsupportedStateError

#: the digits Python's int() and json.loads() accept by default (``sys.int_max_str_digits``):
#: a larger int was saved, and then could not be read by a process with the default limit
INT_DIGITS = 4300
_INT_BITS = int((INT_DIGITS - 1) * 3.3219)  # bits of the largest int surely within them
_INT_TOO_LONG = 10**INT_DIGITS  # the smallest int of more digits


def refuse_int(value: int, where: object) -> None:
    """Refuse an int of more digits than a JSON reader accepts by default (one of exactly
    ``INT_DIGITS`` digits is read back, and saved)."""
    if value.bit_length() > _INT_BITS and abs(value) >= _INT_TOO_LONG:
        raise UnsupportedStateError(
            f"{where} is an int of {value.bit_length()} bits; a JSON reader accepts integers "
            f"of up to {INT_DIGITS} digits. Store it as a str (str(value)) or as bytes "
            "(value.to_bytes(...)), or keep it in a tensor."
        )


def refuse_numpy(obj: np.ndarray | np.generic, where: object) -> None:
    """Refuse a NumPy array or scalar whose dtype a checkpoint does not store (only bool, int
    and float to 64 bits, what safetensors takes), or an array in the other byte order."""
    kind = "array" if isinstance(obj, np.ndarray) else "scalar"
    if obj.dtype.kind not in "biuf" or obj.dtype.itemsize > 8:  # (a long double, say)
        raise UnsupportedStateError(
            f"{where} is a NumPy {kind} of dtype {obj.dtype}; only bool, int and float "
            f"{kind}s (to 64 bits) can be saved (convert: .tolist(), .item(), .astype(...))"
        )
    if not obj.dtype.isnative:  # torch.from_numpy refuses it, deep inside the write
        raise UnsupportedStateError(
            f"{where} is a NumPy {kind} of dtype {obj.dtype.str}, not in this machine's "
            f"byte order; convert it (.astype({obj.dtype.name!r})) to save it"
        )


def refuse_tensor(t: torch.Tensor, where: object) -> None:
    """Refuse a tensor that a checkpoint cannot store exactly: a nested, sparse, quantized or
    meta tensor, a sharded DTensor, a subclass without memory of its own, or a dtype
    safetensors does not name."""
    if t.is_nested:  # its layout reads strided
        raise UnsupportedStateError(
            f"{where} is a nested tensor; save its components (.unbind()) instead."
        )
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedStateError(
            f"{where} is a tensor with layout {t.layout}; only dense (strided) tensors "
            "can be saved. Convert it with .to_dense() in your state_dict()."
        )
    if t.is_quantized:
        raise UnsupportedStateError(
            f"{where} is a quantized tensor; dequantize it (or save its int_repr() "
            "and scale) in your state_dict(). A model converted by torch.ao (quantize_dynamic "
            "to qint8, convert) holds such tensors: keep the float model (or the one prepared "
            "for quantization-aware training, which is saved) in the state and quantize it "
            "again after restore()."
        )
    if t.device.type == "meta":
        raise UnsupportedStateError(
            f"{where} is on the meta device and holds no data; materialize the "
            "module (e.g. to_empty + init) before saving."
        )
    if type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor"):
        raise UnsupportedStateError(
            f"{where} is a sharded DTensor (FSDP2, TP); the plain state holds "
            "replicated and per-rank tensors only. Wrap the sharded model and its optimizer "
            "as resilient_callbacks.dcp.Sharded(model, optimizer): each rank then writes "
            "its own shards (docs/fsdp.md)."
        )
    if t.dtype not in DTYPE_TO_ST:
        raise UnsupportedStateError(unsupported(f"{where} is a tensor that", t.dtype))
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass (functorch's, a tensor of tensors): no bytes
        raise UnsupportedStateError(
            f"{where} is a tensor of type {type(t).__module__}.{type(t).__qualname__} that "
            "holds no memory of its own (a wrapper subclass, an efficient zero tensor); save "
            "plain tensors from your state_dict() (its components, or a .clone() of it) and "
            "rebuild it in load_state_dict()."
        ) from None


def fix_for(obj: Any) -> str:
    """What to do with ``obj``, an object of a type no checkpoint holds."""
    if isinstance(obj, torch.utils.data.DataLoader):
        if isinstance(obj.dataset, torch.utils.data.IterableDataset):
            return (
                f"Its IterableDataset {type(obj.dataset).__name__} has no position a loader "
                "could resume from (ResumableDataLoader takes map-style datasets only): give "
                "the dataset state_dict()/load_state_dict() that save where its stream is, put "
                "the dataset in the state, and use the loader with num_workers=0 and "
                "generator=torch.Generator() (so a resumed run's iterator does not draw from "
                "the global RNG)."
            )
        return (
            "To resume mid-epoch in the same order, build it as resilient_callbacks."
            "ResumableDataLoader (the DataLoader's arguments); under Lightning torchdata's "
            "StatefulDataLoader resumes exactly too (not in a plain loop: docs/data.md)."
        )
    if isinstance(obj, torch.ScriptObject):
        return (
            "A TorchScript object, such as the packed weights of a module quantized by torch.ao "
            "(quantize_dynamic of an LSTM or GRU): keep the float model (or the one prepared "
            "for quantization-aware training, which is saved) in the state and quantize it "
            "again after restore()."
        )
    if isinstance(obj, torch.utils.data.Sampler):
        return (
            "A sampler's position is not saved: to resume mid-epoch in the same order, build "
            "the loader as resilient_callbacks.ResumableDataLoader (its sampler's generator as "
            "generator=). A torch.Generator it draws from can be put in the state itself "
            "(state['sampler_generator'] = sampler.generator), to go on from an epoch's end."
        )
    if isinstance(obj, argparse.Namespace) or is_dataclass(obj):
        kind = "vars(...)" if isinstance(obj, argparse.Namespace) else "dataclasses.asdict(...)"
        return f"Put its values in the state as a dict ({kind}), if they are to be restored."
    return (
        "Give it state_dict() and load_state_dict() methods returning/accepting tensors and "
        "JSON-able values (dict, list, tuple, str, int, float, bool, None), or convert it to "
        "such values before putting it in the state."
    )


#: the loaders ``accelerator.prepare`` and ``accelerator.skip_first_batches`` return for a
#: DataLoader, and their base class (by type: the core does not import accelerate, and they
#: report ``DataLoader`` as their ``__class__``)
_ACCELERATE_LOADERS = (
    "DataLoaderShard",
    "DataLoaderDispatcher",
    "SkipDataLoader",
    "DataLoaderAdapter",
)


def refuse_stateful(obj: Any, where: object) -> None:
    """Refuse a stateful object whose state does not resume exactly: a data loader that
    Hugging Face Accelerate prepared (or ``skip_first_batches`` made: a ``SkipDataLoader``,
    for an iterable dataset). Without ``use_stateful_dataloader`` its ``state_dict()``
    fails inside accelerate; with it, a resumed run draws other batches than the interrupted
    one (its look-ahead and the sampler's seed are not kept right), silently."""
    # (a subclass of one too: its state_dict() is accelerate's)
    cls = next(
        (
            k
            for k in type(obj).__mro__
            if k.__name__ in _ACCELERATE_LOADERS and k.__module__.startswith("accelerate.")
        ),
        None,
    )
    if cls is not None:
        mine = "" if cls is type(obj) else f" ({type(obj).__name__} subclasses it)"
        raise UnsupportedStateError(
            f"{where} is accelerate's {cls.__name__}{mine}, what accelerator.prepare() (or "
            "skip_first_batches()) returns for a DataLoader: its position does not resume exactly (without "
            "use_stateful_dataloader it has no state; with it a resumed run gets other "
            "batches). Put a resilient_callbacks.ResumableDataLoader in the state and iterate "
            "it without passing it to accelerator.prepare(): ResumableDataLoader(dataset, "
            "batch_size, num_replicas=accelerator.num_processes, rank=accelerator."
            "process_index) with several processes, in the state as PerRank(loader), each "
            "batch moved to accelerator.device (docs/accelerate.md)."
        )
