"""The exception hierarchy (errors.py): every error crosses a process boundary intact."""

from __future__ import annotations

import errno
import pickle

import pytest

from resilient_callbacks import errors


def _instances() -> list[BaseException]:
    """One of each error class, built as the library builds it."""
    out: list[BaseException] = []
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
            continue
        if cls is errors.UploadIncompleteError:
            out.append(cls("2 checkpoint(s) never reached", ("step_1", "step_2"), "/d", "s3://b"))
        elif cls is errors.CheckpointWriteError:
            out.append(cls("rank 1: [Errno 28] No space left on device", (1,)))
        else:
            out.append(cls(f"a {name}"))
    return out


@pytest.mark.parametrize("e", _instances(), ids=lambda e: type(e).__name__)
def test_every_error_survives_pickling(e):
    """Exceptions are pickled across process boundaries (a ProcessPoolExecutor, a
    multiprocessing pool or Ray running a training trial): UploadIncompleteError took more
    arguments than it passed to its base, so unpickling it failed with a TypeError (the pool
    reported a result that could not be unpickled, not the error that told what to push)."""
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e)
    assert str(back) == str(e)
    assert vars(back) == vars(e)
    if isinstance(e, errors.UploadIncompleteError):
        assert (back.pending, back.dirpath, back.url) == (("step_1", "step_2"), "/d", "s3://b")
    if isinstance(e, errors.CheckpointWriteError):
        assert (back.failed_ranks, back.errno) == ((1,), errno.ENOSPC)
