"""Durable file writes and whole reads: fsynced files, atomic replacement, a file read once into memory of its own."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import secrets
import shutil
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def staged_beside(target: Path, folder: bool = False) -> Iterator[Path]:
    """A new file (or ``folder``) beside ``target``, named ``.<name>.<random>.tmp``, removed if the block raises.

    The name is made inside the block that removes it: a signal that lands the
    moment it exists (a Ctrl-C, SIGTERM raised as SystemExit) removes it too
    (``tempfile.mkstemp`` returns the name only after making it, and a signal
    between the two left the file behind). The caller renames it into place.
    """
    tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    made = False
    try:
        if folder:  # the modes of any new file or folder (the umask applies): readable by whom the user's files are
            os.mkdir(tmp, 0o777)
        else:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666))
        made = True
        yield tmp
    except BaseException as e:
        if made or not isinstance(e, FileExistsError):  # never remove a name someone else made
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    A crash at any moment leaves either the old file or the new one, never a
    partial one; the temporary file is removed on error or on a signal.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with staged_beside(target) as tmp:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, target)
    fsync_dir(target.parent)
    return target


def write_durably(
    path: str | os.PathLike[str], chunks: Iterable[Any], seen: Callable[[Any], Any] = lambda chunk: None
) -> int:
    """Write ``chunks`` (buffers) to ``path`` and fsync it; ``seen`` is given each chunk as it is written (a hasher's update).

    Returns the number of bytes written. Raises OSError when a write fails (a full disk: ENOSPC).
    """
    size = 0
    # never through a link: a name swapped for a symbolic link fails (ELOOP) instead of writing where it points
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644
    )
    with os.fdopen(fd, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            seen(chunk)
            size += memoryview(chunk).nbytes
        f.flush()
        os.fsync(f.fileno())
    return size


def read_into(
    path: str | os.PathLike[str], size: int, seen: Callable[[memoryview], object] | None = None
) -> bytearray | mmap.mmap:
    """The file's ``size`` bytes, read once into memory of their own (an anonymous map), no link followed;
    ``seen`` (a hasher's update) is given them in order, each part as soon as it is read, while it is still in the
    processor's cache.

    What the caller hashes is what it uses: a copy, which no later write to the
    file (overwritten in place, truncated, removed) can change or take away (a
    map of the file itself would show a rewrite made after the hash was taken,
    and die of SIGBUS on a truncated file). The buffer starts at a page boundary,
    so a tensor at an aligned offset of the file is aligned in it too. A large file
    is read by two threads, part after part, and ``seen`` runs on the caller's
    thread meanwhile: hashing overlaps the reading instead of following it.

    Raises:
        ValueError: the file does not have ``size`` bytes (it changed since it was measured, or while it was read),
            or is not a regular file (a FIFO, a device).
        FileNotFoundError: the file is gone.
    """
    # non-blocking: a FIFO or a device in a file's place is refused here, not waited on (no effect on a regular file)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if info.st_size != size:
            raise ValueError(f"{path} has another size than {size} bytes")
        if size == 0:
            return bytearray()
        buf = mmap.mmap(-1, size)
        view = memoryview(buf)
        try:
            parts = [(start, min(start + READ_PART, size)) for start in range(0, size, READ_PART)]
            if len(parts) == 1:
                _read_part(fd, view, 0, size, path)
                if seen is not None:
                    seen(view)
            else:  # two threads read part after part; each part is seen, in order, as soon as it is read
                with ThreadPoolExecutor(max_workers=2) as pool:
                    for start, end in pool.map(lambda part: _read_part(fd, view, part[0], part[1], path), parts):
                        if seen is not None:
                            seen(view[start:end])
            if os.pread(fd, 1, size):
                raise ValueError(f"{path} grew past {size} bytes while it was read")
        finally:
            view.release()
        return buf
    finally:
        os.close(fd)


def release_pages(address: int, size: int, keep: Iterable[tuple[int, int]] = ()) -> None:
    """Hand back to the system the whole pages of ``size`` bytes at ``address`` (Linux's ``MADV_DONTNEED``): their
    memory is freed, and reads of it see zeros. For the caller's own anonymous memory whose bytes it will not read
    again. Pages that overlap a span of ``keep`` (address, size) are kept; elsewhere than Linux nothing is done.
    """
    if not sys.platform.startswith("linux") or size <= 0:
        return
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + size) // page * page
    for other, length in keep:
        if other < end and start < other + length:
            return
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


_MADV_DONTNEED = 4  # Linux's value on every architecture


@functools.cache
def _libc() -> Any:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


#: how much of a file :func:`read_into` reads at a time: a part is still in the cache (L3) when it is hashed
READ_PART = 8 << 20


def _read_part(fd: int, view: memoryview, start: int, end: int, path: object) -> tuple[int, int]:
    """Read bytes ``start:end`` of the file ``fd`` into the same bytes of ``view``; return ``(start, end)``."""
    done = start
    while done < end:
        n = os.preadv(fd, [view[done:end]], done)
        if n == 0:
            raise ValueError(f"{path} ended after {done} bytes, before {end}")
        done += n
    return start, end


#: where torch's CPU allocator puts every tensor (c10's alignment, for AVX-512)
ALIGNMENT = 64
