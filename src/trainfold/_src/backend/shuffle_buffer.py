"""A ``datasets`` stream's shuffle buffer whose state holds the buffer, so that a resume is O(1) and exact.

``IterableDataset.shuffle(seed, buffer_size)`` shuffles through a buffer that the stream's ``state_dict()`` leaves
out (datasets#7901): loading it would lose up to a buffer of samples, so a resume had to read the epoch again.
:func:`keep_buffers_in_state` swaps each such buffer of a stream for :class:`ShuffleBuffer`, which yields the same
samples in the same order (the same algorithm and the same draws from the same generator) and whose state also
holds what is in the buffer, the generator's state and how far the current round of yields has gone. A checkpoint
then holds the buffer (about half of ``buffer_size`` samples, or as Arrow IPC bytes on the Arrow path) and a resume
loads it and reads on.

It follows datasets 5.1's buffer (a round at a time: the full buffer permuted, half of it yielded); with an
earlier datasets nothing is swapped, and such a stream's resume reads its epoch again.

Samples are kept as the stream's own rows (before any formatting or decoding): numbers, strings, bytes, lists and
dicts, which a checkpoint holds without pickle. Imported only where a run streams a ``datasets`` stream (by
:func:`trainfold._src.backend.streams.keep_given_stream`): it imports datasets.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.iterable_dataset import BufferShuffledExamplesIterable

#: the ``type`` a ShuffleBuffer's state records, where datasets' own records its class name
STATE_TYPE = "trainfold.ShuffleBuffer"


def keep_buffers_in_state(dataset: Any) -> int:
    """Swap every shuffle buffer of the ``datasets`` stream ``dataset`` for a :class:`ShuffleBuffer`, in place (before
    it is iterated); return how many were swapped. Anything but a ``datasets.IterableDataset`` is left alone."""
    root = getattr(dataset, "_ex_iterable", None)
    if root is None or not _rounds_of_half():
        return 0
    swapped = 0

    def swap(node: Any) -> Any:
        nonlocal swapped
        if hasattr(node, "ex_iterable"):
            node.ex_iterable = swap(node.ex_iterable)
        if isinstance(getattr(node, "ex_iterables", None), list):
            node.ex_iterables = [swap(child) for child in node.ex_iterables]
        if type(node) is BufferShuffledExamplesIterable and node.buffer_size > 1:
            swapped += 1
            return ShuffleBuffer(node.ex_iterable, node.buffer_size, node.generator)
        return node

    dataset._ex_iterable = swap(root)
    return swapped


def _rounds_of_half() -> bool:
    """Whether the installed datasets shuffles as :class:`ShuffleBuffer` does: a permutation of the full buffer, half
    of it yielded, a round at a time (datasets 5.1 and later; before, a random slot a sample, whose streams are read
    again at a resume)."""
    import datasets

    release = tuple(int(part) for part in datasets.__version__.split(".")[:2] if part.isdigit())
    return release >= (5, 1)


class ShuffleBuffer(BufferShuffledExamplesIterable):  # type: ignore[misc]
    """datasets' buffer shuffle, draw for draw, with the buffer in its state (see the module's docstring)."""

    def _like(self, ex_iterable: Any, generator: np.random.Generator) -> ShuffleBuffer:
        return ShuffleBuffer(ex_iterable, self.buffer_size, generator)

    def shift_rngs(self, value: int) -> ShuffleBuffer:
        rng = copy.deepcopy(self.generator)
        return self._like(self.ex_iterable, np.random.default_rng(seed=rng.integers(0, 1 << 63) - value))

    def shuffle_data_sources(self, generator: np.random.Generator) -> ShuffleBuffer:
        return self._like(self.ex_iterable.shuffle_data_sources(generator), self.generator)

    def shard_data_sources(self, num_shards: int, index: int, contiguous: bool = True) -> ShuffleBuffer:
        return self._like(self.ex_iterable.shard_data_sources(num_shards, index, contiguous=contiguous), self.generator)

    def reshard_data_sources(self) -> ShuffleBuffer:
        return self._like(self.ex_iterable.reshard_data_sources(), self.generator)

    def _init_state_dict(self) -> dict[str, Any]:
        # "buffer" is None until the stream starts: datasets' loading replaces a None wholesale by what was saved
        self._state_dict = {
            "examples_iterable": self.ex_iterable._init_state_dict(),
            "buffer": None,
            "type": STATE_TYPE,
        }
        return self._state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        # datasets' own warns that the buffer is lost: here it is in the state
        return super(BufferShuffledExamplesIterable, self).load_state_dict(state_dict)

    def _start(self) -> tuple[np.random.Generator, dict[str, Any]]:
        """The generator and the live buffer state: the loaded one, or a new one at the stream's start."""
        rng = copy.deepcopy(self.generator)
        saved = self._state_dict.get("buffer") if self._state_dict else None
        if saved is not None:
            rng.bit_generator.state = saved["rng"]
            live = dict(saved)
        else:
            live = {"samples": [], "tables": None, "rows": 0, "order": None, "done": 0, "keep": 0, "rng": None}
        live["rng"] = rng.bit_generator.state
        if self._state_dict is not None:
            self._state_dict["buffer"] = live
        return rng, live

    def __iter__(self) -> Iterator[Any]:
        rng, live = self._start()
        buffer = live["samples"] = [tuple(sample) for sample in live["samples"]]  # (key, example): JSON has no tuples
        if live["order"] is not None:  # saved in the middle of a round of yields: finish it
            yield from self._round(buffer, live)
            buffer = live["samples"]
        for sample in self.ex_iterable:
            buffer.append(sample)
            if len(buffer) >= self.buffer_size:
                self._draw(rng, live, len(buffer), self.buffer_size // 2)
                yield from self._round(buffer, live)
                buffer = live["samples"]
        if buffer:
            self._draw(rng, live, len(buffer), 0)
            yield from self._round(buffer, live)

    @staticmethod
    def _draw(rng: np.random.Generator, live: dict[str, Any], rows: int, keep: int) -> None:
        """Draw a round's order (datasets' one permutation of the full buffer): yield all but ``keep`` of it."""
        live.update(order=[int(i) for i in rng.permutation(rows)], done=0, keep=keep, rng=rng.bit_generator.state)

    @staticmethod
    def _round(buffer: list[Any], live: dict[str, Any]) -> Iterator[Any]:
        order, stop = live["order"], len(live["order"]) - live["keep"]
        while live["done"] < stop:
            live["done"] += 1  # the state at a sample is the one after it, as datasets' states are
            yield buffer[order[live["done"] - 1]]
        live.update(samples=[buffer[i] for i in order[stop:]], order=None, done=0, keep=0)

    @property
    def iter_arrow(self) -> Any:
        return self._iter_arrow if self.ex_iterable.iter_arrow else None

    def _iter_arrow(self) -> Iterator[tuple[Any, pa.Table]]:
        """datasets' Arrow path: a round yields one table; the state between rounds holds the kept rows as Arrow IPC."""
        rng, live = self._start()
        tables = [] if live["tables"] is None else [pa.ipc.open_stream(pa.py_buffer(live["tables"])).read_all()]
        rows, key = live["rows"], None
        for key, table in self.ex_iterable.iter_arrow():
            tables.append(table)
            rows += len(table)
            if rows >= self.buffer_size:
                shuffled = pc.take(pa.concat_tables(tables), rng.permutation(rows))
                keep = self.buffer_size // 2
                tables, rows = [shuffled.slice(len(shuffled) - keep)], keep
                live.update(tables=_ipc(tables[0]), rows=keep, rng=rng.bit_generator.state)
                yield key, shuffled.slice(0, len(shuffled) - keep)
        if rows > 0:
            shuffled = pc.take(pa.concat_tables(tables), rng.permutation(rows))
            live.update(tables=None, rows=0, rng=rng.bit_generator.state)
            yield key, shuffled


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
