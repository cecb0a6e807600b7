"""The record types a checkpoint may hold, by name: the registry behind checkpoints' no-pickle guarantee.

A checkpoint stores a record (an attrs class kept in ``state.extras``, such as
``nan_guard``'s or ``early_stop``'s) as its registered name and its
``__init__`` arguments, and rebuilds it only if that name is registered here:
loading never imports or calls anything by a name read from a file. trainfold's
own records register themselves where they are defined, and :data:`HOMES` names
those modules, so that a load finds them before the script has imported them
(``import trainfold`` imports lazily); register yours with :func:`register_record`.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

import attrs

_T = TypeVar("_T", bound=type)

#: Registered record types by name.
RECORDS: dict[str, type] = {}

#: trainfold's own record types and the module that defines (and registers) each: a fixed table, so a name read from
#: a checkpoint only ever selects one of these modules to import (tests check it against what the modules register).
HOMES: dict[str, str] = {
    "BestState": "trainfold._src.compose.epoch_fns",
    "EmaState": "trainfold._src.compose.transforms",
    "LocalSgdState": "trainfold._src.compose.local_sgd",
    "LogState": "trainfold._src.compose.transforms",
    "NanGuardFlags": "trainfold._src.core.guard",
    "NanGuardState": "trainfold._src.core.guard",
    "PatienceState": "trainfold._src.compose.epoch_fns",
    "ProfileState": "trainfold._src.compose.profiling",
    "Stop": "trainfold._src.core.stop",
    "StopWhenState": "trainfold._src.compose.stopping",
}


def register_record(cls: _T | None = None, /, *, name: str | None = None) -> _T:
    """Let checkpoints save and load instances of the attrs class ``cls`` (a decorator).

    A record's fields must themselves be checkpointable: numbers, strings,
    tensors, tuples, lists, dicts, modules (saved as their state dicts) and other
    registered records. It is written as ``name`` (default: the class's
    ``__qualname__``) and its ``__init__`` arguments.

    Args:
        cls: an attrs class.
        name: the name to write; keep it stable, since checkpoints refer to it.

    Returns:
        ``cls`` itself, registered (so it works as a decorator, with or without ``name=``).

    Raises:
        TypeError: ``cls`` is not an attrs class.
        ValueError: another class is already registered under that name.

    Examples:
        >>> import attrs
        >>> @register_record
        ... @attrs.frozen
        ... class Seen:
        ...     batches: int = 0
        >>> RECORDS["Seen"] is Seen
        True
    """

    def register(record: _T) -> _T:
        c: Any = record
        if not (isinstance(c, type) and attrs.has(c)):
            raise TypeError(f"register_record takes an attrs class (got {c!r}): decorate an @attrs.frozen class.")
        key = name or c.__qualname__
        known = RECORDS.get(key)
        if (
            known is not None
            and known is not c
            and (known.__module__, known.__qualname__) != (c.__module__, c.__qualname__)
        ):
            raise ValueError(
                f"record name {key!r} is taken by {known.__module__}.{known.__qualname__}; register "
                f"{c.__module__}.{c.__qualname__} under another name: register_record(name='...')."
            )
        RECORDS[key] = c
        setattr(c, "__trainfold_record__", key)  # read back by the codec
        return record

    return register if cls is None else register(cls)  # type: ignore[return-value]


def lookup(name: str) -> type | None:
    """The record type registered as ``name``, importing trainfold's own module for it first if need be; or None."""
    cls = RECORDS.get(name)
    if cls is None and name in HOMES:
        importlib.import_module(HOMES[name])
        cls = RECORDS.get(name)
    return cls


def record_name(cls: type) -> str | None:
    """The name ``cls`` is registered under, or None."""
    key = getattr(cls, "__trainfold_record__", None)
    return key if key is not None and RECORDS.get(key) is cls else None
