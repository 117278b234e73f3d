"""DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo), real engines, one OS process per rank.

Every scenario runs tests/ds_train.py: a tiny model with dropout, gradient accumulation (2), a
warm-up LR scheduler and AdamW, checkpointed through the ``"resilient_checkpoint"`` section of
its DeepSpeed config. "Exact" means: the per-micro-step losses of every rank and every full
(gathered) fp32 master weight and Adam moment at the end are bit-identical (float.hex) to those
of an uninterrupted run.

- kill/resume: the ranks SIGKILL themselves at a step between two saves; the same command run
  again continues from the newest checkpoint, for ZeRO 0-3 x 1-2 ranks, fp32 and bf16 (a
  subset by default, every combination with ``-m slow``);
- 2 -> 1 and 1 -> 2 ranks, ZeRO 2 and 3: every gathered weight and moment after the restore
  equals what was saved, and training goes on;
- a byte flipped in rank 1's partition file: both ranks fall back to the previous checkpoint,
  loudly, and the run still ends bit-identical;
- SIGTERM -> emergency save -> exit 75 -> resume (with ``pickle.load``/``pickle.loads``/
  ``torch.load`` patched to raise), exact;
- no code change: ``python -m resilient_callbacks.deepspeed.run`` makes plain
  ``deepspeed.initialize`` resilient;
- the section is validated, and removed before DeepSpeed sees the config.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import spawn_ranks
from resilient_callbacks import catalog
from torch_needs import needs_transformers

SCRIPT = Path(__file__).with_name("ds_train.py")
DEADLINE = 300.0  # seconds for one group of ranks


def run_group(
    args: list[str], world: int, workdir: Path, name: str, *, expect: int = 0, module: bool = False
) -> list[str]:
    """Run ds_train.py with ``args`` as ``world`` ranks. ``expect``: the exit status every rank
    must end with (-9 for a run that kills itself: once one rank is gone, the others are
    killed too, as a failed node takes its job down). Returns each rank's output."""
    argv = (
        [sys.executable, "-m", "resilient_callbacks.deepspeed.run"] if module else [sys.executable]
    )
    # each rank forked from a process that imported torch and deepspeed once (not the launcher)
    zygote = None if module else spawn_ranks.shared_zygote("deepspeed", DS_ACCELERATOR="cpu")
    return spawn_ranks.run(
        [*argv, str(SCRIPT), *args],
        world,
        workdir,
        name,
        expect=expect,
        env={"DS_ACCELERATOR": "cpu"},
        deadline=DEADLINE,
        log_name="{name}.rank{rank}.log",
        tail=6000,
        zygote=zygote,
    ).outputs


def committed(dirpath: Path | str) -> list[catalog.Entry]:
    """The valid checkpoints in ``dirpath`` (not a save still in staging when killed)."""
    return [e for e in catalog.scan(str(dirpath), catalog.Depth.FULL) if str(e.status) == "valid"]


def losses(prefix: Path, rank: int) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in Path(f"{prefix}.rank{rank}.losses").read_text().splitlines():
        micro, loss = line.split()
        out[int(micro)] = loss  # a re-trained micro-step overwrites the killed run's value
    return out


def restored(prefix: Path, rank: int = 0) -> dict[str, object]:
    """What the newest run of ds_train.py with this prefix restored (step and path)."""
    lines = Path(f"{prefix}.rank{rank}.restored").read_text().splitlines()
    return json.loads(lines[-1])


def final(prefix: Path) -> dict[str, list[str]]:
    return json.loads(Path(f"{prefix}.rank0.final.json").read_text())


def assert_same_run(a: Path, b: Path, world: int) -> None:
    for r in range(world):
        la, lb = losses(a, r), losses(b, r)
        assert la == lb, f"rank {r}: per-step losses differ at micro-steps " + str(
            [k for k in la if la[k] != lb.get(k)][:5]
        )
    fa, fb = final(a), final(b)
    assert fa.keys() == fb.keys()
    differ = [k for k in fa if fa[k] != fb[k]]
    assert not differ, f"final state differs: {differ[:5]}"


def _opts(stage: int, dtype: str, steps: int = 10, every: int = 3) -> list[str]:
    return ["--stage", str(stage), "--dtype", dtype, "--steps", str(steps), "--every", str(every)]


_REFERENCES: dict[tuple[int, int, str], Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run of ``_opts(stage, dtype)`` on ``world`` ranks (made once per
    module, shared by the tests that compare against it); returns its output prefix."""

    def get(stage: int, world: int, dtype: str) -> Path:
        key = (stage, world, dtype)
        if key not in _REFERENCES:
            d = tmp_path_factory.mktemp(f"ref-zero{stage}-{world}-{dtype}")
            run_group(
                ["--dir", str(d / "ck"), "--out", str(d / "full"), *_opts(stage, dtype)],
                world,
                d,
                "full",
            )
            _REFERENCES[key] = d / "full"
        return _REFERENCES[key]

    return get


# the rest: -m slow (suite time budget). fp16 runs on the CPU with DeepSpeed's accelerator told
# that it may (tests/ds_train.py: allow_fp16_on_cpu), with a dynamic loss scale that overflows
# and skips steps, so the scaler's whole state must come back.
# ZeRO 3 runs by default through Lightning's DeepSpeedStrategy (tests/test_lightning.py).
DEFAULT_CASES = {(2, 2, "fp32")}  # the rest: -m slow (suite time budget)
CASES = [
    pytest.param(
        s,
        w,
        d,
        id=f"zero{s}-{w}ranks-{d}",
        marks=() if (s, w, d) in DEFAULT_CASES else pytest.mark.slow,
    )
    for s in (0, 1, 2, 3)
    for w in (1, 2)
    for d in ("fp32", "bf16", "fp16")
]


@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "world", "dtype"), CASES)
def test_sigkill_then_rerun_is_exact(
    tmp_path: Path, reference, stage: int, world: int, dtype: str
) -> None:
    full = reference(stage, world, dtype)
    if stage > 0:  # the ZeRO part's host buffers were made ahead, and the saves copy into them
        for r in range(world):
            lines = Path(f"{full}.rank{r}.buffers.jsonl").read_text().splitlines()
            records = {json.loads(x)["step"]: json.loads(x)["buffers"] for x in lines}
            # (fp16: the first steps overflow and are skipped, so the Adam moments, and their
            # buffers, come later than the fp32 masters')
            assert records[1] and records[1].items() <= records[3].items(), (r, records)
    killed = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "kill"), *_opts(stage, dtype)]
    run_group([*killed, "--die-at", "7"], world, tmp_path, "die", expect=-9)
    steps = [e.step for e in committed(tmp_path / "b")]
    assert steps and max(steps) < 7, steps  # the kill came between two saves (6 and 9)
    run_group(killed, world, tmp_path, "resume")
    assert_same_run(full, tmp_path / "kill", world)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("stage", "dtype"),
    [
        pytest.param(
            s, d, id=f"zero{s}-{d}", marks=() if (s, d) == (2, "fp32") else pytest.mark.slow
        )
        for s, d in [(2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "fp16"), (3, "bf16"), (3, "fp16")]
    ],
)
def test_overlapped_snapshot_defers_the_partitions_and_the_rerun_is_exact(
    tmp_path: Path, reference, monkeypatch, stage: int, dtype: str
) -> None:
    """``overlap_snapshot=True`` in the section: each rank's fp32 ranges and moments are copied
    while the next forward and backward run, and DeepSpeed's inner optimizer step waits for
    them. Each deferred copy is held until that wait (RC_HOLD_DEFERRED, tests/ds_train.py), so
    a write to them before it would be in the checkpoint. Killed at step 7 and run again: the
    same losses and final state as the uninterrupted run without overlap (fp16: with the steps
    an overflow skips)."""
    full = reference(stage, 2, dtype)
    out = tmp_path / "kill"
    killed = ["--dir", str(tmp_path / "b"), "--out", str(out), *_opts(stage, dtype), "--overlap"]
    monkeypatch.setenv("RC_HOLD_DEFERRED", str(tmp_path / "deferred.die"))
    run_group([*killed, "--die-at", "7"], 2, tmp_path, "die", expect=-9)
    monkeypatch.setenv("RC_HOLD_DEFERRED", str(tmp_path / "deferred.resume"))
    run_group(killed, 2, tmp_path, "resume")
    assert_same_run(full, out, 2)
    # the re-run resumed from step 6, or from 3 where the kill came before step 6's save had
    # committed (its copy waits for step 7's optimizer step); then each of its saves (6 and)
    # 9 deferred each rank's ranges, and its close() waited for them
    start = restored(out)["step"]
    assert start in (3, 6), start
    for r in range(2):
        deferred = Path(f"{tmp_path}/deferred.resume.rank{r}").read_text().split()
        assert len(deferred) == (9 - start) // 3, (r, deferred)
        assert all(int(n) > 0 for n in deferred), (r, deferred)


@pytest.mark.distributed
@pytest.mark.slow  # three group runs; keeps the default suite near its budget
def test_each_ranks_buffers_come_back_to_it(tmp_path: Path) -> None:
    """A running normaliser updated from each rank's own batches: DeepSpeed does not make the
    ranks' buffers equal again, so they differ. They were saved once, by rank 0, and every rank
    got rank 0's back (rank 1's losses then differed); now each rank's own, bit-identical."""
    opts = [*_opts(2, "fp32"), "--running-norm"]
    run_group(["--dir", str(tmp_path / "a"), "--out", str(tmp_path / "full"), *opts], 2,
              tmp_path, "full")  # fmt: skip
    killed = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "kill"), *opts]
    run_group([*killed, "--die-at", "7"], 2, tmp_path, "die", expect=-9)
    run_group(killed, 2, tmp_path, "resume")
    assert_same_run(tmp_path / "full", tmp_path / "kill", 2)
    # export: the model whole, rank 0's buffer with it
    from safetensors.torch import load_file

    cli = [
        sys.executable,
        "-m",
        "resilient_callbacks",
        "export",
        str(tmp_path / "b"),
        str(tmp_path / "x"),
    ]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    assert "0.mean" in load_file(tmp_path / "x" / "model.safetensors")


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("stage", "dtype", "before", "after", "offload"),
    [
        pytest.param(2, "fp32", 2, 1, "", id="zero2-2to1", marks=pytest.mark.slow),
        pytest.param(3, "bf16", 1, 2, "", id="zero3-1to2", marks=pytest.mark.slow),
        pytest.param(2, "bf16", 1, 2, "", id="zero2-1to2", marks=pytest.mark.slow),
        pytest.param(3, "fp32", 2, 1, "", id="zero3-2to1", marks=pytest.mark.slow),
        pytest.param(1, "fp32", 2, 1, "", id="zero1-2to1", marks=pytest.mark.slow),
        pytest.param(2, "fp32", 1, 3, "", id="zero2-1to3", marks=pytest.mark.slow),
        # rank 2 wrote nothing: its data loader takes rank 0's position (new_ranks="rank0")
        pytest.param(2, "fp32", 2, 3, "", id="zero2-2to3", marks=pytest.mark.slow),
        pytest.param(2, "fp16", 2, 1, "", id="zero2-fp16-2to1", marks=pytest.mark.slow),
        # saved with ZeRO-Offload, resumed without it, and the other way round
        pytest.param(2, "fp32", 2, 1, "save", id="zero2-offloaded-2to1", marks=pytest.mark.slow),
        pytest.param(3, "fp32", 1, 2, "resume", id="zero3-1to2-offloaded", marks=pytest.mark.slow),
    ],
)
def test_resume_on_another_number_of_ranks(
    tmp_path: Path, stage: int, dtype: str, before: int, after: int, offload: str
) -> None:
    ck = str(tmp_path / "ck")
    save_extra = ["--offload"] if offload == "save" else []
    resume_extra = ["--offload"] if offload == "resume" else []
    run_group(
        ["--dir", ck, "--out", str(tmp_path / "saved"), *_opts(stage, dtype, 6), *save_extra],
        before,
        tmp_path,
        "save",
    )
    saved = final(tmp_path / "saved")
    # The CLI's export consolidates the ranks' ranges into full fp32 weights, without DeepSpeed.
    out = tmp_path / "export"
    cli = [sys.executable, "-m", "resilient_callbacks", "export", ck, str(out), "--step", "6"]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert {f"fp32/{k}" for k in weights} == {k for k in saved if k.startswith("fp32/")}
    for k, t in weights.items():
        assert [float(v).hex() for v in t.flatten()] == saved[f"fp32/{k}"], k
    # inspect lists each parameter's master and moments whole, with the ranks' ranges of it
    show = [sys.executable, "-m", "resilient_callbacks", "inspect", ck, "--step", "6", "--json"]
    keys = json.loads(subprocess.run(show, check=True, capture_output=True, text=True).stdout)
    listed = {k["key"].removeprefix("engine.zero."): k for k in keys["keys"]}
    for name, t in weights.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            entry = listed[f"{key}/{name}"]
            assert (entry["dtype"], entry["shape"]) == ("float32", list(t.shape)), entry
            assert 1 <= entry["chunks"] <= before, entry
    assert before == 1 or any(listed[f"fp32/{n}"]["chunks"] == 2 for n in weights)
    # Restore on the other size: the gathered state is what was saved; then train on.
    more = [
        "--dir",
        ck,
        "--out",
        str(tmp_path / "more"),
        "--dump-restored",
        *_opts(stage, dtype, 9),
        *resume_extra,
    ]
    run_group(more, after, tmp_path, "more")
    assert all(restored(tmp_path / "more", r)["step"] == 6 for r in range(after))
    loaded = json.loads(Path(f"{tmp_path / 'more'}.rank0.restored_state.json").read_text())
    assert saved.keys() == loaded.keys()
    assert [k for k in saved if saved[k] != loaded[k]] == []
    assert max(e.step for e in committed(ck)) == 9


