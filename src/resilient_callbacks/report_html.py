"""The report's plots (matplotlib, extra ``report``) and its one self-contained HTML page.

One job: draw what :func:`.report.analyse` computed. Six panels: a timeline of the run's lives
(steps over wall time, saves, failures, restarts), work lost per failure, time spent saving,
goodput over time, the interval used beside Daly's optimum, and the checkpoints by tier.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
from typing import Any

from .errors import ConfigError


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "the report draws its plots with matplotlib, which is not installed: "
            "pip install 'resilient-callbacks[report]' (--json needs nothing more)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _minutes(t: float) -> float:
    return t / 60.0


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_timeline(ax: Any, data: dict[str, Any]) -> None:
    for i, lf in enumerate(data["lives"]):
        ax.plot(  # each process: from where it began to its last record
            [_minutes(lf["begin_t"]), _minutes(lf["end_t"])],
            [lf["begin_step"], lf["last_step"]],
            color="tab:blue",
            lw=2,
            label="training (one line per process)" if i == 0 else None,
        )
    saves = data["saves"]
    if saves:
        ax.scatter(
            [_minutes(s["t"]) for s in saves],
            [s["step"] for s in saves],
            s=14,
            color="tab:green",
            zorder=3,
            label="checkpoint committed",
        )
    for i, f in enumerate(data["failures"]):
        ax.scatter(
            [_minutes(f["last_seen_t"])],
            [f["last_seen_step"]],
            marker="x",
            s=60,
            color="tab:red",
            zorder=4,
            label="failure (last record)" if i == 0 else None,
        )
        ax.annotate(
            "",
            xy=(_minutes(f["restart_t"]), f["restored_step"]),
            xytext=(_minutes(f["last_seen_t"]), f["last_seen_step"]),
            arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1},
        )
    for j, lf in enumerate(x for x in data["lives"] if x["how"] == "restart"):
        ax.axvline(
            _minutes(lf["begin_t"]),
            color="0.6",
            ls=":",
            lw=1,
            label="restart" if j == 0 else None,
        )
    ax.set_xlabel("wall time since the run started (min)")
    ax.set_ylabel("training step")
    ax.set_title("Timeline: runs, saves, failures, restarts")
    ax.legend(loc="upper left", fontsize=7)


def plot_lost(ax: Any, data: dict[str, Any]) -> None:
    fs = data["failures"]
    if not fs:
        _empty(ax, "no failures: nothing lost")
        ax.set_title("Work lost per failure")
        return
    xs = list(range(1, len(fs) + 1))
    lost = [f["lost_work_s_at_least"] for f in fs]
    gap = [f["unaccounted_s"] for f in fs]
    ax.bar(xs, lost, color="tab:red", label="compute lost (at least)")
    ax.bar(xs, gap, bottom=lost, color="tab:orange", alpha=0.6, label="down + restart + more lost")
    for x, f in zip(xs, fs, strict=True):
        ax.text(
            x,
            f["lost_work_s_at_least"] + f["unaccounted_s"],
            f"{f['lost_steps_at_least']} steps" if f.get("lost_work_known", True) else "unknown",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(xs)
    ax.set_xlabel("failure")
    ax.set_ylabel("seconds")
    ax.set_title("Work lost per failure")
    top = max(a + b for a, b in zip(lost, gap, strict=True))
    ax.set_ylim(0, top * 1.35 if top > 0 else 1)  # room above the bars for the legend
    ax.legend(fontsize=7, loc="upper center", ncol=2)


def plot_saving(ax: Any, data: dict[str, Any]) -> None:
    saves = data["saves"]
    if not saves:
        _empty(ax, "no checkpoint recorded")
        ax.set_title("Time spent saving")
        return
    drawn = False
    for rows, key, size, colour, label in (
        (saves, "persist_s", 10, "tab:gray", "persist (bg)"),
        (saves, "blocking_s", 14, "tab:purple", "blocking training"),
        (data.get("uploads") or [], "seconds", 10, "tab:green", "upload to the remote (bg)"),
    ):  # a log scale: only times > 0 (a record without timings has none to show)
        pts = [(_minutes(r["t"]), r[key]) for r in rows if r[key] is not None and r[key] > 0]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=size, color=colour, label=label)
            drawn = True
    if not drawn:
        _empty(ax, "no save timings recorded")
        ax.set_title("Time spent saving")
        return
    ax.set_yscale("log")
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("seconds per save")
    total = data["summary"].get("saving_blocked_s") or 0.0
    ax.set_title(f"Time spent saving (blocked {total:.2f} s in all)")
    ax.legend(fontsize=7)


def plot_goodput(ax: Any, data: dict[str, Any]) -> None:
    pts = [g for g in data["goodput"] if g["goodput"] is not None]
    if not pts:
        _empty(ax, "no progress recorded (useful time is timed between step() calls)")
    else:
        ax.plot([_minutes(g["t"]) for g in pts], [g["goodput"] for g in pts], color="tab:blue")
        for f in data["failures"]:
            ax.axvline(_minutes(f["last_seen_t"]), color="tab:red", ls=":", lw=1)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("wall time (min)")
        ax.set_ylabel("useful compute / wall time")
    g = data["summary"].get("goodput")
    ax.set_title("Goodput over time" + (f" (now {g:.1%})" if g is not None else ""))


def plot_interval(ax: Any, data: dict[str, Any]) -> None:
    saves = [s for s in data["saves"] if s["interval_used_s"] is not None]
    ax.set_title("Interval used vs Daly's optimum")
    if not saves:
        _empty(ax, "no intervals recorded")
        return
    xs = [s["step"] for s in saves]
    ax.plot(xs, [s["interval_used_s"] for s in saves], "o-", ms=3, label="used (compute s)")
    opt = [s["optimal_interval_s"] for s in saves]
    if any(v is not None for v in opt):
        ax.plot(xs, opt, "--", color="tab:green", label="Daly, MTBF as estimated then")
    obs = data["summary"].get("daly_interval_observed_s")
    if obs:
        ax.axhline(obs, color="tab:red", ls=":", label="Daly, observed MTBF of this run")
    ax.set_yscale("log")
    ax.set_xlabel("step of the save")
    ax.set_ylabel("seconds of compute between saves")
    ax.legend(fontsize=7)


def plot_tiers(ax: Any, data: dict[str, Any]) -> None:
    rows = data["checkpoints"]
    ax.set_title("Checkpoints by tier")
    ax.axis("off")
    if not rows:
        ax.text(0.5, 0.5, "no checkpoints", ha="center", va="center", color="0.4")
        return
    shown = rows[-12:]
    cells = [[r["tier"], r["name"], str(r["step"]), r["status"], _mb(r["bytes"])] for r in shown]
    table = ax.table(
        cellText=cells,
        colLabels=["tier", "checkpoint", "step", "status", "size"],
        loc="center",
        cellLoc="left",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    table.scale(1, 1.2)
    if len(rows) > len(shown):
        ax.text(0, 0, f"(the newest {len(shown)} of {len(rows)})", fontsize=7, color="0.4")


PANELS = (
    ("timeline", plot_timeline),
    ("lost", plot_lost),
    ("saving", plot_saving),
    ("goodput", plot_goodput),
    ("interval", plot_interval),
    ("tiers", plot_tiers),
)


def _mb(n: Any) -> str:
    return "?" if n is None else f"{n / 1e6:,.2f} MB"


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def figure_pngs(data: dict[str, Any]) -> dict[str, bytes]:
    """Each panel as its own PNG."""
    plt = _plt()
    out = {}
    for name, fn in PANELS:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        fn(ax, data)
        out[name] = _png(fig)
        plt.close(fig)
    return out


def overview_png(data: dict[str, Any]) -> bytes:
    """All six panels in one PNG (``--png``)."""
    plt = _plt()
    fig, axes = plt.subplots(3, 2, figsize=(13, 12))
    for ax, (_, fn) in zip(axes.flat, PANELS, strict=True):
        fn(ax, data)
    s = data["summary"]
    if s:
        g = "unknown" if s["goodput"] is None else f"{s['goodput']:.1%}"  # save() alone: untimed
        fig.suptitle(
            f"resilient-ckpt report: run {data['run_id']}, goodput {g}, "
            f"{s['failures']} failure(s), {s['saves']} saves",
            fontsize=12,
        )
    fig.tight_layout()
    png = _png(fig)
    plt.close(fig)
    return png


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return html.escape(str(v))


_SUMMARY_ROWS = (
    ("goodput", "goodput (useful compute / wall time)", lambda v: f"{v:.1%}"),
    ("wall_s", "wall time since the first start (s)", None),
    ("useful_s", "useful compute (s)", None),
    ("history_begins_s", "history here begins into the run (s; elsewhere before)", None),
    ("lives", "processes (start + restarts)", None),
    ("failures", "failures (killed or raised, restarted)", None),
    ("clean_restarts", "restarts after a clean stop", None),
    ("preemptions", "preemptions handled", None),
    ("saves", "checkpoints committed", None),
    ("saving_blocked_s", "training blocked by saves (s)", None),
    ("median_blocking_s", "median blocking per save (s)", None),
    ("median_persist_s", "median persist per save (s)", None),
    ("work_lost_s_at_least", "work lost to failures, at least (s)", None),
    ("work_lost_unknown", "failures whose work lost is unknown (no record past the resume)", None),
    ("unaccounted_s", "down, restarting or lost (s)", None),
    ("restore_s", "restoring (s)", None),
    ("median_interval_used_s", "median interval used (compute s)", None),
    ("daly_interval_observed_s", "Daly's optimum, observed MTBF (s)", None),
    ("daly_interval_estimate_s", "Daly's optimum, MTBF estimate with prior (s)", None),
    ("mtbf_observed_s", "observed MTBF (s)", None),
    ("uploads", "checkpoints uploaded to the remote tier", None),
    ("median_upload_s", "median upload time (s)", None),
    ("max_upload_lag_s", "longest from commit to uploaded (s)", None),
    ("final_step", "last step recorded", None),
    ("finished_cleanly", "last process closed cleanly", None),
    ("running", "last process still running (this host)", None),
)

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;max-width:1400px;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left}th{background:#f3f3f3}.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.grid img{width:100%;border:1px solid #eee}.note{color:#666;font-size:.85em}
"""


