"""A test file to copy: unit tests of a training step with trainfold (run: pytest examples/test_my_training.py)."""

import attrs
import pytest
import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, make_step, max_steps, run_epoch, snapshot, testing


@pytest.fixture(autouse=True)
def isolated():
    with testing.isolated_accelerate():  # Accelerate's state is process-wide
        yield


def my_loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def test_one_step_exactly():
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.25))

    new = make_step(ctx, my_loss)(state, (torch.tensor([[1.0]]), torch.tensor([[1.0]])))

    assert (0, 1) == (state.step, new.step)
    assert 0.5 == new.model.weight.item()


def test_an_epoch_learns_and_never_waits_for_the_device():
    ctx, state, loader, _ = testing.tiny_setup(seed=0)
    before = testing.parameters(state)
    step = make_step(ctx, my_loss, clip_grad_norm=1.0)

    batches = list(loader)  # the loader's own iteration draws a seed with .item(): keep it outside

    with testing.count_host_syncs() as syncs:
        new = testing.run_steps(step, state, batches)

    testing.assert_params_changed(before, new)
    assert 0 == syncs.total


def test_a_transformer_against_a_fake_step():
    step = max_steps(2)(lambda s, b: attrs.evolve(s, step=s.step + 1))
    s = TrainState(model=None, optimizer=None, scheduler=None, accelerator=None)

    assert step(step(s, 0), 0).should_stop


def test_the_same_epoch_twice_from_a_snapshot():
    ctx, state, loader, _ = testing.tiny_setup(seed=0)
    snap = snapshot(state)
    step = make_step(ctx, my_loss)

    first = run_epoch(ctx, step, loader, state)
    params = testing.parameters(first)
    from trainfold import restore

    second = run_epoch(ctx, step, loader, restore(ctx, snap, first))

    testing.assert_params_equal(params, second)
