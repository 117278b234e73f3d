"""Round-trips of training states through save/restore: formats, aliasing, dtypes, Python and
NumPy values, stateful objects, unsupported objects, mismatches and the no-pickle guarantee."""

from __future__ import annotations

import _pickle
import argparse
import dataclasses
import json
import math
import os
import pickle
import sys
import warnings

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_callbacks import (
    Checkpointer,
    CheckpointMismatchError,
    ResumableSampler,
    UnsupportedStateError,
)
from resilient_callbacks import fit as rc_fit
from resilient_callbacks import inplace as rc_inplace
from resilient_callbacks import rng as rc_rng
from resilient_callbacks import structure as rc_structure
from resilient_callbacks import structure_decode as rc_structure_decode
from resilient_callbacks import tensorfile as rc_tensorfile

# --------------------------------------------------------------------------- helpers

ALL_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _save(dirpath, state, step=1, **kw):
    with Checkpointer(dirpath, **kw) as ck:
        assert ck.save(step, state) is True
        ck.flush()  # saves persist in the background; wait for the commit
        return ck.last_save.path


def _restore(dirpath, state, **kw):
    with Checkpointer(dirpath, **kw) as ck:
        return ck.restore(state)


def _placeholder(obj):
    """Same string-keyed dict skeleton as ``obj``, every other value replaced by None."""
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {k: _placeholder(v) for k, v in obj.items()}
    return None


