"""Training features users combine with a ``Checkpointer``, each stopped at a step, restored
into objects built afresh and trained on: the losses and the final state are those of a run
never stopped, bit for bit, or the save is refused naming the key. (AMP's ``GradScaler``,
``weight_norm``/``spectral_norm``/``orthogonal``, tied weights, ``AveragedModel``/``SWALR``,
gradient checkpointing and generators resume exactly on the code before these tests too.)"""

from __future__ import annotations

import logging
import tempfile
import warnings

import pytest
import torch
from torch import nn

from resilient_callbacks import Checkpointer, UnsupportedStateError


def _run_stopped_and_resumed(build, total: int = 8, stop: int = 4):
    """``build() -> (module, optimizer or None)``. Losses and final state dicts of a run never
    stopped and of one saved at ``stop``, rebuilt from another seed, restored and trained on."""

    def train(model, opt, steps):
        losses = []
        for _ in steps:
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
            if opt is not None:
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
        return losses

    def state(model, opt):
        return {"model": model} if opt is None else {"model": model, "opt": opt}

    torch.manual_seed(0)
    ref = build()
    ref_losses = train(*ref, range(total))
    torch.manual_seed(0)
    first = build()
    losses = train(*first, range(stop))
    with tempfile.TemporaryDirectory() as d:
        with Checkpointer(d, async_save=False) as ck:
            ck.save(stop, state(*first))
        torch.manual_seed(1)
        again = build()
        with Checkpointer(d, async_save=False) as ck:
            assert ck.restore(state(*again)) == stop
    losses += train(*again, range(stop, total))
    assert losses == ref_losses
    for a, b in zip(ref[0].state_dict().values(), again[0].state_dict().values(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    if ref[1] is not None:
        assert str(ref[1].state_dict()) == str(again[1].state_dict())


class _Checkpointed(nn.Module):
    """Gradient checkpointing of a block with dropout (its RNG state replayed in backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1))


def _parametrized(how):
    def build():
        m = _mlp()
        how(m[0])
        return m

    return build


P = nn.utils.parametrizations
MODELS = {
    "weight_norm": _parametrized(P.weight_norm),
    "spectral_norm": _parametrized(lambda m: P.spectral_norm(m, n_power_iterations=2)),
    "orthogonal": _parametrized(P.orthogonal),
    "orthogonal-householder": _parametrized(
        lambda m: P.orthogonal(m, orthogonal_map="householder")
    ),
    "checkpointing": lambda: _Checkpointed(reentrant=False),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_parametrized_and_checkpointed_models_resume_exactly(model):
    """Passed before these tests were written: kept so the guide's list stays true."""
    _run_stopped_and_resumed(lambda: (m := MODELS[model](), torch.optim.AdamW(m.parameters())))


def test_a_grad_scaler_resumes_after_a_skipped_step_exactly(tmp_path):
    """GradScaler("cpu") with bf16 autocast, an inf gradient at steps 2 and 5, stopped right
    after the skipped step, with the growth tracker at 1, and with the scale grown: the scale
    and tracker go on as in the run never stopped. (Passed before these tests were written;
    without the scaler in the state it fails.)"""

    def run(stop: int | None, total: int = 8):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        state = {"model": m, "opt": opt, "scaler": scaler}
        start, out = 0, []
        if stop is not None:
            after_init = torch.get_rng_state()
            torch.manual_seed(1)  # what the restore must put back
            with Checkpointer(tmp_path / str(stop), async_save=False) as ck:
                start = ck.restore(state)
            if not start:
                torch.set_rng_state(after_init)
        for i in range(start, total if stop is None or start else stop):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(torch.randn(4, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            if i in (2, 5):
                m[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            out.append((loss.item(), scaler.get_scale(), scaler._get_growth_tracker()))
        if stop is not None and not start:
            with Checkpointer(tmp_path / str(stop), async_save=False) as ck:
                ck.save(stop, state)
        return out, m.state_dict()

    ref, ref_sd = run(None)
    for stop in (3, 4, 5):
        first, _ = run(stop)
        again, sd = run(stop)
        assert first + again == ref, stop
        assert all(torch.equal(ref_sd[k], sd[k]) for k in ref_sd), stop


def _quiet_ao():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*quantiz.*", category=UserWarning)


def test_quantization_aware_training_resumes_exactly():
    """torch.ao's fake-quantize modules and per-channel observers size their scales and
    min/max buffers at the first forward and resize them when loading a state dict (as
    ``load_state_dict`` from ``torch.load`` does). The shape check before loading took the
    fresh model's sizes ([1], [0]) for a checkpoint of another model: a QAT run could never
    resume. Their own loading code decides now, and the resume is exact."""
    _quiet_ao()
    q = torch.ao.quantization

    def build():
        m = nn.Sequential(q.QuantStub(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        m.append(q.DeQuantStub()).train()
        m.qconfig = q.get_default_qat_qconfig("x86")
        q.prepare_qat(m, inplace=True)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    _run_stopped_and_resumed(build)


def test_a_float16_dynamic_quantized_model_restores():
    """``quantize_dynamic(..., dtype=torch.float16)`` saves (its packed weights are float16
    tensors) but never restored: its loading code reads the layout by the module's version,
    which ``state_dict()`` keeps beside the keys (``_metadata``, pickled by ``torch.save``) and
    the restore did not pass, so it took the oldest layout (KeyError '0.weight'); then a dtype
    in the state dict failed a check meant for tensors. It restores, without keeping a view of
    the checkpoint file."""
    _quiet_ao()

    def build():
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        return torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.float16), None

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*still view.*")
        _run_stopped_and_resumed(build)


def test_a_qint8_quantized_model_is_refused_at_save_saying_what_to_keep(tmp_path):
    """A qint8 model from ``quantize_dynamic`` holds quantized tensors in packed params: the
    save is refused, naming the key, and says to keep the float or QAT model instead."""
    _quiet_ao()
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    m = torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)
    with Checkpointer(tmp_path, async_save=False) as ck:
        with pytest.raises(UnsupportedStateError) as ei:
            ck.save(1, {"model": m})
        assert ck.checkpoints() == []
    msg = str(ei.value)
    assert "state['model']['0._packed_params._packed_params'][0]" in msg
    assert "quantize_dynamic" in msg and "after restore()" in msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.qint8])
def test_a_dynamic_quantized_lstm_is_refused_at_save_saying_what_to_keep(tmp_path, dtype):
    """``quantize_dynamic`` of an LSTM keeps its weights packed in TorchScript objects: the
    refusal named the key but advised writing ``state_dict()`` methods, which a user of
    torch.ao cannot; it says to keep the float or QAT model instead."""
    _quiet_ao()
    m = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.LSTM(4, 4)), {nn.LSTM}, dtype=dtype)
    with Checkpointer(tmp_path, async_save=False) as ck, pytest.raises(UnsupportedStateError) as ei:
        ck.save(1, {"model": m})
    msg = str(ei.value)
    assert "state['model']['0._all_weight_values.0.param']" in msg
    assert "quantized by torch.ao" in msg and "after restore()" in msg


def test_a_lazy_module_restores_before_its_first_forward(tmp_path):
    """``load_state_dict`` materializes a lazy module's uninitialized parameters
    (``nn.LazyLinear`` built, then restored, then run): the restore failed on reading their
    shape (a RuntimeError, not a checkpoint error). It loads them now, and the module's own
    load still refuses a shape it cannot take."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(1))
    x = torch.randn(4, 8)
    want = saved(x)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"model": saved})
    live = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(1))
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore({"model": live}) == 1
    assert torch.equal(live(x), want)


def test_a_sampler_in_the_state_is_refused_saying_what_to_save_instead(tmp_path):
    """A ``RandomSampler(generator=g)`` put in the state was refused with the advice for any
    object (write ``state_dict()`` methods): it names the resumable loader and the generator."""
    ds = torch.utils.data.TensorDataset(torch.randn(8, 2))
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    with Checkpointer(tmp_path, async_save=False) as ck, pytest.raises(UnsupportedStateError) as ei:
        ck.save(1, {"sampler": sampler})
    assert "state['sampler']" in str(ei.value)
    assert "ResumableDataLoader" in str(ei.value) and "sampler.generator" in str(ei.value)


_PLAIN: dict[tuple, object] = {}  # _lightning_runs' runs never stopped, by their options


def _lightning_runs(
    tmp_path,
    total: int,
    stop: int,
    qat: bool = False,
    swa: bool = False,
    compiled=(False, False),
    finetune: bool | str = False,
    all_params: bool = False,
):
    """A Lightning run of ``total`` steps never stopped, one stopped at ``stop`` with the
    callback and the one that resumes it: ``(plain, first, again, restored step)``.
    ``compiled``: whether the stopped run's and the resuming run's ``net`` is compiled on its
    own (eager backend); the run never stopped is compiled as the resuming one. ``finetune``:
    ``BackboneFinetuning`` of ``net[:2]`` (frozen, a BatchNorm too, until epoch 1);
    ``"partial"``: a ``BaseFinetuning`` that freezes ``net[:2]`` and unfreezes the weight of
    ``net[0]`` alone at epoch 1 (a group of its own where the optimizer lacks it), and freezes
    ``net[3]``'s bias at epoch 2. ``all_params``: the optimizer holds every parameter, frozen
    ones too."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import (
        BackboneFinetuning,
        BaseFinetuning,
        StochasticWeightAveraging,
    )

    class PartialUnfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone, train_bn=False)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                weight = pl_module.backbone[0].weight
                weight.requires_grad = True
                if not any(p is weight for g in optimizer.param_groups for p in g["params"]):
                    optimizer.add_param_group({"params": [weight], "lr": 0.01})
            if epoch == 2:
                pl_module.net[3].bias.requires_grad = False

    from resilient_callbacks.lightning import ResilientCheckpoint

    class Module(L.LightningModule):
        def __init__(self, compile_net: bool) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 1))
            if finetune:
                self.net[1] = nn.BatchNorm1d(8)
                self.backbone = self.net[:2]
            if compile_net:
                self.net = torch.compile(self.net, backend="eager")
            if qat:
                q = torch.ao.quantization
                self.net = nn.Sequential(q.QuantStub(), *self.net, q.DeQuantStub()).train()
                self.net.qconfig = _qconfig_with_eps()
                q.prepare_qat(self.net, inplace=True)
            self.losses: list[float] = []

        def configure_optimizers(self):
            held = [p for p in self.parameters() if p.requires_grad or all_params]
            return torch.optim.AdamW(held, lr=0.05)

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.losses.append(loss.item())
            return loss

    # 8 steps an epoch; the same data at every call (not drawn from the global generator,
    # wherever the tests before left it), so one run never stopped serves every stop
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    )

    def fit(steps: int, *callbacks, compile_net: bool) -> Module:
        L.seed_everything(0, verbose=False)
        module = Module(compile_net)
        if swa:
            callbacks = (StochasticWeightAveraging(0.01, 1, annealing_epochs=3), *callbacks)
        if finetune == "partial":
            callbacks = (PartialUnfreeze(), *callbacks)
        elif finetune:
            callbacks = (BackboneFinetuning(1, lambda epoch: 1.5, train_bn=False), *callbacks)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            callbacks=list(callbacks),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the run never stopped is the same for every stop: made once for the tests that
        # differ only in where they stop (each fit seeds everything anew: the same run)
        key = (total, qat, swa, compiled[1], finetune, all_params)
        if key not in _PLAIN:
            _PLAIN[key] = fit(total, compile_net=compiled[1])
        plain = _PLAIN[key]
        ck = tmp_path / "ck"
        first = fit(stop, ResilientCheckpoint(ck, every_n_steps=100), compile_net=compiled[0])
        rc = ResilientCheckpoint(ck, every_n_steps=100)
        again = fit(total, rc, compile_net=compiled[1])
    return plain, first, again, rc.restored_step


