"""Context.release: a finished state's model, optimizer and loaders are freed, as a cross-validation needs."""

import gc
import weakref

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, make_step, run_epoch, testing

import helpers


def _folds(release, folds=3):
    """Train ``folds`` states on one Context; weak references to each fold's model, optimizer and loader."""
    ctx = Context(accelerator=Accelerator(cpu=True))
    refs = []
    for k in range(folds):
        model, opt, sched, dl = helpers.build(k, scheduler=True)
        state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
        (dl,) = ctx.prepare_loaders(dl)
        state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
        refs.append([weakref.ref(o) for o in (model, state.model, opt, dl)])
        if release:
            ctx.release(state, dl)
        del model, opt, sched, dl, state
    gc.collect()
    alive = [[r() is not None for r in fold] for fold in refs]
    ctx.close()
    return alive


def test_without_release_the_accelerator_keeps_every_fold_alive():
    """The problem: accelerator.prepare keeps what it prepared."""
    assert _folds(release=False) == [[True] * 4] * 3


def test_released_folds_are_collected():
    assert _folds(release=True) == [[False] * 4] * 3


@pytest.mark.multiprocess
def test_released_folds_are_collected_on_two_processes():
    """Under DDP too (the wrapper, its reducer, the module)."""
    for alive in testing.run_distributed(_folds, True, nprocs=2):
        assert alive == [[False] * 4] * 3


def test_release_leaves_another_live_state_training():
    ctx = Context(accelerator=Accelerator(cpu=True))
    done_model, done_opt, _, done_dl = helpers.build(0)
    done = TrainState.create(ctx, model=done_model, optimizer=done_opt)
    model, opt, _, dl = helpers.build(1)
    live = TrainState.create(ctx, model=model, optimizer=opt)
    done_dl, dl = ctx.prepare_loaders(done_dl, dl)

    ctx.release(done, done_dl)

    acc = ctx.accelerator
    assert acc._models == [live.model] and acc._optimizers == [live.optimizer] and acc._dataloaders == [dl]
    before = testing.parameters(live)
    live = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, live)
    assert live.step == 7 and any(not torch.equal(before[k], v) for k, v in testing.parameters(live).items())


def test_release_takes_the_last_loader():
    """`release` takes the loader of the state's last epoch without being told."""
    ctx = Context(accelerator=Accelerator(cpu=True))
    model, opt, _, dl = helpers.build(0)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)

    ctx.release(state)

    assert ctx.accelerator._dataloaders == [] and ctx.accelerator._models == []
