"""Peak host memory (resident set) of saving and restoring, against torch's and DCP's own, in one run.

    .venv/bin/python benchmarks/bench_memory.py [--mb 3000] [--only CASE,...] [--dir DIR]

A user with a big model on a node with little RAM loses the run when a save or a resume is
OOM-killed, so what counts is the *peak*, not the growth over saves (``bench_async.py`` checks
that). Every case runs in a fresh process holding the state of ``bench_async.py`` (square
Linear layers + AdamW state, ``--mb`` MB in all: 3000 is a ~1 GB model); right before the
operation the process resets its peak (``/proc/self/clear_refs``), after it reads ``VmHWM``.
The figure of a case is its **peak above the resident set it started from, in units of the
state's size** (``+1.00x`` = one more copy of the whole state at the worst moment), and the
same for the resident set left once the operation returned (``after``: a copy kept alive).
The CLI cases run ``resilient-ckpt`` as a child process and take its peak above the peak of a
child that only imports torch and the library.

Cases: saves (each saves twice, as a run does; the baselines ``torch.save`` and DCP's
``save``/``async_save`` of the same state), restores into live modules (a fresh model and an
AdamW without state, as a resumed run has them; baselines ``torch.load(mmap=True)`` and
``torch.load()`` + ``load_state_dict``), the CLI's ``verify`` and ``export``, and the
Transformers Trainer's and Lightning's own checkpointing against our callbacks
(``--mb`` of a Llama built from a config, no download). Writes ``bench_memory.{json,md}``
into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from bench_async import build_state, nbytes_of, state_tensors
from common import library_version, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
SAVES = [
    "torch.save",
    "dcp.save",
    "dcp.async_save",
    "sync",
    "async",
    "zstd",
    "incremental",
    "remote",
    "keep_last=1",
]
RESTORES = [
    "torch.load(mmap)",
    "torch.load",
    "restore",
    "restore zstd",
    "restore remote",
]
CLI = ["verify", "export"]
FRAMEWORKS = ["hf save", "hf ours save", "hf resume", "hf ours resume", "pl save", "pl ours save"]
BASELINE = {
    "dcp.save": "torch.save",
    "dcp.async_save": "torch.save",
    "sync": "torch.save",
    "async": "torch.save",
    "zstd": "torch.save",
    "incremental": "torch.save",
    "remote": "torch.save",
    "keep_last=1": "torch.save",
    "torch.load": "torch.load(mmap)",
    "restore": "torch.load(mmap)",
    "restore zstd": "torch.load(mmap)",
    "restore remote": "torch.load(mmap)",
    "hf ours save": "hf save",
    "hf ours resume": "hf resume",
    "pl ours save": "pl save",
}


def mem() -> dict[str, int]:
    with open("/proc/self/status") as f:
        s = f.read()
    return {
        k: int(m.group(1)) << 10
        for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
        if (m := re.search(k + r":\s+(\d+) kB", s))
    }


def reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return mem()["VmRSS"]


def ours(path: str, **kw: Any) -> Any:
    from resilient_callbacks import Checkpointer

    kw.setdefault("async_save", False)
    return Checkpointer(path, preemption=False, **kw)


def dcp_flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


# ----------------------------------------------------------------------------- workers


def save_case(case: str, work: str, mb: int) -> dict[str, Any]:
    model, opt = build_state(mb)
    state = {"model": model, "optimizer": opt}
    out = os.path.join(work, "case")
    start = reset_peak()
    if case == "torch.save":
        for _ in range(2):
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out + ".pt")
    elif case.startswith("dcp."):
        import torch.distributed.checkpoint as dcp

        for i in range(2):
            if case == "dcp.save":
                dcp.save(dcp_flat(model, opt), checkpoint_id=f"{out}{i}")
            else:
                dcp.async_save(dcp_flat(model, opt), checkpoint_id=f"{out}{i}").result()
    else:
        kw: dict[str, Any] = {
            "sync": {},
            "async": {"async_save": True},
            "zstd": {"compression": "zstd"},
            "incremental": {"incremental": True},
            "remote": {"remote": "file://" + os.path.join(work, "remote")},
            "keep_last=1": {"keep_last": 1},
        }[case]
        with ours(out, **kw) as ck:
            for step in (1, 2):
                ck.save(step, state)
    peak = mem()["VmHWM"]
    after = reset_peak()
    return {"start": start, "peak": peak, "after": after}


def restore_case(case: str, work: str, mb: int) -> dict[str, Any]:
    from bench_async import build_model

    model = build_model(mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt}
    start = reset_peak()
    if case.startswith("torch.load"):
        sd = torch.load(
            os.path.join(work, "torch.pt"), mmap=case.endswith("(mmap)"), weights_only=True
        )
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        del sd
        step = 1
    else:
        where = {"restore": "sync", "restore zstd": "zstd", "restore remote": "pulled"}[case]
        kw: dict[str, Any] = {}
        if case == "restore zstd":
            kw["compression"] = "zstd"
        if case == "restore remote":
            kw["remote"] = "file://" + os.path.join(work, "remote")
        with ours(os.path.join(work, where), **kw) as ck:
            step = ck.restore(state)
    peak = mem()["VmHWM"]
    after = reset_peak()
    assert step >= 1 and len(opt.state) == len(list(model.parameters())), "nothing restored"
    return {"start": start, "peak": peak, "after": after}


def child_peak(argv: list[str]) -> int:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if status:
        raise RuntimeError(f"{argv} failed: {err[-2000:]}")
    return int(usage.ru_maxrss) << 10


def cli_case(case: str, work: str, mb: int) -> dict[str, Any]:
    py = sys.executable
    floor = child_peak([py, "-c", "import torch, resilient_callbacks.cli"])
    src = os.path.join(work, "sync")
    if case == "verify":
        argv = [py, "-m", "resilient_callbacks", "verify", src]
    else:
        argv = [py, "-m", "resilient_callbacks", "export", src, os.path.join(work, "exported")]
        shutil.rmtree(os.path.join(work, "exported"), ignore_errors=True)
    peak = child_peak(argv)
    return {"start": floor, "peak": peak, "after": floor}


# --------------------------------------------------------------------------- frameworks


def llama(mb: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 1024
    per_layer = 12 * hidden * hidden  # attention 4h^2 + MLP 3 * h * (2h) ... in params
    layers = max(1, mb * 1_000_000 // 12 // per_layer)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def framework_case(case: str, work: str, mb: int) -> dict[str, Any]:
    if case.startswith("hf"):
        return hf_case(case, work, mb)
    return pl_case(case, work, mb)


def hf_case(case: str, work: str, mb: int) -> dict[str, Any]:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 1024, (16, 16))
    data = [{"input_ids": r, "labels": r} for r in ids]
    mine = "ours" in case
    out = os.path.join(work, "hf_ours" if mine else "hf")
    resume = case.endswith("resume")
    args = TrainingArguments(
        output_dir=out,
        max_steps=3 if resume else 2,
        per_device_train_batch_size=1,
        save_strategy="no" if mine else "steps",
        save_steps=1,
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    marks: dict[str, int] = {}

    class Mark(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            # the step's own peak (forward, backward, AdamW) is not the save's: reset after it
            if not marks.get("done"):
                marks["start"] = reset_peak()

        def on_train_end(self, *a: Any, **k: Any) -> None:
            marks["peak"] = mem()["VmHWM"]

    trainer = Trainer(model=llama(mb), args=args, train_dataset=data, callbacks=[Mark()])
    if mine:  # after Mark: the peak reset comes before the save
        from resilient_callbacks.transformers import ResilientCheckpoint

        trainer.add_callback(ResilientCheckpoint(out, every_n_steps=1, async_save=False))
    if resume:
        marks["done"] = 1
        marks["start"] = reset_peak()
        trainer.train(resume_from_checkpoint=None if mine else True)
        # the resume's peak: up to the first step (reset happens after it, but "done" stops it)
    else:
        trainer.train()
    after = reset_peak()
    return {"start": marks["start"], "peak": marks["peak"], "after": after}


def pl_case(case: str, work: str, mb: int) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader

    mine = "ours" in case
    marks: dict[str, int] = {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = llama(mb)

        def training_step(self, batch: Any, i: int) -> Any:
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    out = os.path.join(work, "pl_ours" if mine else "pl")
    if mine:
        from resilient_callbacks.lightning import ResilientCheckpoint

        cbs: list[Any] = [ResilientCheckpoint(dirpath=out, every_n_steps=1, async_save=False)]
    else:
        cbs = [L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=1)]

    class Mark(L.Callback):
        def on_train_batch_end(self, *a: Any) -> None:
            marks["start"] = reset_peak()  # the save's peak, not the step's (saves run after)

    cbs.insert(0, Mark())
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        callbacks=cbs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(torch.randint(0, 1024, (16, 16)), batch_size=1)
    trainer.fit(Module(), loader)
    peak = mem()["VmHWM"]
    return {"start": marks["start"], "peak": peak, "after": reset_peak()}


# ----------------------------------------------------------------------------- driver


def worker(case: str, work: str, mb: int) -> dict[str, Any]:
    if case in SAVES:
        return save_case(case, work, mb)
    if case in RESTORES:
        return restore_case(case, work, mb)
    if case in CLI:
        return cli_case(case, work, mb)
    return framework_case(case, work, mb)


def prepare(work: str, mb: int) -> int:
    """The checkpoints the restore and CLI cases read; the state's size in bytes."""
    model, opt = build_state(mb)
    state = {"model": model, "optimizer": opt}
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict()},
        os.path.join(work, "torch.pt"),
    )
    with ours(os.path.join(work, "sync")) as ck:
        ck.save(1, state)
    with ours(os.path.join(work, "zstd"), compression="zstd") as ck:
        ck.save(1, state)
    with ours(os.path.join(work, "pushed"), remote="file://" + os.path.join(work, "remote")) as ck:
        ck.save(1, state)
    shutil.rmtree(os.path.join(work, "pushed"))
    return nbytes_of(state_tensors(model, opt))