def test_lightning_finetuning_resumed_before_the_unfreeze_keeps_the_backbone_frozen(tmp_path):
    """An optimizer built over every parameter (``self.parameters()``, which ``BaseFinetuning``
    allows: a frozen parameter gets no gradient and no step) holds the frozen backbone from
    the start: a run resumed before the unfreeze epoch took every held parameter for one its
    finetuning had unfrozen, made the backbone trainable and trained it, unlike the run never
    stopped. Only what the saved run had trainable is trainable again."""
    plain, first, again, restored = _lightning_runs(tmp_path, 7, 4, finetune=True, all_params=True)
    assert restored == 4
    assert not again.backbone[0].weight.requires_grad
    _assert_same_run(plain, first, again)


def _assert_same_run(plain, first, again) -> None:
    assert first.losses + again.losses == plain.losses
    for a, b in zip(plain.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_lightning_quantization_aware_training_resumes_exactly(tmp_path):
    """The Lightning callback's own check that a checkpoint fits the model refused a QAT
    module's saved per-channel scales and observer min/max (sized at the first forward) as
    another model's: it leaves them to the modules' own loading code, as the core does."""
    plain, first, again, restored = _lightning_runs(tmp_path, 20, 11, qat=True)
    assert restored == 11
    _assert_same_run(plain, first, again)
    # read by the observer's version, which Lightning's load got from no _metadata: eps reset
    assert again.net[0].activation_post_process.activation_post_process.eps.item() == EPS


EPS = 2.0**-10


def _qconfig_with_eps():
    """The x86 QAT config with activation observers of another ``eps`` than the default."""
    q = torch.ao.quantization
    default = q.get_default_qat_qconfig("x86")
    return q.QConfig(activation=default.activation.with_args(eps=EPS), weight=default.weight)


def test_an_observers_own_eps_is_restored_not_reset_to_the_default(tmp_path):
    """An observer (torch.ao, quantization-aware training) reads a state dict by its module
    version, kept in the state dict's ``_metadata``; without one it takes it for its first
    layout and replaces the saved ``eps`` with the default: a QAT model with its own ``eps``
    was restored without error with another one. The live module's versions are passed."""
    _quiet_ao()
    from torch.ao.quantization.observer import MovingAverageMinMaxObserver

    saved = MovingAverageMinMaxObserver(eps=EPS)
    saved(torch.randn(10))
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"observer": saved})
    live = MovingAverageMinMaxObserver(eps=EPS)
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore({"observer": live}) == 1
    assert live.eps.item() == EPS
    assert torch.equal(live.min_val, saved.min_val) and torch.equal(live.max_val, saved.max_val)