def _same(a, b, path="state"):
    """Deep equality that distinguishes types, checks tensors exactly (dtype, shape, values)
    and treats NaN as equal to NaN and -0.0 as different from 0.0."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype, f"{path}: dtype {b.dtype} != {a.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{path}: shape {b.shape} != {a.shape}"
        assert torch.equal(a.detach().cpu(), b.detach().cpu()) or (
            a.is_floating_point()
            and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(), b.nan_to_num())
        ), f"{path}: values differ"
        return
    assert type(a) is type(b), f"{path}: type {type(b).__name__} != {type(a).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, (float, np.floating)):
        if math.isnan(a):
            assert math.isnan(b), path
        else:
            assert a == b and math.copysign(1.0, a) == math.copysign(1.0, b), (
                f"{path}: {b!r} != {a!r}"
            )
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(b)} != {list(a)}"
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(b)} != {len(a)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, (set, frozenset)):
        assert a == b, path
    else:
        assert a == b, f"{path}: {b!r} != {a!r}"


class TinyNet(torch.nn.Module):
    def __init__(self, d_in=4, d_hidden=8, d_out=3):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.bn = torch.nn.BatchNorm1d(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class TiedLM(torch.nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        return self.head(self.emb(idx))


# --------------------------------------------------------------------------- file format


def test_files_are_standard_safetensors_and_json(tmp_path):
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "extra": {"epoch": 3}}
    path = _save(tmp_path / "ck", state)
    names = sorted(os.listdir(path))
    assert "shared.safetensors" in names and "shared.json" in names and "manifest.json" in names
    loaded = safetensors.torch.load_file(os.path.join(path, "shared.safetensors"))
    assert any(torch.equal(v, state["w"]) for v in loaded.values())
    for n in names:
        if n.endswith(".json"):
            with open(os.path.join(path, n)) as f:
                json.load(f)  # plain JSON
        else:
            assert n.endswith(".safetensors"), f"unexpected file {n}"
            safetensors.torch.load_file(os.path.join(path, n))
    # no pickle stream anywhere (pickle protocol 2+ starts with b'\x80')
    for n in names:
        with open(os.path.join(path, n), "rb") as f:
            head = f.read(2)
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


# --------------------------------------------------------------------------- values


def _kitchen_sink():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "dtypes": {
            str(d).removeprefix("torch."): (torch.arange(-3, 5) % 3).to(d) for d in ALL_DTYPES
        },
        "transposed": base.t(),
        "slice": base[1:, ::2],
        "expanded": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),
        "narrow_offset": base.view(-1)[5:9],
        "zero_dim": torch.tensor(3.5, dtype=torch.float64),
        "zero_dim_int": torch.tensor(-7),
        "empty": torch.empty(0, 5),
        "empty_int": torch.zeros(3, 0, dtype=torch.int32),
        "nan_tensor": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
        "np_arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_f64_arr": np.linspace(0, 1, 5),
        "np_noncontig": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2],
        "np_bool_arr": np.array([True, False, True]),
        "np_f32": np.float32(1.25),
        "np_f16": np.float16(0.5),
        "np_i64": np.int64(-7),
        "np_u8": np.uint8(250),
        "np_bool": np.bool_(True),
        "int_keys": {1: "one", 2: [1, 2], -5: None},
        "mixed_keys": {"a": 1, 2: "b", (3, 4): "tuple key"},
        "tag_key": {"__rc__": "not a tag", "x": 1},
        "tuple": (1, "a", (2.5, None), ()),
        "none": None,
        "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 1e-300, 1.5],
        "nested": [[1, [2, [3, {"x": 4}]]], [], {}],
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "dtype2": torch.int64,
        "bytes": b"\x00\xff\x80abc",
        "big_int": 2**70,
        "neg_int": -(2**65),
        "bool": False,
        "str": 'h\u00e9llo \u2603 "quoted" \\ back',
        "set": {1, 2, 3},
        "frozenset": frozenset({"a", "b"}),
    }


def test_kitchen_sink_round_trip_into_placeholders(tmp_path):
    state = _kitchen_sink()
    path = _save(tmp_path / "ck", state)
    # every tensor file is readable by the reference implementation
    safetensors.torch.load_file(os.path.join(path, "shared.safetensors"))
    fresh = _placeholder(state)
    assert _restore(tmp_path / "ck", fresh) == 1
    _same(state, fresh)


def test_tensors_restored_in_place_keep_identity(tmp_path):
    src = {
        "dtypes": {str(d): (torch.arange(10) % 2).to(d) for d in ALL_DTYPES},
        "t": torch.randn(3, 4).t(),
        "zero_dim": torch.tensor(1.5),
        "empty": torch.empty(0, 2),
    }
    _save(tmp_path / "ck", src)
    dst = {
        "dtypes": {str(d): torch.zeros(10, dtype=d) for d in ALL_DTYPES},
        "t": torch.zeros(4, 3),
        "zero_dim": torch.tensor(0.0),
        "empty": torch.empty(0, 2),
    }
    ids = {k: id(v) for k, v in dst["dtypes"].items()}
    t_obj = dst["t"]
    _restore(tmp_path / "ck", dst)
    for k, v in dst["dtypes"].items():
        assert id(v) == ids[k], "tensor replaced instead of loaded in place"
        assert torch.equal(v, src["dtypes"][k])
    assert dst["t"] is t_obj and torch.equal(t_obj, src["t"])
    assert dst["zero_dim"].item() == 1.5


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_each_dtype_readable_by_safetensors(tmp_path, dtype):
    t = (torch.arange(-8, 8) * 3).to(dtype).reshape(4, 4)
    path = _save(tmp_path / "ck", {"t": t})
    loaded = safetensors.torch.load_file(os.path.join(path, "shared.safetensors"))
    assert list(loaded) == ["t"]
    assert loaded["t"].dtype == dtype and torch.equal(loaded["t"], t)


def test_zero_dim_numpy_array_keeps_its_shape(tmp_path):
    state = {"a": np.array(2.5, dtype=np.float32), "b": np.array(7, dtype=np.int64)}
    _save(tmp_path / "ck", state)
    fresh = {"a": None, "b": None}
    _restore(tmp_path / "ck", fresh)
    assert isinstance(fresh["a"], np.ndarray) and isinstance(fresh["b"], np.ndarray)
    assert fresh["a"].shape == () and fresh["b"].shape == (), (fresh["a"].shape, fresh["b"].shape)
    assert fresh["a"] == 2.5 and fresh["b"] == 7


@pytest.mark.parametrize(
    "arr",
    [
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.array([5], dtype="timedelta64[s]"),
        np.array([1.5], dtype=np.longdouble),
        np.array([1j], dtype=np.complex64),
        np.array(["text"]),
        np.array([object()]),
    ],
    ids=lambda a: str(a.dtype),
)
def test_a_numpy_array_without_a_saveable_dtype_is_refused_by_name(tmp_path, arr):
    """UnsupportedStateError naming the key and dtype (datetime64, timedelta64 and longdouble
    arrays failed inside the save as a CheckpointWriteError, an OSError)."""
    with pytest.raises(UnsupportedStateError, match=r"state\['when'\] is a NumPy array of dtype"):
        _save(tmp_path / "ck", {"when": arr})


def test_numpy_float64_scalar_keeps_its_type(tmp_path):
    """Other NumPy scalars (float32, int64, bool_) come back with their NumPy type; float64 is
    a subclass of float and must not silently become a Python float."""
    state = {"x": np.float64(0.1), "y": np.float32(0.1)}
    _save(tmp_path / "ck", state)
    fresh = {"x": None, "y": None}
    _restore(tmp_path / "ck", fresh)
    assert type(fresh["y"]) is np.float32
    assert type(fresh["x"]) is np.float64, f"np.float64 came back as {type(fresh['x']).__name__}"


def test_state_key_named_like_safetensors_metadata(tmp_path):
    """A state key that happens to be ``__metadata__`` (the reserved safetensors header key)
    must still round-trip, and the file must stay readable by safetensors."""
    t = torch.arange(4, dtype=torch.float32)
    path = _save(tmp_path / "ck", {"__metadata__": t, "other": t + 1})
    loaded = safetensors.torch.load_file(os.path.join(path, "shared.safetensors"))
    assert len(loaded) == 2
    fresh = {"__metadata__": torch.zeros(4), "other": torch.zeros(4)}
    _restore(tmp_path / "ck", fresh)
    assert torch.equal(fresh["__metadata__"], t)
    assert torch.equal(fresh["other"], t + 1)


# --------------------------------------------------------------------------- aliasing


def test_shared_tensor_saved_once_and_restored_shared(tmp_path):
    t = torch.randn(5, 7)
    path = _save(tmp_path / "ck", {"a": t, "b": t, "c": {"d": t}})
    loaded = safetensors.torch.load_file(os.path.join(path, "shared.safetensors"))
    assert len(loaded) == 1
    assert torch.equal(next(iter(loaded.values())), t)
    fresh = {"a": None, "b": None, "c": {"d": None}}
    _restore(tmp_path / "ck", fresh)
    assert torch.equal(fresh["a"], t)
    assert fresh["a"] is fresh["b"] is fresh["c"]["d"], "aliases were not restored as one tensor"


def test_tied_weights_saved_once_and_tie_survives_restore(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    assert model.head.weight is model.emb.weight
    ref = model.emb.weight.detach().clone()
    path = _save(tmp_path / "ck", {"model": model})
    loaded = safetensors.torch.load_file(os.path.join(path, "shared.safetensors"))
    assert len(loaded) == 1, f"tied weight stored {len(loaded)} times: {list(loaded)}"

    torch.manual_seed(1)
    fresh = TiedLM()
    assert not torch.equal(fresh.emb.weight, ref)
    _restore(tmp_path / "ck", {"model": fresh})
    assert fresh.head.weight is fresh.emb.weight, "the tie was broken by restore"
    assert torch.equal(fresh.emb.weight, ref)
    with torch.no_grad():
        fresh.emb.weight.add_(1.0)
    assert torch.equal(fresh.head.weight, ref + 1.0)


def test_views_of_one_storage_round_trip(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"base": base, "t": base.t(), "row": base[2], "col": base[:, 3], "flat": base.view(-1)}
    path = _save(tmp_path / "ck", state)
    safetensors.torch.load_file(os.path.join(path, "shared.safetensors"))
    fresh = {k: None for k in state}
    _restore(tmp_path / "ck", fresh)
    for k, v in state.items():
        assert fresh[k].shape == v.shape and torch.equal(fresh[k], v), k


# --------------------------------------------------------------------------- stateful objects


def _train_a_bit(model, opt, sched, scaler, steps=3):
    for _ in range(steps):
        x = torch.randn(5, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def _objects(seed):
    """Fresh training objects; ``seed`` only changes the model's initial weights (the sampler's
    seed describes the data, so it must match between the saving and the restoring run)."""
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    sampler = ResumableSampler(37, seed=0)
    return model, opt, sched, scaler, sampler


def test_optimizer_scheduler_scaler_sampler_round_trip(tmp_path):
    model, opt, sched, scaler, sampler = _objects(0)
    _train_a_bit(model, opt, sched, scaler)
    it = iter(sampler)
    consumed = [next(it) for _ in range(11)]
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "sampler": sampler,
        "extra": {"epoch": 3, "consumed": consumed},
    }
    _save(tmp_path / "ck", state)
    remaining = list(it)  # what the original sampler hands out after the save

    model2, opt2, sched2, scaler2, sampler2 = _objects(0)
    torch.manual_seed(123)
    for p in model2.parameters():  # make sure restore really overwrites
        torch.nn.init.normal_(p)
    fresh = {
        "model": model2,
        "optimizer": opt2,
        "scheduler": sched2,
        "scaler": scaler2,
        "sampler": sampler2,
        "extra": {"epoch": 0, "consumed": []},
    }
    params_before = list(model2.parameters())
    assert _restore(tmp_path / "ck", fresh) == 1

    # model
    for (k, a), (k2, b) in zip(
        model.state_dict().items(), model2.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(a, b), k
    # parameters were loaded in place: the optimizer still points at the live parameters
    assert list(model2.parameters()) == params_before
    assert all(
        p is q for p, q in zip(opt2.param_groups[0]["params"], model2.parameters(), strict=True)
    )
    # optimizer
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sd1["state"].keys() == sd2["state"].keys()
    for i in sd1["state"]:
        for k, v in sd1["state"][i].items():
            assert torch.equal(v, sd2["state"][i][k]), (i, k)
    # scheduler and scaler
    assert sched.state_dict() == sched2.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert scaler.state_dict() == scaler2.state_dict()
    # sampler continues exactly where the original one was when saved
    assert fresh["extra"] == {"epoch": 3, "consumed": consumed}
    assert list(iter(sampler2)) == remaining

    # and training continues identically from both
    torch.manual_seed(7)
    _train_a_bit(model, opt, sched, scaler, steps=2)
    torch.manual_seed(7)
    _train_a_bit(model2, opt2, sched2, scaler2, steps=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- no pickle


_PICKLE_EVENTS: list[str] = []
_PICKLE_WATCH = [False]


def _audit(event, args):
    if _PICKLE_WATCH[0] and event == "pickle.find_class":
        _PICKLE_EVENTS.append(f"{event}{args}")


sys.addaudithook(_audit)


def test_no_pickle_anywhere_on_save_and_restore(tmp_path, monkeypatch):
    def forbidden(name):
        def f(*a, **k):
            raise AssertionError(f"{name} was called: checkpoints must not use pickle")

        return f

    for mod, mname in ((pickle, "pickle"), (_pickle, "_pickle")):
        for attr in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
            if hasattr(mod, attr):
                monkeypatch.setattr(mod, attr, forbidden(f"{mname}.{attr}"))
    monkeypatch.setattr(torch, "save", forbidden("torch.save"))
    monkeypatch.setattr(torch, "load", forbidden("torch.load"))
    monkeypatch.setattr(torch.serialization, "save", forbidden("torch.serialization.save"))
    monkeypatch.setattr(torch.serialization, "load", forbidden("torch.serialization.load"))
    monkeypatch.setattr(np, "load", forbidden("np.load"))
    monkeypatch.setattr(np, "save", forbidden("np.save"))

    model, opt, sched, scaler, sampler = _objects(0)
    _train_a_bit(model, opt, sched, scaler)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "sampler": sampler,
        "extra": _kitchen_sink(),
    }
    _PICKLE_WATCH[0] = True
    try:
        _save(tmp_path / "ck", state)
        model2, opt2, sched2, scaler2, sampler2 = _objects(1)
        fresh = {
            "model": model2,
            "optimizer": opt2,
            "scheduler": sched2,
            "scaler": scaler2,
            "sampler": sampler2,
            "extra": _placeholder(state["extra"]),
        }
        assert _restore(tmp_path / "ck", fresh) == 1
    finally:
        _PICKLE_WATCH[0] = False
    assert _PICKLE_EVENTS == []
    _same(state["extra"], fresh["extra"])
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- unsupported


class _NoState:
    def __init__(self):
        self.x = 1


@pytest.mark.parametrize(
    "value, type_hint",
    [(lambda x: x, "function"), (_NoState(), "_NoState"), (object(), "object")],
    ids=["lambda", "custom-class", "object"],
)
def test_unsupported_object_names_path_and_type_and_commits_nothing(tmp_path, value, type_hint):
    d = tmp_path / "ck"
    state = {"model": torch.nn.Linear(2, 2), "extra": {"epoch": 1, "fn": value}}
    with Checkpointer(d) as ck:
        with pytest.raises(UnsupportedStateError) as ei:
            ck.save(5, state)
        msg = str(ei.value)
        assert "state['extra']['fn']" in msg
        assert type_hint in msg
        assert "state_dict()" in msg and "load_state_dict()" in msg  # how to fix it
        assert isinstance(ei.value, TypeError)
        assert ck.checkpoints() == []
    left = [n for n in os.listdir(d) if n.startswith(("step_", ".staging"))]
    assert left == [], f"left behind: {left}"
    # the directory is still usable afterwards
    with Checkpointer(d) as ck:
        assert ck.save(5, {"extra": {"epoch": 1}}) is True


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@dataclasses.dataclass
class _Hparams:
    lr: float = 0.1


@pytest.mark.parametrize(
    "value, fix",
    [
        (torch.utils.data.DataLoader([1, 2]), "ResumableDataLoader"),
        # ResumableDataLoader refuses an IterableDataset: the fix is the dataset's own state
        (torch.utils.data.DataLoader(_Stream()), "IterableDataset _Stream has no position"),
        (argparse.Namespace(lr=0.1), "vars(...)"),
        (_Hparams(), "dataclasses.asdict(...)"),
    ],
    ids=["dataloader", "iterable-dataset", "namespace", "dataclass"],
)
def test_common_unsaveable_objects_get_their_own_fix(tmp_path, value, fix):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(UnsupportedStateError) as ei:
        ck.save(1, {"model": torch.nn.Linear(2, 2), "x": value})
    assert "state['x']" in str(ei.value) and fix in str(ei.value)


def test_unsupported_object_deep_in_a_list(tmp_path):
    with (
        Checkpointer(tmp_path / "ck") as ck,
        pytest.raises(UnsupportedStateError, match=r"state\['a'\]\[1\]\[0\]"),
    ):
        ck.save(1, {"a": [0, [lambda: None]]})


@pytest.mark.parametrize(
    "value, hint",
    [
        (torch.eye(3).to_sparse(), "to_dense"),
        (torch.zeros(2, device="meta"), "meta"),
        (np.array(["a", "b"]), "NumPy array"),
        (np.complex64(1 + 2j), "NumPy scalar"),
    ],
    ids=["sparse", "meta", "np-str-array", "np-complex-scalar"],
)
def test_unsupported_tensors_and_arrays(tmp_path, value, hint):
    d = tmp_path / "ck"
    with Checkpointer(d) as ck:
        with pytest.raises(UnsupportedStateError) as ei:
            ck.save(1, {"extra": {"x": value}})
        assert "state['extra']['x']" in str(ei.value) and hint in str(ei.value)
        assert ck.checkpoints() == []
    assert not [n for n in os.listdir(d) if n.startswith(("step_", ".staging"))]


@pytest.mark.parametrize(
    "value, hint",
    [
        (np.longdouble(1.5), "NumPy scalar of dtype float128"),
        (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), "nested"),
    ],
    ids=["np-longdouble", "nested-tensor"],
)
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_values_that_failed_deep_inside_a_write_are_refused_by_name(
    tmp_path, value, hint, async_save
):
    """A NumPy long double recursed without end (its .item() is a long double again) and a
    nested tensor (its layout reads strided) failed as a write error naming no key."""
    with Checkpointer(tmp_path / "ck", async_save=async_save) as ck:
        with pytest.raises(UnsupportedStateError, match=hint) as ei:
            ck.save(1, {"extra": {"x": value}})
        assert "state['extra']['x']" in str(ei.value)
        assert ck.checkpoints() == []


def test_nested_plain_containers_are_restored_in_place_at_every_depth(tmp_path):
    """A loop that keeps references to containers nested in the state (a history list inside
    ``extra``) sees the restored values, and the next checkpoint holds what it adds after the
    resume. They were replaced by new objects, so the loop's additions never reached a
    checkpoint again."""
    history: list[int] = []
    counters = {"epoch": 0, "seen": {"a": 1}}
    extra = {"history": history, "counters": counters, "pairs": [[1], {"k": [2]}]}
    _save(
        tmp_path / "ck",
        {
            "extra": {
                "history": [1, 2],
                "counters": {"epoch": 2, "seen": {"b": 2}},
                "pairs": [[1, 5], {"k": [2, 6], "j": 0}],
                "new": 7,
            }
        },
    )
    seen, pairs, inner = counters["seen"], extra["pairs"], extra["pairs"][1]
    # a key the live dict has and the checkpoint's had not is removed, and said (it was silent)
    with pytest.warns(UserWarning, match=r"state\['extra'\]\['counters'\]\['seen'\]\['a'\] not in"):
        _restore(tmp_path / "ck", {"extra": extra})
    assert extra["history"] is history and history == [1, 2]
    assert extra["counters"] is counters and counters == {"epoch": 2, "seen": {"b": 2}}
    assert counters["seen"] is seen and extra["pairs"] is pairs and pairs[1] is inner
    assert pairs == [[1, 5], {"k": [2, 6], "j": 0}] and extra["new"] == 7
    history.append(3)
    counters["epoch"] = 3
    _save(tmp_path / "ck2", {"extra": extra})
    again: dict = {"extra": {"history": [], "counters": {}}}
    _restore(tmp_path / "ck2", again)
    assert again["extra"]["history"] == [1, 2, 3] and again["extra"]["counters"]["epoch"] == 3


@pytest.mark.parametrize(
    "plain", [np.arange(3.0), float("nan"), {"a": [float("nan")]}], ids=["array", "nan", "nested"]
)
def test_a_tuple_holding_a_tensor_and_plain_values_restores(tmp_path, plain):
    """Restoring into a tuple compared each plain item with ``!=``: a NumPy array raised (no
    truth value) and NaN never equals itself, so an unchanged value was refused."""
    _save(tmp_path / "ck", {"pair": (torch.arange(3.0), plain)})
    live = {"pair": (torch.zeros(3), plain)}
    _restore(tmp_path / "ck", live)
    assert torch.equal(live["pair"][0], torch.arange(3.0))


def test_complex128_tensor_is_unsupported_and_commits_nothing(tmp_path):
    d = tmp_path / "ck"
    with (
        Checkpointer(d) as ck,
        pytest.raises(UnsupportedStateError, match=r"state\['z'\].*complex128.*does not store"),
    ):
        ck.save(1, {"z": torch.zeros(3, dtype=torch.complex128)})
    assert not [n for n in os.listdir(d) if n.startswith(("step_", ".staging"))]


def test_complex64_and_float8_fnuz_state_round_trips(tmp_path):
    """complex64 and the fnuz float8 formats, which safetensors stores (they were refused as
    if it did not): a complex parameter trained by Adam, its moments and float8 values come
    back bit for bit, and a plain safetensors reader opens the file."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    opt = torch.optim.Adam([w], lr=0.1)
    (w.abs() ** 2).sum().backward()
    opt.step()
    f8 = {
        n: torch.randn(5).to(getattr(torch, n))
        for n in ("float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    }
    state = {"w": w, "opt": opt, "f8": dict(f8)}
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, state)
    w2 = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.complex64))
    opt2 = torch.optim.Adam([w2], lr=0.1)
    live = {"w": w2, "opt": opt2, "f8": {n: torch.zeros(5, dtype=t.dtype) for n, t in f8.items()}}
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(live) == 1
    assert torch.equal(w2.detach(), w.detach())
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt2.state[w2][k], opt.state[w][k])
    for n, t in f8.items():
        assert live["f8"][n].dtype == t.dtype
        assert torch.equal(live["f8"][n].view(torch.uint8), t.view(torch.uint8))
    shared = tmp_path / "ck" / "step_000000001" / "shared.safetensors"
    assert any(t.dtype == torch.complex64 for t in load_file(str(shared)).values())


