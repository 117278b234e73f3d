"""Unusual content of a training state, against what ``torch.save``/``torch.load`` keeps: views
that share bytes but not values, tensor subclasses, arrays in another byte order, and tensors
restored into placeholders. Each comes back exactly or is refused at save, naming its key."""

from __future__ import annotations

import collections
import sys
from collections.abc import MutableMapping

import numpy as np
import pytest
import torch

from resilient_callbacks import (
    Checkpointer,
    CheckpointMismatchError,
    PerRank,
    UnsupportedStateError,
)


def _save(dirpath, state, **kw):
    with Checkpointer(dirpath, **kw) as ck:
        assert ck.save(1, state) is True
        ck.flush()


def _restore(dirpath, state, **kw):
    with Checkpointer(dirpath, **kw) as ck:
        return ck.restore(state)


def test_a_conjugate_or_negative_view_is_not_taken_for_its_base(tmp_path):
    """``c.conj()`` and ``x._neg_view()`` view the same bytes as ``c`` and ``x`` with the same
    shape and strides, but read other values (a lazy conjugate/negative bit): they were stored
    as aliases of their base, and came back as the base's values, with no error."""
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0])
    state = {"c": c, "cc": c.conj(), "x": x, "nx": x._neg_view()}
    _save(tmp_path / "ck", state)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    _restore(tmp_path / "ck", live)
    for k, v in state.items():
        assert torch.equal(live[k], v.resolve_conj().resolve_neg()), k


def _two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.ones(2), torch.zeros(2))


@pytest.mark.parametrize(
    "make, hint",
    [
        (_two_tensor, "TwoTensor that holds no memory of its own"),
        (lambda: torch._efficientzerotensor(3), "an efficient zero tensor"),
        (lambda: np.arange(3, dtype=">i4"), "byte order; convert it (.astype('int32'))"),
    ],
    ids=["wrapper-subclass", "zero-tensor", "big-endian-array"],
)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_values_that_failed_inside_the_write_are_refused_by_name(tmp_path, make, hint, async_save):
    """A wrapper tensor subclass or a zero tensor (no storage of its own) and a NumPy array in
    the other byte order failed as a CheckpointWriteError quoting torch's internals ("invalid
    python storage", "byte order different from the native"), naming no key and no fix."""
    with Checkpointer(tmp_path / "ck", async_save=async_save) as ck:
        with pytest.raises(UnsupportedStateError) as ei:
            ck.save(1, {"extra": {"x": make()}})
        assert "state['extra']['x']" in str(ei.value) and hint in str(ei.value)
        assert ck.checkpoints() == []


def test_tensors_restored_into_placeholders_do_not_view_the_checkpoint_file(tmp_path, caplog):
    """A tensor restored where the live state had a placeholder (``None``, a plain value) was
    put there as a view of the mapped checkpoint file: once retention deleted that checkpoint,
    its disk space stayed in use for as long as the state held it, and the restore logged a
    warning about FileParts the state did not have. Aliases still come back as one tensor."""
    from resilient_callbacks import mapped

    t = torch.arange(6.0)
    _save(tmp_path / "ck", {"a": t, "b": t, "c": {"d": t}, "w": torch.ones(3), "n": [t]})
    live = {"a": None, "b": None, "c": {"d": 0}, "w": torch.zeros(3), "n": None}
    with caplog.at_level("WARNING", logger="resilient_callbacks"):
        _restore(tmp_path / "ck", live)
    assert "still view" not in caplog.text
    assert live["a"] is live["b"] is live["c"]["d"] is live["n"][0]
    assert torch.equal(live["a"], t) and not mapped.is_mapped(live["a"])
    assert mapped.still_mapped(str(tmp_path / "ck")) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda p1, p2: {"a/b": p1, "a": {"b": p2}},
        lambda p1, p2: {"parts": {1: p1, "1": p2}},
    ],
    ids=["slash-in-key", "int-and-str-key"],
)
def test_two_parts_whose_ids_collide_are_refused_at_save(tmp_path, make):
    """A FilePart's folder (and a PerRank's entry) is named by its keys joined with '/': two
    parts at ``state['a/b']`` and ``state['a']['b']`` (or at keys ``1`` and ``'1'``) got one
    id, one part's files were never written, and the restore left it as it was, silently."""
    from test_seams_filepart import ToyShards

    p1, p2 = ToyShards(), ToyShards()
    for state in (make(p1, p2), make(PerRank(torch.ones(2)), PerRank(torch.zeros(2)))):
        with Checkpointer(tmp_path / "ck") as ck:
            with pytest.raises(UnsupportedStateError, match="would share the id") as ei:
                ck.save(1, state)
            assert ck.checkpoints() == []
        assert "Rename one of the keys" in str(ei.value)