@pytest.mark.distributed
@pytest.mark.slow  # the same fallback for any FilePart: test_seams_filepart (default suite)
def test_flipped_byte_in_rank1_partition_falls_back_on_both_ranks(
    tmp_path: Path, reference
) -> None:
    full = reference(2, 2, "fp32")
    opts = [*_opts(2, "fp32"), "--sync"]  # step 6 is committed when step 7 starts
    ck = tmp_path / "b"
    run_group(
        ["--dir", str(ck), "--out", str(tmp_path / "kill"), *opts, "--die-at", "7"],
        2,
        tmp_path,
        "die",
        expect=-9,
    )
    newest = max(committed(ck), key=lambda e: e.step)
    assert newest.step == 6
    victim = Path(newest.path) / "parts" / "engine" / "zero" / "rank_00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = run_group(
        ["--dir", str(ck), "--out", str(tmp_path / "kill"), *opts], 2, tmp_path, "resume"
    )
    # rank 0 says what was skipped, and why (rank 1's damaged file, found by rank 1); the
    # other rank logs it at INFO only, a notice about all ranks being said once (notices.py)
    assert "step_000000006" in out[0] and "rank_00001.safetensors" in out[0], out[0][-3000:]
    assert "skipping checkpoint" not in out[1], out[1][-3000:]
    for r in (0, 1):  # both ranks fell back to the same older checkpoint
        assert restored(tmp_path / "kill", r)["step"] == 3
    assert_same_run(full, tmp_path / "kill", 2)


@pytest.mark.distributed
@pytest.mark.slow  # the same part blobs for any FilePart: test_part_blobs (default suite)
def test_incremental_zero2_partitions_are_blobs_and_a_kill_resumes_exactly(tmp_path: Path) -> None:
    """incremental=True at ZeRO 2 on 2 ranks: each rank's fp32 and moment ranges (>= 16 KiB)
    are blobs the rank writes, listed with its rank; killed and re-run, bit-identical."""
    opts = [*_opts(2, "fp32"), "--incremental"]
    run_group(
        ["--dir", str(tmp_path / "a"), "--out", str(tmp_path / "full"), *opts], 2, tmp_path, "full"
    )
    ck = tmp_path / "b"
    killed = ["--dir", str(ck), "--out", str(tmp_path / "kill"), *opts]
    run_group([*killed, "--die-at", "7"], 2, tmp_path, "die", expect=-9)
    run_group(killed, 2, tmp_path, "resume")
    assert_same_run(tmp_path / "full", tmp_path / "kill", 2)
    newest = max(committed(ck), key=lambda e: e.step)
    assert newest.manifest is not None
    assert {b.rank for b in newest.manifest.blobs} == {0, 1}
    part_file = Path(newest.path) / "parts" / "engine" / "zero" / "rank_00001.safetensors"
    assert part_file.stat().st_size < 16 << 10  # its large ranges are in the blobs


@pytest.mark.distributed
@pytest.mark.slow  # keeps the default suite near its budget; run with -m slow
def test_sigterm_exits_75_and_resumes_exactly_without_unpickling(tmp_path: Path, reference) -> None:
    full = reference(2, 1, "fp32")
    run = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "term"), *_opts(2, "fp32")]
    run_group([*run, "--term-at", "4"], 1, tmp_path, "term", expect=75)
    assert max(e.step for e in committed(tmp_path / "b")) == 5  # the emergency save
    run_group([*run, "--no-pickle"], 1, tmp_path, "resume")  # pickle/torch.load raise
    assert restored(tmp_path / "term")["step"] == 5
    assert_same_run(full, tmp_path / "term", 1)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "how",
    [pytest.param(h, marks=pytest.mark.slow) for h in ("with-block", "launcher")],
)
def test_save_on_exception_saves_the_last_step_and_the_rerun_is_exact(
    tmp_path: Path, reference, how: str
) -> None:
    """``save_on_exception`` in the section: an exception after step 4 (periodic saves every 3)
    saves step 4 -- seen by ``with engine.resilient_checkpoint:`` or by the launcher -- and the
    same command run again resumes from it, exactly."""
    full = reference(2, 1, "fp32")
    run = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "exc"), *_opts(2, "fp32")]
    if how == "launcher":
        run.append("--launcher")
    else:
        run.append("--guard")
    (out,) = run_group(
        [*run, "--raise-at", "4"], 1, tmp_path, "exc", expect=1, module=how == "launcher"
    )
    assert "RuntimeError: raised at step 4" in out
    assert "an exception will not be saved" not in out
    assert max(e.step for e in committed(tmp_path / "b")) == 4  # the exception's save
    run_group(run, 1, tmp_path, "resume", module=how == "launcher")
    assert restored(tmp_path / "exc")["step"] == 4
    assert_same_run(full, tmp_path / "exc", 1)


@pytest.mark.slow  # suite time budget
@pytest.mark.distributed
def test_a_changed_gradient_accumulation_count_gives_full_cycles_after_the_resume(
    tmp_path: Path,
) -> None:
    """Saved with gradient_accumulation_steps=2 at step 4 (8 micro-steps), resumed with 3: the
    first optimizer step after the resume accumulates 3 micro-batches, not the 1 that
    DeepSpeed's boundary test ((8 + 1) % 3 == 0) gives for the restored count -- and says so."""
    run = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "g"), "--stage", "2"]
    run_group([*run, "--steps", "4", "--every", "4"], 1, tmp_path, "gas2")
    (out,) = run_group([*run, "--steps", "7", "--every", "100", "--gas", "3"], 1, tmp_path, "gas3")
    assert restored(tmp_path / "g")["step"] == 4
    assert "not a multiple of gradient_accumulation_steps=3" in out
    assert "initialize(" in _warned_line(out, "the checkpoint's micro-step count")
    cycles = [
        line.split()
        for line in Path(f"{tmp_path / 'g'}.rank0.cycles").read_text().split("\n")
        if line
    ]
    assert [(int(s), int(n)) for s, n in cycles] == [
        (1, 2),
        (2, 2),
        (3, 2),
        (4, 2),
        (5, 3),
        (6, 3),
        (7, 3),
    ]