@pytest.mark.parametrize("stop", [5, 13], ids=["first-swa-epoch", "annealing"])
def test_lightning_swa_resumed_mid_epoch_goes_on_as_the_run_did(tmp_path, stop):
    """Lightning's ``StochasticWeightAveraging`` makes its ``SWALR`` scheduler (from its
    restored state) only in ``on_train_epoch_start``, which Lightning does not call for an
    epoch resumed mid-way: the rest of that epoch ran without it, its step at the epoch's end
    was skipped, and every later learning rate and weight differed from the run never
    stopped (Lightning's own ``ckpt_path`` resume too). It starts at the resume now."""
    plain, first, again, restored = _lightning_runs(tmp_path, 30, stop, swa=True)
    assert restored == stop
    _assert_same_run(plain, first, again)


@pytest.mark.parametrize(
    "compiled_first", [True, False], ids=["compiled-then-not", "then-compiled"]
)
def test_a_submodule_compiled_in_one_run_only_restores_transparently(tmp_path, compiled_first):
    """A submodule compiled on its own (``model[0] = torch.compile(model[0])``) or an
    ``AveragedModel`` (EMA) of a compiled model carries ``_orig_mod.`` inside its keys
    (``0._orig_mod.weight``, ``module._orig_mod.0.weight``): a run that turned compiling on or
    off was refused (missing and unexpected keys), where a model compiled as a whole restores
    either way. The keys are matched without torch.compile's segment now."""

    def build(compiled: bool, seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        ema = torch.optim.swa_utils.AveragedModel(
            torch.compile(model, backend="eager") if compiled else model
        )
        if compiled:
            model[0] = torch.compile(model[0], backend="eager")
        return {"model": model, "ema": ema}

    saved = build(compiled_first, 0)
    saved["ema"].update_parameters(saved["model"])
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, saved)
    live = build(not compiled_first, 1)
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore(live) == 1
    for name in ("model", "ema"):
        got, want = live[name].state_dict().values(), saved[name].state_dict().values()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name


