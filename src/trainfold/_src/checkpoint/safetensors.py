"""The safetensors file format, written from the tensors' own memory and read into one buffer.

Owned here: :func:`encode` (a header, then every tensor's bytes straight from its
memory: no serialised copy of the file in memory; a storage writes and hashes
them), :func:`write` (that, into a local file) and :func:`parse` (every tensor a
view into one buffer, such as a mapped file: no copy per tensor). The files are the format the
``safetensors`` library writes and reads (tensors ordered by alignment, the
header padded to 8 bytes); a test checks both ways. The reader trusts nothing
in the header: names, dtypes, shapes and offsets are checked against the buffer.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator, Mapping, NamedTuple

import torch

from trainfold._src.base.io import ALIGNMENT, write_durably
from trainfold._src.checkpoint import digest as _digest

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
#: A header larger than this is not one of a checkpoint (the library's own limit is 100 MB).
MAX_HEADER = 100_000_000


class FormatError(ValueError):
    """A file that is not a valid safetensors file (the reason is in the message)."""


def raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, as a read-only view of its (CPU, contiguous) memory."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    array: Any = flat.view(torch.uint8).numpy()  # a buffer; numpy's stubs do not say so
    return memoryview(array).cast("B")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def encode(tensors: Mapping[str, torch.Tensor]) -> list[Any]:
    """The buffers of a safetensors file of ``tensors``: its header, then every tensor's bytes as a view of its memory.

    Raises:
        TypeError: a tensor of a dtype safetensors has no name for.
    """
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot write tensor {name!r} of dtype {t.dtype} to a safetensors file.")
    # The data begins at an ALIGNMENT boundary of the file (the header padded with spaces, which the format allows) and
    # the tensors whose sizes are multiples of it come first: each of those lies at such a boundary of a mapped file,
    # where torch would have allocated it, so a load keeps it as a view (codec.aligned copies the others). Within each
    # part, largest elements first, as the library does: every offset is aligned to its element size.
    order = sorted(tensors, key=lambda n: (_nbytes(tensors[n]) % ALIGNMENT != 0, -tensors[n].element_size(), n))
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = _nbytes(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % ALIGNMENT)
    return [struct.pack("<Q", len(head)), head, *(raw(tensors[name]) for name in order)]


def write(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` to the file ``path`` as safetensors, fsynced; return its manifest entry (size, digest).

    Raises:
        TypeError: a tensor of a dtype safetensors has no name for.
        OSError: the write failed (a full disk: ENOSPC).
    """
    digest = _digest.new()
    return _digest.entry(write_durably(path, encode(tensors), digest.update), digest)


class Entry(NamedTuple):
    """One tensor of a safetensors file, checked against the buffer but not yet made: :meth:`tensor` makes it."""

    buf: Any
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in the buffer
    nbytes: int

    def tensor(self) -> torch.Tensor:
        """The tensor, a view into the buffer (a copy where the file misaligns it: not written by trainfold or the library)."""
        if not self.nbytes:
            return torch.empty(self.shape, dtype=self.dtype)
        raw = torch.frombuffer(self.buf, dtype=torch.uint8, count=self.nbytes, offset=self.offset)
        if self.offset % self.dtype.itemsize:
            raw = raw.clone()
        return raw.view(self.dtype).reshape(self.shape)


class Tensors(Mapping[str, torch.Tensor]):
    """Tensors by name, each made from its :class:`Entry` when it is asked for: a reader that needs a few of a file's
    tensors (an export's base) holds one small entry for each of the others, not a tensor."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self.entries = entries

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.entries[name].tensor()

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


class _Raw(NamedTuple):
    """A tensor's entry as the header holds it, before it is checked."""

    dtype: Any
    shape: Any
    data_offsets: Any


def _compact(pairs: list[tuple[str, Any]]) -> Any:
    """A JSON object as the decoder meets it: a tensor's entry as a tuple (a third of a dict's memory), others a dict."""
    if [key for key, _ in pairs] == ["dtype", "shape", "data_offsets"]:  # the order the format's writers use
        return _Raw(*(value for _, value in pairs))
    entry = dict(pairs)
    return _Raw(**entry) if entry.keys() == set(_Raw._fields) else entry


def _ints(value: Any) -> tuple[int, ...] | None:
    """A JSON list of integers as a tuple; None for anything else (a string, a float, a bool)."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        return None
    return tuple(value)


def index(buf: Any) -> dict[str, Entry]:
    """The entries of a safetensors file in ``buf``, every one checked against the buffer; no tensor is made.

    Raises:
        FormatError: a header that is not a safetensors header, or names a dtype,
            shape or offsets the buffer does not hold.
    """
    if len(buf) < 8:
        raise FormatError("shorter than a header")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > min(MAX_HEADER, len(buf) - 8):
        raise FormatError(f"a header of {n} bytes in a file of {len(buf)}")
    try:
        header = json.loads(str(memoryview(buf)[8 : 8 + n], "utf-8"), object_pairs_hook=_compact)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"the header is not JSON ({type(exc).__name__})") from None
    if isinstance(header, _Raw):  # three tensors named like an entry's keys
        header = header._asdict()
    if not isinstance(header, dict):
        raise FormatError("the header is not a JSON object")
    data_start, data_len = 8 + n, len(buf) - 8 - n
    out: dict[str, Entry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        raw = entry if isinstance(entry, _Raw) else _Raw(None, None, None)
        dtype = _BY_NAME.get(raw.dtype) if isinstance(raw.dtype, str) else None
        shape, offsets = _ints(raw.shape), _ints(raw.data_offsets)
        if dtype is None or shape is None or offsets is None or len(offsets) != 2:
            raise FormatError(f"tensor {name!r} has no valid dtype, shape and offsets")
        begin, end = offsets
        numel = 1
        for s in shape:
            if s < 0:
                raise FormatError(f"tensor {name!r} has a negative dimension")
            numel *= s
        if not 0 <= begin <= end <= data_len or end - begin != numel * dtype.itemsize:
            raise FormatError(f"tensor {name!r} has offsets {begin}..{end} that do not fit its shape or the file")
        out[name] = Entry(buf, dtype, shape, data_start + begin, end - begin)
    _check_apart(out)
    return out


def _check_apart(entries: Mapping[str, Entry]) -> None:
    """No two tensors share a byte: each loaded tensor may become a live one, and a write to one must not change another."""
    spans = sorted((e.offset, e.offset + e.nbytes, name) for name, e in entries.items() if e.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise FormatError(f"tensors {first!r} and {second!r} share bytes of the file")


def parse(buf: Any) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file in ``buf``, each a view into it (the buffer stays alive with them), at the
    file's offset: what a load copies into the live model needs no more; what the run keeps goes through
    ``codec.aligned``.

    Raises:
        FormatError: a header that is not a safetensors header, or names a dtype,
            shape or offsets the buffer does not hold.
    """
    return {name: entry.tensor() for name, entry in index(buf).items()}