def test_a_config_without_the_section_says_so_under_the_launcher_or_for_a_near_miss(
    tmp_path: Path, monkeypatch
) -> None:
    """A misspelled section name ("resilient_checkpoints") trained with nothing saved and no
    word, also under the launcher run to checkpoint (the docs walkthrough). Now a near miss is
    named, and under the launcher a config without the section is said; a plain config outside
    it stays plain DeepSpeed, in silence."""
    import torch

    import resilient_callbacks.deepspeed as rcds
    from resilient_callbacks.deepspeed import launch, section

    typo = {"train_batch_size": 8, "resilient_checkpoints": {"dirpath": str(tmp_path)}}
    said = section.without_section(typo, launched=False)
    assert said is not None and 'did you mean "resilient_checkpoint"' in said
    assert '"resilient_checkpoints"' in said
    assert section.without_section({"train_batch_size": 8}, launched=False) is None
    under = section.without_section({"train_batch_size": 8}, launched=True)
    assert under is not None and "launched through resilient_callbacks.deepspeed.run" in under

    handed: list[dict] = []  # what reaches DeepSpeed's own initialize (not run here)
    monkeypatch.setattr(launch, "original_initialize", lambda: lambda **kw: handed.append(kw))
    with pytest.warns(UserWarning, match="did you mean") as got:
        rcds.initialize(model=torch.nn.Linear(2, 2), config=typo)
    assert handed and handed[0]["config"] == typo  # plain DeepSpeed, as before
    assert got[0].filename == __file__  # the warning points at the call (it said sys:1)


@pytest.mark.slow  # suite time budget
@pytest.mark.distributed
def test_the_launcher_leaves_an_engine_without_an_optimizer_plain(tmp_path: Path) -> None:
    """A script that also builds an inference-only engine (a teacher) from the sectioned config
    runs under the launcher: that engine is not checkpointed, and says so; the trained one is."""
    run = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "t"), *_opts(2, "fp32", steps=4)]
    (out,) = run_group([*run, "--launcher", "--teacher"], 1, tmp_path, "teacher", module=True)
    assert "an engine without an optimizer is not checkpointed" in out
    assert max(e.step for e in committed(tmp_path / "b")) == 3  # every 3 steps, of 4


@pytest.mark.slow  # suite time budget
def test_save_on_exception_without_a_with_block_warns_that_it_cannot_save(tmp_path: Path) -> None:
    """A loop that is not inside ``with engine.resilient_checkpoint:`` (nor under the launcher)
    cannot see an exception: the first optimizer step says so, once, rather than nothing
    being saved silently."""
    (out,) = run_group(
        ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "x"), *_opts(2, "fp32", steps=4),
         "--raise-at", "3"],
        1, tmp_path, "bare", expect=1,
    )  # fmt: skip
    assert out.count("an exception will not be saved") >= 1
    assert max(e.step for e in committed(tmp_path / "b")) == 3  # the periodic save only
    assert ".step(" in _warned_line(out, "save_on_exception is set")  # the user's engine.step()


def _warned_line(out: str, message: str) -> str:
    """The source line a warning printed in ``out`` is attributed to (the user's, not ours)."""
    m = re.search(rf"^(\S+\.py):(\d+): UserWarning: {re.escape(message)}", out, re.MULTILINE)
    assert m, f"no warning {message!r} in:\n{out[-3000:]}"
    assert "resilient_callbacks" not in m.group(1), m.group(0)
    return Path(m.group(1)).read_text().splitlines()[int(m.group(2)) - 1]


@pytest.mark.distributed
@pytest.mark.slow
def test_no_code_change_through_the_launcher(tmp_path: Path, reference) -> None:
    full = reference(2, 1, "fp32")
    run = [
        "--dir",
        str(tmp_path / "b"),
        "--out",
        str(tmp_path / "kill"),
        "--launcher",
        *_opts(2, "fp32"),
    ]
    run_group([*run, "--die-at", "7"], 1, tmp_path, "die", expect=-9, module=True)
    (out,) = run_group(run, 1, tmp_path, "resume", module=True)
    assert "nothing is being checkpointed" not in out  # the guard sees no section
    assert restored(tmp_path / "kill")["step"] in (3, 6)  # 6 unless its background save was cut
    assert_same_run(full, tmp_path / "kill", 1)


def test_section_is_validated_and_removed(tmp_path: Path) -> None:
    from resilient_callbacks.deepspeed import section
    from resilient_callbacks.errors import ConfigError

    cfg = {"train_batch_size": 8, "resilient_checkpoint": {"dirpath": "x", "keep_lats": 3}}
    with pytest.raises(
        ConfigError, match=r"'keep_lats'.*valid options are: dirpath, every_n_steps"
    ):
        section.split(cfg)
    with pytest.raises(ConfigError, match='needs "dirpath"'):
        section.split({"resilient_checkpoint": {"keep_last": 3}})
    # the values too, naming the section, before DeepSpeed builds the engine (they were checked
    # only when the Checkpointer was made, after the engine, without saying where from)
    for bad, said in (
        ({"every_n_steps": "5"}, "every_n_steps='5'"),
        ({"adaptive": "yes"}, "adaptive='yes'"),
        ({"signals": ["SIGNOPE"]}, "'SIGNOPE' is not a signal"),
    ):
        with pytest.raises(ConfigError, match=f'^"resilient_checkpoint" in .*{re.escape(said)}'):
            section.split({"resilient_checkpoint": {"dirpath": "x", **bad}})
    # one signal as a string, as JSON invites: that signal (it was read letter by letter)
    _, one = section.split({"resilient_checkpoint": {"dirpath": "x", "signals": "SIGUSR1"}})
    assert one is not None and one["signals"] == "SIGUSR1"
    from resilient_callbacks import Checkpointer

    with Checkpointer(tmp_path / "sig", signals="SIGUSR1") as ck:
        assert ck.config.signals == ("SIGUSR1",)
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "resilient_checkpoint": {
                    "dirpath": "x",
                    "remote": "s3://b/r",
                    "remote_options": {"secret": "s"},
                },
            }
        )
    )
    clean, options = section.split(str(path))
    assert clean == {"train_batch_size": 8}
    assert options is not None and options["remote_options"] == {"secret": "s"}
    assert section.split({"train_batch_size": 8}) == ({"train_batch_size": 8}, None)
    assert json.loads(path.read_text())["resilient_checkpoint"]["dirpath"] == "x"  # file untouched


def test_a_typo_in_the_sections_keys_names_the_option_meant() -> None:
    """A typo in the section ("every_n_step", "Every_N_Steps") was answered with some forty
    valid options to search; the callbacks' own options already said which one was meant."""
    from resilient_callbacks.deepspeed import section
    from resilient_callbacks.errors import ConfigError

    for typo in ("every_n_step", "Every_N_Steps"):
        with pytest.raises(ConfigError, match=f"'{typo}' \\(did you mean 'every_n_steps'\\?\\)"):
            section.split({"resilient_checkpoint": {"dirpath": "x", typo: 3}})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) 'zzz'; valid"):
        section.split({"resilient_checkpoint": {"dirpath": "x", "zzz": 3}})


def test_a_misspelt_keyword_of_attach_is_an_unknown_option_error() -> None:
    """rcds.attach(engine, every_n_step=5) takes Checkpointer options as keywords, like the
    Checkpointer and the callbacks, which raise UnknownOptionError (a TypeError, as Python's own
    for a wrong keyword); attach's check raised a bare ConfigError, which `except TypeError`
    missed. The section of a JSON config raises the same (still a ConfigError). attach()'s
    error names its keywords, not a "resilient_checkpoint" section the run has not got."""
    from resilient_callbacks.deepspeed import section
    from resilient_callbacks.errors import ConfigError, UnknownOptionError

    with pytest.raises(UnknownOptionError, match="did you mean 'every_n_steps'") as said:
        section.validate({"dirpath": "x", "every_n_step": 5}, "attach()")
    assert str(said.value).startswith("rcds.attach()'s keywords: unknown option(s)")
    assert "resilient_checkpoint" not in str(said.value)
    with pytest.raises(TypeError):
        section.split({"resilient_checkpoint": {"dirpath": "x", "every_n_step": 5}})
    with pytest.raises(ConfigError):
        section.split({"resilient_checkpoint": {"dirpath": "x", "every_n_step": 5}})


def test_section_in_a_base64_or_hjson_config_is_found(tmp_path: Path) -> None:
    """DeepSpeed also takes a base64-encoded config and Hjson files: a section in either is
    read and removed (a base64 one reached DeepSpeed, with any credentials, and nothing was
    checkpointed), and the guard sees it too."""
    import base64

    import resilient_callbacks_ds_guard as guard
    from resilient_callbacks.deepspeed import section

    cfg = {"train_batch_size": 8, "resilient_checkpoint": {"dirpath": "x", "keep_last": 2}}
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    assert section.split(encoded) == ({"train_batch_size": 8}, {"dirpath": "x", "keep_last": 2})
    assert guard.has_section(config=encoded)
    plain = base64.urlsafe_b64encode(b'{"train_batch_size": 8}').decode()
    assert section.split(plain) == ({"train_batch_size": 8}, None)
    assert not guard.has_section(config=plain)
    path = tmp_path / "ds.hjson"
    path.write_text(
        "{\n  # a comment\n  train_batch_size: 8\n  resilient_checkpoint: {\n    dirpath: x\n  }\n}\n"
    )
    assert section.split(str(path)) == ({"train_batch_size": 8}, {"dirpath": "x"})
    assert guard.has_section(config=str(path))
    assert section.split("no/such/ds.json") == ("no/such/ds.json", None)


