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


@pytest.mark.parametrize("e", _instances(), ids=lambda e: type(e).__name__)
def test_an_error_relayed_from_rank_0_names_its_class_once_and_the_rank(e):
    """What the other ranks raise for rank 0's error, by class name and message (a restore's
    listing, the directory's opening, the DCP reader's): it said "on rank 0: <its text>", and
    the DCP reader's text held the class name again ("CheckpointNotFoundError: on rank 0:
    CheckpointNotFoundError: no checkpoints in DIR")."""
    name = type(e).__name__
    got = errors.relayed(name, str(e))
    if isinstance(e, errors.UploadIncompleteError):  # (built of more than a message)
        assert type(got) is errors.CheckpointError and str(got) == f"rank 0 reported: {name}: {e}"
    else:
        assert type(got) is type(e) and str(got) == f"rank 0 reported: {e}"
    assert f"{type(got).__name__}: {got}".count(name) == 1 + str(e).count(name)


def test_an_error_of_another_class_relayed_keeps_its_name_in_the_text():
    got = errors.relayed(
        "PermissionError", "[Errno 13] denied: '/d'", 2, errors.CheckpointNotFoundError
    )
    assert type(got) is errors.CheckpointNotFoundError
    assert str(got) == "rank 2 reported: PermissionError: [Errno 13] denied: '/d'"
    assert type(errors.relayed("KeyError", "x")) is errors.CheckpointError
