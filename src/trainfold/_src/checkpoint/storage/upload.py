"""Writing one object of a store from a file's buffers (a tensor's own memory), as few times copied as the store allows.

S3: one ``PutObject`` for a small file, a multipart upload (:data:`WRITE_THREADS` parts at once) for a large one;
any other store: its filesystem's own writer. Used by ``remote.py``'s staging, which hashes the buffers as they go.
"""

from __future__ import annotations

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


def _parts(chunks: Iterable[Any], size: int) -> Iterator[Any]:
    """The chunks regrouped into parts of ``size`` bytes (the last shorter): slices of a large buffer, joins of small ones."""
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
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, held, yielded = [], 0, True
    if held or not yielded:  # the last, shorter part (or the one empty part of an empty file)
        yield b"".join(pending)


def upload_s3(fs: Any, path: str, chunks: Iterable[Any], what: str) -> int:
    """S3: one ``PutObject`` for a small file; a multipart upload for a large one, :data:`WRITE_THREADS` parts at once.

    The parts are slices of the tensors' own memory where a tensor is at least a
    part long; at most twice :data:`WRITE_THREADS` parts are held at once. A failed
    upload is aborted (its parts are dropped by the store) and raised.
    """
    bucket, key, _ = fs.split_path(path)
    parts = _parts(chunks, WRITE_PART)
    first = next(parts)
    second = next(parts, None)
    if second is None:  # one part: a single request
        call(fs, what, "call_s3", "put_object", Bucket=bucket, Key=key, Body=bytes(first))
        return len(first)
    upload = call(fs, what, "call_s3", "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    size, done, inflight = 0, [], []

    def send(number: int, body: Any) -> dict[str, Any]:
        out = call(
            fs,
            what,
            "call_s3",
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            PartNumber=number,
            Body=bytes(body),
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    try:
        with ThreadPoolExecutor(max_workers=WRITE_THREADS) as pool:
            for number, body in enumerate(_chain(first, second, parts), start=1):
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