@pytest.mark.distributed
@pytest.mark.slow
def test_stage0_checkpoint_does_not_load_into_zero2(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    run_group(["--dir", ck, "--out", str(tmp_path / "a"), *_opts(0, "fp32", 3)], 1, tmp_path, "z0")
    with pytest.raises(AssertionError, match="CheckpointMismatchError") as refused:
        run_group(
            ["--dir", ck, "--out", str(tmp_path / "b"), *_opts(2, "fp32", 6)], 1, tmp_path, "z2"
        )
    said = " ".join(str(refused.value).replace("[rank0]:", "").split())
    assert "of a ZeRO stage 0 engine; this engine is ZeRO stage 2" in said


def test_integration_configs_are_valid() -> None:
    from resilient_callbacks.deepspeed import section

    root = Path(__file__).resolve().parent.parent / "integrations" / "deepspeed"
    configs = sorted(root.glob("*.json"))
    assert configs
    for path in configs:
        clean, options = section.split(str(path))
        assert options is not None and options["dirpath"], path
        assert "resilient_checkpoint" not in clean


@needs_transformers
@pytest.mark.distributed
@pytest.mark.slow  # keeps the default suite near its budget; run with -m slow
@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlapped"])
@pytest.mark.parametrize("stage", ["2", "3"])
def test_hf_trainer_with_deepspeed_kill_resume_exact(
    tmp_path: Path, monkeypatch, stage: str, overlap: bool
) -> None:
    """The Transformers callback under ``TrainingArguments(deepspeed=...)`` (ZeRO-2/3, CPU), its
    options in the config's section: SIGKILL mid-run, re-run, bit-identical per-step records,
    final fp32 weights and log history; DeepSpeed never sees the section. The re-run goes
    through the launcher (one wrapper command for every job): the section stays the callback's,
    and the launcher's engine checkpoint does not open a second writer on the same directory.
    ``overlapped``: the killed run and the re-run with ``"overlap_snapshot": true``, each
    deferred copy held until the optimizer step's wait (tests/ds_train.py), against the
    uninterrupted run without it."""
    import test_transformers as tt

    def cmd(d: Path, launcher: bool = False, overlap: bool = False) -> list[str]:
        run = (
            [sys.executable, "-m", "resilient_callbacks.deepspeed.run"]
            if launcher
            else [sys.executable]
        )
        return [
            *run, str(Path(__file__).with_name("hf_train.py")), str(d),
            "--deepspeed", stage,
            "--out-jsonl", str(d / "steps.jsonl"), "--out-final", str(d / "final.safetensors"),
            *(["--overlap"] if overlap else []),
        ]  # fmt: skip

    ref, got = tmp_path / "ref", tmp_path / "got"
    ref.mkdir()
    got.mkdir()
    tt._run(cmd(ref))
    if overlap:
        monkeypatch.setenv("RC_HOLD_DEFERRED", str(tmp_path / "deferred"))
    # ZeRO-3: killed at 3, resumed at 2, whose next micro-batch starts an accumulation group
    # (the Trainer's FLOP count of a new engine's first micro-batch: under_deepspeed.py)
    at = 3 if stage == "3" else 5
    rc, killed_at, _ = tt._run_and_signal(  # once the save of step at - 1 committed
        cmd(got, overlap=overlap), got, at, signal.SIGKILL, committed=(got / "ckpt", at - 1)
    )
    assert rc == -signal.SIGKILL
    log = tt._run(cmd(got, launcher=True, overlap=overlap))
    resumed = tt._restored(log)
    assert 0 < resumed <= killed_at and resumed % 3 != 0  # no multiple of the accumulation
    if overlap:  # the saves deferred the ZeRO ranges
        assert all(int(n) > 0 for n in Path(f"{tmp_path}/deferred.rank0").read_text().split())
    assert "nothing is being checkpointed" not in log  # the section never reached DeepSpeed
    # accelerate calls engine.step() once per optimizer step: micro_steps counts those, and a
    # resume with the same accumulation is no "changed gradient_accumulation_steps"
    assert "micro-step count" not in log, log[-3000:]
    # ZeRO-3: the Trainer counts the FLOPs of a new engine's first micro-batch with the size of
    # its partitioned parameters, 0, unless it ends an accumulation (the Trainer's own resume
    # too): resumed at 2, total_flos was one micro-batch less; it is counted again now
    tt._assert_same_run(ref, got)


@needs_transformers
@pytest.mark.distributed
@pytest.mark.slow  # suite time budget (the same without DeepSpeed: test_transparent_transformers)
@pytest.mark.parametrize("stage", ["2", "3"])
def test_the_trainer_under_deepspeed_is_unchanged_by_the_callback(tmp_path: Path, stage) -> None:
    """14 steps under ZeRO-2/3 with the callback saving every 2 steps: per-step logs (loss,
    grad norm, learning rate, evaluations), train()'s metrics, the engine's counters and the
    final fp32 weights are those of the run without it, bit for bit."""
    import torch

    import test_transformers as tt

    script = Path(__file__).with_name("hf_ds_transparent.py")
    runs = {}
    for mode in ("without", "with"):
        out = str(tmp_path / mode)
        tt._run([sys.executable, str(script), mode, out, stage])
        runs[mode] = torch.load(out + ".pt", weights_only=True)
    a, b = runs["without"], runs["with"]
    assert a["history"] and a["history"] == b["history"]
    assert a["metrics"] == b["metrics"] and a["counters"] == b["counters"] == [14, 14, 14 * 12]
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert [e.step for e in committed(tmp_path / "with" / "ckpt")][-1] == 14


@pytest.mark.slow  # suite time budget
@pytest.mark.distributed
def test_export_holds_the_frozen_parameters_too(tmp_path: Path) -> None:
    """ZeRO 2 with a frozen layer (in no optimizer; saved once, replicated): ``export`` writes
    it beside the trained fp32 masters, so the exported model is whole."""
    from safetensors.torch import load_file

    ck = str(tmp_path / "ck")
    opts = ["--dir", ck, "--out", str(tmp_path / "run"), *_opts(2, "fp32", 6), "--freeze-first"]
    run_group(opts, 1, tmp_path, "run")
    saved = final(tmp_path / "run")
    out = tmp_path / "export"
    cli = [sys.executable, "-m", "resilient_callbacks", "export", ck, str(out)]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    weights = load_file(out / "model.safetensors")
    want = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith(("fp32/", "frozen/"))}
    assert {"0.weight", "0.bias"} <= {k[len("frozen/") :] for k in saved if "frozen/" in k}
    assert sorted(weights) == sorted(want)
    for k, t in weights.items():
        assert [float(v).hex() for v in t.float().flatten()] == want[k], k


@needs_transformers
@pytest.mark.slow  # one Trainer run under DeepSpeed
@pytest.mark.parametrize("stage", ["0", "3"])
def test_export_of_a_trainer_run_of_a_plain_module_under_deepspeed(tmp_path: Path, stage) -> None:
    """The Trainer under ZeRO 0/3 training a plain torch module: ``export`` failed ("records no
    model configuration"); it writes the weights, consolidated, equal to the engine's."""
    import torch
    from safetensors.torch import load_file

    import test_transformers as tt

    tt._run([sys.executable, str(Path(__file__).with_name("hf_ds_plain.py")), str(tmp_path), stage])
    out = tmp_path / "export"
    cli = [sys.executable, "-m", "resilient_callbacks", "export", str(tmp_path / "ckpt"), str(out)]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    got, want = load_file(out / "model.safetensors"), load_file(tmp_path / "final.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.distributed
@pytest.mark.slow  # ZeRO 3's frozen partitions on 2 ranks: three group runs
def test_zero3_with_frozen_parameters_kill_resume_is_exact_and_exports_them(
    tmp_path: Path,
) -> None:
    """ZeRO 3 partitions frozen parameters too (outside the optimizer): each rank saves its
    partition of them; killed and re-run on 2 ranks, bit-identical (the frozen values
    included); resumed on 1 rank, the frozen values laid together as saved; export writes them
    whole."""
    from safetensors.torch import load_file

    opts = [*_opts(3, "fp32"), "--freeze-first"]
    full_run = tmp_path / "full"
    run_group(["--dir", str(tmp_path / "a"), "--out", str(full_run), *opts], 2, tmp_path, "full")
    ck = tmp_path / "b"
    killed = ["--dir", str(ck), "--out", str(tmp_path / "kill"), *opts]
    run_group([*killed, "--die-at", "7"], 2, tmp_path, "die", expect=-9)
    # the re-run's frozen layer starts from other values: only the restore brings them back
    run_group([*killed, "--scramble-frozen"], 2, tmp_path, "resume")
    assert_same_run(full_run, tmp_path / "kill", 2)
    ref = final(full_run)
    assert {"frozen/0.weight", "frozen/0.bias"} <= set(ref)

    out = tmp_path / "export"
    cli = [sys.executable, "-m", "resilient_callbacks", "export", str(ck), str(out)]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    weights = load_file(out / "model.safetensors")
    want = {k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith(("fp32/", "frozen/"))}
    assert sorted(weights) == sorted(want)
    for k in ("0.weight", "0.bias"):  # frozen: the same at every step (the newest saved is 9)
        assert [float(v).hex() for v in weights[k].float().flatten()] == want[k], k

    more = [
        "--dir", str(ck), "--out", str(tmp_path / "one"), "--dump-restored", *opts,
        "--scramble-frozen",
    ]  # fmt: skip
    run_group(more, 1, tmp_path, "one")  # 2 -> 1 rank: the frozen partitions laid together
    loaded = json.loads(Path(f"{tmp_path / 'one'}.rank0.restored_state.json").read_text())
    frozen = [k for k in ref if k.startswith("frozen/")]
    assert frozen and [k for k in frozen if loaded[k] != ref[k]] == []  # never trained: as saved


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_frozen_partitions_are_copied_once_with_incremental(tmp_path: Path) -> None:
    """ZeRO 3, 2 ranks, incremental=True: each rank's partition of the frozen weight is copied
    to the host (and written) by the first save only; later saves know it unchanged."""
    opts = [*_opts(3, "fp32"), "--freeze-first", "--incremental"]
    out = tmp_path / "run"
    spawn_ranks.run(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path / "ck"), "--out", str(out), *opts],
        2,
        tmp_path,
        "run",
        env={"DS_ACCELERATOR": "cpu", "RC_COUNT_COPIES": "1"},
        deadline=DEADLINE,
    )
    for r in range(2):
        lines = Path(f"{out}.rank{r}.copies.jsonl").read_text().splitlines()
        copied = [set(n) for n in map(json.loads, lines)]
        # the weight's partition (48 KiB, a blob): at the first save only (steps 3, 6, 9); the
        # bias's (8 KiB, kept in the part's file) at every save
        assert sum("frozen/0.weight" in n for n in copied) == 1, lines
        assert sum("frozen/0.bias" in n for n in copied) == 3, lines
    newest = max(committed(tmp_path / "ck"), key=lambda e: e.step)
    assert newest.manifest is not None and {b.rank for b in newest.manifest.blobs} == {0, 1}