@pytest.mark.parametrize("compiled", [(True, False), (False, True)], ids=["then-not", "then-on"])
def test_lightning_a_submodule_compiled_in_one_run_only_resumes(tmp_path, compiled):
    """``self.net = torch.compile(self.net)`` in a LightningModule saves ``net._orig_mod.*``
    keys: a run that turned compiling on or off was refused as another model's. The weights
    Lightning loads are keyed as the live module has them now, and the run goes on exactly."""
    plain, first, again, restored = _lightning_runs(tmp_path, 12, 5, compiled=compiled)
    assert restored == 5
    _assert_same_run(plain, first, again)


def test_a_module_with_its_own_loader_is_still_checked_before_anything_loads(tmp_path):
    """Only torch.ao's modules decide about a saved shape themselves: a module of a user or a
    library with its own ``_load_from_state_dict`` (DETR's frozen BatchNorm drops a key, then
    loads as torch.nn does) gets the shape check before anything is loaded, naming the key."""
    from resilient_callbacks import CheckpointMismatchError

    class Renaming(nn.Linear):
        def _load_from_state_dict(self, state_dict, prefix, *args):
            state_dict.pop(prefix + "unused", None)
            super()._load_from_state_dict(state_dict, prefix, *args)

    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"first": torch.ones(2), "model": nn.Sequential(Renaming(4, 3))})
    first = torch.zeros(2)
    with (
        Checkpointer(tmp_path, async_save=False) as ck,
        pytest.raises(CheckpointMismatchError) as ei,
    ):
        ck.restore({"first": first, "model": nn.Sequential(Renaming(4, 2))})
    assert "state['model']['0.weight']: shape [3, 4] in checkpoint, [2, 4] in model" in str(
        ei.value
    )
    assert torch.equal(first, torch.zeros(2))  # nothing loaded


@pytest.mark.parametrize("stop", [11, 16], ids=["unfreeze-epoch", "epoch-end-after"])
def test_lightning_backbone_finetuning_resumed_after_the_unfreeze_trains_the_backbone(
    tmp_path, stop
):
    """``BaseFinetuning`` freezes its modules at every ``fit()`` and unfreezes them only at its
    epoch (1 here, steps 8-15): a run resumed in or after that epoch, mid-epoch or from an
    epoch's end, trained on with the backbone frozen although the optimizer held it (also with
    Lightning's own resume), so every later step differed. It is trainable again now."""
    plain, first, again, restored = _lightning_runs(tmp_path, 28, stop, finetune=True)
    assert restored == stop
    assert again.backbone[0].weight.requires_grad and again.backbone[1].track_running_stats
    _assert_same_run(plain, first, again)


def _trainable_and_groups(module) -> tuple[list[str], list[list[str]], list[bool]]:
    """The names of the trainable parameters, of each optimizer group's parameters, and
    which BatchNorm modules track their running statistics."""
    names = {id(p): n for n, p in module.named_parameters()}
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    groups = [
        [names[id(p)] for p in g["params"]] for g in module.trainer.optimizers[0].param_groups
    ]
    bn = [m.track_running_stats for m in module.modules() if isinstance(m, nn.BatchNorm1d)]
    return trainable, groups, bn


@pytest.mark.parametrize("all_params", [False, True], ids=["group-added", "all-held"])
@pytest.mark.parametrize("stop", [8, 9, 17], ids=["before", "after", "after-refreeze"])
def test_lightning_finetuning_of_part_of_a_module_resumes_as_the_run_did(
    tmp_path, stop, all_params
):
    """A ``BaseFinetuning`` that unfreezes one parameter of a module (the weight of a
    ``Linear``, not its bias) at epoch 1 and freezes the head's bias at epoch 2: the resume
    made whole modules trainable (every parameter of a module with one trainable one), and
    never froze again what the run had frozen, so the bias trained (with an optimizer that
    holds every parameter) and the frozen set differed from the run never stopped. Each
    parameter is trainable as it was at the save now; the optimizer's groups are the run's."""
    plain, first, again, restored = _lightning_runs(
        tmp_path, 28, stop, finetune="partial", all_params=all_params
    )
    assert restored == stop
    assert _trainable_and_groups(again) == _trainable_and_groups(plain)
    _assert_same_run(plain, first, again)


def test_a_users_module_with_a_child_named_orig_mod_is_saved_whole(tmp_path):
    """A user's own wrapper that names its inner model ``_orig_mod`` (as torch.compile's
    does) beside other children: it was taken for torch.compile's wrapper, only the inner
    model was saved and restored, and the ``head`` silently resumed from its initial weights.
    Only torch.compile's ``OptimizedModule`` is unwrapped now."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

    torch.manual_seed(0)
    saved = Wrapper()
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"model": saved})
    torch.manual_seed(1)
    live = Wrapper()
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore({"model": live}) == 1
    for a, b in zip(saved.state_dict().values(), live.state_dict().values(), strict=True):
        assert torch.equal(a, b)


class _ScaleV1(nn.Module):
    """Version 1 of a user's module: keeps the log of its scale, as ``log_scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor([0.5, -1.0]))