def test_module_as_the_whole_state_and_per_rank_single_process(tmp_path):
    from resilient_callbacks import PerRank

    torch.manual_seed(0)
    m = TinyNet()
    _save(tmp_path / "a", m)
    torch.manual_seed(1)
    m2 = TinyNet()
    assert _restore(tmp_path / "a", m2) == 1
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    sampler = ResumableSampler(10, seed=3)
    it = iter(sampler)
    [next(it) for _ in range(4)]
    _save(tmp_path / "b", {"sampler": PerRank(sampler), "rng": PerRank({"pos": 4})})
    s2 = ResumableSampler(10, seed=3)
    st = {"sampler": PerRank(s2), "rng": PerRank({"pos": 0})}
    _restore(tmp_path / "b", st)
    assert list(iter(s2)) == list(it)
    assert st["rng"].obj == {"pos": 4}


# --------------------------------------------------------------------------- mismatch


def test_restore_into_model_with_other_layer_sizes(tmp_path):
    _save(tmp_path / "ck", {"model": TinyNet(d_hidden=8)})
    other = TinyNet(d_hidden=16)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as ei:
        _restore(tmp_path / "ck", {"model": other})
    msg = str(ei.value)
    assert "fc1.weight" in msg and "[8, 4]" in msg and "[16, 4]" in msg
    assert "fc2.weight" in msg
    assert isinstance(ei.value, ValueError)
    # nothing was half-loaded
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_restore_into_other_dtypes_casts_and_says_so(tmp_path):
    """A run resumed in another precision loads (cast, as ``load_state_dict`` casts), with a
    warning naming the tensors: the resume is not exact (found 2026-11-25: silently cast)."""
    saved = TinyNet()
    _save(tmp_path / "ck", {"model": saved, "t": torch.ones(3)})
    model = TinyNet().to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"cast .* not exact: .*fc1.weight'\]: float32 in "):
        _restore(tmp_path / "ck", {"model": model, "t": torch.zeros(3, dtype=torch.float64)})
    assert torch.equal(model.fc1.weight, saved.fc1.weight.to(torch.bfloat16))