@needs_transformers
@pytest.mark.slow  # suite time budget
@pytest.mark.distributed
def test_hf_trainer_with_deepspeed_exports_a_from_pretrained_directory(tmp_path: Path) -> None:
    """``resilient-ckpt export`` of a Trainer run under DeepSpeed ZeRO-2: a ``from_pretrained``
    directory (the model's class and config, as the Trainer recorded them) whose weights are the
    engine's fp32 masters at the end of training -- not a bare weights file, and not a refusal."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import test_transformers as tt

    d = tmp_path / "run"
    d.mkdir()
    tt._run([
        sys.executable, str(Path(__file__).with_name("hf_train.py")), str(d), "--deepspeed", "2",
        "--max-steps", "4", "--out-jsonl", str(d / "steps.jsonl"),
        "--out-final", str(d / "final.safetensors"),
    ])  # fmt: skip
    out = tmp_path / "hf"
    cli = [sys.executable, "-m", "resilient_callbacks", "export", str(d / "ckpt"), str(out)]
    done = subprocess.run(cli, capture_output=True, text=True, env=tt._env())
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    got = model.state_dict()
    final = load_file(d / "final.safetensors")  # every parameter, full fp32, gathered
    for k, v in final.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])  # tied again


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("stage", "world"), [(1, 2), (2, 1), (2, 2), (3, 2)], ids=lambda v: str(v))
def test_offload_to_cpu_sigkill_then_rerun_is_exact(tmp_path: Path, stage: int, world: int) -> None:
    """ZeRO-Offload (``offload_optimizer`` to the CPU, and ``offload_param`` at stage 3): the
    fp32 masters and moments live in host memory; killed between two saves and re-run, the
    losses and final state equal those of an uninterrupted offloaded run."""
    opts = [*_opts(stage, "fp32"), "--offload"]
    full = ["--dir", str(tmp_path / "a"), "--out", str(tmp_path / "full"), *opts]
    run_group(full, world, tmp_path, "full")
    killed = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "kill"), *opts]
    run_group([*killed, "--die-at", "7"], world, tmp_path, "die", expect=-9)
    steps = [e.step for e in committed(tmp_path / "b")]
    assert steps and max(steps) < 7, steps
    run_group(killed, world, tmp_path, "resume")
    assert_same_run(tmp_path / "full", tmp_path / "kill", world)


UNMANAGED_SCRIPT = """
import json, sys, torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from ds_noshm import skip_shm_op
skip_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
       "managed_gradient_accumulation": False, "zero_optimization": {"stage": 1},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH, "every_n_steps": 2}}
# config_params=: deepspeed.initialize's other name for config=
engine, *_ = rcds.initialize(model=model, model_parameters=model.parameters(), config_params=cfg)
assert "resilient_checkpoint" not in engine.config, "the section reached DeepSpeed"
start = engine.global_steps
g = torch.Generator().manual_seed(1)
batches = [torch.randn(4, 6, generator=g) for _ in range(12)]
for step in range(start, 6):
    for micro in range(2):  # the caller's own accumulation: two backward() calls, one step()
        engine.backward(engine(batches[2 * step + micro]).pow(2).mean())
    engine.step()
    if step + 1 == DIE_AT:
        engine.resilient_checkpoint.checkpointer.flush()
        import os, signal; os.kill(os.getpid(), signal.SIGKILL)
engine.resilient_checkpoint.close()
print(json.dumps({"start": start, "weights": [p.detach().flatten().tolist()
                  for p in engine.module.parameters()]}))
"""


@pytest.mark.distributed
@pytest.mark.slow  # three DeepSpeed start-ups; keeps the default suite near its budget
def test_unmanaged_gradient_accumulation_and_config_params_checkpoint_and_resume(
    tmp_path: Path,
) -> None:
    """``"managed_gradient_accumulation": false`` (the caller runs several backward() calls,
    then one step()) with the config given as ``config_params=``. Saves came only at steps
    DeepSpeed's is_gradient_accumulation_boundary() called boundaries, which in this mode it
    never does outside step(): nothing was checkpointed (and SIGTERM went unanswered); and
    config_params= bypassed us entirely, the section (remote URL included) reaching DeepSpeed.
    Now: checkpoints at steps 2 and 4, killed after 4, re-run: resumes at 4, ends with the
    weights of a run not stopped."""
    env = dict(
        os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip

    def run(dirpath: Path, die_at: int) -> subprocess.CompletedProcess:
        script = tmp_path / f"unmanaged-{dirpath.name}-{die_at}.py"
        code = UNMANAGED_SCRIPT.replace("DIRPATH", repr(str(dirpath)))
        script.write_text(code.replace("DIE_AT", str(die_at)))
        run_env = dict(env, MASTER_PORT=str(spawn_ranks.free_port()))
        return subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=run_env,
            timeout=DEADLINE,
        )  # fmt: skip

    whole = run(tmp_path / "a", 0)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert [e.step for e in committed(tmp_path / "a")] == [2, 4, 6]
    killed = run(tmp_path / "b", 4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [e.step for e in committed(tmp_path / "b")] == [2, 4]
    again = run(tmp_path / "b", 0)
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = json.loads(whole.stdout.splitlines()[-1]), json.loads(again.stdout.splitlines()[-1])
    assert (a["start"], b["start"]) == (0, 4)
    assert a["weights"] == b["weights"]


def run_one_rank(script: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` written to ``script`` and run as one DeepSpeed rank on the CPU (gloo): a
    process of its own, forked from the session's zygote that imported torch and DeepSpeed
    once (spawn_ranks.run_python; a fresh interpreter spent seconds of CPU importing them)."""
    script.write_text(code)
    env = dict(
        os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spawn_ranks.free_port()), DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip
    zygote = spawn_ranks.shared_zygote("deepspeed", DS_ACCELERATOR="cpu")
    return spawn_ranks.run_python([sys.executable, str(script)], env, DEADLINE, zygote)


TWICE_SCRIPT = """
import torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from resilient_callbacks import ConfigError
from ds_noshm import skip_shm_op
skip_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(4, 1)
cfg = {"train_micro_batch_size_per_gpu": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH + "/a", "every_n_steps": 1}}
engine, *_ = rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
try:
    rcds.attach(engine, dirpath=DIRPATH + "/b")
except ConfigError as e:
    print("REFUSED:", e)
for _ in range(2):
    engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
    engine.step()
engine.resilient_checkpoint.close()
"""


def test_a_second_attach_to_a_checkpointed_engine_is_refused(tmp_path: Path) -> None:
    """A second handle wrapped the first's ``engine.step``, and closing it unwrapped both: the
    first handle silently stopped saving. Now refused, naming the first handle's directory; the
    first keeps saving."""
    out = run_one_rank(tmp_path / "twice.py", TWICE_SCRIPT.replace("DIRPATH", repr(str(tmp_path))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED: this engine is already checkpointed" in out.stdout, out.stdout
    assert str(tmp_path / "a") in out.stdout
    assert [e.step for e in committed(tmp_path / "a")] == [1, 2]
    assert not (tmp_path / "b").exists()


OFFLOAD_SCRIPT = """
import torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from ds_noshm import skip_shm_op
skip_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(4, 4)
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False,
       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                              "nvme_path": DIRPATH}},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH}}
rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
"""


@pytest.mark.parametrize(
    ("offload", "says"),
    [
        (
            {"offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
            r"NVMe offload \(offload_param",
        ),
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.3}}, "partial ZeRO offload"),
    ],
    ids=["nvme-param", "partial"],
)
def test_offload_we_cannot_save_is_refused_before_deepspeed_builds_anything(
    tmp_path: Path, offload: dict, says: str
) -> None:
    import torch

    import resilient_callbacks.deepspeed as rcds
    from resilient_callbacks.errors import UnsupportedStateError

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, **offload},
        "resilient_checkpoint": {"dirpath": str(tmp_path / "ck")},
    }
    model = torch.nn.Linear(4, 4)
    with pytest.raises(UnsupportedStateError, match=says):
        rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert not (tmp_path / "ck").exists()


def test_zero1_bf16_with_fp32_gradient_accumulation_is_refused_before_the_engine() -> None:
    """DeepSpeed trains ZeRO 1 + bf16 + fp32 gradient accumulation with its BF16_Optimizer,
    which we do not read yet: refused from the config, naming what works (it failed only after
    DeepSpeed had built the engine); ZeRO 2 with the same settings passes."""
    from resilient_callbacks.deepspeed.engine_state import check_config
    from resilient_callbacks.errors import UnsupportedStateError

    cfg = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(UnsupportedStateError, match=r"BF16_Optimizer.*ZeRO stage 2"):
        check_config({**cfg, "zero_optimization": {"stage": 1}})
    check_config({**cfg, "zero_optimization": {"stage": 2}})
    check_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})


@pytest.mark.distributed
@pytest.mark.slow
def test_nvme_offload_is_refused_clearly_at_initialize(tmp_path: Path) -> None:
    code = OFFLOAD_SCRIPT.replace("DIRPATH", repr(str(tmp_path / "ck")))
    p = run_one_rank(tmp_path / "offload.py", code)
    assert p.returncode != 0
    assert "UnsupportedStateError" in p.stderr, p.stderr[-3000:]
    assert "NVMe offload (offload_optimizer to nvme) is not supported yet" in p.stderr
    assert '("device": "cpu") is supported' in p.stderr
    assert not committed(tmp_path / "ck")


@pytest.mark.distributed
@pytest.mark.slow  # keeps the default suite near its budget; run with -m slow
def test_remote_tier_holds_the_partitions_and_restores_them(tmp_path: Path, reference) -> None:
    """ZeRO-2 with ``"remote"`` in the section: every checkpoint, ``parts/engine/zero/*``
    included, is uploaded (the run ends by waiting for its uploads); with the local directory
    gone, the re-run resumes from the remote copy and ends bit-identical."""
    import shutil

    full = reference(2, 1, "fp32")
    remote = (tmp_path / "remote").as_uri()
    common = ["--dir", str(tmp_path / "b"), "--out", str(tmp_path / "kill"), "--remote", remote]
    run_group([*common, *_opts(2, "fp32", 6)], 1, tmp_path, "first")
    parts = tmp_path / "remote" / "step_000000006" / "parts" / "engine" / "zero"
    assert (parts / "rank_00000.safetensors").is_file()
    shutil.rmtree(tmp_path / "b")  # the node's disk is gone
    run_group([*common, *_opts(2, "fp32")], 1, tmp_path, "resume")
    assert restored(tmp_path / "kill")["step"] == 6
    assert_same_run(full, tmp_path / "kill", 1)


