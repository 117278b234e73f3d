"""The tensor dtypes a checkpoint stores, and their safetensors codes.

Every dtype here is one that the safetensors format names and its own readers map to the same
torch dtype (so any safetensors reader opens our files): the float, integer and bool types,
the float8 formats, and ``complex64``. Others (``complex128``, ``complex32``, ``float8_e8m0fnu``,
the packed 4-bit and bit types) are refused at save time, naming the tensor.
"""

from __future__ import annotations

import torch

from .dtype_codes import ST_CODES

# (every torch names those of ST_CODES but the float8 and uint16-64 ones: not in older ones)
DTYPE_TO_ST: dict[torch.dtype, str] = {
    getattr(torch, name): code for name, code in ST_CODES.items() if hasattr(torch, name)
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}


def unsupported(where: str, dtype: torch.dtype) -> str:
    """The message for a tensor whose dtype no checkpoint stores."""
    return (
        f"{where} has dtype {dtype}, which the checkpoint format (safetensors) does not "
        f"store; convert it in your state_dict() (e.g. complex128 -> torch.view_as_real). "
        f"Supported: {', '.join(str(d).removeprefix('torch.') for d in DTYPE_TO_ST)}"
    )