def test_the_cast_warning_counts_the_optimizer_state_and_names_the_restore_line(tmp_path):
    """An fp32 checkpoint into a bf16 model and its AdamW: torch's load_state_dict casts the
    moments too (they were not counted), and the warning names the user's restore() line (it
    named checkpointer.py)."""
    saved = TinyNet()
    opt = torch.optim.AdamW(saved.parameters())
    saved(torch.randn(2, 4)).sum().backward()
    opt.step()
    _save(tmp_path / "ck", {"model": saved, "opt": opt})
    model = TinyNet().to(torch.bfloat16)
    live = {"model": model, "opt": torch.optim.AdamW(model.parameters())}
    with Checkpointer(tmp_path / "ck") as ck, pytest.warns(UserWarning, match="cast") as got:
        ck.restore(live)  # the line the warning names
    w = got.list[0]
    assert w.filename == __file__, w.filename
    floats = sum(v.is_floating_point() for v in saved.state_dict().values())
    moments = 2 * len(list(saved.parameters()))  # exp_avg, exp_avg_sq
    assert str(w.message).startswith(f"{floats + moments} tensor(s)"), str(w.message)[:200]


class _Extra(TinyNet):
    def __init__(self):
        super().__init__()
        self.extra_layer = torch.nn.Linear(3, 3)


