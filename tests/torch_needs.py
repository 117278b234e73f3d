"""What tests need of torch beyond the package's floor (2.4): ``resilient_callbacks.dcp`` needs a
newer torch (its ImportError says which). On an older torch the files built on it are not
collected (tests/conftest.py) and the tests elsewhere that use it skip, saying why. The
Transformers Trainer needs torch >= 2.5 (transformers 5 disables its PyTorch support below it):
the tests outside the Transformers files that run a Trainer skip there."""

from __future__ import annotations

import pytest
import torch

from resilient_callbacks._version import release

try:
    import resilient_callbacks.dcp  # noqa: F401

    DCP_MISSING = ""
except ImportError as e:
    DCP_MISSING = str(e)

needs_dcp = pytest.mark.skipif(bool(DCP_MISSING), reason=DCP_MISSING)

TRANSFORMERS_MISSING = (
    ""
    if release(torch.__version__) >= (2, 5)
    else "transformers 5 disables its PyTorch support below torch 2.5"
)
needs_transformers = pytest.mark.skipif(bool(TRANSFORMERS_MISSING), reason=TRANSFORMERS_MISSING)