class _ScaleV2(nn.Module):
    """Version 2: keeps the scale itself, as ``scale``; its loader upgrades version 1's entry."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(2))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if (local_metadata.get("version") or 1) < 2 and prefix + "log_scale" in state_dict:
            state_dict[prefix + "scale"] = state_dict.pop(prefix + "log_scale").exp()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


class _GainV1(nn.Module):
    """Version 1 of another: ``gain`` holds the log of the gain."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([0.25, 2.0]))


class _GainV2(nn.Module):
    """Version 2: ``gain`` holds the gain itself, under the same name (nothing to check by)."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(2))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if (local_metadata.get("version") or 1) < 2 and prefix + "gain" in state_dict:
            state_dict[prefix + "gain"] = state_dict[prefix + "gain"].exp()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_a_module_whose_version_changed_since_the_save_upgrades_the_saved_entries(tmp_path):
    """A module's ``_load_from_state_dict`` upgrades an older layout by the version of the code
    that wrote it (as BatchNorm's does for a checkpoint of an older torch): the restore gave it
    the live module's version, so the renamed key was refused as another model's and a value
    whose meaning changed under the same name was loaded as it was, silently. The versions are
    recorded at the save now and the upgrade runs, as after ``torch.save``/``torch.load``."""
    torch.manual_seed(0)
    old = nn.Sequential(nn.Linear(2, 2), _ScaleV1(), _GainV1())
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"model": old})
    new = nn.Sequential(nn.Linear(2, 2), _ScaleV2(), _GainV2())
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore({"model": new}) == 1
    assert torch.equal(new[0].weight, old[0].weight) and torch.equal(new[0].bias, old[0].bias)
    assert torch.equal(new[1].scale, old[1].log_scale.exp())
    assert torch.equal(new[2].gain, old[2].gain.exp())


def test_an_upgrade_that_does_not_make_the_entries_fit_is_refused_naming_the_keys(tmp_path):
    """The entries of a module whose version changed are left to its loader, whose strict
    ``load_state_dict`` still refuses what its upgrade does not make fit, naming the keys."""
    from resilient_callbacks import CheckpointMismatchError

    class NoUpgrade(nn.Module):
        _version = 2

        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.zeros(2))

    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"model": nn.Sequential(nn.Linear(2, 2), _ScaleV1())})
    with (
        Checkpointer(tmp_path, async_save=False) as ck,
        pytest.raises(CheckpointMismatchError) as ei,
    ):
        ck.restore({"model": nn.Sequential(nn.Linear(2, 2), NoUpgrade())})
    assert "rejected the checkpoint" in str(ei.value)
    assert '"1.scale"' in str(ei.value) and '"1.log_scale"' in str(ei.value)


@pytest.mark.parametrize("compiled_first", [True, False], ids=["then-not", "then-compiled"])
def test_a_submodule_compiled_in_one_run_only_loads_by_its_own_version(tmp_path, compiled_first):
    """A submodule compiled on its own has two entries in ``_metadata``: torch.compile's wrapper
    (``2``, version 1) and the module (``2._orig_mod``, its own version). Restored uncompiled,
    the module was given the wrapper's version 1, and a loader that converts version-1 entries
    converted its own version-2 weights again, silently (``gain`` became ``exp(gain)``)."""

    def build(compiled: bool) -> nn.Module:
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), _GainV2())
        if compiled:
            model[2] = torch.compile(model[2], backend="eager")
        return model

    torch.manual_seed(0)
    saved = build(compiled_first)
    with torch.no_grad():
        saved[2].gain.copy_(torch.tensor([0.5, -1.5]))
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"model": saved})
    live = build(not compiled_first)
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore({"model": live}) == 1
    assert torch.equal(live[2].gain, saved[2].gain)
    assert torch.equal(live[0].weight, saved[0].weight)


def test_a_users_module_with_a_child_named_orig_mod_is_upgraded_by_its_saved_version(tmp_path):
    """A module of yours with a child named ``_orig_mod`` has the same ``_metadata`` names as
    torch.compile's wrapper; it is no wrapper on either side, so its saved version is still
    the one its loader is given (its ``gain`` of version 1 is converted)."""

    def build(gain: type[nn.Module]) -> nn.Module:
        holder = gain()
        holder._orig_mod = nn.Linear(2, 2)
        return nn.Sequential(nn.Linear(2, 2), holder)

    torch.manual_seed(0)
    old = build(_GainV1)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"model": old})
    new = build(_GainV2)
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore({"model": new}) == 1
    assert torch.equal(new[1].gain, old[1].gain.exp())
    assert torch.equal(new[1]._orig_mod.weight, old[1]._orig_mod.weight)


def test_a_checkpoint_without_versions_loads_by_the_live_modules_versions(tmp_path, monkeypatch):
    """A checkpoint written before the versions were recorded: the live module's are passed
    (it was written by the same code), so an observer keeps its saved ``eps``."""
    _quiet_ao()
    from torch.ao.quantization.observer import MovingAverageMinMaxObserver

    from resilient_callbacks import module_versions

    saved = MovingAverageMinMaxObserver(eps=EPS)
    saved(torch.randn(10))
    with monkeypatch.context() as m:
        m.setattr(module_versions, "recorded", lambda sd: None)
        with Checkpointer(tmp_path, async_save=False) as ck:
            ck.save(1, {"observer": saved})
    live = MovingAverageMinMaxObserver(eps=EPS)
    with Checkpointer(tmp_path, async_save=False) as ck:
        assert ck.restore({"observer": live}) == 1
    assert live.eps.item() == EPS and torch.equal(live.min_val, saved.min_val)


def test_lightning_a_module_whose_version_changed_since_the_save_upgrades_the_saved_entries(
    tmp_path,
):
    """The Lightning callback too: its check that the checkpoint fits the model refused the
    renamed key, and Lightning's load was given the live module's versions."""
    L = pytest.importorskip("lightning")
    from resilient_callbacks.lightning import ResilientCheckpoint

    class Module(L.LightningModule):
        def __init__(self, *blocks: nn.Module) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), *blocks)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def training_step(self, batch, batch_idx):
            x = self.net[0](batch[0])
            return sum((x * p).sum() for p in self.net[1:].parameters()).pow(2)

    def fit(module, steps):
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=1)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            callbacks=[rc],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        data = torch.utils.data.TensorDataset(torch.randn(8, 2))
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        return rc.restored_step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = Module(_ScaleV1(), _GainV1())
        fit(old, 2)
        new = Module(_ScaleV2(), _GainV2())
        assert fit(new, 2) == 2  # (at the run's max_steps: restored, nothing trained)
    assert torch.equal(new.net[0].weight, old.net[0].weight)
    assert torch.equal(new.net[1].scale, old.net[1].log_scale.exp())
    assert torch.equal(new.net[2].gain, old.net[2].gain.exp())


def _weight_averaging_runs(tmp_path, averaging: str, total: int, stop: int, fail_at=None):
    """Lightning runs with ``WeightAveraging`` (``"swa"``: every step; ``"ema"``:
    ``EMAWeightAveraging`` every 3rd step from step 5, and at every epoch's end from epoch 1)
    and a validation every 3 batches: never stopped, stopped at ``stop`` (or by an exception
    in the validation at step ``fail_at``, with ``save_on_exception``) and resumed. Two
    batches an optimizer step: a validation comes in the middle of an accumulation window.
    ``(plain, first, again, restored step)``, each module with its ``averaging`` callback."""
    L = pytest.importorskip("lightning")
    callbacks = L.pytorch.callbacks
    if not hasattr(callbacks, "WeightAveraging"):
        pytest.skip(f"Lightning {L.__version__} has no WeightAveraging (2.6 added it)")
    from resilient_callbacks.lightning import ResilientCheckpoint

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
            self.losses: list[float] = []
            self.fail_at = None

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            if self.trainer.global_step == self.fail_at:
                raise RuntimeError(f"validation failed at step {self.fail_at}")
            self.log("val", self.net(batch[0]).pow(2).mean())

    data = torch.utils.data.TensorDataset(torch.randn(64, 4))  # 8 steps an epoch

    def fit(steps: int, *callbacks_, fail_at=None) -> Module:
        L.seed_everything(0, verbose=False)
        module = Module()
        module.fail_at = fail_at
        if averaging == "swa":
            module.averaging = callbacks.WeightAveraging()
        else:
            module.averaging = callbacks.EMAWeightAveraging(
                decay=0.9, update_every_n_steps=3, update_starting_at_step=5,
                update_starting_at_epoch=1,
            )  # fmt: skip
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            callbacks=[module.averaging, *callbacks_],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            num_sanity_val_steps=0,
            limit_val_batches=1,
            val_check_interval=3,
            accumulate_grad_batches=2,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        trainer.fit(module, loader, torch.utils.data.DataLoader(data, batch_size=16))
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit(total)
        ck = tmp_path / "ck"
        first = ResilientCheckpoint(ck, every_n_steps=stop, save_on_exception=True)
        if fail_at is None:
            first = fit(stop, first)
        else:
            with pytest.raises(RuntimeError, match=f"validation failed at step {fail_at}"):
                fit(total, first, fail_at=fail_at)
        rc = ResilientCheckpoint(ck, every_n_steps=100)
        again = fit(total, rc)
    return plain, first, again, rc.restored_step


def _assert_same_average(plain, again) -> None:
    ours, theirs = again.averaging._average_model, plain.averaging._average_model
    for a, b in zip(theirs.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert again.averaging._latest_update_step == plain.averaging._latest_update_step
    for a, b in zip(plain.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # (the averaged weights, put into the model at the end)


@pytest.mark.slow
@pytest.mark.parametrize("averaging", ["swa", "ema"])
@pytest.mark.parametrize("stop", [7, 8, 17], ids=["mid-epoch", "epoch-end", "after-an-ema-epoch"])
def test_lightning_weight_averaging_resumes_its_average_as_the_run_did(tmp_path, averaging, stop):
    """Lightning's ``WeightAveraging`` saves its averaged model and the step of its last
    update, not the epoch of it (``_latest_update_epoch``): resumed mid-epoch, at an epoch's end
    and after an epoch-end update, its averaged model (``n_averaged`` too) and the weights it
    puts into the model at the end are the run's never stopped (the epoch guard matters only
    for an epoch whose end would run twice, which a resume from our checkpoints never does)."""
    plain, first, again, restored = _weight_averaging_runs(tmp_path, averaging, 24, stop)
    assert restored == stop
    assert first.losses + again.losses == plain.losses
    _assert_same_average(plain, again)


def test_lightning_an_exception_in_a_validation_with_weight_averaging_saves_nothing(
    tmp_path, caplog
):
    """``WeightAveraging`` swaps the averaged weights into the model for a validation: an
    exception there, in the middle of an accumulation window (no optimizer step since the
    last step's end), saved the averages as the trained weights (and the trained ones as the
    average), and the re-run resumed from them. Nothing is saved there now (a warning says
    why): the re-run resumes the last periodic checkpoint and is the run never stopped."""
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        plain, _, again, restored = _weight_averaging_runs(tmp_path, "swa", 12, 3, fail_at=4)
    assert "came during a validation, in which WeightAveraging puts the averaged" in caplog.text
    assert restored == 3
    assert again.losses == plain.losses[-len(again.losses) :] and len(again.losses) == 18
    _assert_same_average(plain, again)


def test_lightning_weight_averagings_trained_weights_load_by_the_modules_versions(tmp_path):
    """With ``WeightAveraging`` the checkpoint's ``state_dict`` holds the averages and the
    trained weights are in ``current_model_state``, which it loads with ``load_state_dict``
    itself: they reached it without the modules' versions (Lightning's own checkpoints keep
    them), so a module that reads a state dict without versions as its oldest layout (here:
    converts its ``gain``) loaded the trained weights converted, and the run went on from
    other weights. They are given the live module's versions now, and training goes on as
    the run never stopped. (Its averaged model is loaded from a dict WeightAveraging builds
    without versions, with Lightning's own checkpoints too: the final averages of such a
    module are not compared.)"""
    L = pytest.importorskip("lightning")
    callbacks = L.pytorch.callbacks
    if not hasattr(callbacks, "WeightAveraging"):
        pytest.skip(f"Lightning {L.__version__} has no WeightAveraging (2.6 added it)")
    from resilient_callbacks.lightning import ResilientCheckpoint

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), _GainV2())
            self.losses: list[float] = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def training_step(self, batch, batch_idx):
            loss = (self.net[0](batch[0]) * self.net[1].gain).pow(2).mean()
            self.losses.append(loss.item())
            return loss

    def fit(steps: int, *callbacks_) -> Module:
        L.seed_everything(0, verbose=False)
        module = Module()
        with torch.no_grad():
            module.net[1].gain.fill_(0.5)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            callbacks=[callbacks.WeightAveraging(), *callbacks_],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        data = torch.utils.data.TensorDataset(torch.randn(16, 2))
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit(6)
        first = fit(3, ResilientCheckpoint(tmp_path / "ck", every_n_steps=100))
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100)
        again = fit(6, rc)
    assert rc.restored_step == 3
    assert first.losses + again.losses == plain.losses


def test_lightning_a_max_time_stop_between_steps_with_weight_averaging_saves_the_trained_weights(
    tmp_path,
):
    """A ``Timer`` (or ``EarlyStopping``) stop after a batch that only accumulated gradients is
    saved at the fit's end. That save came after ``WeightAveraging.on_train_end``, which copies
    the averages into the model: the checkpoint held them as the trained weights, and the
    re-run given more ``max_time`` trained on from the averages. It is saved before the
    ``on_train_end`` hooks now, and the re-run is the run never stopped. (The clock is the
    number of batches: no real time.)"""
    L = pytest.importorskip("lightning")
    callbacks = L.pytorch.callbacks
    if not hasattr(callbacks, "WeightAveraging"):
        pytest.skip(f"Lightning {L.__version__} has no WeightAveraging (2.6 added it)")
    from lightning.pytorch.trainer.states import RunningStage

    from resilient_callbacks.lightning import ResilientCheckpoint

    class BatchClock(callbacks.Timer):
        def __init__(self, batches: int) -> None:
            super().__init__(duration={"seconds": batches}, interval="step")
            self.batches = 0

        def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
            self.batches += 1
            super().on_train_batch_end(trainer, *args, **kwargs)

        def time_elapsed(self, stage=RunningStage.TRAINING) -> float:
            training = RunningStage(stage) == RunningStage.TRAINING
            return self.batches + self._offset if training else 0.0

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
            self.losses: list[float] = []

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.losses.append(loss.item())
            return loss

    data = torch.utils.data.TensorDataset(torch.randn(32, 4))

    def fit(batches: int, *more) -> Module:
        L.seed_everything(0, verbose=False)
        module = Module()
        trainer = L.Trainer(
            max_steps=6,
            accelerator="cpu",
            callbacks=[callbacks.WeightAveraging(), BatchClock(batches), *more],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            limit_val_batches=0,
            accumulate_grad_batches=2,
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit(1000)
        first = fit(5, ResilientCheckpoint(tmp_path / "ck", every_n_steps=100))  # stops at 2
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100)
        again = fit(1000, rc)
    assert rc.restored_step == 2 and len(first.losses) == 5
    assert first.losses[:4] + again.losses == plain.losses  # (batch 5 is trained again)
    for a, b in zip(plain.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_lightning_an_exception_mid_window_with_weight_averaging_saves_each_models_buffers(
    tmp_path,
):
    """``save_on_exception`` saves the buffers of the last step's end (a forward since then
    moved BatchNorm's running statistics) by putting them into the checkpoint's
    ``state_dict``. With ``WeightAveraging`` that holds the averaged model, and the trained one
    is in ``current_model_state``: the averages' running statistics were overwritten with the
    trained model's, and the trained model kept those of the failed batch's forward. The
    re-run's averaged model and final weights differed from the run never stopped."""
    L = pytest.importorskip("lightning")
    callbacks = L.pytorch.callbacks
    if not hasattr(callbacks, "WeightAveraging"):
        pytest.skip(f"Lightning {L.__version__} has no WeightAveraging (2.6 added it)")
    from resilient_callbacks.lightning import ResilientCheckpoint

    class Module(L.LightningModule):
        def __init__(self, fail_at: int | None) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
            self.averaging = callbacks.WeightAveraging()
            self.fail_at, self.batches = fail_at, 0

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.batches += 1
            if self.batches == self.fail_at:  # after the forward: the statistics moved
                raise RuntimeError("training failed")
            return loss

    data = torch.utils.data.TensorDataset(torch.randn(64, 4))

    def fit(rc=None, fail_at=None) -> Module:
        L.seed_everything(0, verbose=False)
        module = Module(fail_at)
        trainer = L.Trainer(
            max_steps=6,
            accelerator="cpu",
            callbacks=[module.averaging, *([rc] if rc else [])],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            limit_val_batches=0,
            accumulate_grad_batches=2,
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit()
        first = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100, save_on_exception=True)
        with pytest.raises(RuntimeError, match="training failed"):
            fit(first, fail_at=6)  # the window of step 3's second batch: step 2 is saved
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100)
        again = fit(rc)
    assert rc.restored_step == 2
    _assert_same_average(plain, again)