def test_restore_with_extra_and_missing_keys(tmp_path):
    _save(tmp_path / "ck", {"model": TinyNet()})
    with pytest.raises(CheckpointMismatchError) as ei:
        _restore(tmp_path / "ck", {"model": _Extra()})
    assert "extra_layer.weight" in str(ei.value) and "extra_layer.bias" in str(ei.value)
    assert "missing" in str(ei.value)

    _save(tmp_path / "ck2", {"model": _Extra()})
    with pytest.raises(CheckpointMismatchError) as ei:
        _restore(tmp_path / "ck2", {"model": TinyNet()})
    assert "extra_layer.weight" in str(ei.value) and "unexpected" in str(ei.value)


def test_restore_with_missing_and_unexpected_top_level_keys(tmp_path):
    _save(tmp_path / "ck", {"model": TinyNet(), "extra": {"epoch": 1}})
    with pytest.raises(CheckpointMismatchError) as ei:
        _restore(tmp_path / "ck", {"model": TinyNet(), "extra": {"epoch": 0}, "ema": TinyNet()})
    assert "'ema'" in str(ei.value)
    with pytest.raises(CheckpointMismatchError) as ei:
        _restore(tmp_path / "ck", {"model": TinyNet()})
    assert "'extra'" in str(ei.value)


