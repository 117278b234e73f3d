"""The tensor dtypes a checkpoint stores, and their safetensors codes.

Every dtype here is one that the safetensors format names and its own readers map to the same
torch dtype (so any safetensors reader opens our files): the float, integer and bool types,
the float8 formats, and ``complex64``. Others (``complex128``, ``complex32``, ``float8_e8m0fnu``,
the packed 4-bit and bit types) are refused at save time, naming the tensor.
"""

from __future__ import annotations

import torch

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _code
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}


def dtype_name(code: str) -> str:
    """A safetensors dtype code as torch names the dtype (``"F32"`` -> ``"float32"``); a code
    no torch dtype here has, as it is."""
    dtype = ST_TO_DTYPE.get(code)
    return str(dtype).removeprefix("torch.") if dtype is not None else str(code)


def unsupported(where: str, dtype: torch.dtype) -> str:
    """The message for a tensor whose dtype no checkpoint stores."""
    return (
        f"{where} has dtype {dtype}, which the checkpoint format (safetensors) does not "
        f"store; convert it in your state_dict() (e.g. complex128 -> torch.view_as_real). "
        f"Supported: {', '.join(str(d).removeprefix('torch.') for d in DTYPE_TO_ST)}"
    )
