"""Whether a restored value equals the live one it would replace (NaN equals NaN, arrays
and tensors element-wise), for the checks that name what a restore changes (:mod:`.inplace`,
:mod:`.scheduler_settings`).

Which ranks call what: any rank; nothing collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def same_value(a: Any, b: Any) -> bool:
    """Whether a restored value equals the live one it would replace: NaN equals NaN, arrays
    and tensors compare element-wise (``==`` on them is no truth value), containers item by
    item."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        nan = a.dtype.is_floating_point or a.dtype.is_complex
        return bool(((a == b) | (a.isnan() & b.isnan()) if nan else a == b).all())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_value(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # no truth value (a tensor, say)
        return False