def test_restore_tensor_with_other_shape(tmp_path):
    _save(tmp_path / "ck", {"t": torch.zeros(3, 4)})
    with pytest.raises(CheckpointMismatchError, match=r"\[3, 4\].*\[4, 3\]"):
        _restore(tmp_path / "ck", {"t": torch.zeros(4, 3)})


# --------------------------------------------------------------------------- property: encode/decode

_keys = st.one_of(st.text(max_size=6), st.sampled_from(["__rc__", "a/b", "@x", "__metadata__"]))
_hkeys = st.one_of(
    st.integers(-5, 5), st.text(max_size=3), st.tuples(st.integers(0, 3), st.text(max_size=2))
)
_tensors = st.builds(
    lambda dt, shape, seed: (
        torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)) * 10
    ).to(dt),
    st.sampled_from(ALL_DTYPES),
    st.lists(st.integers(0, 3), max_size=3),
    st.integers(0, 1000),
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    _tensors,
    st.sampled_from(ALL_DTYPES),
    st.builds(torch.Size, st.lists(st.integers(0, 5), max_size=3)),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
        st.dictionaries(_hkeys, inner, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_values)
def test_property_encode_write_read_decode_round_trip(tmp_path_factory, value):
    shared, local = rc_structure.encode({"v": value}, split_per_rank=False)
    assert local.tensors == {} and local.per_rank == {}
    structure = json.loads(json.dumps(shared.structure, allow_nan=False))  # pure JSON
    path = str(tmp_path_factory.mktemp("st") / "t.safetensors")
    digest = rc_tensorfile.write_tensors(path, shared.tensors, fsync=False)
    tensors = rc_tensorfile.read_tensors_verified(path, digest)
    assert set(tensors) == set(shared.tensors)
    decoded = rc_structure_decode.decode(structure, tensors)
    _same({"v": value}, decoded)
    # and loading into a state skeleton (what restore() does) gives the same values
    target = {"v": _placeholder(value)}
    meta = {k: (str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in tensors.items()}
    rc_fit.check_fits(target, structure, meta)
    rc_inplace.apply(target, structure, lambda n: rc_structure_decode.decode(n, tensors))
    _same({"v": value}, target)


def test_an_optimizer_stepping_tensors_the_state_lacks_is_warned_about_once(tmp_path):
    """fp32 master weights kept apart from a bf16 model, the optimizer over the masters, and
    only model + optimizer in the state: a resume restored the moments and the bf16 weights,
    then the first master -> model copy put the initial weights back, in silence (the
    mixed-precision probe). The first save says so, at the user's line; a state that holds what
    its optimizers step says nothing."""
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master)
    with Checkpointer(tmp_path / "a", async_save=False) as ck:
        with pytest.warns(
            UserWarning, match=r"step 2 tensor\(s\) that the state does not hold"
        ) as got:
            ck.save(1, {"model": model, "opt": opt})  # the line warned at
        assert got.list[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.save(2, {"model": model, "opt": opt})  # once
    with Checkpointer(tmp_path / "b", async_save=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(1, {"model": model, "opt": opt, "master": master})
    plain = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path / "c", async_save=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(1, {"model": plain, "opt": torch.optim.SGD(plain.parameters(), lr=0.1)})


def test_a_generator_in_the_state_is_restored_into_the_live_one(tmp_path):
    """A ``torch.Generator`` (a DataLoader's, one the loop draws noise from) is saved as its
    state and restored with ``set_state`` into the very object the loader holds."""
    g = torch.Generator().manual_seed(7)
    loader = torch.utils.data.DataLoader(list(range(32)), batch_size=4, shuffle=True, generator=g)
    state = {"model": torch.nn.Linear(2, 2), "extra": {"epoch": 1, "gen": g}}
    torch.rand(3, generator=g)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, state)
    expected_noise = torch.rand(5, generator=g)
    expected_order = [b.tolist() for b in loader]
    g.manual_seed(99)  # the live generator moves on; the restore must bring it back
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(state) == 1
    assert state["extra"]["gen"] is g and loader.generator is g
    assert torch.equal(torch.rand(5, generator=g), expected_noise)
    assert [b.tolist() for b in loader] == expected_order


def test_a_generators_state_loads_only_into_one_of_its_device_type():
    g = torch.Generator().manual_seed(1)
    sd = rc_rng.GeneratorState(g).state_dict()
    assert sd["device"] == "cpu" and sd["state"].dtype == torch.uint8
    with pytest.raises(ValueError, match="cuda generator's state; this one is cpu"):
        rc_rng.GeneratorState(g).load_state_dict({**sd, "device": "cuda:0"})


def test_per_rank_state_missing_for_a_new_rank_says_what_to_do():
    """A checkpoint of 2 ranks resumed on 3 (torchrun 2 -> 3) with the loader as a plain
    PerRank(loader): rank 2 has no state, and the refusal asked "was it written with another
    world size?" without saying what makes the resume work. It now names both ways out."""
    shared = {"data": {rc_structure.TAG: "per_rank", "id": "data"}}
    with pytest.raises(CheckpointMismatchError) as e:
        rc_structure_decode.inline_per_rank(shared, {})
    said = str(e.value)
    assert "'data' is missing for this rank" in said
    assert "PerRank(obj, new_ranks='rank0')" in said and "resume on the ranks" in said
