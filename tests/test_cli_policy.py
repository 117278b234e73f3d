"""``gc --remote URL``'s remote retention (:mod:`resilient_callbacks.cli_policy`): the policy the
store's newest manifest records, ``--keep-last`` overriding it, said with where it came from.

A run without a remote tier (its checkpoints copied by ``push``) records its own retention but
no remote one, and ``gc DIR --remote URL`` refused to run without ``--keep-last N``: a remote tier
with default options keeps what the run keeps, so that is what gc now applies."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.manifest import SELF_CHECKSUM, self_checksum
from test_cli import cli

STEPS = (10, 20, 30, 40, 50, 60)


def record_no_retention(store: Path) -> None:
    """Every manifest under ``store`` (a local store's folder) sealed again without a retention
    policy: a writer that gave none (a ``CommitSession`` of its own)."""
    for path in store.glob("step_*/manifest.json"):
        m = json.loads(path.read_text())
        m.pop("retention", None)
        m.pop("remote_retention", None)
        m[SELF_CHECKSUM] = self_checksum(m)
        path.write_text(json.dumps(m))


def _pushed_run(tmp_path: Path) -> tuple[str, str]:
    """A run with no remote tier, its checkpoints pushed after each save (keep_last=3, the best
    by loss, every 20th step archived): the store holds every step, the directory its
    retention's. Its directory and the store's URL."""
    root, url = str(tmp_path / "ck"), (tmp_path / "remote").as_uri()
    model = torch.nn.Linear(2, 2)
    policy = {"keep_last": 3, "keep_best": 1, "monitor": "loss", "keep_every_n_steps": 20}
    for s in STEPS:  # (a push beside an open writer is refused: one session per save)
        with Checkpointer(root, async_save=False, **policy) as ck:
            ck.restore({"model": model})
            ck.save(s, {"model": model}, metrics={"loss": 0.001 if s == 10 else 1.0 / s})
        assert cli("push", root, url).returncode == 0
    return root, url


def _remote(r) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["remote"]


def _deleted(result: dict) -> list[int]:
    return [d["step"] for d in result["delete"]]


def test_gc_remote_of_a_pushed_store_applies_the_retention_the_run_recorded(tmp_path):
    root, url = _pushed_run(tmp_path)
    r = cli("gc", root, "--remote", url, "--dry-run")
    assert r.returncode == 0, r.stderr  # (before: 1, "records no remote retention")
    said = (
        f"{url}: remote retention keep_last=3, keep_best=1 by loss (min), keep_every_n_steps=20 "
        "(the run's own retention, recorded in step_000000060's manifest: it had no remote tier"
    )
    assert said in r.stdout, r.stdout
    got = _remote(cli("gc", root, "--remote", url, "--dry-run", "--json"))
    assert _deleted(got) == [30]  # 10 the best, 20/40/60 archives, 40-60 the last 3
    assert got["retention"]["keep_last"] == 3 and got["retention"]["keep_best"] == 1
    assert got["retention_from"].startswith("the run's own retention, recorded in step_000000060")
    # --keep-last overrides the recorded keep_last only, and says so
    got = _remote(cli("gc", root, "--remote", url, "--dry-run", "--json", "--keep-last", "1"))
    assert _deleted(got) == [30, 50]
    assert got["retention_from"].startswith("--keep-last 1; the rest the run's own retention")
    r = cli("gc", root, "--remote", url)
    assert r.returncode == 0, r.stderr
    left = sorted(p.name for p in (tmp_path / "remote").iterdir())
    assert left == [f"step_{s:09d}" for s in (10, 20, 40, 50, 60)]


def test_gc_remote_says_the_remote_retention_a_run_with_a_remote_tier_recorded(tmp_path):
    root, url = str(tmp_path / "ck"), (tmp_path / "remote").as_uri()
    with Checkpointer(root, async_save=False, remote=url, keep_last=1, remote_keep_last=2) as ck:
        for s in (10, 20, 30):
            ck.save(s, {"w": torch.zeros(2)})
    r = cli("gc", root, "--remote", url, "--dry-run")
    assert r.returncode == 0, r.stderr
    said = f"{url}: remote retention keep_last=2 (recorded as remote_retention in step_000000030"
    assert said in r.stdout, r.stdout


def test_gc_remote_of_a_store_recording_no_retention_is_a_usage_error(tmp_path):
    """Nothing recorded at all: gc cannot tell what the store keeps; it needs --keep-last (exit
    2, nothing deleted), with the URL alone as with the run's directory."""
    _, url = _pushed_run(tmp_path)
    record_no_retention(tmp_path / "remote")
    alone = str(tmp_path / "elsewhere")  # (no such directory: the store alone)
    r = cli("gc", alone, "--remote", url)
    assert r.returncode == 2, r.stdout
    assert "records no retention policy" in r.stderr and "pass --keep-last N" in r.stderr
    assert len(list((tmp_path / "remote").iterdir())) == len(STEPS)
    got = _remote(cli("gc", alone, "--remote", url, "--dry-run", "--json", "--keep-last", "2"))
    assert _deleted(got) == [10, 20, 30, 40]
    assert got["retention_from"] == "--keep-last 2; no retention recorded"


def _committed(store: Path) -> list[str]:
    return sorted(p.parent.name for p in store.glob("step_*/manifest.json"))


def _as_before_remote_retention(store: Path) -> None:
    """Every manifest under ``store`` as a version before 2026-11-24 wrote it: no
    ``remote_retention`` and no checksum of itself (added the day after)."""
    for path in store.glob("step_*/manifest.json"):
        m = json.loads(path.read_text())
        m.pop("remote_retention", None)
        m.pop(SELF_CHECKSUM, None)
        path.write_text(json.dumps(m))


def test_gc_remote_of_an_older_remote_tiers_store_deletes_nothing_without_keep_last(tmp_path):
    """A run with a remote tier of a version before manifests recorded ``remote_retention``
    recorded only its local tier's retention (keep_last alone: best and archive checkpoints
    were the remote's to keep). gc --remote read that as the remote's own and deleted the
    store's best checkpoint and archive points; such a manifest (no checksum of itself) cannot
    tell a pushed store from a remote tier's, so gc still asks for --keep-last N."""
    root, url = str(tmp_path / "ck"), (tmp_path / "remote").as_uri()
    opts = {"keep_last": 1, "keep_best": 1, "monitor": "loss", "keep_every_n_steps": 20}
    with Checkpointer(root, async_save=False, remote=url, **opts) as ck:
        for s in STEPS:
            ck.save(s, {"w": torch.zeros(2)}, metrics={"loss": 0.001 if s == 10 else 1.0 / s})
    held = _committed(tmp_path / "remote")
    assert {f"step_{s:09d}" for s in (10, 20, 40, 60)} <= set(held), held  # best, archives, last
    _as_before_remote_retention(tmp_path / "remote")
    alone = str(tmp_path / "elsewhere")  # (no such directory: the store alone)
    r = cli("gc", alone, "--remote", url)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pass --keep-last N" in r.stderr, r.stderr
    said = "step_000000060, records no remote_retention and was written by a version before"
    assert said in r.stderr, r.stderr
    assert _committed(tmp_path / "remote") == held
    got = _remote(cli("gc", alone, "--remote", url, "--dry-run", "--json", "--keep-last", "1"))
    assert got["retention"]["keep_best"] == 0  # (what --keep-last alone says: as before)
    assert got["retention_from"].startswith("--keep-last 1; the rest none: its newest"), got
