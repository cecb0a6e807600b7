"""Documented behaviours that a mutation of the library once broke without any test failing (issue 23, item 13).

Each test names the promise it keeps; each fails when the behaviour it describes is removed.
"""

import math

import attrs
import pytest
import torch
from accelerate import Accelerator

from trainfold import (
    CheckpointError, Context, TrainState, constant, early_stop, evaluate, every_steps, load_checkpoint, lr_schedule, make_step,
    nan_guard, reduce_lr_on_plateau, repeat, run_epoch, save_best, save_checkpoint, testing,
)

import helpers


def _with_metric(state, value, name="eval_loss"):
    return attrs.evolve(state, history=state.history.add(epoch=state.epoch, step=state.step, values={name: value}))


def test_tokens_mode_logs_the_loss_per_token():
    """normalize="tokens": loss_fn returns a summed loss and its token count; the logged loss is the per-token mean."""
    ctx, state, loader, _ = testing.tiny_setup()

    def summed(model, batch):
        x, _ = batch
        tokens = torch.tensor(float(len(x) * 3))
        return model(x).sum() * 0 + 2.5 * tokens, {"tokens": tokens}  # 2.5 per token, whatever the batch

    state = run_epoch(ctx, make_step(ctx, summed, normalize="tokens"), loader, state)

    assert 2.5 == pytest.approx(state.history.latest("train_loss"))


def test_an_epoch_cut_short_by_max_batches_unregisters_its_loader():
    """Accelerate's GradientState tracks the loader being iterated; an epoch left early must not stay registered."""
    ctx, state, loader, loss_fn = testing.tiny_setup()

    run_epoch(ctx, make_step(ctx, loss_fn), loader, state, max_batches=2)

    assert not ctx.accelerator.gradient_state.in_dataloader


@pytest.mark.parametrize("saved_with,loaded_with,match", [
    (True, False, r"has a scheduler but the state has none"),
    (False, True, r"has no scheduler but the state has one"),
])
@pytest.mark.parametrize("built_on_both", [True, False])
def test_a_checkpoint_and_a_state_must_agree_on_having_a_scheduler(saved_with, loaded_with, match, built_on_both, tmp_path):
    """A scheduler adds initial_lr to the optimizer's parameter groups: built on one side only (a scheduler added between
    runs), the groups differ too, and the scheduler, the cause, is what the error names."""

    def build(with_scheduler):
        testing.reset_accelerate_state()
        ctx = Context(accelerator=Accelerator(cpu=True))
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1) if built_on_both or with_scheduler else None
        return ctx, TrainState.create(ctx, model=model, optimizer=opt, scheduler=scheduler if with_scheduler else None)

    ctx, saved = build(saved_with)
    save_checkpoint(ctx, tmp_path, saved)
    ctx, state = build(loaded_with)

    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ctx, tmp_path, state)


def test_lr_schedule_multiplies_by_the_factor_reduce_lr_on_plateau_records():
    """lr_schedule composes with reduce_lr_on_plateau: extras["lr_scale"] scales the scheduled rate."""
    ctx, state, loader, loss_fn = testing.tiny_setup(lr=0.1)
    for flat in (1.0, 1.0):  # the best, then a flat epoch: patience 1 is spent
        state = reduce_lr_on_plateau("eval_loss", _with_metric(state, flat), factor=0.5, patience=1)
    assert 0.5 == state.extras["lr_scale"]

    state = testing.run_steps(lr_schedule(constant(0.2))(make_step(ctx, loss_fn)), state, loader, n=1)

    assert 0.1 == state.optimizer.param_groups[0]["lr"]  # 0.2 scheduled x 0.5 recorded


def test_every_steps_fires_on_updates_not_on_micro_batches():
    """With 2 accumulation steps, 8 batches are 4 updates: every_steps(1, fn) runs fn 4 times, after each update."""
    ctx, state, loader, loss_fn = testing.tiny_setup(n=32, accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    seen = []

    def record(s):
        seen.append(s.step)
        return s

    run_epoch(ctx, every_steps(1, record)(make_step(ctx, loss_fn)), loader, state)

    assert [1, 2, 3, 4] == seen


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nan_guard_keeps_an_infinite_loss_out_of_the_epoch_mean(bad):
    """Under nan_guard a non-finite batch loss (NaN, +inf or -inf) is left out of train_loss, which stays the finite batches' mean."""
    ctx, state, loader, loss_fn = testing.tiny_setup(lr=0.0)  # lr 0: every batch sees the same model
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss = loss_fn(model, batch)
        return loss * 0 + bad if calls["n"] == 2 else loss

    clean = run_epoch(ctx, make_step(ctx, loss_fn), loader, state).history.latest("train_loss")
    finite = [loss_fn(state.model, b).item() for i, b in enumerate(loader) if i != 1]
    guarded = run_epoch(ctx, make_step(ctx, poisoned, stages=[nan_guard(3)]), loader, state).history.latest("train_loss")

    assert math.isfinite(clean)
    assert guarded == pytest.approx(sum(finite) / len(finite), rel=1e-6)


def _mismatched_aux_on_this_rank():
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(8, 3)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(16), batch_size=4))
    name = f"metric_of_rank_{ctx.accelerator.process_index}"

    def loss_fn(model, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss, {name: loss.detach()}

    try:
        evaluate(ctx, loss_fn, dl, state)
    except RuntimeError as exc:
        return str(exc)
    finally:
        ctx.close()
    return None


@pytest.mark.multiprocess
def test_different_metric_names_fail():
    """Processes that report different metric names fail instead of mixing them."""
    for message in testing.run_distributed(_mismatched_aux_on_this_rank, nprocs=2, timeout=60):
        assert message and "not every process has the same names" in message


def test_repeat_does_not_start_an_epoch_once_the_state_is_stopped():
    ctx, state, *_ = testing.tiny_setup()
    calls = []

    def epoch(s):
        calls.append(s.epoch)
        return attrs.evolve(s, epoch=s.epoch + 1)

    repeat(3, epoch)(state.with_stop("max_steps"))

    assert [] == calls


def test_early_stop_keeps_a_stop_set_before_it():
    """An improving metric does not clear a stop another function set (a budget, a signal)."""
    ctx, state, *_ = testing.tiny_setup()
    state = _with_metric(state, 1.0).with_stop("max_steps")

    after = early_stop("eval_loss", state, patience=2)

    assert after.should_stop and "max_steps" == after.stop.reason


def test_reduce_lr_on_plateau_never_goes_below_min_lr():
    ctx, state, *_ = testing.tiny_setup(lr=0.1)
    for flat in (1.0, 1.0):  # the best, then a flat epoch: 0.1 x 0.1 would be 0.01
        state = reduce_lr_on_plateau("eval_loss", _with_metric(state, flat), factor=0.1, patience=1, min_lr=0.05)

    assert 0.05 == state.optimizer.param_groups[0]["lr"]


def test_save_best_in_max_mode_keeps_the_highest_value(tmp_path):
    ctx, state, *_ = testing.tiny_setup()
    path = tmp_path / "best.safetensors"
    for accuracy in (0.5, 0.7, 0.6):
        state = save_best(ctx, path, "accuracy", _with_metric(state, accuracy, "accuracy"), mode="max")

    assert 0.7 == state.extras["save_best:accuracy"].value