GUARD_SCRIPT = """
import site, sys, warnings
site.addsitedir(sys.argv[1])  # processes resilient_callbacks_ds_guard.pth as an install does
assert "torch" not in sys.modules and "resilient_callbacks" not in sys.modules, sorted(sys.modules)
sys.path.insert(0, sys.argv[2])
if sys.argv[5] == "probed":  # as accelerate, transformers and lightning ask whether it is there
    import importlib.util
    assert importlib.util.find_spec("deepspeed") is not None
import torch, deepspeed
from ds_noshm import skip_shm_op
skip_shm_op()
assert "resilient_callbacks" not in sys.modules
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
if sys.argv[3] == "section":
    config["resilient_checkpoint"] = {"dirpath": sys.argv[4]}
model = torch.nn.Linear(2, 2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
print("WARNINGS:", [type(w.message).__name__ for w in caught if "resilient" in str(w.message)])
"""


@pytest.mark.parametrize(
    "with_section, probed",
    [
        (True, True),
        pytest.param(True, False, marks=pytest.mark.slow),
        pytest.param(False, False, marks=pytest.mark.slow),
    ],
    ids=["section-probed", "section", "no-section"],
)
def test_section_reaching_plain_deepspeed_initialize_warns(
    tmp_path: Path, with_section, probed
) -> None:
    """Installed, the package's .pth makes plain ``deepspeed.initialize`` warn when the config
    holds the section (nothing would be checkpointed), without importing anything at start-up
    and without the user's script importing resilient_callbacks. Also where something asked
    ``importlib.util.find_spec("deepspeed")`` before the import (accelerate does it at import,
    and so transformers' model classes and lightning): that once disarmed the guard."""
    src = Path(__file__).resolve().parents[1] / "src"
    env = dict(
        os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spawn_ranks.free_port()), DS_ACCELERATOR="cpu",
        GLOO_SOCKET_IFNAME="lo",
    )  # fmt: skip
    env.pop("RESILIENT_CALLBACKS_NO_DS_GUARD", None)
    arg = "section" if with_section else "plain"
    argv = [sys.executable, "-c", GUARD_SCRIPT, str(src), str(SCRIPT.parent), arg, str(tmp_path)]
    argv.append("probed" if probed else "direct")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    if with_section:
        assert "WARNINGS: ['SectionIgnoredWarning']" in out.stdout
        assert "nothing is being checkpointed by resilient_callbacks" in out.stderr
    else:
        assert "WARNINGS: []" in out.stdout
        assert "nothing is being checkpointed" not in out.stderr
    assert not (tmp_path / "resilient").exists()


def test_no_guard_warning_through_our_initialize_and_launcher(tmp_path: Path) -> None:
    """Our own paths hand DeepSpeed a config without the section: the guard stays quiet."""
    import warnings

    import resilient_callbacks_ds_guard as guard

    seen: list[object] = []

    def initialize(*a: object, **kw: object) -> str:
        seen.append((a, kw))
        return "engine"

    wrapped = guard.guard(initialize)
    assert guard.guard(wrapped) is wrapped  # wrapping twice is once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wrapped(model=None, config={"train_batch_size": 8}) == "engine"
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"train_batch_size": 8}))
        assert wrapped(None, config=str(path)) == "engine"
    path.write_text(json.dumps({"train_batch_size": 8, "resilient_checkpoint": {"dirpath": "x"}}))

    class Args:
        deepspeed_config = str(path)

    with pytest.warns(guard.SectionIgnoredWarning, match="resilient_callbacks.deepspeed.run"):
        wrapped(Args(), model=None)
    assert len(seen) == 3
    # the launcher's forms, torchrun's included (a torchrun user was offered only the others)
    said = guard._warning()
    assert "`torchrun --nproc_per_node N -m resilient_callbacks.deepspeed.run" in said
    assert "`deepspeed --module resilient_callbacks.deepspeed.run" in said


def test_the_launcher_refuses_a_trainers_section_that_no_callback_reads(monkeypatch) -> None:
    """Under the launcher, a trainer that calls ``deepspeed.initialize`` itself (the Hugging Face
    Trainer through accelerate) with the section in its config and no callback of ours: refused,
    naming the callback (the engine's checkpoint alone re-trained from the trainer's step 0).
    With the callback's claim, the call is DeepSpeed's and the section the callback's; a plain
    script's call is still the launcher's."""
    import deepspeed

    import resilient_callbacks_ds_guard as guard
    from resilient_callbacks.deepspeed import launch
    from resilient_callbacks.errors import ConfigError

    attach = sys.modules["resilient_callbacks.deepspeed.attach"]  # the module, not the function
    calls: list[str] = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: calls.append("deepspeed") or "ds")
    monkeypatch.setattr(attach, "initialize", lambda **kw: calls.append("ours") or ("e",) * 4)
    monkeypatch.setattr(guard, "_claims", [])
    launch.patch()
    try:
        code = "out = deepspeed.initialize(model=None, config_params=config)"
        config = {"train_batch_size": 8, "resilient_checkpoint": {"dirpath": "x"}}
        trainer = {"__name__": "transformers.trainer", "deepspeed": deepspeed, "config": config}
        with pytest.raises(ConfigError, match=r"transformers\.ResilientCheckpoint\(\)"):
            exec(code, dict(trainer))
        assert calls == []
        exec(code, {"__name__": "__main__", "deepspeed": deepspeed, "config": config})
        assert calls == ["ours"]
        guard.claim("transformers.ResilientCheckpoint")
        exec(code, dict(trainer))
        assert calls == ["ours", "deepspeed"]
        lightning = {**trainer, "__name__": "lightning.pytorch.strategies.deepspeed"}
        guard._claims.clear()
        with pytest.raises(ConfigError, match=r"lightning\.ResilientCheckpoint\(\)"):
            exec(code, lightning)
        exec(code, {**trainer, "config": {"train_batch_size": 8}})  # no section: DeepSpeed's
        assert calls == ["ours", "deepspeed", "deepspeed"]
    finally:
        launch.unpatch()


def test_claimed_section_is_removed_before_deepspeed_sees_it() -> None:
    """With the Transformers callback in the process (it reads the section after
    ``deepspeed.initialize``), a section in a config dict is taken out before DeepSpeed sees it,
    kept for the callback, and no warning is given."""
    import warnings

    import resilient_callbacks_ds_guard as guard

    seen: list[dict] = []
    wrapped = guard.guard(lambda **kw: seen.append(dict(kw["config_params"])))
    config = {"train_batch_size": 8, "resilient_checkpoint": {"dirpath": "x"}}
    claims = list(guard._claims)
    guard.claim("test")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            wrapped(model=None, config_params=config)
    finally:
        guard._claims[:] = claims
    assert seen == [{"train_batch_size": 8}] and config == {"train_batch_size": 8}
    assert guard.take() == {"dirpath": "x"} and guard.take() is None


def test_launcher_module_takes_the_local_rank_the_deepspeed_launcher_puts_first() -> None:
    # `deepspeed --module M script.py a b` runs `python -u -m M --local_rank=0 script.py a b`
    from resilient_callbacks.deepspeed.run import split_argv

    assert split_argv(["--local_rank=1", "t.py", "--x", "2"]) == (
        "t.py",
        ["t.py", "--local_rank=1", "--x", "2"],
    )
    assert split_argv(["--local_rank", "0", "t.py"]) == ("t.py", ["t.py", "--local_rank", "0"])
    assert split_argv(["t.py", "--local_rank=3"]) == ("t.py", ["t.py", "--local_rank=3"])
    with pytest.raises(SystemExit):
        split_argv(["--local_rank=0"])


def test_the_launcher_started_alone_sets_the_rendezvous_for_one_process() -> None:
    """``python -m resilient_callbacks.deepspeed.run train.py`` with none of RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT set: DeepSpeed's init_distributed turned to MPI and
    failed (``No module named 'mpi4py'``); the launcher sets them for one process. Where any
    is set, or an MPI launcher or a Slurm step of several tasks started the process, the
    environment is left as it is."""
    from resilient_callbacks.deepspeed.run import RENDEZVOUS, single_process_env

    env = {"PATH": "/bin"}
    assert single_process_env(env)
    assert [env[k] for k in RENDEZVOUS[:4]] == ["0", "0", "1", "127.0.0.1"]
    assert 0 < int(env["MASTER_PORT"]) < 65536
    for given in ({"WORLD_SIZE": "2"}, {"MASTER_PORT": "1"}, {"OMPI_COMM_WORLD_SIZE": "4"}):
        assert not single_process_env(dict(given)), given
    assert not single_process_env({"SLURM_NTASKS": "8"})
    assert single_process_env({"SLURM_NTASKS": "1"})


def test_the_launcher_started_by_aprun_is_one_of_several_ranks() -> None:
    """Cray's ``aprun -n 4`` (ALPS) starts the processes with ``ALPS_APP_PE`` (each one's rank)
    and, without cray-pmi's variables, none of the others: each took itself for the only rank
    and trained alone, rank 0 of 1, into the same directory. Slurm on a Cray sets
    ``ALPS_APP_PE`` in a step's tasks too: there ``SLURM_NTASKS`` says how many run, as
    elsewhere. ``ALPS_APP_ID`` (the application's id, one for all its processes) says no number
    of processes: alone it is taken for no launcher."""
    from resilient_callbacks.deepspeed.run import single_process_env

    for pe in ("0", "3"):
        env = {"ALPS_APP_PE": pe, "ALPS_APP_ID": "1234567", "PATH": "/bin"}
        assert not single_process_env(env), env
        assert "RANK" not in env and "WORLD_SIZE" not in env
    slurm = {"ALPS_APP_PE": "0", "SLURM_JOB_ID": "42", "SLURM_NTASKS": "1"}
    assert single_process_env(dict(slurm))
    assert not single_process_env({**slurm, "ALPS_APP_PE": "1", "SLURM_NTASKS": "2"})
    assert single_process_env({"ALPS_APP_ID": "1234567"})