def test_lightning_weight_averaging_weights_are_upgraded_by_their_saved_versions(tmp_path):
    """``WeightAveraging`` replaces the checkpoint's ``state_dict`` by a plain dict of the
    averages, so no module version was recorded with it, and the trained weights
    (``current_model_state``) were loaded by the live module's versions: a module whose
    version changed since the save (``gain`` holds its log in version 1) took the saved
    entries as its own layout, silently. The versions of the module that wrote them are
    recorded and given to its loader now, as without ``WeightAveraging``."""
    L = pytest.importorskip("lightning")
    callbacks = L.pytorch.callbacks
    if not hasattr(callbacks, "WeightAveraging"):
        pytest.skip(f"Lightning {L.__version__} has no WeightAveraging (2.6 added it)")
    from resilient_callbacks.lightning import ResilientCheckpoint

    class Module(L.LightningModule):
        def __init__(self, gain: type[nn.Module]) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), gain())
            self.at_start: torch.Tensor | None = None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def training_step(self, batch, batch_idx):
            return (self.net[0](batch[0]) * self.net[1].gain).pow(2).mean()

        def on_train_start(self) -> None:  # the trained weights as restored
            self.at_start = self.net[1].gain.detach().clone()

        def on_train_batch_end(self, *args) -> None:  # (on_train_end copies the averages in)
            self.trained = self.net[1].gain.detach().clone()

    def fit(gain: type[nn.Module], steps: int) -> Module:
        L.seed_everything(0, verbose=False)
        module = Module(gain)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            callbacks=[callbacks.WeightAveraging(), ResilientCheckpoint(tmp_path / "ck")],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        data = torch.utils.data.TensorDataset(torch.randn(16, 2))
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = fit(_GainV1, 2)
        new = fit(_GainV2, 3)
    assert new.at_start is not None and torch.equal(new.at_start, old.trained.exp())


