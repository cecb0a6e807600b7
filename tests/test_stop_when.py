"""stop_when: a stop decided from a batch's values on any process, equal to Accelerate's set_trigger / check_trigger.

Also ``state.last_loss`` / ``state.last_aux``: each batch's values, readable by a transformer at every step.
"""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    list_checkpoints,
    load_checkpoint,
    loop,
    make_step,
    run_epoch,
    stop_when,
    testing,
)
from trainfold._src.base.checks import named

import helpers

EPOCHS = 4


def _trigger(rank_only, threshold):
    """The decision both loops take on a batch's loss: below ``threshold``, on ``rank_only`` (or any rank)."""

    def holds(loss, rank):
        return (rank_only is None or rank == rank_only) and loss < threshold

    return holds


def _accelerate_way(trigger, end, epochs=EPOCHS, ga=1):
    """Accelerate's examples/by_feature/early_stopping.py: set_trigger on the batch's loss, check_trigger, break."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ga)
    model, opt, _, dl = helpers.build(0, shuffle=True)
    torch.manual_seed(7)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    updates, ends = 0, []
    for _ in range(epochs):
        model.train()
        triggered = False
        for batch in dl:
            with accelerator.accumulate(model):
                loss = helpers.ce_loss(model, batch)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            updates += accelerator.sync_gradients
            if trigger(loss.item(), accelerator.process_index):
                accelerator.set_trigger()
            if accelerator.check_trigger():
                ends.append(updates)
                triggered = True
                break
        if triggered and end == "run":
            break
    return testing.parameters(model), ends, updates


def _trainfold_way(trigger, end, epochs=EPOCHS, ga=1):
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    model, opt, _, dl = helpers.build(0, shuffle=True)
    torch.manual_seed(7)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    rank = ctx.accelerator.process_index
    ends = []

    def note_end(step):  # the updates at which an epoch (or the run) ended early, as the Accelerate loop lists them
        def noted(state, batch):
            new = step(state, batch)
            if new.end_of_epoch or (new.should_stop and not state.should_stop):
                ends.append(new.step)
            return new

        return named(noted, "noted")

    predicate = lambda s: torch.tensor(trigger(s.last_loss.item(), rank))  # noqa: E731  (as the example reads loss.item())
    step = note_end(stop_when(ctx, predicate, end=end, check_every=1)(make_step(ctx, helpers.ce_loss)))
    state = loop(run_epoch(ctx, step, dl), max_epochs=epochs)(state)
    return testing.parameters(state), ends, state


def _both_ways(trigger, end, ga=1):
    return helpers.each_fresh(lambda: _accelerate_way(trigger, end, ga=ga), lambda: _trainfold_way(trigger, end, ga=ga))


def _on_this_rank(end):
    (params, ends, updates), (got, got_ends, state) = _both_ways(_trigger(1, 0.9), end)
    return (
        params,
        ends,
        updates,
        got,
        got_ends,
        state.step,
        state.epoch,
        [r.epoch for r in state.history if r.name == "train_loss"],
    )


@pytest.mark.parametrize("end", ["run", "epoch"])
def test_one_process_stops_where_set_trigger_and_check_trigger_stop(end):
    (params, ends, updates), (got, got_ends, state) = _both_ways(_trigger(None, 0.9), end)

    assert ends and ends == got_ends  # it stopped, at the same updates
    assert state.step == updates
    testing.assert_params_equal(params, got)
    if end == "run":
        assert len(ends) == 1 and state.should_stop and state.stop.finished and state.stop.reason == "stop_when"
        assert updates < EPOCHS * 7  # in the middle of the run
    else:
        assert len(ends) > 1  # several epochs ended early, and the run went on
        assert state.epoch == EPOCHS and not state.should_stop and not state.end_of_epoch
        assert [r.epoch for r in state.history if r.name == "train_loss"] == list(range(1, EPOCHS + 1))


def test_a_stop_inside_a_group_waits_for_its_end():
    """Unlike a break in Accelerate's loop, which leaves half a group's gradients for the next epoch: the decision
    waits for the update, so a run stops (or an epoch ends) with no partial gradients held."""
    ctx, state, loader, loss_fn = testing.tiny_setup(
        seed=0, n=32, accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2)
    )
    step = stop_when(ctx, lambda s: s.micro_step == 3, check_every=1)(
        make_step(ctx, loss_fn)
    )  # the 1st micro-batch of group 2

    state = run_epoch(ctx, step, loader, state)

    assert (state.step, state.micro_step, state.should_stop) == (2, 4, True)
    assert all(p.grad is None or not p.grad.any() for p in state.model.parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize("end", ["run", "epoch"])
def test_a_decision_on_rank_one_stops_both(end):
    """On two processes, a decision on rank one stops both at the same update."""
    ranks = testing.run_distributed(_on_this_rank, end, nprocs=2)

    (p0, ends0, u0, got0, gends0, step0, epoch0, recorded0), (p1, ends1, u1, got1, gends1, step1, epoch1, recorded1) = (
        ranks
    )
    assert ends0 == ends1 == gends0 == gends1 and ends0  # rank 1 decided; both stopped there
    assert step0 == step1 == u0 == u1
    testing.assert_params_equal(p0, got0)
    testing.assert_params_equal(p1, got1)
    if end == "epoch":
        assert epoch0 == epoch1 == EPOCHS and recorded0 == recorded1 == list(range(1, EPOCHS + 1))


def _tiny(check_every, end, predicate):
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)  # 4 updates per epoch
    step = stop_when(ctx, predicate, end=end, check_every=check_every)(make_step(ctx, loss_fn))
    return ctx, loop(run_epoch(ctx, step, loader), max_epochs=3)(state)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_value_held_between_checks_stops(as_tensor):
    """A value that held once between checks stops the run at the next check."""
    predicate = (lambda s: torch.tensor(s.step == 5)) if as_tensor else (lambda s: s.step == 5)

    _, state = _tiny(3, "run", predicate)

    assert state.step == 6 and state.should_stop and state.stop.reason == "stop_when"


def test_a_late_epoch_end_is_dropped():
    """Raised at update 4 (the last of epoch 1, checks at 3, 6, 9): the run-scoped flag stops at 6, the
    epoch-scoped one belonged to an epoch that ended anyway, so epoch 2 runs whole."""
    _, run = _tiny(3, "run", lambda s: s.step == 4)
    _, epoch = _tiny(3, "epoch", lambda s: s.step == 4)

    assert run.step == 6 and run.should_stop
    assert epoch.step == 12 and not epoch.should_stop and epoch.epoch == 3


def test_a_stop_that_is_not_finished_leaves_a_resumable_run():
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    step = stop_when(ctx, lambda s: s.step >= 2, finished=False, check_every=1)(make_step(ctx, loss_fn))

    state = loop(run_epoch(ctx, step, loader), max_epochs=2)(state)

    assert state.should_stop and not state.stop.finished and state.step == 2


def test_a_device_predicate_is_read_once_per_check_only():
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, n=32)  # 8 updates
    step = stop_when(ctx, lambda s: s.last_loss < -1.0, check_every=4)(make_step(ctx, loss_fn))
    plain = make_step(ctx, loss_fn)
    batches = list(loader)

    with testing.count_host_syncs() as baseline:
        testing.run_steps(plain, state, batches)
    with testing.count_host_syncs() as syncs:
        out = testing.run_steps(step, state, batches)

    assert syncs.total - baseline.total == 2  # updates 4 and 8
    assert not out.should_stop


def test_an_epoch_ended_by_a_step_resumes_from_any_checkpoint_as_it_ran(tmp_path):
    """Checkpoints after every update, one of them after the step that ended the epoch (before run_epoch closed it):
    resumed from each, the run ends with the same parameters and history as the uninterrupted one."""

    def run(root, resume_from=None):
        ctx, state, loader, loss_fn = testing.tiny_setup(seed=0, shuffle=True)
        if resume_from is not None:
            state = load_checkpoint(ctx, resume_from, state)
        saving = checkpoint_every(ctx, 1, root)
        step = saving(stop_when(ctx, lambda s: s.last_loss < 2.0, end="epoch", check_every=1)(make_step(ctx, loss_fn)))
        return saving.at_end(loop(run_epoch(ctx, step, loader), max_epochs=3)(state))

    uninterrupted = run(tmp_path / "uninterrupted")
    assert [r.step for r in uninterrupted.history if r.name == "train_loss"] != [4, 8, 12]  # some epoch ended early
    checkpoints = list_checkpoints(tmp_path / "uninterrupted")
    assert any(_saved_end_of_epoch(c) for c in checkpoints)  # the case under test was written
    for i, ckpt in enumerate(checkpoints):
        resumed = run(tmp_path / f"resumed{i}", ckpt)
        testing.assert_params_equal(uninterrupted, resumed)
        assert resumed.history == uninterrupted.history, ckpt.name


def _saved_end_of_epoch(folder):
    ctx, state, _, _ = testing.tiny_setup(seed=0, shuffle=True)
    return load_checkpoint(ctx, folder, state).end_of_epoch


@pytest.mark.parametrize(
    "value, message",
    [(lambda s: torch.ones(2).bool(), "tensor of shape \\(2,\\)"), (lambda s: "yes", "returned a str")],
)
def test_a_predicate_that_returns_something_else_is_named(value, message):
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    step = stop_when(ctx, value)(make_step(ctx, loss_fn))
    with pytest.raises(TypeError, match=message):
        step(state, next(iter(loader)))


def test_bad_options_are_refused_when_built():
    ctx, *_ = testing.tiny_setup(seed=0)
    with pytest.raises(ValueError, match="end must be 'run' or 'epoch'"):
        stop_when(ctx, lambda s: False, end="batch")
    with pytest.raises(ValueError, match="check_every must be a positive int"):
        stop_when(ctx, lambda s: False, check_every=0)
    with pytest.raises(TypeError, match="predicate must be a function"):
        stop_when(ctx, 0.5)


def test_a_transformer_reads_every_batch_loss_past_the_running_sums_fold():
    """state.last_loss is the batch's loss at every step, also after the running sums fold their pending batches
    (every 64): 100 batches' losses equal the hand-written loop's."""
    model, opt, _, dl = helpers.build(0, n=400, batch_size=4)
    _, expected = helpers.canonical_loop(Accelerator(cpu=True), model, opt, None, dl, helpers.ce_loss, epochs=1)
    AcceleratorState._reset_state()
    GradientState._reset_state()

    ctx = Context(accelerator=Accelerator(cpu=True))
    model, opt, _, dl = helpers.build(0, n=400, batch_size=4)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    seen, aux_names = [], set()

    def reading(step):
        def read(state, batch):
            new = step(state, batch)
            seen.append(new.last_loss)
            aux_names.update(new.last_aux)
            return new

        return read

    run_epoch(ctx, reading(make_step(ctx, helpers.ce_loss_with_accuracy)), dl, state)

    assert len(seen) == 100 and all(not t.requires_grad for t in seen)
    assert torch.equal(torch.stack(seen), torch.stack(expected))
    assert aux_names == {"accuracy"}


def test_a_run_stop_mid_epoch_is_the_end(tmp_path):
    """stop_when's stop is final, not a preemption: the epoch functions run on the final state (its model evaluated,
    logged, saved as best), as they do at a budget's end (TrainState.ended_mid_epoch)."""
    from toolz import compose

    from trainfold import evaluate, save_best

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)  # 4 batches an epoch
    step = stop_when(ctx, lambda s: s.step >= 6, check_every=1)(make_step(ctx, loss_fn))
    epoch = compose(
        save_best(ctx, tmp_path / "best", "eval_loss"), evaluate(ctx, loss_fn, loader), run_epoch(ctx, step, loader)
    )
    final = loop(epoch, max_epochs=5)(state)
    ctx.close()

    assert (6, 2, True) == (final.step, final.batch_in_epoch, final.ended_mid_epoch)
    assert [(1, 4), (1, 6)] == [
        (r.epoch, r.step) for r in final.history if r.name == "eval_loss"
    ]  # the final model too
    losses = final.history["eval_loss"]
    assert losses[1] < losses[0]  # so the final model is the best one, and save_best wrote it
    assert 6 == final.extras["save_best:eval_loss"].step and (tmp_path / "best").exists()