def render_html(data: dict[str, Any], pngs: dict[str, bytes]) -> str:
    """One self-contained page: the summary, the plots (embedded PNGs), the failures and the
    checkpoints by tier."""
    s = data["summary"]
    gen = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>resilient-ckpt report: {html.escape(str(data['run_id']))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Checkpointing report of run {html.escape(str(data['run_id']))}</h1>",
        f"<p class='note'>{html.escape(data['dir'])}, generated {gen}. How to read it: "
        "docs/monitoring.md.</p>",
    ]
    if data.get("missing"):
        parts.append(f"<p><b>{html.escape(data['missing'])}</b></p>")
    if s:
        parts.append("<h2>Summary</h2><table>")
        for key, label, fmt in _SUMMARY_ROWS:
            v = s.get(key)
            text = fmt(v) if fmt is not None and v is not None else _fmt(v)
            parts.append(f"<tr><th>{label}</th><td>{text}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>Plots</h2><div class='grid'>")
    for name, _ in PANELS:
        if name in pngs:
            b64 = base64.b64encode(pngs[name]).decode()
            parts.append(f"<img alt='{name}' src='data:image/png;base64,{b64}'>")
    parts.append("</div>")
    if data["failures"]:
        parts.append("<h2>Failures</h2><table><tr>")
        cols = (
            "ended",
            "error",
            "last_seen_step",
            "restored_step",
            "lost_steps_at_least",
            "lost_work_s_at_least",
            "unaccounted_s",
            "restore_s",
            "tier",
            "fallbacks",
        )
        parts.append("".join(f"<th>{c}</th>" for c in cols) + "</tr>")
        for f in data["failures"]:
            known = f.get("lost_work_known", True)  # (else killed at a time no record says)
            lost = ("lost_steps_at_least", "lost_work_s_at_least")
            cells = ("unknown" if not known and c in lost else _fmt(f.get(c)) for c in cols)
            parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    if data["checkpoints"]:
        parts.append("<h2>Checkpoints by tier</h2><table><tr>")
        tier_cols = ("tier", "name", "step", "status", "bytes", "reason", "run_id")
        parts.append("".join(f"<th>{c}</th>" for c in tier_cols) + "</tr>")
        for r in data["checkpoints"]:
            parts.append("<tr>" + "".join(f"<td>{_fmt(r[c])}</td>" for c in tier_cols) + "</tr>")
        parts.append("</table>")
    if data.get("remote") and not any(r["tier"] == "remote" for r in data["checkpoints"]):
        parts.append(
            f"<p class='note'>The remote {html.escape(data['remote'])} holds no checkpoint "
            "(a mistyped URL reads as an empty store).</p>"
        )
    if data.get("other_runs"):
        parts.append(
            "<p class='note'>The history also holds other runs: "
            + html.escape(", ".join(data["other_runs"]))
            + " (pick one with --run).</p>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)
