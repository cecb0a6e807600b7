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
from typing import Any, Mapping

import torch

from trainfold._src.base.io import ALIGNMENT, write_durably
from trainfold._src.checkpoint import digest as _digest

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
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


def parse(buf: Any) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file in ``buf``, each a view into it (the buffer stays alive with them), at the
    file's offset: what a load copies into the live model needs no more; what the run keeps goes through
    ``codec.aligned``.

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
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"the header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise FormatError("the header is not a JSON object")
    data_start, data_len = 8 + n, len(buf) - 8 - n
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _BY_NAME[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"tensor {name!r} has no valid dtype, shape and offsets") from None
        numel = 1
        for s in shape:
            if s < 0:
                raise FormatError(f"tensor {name!r} has a negative dimension")
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_len or end - begin != numel * itemsize:
            raise FormatError(f"tensor {name!r} has offsets {begin}..{end} that do not fit its shape or the file")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=data_start + begin) if end > begin else torch.empty(0, dtype=torch.uint8)
        if (data_start + begin) % itemsize:  # misaligned (not written by trainfold or the library): copy
            raw = raw.clone()
        out[name] = raw.view(dtype).reshape(shape)
    return out
