"""A composed trainfold loop computes the same parameters, bit for bit, as Accelerate's canonical loop."""

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, loop, make_step, nan_guard, run_epoch, testing

from helpers import build, canonical_loop, ce_loss, needs_cuda

CONFIGS = {
    "fp32": dict(),
    "accumulation_4": dict(gradient_accumulation_steps=4),
    "clip_norm": dict(clip_norm=0.5),
    "bf16_cpu": dict(mixed_precision="bf16"),
    "scheduler": dict(scheduler=True),
    "dropout_shuffled": dict(dropout=0.3, shuffle=True),
    "all_together": dict(
        gradient_accumulation_steps=4, clip_norm=0.5, mixed_precision="bf16", scheduler=True, dropout=0.3, shuffle=True
    ),
}

#: The same comparison on a GPU (skipped without CUDA): autocast there, and fp16 with Accelerate's GradScaler.
CUDA_CONFIGS = {
    "fp32_cuda": dict(),
    "bf16_cuda": dict(mixed_precision="bf16"),
    "fp16_cuda": dict(mixed_precision="fp16"),
    "fp16_all_together_cuda": dict(
        gradient_accumulation_steps=4, clip_norm=0.5, mixed_precision="fp16", scheduler=True, dropout=0.3, shuffle=True
    ),
}


def _accelerator(cfg):
    return Accelerator(
        cpu=not cfg.get("cuda", False),
        gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1),
        mixed_precision=cfg.get("mixed_precision", "no"),
    )


def _run_both(cfg, epochs=3, seed=0):
    build_kw = {k: cfg[k] for k in ("dropout", "shuffle", "scheduler") if k in cfg}

    model, opt, sched, dl = build(seed, **build_kw)
    torch.manual_seed(seed + 100)
    expected, losses = canonical_loop(
        _accelerator(cfg), model, opt, sched, dl, ce_loss, epochs=epochs, clip_norm=cfg.get("clip_norm")
    )

    testing.reset_accelerate_state()
    model, opt, sched, dl = build(seed, **build_kw)
    torch.manual_seed(seed + 100)
    ctx = Context(accelerator=_accelerator(cfg))
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(dl)
    step = make_step(ctx, ce_loss, clip_grad_norm=cfg.get("clip_norm"))
    final = loop(run_epoch(ctx, step, dl), max_epochs=epochs)(state)
    return expected, losses, final


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_composed_loop_equals_canonical_accelerate_loop(name):
    """Same seed, same data: identical parameters after three epochs."""
    expected, _, final = _run_both(CONFIGS[name])

    testing.assert_params_equal(expected, final)


@needs_cuda
@pytest.mark.parametrize("name", sorted(CUDA_CONFIGS))
def test_composed_loop_equals_canonical_accelerate_loop_on_a_gpu(name):
    expected, _, final = _run_both({**CUDA_CONFIGS[name], "cuda": True})

    assert next(final.model.parameters()).is_cuda
    testing.assert_params_equal(expected, final)


def _fp16_overflowing_accelerator():
    """fp16 with a loss scale of 2**24: the first updates overflow and the GradScaler skips them, halving the scale."""
    from accelerate.utils import GradScalerKwargs

    return Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**24)])


@needs_cuda
@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "nan_guard"])
def test_fp16_skipped_updates_are_not_counted(guarded):
    """Both loops skip the same updates; ``state.step`` counts only the applied ones, and nan_guard counts the skipped."""
    acc = _fp16_overflowing_accelerator()
    model, opt, _, dl = build(0)
    model, opt, dl = acc.prepare(model, opt, dl)
    applied = 0
    for _ in range(3):
        for batch in dl:
            with acc.accumulate(model):
                acc.backward(ce_loss(model, batch))
                opt.step()
                opt.zero_grad()
            applied += not opt.step_was_skipped
    expected = testing.parameters(model)

    testing.reset_accelerate_state()
    model, opt, _, dl = build(0)
    ctx = Context(accelerator=_fp16_overflowing_accelerator())
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    step = make_step(ctx, ce_loss, stages=[nan_guard(100, check_every=5)] if guarded else [])
    final = loop(run_epoch(ctx, step, dl), max_epochs=3)(state)

    assert 0 < applied < 21  # some updates skipped, some applied (7 batches, 3 epochs)
    assert (applied, 21) == (final.step, final.micro_step)
    if guarded:
        assert 21 - applied == final.extras["nan_guard"].skipped
    testing.assert_params_equal(expected, final)


def test_epoch_loss_is_mean_of_the_canonical_loops_batch_losses():
    """history['train_loss'] holds each epoch's mean batch loss."""
    expected, losses, final = _run_both(CONFIGS["accumulation_4"], epochs=2)

    per_epoch = len(losses) // 2
    means = [torch.stack(losses[i * per_epoch : (i + 1) * per_epoch]).mean().item() for i in range(2)]
    assert final.history["train_loss"] == pytest.approx(means, rel=1e-6)


def test_step_counts_updates_and_micro_batches_with_accumulation():
    """50 samples in batches of 8 is 7 batches; accumulation 4 gives 2 updates per epoch (the last group short)."""
    _, _, final = _run_both(CONFIGS["accumulation_4"], epochs=3)

    assert (final.epoch, final.step, final.micro_step, final.batch_in_epoch) == (3, 6, 21, 0)


def test_scheduler_is_stepped_as_accelerate_does():
    """The prepared torch scheduler ends where the canonical loop's does."""
    cfg = dict(scheduler=True, gradient_accumulation_steps=4)
    model, opt, sched, dl = build(0, scheduler=True)
    canonical_loop(_accelerator(cfg), model, opt, sched, dl, ce_loss, epochs=2)
    expected_lr = opt.param_groups[0]["lr"]

    testing.reset_accelerate_state()
    model, opt, sched, dl = build(0, scheduler=True)
    ctx = Context(accelerator=_accelerator(cfg))
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(dl)
    loop(run_epoch(ctx, make_step(ctx, ce_loss), dl), max_epochs=2)(state)

    assert expected_lr == opt.param_groups[0]["lr"]
    assert expected_lr == 0.1 * 0.5**2  # 4 updates, halved every 2
