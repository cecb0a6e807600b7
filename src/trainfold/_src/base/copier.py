"""A positional copy of an attrs instance with some fields replaced: ``attrs.evolve`` for the step's one new state.

``attrs.evolve`` loops over the class's fields and builds a dict of them on
every call (2.0 µs for TrainState's fourteen, in a tight loop). :func:`copier`
generates, once per class and set of changed fields (as attrs generates
``__init__``), a function that calls the constructor with every field by
position. It is used in one place, ``step.record``; it earns its place by the
measurement in ``benchmarks/README.md`` ("What was found").
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar, cast

import attrs

_A = TypeVar("_A")
_COPIERS: dict[tuple[type, tuple[str, ...]], Callable[..., Any]] = {}


def copier(cls: type[_A], *changed: str) -> Callable[..., _A]:
    """``copy(old, *values) -> cls``: ``old`` with the fields ``changed`` set to ``values``, in that order.

    The same result as ``attrs.evolve(old, **dict(zip(changed, values)))``
    (attrs' ``__init__`` runs, validators and all), cached per ``(cls, changed)``.

    Examples:
        >>> import attrs
        >>> @attrs.frozen
        ... class P:
        ...     x: int
        ...     y: int = attrs.field(default=0, kw_only=True)
        >>> copier(P, "y")(P(1, y=2), 5)
        P(x=1, y=5)
    """
    key = (cls, changed)
    made = _COPIERS.get(key)
    if made is None:
        made = _COPIERS[key] = _generate(cls, changed)
    return made


def _generate(cls: type, changed: tuple[str, ...]) -> Callable[..., Any]:
    fields = [f for f in attrs.fields(cls) if f.init]
    if unknown := set(changed) - {f.alias for f in fields}:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    # the generated names cannot clash with a field's (fields named "state" or "cls" are fine)
    values = {f.alias: f.alias if f.alias in changed else f"__old.{f.name}" for f in fields}
    # by position where __init__ takes it (attrs keeps the fields' order), by keyword otherwise
    args = [values[f.alias] for f in fields if not f.kw_only] + [
        f"{f.alias}={values[f.alias]}" for f in fields if f.kw_only
    ]
    source = f"def copy(__old{''.join(f', {name}' for name in changed)}):\n    return __cls({', '.join(args)})\n"
    namespace: dict[str, Any] = {"__cls": cls}
    exec(compile(source, f"<trainfold copy of {cls.__name__}>", "exec"), namespace)  # noqa: S102 (field names only)
    return cast("Callable[..., Any]", namespace["copy"])