def run_case(case: str, work: str, mb: int) -> dict[str, Any]:
    for name in os.listdir(work):  # each save case starts from an empty directory
        if name.startswith("case"):
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
            if os.path.exists(os.path.join(work, name)):
                os.remove(os.path.join(work, name))
    shutil.rmtree(os.path.join(work, "pulled"), ignore_errors=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.join(os.path.dirname(HERE), "src"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", case, "--dir", work, "--mb", str(mb)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--mb", type=int, default=3000)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.mb)))
        return 0
    cases = SAVES + RESTORES + CLI + FRAMEWORKS
    if args.only:
        cases = [c for c in cases if c in args.only.split(",")]
    work = tempfile.mkdtemp(prefix="rc-bench-memory-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        nbytes = prepare(work, args.mb)
        res: dict[str, dict[str, Any]] = {}
        for case in cases:
            res[case] = r = run_case(case, work, args.mb)
            if "error" not in r:
                r["extra"] = (r["peak"] - r["start"]) / nbytes
                r["kept"] = (r["after"] - r["start"]) / nbytes
            print(case, json.dumps(r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = [
        f"State {nbytes / 1e9:.2f} GB (model + AdamW, fp32), {platform.node()} "
        f"({os.cpu_count()} CPUs), torch {torch.__version__}, library {library_version()}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}. Peak above the start, in states "
        "(1.00 = one more copy of the whole state); vs baseline = the same minus the baseline's.",
        "",
        "| case | peak above start | left after | baseline | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for case, r in res.items():
        if "error" in r:
            md.append(f"| {case} | error: {r['error'][:80]} | | | |")
            continue
        base = BASELINE.get(case, "")
        vs = ""
        if base in res and "extra" in res[base]:
            vs = f"{r['extra'] - res[base]['extra']:+.2f}"
        md.append(f"| {case} | {r['extra']:+.2f} | {r['kept']:+.2f} | {base} | {vs} |")
    md.append(f"\n({time.perf_counter() - t0:.0f} s)")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.out, "bench_memory", {"state_bytes": nbytes, "cases": res}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
