"""local_sgd: no gradient sync for n updates, then parameter averaging; equal to Accelerate's LocalSGD on 2 processes."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from toolz import compose

from trainfold import (
    Context,
    TrainState,
    average_parameters,
    latest_checkpoint,
    load_checkpoint,
    local_sgd,
    loop,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
)

import helpers

EVERY, EPOCHS = 3, 2


def _accelerate_way():
    """examples/by_feature/local_sgd.py: a `with LocalSGD(...)` block per epoch, local_sgd.step() after each update."""
    accelerator = Accelerator(cpu=True)
    model, opt, _, dl = helpers.build(0, shuffle=True)
    torch.manual_seed(7)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    for _ in range(EPOCHS):
        model.train()
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=EVERY, enabled=True) as local:
            for batch in dl:
                with accelerator.accumulate(model):
                    accelerator.backward(helpers.ce_loss(model, batch))
                    opt.step()
                    opt.zero_grad()
                    local.step()
    return testing.parameters(model)


def _trainfold_way(root=None, epochs=EPOCHS, resume=False, stateless=False):
    ctx = Context(accelerator=Accelerator(cpu=True))
    model, opt, _, dl = helpers.build(0, shuffle=True)
    if (
        stateless
    ):  # each process's momentum differs under local SGD, and a checkpoint holds one process's: see docs/guides/loop.md
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(7)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    if resume:
        state = load_checkpoint(ctx, latest_checkpoint(root), state)
    after_first = []

    def first(step):  # the replicas after the first update: not synchronised
        def watched(state, batch):
            new = step(state, batch)
            if new.step == 1 and not after_first:
                after_first.append(testing.parameters(new))
            return new

        return watched

    epoch = compose(
        average_parameters(ctx), run_epoch(ctx, first(local_sgd(ctx, EVERY)(make_step(ctx, helpers.ce_loss))), dl)
    )
    if root is not None:
        epoch = compose(save_checkpoint(ctx, root), epoch)
    state = loop(epoch, max_epochs=epochs)(state)
    ctx.close()
    return testing.parameters(state), after_first, state.extras["local_sgd"], state.step


def _both_ways():
    return helpers.each_fresh(_accelerate_way, _trainfold_way)


@pytest.mark.multiprocess
def test_local_sgd_equals_accelerates_local_sgd_on_two_processes():
    (expected0, (got0, [first0], record0, _)), (expected1, (got1, [first1], record1, _)) = testing.run_distributed(
        _both_ways, nprocs=2
    )

    testing.assert_params_equal(expected0, got0)
    testing.assert_params_equal(expected1, got1)
    testing.assert_params_equal(got0, got1)  # averaged at the end of each epoch
    assert any(not torch.equal(first0[k], first1[k]) for k in first0)  # but each trained alone in between
    assert (
        record0 == record1 and record0.since == 0 and record0.averages == 4
    )  # per epoch of 4 updates: at the 3rd, and at its end


@pytest.mark.multiprocess
def test_a_local_sgd_run_resumes_exactly_from_an_epochs_end(tmp_path):
    """With an optimizer without state (plain SGD): the parameters are all a process holds of its own, and they were
    just averaged."""
    (expected, *_), _ = testing.run_distributed(_trainfold_way, None, EPOCHS, False, True, nprocs=2)
    first_epoch = testing.run_distributed(_trainfold_way, str(tmp_path), 1, False, True, nprocs=2)
    assert [r[2].averages for r in first_epoch] == [2, 2]
    resumed = testing.run_distributed(_trainfold_way, str(tmp_path), EPOCHS, True, True, nprocs=2)

    for params, _, record, _ in resumed:
        testing.assert_params_equal(expected, params)
        assert record.averages == 4  # counted on from the checkpoint's record


def test_a_checkpoint_between_two_averages_is_refused_with_the_way_out(tmp_path):
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    state = testing.run_steps(local_sgd(ctx, 3)(make_step(ctx, loss_fn)), state, loader, n=2)

    assert state.extras["local_sgd"].replicas_differ
    with pytest.raises(ValueError, match="parameters differ .* after average_parameters"):
        save_checkpoint(ctx, tmp_path, state)
    save_checkpoint(ctx, tmp_path, average_parameters(ctx, state))  # after an average: saved


def test_one_process_counts_and_trains_as_without_it():
    def run(wrap):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, shuffle=True)
        return loop(run_epoch(ctx, wrap(ctx)(make_step(ctx, loss_fn)), loader), max_epochs=2)(state)

    plain, local = run(lambda ctx: lambda step: step), run(lambda ctx: local_sgd(ctx, 3))

    testing.assert_params_equal(plain, local)
    assert local.extras["local_sgd"].averages == 2  # updates 3 and 6 of 8; since=2 left for average_parameters


def test_bad_interval_is_refused():
    ctx, *_ = testing.tiny_setup(seed=0)
    with pytest.raises(ValueError, match="local_sgd must be a positive int"):
        local_sgd(ctx, 0)