def test_a_restore_into_tensors_on_the_meta_device_is_refused(tmp_path):
    """A model built on the meta device (or a bare meta tensor in the state) "restored"
    without an error: copying into a meta tensor does nothing, so the run went on with no
    weights (torch only warned, per parameter, for a module; not at all for a tensor)."""
    _save(tmp_path / "ck", {"m": torch.nn.Linear(2, 2), "t": torch.ones(2)})
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    live = {"m": model, "t": torch.empty(2, device="meta")}
    with pytest.raises(CheckpointMismatchError, match="meta device") as ei:
        _restore(tmp_path / "ck", live)
    assert "state['m']: 'weight', 'bias' are on the meta device" in str(ei.value)
    assert "state['t'] is on the meta device" in str(ei.value)
    assert "to_empty" in str(ei.value)


@pytest.mark.parametrize("where", ["value", "key"])
def test_an_int_too_long_for_a_json_reader_is_refused_by_name(tmp_path, where):
    """Python's int() and json.loads() refuse integers of over 4300 digits: an int that long
    failed inside the write naming no key (or, saved by a process that had raised the limit,
    would have failed at every resume)."""
    big = 10**4400
    value = {"x": big} if where == "value" else {"x": {big: 1}}
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(UnsupportedStateError, match=r"digits\. Store it as a str") as ei:
            ck.save(1, {"extra": value})
        assert "state['extra']['x']" in str(ei.value)
        assert ck.checkpoints() == []
    # within the limit: restored exactly (10**4300 - 1 has 4300 digits, and 14284 bits: its
    # bit length alone had it refused)
    ok = {"extra": {"x": 10**4200, "y": -(2**14000), "z": -(10**4300 - 1)}}
    _save(tmp_path / "ck2", ok)
    live = {"extra": {}}
    _restore(tmp_path / "ck2", live)
    assert live == ok


def test_a_container_that_holds_itself_is_refused_by_name(tmp_path):
    """A dict or list that holds itself (``d["self"] = d``; torch.save keeps such cycles)
    recursed until Python's limit and failed inside the write as a RecursionError naming no
    key, as did a state nested too deeply. The same list at two places is no cycle and still
    saves."""
    cyclic = {"epoch": 1}
    cyclic["self"] = cyclic
    loop = []
    loop.append(loop)
    for value, where in ((cyclic, "state['extra']['self']"), (loop, "state['extra'][0]")):
        with Checkpointer(tmp_path / "ck") as ck:
            with pytest.raises(UnsupportedStateError, match="holds itself") as ei:
                ck.save(1, {"extra": value})
            assert ck.checkpoints() == []
        assert str(ei.value).startswith(where)
    deep: list = []
    for _ in range(2 * sys.getrecursionlimit()):  # no cycle, but too deep to walk
        deep = [deep]
    too_deep = pytest.raises(UnsupportedStateError, match="nested deeper than Python's")
    with Checkpointer(tmp_path / "ck") as ck, too_deep:
        ck.save(1, {"extra": deep})
    twice = [1, 2]
    _save(tmp_path / "ok", {"a": twice, "b": (twice, twice)})
    live = {"a": None, "b": None}
    _restore(tmp_path / "ok", live)
    assert live == {"a": [1, 2], "b": ([1, 2], [1, 2])}


def test_a_dict_of_plain_values_is_restored_in_the_saved_order(tmp_path):
    """A dict of plain values is merged into the live one in place; its keys kept the live
    dict's order, not the saved one, so a loop over it (a float sum of its values) could
    compute other bits than the uninterrupted run."""
    _save(tmp_path / "ck", {"extra": {"a": 0.1, "b": 0.2, "c": {"y": 1e16, "x": 1.0}}})
    inner = {"x": 0, "y": 0}
    live = {"extra": {"c": inner, "b": 0, "a": 0}}
    _restore(tmp_path / "ck", live)
    assert list(live["extra"]) == ["a", "b", "c"] and list(inner) == ["y", "x"]
    assert live["extra"]["c"] is inner and inner == {"y": 1e16, "x": 1.0}


def test_a_key_that_is_no_valid_unicode_still_makes_a_standard_safetensors_file(tmp_path):
    """A str key holding a lone surrogate (text decoded with ``surrogateescape``, say) named
    its tensor in the safetensors header as it was: the reference reader refused the file
    ("invalid JSON in header"), though the files are meant for any safetensors reader."""
    import safetensors.torch

    key = "loss_\udcff"
    _save(tmp_path / "ck", {key: torch.ones(2)})
    files = list(tmp_path.glob("ck/step_*/shared.safetensors"))
    loaded = safetensors.torch.load_file(files[0])
    assert [torch.equal(t, torch.ones(2)) for t in loaded.values()] == [True]
    live = {key: None}
    _restore(tmp_path / "ck", live)
    assert torch.equal(live[key], torch.ones(2))


