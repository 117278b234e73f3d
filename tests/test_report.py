"""``resilient-ckpt report``: from a run SIGKILLed twice and resumed (real processes), the HTML
page (plots embedded), the PNG and the JSON; the failures, saves and goodput it reports match
what the run did. The headless-browser screenshot is slow-marked (needs Chromium)."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spawn_ranks
from resilient_callbacks import history
from resilient_callbacks.adaptive import DEFAULT_PRIOR_MTBF_HOURS, HOUR
from resilient_callbacks.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "monitor_train.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_killed_twice(tmp: Path, steps: int = 30, kills: tuple[int, ...] = (13, 24)) -> Path:
    """Three runs of monitor_train.py in ``tmp/ck``, each a process of its own forked from the
    session's zygote (spawn_ranks.run_python: torch imported once), SIGKILLed at ``kills``."""
    d = tmp / "ck"
    env = {
        **os.environ,
        "RESILIENT_PROGRESS_EVERY_S": "0.05",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    for kill in (*kills, None):
        args = [sys.executable, str(TRAIN), str(d), "--steps", str(steps), "--every", "5"]
        args += ["--sleep", "0.02"] + (["--kill-at", str(kill)] if kill else [])
        p = spawn_ranks.run_python(args, env, timeout=300)
        want = -9 if kill else 0
        assert p.returncode == want, p.stdout + p.stderr
    return d


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    return run_killed_twice(tmp_path_factory.mktemp("report"))


@pytest.mark.slow
def test_history_records_what_the_report_needs(killed_run: Path):
    recs = history.records(str(killed_run))
    kinds = [r["event"] for r in recs]
    assert kinds.count("start") == 1 and kinds.count("restart") == 2
    assert kinds.count("end") == 1 and kinds[-1] == "end"
    saves = [r for r in recs if r["event"] == "save"]
    assert [r["step"] for r in saves] == [5, 10, 10 + 5, 20, 25, 30][: len(saves)] or saves
    for r in saves:
        assert r["bytes"] > 0 and r["blocking_s"] >= 0 and r["persist_s"] > 0
        assert r["useful_s"] >= 0 and r["interval_steps"] == 5
    restarts = [r for r in recs if r["event"] == "restart"]
    assert [r["step"] for r in restarts] == [10, 20]
    assert all(r["tier"] == "local" and r["seconds"] > 0 for r in restarts)
    # the lifecycle the MTBF estimate reads is unchanged by the new records
    assert [e.event for e in history.read(str(killed_run))] == ["start", "restart", "restart"]


@pytest.mark.slow
def test_report_html_png_json(killed_run: Path, tmp_path: Path, capsys):
    pytest.importorskip("matplotlib")
    html_path, png, js = tmp_path / "r.html", tmp_path / "r.png", tmp_path / "r.json"
    rc = cli(
        [
            "report",
            str(killed_run),
            "--output",
            str(html_path),
            "--png",
            str(png),
            "--json",
            str(js),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    data = json.loads(js.read_text())
    s = data["summary"]
    assert s["failures"] == 2 and s["lives"] == 3 and s["finished_cleanly"]
    assert s["final_step"] == 30 and 0 < s["goodput"] < 1
    assert [f["restored_step"] for f in data["failures"]] == [10, 20]
    assert [f["last_seen_step"] for f in data["failures"]] == [13, 24] or all(
        f["restored_step"] <= f["last_seen_step"] <= k
        for f, k in zip(data["failures"], (13, 24), strict=True)
    )
    assert all(f["lost_work_s_at_least"] >= 0 for f in data["failures"])
    assert {c["tier"] for c in data["checkpoints"]} == {"local"}
    assert png.read_bytes().startswith(PNG_MAGIC)
    page = html_path.read_text()
    imgs = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(imgs) == 6  # every plot embedded: the page is self-contained
    assert all(base64.b64decode(i).startswith(PNG_MAGIC) for i in imgs)
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from elsewhere
    for title in ("Failures", "Checkpoints by tier", "Summary"):
        assert title in page


@pytest.mark.slow
def test_report_json_without_matplotlib_and_errors(killed_run: Path, tmp_path: Path, capsys):
    js = tmp_path / "r.json"
    assert cli(["report", str(killed_run), "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    assert report["summary"]["failures"] == 2
    assert [lf["ended"] for lf in report["lives"]] == ["killed", "killed", "clean"]
    assert cli(["report", str(tmp_path / "nope")]) == 2  # usage: no such directory
    assert "nope: no such directory (give the directory" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert cli(["report", str(tmp_path / "a-file")]) == 2
    assert "a-file: not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli(["report", str(tmp_path / "empty")]) == 3  # nothing to act on
    assert "history.jsonl" in capsys.readouterr().err


def two_lives(d: Path) -> Path:
    """Two processes' worth of a run in this one (closed, then resumed): 12 steps, a save
    every 3."""
    import torch

    from resilient_callbacks import Checkpointer

    state = {"w": torch.zeros(64)}
    for life in range(2):
        with Checkpointer(d, every_n_steps=3, async_save=life == 0) as ck:
            start = ck.restore(state)
            for step in range(start + 1, start + 7):
                state["w"] += 1
                time.sleep(0.01)  # the "training" between steps: useful time
                ck.step(step, state)
    return d


def test_report_of_an_in_process_run(tmp_path: Path, capsys):
    """Default suite (no subprocess): two processes' worth of a run in this one (closed, then
    resumed), and the HTML, PNG and JSON report of it."""
    d = two_lives(tmp_path / "ck")
    html_path, png, js = tmp_path / "r.html", tmp_path / "r.png", tmp_path / "r.json"
    assert (
        cli(["report", str(d), "--output", str(html_path), "--png", str(png), "--json", str(js)])
        == 0
    )
    s = json.loads(js.read_text())["summary"]
    assert s["lives"] == 2 and s["failures"] == 0 and s["clean_restarts"] == 1
    assert s["saves"] == 4 and s["final_step"] == 12 and 0 < s["goodput"] <= 1
    # a clean restart is no failure for the MTBF estimate either (it counted every process)
    prior = DEFAULT_PRIOR_MTBF_HOURS * HOUR
    assert s["mtbf_estimate_s"] == pytest.approx(prior + s["exposure_s"])
    assert 0 < s["exposure_s"] <= s["wall_s"]
    assert png.read_bytes().startswith(PNG_MAGIC)
    imgs = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html_path.read_text())
    assert len(imgs) == 6
    assert "unreadable" not in capsys.readouterr().err  # every history line was read


def test_a_loop_that_only_calls_save_has_an_unknown_goodput_not_zero(tmp_path: Path, capsys):
    """guide.md: "Use save() to save when you choose". Useful time is the compute between
    step() calls, so such a loop has none measured; the report said "goodput 0.0%" (found
    2026-12-06) and now says that it is unknown, and why."""
    import torch

    from resilient_callbacks import Checkpointer

    model = torch.nn.Linear(4, 2)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.restore({"model": model})
        for step in (10, 20):
            ck.save(step, {"model": model})
    js, page, png = tmp_path / "r.json", tmp_path / "r.html", tmp_path / "r.png"
    argv = ["report", str(tmp_path / "ck"), "--json", str(js), "--output", str(page)]
    assert cli([*argv, "--png", str(png)]) == 0  # the plots' titles took a number
    err = capsys.readouterr().err
    assert "goodput unknown (no step() call was timed" in err, err
    data = json.loads(js.read_text())
    assert data["summary"]["goodput"] is None and data["summary"]["saves"] == 2
    assert all(g["goodput"] is None for g in data["goodput"])


def test_report_json_before_the_directory_prints_the_json(tmp_path: Path, capsys, monkeypatch):
    """``report --json DIR``: argparse gave DIR to --json's optional FILE and stopped with "DIR
    is required"; a directory there is the DIR meant, the JSON goes to stdout. A FILE with no DIR
    is still a usage error, and nothing is written."""
    d = two_lives(tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli(["report", "--json", str(d)]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["saves"] == 4
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no report.html beside it, no JSON file
    with pytest.raises(SystemExit) as e:
        cli(["report", "--json", "out.json"])
    assert e.value.code == 2 and "required: DIR" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def _screenshot_tool():
    spec = importlib.util.spec_from_file_location(
        "screenshot_report", ROOT / "scripts" / "screenshot_report.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plot_boxes(png: Path) -> list[tuple[int, int, int, int]]:
    """The plot images of a screenshot of the report: the page draws each in a 1 px #eee
    border, so the boxes are where that border's vertical lines run (left, top, right, bottom)."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(png).convert("RGB"))
    border = (a == 238).all(axis=2)
    xs = [int(x) for x in np.nonzero(border.sum(axis=0) > 100)[0]]
    edges = [x for k, x in enumerate(xs) if k == 0 or x != xs[k - 1] + 1]  # each line once
    boxes = []
    for left, right in zip(edges[::2], edges[1::2], strict=False):
        col = border[:, left]
        y = 0
        while y < len(col):
            if col[y]:
                top = y
                while y < len(col) and col[y]:
                    y += 1
                if y - top > 100:
                    boxes.append((left, top, right, y))
            y += 1
    return sorted(boxes, key=lambda b: (b[1], b[0]))


def ink_and_colour(png: Path, box: tuple[int, int, int, int]) -> tuple[float, int, set]:
    """Within ``box``: the fraction of pixels drawn (not near white), the number of plot-colour
    pixels (saturated: not black, grey or white) and those colours (16 levels a channel)."""
    import numpy as np
    from PIL import Image

    left, top, right, bottom = box
    a = np.asarray(Image.open(png).convert("RGB"))[top + 1 : bottom - 1, left + 1 : right - 1]
    a = a.astype(int)
    ink = float((a.min(axis=2) < 200).mean())
    sat = (a.max(axis=2) - a.min(axis=2)) > 60
    colours = {tuple(int(c) // 16 for c in p) for p in a[sat]}
    return ink, int(sat.sum()), colours


@pytest.mark.slow
def test_report_opens_in_a_headless_browser(killed_run: Path, tmp_path: Path):
    """The report of a run SIGKILLed twice and resumed, rendered by headless Chromium
    (scripts/screenshot_report.py): the screenshot is the whole page, and each of the six plots
    of its 3 x 2 grid shows plot colours (a broken or missing image shows none). Skipped where
    no Chromium is installed (apt-get install chromium)."""
    pytest.importorskip("matplotlib")
    tool = _screenshot_tool()
    if tool.find_browser() is None:
        pytest.skip("no Chromium to render the page: apt-get install chromium")
    page = tmp_path / "r.html"
    assert cli(["report", str(killed_run), "--output", str(page)]) == 0
    shot = tmp_path / "shot.png"
    w, h = tool.screenshot(page, shot, width=1400)
    assert shot.read_bytes().startswith(PNG_MAGIC)
    assert w == 1400 and 1500 < h < 6000  # the plots and tables, cropped below the page
    boxes = plot_boxes(shot)
    assert len(boxes) == 6, boxes  # the 3 x 2 grid of plots, each drawn
    assert len({b[0] for b in boxes}) == 2 and all(b[2] - b[0] > 600 for b in boxes), boxes
    seen = [ink_and_colour(shot, b) for b in boxes]
    assert all(ink > 0.01 for ink, _, _ in seen), seen  # none blank: axes, text, lines
    coloured = [n for _, n, _ in seen]
    # the five charts draw in colour (the sixth, checkpoints by tier, is a table)
    assert sum(n > 100 for n in coloured) >= 5, coloured
    assert len(set().union(*(c for _, _, c in seen))) >= 6  # of several colours


def test_history_survives_a_torn_line_and_skips_malformed_records(tmp_path: Path, capsys):
    """A crash mid-append leaves a torn last line: the next record starts a line of its own
    (it used to be glued to the torn one and lost). Records whose time or step is not a number
    are skipped, as foreign lines are, and the report still renders."""
    root = str(tmp_path)
    history.append(root, "start", 0, "r1", 1)
    with open(os.path.join(root, history.HISTORY_NAME), "a") as f:
        f.write('{"event": "save", "time": 17')  # torn by a crash
        f.write('\n{"event": "save", "time": "soon", "step": 3}\n')
        f.write(
            '{"event": "save", "time": null, "step": 3}\n{"event": "save", "time": 5, "step": "x"}\n'
        )
    history.append(root, "restart", 5, "r1", 1)
    assert [r["event"] for r in history.records(root)] == ["start", "restart"]
    js = tmp_path / "r.json"
    assert cli(["report", root, "--json", str(js)]) == 0
    assert json.loads(js.read_text())["summary"]["failures"] == 1
    where = os.path.join(root, history.HISTORY_NAME)
    said = [line for line in capsys.readouterr().err.splitlines() if "unreadable" in line]
    assert said == [f"resilient-ckpt report: skipped 4 unreadable history lines in {where}"], said


def test_a_restore_parses_only_the_lifecycle_records_of_a_long_history(tmp_path: Path, monkeypatch):
    """A restore reads the history for its start and restart records, a handful among a save
    and a heartbeat a minute (30,000 records took 0.36 s at each restore, parsed one by one);
    lines that cannot be of the kinds asked for are skipped unparsed, and a record of another
    kind that merely mentions one (a reason "start") is still not taken for it."""
    root = str(tmp_path)
    history.append(root, "start", 0, "r1", 1)
    for step in range(1, 200):
        history.append(root, "save", step, "r1", 1, sync=False, reason="interval", bytes=10)
    history.append(root, "save", 200, "r1", 1, sync=False, reason="start")
    history.append(root, "restart", 150, "r1", 1)
    parsed = []
    loads = json.loads
    monkeypatch.setattr(history.json, "loads", lambda s: parsed.append(s) or loads(s))
    events = history.read(root, (*history.LIFECYCLE, "end"))
    assert [(e.event, e.step) for e in events] == [("start", 0), ("restart", 150)]
    assert len(parsed) == 3, parsed  # the two lifecycle lines and the save whose reason is "start"
    parsed.clear()
    assert len(history.records(root)) == 202 and len(parsed) == 202  # the report reads them all


def test_an_exception_is_recorded_as_a_failure_not_a_clean_end(tmp_path: Path):
    import torch

    from resilient_callbacks import Checkpointer

    state = {"w": torch.zeros(8)}
    with pytest.raises(RuntimeError), Checkpointer(tmp_path, every_n_steps=2) as ck:
        for step in range(1, 6):
            ck.step(step, state)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(state) == 4
    events = [(r["event"], r.get("error")) for r in history.records(str(tmp_path))]
    assert ("failed", "RuntimeError") in events and ("end", None) in events
    js = tmp_path / "r.json"
    assert cli(["report", str(tmp_path), "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    s = report["summary"]
    assert s["lives"] == 2 and s["failures"] == 1 and s["clean_restarts"] == 0
    # told apart from a kill (a life that left no record of how it ended)
    assert [(lf["ended"], lf["error"]) for lf in report["lives"]] == [
        ("failed", "RuntimeError"),
        ("clean", None),
    ]
    assert [(f["ended"], f["error"]) for f in report["failures"]] == [("failed", "RuntimeError")]


def test_an_uncaught_exception_without_a_with_block_is_recorded_as_a_failure(tmp_path: Path):
    """A plain loop (no ``with``, no adapter) dies of an exception: the Checkpointer closed at
    exit recorded a clean end, and the report said the run finished cleanly with no failure."""
    script = (
        "import sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1], every_n_steps=2)\n"
        "state = {'w': torch.zeros(8)}\n"
        "for step in range(1, 8):\n"
        "    ck.step(step, state)\n"
        "raise RuntimeError('NCCL watchdog: a collective timed out')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert p.returncode == 1 and "NCCL watchdog" in p.stderr, p.stderr
    events = [(r["event"], r.get("error")) for r in history.records(str(tmp_path))]
    assert events[-1] == ("failed", "RuntimeError"), events
    js = tmp_path / "r.json"
    assert cli(["report", str(tmp_path), "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    assert not report["summary"]["finished_cleanly"]
    assert [(lf["ended"], lf["error"]) for lf in report["lives"]] == [("failed", "RuntimeError")]


@pytest.mark.parametrize("ending", ["end", pytest.param("failed", marks=pytest.mark.slow)])
def test_a_synchronous_plain_loop_without_close_records_how_it_ended(tmp_path: Path, ending):
    """async_save=False, no ``with``, no close(): the exit hook that closes a Checkpointer
    was registered only for background saves (or telemetry), so a run that finished (exit 0,
    final step saved) left no 'end' record and each re-run counted as a failure (the learned
    MTBF shrank with every re-run), and one that died of an exception no 'failed' one."""
    script = (
        "import sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1], every_n_steps=2, async_save=False)\n"
        "state = {'w': torch.zeros(8)}\n"
        "ck.restore(state)\n"
        "for step in range(1, 5):\n"
        "    ck.step(step, state, final=step == 4)\n"
        f"{'raise RuntimeError(chr(98))' if ending == 'failed' else 'pass'}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert p.returncode == (1 if ending == "failed" else 0), p.stderr
    assert history.records(str(tmp_path))[-1]["event"] == ending


def test_processes_killed_before_the_first_checkpoint_are_failures_of_the_run(
    tmp_path: Path, capsys
):
    """Two processes SIGKILLed before their first save, then one that trains to the end: each
    re-run started a new run, and the report said 0 failures with the goodput of the last
    process alone (a job that keeps dying before its first save looked healthy). The re-runs
    go on as the killed run: its wall time, 2 failures; the report, metrics and MTBF say so."""
    import signal

    import torch

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.metrics import PREFIX

    script = (
        "import os, signal, sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "ck = Checkpointer(sys.argv[1], every_n_steps=100)\n"
        "state = {'w': torch.zeros(8)}\n"
        "assert ck.restore(state) == 0\n"
        "for step in range(1, 6):\n"
        "    ck.step(step, state)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for _ in range(2):  # (forked from the session's zygote: torch imported once)
        p = spawn_ranks.run_python([sys.executable, "-c", script, str(tmp_path)], env)
        assert p.returncode == -signal.SIGKILL
    state = {"w": torch.zeros(8)}
    with Checkpointer(tmp_path, every_n_steps=100, adaptive=True) as ck:
        assert ck.restore(state) == 0
        m = ck.metrics()
        for step in range(1, 4):
            ck.step(step, state, final=step == 3)
    assert m[PREFIX + "restarts_total"] == 2
    assert m[PREFIX + "mtbf_seconds"] < DEFAULT_PRIOR_MTBF_HOURS * HOUR / 2  # 3 lives, 2 failed
    lives = [r for r in history.records(str(tmp_path)) if r["event"] in history.LIFECYCLE]
    assert [r["event"] for r in lives] == ["start", "restart", "restart"]
    assert len({r["run_id"] for r in lives}) == 1
    js = tmp_path / "r.json"
    capsys.readouterr()
    assert cli(["report", str(tmp_path), "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    s = report["summary"]
    assert s["lives"] == 3 and s["failures"] == 2 and s["saves"] == 1, s
    # the summary line: a lower bound of 0.0 s read as nothing lost; killed before any record
    # past the step resumed from, the work lost is unknown, within the time no record covers
    said = capsys.readouterr().err
    assert s["work_lost_unknown"] == 2 and ">= 0.0 s" not in said, said
    assert "work lost unknown (nothing recorded past the step resumed from: " in said
    assert f", {s['unaccounted_s']:.1f} s from the failures' last records to the " in said
    assert s["wall_s"] >= lives[-1]["time"] - lives[0]["time"]
    assert report["other_runs"] == []


def test_the_report_of_a_live_run_shows_its_process_running_not_killed(tmp_path: Path):
    """A report made while the run trains (its writer holds the directory) called the live
    process's life "killed"; it is "running" until the process closes (then "clean")."""
    import torch

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.report import analyse

    state = {"w": torch.zeros(8)}
    with Checkpointer(tmp_path, every_n_steps=2) as ck:
        ck.restore(state)
        for step in range(1, 5):
            ck.step(step, state)
        live = analyse(str(tmp_path))
    assert [lf["ended"] for lf in live["lives"]] == ["running"]
    assert live["summary"]["running"] and not live["summary"]["finished_cleanly"]
    done = analyse(str(tmp_path))
    assert [lf["ended"] for lf in done["lives"]] == ["clean"] and not done["summary"]["running"]


def test_report_of_a_history_without_a_run_start_exits_1(tmp_path: Path, capsys):
    (tmp_path / history.HISTORY_NAME).write_text("")
    assert cli(["report", str(tmp_path)]) == 1
    assert "no history records of a run" in capsys.readouterr().err


def test_report_of_a_directory_above_the_runs_names_the_ones_below(tmp_path: Path, capsys):
    """`report demo_output` (the runs are in demo_output/plain/.../checkpoints) said "not a
    directory a Checkpointer wrote"; like ls, verify, inspect, gc and export it names the
    subdirectories that hold checkpoints (docs/cli.md: "every command says which")."""
    import torch

    from resilient_callbacks import Checkpointer

    for run in ("interrupted", "uninterrupted"):
        with Checkpointer(tmp_path / "plain" / run / "checkpoints", async_save=False) as ck:
            ck.save(1, {"w": torch.zeros(4)})
    assert cli(["report", str(tmp_path), "--json"]) == 3  # nothing to act on (here)
    err = capsys.readouterr().err
    assert "these subdirectories hold checkpoints: plain/interrupted/checkpoints (1), " in err
    assert f"e.g. {tmp_path / 'plain/interrupted/checkpoints'}" in err
    assert "not a directory a Checkpointer wrote" not in err
    assert cli(["report", str(tmp_path / "plain")]) == 3  # one level less high: the same
    assert "these subdirectories" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli(["report", str(tmp_path / "empty")]) == 3
    assert "not a directory a Checkpointer wrote" in capsys.readouterr().err


def test_report_status_of_a_corrupt_checkpoint(tmp_path: Path):
    """A byte flipped in the newest checkpoint: the report called it ``valid`` after a size
    check; it says ``unverified`` (as ``ls --fast``), and ``corrupt`` with ``--verify``."""
    import torch

    from resilient_callbacks import Checkpointer

    d = tmp_path / "ck"
    with Checkpointer(d, every_n_steps=2, async_save=False) as ck:
        for step in range(1, 5):
            ck.step(step, {"w": torch.full((256,), float(step))})
    data = d / "step_000000004" / "rank_00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))

    def statuses(*extra: str) -> dict[int, str]:
        js = tmp_path / "r.json"
        assert cli(["report", str(d), "--json", str(js), *extra]) == 0
        rows = json.loads(js.read_text())["checkpoints"]
        return {r["step"]: r["status"] for r in rows}

    assert statuses() == {2: "unverified", 4: "unverified"}
    assert statuses("--verify") == {2: "valid", 4: "corrupt"}


def test_report_of_a_run_restored_from_the_remote_on_a_new_machine(tmp_path: Path):
    """The local directory (and its history) is lost and the run resumes from the remote
    tier: the report's wall time counts from the run's start the checkpoint recorded, so its
    goodput stays a fraction (it counted from the restart: goodput 619% over time, 100%)."""
    import shutil

    import torch

    from resilient_callbacks import Checkpointer

    remote, d = f"file://{tmp_path}/remote", tmp_path / "ck"
    state = {"w": torch.zeros(16)}
    with Checkpointer(d, every_n_steps=4, remote=remote) as ck:
        ck.restore(state)
        for step in range(1, 9):
            time.sleep(0.05)  # useful time
            ck.step(step, state)
    time.sleep(0.5)  # the run is down: wall time, not useful time
    shutil.rmtree(d)
    with Checkpointer(d, every_n_steps=4, remote=remote) as ck:
        assert ck.restore(state) == 8
        ck.step(9, state, final=True)
    js = tmp_path / "r.json"
    assert cli(["report", str(d), "--json", str(js)]) == 0
    rep = json.loads(js.read_text())
    s = rep["summary"]
    assert s["history_begins_s"] >= 0.5 and s["wall_s"] >= s["history_begins_s"]
    assert s["useful_s"] < s["wall_s"]
    assert all(g["goodput"] is None or g["goodput"] <= 1 for g in rep["goodput"])


def test_report_json_alone_prints_to_stdout_and_o_is_a_remote_option(
    tmp_path: Path, capsys, monkeypatch
):
    """``--json`` with no FILE prints the numbers (no page written); ``-o`` is a remote-store
    option as for ``ls``/``gc``, not the output file (``-o endpoint_url=...`` used to write a
    page named after it)."""
    run = two_lives(tmp_path / "ck")  # (not the killed run: 14 s of the default suite)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli(["report", str(run), "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert data["summary"]["lives"] == 2 and data["summary"]["saves"] == 4
    assert not os.path.exists("report.html")
    # times as the other commands write them (they were epoch seconds; a user probe)
    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$")
    assert iso.match(data["generated"]), data["generated"]
    rows = data["checkpoints"]
    assert rows and all(iso.match(r["time"]) and "created" not in r for r in rows), rows
    assert out.startswith('{\n  "')  # indented as the other commands' JSON
    with pytest.raises(SystemExit):
        cli(["report", str(run), "-o"])  # -o needs KEY=VALUE


def test_report_never_writes_over_the_runs_own_files(tmp_path: Path, capsys):
    """``report DIR --json DIR/history.jsonl`` replaced the run's history with the report (and
    ``--output DIR/step_.../manifest.json`` a checkpoint's manifest): an output inside the
    checkpoint directory is refused unless it is a report file directly in it; nothing is
    written, the history and checkpoints are as they were."""
    d = two_lives(tmp_path / "ck")
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".lock"}
    step = sorted(d.glob("step_*"))[-1]
    for args in (
        ["--json", str(d / "history.jsonl")],
        ["--output", str(d / "latest")],
        ["--png", str(step / "manifest.json")],
        ["--json", str(step / "r.json")],
        ["--output", str(d)],
    ):
        assert cli(["report", str(d), *args]) == 2, args  # a usage error
        err = capsys.readouterr().err
        assert "checkpoint directory" in err, (args, err)
    after = {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    # a new report file directly in the directory is still fine
    assert cli(["report", str(d), "--json", str(d / "report.json")]) == 0
    assert json.loads((d / "report.json").read_text())["summary"]["saves"] == 4


def test_bytes_that_are_not_utf8_in_the_history_are_skipped_not_fatal(tmp_path: Path):
    """A history.jsonl with a line that is not UTF-8 (bit rot, a foreign tool's append) is a
    foreign line like any other: restore() resumed the run (it raised UnicodeDecodeError, so
    training could not start again) and the report still reads the run."""
    import torch

    from resilient_callbacks import Checkpointer

    d = two_lives(tmp_path / "ck")
    with open(d / history.HISTORY_NAME, "ab") as f:
        f.write(b"\xff\xfe\x00 not text\n")
    state = {"w": torch.zeros(64)}
    with Checkpointer(d, every_n_steps=3) as ck:
        assert ck.restore(state) == 12
        ck.step(13, state, final=True)
    js = tmp_path / "r.json"
    assert cli(["report", str(d), "--json", str(js)]) == 0
    s = json.loads(js.read_text())["summary"]
    assert s["lives"] == 3 and s["final_step"] == 13


def test_report_pages_of_a_garbled_directory(tmp_path: Path, capsys):
    """Records a foreign tool (or an older version) wrote, with no timings or a size that is
    no number, and a lock file that holds no JSON object: the page renders (the HTML/PNG
    failed with matplotlib's 'Data cannot be log-scaled', the lock file with an
    AttributeError), the plots that have nothing to show say so."""
    root = tmp_path / "ck"
    root.mkdir()
    (root / history.HISTORY_NAME).write_text(
        '{"event": "start", "time": 1.0, "step": 0, "run_id": "a"}\n'
        '{"event": "save", "time": 2.0, "step": 5, "run_id": "a", "bytes": "big",'
        ' "blocking_s": null}\n'
        '{"event": "end", "time": 4.0, "step": 7, "run_id": "a"}\n'
    )
    (root / ".lock").write_text("[1, 2]")
    out, js = tmp_path / "r.html", tmp_path / "r.json"
    assert cli(["report", str(root), "--output", str(out), "--json", str(js)]) == 0
    assert json.loads(js.read_text())["saves"][0]["bytes"] is None
    imgs = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", out.read_text())
    assert len(imgs) == 6


def test_report_says_when_the_remote_it_was_given_holds_no_checkpoint(tmp_path: Path, capsys):
    """``--remote`` with a mistyped URL (or a store never uploaded to) reads as an empty store:
    the report said nothing, and its table showed only local checkpoints, as if none had
    been uploaded. It says so on stderr and on the page, as ``ls --remote`` does."""
    d = two_lives(tmp_path / "ck")
    url = (tmp_path / "no-such-remote").as_uri()
    out, js = tmp_path / "r.html", tmp_path / "r.json"
    assert cli(["report", str(d), "--remote", url, "--output", str(out), "--json", str(js)]) == 0
    assert f"the remote {url} holds no checkpoint" in capsys.readouterr().err
    assert json.loads(js.read_text())["remote"] == url
    assert "holds no checkpoint" in out.read_text()


def test_report_says_whether_the_uploads_kept_up(tmp_path: Path):
    """A run with a remote tier: each upload is in the history (its checkpoint, size, upload
    time and how long after the commit it was durable remotely), and the report sums them up
    (uploads, median upload time, longest lag), where it said nothing about the remote tier
    without --remote."""
    import torch

    from resilient_callbacks import Checkpointer

    d, remote = tmp_path / "ck", (tmp_path / "remote").as_uri()
    state = {"w": torch.zeros(64)}
    with Checkpointer(d, every_n_steps=3, remote=remote) as ck:
        ck.restore(state)
        for step in range(1, 10):
            state["w"] += 1
            ck.step(step, state)
    ups = [r for r in history.records(str(d)) if r["event"] == "upload"]
    assert [(r["step"], r["name"]) for r in ups] == [
        (3, "step_000000003"),
        (6, "step_000000006"),
        (9, "step_000000009"),
    ]
    assert all(r["bytes"] > 0 and r["seconds"] >= 0 and r["lag_s"] >= 0 for r in ups)
    js, out = tmp_path / "r.json", tmp_path / "r.html"
    assert cli(["report", str(d), "--json", str(js), "--output", str(out)]) == 0
    data = json.loads(js.read_text())
    s = data["summary"]
    assert s["uploads"] == 3 and s["median_upload_s"] is not None
    assert s["max_upload_lag_s"] == max(r["lag_s"] for r in ups)
    assert [u["name"] for u in data["uploads"]] == [r["name"] for r in ups]
    assert "checkpoints uploaded" in out.read_text()


def _write_history(root: Path, records: list[tuple[str, float, int, float]]) -> Path:
    """A history.jsonl of run "r" as the recorder writes it: (event, time, step, useful_s)."""
    root.mkdir()
    lines = [
        json.dumps({"event": e, "time": t, "step": step, "run_id": "r", "useful_s": u})
        for e, t, step, u in records
    ]
    (root / history.HISTORY_NAME).write_text("\n".join(lines) + "\n")
    return root


def test_work_lost_to_a_kill_after_the_last_record_is_unknown_not_zero(tmp_path: Path, capsys):
    """The demo's run, SIGKILLed 7 steps past its save of step 30 and before any heartbeat
    (about one a minute), reported ">= 0.0 s of work lost": its last record is the checkpoint
    the restart resumed from, and when the kill came no record says. It is now "unknown"
    (summary ``work_lost_unknown``, each failure's ``lost_work_known``), within the time from
    the last record to the restart; a failure whose heartbeat went past its checkpoint keeps its
    lower bound, and a mix says which failures it leaves out."""
    from resilient_callbacks.report import analyse
    from resilient_callbacks.report_html import render_html

    killed_after_save = [("start", 100.0, 0, 0.0), ("save", 101.0, 10, 0.5)]
    restart = [("restart", 110.0, 10, 0.5), ("save", 111.0, 20, 1.0), ("end", 112.0, 20, 1.0)]
    d = _write_history(tmp_path / "a", killed_after_save + restart)
    assert cli(["report", str(d), "--json", str(tmp_path / "a.json")]) == 0
    said = capsys.readouterr().err
    assert ">= 0.0 s" not in said, said
    assert ", work lost unknown (nothing recorded past the step resumed from: " in said, said
    assert ", 9.0 s from the failures' last records to the restarts" in said
    data = analyse(str(d))
    s, (f,) = data["summary"], data["failures"]
    assert (f["lost_work_known"], s["work_lost_unknown"], s["unaccounted_s"]) == (False, 1, 9.0)
    row = render_html(data, {}).split("<h2>Failures</h2>")[1].split("</table>")[0]
    assert row.count("<td>unknown</td>") == 2, row  # lost steps and seconds

    heartbeat = ("progress", 102.0, 14, 0.7)  # 4 steps, 0.2 s of compute past the save
    killed_again = [("save", 113.0, 30, 1.5), ("restart", 120.0, 30, 1.5), ("end", 121.0, 30, 1.5)]
    d = _write_history(tmp_path / "b", [*killed_after_save, heartbeat, *restart[:2], *killed_again])
    data = analyse(str(d))
    assert [f["lost_work_known"] for f in data["failures"]] == [True, False]
    assert [f["lost_steps_at_least"] for f in data["failures"]] == [4, 0]
    assert cli(["report", str(d), "--json", str(tmp_path / "b.json")]) == 0
    said = capsys.readouterr().err
    assert ", >= 0.2 s of work lost (unknown for 1 of the 2 failures: no record past" in said
    assert ", 15.0 s more from the failures' last records to the restarts" in said, said
