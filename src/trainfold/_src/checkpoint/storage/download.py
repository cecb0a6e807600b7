"""Reading a range of one object of a store into its place in a buffer, with no copy of the range on the way.

S3: a ranged ``GetObject`` whose body is streamed into the buffer a mebibyte at a time; any other store: its
filesystem's ``cat_file`` of the range (a copy of the range, then into the buffer). ``remote.py`` reads an object
as such ranges in parallel, so with S3 a load holds the buffer and a few mebibytes, not a copy of every range in
flight beside it.
"""

from __future__ import annotations

from typing import Any

from trainfold._src.checkpoint.storage.requests import REQUEST_TIMEOUT_S, call, guarded, protocol_of

#: how much of a ranged read's body is taken at a time
STREAM_CHUNK = 1 << 20


def read_range(fs: Any, path: str, start: int, end: int, into: memoryview, what: str) -> int:
    """Read bytes ``start:end`` of the object ``path`` into ``into`` (``end - start`` bytes long, or one byte shorter:
    a range may ask one byte past the expected end, to find an object that is longer) and return how many bytes the
    store sent; never more than ``into`` holds is written."""
    if protocol_of(fs) in ("s3", "s3a"):
        from fsspec.asyn import sync

        bucket, key, version = fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        return int(
            guarded(
                what,
                lambda: sync(fs.loop, _stream_s3, fs, bucket, key, start, end, into, extra, timeout=REQUEST_TIMEOUT_S),
            )
        )
    data = call(fs, what, "cat_file", path, start=start, end=end)
    into[: min(len(data), len(into))] = data[: len(into)]
    return len(data)


async def _stream_s3(
    fs: Any, bucket: str, key: str, start: int, end: int, into: memoryview, extra: dict[str, Any]
) -> int:
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)
    body, sent = response["Body"], 0
    try:
        while chunk := await body.read(STREAM_CHUNK):
            room = max(0, len(into) - sent)
            into[sent : sent + min(room, len(chunk))] = chunk[:room]
            sent += len(chunk)
    finally:
        body.close()
    return sent
