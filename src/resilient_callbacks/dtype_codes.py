"""The safetensors dtype codes a checkpoint stores, by the name torch gives each dtype.

Standard library only: what reads a checkpoint's headers without torch (``resilient-ckpt
inspect``) names its dtypes from here; :mod:`.dtypes` maps torch's dtypes through it.
"""

from __future__ import annotations

# torch's name of a dtype -> its safetensors code; the last ones not in every torch version
ST_CODES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
}
_NAMES = {code: name for name, code in ST_CODES.items()}


def dtype_name(code: str) -> str:
    """A safetensors dtype code as torch names the dtype (``"F32"`` -> ``"float32"``); a code
    not stored by a checkpoint, as it is."""
    return _NAMES.get(code, str(code))
