"""find_batch_size: the largest per-process batch that fits, the accumulation that keeps the global batch, the failed
attempts freed. Out-of-memory is simulated as Accelerate's own tests do: a RuntimeError with the allocator's message."""

import gc
import weakref

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from trainfold import Context, TrainState, find_batch_size, loop, make_step, run_epoch, testing
from trainfold._src.compose.batch_size import batch_sizes

import helpers

N, GLOBAL, FITS, EPOCHS = 48, 16, 5, 2


def _oom_above(limit):
    def loss_fn(model, batch):
        if len(batch[0]) > limit:
            raise RuntimeError(
                f"CUDA out of memory. Tried to allocate {len(batch[0])} GiB"
            )  # what torch raises on a GPU
        return helpers.ce_loss(model, batch)

    return loss_fn


def _train(attempts):
    def train(ctx, batch_size):
        model, opt, _, dl = helpers.build(0, shuffle=True, n=N, batch_size=batch_size)
        attempts.append((batch_size, ctx.gradient_accumulation_steps, weakref.ref(model), weakref.ref(opt)))
        torch.manual_seed(7)
        state = TrainState.create(ctx, model=model, optimizer=opt)
        (dl,) = ctx.prepare_loaders(dl)
        state = loop(run_epoch(ctx, make_step(ctx, _oom_above(FITS)), dl), max_epochs=EPOCHS)(state)
        return testing.parameters(state), state.history["train_loss"]

    return train


def _found_and_canonical():
    ctx = Context(accelerator=Accelerator(cpu=True))
    attempts = []
    found = find_batch_size(ctx, _train(attempts), global_batch=GLOBAL)
    params, losses = found.result
    found.ctx.check()  # the Context it trained with is live, and handed back
    gc.collect()
    freed = [model() is None and opt() is None for _, _, model, opt in attempts[:-1]]
    prepared = len(ctx.accelerator._models), len(ctx.accelerator._optimizers), len(ctx.accelerator._dataloaders)
    try:
        ctx.check()  # the Context given was retired by the first attempt
        retired = ""
    except RuntimeError as exc:
        retired = str(exc)
    batch_size, steps = attempts[-1][:2]
    AcceleratorState._reset_state()
    GradientState._reset_state()
    model, opt, _, dl = helpers.build(0, shuffle=True, n=N, batch_size=batch_size)
    torch.manual_seed(7)
    expected, _ = helpers.canonical_loop(
        Accelerator(cpu=True, gradient_accumulation_steps=steps), model, opt, None, dl, helpers.ce_loss, epochs=EPOCHS
    )
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return [a[:2] for a in attempts], freed, prepared, expected, params, retired


def test_the_largest_fitting_batch_keeps_the_global():
    """The largest batch that fits is used with the accumulation that keeps the global batch."""
    attempts, freed, prepared, expected, params, retired = _found_and_canonical()

    assert attempts == [(16, 1), (8, 2), (4, 4)]  # 16 and 8 ran out of memory; 4 x 4 = 16 samples per update
    testing.assert_params_equal(expected, params)  # the hand-written loop with that batch and accumulation
    assert freed == [True, True]  # the failed attempts' models and optimizers were collected
    assert prepared == (1, 1, 1)  # the Accelerator holds only the attempt that ran
    assert "use the Context it returned" in retired  # the Context given was retired by the first attempt


def _found_on_this_rank():
    attempts, freed, prepared, expected, params, _ = _found_and_canonical()
    return attempts, freed, expected, params


@pytest.mark.multiprocess
def test_on_two_processes_the_global_batch_is_over_both():
    for attempts, freed, expected, params in testing.run_distributed(_found_on_this_rank, nprocs=2):
        assert attempts == [(8, 1), (4, 2)]  # 8 per process failed; 4 per process x 2 processes x 2 steps = 16
        assert freed == [True]
        testing.assert_params_equal(expected, params)


def test_other_errors_are_raised_and_a_model_that_never_fits_says_so():
    ctx = Context(accelerator=Accelerator(cpu=True))
    calls = []

    def broken(ctx, batch_size):
        calls.append(batch_size)
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        find_batch_size(ctx, broken, global_batch=8)
    assert calls == [8]

    def never(ctx, batch_size):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")

    with pytest.raises(RuntimeError, match="even with 1 sample per process") as info:
        find_batch_size(ctx.with_accumulation(1), never, global_batch=8, start=2)
    assert "out of memory" in str(info.value.__cause__)


def test_batch_sizes_divide_the_per_process_batch():
    assert batch_sizes(12) == [12, 6, 4, 3, 2, 1]
    assert batch_sizes(12, start=5) == [4, 3, 2, 1]
    ctx = Context(accelerator=Accelerator(cpu=True))
    with pytest.raises(ValueError, match="global_batch must be a positive int"):
        find_batch_size(ctx, lambda c, b: None, global_batch=0)


def test_the_halve_policy_is_accelerates():
    """Accelerate's finder halves the batch and leaves the accumulation alone: the global batch shrinks."""
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    tried = []

    def train(ctx, batch_size):
        tried.append((batch_size, ctx.gradient_accumulation_steps))
        if batch_size > 5:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * ctx.gradient_accumulation_steps

    found = find_batch_size(ctx, train, global_batch=24, policy="halve")

    assert [(24, 2), (12, 2), (6, 2), (3, 2)] == tried
    assert (6, 3, 2) == (found.result, found.batch_size, found.gradient_accumulation_steps)
    found.ctx.check()
    assert found.ctx.accelerator is ctx.accelerator
    with pytest.raises(ValueError, match="policy must be one of"):
        find_batch_size(found.ctx, train, global_batch=24, policy="shrink")
