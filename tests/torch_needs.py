"""What tests need of torch beyond the package's floor (2.4): ``resilient_callbacks.dcp`` needs a
newer torch (``DCP_NEEDS_TORCH``; its ImportError says which). On an older torch the files built
on it are not collected (tests/conftest.py) and the tests elsewhere that use it skip, saying why. The
Transformers Trainer needs torch >= 2.5 (transformers 5 disables its PyTorch support below it):
the tests outside the Transformers files that run a Trainer skip there."""

from __future__ import annotations

import pytest
import torch

from resilient_callbacks._version import DCP_NEEDS_TORCH, release

# By the version, as resilient_callbacks.dcp checks it. Imported here (for its ImportError), it
# cost every test process 1-3 s (torch.distributed.checkpoint, DTensor), also those that never
# use it; and a failing import on a torch that has what it needs hid the files built on it
# (not collected) where it now fails them.
DCP_MISSING = (
    ""
    if release(torch.__version__) >= DCP_NEEDS_TORCH
    else f"resilient_callbacks.dcp needs torch >= {'.'.join(map(str, DCP_NEEDS_TORCH))}, found "
    f"torch {torch.__version__}"
)

needs_dcp = pytest.mark.skipif(bool(DCP_MISSING), reason=DCP_MISSING)

TRANSFORMERS_MISSING = (
    ""
    if release(torch.__version__) >= (2, 5)
    else "transformers 5 disables its PyTorch support below torch 2.5"
)
needs_transformers = pytest.mark.skipif(bool(TRANSFORMERS_MISSING), reason=TRANSFORMERS_MISSING)
