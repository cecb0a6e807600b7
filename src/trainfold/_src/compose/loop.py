"""Loop combinators: they decide when to stop, and check what each epoch function returns.

One argument order for all of them: what decides *when* comes first, the epoch
function last (``repeat(n, fn)``, ``until(predicate, fn)``, ``every_epochs(n, fn)``,
like ``every_steps(n, fn)``); ``loop(fn, max_epochs=...)`` takes its limit by keyword.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import attrs
from toolz.functoolz import no_default

from trainfold._src.base.checks import name_of, named, positive_int, user_stacklevel
from trainfold._src.core.checks import expect_state, returned_state
from trainfold._src.core.context import Context, context_of
from trainfold._src.core.cursor import EpochCursor
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import EpochFn, StatePredicate
from trainfold._src.distributed.interrupt import signal_name


def _context(state: TrainState) -> Context | None:
    return context_of(state.accelerator) if state.accelerator is not None else None


def _stop_requested(ctx: Context | None, state: TrainState) -> TrainState:
    """A signal that arrived since the last check (in an epoch function, a tracker's flush...), agreed before the next epoch.

    Every process calls it at the same point (one all-reduce on the control channel on several).
    """
    if ctx is None or state.should_stop:
        return state
    signum = ctx.runtime.interrupt.agree_now()
    if not signum:
        return state
    ctx.runtime.interrupt.clear()  # honoured: a later run on this Context is not stopped by it
    return state.with_stop(f"signal {signal_name(signum)}")


def _ended(state: TrainState) -> TrainState:
    """The state a loop combinator returns: an interrupted epoch is no longer being unwound.

    The epoch functions composed after ``run_epoch`` passed it through; code after
    the loop runs as written (``evaluate`` evaluates, ``checkpoint_every(...).at_end``
    saves). It stays stopped and mid-epoch.
    """
    if isinstance(state.cursor, EpochCursor) and state.cursor.interrupted:
        state = attrs.evolve(state, cursor=attrs.evolve(state.cursor, interrupted=False))
    return state


def expect_epoch_fn(where: str, fn: Any) -> None:
    """Refuse, where the combinator is built, what cannot be called as ``fn(state)``: a state (a primitive given its state
    runs at once and returns one), something not callable, a function that needs more than the state.

    Raises:
        TypeError: naming what was given and the fix.
    """
    if isinstance(fn, TrainState):
        raise TypeError(
            f"{where} takes an epoch function (state -> state) and was given a TrainState: a primitive given its state "
            "(run_epoch(ctx, step, loader, state)) runs at once. Leave the state out to get the function: "
            f"{where}(run_epoch(ctx, step, loader), ...)."
        )
    if not callable(fn):
        raise TypeError(f"{where} takes an epoch function (state -> state); got {fn!r}, a {type(fn).__name__}.")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C callable: nothing to check
        return
    # toolz's curry shows the arguments it still needs with this default
    required = [
        p.name
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and (p.default is p.empty or p.default == no_default)
    ]
    if len(required) > 1 or any(signature.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY for n in required):
        raise TypeError(
            f"{where} calls epoch_fn(state), with the state alone, and {name_of(fn)} still needs {', '.join(required)} "
            f"(the state would be taken as {required[0]!r}). Give it the rest first (a curried primitive takes everything "
            "but the state: evaluate(ctx, loss_fn, loader)), or wrap it: lambda state: fn(state, ...)."
        )


def warn_if_recorded_before_training(where: str, epoch_fn: EpochFn, before: TrainState, after: TrainState) -> None:
    """Warn when an epoch that trained recorded a value (an evaluation's) of the model it was given, before any update:
    the functions ran in the order the composition reads left to right, not the one it applies (``compose(a, b)``
    runs ``b`` first), and the final model is never evaluated. Values recorded during the epoch after an update
    (``every_steps``) are not that. Checked on a loop's first epoch (a few comparisons)."""
    if after.step <= before.step:
        return
    early = [
        r
        for r in tuple(after.history)[len(before.history) :]
        if not r.name.startswith("train_") and r.step == before.step
    ]
    if early:
        r = early[0]
        warnings.warn(
            f"{where}: epoch function {name_of(epoch_fn)!r} recorded {r.name!r} at update {r.step}, before the epoch's training "
            f"(which ended at update {after.step}): compose applies right to left, so in compose(run_epoch(...), "
            "evaluate(...)) the evaluation runs first, on the model before each epoch, and the final model is never "
            "evaluated. Put what runs after training on the left: compose(evaluate(...), run_epoch(...)).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def loop(epoch_fn: EpochFn, *by_position: Any, max_epochs: int | None = None) -> EpochFn:
    """Run ``epoch_fn`` until ``state.epoch`` reaches ``max_epochs`` or ``state.should_stop`` is set.

    In outline:

        while not state.should_stop and state.epoch < max_epochs:
            stop if a signal arrived since the last check (agreed by every process)
            state = epoch_fn(state)        # must advance state.epoch

    ``max_epochs`` counts epochs of the whole run, so a state resumed at epoch
    5 runs epochs 6..max_epochs. With ``max_epochs=None`` only ``should_stop``
    ends the loop. A stop in the middle of an epoch (``state.interrupted``) is
    returned as it is, mid-epoch and stopped, with the interrupted flag
    cleared: code after the loop (an ``evaluate``...) runs as written. The loop
    saves nothing itself: a run that checkpoints composes its final save after it,
    ``compose(saving.at_end, loop(...))`` (:func:`~trainfold.checkpoint_every`).

    Args:
        epoch_fn: ``state -> state``; it must advance ``state.epoch`` (contain a ``run_epoch``).
        by_position: nothing: ``max_epochs`` is a keyword argument, and a value given by position is refused naming it.
        max_epochs: the epoch count of the whole run at which to stop; None: only ``should_stop`` ends it.

    Returns:
        An epoch function ``state -> state`` that runs the loop.

    Raises:
        ValueError: ``max_epochs`` is not a positive int (when the loop is built).
        TypeError: ``epoch_fn`` cannot be called as ``epoch_fn(state)`` (a TrainState, not callable, a function that
            needs more), or ``max_epochs`` given by position (when the loop is built); ``epoch_fn`` returned something
            other than a TrainState (when it runs).
        RuntimeError: ``epoch_fn`` did not advance ``state.epoch`` (it would loop
            forever): it must contain a ``run_epoch``.

    Examples:
        >>> from trainfold import testing, make_step, run_epoch
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = loop(run_epoch(ctx, make_step(ctx, loss_fn), loader), max_epochs=3)(state)
        >>> state.epoch
        3
    """
    if by_position:
        raise TypeError(
            f"loop(epoch_fn, max_epochs={by_position[0]!r}): max_epochs is a keyword argument "
            f"(loop was given {len(by_position) + 1} arguments by position)."
        )
    expect_epoch_fn("loop", epoch_fn)
    if max_epochs is not None:
        positive_int("max_epochs", max_epochs)

    def run(state: TrainState) -> TrainState:
        state = expect_state("loop", state)
        ctx = _context(state)
        first = True
        while not state.should_stop and (max_epochs is None or state.epoch < max_epochs):
            state = _stop_requested(ctx, state)
            if state.should_stop:
                break
            new = returned_state(epoch_fn, epoch_fn(state))
            if new.epoch <= state.epoch and not new.should_stop:
                raise RuntimeError(
                    f"loop: epoch function {name_of(epoch_fn)!r} did not advance state.epoch "
                    f"(still {new.epoch}), so the loop would never end: compose it with run_epoch."
                )
            if first:
                warn_if_recorded_before_training("loop", epoch_fn, state, new)
                first = False
            state = new
        return _ended(state)

    return named(run, f"loop({name_of(epoch_fn)}, max_epochs={max_epochs})")


def repeat(n: int, fn: EpochFn) -> EpochFn:
    """Apply ``fn`` ``n`` times (fewer if the state says stop).

    Args:
        n: how many times (a positive int).
        fn: the epoch function to apply.

    Returns:
        An epoch function ``state -> state``; a stop (``should_stop``) ends it early, as :func:`loop`'s does.

    Raises:
        ValueError: ``n`` is not a positive int.
        TypeError: ``fn`` returned something other than a TrainState (when run).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> repeat(2, run_epoch(ctx, make_step(ctx, loss_fn), loader))(state).epoch
        2
    """
    positive_int("n", n)
    expect_epoch_fn("repeat", fn)

    def run(state: TrainState) -> TrainState:
        state = expect_state("repeat", state)
        ctx = _context(state)
        for _ in range(n):
            state = _stop_requested(ctx, state)
            if state.should_stop:
                break
            state = returned_state(fn, fn(state))
        return _ended(state)

    return named(run, f"repeat({n}, {name_of(fn)})")


def until(predicate: StatePredicate, fn: EpochFn) -> EpochFn:
    """Apply ``fn`` while ``predicate(state)`` is false (checked before each call) and not stopped.

    Args:
        predicate: ``state -> bool``, checked before each call of ``fn``.
        fn: the epoch function to apply.

    Returns:
        An epoch function ``state -> state``, ended as :func:`loop` ends.

    Raises:
        TypeError: ``fn`` returned something other than a TrainState (when run).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> until(lambda s: s.step >= 6, run_epoch(ctx, make_step(ctx, loss_fn), loader))(state).step
        8
    """
    expect_epoch_fn("until", fn)

    def run(state: TrainState) -> TrainState:
        state = expect_state("until", state)
        ctx = _context(state)
        while not state.should_stop and not predicate(state):
            state = _stop_requested(ctx, state)
            if state.should_stop:
                break
            state = returned_state(fn, fn(state))
        return _ended(state)

    return named(run, f"until({name_of(predicate)}, {name_of(fn)})")


def every_epochs(n: int, fn: EpochFn) -> EpochFn:
    """Apply ``fn`` only when ``state.epoch`` is a multiple of ``n``; otherwise pass the state through.

    In ``compose(every_epochs(5, save), run_epoch(...))`` the checkpoint is
    written after epochs 5, 10, 15..., and at the final stop of a budget
    (:attr:`~trainfold.TrainState.ended_mid_epoch`). (For every ``n`` optimizer updates inside
    an epoch, see :func:`~trainfold.every_steps`.)

    Args:
        n: the period, in epochs (a positive int).
        fn: the epoch function to run after epochs ``n``, ``2n``...

    Returns:
        An epoch function that passes other epochs' states through unchanged.

    Raises:
        ValueError: ``n`` is not a positive int.
        TypeError: ``fn`` returned something other than a TrainState (when run).

    Examples:
        >>> from toolz import compose
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> epoch = compose(every_epochs(2, evaluate(ctx, loss_fn, loader)), run_epoch(ctx, make_step(ctx, loss_fn), loader))
        >>> [r.epoch for r in loop(epoch, max_epochs=4)(state).history if r.name == "eval_loss"]
        [2, 4]
    """
    positive_int("n", n)
    expect_epoch_fn("every_epochs", fn)

    def run(state: TrainState) -> TrainState:
        state = expect_state("every_epochs", state)
        if state.interrupted:  # the epoch did not end: the one before it was already counted
            return state
        if state.ended_mid_epoch:  # a budget's end: the final model gets what the epochs get
            return returned_state(fn, fn(state))
        return returned_state(fn, fn(state)) if state.epoch % n == 0 else state

    return named(run, f"every_epochs({n}, {name_of(fn)})")
