"""DCP's metadata as JSON (``tensors.json``): written from DCP's plan, and read back with every field checked.

Every saved tensor's global shape and dtype, and where each of its pieces lies
(which shard file, under which key). Read back, the pieces must tile each tensor
exactly (no overlap, nothing uncovered) and lie in the checkpoint's own shard
files: a forged ``tensors.json`` is refused before any piece is read.
"""

from __future__ import annotations

import gc
import json
import math
import re
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from trainfold._src.checkpoint import safetensors as _safetensors
from trainfold._src.checkpoint.manifest import parse_json
from trainfold.errors import CheckpointError

METADATA = "tensors.json"

#: the files pieces may be stored in: a process's shards (``shard-<rank>``), and the tensors every process of a sharded
#: model holds whole, dealt among them (``whole-<rank>``)
_SHARD = re.compile(r"(?:shard|whole)-(0|[1-9][0-9]{0,5})\.safetensors")


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: a merge makes hundreds of thousands of small objects and frees none, and each
    collection would walk the whole heap (at 4,096 processes it took half the merge's time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def metadata_json(metadata: Metadata, stored: Mapping[MetadataIndex, Any]) -> list[bytes]:
    """``tensors.json``'s bytes, a part per tensor: each tensor's dtype, size and chunks, then where each piece is stored
    (by name and offset). The same bytes as ``json.dumps`` of the whole document, without the whole document in memory.

    The sizes and offsets are ``torch.Size`` values, tuples, which JSON writes as lists as they are: converting each
    (hundreds of thousands at thousands of processes) took most of the time. The garbage collector is paused
    (:func:`paused_gc`)."""
    with paused_gc():
        parts = []
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise TypeError(f"a sharded checkpoint holds tensors only; {fqn!r} is not one.")
            entry = {
                "dtype": _safetensors.DTYPES[md.properties.dtype],
                "size": md.size,
                "chunks": [(c.offsets, c.sizes) for c in md.chunks],
            }
            parts.append(f"{json.dumps(fqn)}: {json.dumps(entry)}")
        out = [f'{{"tensors": {{{", ".join(parts)}}}, "storage": ['.encode()]
        del parts
        by_tensor: dict[str, list[tuple[Any, ...]]] = {}
        for index, (file, key) in stored.items():
            by_tensor.setdefault(index.fqn, []).append(
                (() if index.offset is None else index.offset, index.offset, file, key)
            )
        for n, fqn in enumerate(sorted(by_tensor)):
            pieces = sorted(by_tensor.pop(fqn))  # offsets are unique within a tensor
            text = json.dumps([(fqn, offset, file, key) for _, offset, file, key in pieces])[1:-1]
            out.append(((", " if n else "") + text).encode())
        out.append(b"]}")
        return out


def parse_metadata(folder: object, data: Any, world_size: int) -> Metadata:
    """DCP's metadata from ``tensors.json``, every field checked: dtypes, shapes, chunks that tile each tensor, files of the checkpoint.

    Raises:
        CheckpointError: a value that is not what trainfold writes, chunks that
            overlap or leave part of a tensor uncovered, a piece stored in a file
            that is not one of the checkpoint's shard files.
    """
    doc = parse_json(folder, METADATA, data)
    try:
        tensors = {}
        for fqn, entry in doc["tensors"].items():
            dtype = _safetensors._BY_NAME[entry["dtype"]]
            size = _dims(entry["size"])
            if (
                not isinstance(entry["chunks"], list) or len(entry["chunks"]) > world_size
            ):  # one piece per process at most
                raise ValueError(
                    f"{fqn!r} is declared in {len(entry['chunks'])} pieces, more than the {world_size} processes that wrote it"
                )
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(_dims(o)), sizes=torch.Size(_dims(s)))
                for o, s in entry["chunks"]
            ]
            check_tiling(fqn, size, chunks)
            tensors[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=chunks
            )
        storage = {}
        for fqn, offset, file, key in doc["storage"]:
            match = _SHARD.fullmatch(file) if isinstance(file, str) else None
            if match is None or int(match.group(1)) >= world_size or not isinstance(key, str) or fqn not in tensors:
                raise ValueError(f"the piece {fqn!r} is stored in {file!r}, not a shard file of this checkpoint")
            storage[MetadataIndex(fqn, None if offset is None else torch.Size(_dims(offset)))] = (file, key)
        for fqn, md in tensors.items():
            for c in md.chunks:
                if MetadataIndex(fqn, c.offsets) not in storage:
                    raise ValueError(f"the piece of {fqn!r} at {list(c.offsets)} is stored nowhere")
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(
            f"{folder}: file {METADATA} does not describe the checkpoint's shards ({type(exc).__name__}: {exc}): refused, nothing changed."
        ) from None
    return Metadata(state_dict_metadata=dict(tensors), storage_data=storage)