def test_the_launcher_started_by_pals_mpiexec_is_one_of_several_ranks() -> None:
    """HPE Cray's PALS ``mpiexec -n 4`` (PBS on Cray EX) starts the processes with
    ``PALS_RANKID`` (and ``PALS_LOCAL_RANKID``, ``PALS_DEPTH``...; ``PMI_RANK`` and
    ``PMI_SIZE`` only with cray-pmi): without the latter each took itself for the only rank and
    trained alone, rank 0 of 1, into the same directory, as under ``aprun``. Slurm's
    cray_shasta plugin sets ``PALS_RANKID`` in a step's tasks too, where ``SLURM_NTASKS`` says
    how many run. Without mpi4py, DeepSpeed's MPI discovery's error then names mpiexec."""
    from resilient_callbacks.deepspeed.run import (
        _cray_launcher,
        _cray_needs_mpi4py,
        single_process_env,
    )

    for rank in ("0", "3"):
        env = {"PALS_RANKID": rank, "PALS_LOCAL_RANKID": rank, "PALS_DEPTH": "8", "PATH": "/b"}
        assert not single_process_env(env), env
        assert "RANK" not in env and "WORLD_SIZE" not in env
    slurm = {"PALS_RANKID": "0", "SLURM_JOB_ID": "42", "SLURM_NTASKS": "1"}
    assert single_process_env(dict(slurm))
    assert not single_process_env({**slurm, "PALS_RANKID": "1", "SLURM_NTASKS": "2"})
    assert single_process_env({"PALS_APID": "3f2a", "PALS_DEPTH": "8"})
    env = {"PALS_RANKID": "0"}
    assert _cray_launcher(env) == "PALS_RANKID"
    err = _cray_needs_mpi4py(env, "PALS_RANKID")
    assert err.startswith("No module named 'mpi4py': HPE Cray PALS's mpiexec started this ")
    assert "(PALS_RANKID=0)" in err and "start it without mpiexec, or set RANK=0" in err, err
    assert _cray_launcher({"PALS_RANKID": "0", "PMI_SIZE": "4"}) is None


