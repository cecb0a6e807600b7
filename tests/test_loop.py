"""Loop combinators: when they stop, what they check, and composition in pipes."""

import attrs
import pytest
from hypothesis import given, settings, strategies as st
from toolz import compose, pipe

from trainfold import TrainState, every_epochs, loop, make_step, repeat, run_epoch, testing, until


def _fake_state(**kw):
    return TrainState(model=None, optimizer=None, scheduler=None, accelerator=None, **kw)


def _fake_epoch(state):
    return attrs.evolve(state, epoch=state.epoch + 1)


def test_loop_runs_to_max_epochs():
    assert 5 == loop(_fake_epoch, max_epochs=5)(_fake_state()).epoch


def test_loop_counts_epochs_of_the_whole_run():
    """A state resumed at epoch 3 runs epochs 4 and 5 only."""
    calls = []

    def epoch(state):
        calls.append(state.epoch)
        return _fake_epoch(state)

    loop(epoch, max_epochs=5)(_fake_state(epoch=3))

    assert [3, 4] == calls


def test_loop_stops_when_the_state_says_so():
    def epoch(state):
        new = _fake_epoch(state)
        return new.with_stop("two epochs") if new.epoch == 2 else new

    assert 2 == loop(epoch, max_epochs=10)(_fake_state()).epoch


def test_loop_refuses_an_epoch_function_that_does_not_advance():
    with pytest.raises(RuntimeError, match="did not advance state.epoch"):
        loop(lambda s: s, max_epochs=3)(_fake_state())


def test_loop_catches_a_curried_primitive_missing_its_loader():
    """run_epoch(ctx, step) without the loader is a curry that still needs the loader: loop says so when it is built,
    naming what is missing and where the state would have gone."""
    ctx, state, loader, loss_fn = testing.tiny_setup()
    epoch = run_epoch(ctx, make_step(ctx, loss_fn))

    with pytest.raises(
        TypeError,
        match=r"loop calls epoch_fn\(state\), with the state alone, and run_epoch still needs "
        r"loader, state \(the state would be taken as 'loader'\)",
    ):
        loop(epoch, max_epochs=2)


def test_repeat_until_every():
    state = _fake_state()
    assert 3 == repeat(3, _fake_epoch)(state).epoch
    assert 4 == until(lambda s: s.epoch >= 4, _fake_epoch)(state).epoch
    marks = []

    def mark(s):
        marks.append(s.epoch)
        return s

    loop(compose(every_epochs(2, mark), _fake_epoch), max_epochs=7)(state)
    assert [2, 4, 6] == marks


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), epochs=st.integers(1, 25))
def test_every_fires_floor_epochs_over_n_times(n, epochs):
    """every_epochs(n, f) inside a loop of E epochs fires floor(E / n) times."""
    fired = []

    def f(s):
        fired.append(s.epoch)
        return s

    loop(compose(every_epochs(n, f), _fake_epoch), max_epochs=epochs)(_fake_state())

    assert epochs // n == len(fired)


def test_compose_order_is_right_to_left():
    """In compose(a, b), b runs first (toolz convention): the outermost is the leftmost."""
    order = []

    def a(s):
        order.append("a")
        return s

    def b(s):
        order.append("b")
        return s

    compose(a, b)(_fake_state())
    assert ["b", "a"] == order


def test_combinators_have_readable_names():
    assert "loop(_fake_epoch, max_epochs=3)" == loop(_fake_epoch, max_epochs=3).__qualname__
    assert "every_epochs(2, _fake_epoch)" == every_epochs(2, _fake_epoch).__name__


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_combinators_refuse_non_positive_counts(bad):
    with pytest.raises(ValueError, match="positive int"):
        repeat(bad, _fake_epoch)


def test_pipe_of_primitives_catches_missing_state_argument():
    """In a pipe, a primitive missing an argument is caught by the next one, which names it."""
    from trainfold import evaluate

    ctx, state, loader, loss_fn = testing.tiny_setup()
    with pytest.raises(TypeError, match=r"evaluate received a curried 'run_epoch'"):
        pipe(state, run_epoch(ctx, make_step(ctx, loss_fn)), evaluate(ctx, loss_fn, loader))


def test_the_unreleased_alias_every_is_gone():
    """One name per thing: every_epochs (and every_steps) count what their names say."""
    import trainfold

    assert not hasattr(trainfold, "every") and "every" not in trainfold.__all__


def test_loop_takes_its_limit_by_keyword():
    """One order for the combinators: the schedule first, the epoch function last; loop's limit is a keyword."""
    with pytest.raises(TypeError):
        loop(_fake_epoch, 3)


