"""The library's own work on the training thread leaves the user's global random streams alone.

Importing an fsspec backend can draw from Python's global RNG (aiobotocore imports httpx, which
imports rich, which calls ``random.getrandbits`` at import): a run with ``remote=`` then saw other
random numbers than the same run without it, from step 1.
"""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from resilient_callbacks import rng


def test_preserved_restores_python_numpy_and_torch():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with rng.preserved():
        random.random(), np.random.rand(3), torch.rand(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


_CHILD = r"""
import random, sys
random.seed(7)
want = random.random()
random.seed(7)
from resilient_callbacks.remote import RemoteStore
RemoteStore("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"})
got = random.random()
print("same" if got == want else f"changed: {got!r} != {want!r}")
"""


def test_creating_an_s3_remote_leaves_the_global_rng_alone():
    pytest.importorskip("s3fs")
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "same"