def test_a_restore_into_an_expanded_tensor_is_refused_before_anything_loads(tmp_path):
    """A live tensor made by expand() (stride 0) cannot take other values per element: copy_
    into it raised torch's RuntimeError, naming no key, after the objects before it in the
    state had been loaded."""
    model = torch.nn.Linear(2, 2)
    _save(tmp_path / "ck", {"model": model, "pos": torch.arange(6.0).reshape(2, 3)})
    fresh = torch.nn.Linear(2, 2)
    before = fresh.weight.detach().clone()
    live = {"model": fresh, "pos": torch.zeros(3).expand(2, 3)}
    with pytest.raises(CheckpointMismatchError, match=r"state\['pos'\] is an expanded tensor"):
        _restore(tmp_path / "ck", live)
    assert torch.equal(fresh.weight, before)  # nothing loaded


class _FixedKeys(MutableMapping):
    """A mapping whose keys are fixed at construction (a config in 'struct' mode): values
    change, keys are never added or removed."""

    def __init__(self, **values):
        self._d = dict(values)

    def __getitem__(self, k):
        return self._d[k]

    def __setitem__(self, k, v):
        if k not in self._d:
            raise KeyError(f"{k!r}: no new keys")
        self._d[k] = v

    def __delitem__(self, k):
        raise TypeError("keys are fixed")

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def test_a_mapping_with_fixed_keys_in_another_order_is_restored_in_its_own(tmp_path):
    """The saved-order restore popped and re-set every key of any mapping whose order differed:
    one that cannot drop a key (a struct-mode config) made the restore fail, where it had
    restored its values before; a dict subclass still takes the saved order."""
    _save(tmp_path / "ck", {"cfg": {"lr": 0.5, "wd": 0.1}, "d": {"a": 1, "b": 2}})
    cfg = _FixedKeys(wd=0.0, lr=0.0)
    d = collections.defaultdict(int, b=0, a=0)
    live = {"cfg": cfg, "d": d}
    _restore(tmp_path / "ck", live)
    assert live["cfg"] is cfg and dict(cfg) == {"wd": 0.1, "lr": 0.5}
    assert live["d"] is d and list(d) == ["a", "b"] and d == {"a": 1, "b": 2}


class _MayLack(dict):
    """A state dict whose entries named in ``optional`` may be absent from a checkpoint (an
    adapter's newer version saving what its older checkpoints lack: DeepSpeed's
    ``ModuleExtras``)."""

    optional = frozenset({"new"})

    def missing_allowed(self, missing):
        return set(missing) <= self.optional


def test_a_state_may_allow_entries_its_older_checkpoints_lack(tmp_path):
    """``missing_allowed(missing)``: entries the checkpoint lacks that the state says it may
    lack keep their live values; any other missing entry is refused as before."""
    _save(tmp_path / "ck", {"m": {"old": torch.ones(2)}})
    live = _MayLack(old=torch.zeros(2), new=torch.full((2,), 7.0))
    assert _restore(tmp_path / "ck", {"m": live}) == 1
    assert torch.equal(live["old"], torch.ones(2)) and torch.equal(
        live["new"], torch.full((2,), 7.0)
    )
    other = _MayLack(old=torch.zeros(2), other=torch.zeros(2))
    with pytest.raises(CheckpointMismatchError, match="missing keys in checkpoint: 'other'"):
        _restore(tmp_path / "ck", {"m": other})


class _Kind:
    """A stateful object that records a kind and refuses a checkpoint of another one
    (``refuse_saved``, as DeepSpeed's engine counters refuse a dtype change at ZeRO 0)."""

    def __init__(self, kind):
        self.kind = kind

    def state_dict(self):
        return {"kind": self.kind}

    def load_state_dict(self, state):
        self.kind = state["kind"]

    def refuse_saved(self, saved):
        if saved.get("kind") != self.kind:
            raise CheckpointMismatchError(f"saved as {saved.get('kind')}, {self.kind} here")


def test_a_stateful_object_may_refuse_a_checkpoint_before_other_problems_are_listed(tmp_path):
    """``refuse_saved(saved)``: its error is the restore's, before the other objects' problems
    are listed (an optimizer of another class, here after it in the state) and before anything
    loads; a checkpoint it accepts restores as before."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters())
    _save(tmp_path / "ck", {"model": model, "opt": opt, "kind": _Kind("a")})
    fresh = torch.nn.Linear(2, 2)
    before = fresh.weight.detach().clone()
    live = {"model": fresh, "opt": torch.optim.Adam(fresh.parameters()), "kind": _Kind("b")}
    with pytest.raises(CheckpointMismatchError, match="saved as a, b here") as e:
        _restore(tmp_path / "ck", live)
    assert "does not fit" not in str(e.value) and live["kind"].kind == "b"
    assert torch.equal(fresh.weight, before)  # nothing loaded
    same = {"model": fresh, "opt": torch.optim.SGD(fresh.parameters()), "kind": _Kind("a")}
    assert _restore(tmp_path / "ck", same) == 1 and torch.equal(fresh.weight, model.weight)