def test_every_epochs_runs_at_a_final_stop():
    """A budget ending mid-epoch after 1 epoch (not a multiple of 2): the final model still gets what the epochs get."""
    from trainfold import evaluate, max_steps

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)  # 4 batches an epoch: update 6 is in epoch 2
    epoch = compose(
        every_epochs(2, evaluate(ctx, loss_fn, loader)), run_epoch(ctx, max_steps(6)(make_step(ctx, loss_fn)), loader)
    )
    final = loop(epoch, max_epochs=5)(state)
    ctx.close()
    assert (6, True) == (final.step, final.ended_mid_epoch)
    assert [(1, 6)] == [(r.epoch, r.step) for r in final.history if r.name == "eval_loss"]


def test_loop_refuses_what_it_cannot_call():
    """`loop` refuses at the call what it could not call with the state naming the fix."""
    from trainfold import evaluate

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    epoch = run_epoch(ctx, make_step(ctx, loss_fn), loader)
    with pytest.raises(TypeError, match=r"loop\(epoch_fn, max_epochs=20\): max_epochs is a keyword argument"):
        loop(epoch, 20)
    with pytest.raises(
        TypeError, match=r"loop takes an epoch function .* and was given a TrainState: a primitive given its state"
    ):
        loop(run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
    with pytest.raises(TypeError, match=r"loop takes an epoch function \(state -> state\); got 3, a int"):
        loop(3, max_epochs=2)
    with pytest.raises(
        TypeError,
        match=r"loop calls epoch_fn\(state\), with the state alone, and evaluate still needs loss_fn, loader, state ",
    ):
        loop(evaluate(ctx), max_epochs=2)  # evaluate given the Context alone: still needs loss_fn and loader
    with pytest.raises(
        TypeError,
        match=r"repeat calls epoch_fn\(state\), with the state alone, and <lambda> still needs state, loader \(the state would be taken as 'state'\)",
    ):
        repeat(2, lambda state, loader: state)
    with pytest.raises(TypeError, match=r"every_epochs takes an epoch function"):
        every_epochs(2, state)
    with pytest.raises(TypeError, match=r"until takes an epoch function"):
        until(lambda s: True, None)
    ctx.close()


def test_evaluation_before_training_warns():
    """compose(run_epoch, evaluate) read left to right evaluates before each epoch's training: said once, naming the fix;
    the right order and evaluations every few updates say nothing."""
    import warnings

    from trainfold import evaluate

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)  # 4 updates an epoch
    with pytest.warns(
        UserWarning,
        match=r"recorded 'eval_loss' at update 0, before the epoch's training \(which ended at update 4\)"
        r": compose applies right to left",
    ) as caught:
        wrong = loop(
            compose(run_epoch(ctx, make_step(ctx, loss_fn), loader), evaluate(ctx, loss_fn, loader)), max_epochs=3
        )(state)
    assert 1 == len(caught)
    assert [0, 4, 8] == [r.step for r in wrong.history if r.name == "eval_loss"]  # the final model (update 12) never
    ctx.close()

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right order says nothing
        right = loop(
            compose(evaluate(ctx, loss_fn, loader), run_epoch(ctx, make_step(ctx, loss_fn), loader)), max_epochs=3
        )(state)
    assert [4, 8, 12] == [r.step for r in right.history if r.name == "eval_loss"]
    ctx.close()

    from trainfold import every_steps

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # evaluations inside the epoch, after updates, are not the wrong order either
        inside = loop(
            run_epoch(ctx, every_steps(2, evaluate(ctx, loss_fn, loader))(make_step(ctx, loss_fn)), loader),
            max_epochs=2,
        )(state)
    assert [2, 4, 6, 8] == [r.step for r in inside.history if r.name == "eval_loss"]
    ctx.close()


def test_an_epoch_cut_short_by_max_batches_unregisters_its_loader():
    """Accelerate's GradientState tracks the loader being iterated; an epoch left early must not stay registered."""
    ctx, state, loader, loss_fn = testing.tiny_setup()

    run_epoch(ctx, make_step(ctx, loss_fn), loader, state, max_batches=2)

    assert not ctx.accelerator.gradient_state.in_dataloader


def test_repeat_does_not_start_an_epoch_once_the_state_is_stopped():
    ctx, state, *_ = testing.tiny_setup()
    calls = []

    def epoch(s):
        calls.append(s.epoch)
        return attrs.evolve(s, epoch=s.epoch + 1)

    repeat(3, epoch)(state.with_stop("max_steps"))

    assert [] == calls