@pytest.mark.distributed
@pytest.mark.slow
def test_the_launcher_under_aprun_without_mpi4py_says_how_to_run_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aprun -n 1`` (ALPS_APP_PE=0, nothing else) ran as the only rank until aprun's processes
    were left to DeepSpeed's MPI discovery (ALPS says no number of processes): without mpi4py
    it then failed with DeepSpeed's bare ``No module named 'mpi4py'``. The error now says that
    aprun started it and how to run one process or give MPI its ranks."""
    pytest.importorskip("deepspeed")
    if importlib.util.find_spec("mpi4py") is not None:
        pytest.skip("mpi4py is installed: MPI discovery would find the ranks")
    for var in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ALPS_APP_PE", "0")
    code = "import deepspeed\ndeepspeed.init_distributed(dist_backend='gloo')\n"
    proc = _launch_alone(tmp_path / "train.py", code)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    err = proc.stderr[-4000:]
    assert "No module named 'mpi4py': Cray's aprun started this process (ALPS_APP_PE=0)" in err
    assert "start it without aprun, or set RANK=0 LOCAL_RANK=0 WORLD_SIZE=1" in err, err


def _launch_alone(script: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m resilient_callbacks.deepspeed.run SCRIPT ARGS`` as a user starts it, with
    none of the launchers' variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) in the environment;
    forked from the session's DeepSpeed zygote, DeepSpeed's shared-memory op not compiled."""
    script.write_text(code)
    gone = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in gone}
    env.update(
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    run = (
        "from ds_noshm import skip_shm_op\nskip_shm_op()\n"
        "from resilient_callbacks.deepspeed.run import main\n"
        f"main({[str(script), *args]!r})\n"
    )
    zygote = spawn_ranks.shared_zygote("deepspeed", DS_ACCELERATOR="cpu")
    return spawn_ranks.run_python([sys.executable, "-c", run], env, DEADLINE, zygote)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_launcher_started_alone_trains_and_checkpoints(tmp_path: Path) -> None:
    """The documented ``python -m resilient_callbacks.deepspeed.run train.py ...`` with no
    launcher's variables in the environment: one rank trains and the end is saved (it failed
    in ``deepspeed.init_distributed`` with ``No module named 'mpi4py'``)."""
    code = (
        "import sys, torch, deepspeed\n"
        "m = torch.nn.Linear(4, 1)\n"
        "cfg = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'SGD', 'params': "
        "{'lr': 0.1}}, 'resilient_checkpoint': {'dirpath': sys.argv[1]}}\n"
        "engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)\n"
        "for _ in range(3):\n"
        "    engine.backward(engine(torch.ones(2, 4)).sum()); engine.step()\n"
    )
    ck = tmp_path / "ck"
    proc = _launch_alone(tmp_path / "train.py", code, str(ck))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [e.step for e in committed(ck)] == [3]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_launcher_started_alone_lets_lightning_start_its_ranks(tmp_path: Path) -> None:
    """``python -m resilient_callbacks.deepspeed.run train.py`` on a Lightning script with
    ``DeepSpeedStrategy`` and ``devices=2`` (the launcher passes a trainer's call on to DeepSpeed
    and the callback checkpoints): Lightning starts rank 1 itself, and both ranks train and save.
    With the five variables set at the launcher's start, ``LOCAL_RANK`` told Lightning that a
    launcher had started the ranks: it started none and rank 0 waited for rank 1 until the
    rendezvous timed out (30 minutes by default)."""
    code = (
        "import sys, torch, lightning as L\n"
        "from datetime import timedelta\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from lightning_train import cpu_deepspeed_strategy\n"
        "from resilient_callbacks.lightning import ResilientCheckpoint\n"
        "class M(L.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(8, 1)\n"
        "    def training_step(self, b, i):\n"
        "        return self.l(b[0]).sum()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "if __name__ == '__main__':\n"
        "    s = cpu_deepspeed_strategy(0, sys.argv[1])\n"
        "    s._timeout = timedelta(seconds=120)  # (a rank that never comes: not 30 minutes)\n"
        "    t = L.Trainer(strategy=s, accelerator='cpu',\n"
        "                  devices=2, max_steps=2, logger=False, enable_progress_bar=False,\n"
        "                  callbacks=[ResilientCheckpoint(every_n_steps=2)],\n"
        "                  enable_model_summary=False)\n"
        "    external = t.strategy.cluster_environment.creates_processes_externally\n"
        "    print(f'ranks started by a launcher: {external}', flush=True)\n"
        "    t.fit(M(), DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8))\n"
        "    print(f'rank {t.global_rank} of {t.world_size} done', flush=True)\n"
    )
    ck = tmp_path / "ck"
    script = tmp_path / "train.py"
    script.write_text(code)
    # a real `python -m` process, as a user starts it (forked from the session's zygote, the
    # same script passed on the code before the fix: Lightning started rank 1 there anyway)
    gone = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in gone}
    src = str(Path(__file__).parent.parent / "src")
    env.update(
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([src, str(Path(__file__).parent), env.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "resilient_callbacks.deepspeed.run", str(script), str(ck)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE)
    out = (proc.stdout + proc.stderr)[-4000:]
    assert "ranks started by a launcher: False" in proc.stdout, out
    assert proc.returncode == 0, out
    assert "rank 0 of 2 done" in proc.stdout, out
    assert [e.step for e in committed(ck)] == [2]


def test_the_launcher_saves_engines_of_rcds_initialize_and_attach_on_an_exception(
    tmp_path: Path,
) -> None:
    """Under the launcher, engines the script checkpoints itself -- ``rcds.initialize`` and
    ``rcds.attach`` -- with ``save_on_exception``, no ``with`` block, and an exception after
    step 3: each saves step 3 (the launcher sees the exception for the whole script, as the
    docs say). Only the patched ``deepspeed.initialize``'s engines were: these two saved
    nothing, and no warning said so (the launcher counted as seeing the exception)."""
    code = (
        "import sys, torch, deepspeed\n"
        "import resilient_callbacks.deepspeed as rcds\n"
        "opt = {'type': 'SGD', 'params': {'lr': 0.1}}\n"
        "m1, m2 = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)\n"
        "cfg = {'train_micro_batch_size_per_gpu': 2, 'optimizer': opt, 'resilient_checkpoint': "
        "{'dirpath': sys.argv[1], 'every_n_steps': 100, 'save_on_exception': True}}\n"
        "a, *_ = rcds.initialize(model=m1, model_parameters=m1.parameters(), config=cfg)\n"
        "plain = {'train_micro_batch_size_per_gpu': 2, 'optimizer': opt}\n"
        "b, *_ = deepspeed.initialize(model=m2, model_parameters=m2.parameters(), config=plain)\n"
        "rcds.attach(b, dirpath=sys.argv[2], every_n_steps=100, save_on_exception=True)\n"
        "for _ in range(3):\n"
        "    for e in (a, b):\n"
        "        e.backward(e(torch.ones(2, 4)).sum()); e.step()\n"
        "raise RuntimeError('the training failed')\n"
    )
    ck_a, ck_b = tmp_path / "a", tmp_path / "b"
    proc = _launch_alone(tmp_path / "train.py", code, str(ck_a), str(ck_b))
    assert proc.returncode != 0 and "the training failed" in proc.stderr, proc.stderr[-4000:]
    assert [e.step for e in committed(ck_a)] == [3], proc.stderr[-4000:]
    assert [e.step for e in committed(ck_b)] == [3], proc.stderr[-4000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_deepspeed_launcher_with_our_module_trains_and_checkpoints(tmp_path: Path) -> None:
    """The documented `deepspeed --module resilient_callbacks.deepspeed.run script ...`, through
    DeepSpeed's own launcher (which adds --local_rank before the script). The script neither
    saves nor closes at its end: the launcher saves the last step (5; the schedule saved 3)."""
    ck = tmp_path / "b"
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        "1",
        "--master_port",
        str(spawn_ranks.free_port()),
        "--module",
        "resilient_callbacks.deepspeed.run",
        str(SCRIPT),
        "--dir",
        str(ck),
        "--out",
        str(tmp_path / "run"),
        "--launcher",
        "--no-close",
        *_opts(2, "fp32", steps=5),
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(SCRIPT.parent)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sorted(e.step for e in committed(ck)) == [3, 5]


@pytest.mark.distributed
@pytest.mark.slow  # the launcher itself: tests/test_deepspeed.py's other launcher tests, default
def test_the_launchers_loader_is_deepspeeds_and_an_epoch_loop_resumes_exactly(tmp_path: Path):
    """A script that loops `for epoch in range(3): for batch in loader` (no step bound, unaware
    of resuming), on 2 ranks: through the launcher, an uninterrupted run trains on the batches
    of DeepSpeed's own loader (every epoch in the same order, 2 workers), loss for loss; killed
    in its second epoch and run again, it ends bit-identical (the loop starts at epoch 0 again;
    the passes the run had trained answer nothing)."""
    loop = ["--epochs", "3", *_opts(2, "fp32", every=4)]
    plain = ["--dir", str(tmp_path / "p"), "--out", str(tmp_path / "plain"), "--plain", *loop]
    run_group(plain, 2, tmp_path, "plain")
    full = ["--dir", str(tmp_path / "f"), "--out", str(tmp_path / "full"), "--launcher", *loop]
    run_group(full, 2, tmp_path, "full", module=True)
    for r in (0, 1):
        assert losses(tmp_path / "plain", r) == losses(tmp_path / "full", r)
    assert len(losses(tmp_path / "full", 0)) == 3 * 6  # 24 samples per rank, micro-batch 4
    kill = ["--dir", str(tmp_path / "k"), "--out", str(tmp_path / "kill"), "--launcher", *loop]
    kill.append("--sync")  # step 4 is committed before training goes on: the kill cannot beat it
    run_group([*kill, "--die-at", "6"], 2, tmp_path, "die", expect=-9, module=True)
    out = run_group(kill, 2, tmp_path, "resume", module=True)
    assert restored(tmp_path / "kill")["step"] == 4  # epoch 1 (0-based), one step into it
    assert "resilient_callbacks: resumed at step 4" in out[0]  # through DeepSpeed's logger
    assert_same_run(tmp_path / "full", tmp_path / "kill", 2)


def test_the_module_launchers_help_is_plain_text(capsys) -> None:
    """``python -m resilient_callbacks.deepspeed.run --help`` prints the usage without the
    docstring's reStructuredText marks (it printed ``code`` and :mod: roles)."""
    from resilient_callbacks.deepspeed import run

    with pytest.raises(SystemExit) as e:
        run.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m resilient_callbacks.deepspeed.run SCRIPT")
    assert "``" not in out and ":mod:" not in out


@pytest.mark.benchmark
def test_bench_deepspeed_quick(tmp_path: Path) -> None:
    """benchmarks/bench_deepspeed.py end to end at a toy size, overlapped mode included: every
    mode timed, the ratios computed, the overlapped saves blocking at all."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_deepspeed.py"
    cmd = [sys.executable, str(bench), "--mb", "8", "--steps", "4", "--every", "2", "--reps", "1"]
    cmd += ["--no-decoupled", "--overlap", "--out", str(tmp_path / "out")]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench_deepspeed.json").read_text())
    for mode in ("none", "ds", "ours", "ours_in_loop", "ours_overlap", "ours_overlap_in_loop"):
        assert len(report["times_s"][mode]) == 1, mode
    assert len(report["blocking_per_save_s"]["ours_overlap"]) == 2  # saves at steps 2 and 4
    assert report["ratios"]["ours_overlap_vs_ds"] is not None
    assert "ours overlapped, in the loop" in (tmp_path / "out" / "bench_deepspeed.md").read_text()


def test_overlap_defers_only_behind_a_plain_torch_optimizer_step() -> None:
    """What ZeroPart.stepped_by names, which decides whether an overlapped save defers the ZeRO
    ranges: the torch optimizer the ZeRO optimizer wraps; nothing for an optimizer that is not
    a torch one, for DeepSpeed's Muon (it commits its momentum into the optimizer's state before
    that step) or for ZenFlow (its own CPU step)."""
    import types

    import torch

    from resilient_callbacks.deepspeed.zero_part import ZeroPart

    def part(inner: object, **zero: object) -> ZeroPart:
        p = ZeroPart.__new__(ZeroPart)
        p.engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=inner, **zero))
        return p

    class MuonWithAuxAdam(torch.optim.SGD):
        pass

    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw = torch.optim.AdamW(params)
    assert part(adamw).stepped_by() == (adamw,)
    assert part(adamw, zenflow=False, use_muon=False).stepped_by() == (adamw,)
    assert part(object()).stepped_by() == ()
    assert part(MuonWithAuxAdam(params, lr=0.1)).stepped_by() == ()
    assert part(adamw, use_muon=True).stepped_by() == ()
    assert part(adamw, zenflow=True).stepped_by() == ()


NO_ITEM_SCRIPT = """
import glob, json, torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from resilient_callbacks.deepspeed import zero_part
from ds_noshm import skip_shm_op
skip_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
calls, item, capture = [], torch.Tensor.item, zero_part.ZeroPart.capture
def counted(self):
    calls.append(tuple(self.shape))
    return item(self)
def watched(self, buffers):
    torch.Tensor.item = counted
    try:
        return capture(self, buffers)
    finally:
        torch.Tensor.item = item
zero_part.ZeroPart.capture = watched
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": STAGE},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH + "/ck", "every_n_steps": 1}}
engine, *_ = rcds.initialize(model=torch.nn.Linear(4, 1), config=cfg)
for _ in range(2):
    engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
    engine.step()
engine.resilient_checkpoint.close()
print("ITEMS IN CAPTURE:", calls)
newest = sorted(glob.glob(DIRPATH + "/ck/step_*/parts/*/zero/rank_00000.json"))[-1]
print("STEPS:", json.dumps(json.load(open(newest))["steps"]))
"""


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_save_reads_no_number_off_a_tensor_on_the_training_thread(tmp_path: Path, stage) -> None:
    """ZeroPart.capture (the training thread, at every save) called ``.item()`` on the
    optimizer's step counts (and any one-value tensor of its state or hyper-parameters): on a
    GPU, where a capturable or fused optimizer keeps them, each save then waited for the GPU's
    queued work, against the snapshot's promise that the CPU does not wait. They are now copied
    with the ranges and read in the background write; the index holds the same numbers."""
    code = NO_ITEM_SCRIPT.replace("DIRPATH", repr(str(tmp_path))).replace("STAGE", str(stage))
    out = run_one_rank(tmp_path / "noitem.py", code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ITEMS IN CAPTURE: []" in out.stdout, out.stdout[-2000:]
    assert 'STEPS: [{"value": 2.0, "tensor_dtype": "float32"}]' in out.stdout, out.stdout[-2000:]


def test_a_resumed_zero3_trainer_counts_its_first_micro_batch_as_the_uninterrupted_run() -> None:
    """The Trainer's FLOP count of a new ZeRO-3 engine's first micro-batch sees its parameters
    partitioned (0 elements): after a restore it is counted again at the second micro-batch and
    the difference added, then the instance attribute goes; other engines are left alone
    (the end-to-end check: test_hf_trainer_with_deepspeed_kill_resume_exact, -m slow)."""
    import types

    from resilient_callbacks.transformers.under_deepspeed import continue_flos

    class Trainer:
        is_deepspeed_enabled = True

        def __init__(self, stage: int) -> None:
            self.model_wrapped = types.SimpleNamespace(zero_optimization_stage=lambda: stage)
            self.gathered = False  # the new engine's parameters: partitioned

        def floating_point_ops(self, inputs: dict) -> int:
            return 6 * inputs["input_ids"] * (10 if self.gathered else 0)

    t = Trainer(3)
    continue_flos(t)
    first = t.floating_point_ops({"input_ids": 4})  # partitioned: 0
    t.gathered = True  # the engine as the uninterrupted run's after its first micro-batch
    second = t.floating_point_ops({"input_ids": 5})
    assert (first, second) == (0, 6 * 5 * 10 + 6 * 4 * 10)
    assert "floating_point_ops" not in vars(t) and t.floating_point_ops({"input_ids": 1}) == 60
    other = Trainer(2)
    continue_flos(other)
    assert "floating_point_ops" not in vars(other)


EXIT0_SCRIPT = """
import sys, torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from resilient_callbacks import checkpointer
from resilient_callbacks.remote import RemoteStore
from ds_noshm import skip_shm_op
skip_shm_op()
checkpointer.CLOSE_OUTAGE_S = 0.5  # (300 s by default)

def down(self, *a, **k):
    raise ConnectionError("the store is down")

RemoteStore.upload = down
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(4, 1)
cfg = {"train_micro_batch_size_per_gpu": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH + "/a", "every_n_steps": 1,
                                "remote": "file://" + DIRPATH + "/remote"}}
engine, *_ = rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
with engine.resilient_checkpoint:
    engine.resilient_checkpoint.checkpointer._sync.retry_base_s = 0.05
    engine.resilient_checkpoint.checkpointer._sync.retry_max_s = 0.05
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
        engine.step()
    sys.exit(0)
"""


@pytest.mark.slow
def test_sys_exit_0_in_the_engines_with_block_does_not_hide_upload_incomplete(tmp_path: Path):
    """`with engine.resilient_checkpoint:` left by sys.exit(0) after close() gave up on the
    uploads: its __exit__ took the SystemExit for a failure, abort() logged the close's
    UploadIncompleteError and the job exited 0 with its newest checkpoints only local. The
    error is raised now (exit 1), as by a with block of a Checkpointer."""
    out = run_one_rank(tmp_path / "exit0.py", EXIT0_SCRIPT.replace("DIRPATH", repr(str(tmp_path))))
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert "UploadIncompleteError" in out.stderr.strip().splitlines()[-1], out.stderr[-3000:]
