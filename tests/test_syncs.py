"""No host-device synchronisation inside a step: the count per epoch does not grow with its length."""

import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, evaluate, make_step, run_epoch, testing

from helpers import ce_loss_with_accuracy, classification_data, mlp


def _syncs_for_an_epoch(n_samples, **step_options):
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2))
    torch.manual_seed(0)
    model = mlp()
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(classification_data(n_samples), batch_size=4))
    step = make_step(ctx, ce_loss_with_accuracy, **step_options)
    with testing.count_host_syncs() as syncs:
        state = run_epoch(ctx, step, dl, state)
    return syncs.total


@pytest.mark.parametrize("options", [{}, {"clip_grad_norm": 1.0}, {"clip_grad_value": 0.1}])
def test_host_syncs_per_epoch_do_not_grow_with_batches(options):
    """4 batches and 40 batches cost the same number of syncs: the one reduction at epoch end."""
    short = _syncs_for_an_epoch(16, **options)
    long = _syncs_for_an_epoch(160, **options)

    assert short == long
    # One is trainfold's reduction at epoch end; the other is DataLoader.__iter__ drawing
    # its base seed with .item() on a CPU tensor (not a device sync).
    assert long <= 2


def test_a_step_alone_has_no_host_sync():
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    step = make_step(ctx, loss_fn, clip_grad_norm=1.0)
    batch = next(iter(loader))

    with testing.count_host_syncs() as syncs:
        step(state, batch)

    assert 0 == syncs.total


def test_evaluate_syncs_once_whatever_the_length():
    counts = []
    for n in (16, 160):
        testing.reset_accelerate_state()
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=n)
        with testing.count_host_syncs() as syncs:
            evaluate(ctx, loss_fn, loader, state)
        counts.append(syncs.total)

    assert counts[0] == counts[1] <= 2  # the reduction, and the DataLoader's CPU seed draw


def test_count_host_syncs_sees_each_kind():
    t = torch.ones(2)
    with testing.count_host_syncs() as syncs:
        t.sum().item()
        float(t.sum())
        bool(t.sum())
        t.tolist()

    assert {"item": 1, "__float__": 1, "__bool__": 1, "tolist": 1} == syncs.by_method
    assert 4 == syncs.total
