"""History: the epoch-level records of a run, as an immutable value."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Iterator, Mapping

import attrs

from trainfold._src.base.checks import counter


@attrs.frozen
class Record:
    """One recorded value: ``name`` was ``value`` after ``epoch`` epochs and ``step`` updates.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> [record] = run_epoch(ctx, make_step(ctx, loss_fn), loader, state).history
        >>> record.name, record.epoch, record.step, round(record.value, 4)
        ('train_loss', 1, 4, 2.3797)
    """

    epoch: int
    step: int
    name: str
    value: float


@attrs.frozen
class History:
    """Every metric recorded in a run, oldest first.

    A record is added once per epoch or evaluation, never per step, so the
    tuple stays small; adding returns a new History.

    Read it by name as a read-only mapping of each metric to its values, oldest
    first: ``h["eval_loss"]``, ``h.get(name)``, ``h.keys()``, ``h.items()``,
    ``name in h``. Iterating gives the records themselves (each a :class:`Record`:
    a value with its epoch and update), and ``len`` counts them.

    Examples:
        >>> h = History().add(epoch=1, step=10, values={"train_loss": 0.5})
        >>> h = h.add(epoch=2, step=20, values={"train_loss": 0.25, "eval_loss": 0.3})
        >>> h["train_loss"], h.latest("eval_loss"), h.names
        ((0.5, 0.25), 0.3, ('train_loss', 'eval_loss'))
        >>> dict(h.items())
        {'train_loss': (0.5, 0.25), 'eval_loss': (0.3,)}
    """

    records: tuple[Record, ...] = ()

    def add(self, *, epoch: int, step: int, values: Mapping[str, float]) -> History:
        """Return a History with one record per item of ``values`` appended."""
        # sync: none for floats; per record (never per step) for a tensor
        new = tuple(Record(epoch, step, name, float(v)) for name, v in values.items())  # sync: as above
        return History(self.records + new)

    def __getitem__(self, name: str) -> tuple[float, ...]:
        """All values recorded under ``name``, oldest first.

        Raises:
            KeyError: nothing was recorded under ``name``; the message lists what was.
        """
        values = tuple(r.value for r in self.records if r.name == name)
        if not values:
            raise KeyError(f"no metric {name!r} has been recorded; recorded: {list(self.names)}")
        return values

    def get(self, name: str, default: Any = None) -> Any:
        """The values recorded under ``name``, oldest first, or ``default`` if none were."""
        return self[name] if name in self else default

    def keys(self) -> tuple[str, ...]:
        """The recorded metric names, in order of first appearance (as :attr:`names`)."""
        return self.names

    def items(self) -> Iterator[tuple[str, tuple[float, ...]]]:
        """Each recorded name with its values, oldest first."""
        by_name: dict[str, list[float]] = {}
        for r in self.records:
            by_name.setdefault(r.name, []).append(r.value)
        return ((name, tuple(values)) for name, values in by_name.items())

    def values(self) -> Iterator[tuple[float, ...]]:
        """Each recorded name's values, in the order of :meth:`keys`."""
        return (values for _, values in self.items())

    def __contains__(self, name: object) -> bool:
        return any(r.name == name for r in self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def names(self) -> tuple[str, ...]:
        """The recorded metric names, in order of first appearance."""
        return tuple(dict.fromkeys(r.name for r in self.records))

    def latest(self, name: str) -> float:
        """The most recent value recorded under ``name`` (KeyError if none)."""
        return self[name][-1]

    def at(self, step: int) -> Mapping[str, float]:
        """The values recorded at update ``step`` (the newest of each name); a name recorded only earlier raises a KeyError saying so.

        Examples:
            >>> h = History().add(epoch=1, step=10, values={"train_loss": 0.5, "eval_loss": 0.4})
            >>> h = h.add(epoch=2, step=20, values={"train_loss": 0.25})
            >>> dict(h.at(20))
            {'train_loss': 0.25}
        """
        return _AtStep(self, step)

    def latest_values(self) -> Mapping[str, float]:
        """A read-only mapping of every name to its most recent value."""
        return MappingProxyType({r.name: r.value for r in self.records})

    def to_dict(self) -> dict[str, list[tuple[int, int, float]]]:
        """``{name: [(epoch, step, value), ...]}``: plain values for JSON or plotting."""
        out: dict[str, list[tuple[int, int, float]]] = {}
        for r in self.records:
            out.setdefault(r.name, []).append((r.epoch, r.step, r.value))
        return out


def history_rows(history: History) -> list[list[Any]]:
    """The records as JSON rows, ``[[epoch, step, name, value], ...]``: how a checkpoint's ``state.json`` holds them.

    Examples:
        >>> history_from_rows(history_rows(History().add(epoch=1, step=4, values={"loss": 0.5}))).latest("loss")
        0.5
    """
    return [[r.epoch, r.step, r.name, r.value] for r in history.records]


def history_from_rows(saved: Any) -> History:
    """The run's records from the rows a checkpoint's ``state.json`` holds (:func:`history_rows`), each checked.

    Raises:
        ValueError: not a list of such records (the record, and what it should be, named).
    """
    if not isinstance(saved, list):
        raise ValueError(f"history is {type(saved).__name__}, not a list of [epoch, step, name, value] records")
    return History(tuple(_record(r) for r in saved))


def _record(r: Any) -> Record:
    if not isinstance(r, list) or len(r) != 4:
        raise ValueError(f"history record {r!r} is not [epoch, step, name, value]")
    epoch, step, name, value = r
    if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"history record {r!r} is not [epoch, step, name, value]")
    number = float(value)  # sync: none: a JSON number
    return Record(counter("history epoch", epoch), counter("history step", step), name, number)


class _AtStep(Mapping[str, float]):
    """The values a History recorded at one update: a read-only mapping whose KeyError says where a name was last seen."""

    def __init__(self, history: History, step: int) -> None:
        self._values = {r.name: r.value for r in history.records if r.step == step}
        self._history = history
        self._step = step

    def __getitem__(self, name: str) -> float:
        try:
            return self._values[name]
        except KeyError:
            older = [r for r in self._history.records if r.name == name]
            if not older:
                raise KeyError(
                    f"no metric {name!r} has been recorded; recorded at update {self._step}: {list(self._values)}"
                ) from None
            last = older[-1]
            raise KeyError(
                f"{name!r} was not recorded for the model at update {self._step}: its last value is from update {last.step} "
                f"(epoch {last.epoch}), an older model. state.history.latest({name!r}) gives it; evaluate the state to "
                "record one now."
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return repr(self._values)
