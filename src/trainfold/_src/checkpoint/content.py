"""A save's files as content, written into a staging, and tensor files parsed back: the torch side of a checkpoint's files.

A file's content is JSON bytes or the tensors of a safetensors file (:data:`Content`);
:func:`write_files` writes a save's files durably and returns their manifest entries,
and :func:`parse_tensors` reads a verified safetensors file's bytes back as tensors.
The names, the manifest and verified reading are ``manifest.py``'s (no torch there).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping, Union

import torch

from trainfold._src.checkpoint import safetensors as _safetensors
from trainfold.errors import CheckpointError

if TYPE_CHECKING:
    from trainfold._src.checkpoint.storage.protocol import Staging

#: A file's content before it is written: JSON bytes, or the tensors of a safetensors file.
Content = Union[bytes, Mapping[str, torch.Tensor]]


def chunks_of(content: Content) -> list[Any]:
    """The buffers a file is written from: JSON bytes as they are, tensors as a safetensors file (from their own memory)."""
    return [content] if isinstance(content, bytes) else _safetensors.encode(content)


def write_files(staging: Staging, files: Mapping[str, Content]) -> dict[str, dict[str, Any]]:
    """Write every file (durably, two at a time) and return their manifest entries, hashed as written."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(staging.write, name, chunks_of(content)) for name, content in files.items()}
        return {name: future.result() for name, future in futures.items()}


def parse_tensors(folder: object, name: str, data: Any) -> dict[str, torch.Tensor]:
    try:
        return _safetensors.parse(data)
    except _safetensors.FormatError as exc:
        raise CheckpointError(f"{folder}: file {name} is not a readable safetensors file ({exc}).") from None
