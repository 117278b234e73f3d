"""PyTorch's own DCP tests, run with ``ResilientStorageWriter`` / ``ResilientStorageReader`` in
place of ``FileSystemWriter`` / ``FileSystemReader`` (and of the fault-injecting storage of
``test_checkpoint.py``). The upstream files are vendored in ``tests/upstream/dcp/``
(``ORIGIN.md`` says from where and the one line that differs); their assertions run as written.

The swap: within each spawned rank (``run_test``) and each in-process test (``run``) the names
``FileSystemWriter`` / ``FileSystemReader`` -- in the vendored module, in
``torch.distributed.checkpoint`` and in its ``_storage_utils`` (``checkpoint_id=<dir>``) --
are our classes, the path becoming the ``dirpath``. Each save is then a new committed
``step_*`` checkpoint in that directory, and each load reads the newest, verified.

(a) ``test_checkpoint.py``'s failure injection: every failure point of a save (set-up, local and
    global plan, write, the write's future, finish; on the coordinator or another rank) raises
    DCP's ``CheckpointException`` naming exactly the failing ranks -- and our checkpoint
    directory holds no new committed checkpoint after it; a save without failures commits one,
    and upstream's load-failure sequence runs against it. In one process (default suite) and
    on 4 gloo ranks (slow).
(b) ``test_file_system_checkpoint_cpu.py``: ShardedTensor state on 2 ranks saved and loaded,
    resharded between 4 sharding specs, ShardedTensor <-> plain tensor, objects (slow).
(c) ``test_dtensor_resharding.py``: DTensor placements and meshes changed between save and load
    (1-D <-> 2-D meshes on 4 ranks; slow).

The test harness (``torch.testing._internal``) ships in the torch wheel; it imports
``expecttest``, which is not a torch dependency: when it is not installed a stub stands in
(only ``assertExpectedInline`` would need it, and no test here calls it). Each upstream test is
run as a ``unittest`` case inside a pytest test which fails on any error, failure or skip: a
failure inside a spawned rank fails the pytest test (the harness gathers the ranks' exit codes
and tracebacks).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import types
import unittest
from typing import Any, ClassVar
from unittest import mock

import pytest

try:
    import expecttest  # noqa: F401  (the harness's base TestCase)
except ImportError:
    _stub = types.ModuleType("expecttest")
    _stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    _stub.ACCEPT = False  # type: ignore[attr-defined]
    sys.modules["expecttest"] = _stub

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._storage_utils as dcp_storage_utils
import torch.testing._internal.distributed._tensor.common_dtensor as common_dtensor
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.distributed._shard.sharded_tensor import with_comms

from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter
from resilient_callbacks.reader import committed

# DTensor tests written for accelerators but not needing them run on CPU ranks (the harness's own
# ``allow_cpu`` switch; they still skip on a machine with fewer accelerators than they need)
_skip_if_lt_x_gpu = common_dtensor.skip_if_lt_x_gpu
with mock.patch.object(
    common_dtensor,
    "skip_if_lt_x_gpu",
    lambda x: _skip_if_lt_x_gpu(x, allow_cpu=True),
):
    from upstream.dcp import checkpoint as up_checkpoint
    from upstream.dcp import dtensor_resharding as up_resharding
    from upstream.dcp import file_system_checkpoint_cpu as up_fs_cpu

# FileSystemWriter's options that only tune its own file layout or threads
_FS_TUNING = {
    "single_file_per_rank",
    "sync_files",
    "thread_count",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
}


class _WriterForPath(ResilientStorageWriter):
    """``FileSystemWriter(path, ...)`` / ``checkpoint_id=path`` -> ``ResilientStorageWriter(path)``."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        if unknown := sorted(set(kwargs) - _FS_TUNING):
            raise TypeError(f"FileSystemWriter options without a counterpart: {unknown}")
        super().__init__(path)

    def reset(self, checkpoint_id: Any = None) -> None:
        if isinstance(checkpoint_id, (str, os.PathLike)) and (
            os.path.abspath(os.fspath(checkpoint_id)) == self.dirpath
        ):
            return  # DCP hands the directory back as the checkpoint_id: ours is a step
        super().reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class _ReaderForPath(ResilientStorageReader):
    """``FileSystemReader(path)`` / ``checkpoint_id=path`` -> ``ResilientStorageReader(path)``."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


@contextlib.contextmanager
def our_storage(*modules: Any):
    with contextlib.ExitStack() as stack:
        for target in (dcp, dcp_storage_utils, *modules):
            for name, ours in (
                ("FileSystemWriter", _WriterForPath),
                ("FileSystemReader", _ReaderForPath),
            ):
                if hasattr(target, name):
                    stack.enter_context(mock.patch.object(target, name, ours))
        yield


class _OurStorage:
    """Mixin: the upstream test runs with our storage, in each spawned rank and in process."""

    __test__ = False  # pytest runs these through the functions below
    upstream: Any = None

    def run_test(self, test_name: str, parent_pipe: Any) -> None:  # a spawned rank
        with our_storage(self.upstream):
            super().run_test(test_name, parent_pipe)  # type: ignore[misc]

    def run(self, result: Any = None) -> Any:  # the pytest process
        with our_storage(self.upstream):
            return super().run(result)  # type: ignore[misc]


def _run(case: type[unittest.TestCase], name: str) -> None:
    """Run one upstream test; an error, a failure (in any rank) or a skip fails."""
    result = unittest.TestResult()
    case(name).run(result)
    problems = [tb for _, tb in result.errors + result.failures]
    assert not problems, "\n".join(problems)
    assert not result.skipped, result.skipped
    assert result.testsRun == 1


# ---------------------------------------------------------------- (a) failure injection

_FAULTY_DIR: list[str] = []  # the checkpoint directory of the faulty storage (upstream gives none)


class _FaultyWriter(up_checkpoint.TestStorageBase, ResilientStorageWriter):
    """Upstream's ``FaultyStorageWriter`` (same failure points and errors) around our writer."""

    made: ClassVar[list[_FaultyWriter]] = []

    def __init__(self, fail_conf: dict) -> None:
        ResilientStorageWriter.__init__(self, _FAULTY_DIR[0])
        up_checkpoint.TestStorageBase.__init__(self, fail_conf)
        self.made.append(self)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._fail_rank("fail_set_up_storage_writer")
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        self._fail_rank("fail_prepare_local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        self._fail_rank("fail_prepare_global_plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._fail_rank("fail_write_data")
        results = super().write_data(plan, planner).wait()
        return self._fail_rank_async("fail_write_data_async", results)

    def finish(self, metadata: Any, results: Any) -> None:
        self._fail_rank("fail_finish")
        super().finish(metadata, results)


class _FaultyReader(up_checkpoint.TestStorageBase, ResilientStorageReader):
    """Upstream's ``FaultyStorageReader`` around our reader (which reads its own metadata)."""

    def __init__(self, metadata: Any, fail_conf: dict) -> None:
        ResilientStorageReader.__init__(self, _FAULTY_DIR[0])
        up_checkpoint.TestStorageBase.__init__(self, fail_conf)

    def read_metadata(self, *args: Any) -> Any:
        # ours is collective (the ranks choose the checkpoint together): every rank takes part
        # before this one fails, or the others would wait in it for the collective timeout
        metadata = super().read_metadata(*args)
        self._fail_rank("fail_read_metadata")
        return metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any) -> None:
        self._fail_rank("fail_set_up_storage_reader")
        super().set_up_storage_reader(metadata, is_coordinator, *args)

    def prepare_local_plan(self, plan: Any) -> Any:
        self._fail_rank("fail_prepare_local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        self._fail_rank("fail_prepare_global_plan")
        return super().prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Any:
        self._fail_rank("fail_read_data")
        super().read_data(plan, planner).wait()
        return self._fail_rank_async("fail_read_data_async")


def _body(method: Any) -> Any:
    """An upstream test's own code, without its accelerator-only decorators."""
    while hasattr(method, "__wrapped__"):
        method = method.__wrapped__
    return method


class _CommitChecks:
    """After each of upstream's saves: a failing one committed nothing, a clean one exactly
    one checkpoint. Then a clean save, and upstream's load sequence against it."""

    def _committed(self) -> int:
        return len(committed(_FAULTY_DIR[0])) if os.path.isdir(_FAULTY_DIR[0]) else 0

    def _test_save(self, state_dict: Any, coordinator: int = 0, **kwargs: Any) -> None:
        before = self._committed()
        super()._test_save(state_dict, coordinator, **kwargs)  # type: ignore[misc]
        if "fail_write_data_async" in kwargs:
            # torch keeps this save's writers alive for good: the failed torch Future (C++)
            # holds the exception, whose traceback holds the writer -- a cycle the collector
            # cannot see. Such a writer keeps its lock until close(), the documented way; the
            # writers of the other failed saves are dropped without close(), as upstream does.
            for writer in _FaultyWriter.made:
                writer.close()
        _FaultyWriter.made.clear()
        if dist.is_initialized():
            dist.barrier()
        self.assertEqual(self._committed(), before + (0 if kwargs else 1), kwargs)  # type: ignore[attr-defined]

    def _state(self, fill: Any) -> dict:
        """The state upstream's load sequence loads into (its no-dist tests: no ShardedTensor)."""
        state: dict = {"replicated": fill((10, 10)), "bytes": [1, 2, 3, 4]}
        if dist.is_initialized():
            state["sharded"] = sharded_tensor.zeros(self.get_spec(), 20, 20)  # type: ignore[attr-defined]
            state["sharded"].local_shards()[0].tensor.copy_(fill((20 // 4, 20)))  # 4 ranks
        return state

    def _run_upstream(self, save_test: str, load_test: str, directory: str) -> None:
        _FAULTY_DIR[:] = [directory]
        upstream = up_checkpoint.TestDistributedFailure
        with (
            mock.patch.object(up_checkpoint, "FaultyStorageWriter", _FaultyWriter),
            mock.patch.object(up_checkpoint, "FaultyStorageReader", _FaultyReader),
        ):
            _body(getattr(upstream, save_test))(self)  # failing saves: none commits
            saved = self._state(torch.rand)
            self._test_save(saved)  # a clean save after them commits
            _body(getattr(upstream, load_test))(self)  # its first, clean load must work
            loaded = self._state(torch.zeros)
            self._test_load(loaded)  # type: ignore[attr-defined]
        for key in ("replicated", "bytes", "sharded"):
            if key in saved:
                a, b = saved[key], loaded[key]
                if key == "sharded":
                    a, b = a.local_shards()[0].tensor, b.local_shards()[0].tensor
                self.assertEqual(a, b, key)  # type: ignore[attr-defined]


class _UpstreamHelpers(TestCase):
    """``TestDistributedFailure``'s helpers, on a test case that spawns nothing."""

    _test_dist_failure = up_checkpoint.TestDistributedFailure._test_dist_failure
    _test_save = up_checkpoint.TestDistributedFailure._test_save
    _test_load = up_checkpoint.TestDistributedFailure._test_load


class NoDistFailureInjection(_CommitChecks, _UpstreamHelpers):
    """Upstream's ``*_error_handling_no_dist`` in this process (upstream spawns 4 processes
    for them, each running the same body without a process group)."""

    __test__ = False

    def test_error_handling_no_dist(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            self._run_upstream(
                "test_save_error_handling_no_dist", "test_load_error_handling_no_dist", d
            )


class FailureInjection(_CommitChecks, up_checkpoint.TestDistributedFailure):
    """Upstream's ``test_save_error_handling`` / ``test_load_error_handling`` (4 ranks; upstream
    runs them on 4 GPUs with NCCL only) on 4 gloo CPU ranks."""

    __test__ = False

    def get_spec(self) -> ChunkShardingSpec:
        # upstream places the shards on "rank:r/<accelerator>:r"; CPU ranks hold them as "rank:r"
        return ChunkShardingSpec(
            dim=0, placements=[f"rank:{r}" for r in range(dist.get_world_size())]
        )

    @with_comms(init_rpc=False, backend="gloo")
    def test_error_handling(self) -> None:
        self._run_upstream(
            "test_save_error_handling",
            "test_load_error_handling",
            self.file_name + ".ckpt",  # the same path on every rank
        )


def test_upstream_failure_injection_no_dist() -> None:
    _run(NoDistFailureInjection, "test_error_handling_no_dist")


@pytest.mark.slow
@pytest.mark.distributed
def test_upstream_failure_injection_4_ranks() -> None:
    _run(FailureInjection, "test_error_handling")


# ---------------------------------------------------------------- (b) ShardedTensor, objects


class SaveLoad(_OurStorage, up_fs_cpu.TestDistributedStateDictSaveLoad):
    upstream = up_fs_cpu


class SaveLoadShardedTensor(
    _OurStorage, up_fs_cpu.TestDistributedStateDictSaveLoadWithSharedTensor
):
    upstream = up_fs_cpu


class ReshardOnLoad(_OurStorage, up_fs_cpu.TestDistributedReshardOnLoad):
    upstream = up_fs_cpu


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "case, name",
    [
        (SaveLoad, "test_read_write_only_tensor_thread_count_1"),
        (SaveLoadShardedTensor, "test_read_write_shard_tensor_thread_count_1"),
        (ReshardOnLoad, "test_load_with_different_shard_plan_thread_count_1"),
        (ReshardOnLoad, "test_save_load_bytes_thread_count_1"),
        # (with upstream's later one-line fix, ORIGIN.md)
        (ReshardOnLoad, "test_switch_between_sharded_tensor_to_tensor_thread_count_1"),
        # not test_load_rowwise_to_colwise: it moves its model to CUDA
    ],
)
def test_upstream_file_system_checkpoint_cpu(case: Any, name: str) -> None:
    _run(case, name)


# ---------------------------------------------------------------- (c) DTensor resharding


class ReshardPlacementChange(_OurStorage, up_resharding.TestDTensorReshardPlacementChange):
    upstream = up_resharding


class ReshardMeshChange(_OurStorage, up_resharding.TestDTensorReshardMeshChange):
    upstream = up_resharding


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "case, name",
    [
        (ReshardPlacementChange, "test_1d_to_1d_reshard_placement_change"),
        (ReshardPlacementChange, "test_2d_to_2d_reshard_placement_change"),
        (ReshardMeshChange, "test_1d_to_2d_reshard_mesh_change"),
        (ReshardMeshChange, "test_2d_to_1d_reshard_mesh_change"),
    ],
)
def test_upstream_dtensor_resharding(case: Any, name: str) -> None:
    _run(case, name)
