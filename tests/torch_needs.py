"""What tests need of torch beyond the package's floor (2.4): ``resilient_callbacks.dcp`` needs a
newer torch (its ImportError says which). On an older torch the files built on it are not
collected (tests/conftest.py) and the tests elsewhere that use it skip, saying why."""

from __future__ import annotations

import pytest

try:
    import resilient_callbacks.dcp  # noqa: F401

    DCP_MISSING = ""
except ImportError as e:
    DCP_MISSING = str(e)

needs_dcp = pytest.mark.skipif(bool(DCP_MISSING), reason=DCP_MISSING)
