"""Writing one object of a store from a file's buffers (a tensor's own memory), as few times copied as the store allows.

S3: one ``PutObject`` for a small file, a multipart upload (:data:`WRITE_THREADS` parts at once) for a large one;
any other store: its filesystem's own writer. Used by ``remote.py``'s staging, which hashes the buffers as they go.
"""

from __future__ import annotations

import bisect
import io
import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator

from trainfold._src.checkpoint.storage.requests import call

#: a multipart upload's part (S3 takes 5 MiB to 5 GiB), and how many are uploaded at once
WRITE_PART = 16 << 20
WRITE_THREADS = 8


def upload(fs: Any, path: str, chunks: Iterable[Any]) -> int:
    """Any fsspec store: the filesystem's own writer."""
    size = 0
    with fs.open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            size += memoryview(chunk).nbytes
    return size


def _parts(chunks: Iterable[Any], size: int) -> Iterator[list[memoryview]]:
    """The chunks regrouped into parts of ``size`` bytes (the last shorter), each the list of the slices of the chunks'
    memory it is made of: nothing is copied (the chunks are views that stay valid, as ``safetensors.encode`` gives)."""
    pending: list[memoryview] = []
    held, yielded = 0, False
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while len(view):
            take = min(size - held, len(view))
            pending.append(view[:take])
            held += take
            view = view[take:]
            if held == size:
                yield pending
                pending, held, yielded = [], 0, True
    if held or not yielded:  # the last, shorter part (or the one empty part of an empty file)
        yield pending


class PartBody(io.RawIOBase):
    """A part's bytes as a read-only, seekable file over the memory they lie in (slices of the tensors' own buffers):
    botocore and the HTTP client read it a chunk at a time, so no part is copied whole, however many are queued; a
    retry seeks back to its start."""

    def __init__(self, pieces: list[memoryview]) -> None:
        super().__init__()
        self._pieces, self._at = pieces, 0
        self._starts = list(itertools.accumulate((len(p) for p in pieces), initial=0))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out, filled = memoryview(buffer).cast("B"), 0
        i = bisect.bisect_right(self._starts, self._at) - 1
        while filled < len(out) and i < len(self._pieces):
            piece = self._pieces[i][self._at - self._starts[i] :]
            n = min(len(piece), len(out) - filled)
            out[filled : filled + n] = piece[:n]
            filled, self._at = filled + n, self._at + n
            i += 1
        return filled

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def __len__(self) -> int:
        return self._starts[-1]


def upload_s3(fs: Any, path: str, chunks: Iterable[Any], what: str) -> int:
    """S3: one ``PutObject`` for a small file; a multipart upload for a large one, :data:`WRITE_THREADS` parts at once.

    The parts are read from the tensors' own memory (:class:`PartBody`): an upload
    copies nothing but what the HTTP client sends a chunk at a time. A failed
    upload is aborted (its parts are dropped by the store) and raised.
    """
    bucket, key, _ = fs.split_path(path)
    parts = _parts(chunks, WRITE_PART)
    first = next(parts)
    second = next(parts, None)
    if second is None:  # one part: a single request
        body = PartBody(first)
        call(fs, what, "call_s3", "put_object", Bucket=bucket, Key=key, Body=body)
        return len(body)
    upload = call(fs, what, "call_s3", "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    size, done, inflight = 0, [], []

    def send(number: int, body: PartBody) -> dict[str, Any]:
        out = call(
            fs,
            what,
            "call_s3",
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    try:
        with ThreadPoolExecutor(max_workers=WRITE_THREADS) as pool:
            for number, pieces in enumerate(_chain(first, second, parts), start=1):
                body = PartBody(pieces)
                size += len(body)
                inflight.append(pool.submit(send, number, body))
                if len(inflight) >= 2 * WRITE_THREADS:
                    done.append(inflight.pop(0).result())
            done += [f.result() for f in inflight]
        call(
            fs,
            what,
            "call_s3",
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            MultipartUpload={"Parts": done},
        )
    except BaseException:
        _abort(fs, bucket, key, upload, inflight)
        raise
    return size


def _chain(first: Any, second: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield second
    yield from rest


def _abort(fs: Any, bucket: str, key: str, upload: str, inflight: list[Future[Any]]) -> None:
    for f in inflight:
        f.cancel()
    try:
        call(fs, "aborting an upload", "call_s3", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
    except (
        OSError
    ):  # the store unreachable: an unfinished upload is dropped by the bucket's lifecycle rules, never listed
        pass