#: the largest dimension, and number of elements, a saved tensor may declare (torch indexes with int64)
MAX_ELEMENTS = 1 << 62


def _dims(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_ELEMENTS for v in value
    ):
        raise ValueError(f"{str(value)[:80]} is not a list of non-negative ints below 2**62")
    if math.prod(value) >= MAX_ELEMENTS:
        raise ValueError(f"{value!r} declares {math.prod(value)} elements, more than any tensor can hold")
    return value


def check_tiling(fqn: str, size: list[int], chunks: list[ChunkStorageMetadata]) -> None:
    """The chunks lie inside the tensor and tile it exactly, as a grid: O(N log N) in the number of pieces.

    Every layout torch's DTensor and FSDP write is a grid: along each dimension the
    pieces' intervals partition it, and each non-empty piece is one cell of the
    product of those partitions. Checking that is what makes "no overlap, nothing
    uncovered" cheap (a pairwise overlap test was quadratic: 65 s for 4,000 pieces).
    Empty pieces (a process whose shard is empty) only need to lie inside the tensor.
    """
    rank = len(size)
    cells = set()
    pieces = 0
    for c in chunks:
        offsets, sizes = c.offsets, c.sizes
        if len(offsets) != rank or len(sizes) != rank:
            raise ValueError(f"a piece of {fqn!r} has {len(offsets)} offsets and {len(sizes)} sizes, not {rank}")
        if 0 in sizes:  # an empty piece only needs to lie inside the tensor
            if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise ValueError(f"a piece of {fqn!r} lies outside its shape {size}")
            continue
        cells.add(tuple(zip(offsets, sizes)))
        pieces += 1
    if len(cells) != pieces:
        raise ValueError(f"two pieces of {fqn!r} overlap")
    if math.prod(size) == 0:
        if cells:
            raise ValueError(f"the pieces of {fqn!r} cover elements of an empty tensor")
        return
    # each axis's intervals (a transposition in C): they must partition it, which also keeps every piece inside
    axes = [set(axis) for axis in zip(*cells)] if cells else [set() for _ in range(rank)]
    for d, (axis, length) in enumerate(zip(axes, size)):
        at = 0
        for offset, extent in sorted(axis):
            if offset != at:  # a gap (offset > at) or two intervals that overlap (offset < at)
                raise ValueError(
                    f"the pieces of {fqn!r} do not tile it: along dimension {d}, a piece starts at {offset}, not at {at}"
                )
            at = offset + extent
        if at != length:
            raise ValueError(f"the pieces of {fqn!r} cover {at} of the {length} places along its dimension {d}")
    if len(cells) != math.prod(len(axis) for axis in axes):
        raise ValueError(
            f"the pieces of {fqn!r} do not tile it: {len(cells)} pieces for a grid of {math.prod(len(a) for a in axes)}"
        )


def check_piece(metadata: Metadata, index: MetadataIndex, file: str, piece: torch.Tensor | None) -> torch.Tensor:
    """The piece ``index`` names, as read from ``file``: refused unless it is exactly the chunk the metadata declares there.

    Its shape and dtype must be the chunk's (a piece of half the rows, or of float16 where float32 is declared, would
    leave part of the tensor unwritten or be converted silently); the chunks tile the tensor (``parse_metadata``).
    Load and export both read pieces through this.

    Raises:
        CheckpointError: no such piece, or one of another shape or dtype.
    """
    md = metadata.state_dict_metadata[index.fqn]
    chunk = next((c for c in md.chunks if c.offsets == index.offset), None)  # type: ignore[union-attr]
    if piece is None or chunk is None or tuple(piece.shape) != tuple(chunk.sizes) or piece.dtype != md.properties.dtype:  # type: ignore[union-attr]
        held = "nothing" if piece is None else f"a {piece.dtype} piece of shape {tuple(piece.shape)}"
        want = "no such piece" if chunk is None else f"{md.properties.dtype} of shape {tuple(chunk.sizes)}"  # type: ignore[union-attr]
        raise CheckpointError(
            f"file {file} does not hold the piece of {index.fqn!r} that {METADATA} says it does ({held}; "
            f"declared: {want}): damaged, refused."
        )
    return piece
