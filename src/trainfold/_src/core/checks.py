"""Checks of the primitives' arguments against the run: is this a TrainState, the Context, and are they each other's?"""

from __future__ import annotations

from typing import Any

from toolz import curry

from trainfold._src.base.checks import name_of
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState


def expect_state(where: str, value: Any) -> TrainState:
    """Return ``value`` if it is a TrainState; otherwise explain what went wrong.

    The common mistake is a curried primitive missing an argument inside a
    pipe: it returns a function, which the next primitive receives as its
    state.
    """
    if isinstance(value, TrainState):
        return value
    if isinstance(value, curry):
        raise TypeError(
            f"{where} received a curried {name_of(value)!r} instead of a TrainState: the function "
            f"before it in the pipe is missing arguments (did you pass the loader, or the state?). "
            f"Still expected by {name_of(value)!r}: {_missing_args(value)}."
        )
    if callable(value):
        raise TypeError(
            f"{where} received the function {name_of(value)!r} instead of a TrainState: an earlier "
            "function returned a function; check that every function in the pipe takes and returns "
            "the state."
        )
    raise TypeError(
        f"{where} needs a TrainState (got {value!r} that is a {type(value).__name__}); build one "
        "with TrainState.create(ctx, model=..., optimizer=...)."
    )


def _missing_args(c: curry) -> str:
    """The arguments a curry still needs, and where a TrainState it holds went when it took the place of another."""
    import inspect

    from toolz.functoolz import no_default

    try:
        params = inspect.signature(c).parameters
        bound = list(inspect.signature(c.func).parameters)
    except (TypeError, ValueError):
        return "unknown"
    # toolz marks an argument still to come by its no_default sentinel, not by inspect's empty
    names = [p for p, v in params.items() if v.default is inspect.Parameter.empty or v.default is no_default]
    missing = ", ".join(names) or "none"
    for name, value in zip(bound, c.args):
        if isinstance(value, TrainState) and name != "state":
            return f"{missing}; the TrainState was taken as {name!r}: an argument before it is missing"
    return missing


_NO_LOADER = object()


def describe(value: Any) -> str:
    """What a misplaced argument is, in the words of the API (the Context, a TrainState, a loader, a function...)."""
    if isinstance(value, Context):
        return "the Context"
    if isinstance(value, TrainState):
        return "a TrainState"
    if hasattr(value, "__iter__") and hasattr(value, "batch_size"):
        return f"a loader ({type(value).__name__})"
    if callable(value):
        return f"the function {name_of(value)!r}"
    return f"a {type(value).__name__}"


def expect_context(where: str, signature: str, ctx: Any) -> Context:
    """Return ``ctx`` if it is a Context; otherwise say that the Context comes first.

    Raises:
        TypeError: the first argument is something else (a TrainState: the state comes last).
    """
    if isinstance(ctx, Context):
        return ctx
    raise TypeError(
        f"{where}: the first argument of {signature} must be the Context; got {describe(ctx)}. Check the order of the arguments."
    )


def expect_args(where: str, signature: str, ctx: Any, fn_name: str, fn: Any, loader: Any = _NO_LOADER) -> None:
    """Check the kinds of a primitive's leading arguments (once, when it runs or is built; never per step).

    Arguments in the wrong order would otherwise fail far away, about the wrong
    thing (``'function' object is not iterable``); this names each place.

    Raises:
        TypeError: the first argument is not the Context, the second not a
            function, or the third not an iterable of batches.
    """
    expect_context(where, signature, ctx)
    if not callable(fn):
        raise TypeError(
            f"{where}: {fn_name}, the second argument of {signature}, must be a function; got {describe(fn)}. Check the order of the arguments."
        )
    if loader is not _NO_LOADER and (
        callable(loader) or not hasattr(loader, "__iter__") or isinstance(loader, (str, bytes, TrainState))
    ):
        raise TypeError(
            f"{where}: loader, the third argument of {signature}, must be an iterable of batches (a DataLoader); got "
            f"{describe(loader)}. Check the order of the arguments."
        )


def expect_shared_out(where: str, ctx: Context, loader: Any) -> None:
    """On several processes, refuse a loader every process would read whole (once per epoch, never per batch).

    Raises:
        ValueError: the loader was not prepared, not marked with ``ctx.own_shards`` and not
            over a ``DistributedSampler``.
    """
    from trainfold._src.backend.loaders import shares_out_data

    n = ctx.accelerator.num_processes
    if n > 1 and not shares_out_data(loader):
        raise ValueError(
            f"{where}: the loader was not prepared, so each of the {n} processes would read the whole dataset "
            f"({n} times the batches per epoch, every sample {n} times). Prepare it with ctx.prepare_loaders(loader); "
            "if it already yields only this process's share (its own sampler or stream per process), mark it with "
            "ctx.own_shards(loader)."
        )


def expect_owned(where: str, ctx: Context, state: TrainState) -> TrainState:
    """Raise unless ``state`` was created with ``ctx``'s Accelerator."""
    if state.accelerator is not ctx.accelerator:
        raise ValueError(
            f"{where}: this TrainState was created with another Accelerator than the Context's: its "
            "model and optimizer are prepared for that one. Create the state with "
            "TrainState.create(ctx, ...) using the same Context you pass here."
        )
    return state


def returned_state(fn: Any, value: Any) -> TrainState:
    """Check what an epoch function returned."""
    if isinstance(value, TrainState):
        return value
    what = (
        f"a curry, not a TrainState: it is missing arguments ({_missing_args(value)})"
        if isinstance(value, curry)
        else f"{type(value).__name__}, not a TrainState"
    )
    raise TypeError(
        f"epoch function {name_of(fn)!r} returned {what}. Epoch functions take the state last and "
        "return the new state (did you pass the state?)."
    )