def test_lightning_an_exception_after_an_epochs_start_hooks_saves_nothing(tmp_path, caplog):
    """``save_on_exception`` saves the last step's state; after an epoch's last step that is a
    checkpoint of the epoch's end, whose resume runs the next epoch's ``on_train_epoch_start``
    hooks. An exception after they ran (the first batch of epoch 2) saved the optimizers and
    callbacks as those hooks left them: ``BackboneFinetuning`` had scaled the backbone's
    learning rate for epoch 2, and the resume scaled it again. Nothing is saved when such a
    hook changed the optimizers' parameter groups now (a warning says why): the re-run
    resumes the last periodic checkpoint and is exact. (Hooks that only draw random numbers
    still get the save: tests/test_lightning.py.)"""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import BackboneFinetuning

    from resilient_callbacks.lightning import ResilientCheckpoint

    class Module(L.LightningModule):
        def __init__(self, fail_at: int | None) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.head = nn.Linear(8, 1)
            self.losses: list[float] = []
            self.fail_at, self.batches = fail_at, 0

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)

        def training_step(self, batch, batch_idx):
            self.batches += 1
            if self.batches == self.fail_at:
                raise RuntimeError("training failed")
            loss = self.head(self.backbone(batch[0])).pow(2).mean()
            self.losses.append(loss.item())
            return loss

    data = torch.utils.data.TensorDataset(torch.randn(32, 4))  # 4 steps an epoch

    def fit(rc=None, fail_at=None) -> Module:
        L.seed_everything(0, verbose=False)
        module = Module(fail_at)
        trainer = L.Trainer(
            max_steps=12,
            accelerator="cpu",
            callbacks=[BackboneFinetuning(1, lambda epoch: 1.5), *([rc] if rc else [])],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit()
        first = ResilientCheckpoint(tmp_path / "ck", every_n_steps=3, save_on_exception=True)
        with (
            caplog.at_level(logging.WARNING, logger="resilient_callbacks"),
            pytest.raises(RuntimeError, match="training failed"),
        ):
            fit(first, fail_at=9)  # epoch 2's first batch: step 8 ended epoch 1
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=3)
        again = fit(rc)
    for a, b in zip(plain.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert rc.restored_step == 6 and again.losses == plain.losses[6:]
    assert "an on_train_epoch_start hook changed the optimizers' parameter groups" in caplog.text
