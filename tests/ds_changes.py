"""A DeepSpeed run (one rank, CPU) whose optimizer, dtype and loss scale the tests choose, for
what a resume must do when they are unusual or changed between runs.

    python ds_changes.py --dir D --steps N [--every K] [--opt NAdam] [--dtype fp16] [--stage 2]
                         [--scale-power P] [--micro B] [--data] [--scheduler [WarmupDecayLR|LambdaLR|Cosine]]
                         [--lr-by-hand] [--total N] [--t-max N] [--set-t-max N]
                         [--roll-back-at S]

Trains ``Linear(8, 8)`` to optimizer step N (a save every K), from the newest checkpoint in D
if there is one, then prints one line ``RESULT {json}``: the step restored from, the fp32
parameters' digest, the loss scaler's state, the first group's lr and the optimizer state's
keys, whether DeepSpeed's ``safe_get_full_optimizer_state`` finds the first moment, and
(``--data``) the indices of the samples this run trained on. ``--set-t-max``: the Cosine
scheduler's ``T_max`` set once ``rcds.initialize`` returned (the restore's advice);
``--roll-back-at S``: at step S, ``engine.resilient_checkpoint.restore()`` again (once), as a
loop that saw a NaN loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from ds_noshm import skip_shm_op
from ds_train import allow_fp16_on_cpu
from spawn_ranks import world_of_one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--opt", default="AdamW")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--scale-power", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)  # train_micro_batch_size_per_gpu
    ap.add_argument("--lr-by-hand", action="store_true")  # lr halved each step by the loop
    ap.add_argument("--data", action="store_true")  # training_data=; trains from the engine's
    ap.add_argument("--deepscale", action="store_true")  # the config as args.deepscale_config
    ap.add_argument("--freeze-bias", action="store_true")  # requires_grad=False
    ap.add_argument("--sub-group-size", type=int)  # ZeRO 3: partitions of sub-groups
    ap.add_argument("--two-groups", action="store_true")  # the bias in a group of its own
    # DeepSpeed's WarmupLR in the config (or the scheduler named, warming up for 5 steps;
    # LambdaLR, Cosine: torch's LambdaLR, CosineAnnealingLR, given to initialize)
    ap.add_argument("--scheduler", nargs="?", const="WarmupLR")
    ap.add_argument("--total", type=int, default=20)  # WarmupDecayLR's total_num_steps
    ap.add_argument("--t-max", type=int, default=10)  # Cosine's T_max
    ap.add_argument("--set-t-max", type=int)  # engine.lr_scheduler.T_max, after initialize
    ap.add_argument("--roll-back-at", type=int)  # restore() again at that step
    args = ap.parse_args()
    world_of_one()
    skip_shm_op()
    allow_fp16_on_cpu()
    import resilient_callbacks.deepspeed as rcds

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model.bias.requires_grad_(not args.freeze_bias)
    kw = {"momentum": 0.9} if args.opt == "SGD" else {}
    trained = [p for p in model.parameters() if p.requires_grad]
    if args.two_groups:  # (as a no-weight-decay group for biases)
        trained = [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}]
    opt = getattr(torch.optim, args.opt)(trained, lr=args.lr, **kw)
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.micro,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "resilient_checkpoint": {"dirpath": args.dir, "every_n_steps": args.every},
    }
    if args.scheduler and args.scheduler not in ("LambdaLR", "Cosine"):
        params = {"warmup_num_steps": 5}
        if args.scheduler == "WarmupDecayLR":
            params["total_num_steps"] = args.total
        cfg["scheduler"] = {"type": args.scheduler, "params": params}
    if args.sub_group_size:
        cfg["zero_optimization"]["sub_group_size"] = args.sub_group_size
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": args.scale_power, "hysteresis": 1}
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=torch.Generator()),
        torch.arange(64),  # (and each one's index)
    )
    how: dict = {"config": cfg}
    if args.deepscale:  # DeepSpeed's deprecated flag, which it still reads
        path = os.path.join(os.path.dirname(os.path.abspath(args.dir)), "ds.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        how = {"args": argparse.Namespace(deepscale_config=path, deepspeed_config=None)}
    engine, _, loader, _ = rcds.initialize(
        model=model,
        optimizer=opt,
        training_data=data if args.data else None,
        # torch's LambdaLR, given to initialize (not in the config)
        lr_scheduler=(
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
            if args.scheduler == "LambdaLR"
            else torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.t_max)
            if args.scheduler == "Cosine"
            else None
        ),
        **how,
    )
    restored = engine.global_steps
    values = single_values(engine)  # as restored, before any step
    if args.set_t_max is not None:
        engine.lr_scheduler.T_max = args.set_t_max
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    for _ in range(engine.global_steps):  # the batches already trained on
        torch.randn(4, 8, generator=g)
    batches = iter(engine.training_dataloader) if args.data else None
    samples: list[int] = []  # the indices of the samples this run trained on (--data)
    while engine.global_steps < args.steps:
        if engine.global_steps == args.roll_back_at:
            args.roll_back_at = None
            engine.resilient_checkpoint.restore()  # (the newest checkpoint)
        if batches is not None:
            x, index = next(batches)
            samples.extend(index.tolist())
        else:
            x = torch.randn(4, 8, generator=g)
        loss = engine(x.to(dtype)).float().pow(2).mean()
        engine.backward(loss)
        if args.lr_by_hand:  # (a schedule of the script's own, as nanoGPT's get_lr)
            for group in engine.optimizer.optimizer.param_groups:
                group["lr"] = args.lr * 0.5**engine.global_steps
        engine.step()
    engine.resilient_checkpoint.close()
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    digest = hashlib.sha1(
        b"".join(
            (safe_get_full_fp32_param(p) if args.stage else p.detach().float()).numpy().tobytes()
            for p in model.parameters()
            if p.requires_grad
        )
    ).hexdigest()
    try:
        moment = safe_get_full_optimizer_state(model.weight, "exp_avg")
        found = moment is not None
    except (ValueError, TypeError) as e:  # "exp_avg not found ..."; no state at all yet
        found = f"{type(e).__name__}: {e}"
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # (ZeRO 0: torch's)
    keys = sorted({k for st in inner.state.values() for k in st})
    result = {
        "restored": restored,
        "digest": digest,
        "scale": getattr(scaler, "cur_scale", None),
        "dynamic": getattr(scaler, "dynamic", None),
        "lr": inner.param_groups[0]["lr"],
        "t_max": getattr(engine.lr_scheduler, "T_max", None),  # (--scheduler Cosine)
        "keys": keys,
        "restored_values": values,
        "values": single_values(engine),
        "exp_avg": found,
        "samples": samples,
        "engines_loader_is_the_returned_one": args.data and engine.training_dataloader is loader,
    }
    print("RESULT " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()  # (as ds_train.py: no gloo threads left at exit)


def single_values(engine) -> list[dict[str, float]]:
    """Each flat partition's optimizer state values that are one number (NAdam's
    ``mu_product``), in the order of the partitions."""
    if engine.zero_optimization_stage() == 0:
        return []  # (not partitioned)
    inner, zero = engine.optimizer.optimizer, engine.optimizer
    flats = getattr(zero, "single_partition_of_fp32_groups", None)
    if flats is None:
        flats = zero.fp32_partitioned_groups_flat
    state = [inner.state.get(f, {}) for f in flats]
    return [
        {k: float(v) for k, v in st.items() if k != "step" and torch.as_tensor(v).numel() == 1}
        for st in state
    ]


if __name__ == "__main__":
    main()
