"""Requests to an fsspec store, each bounded in time and each failure an ``OSError`` that says what was being done.

A store that stops answering (a server gone, a network partition) must fail a
save, on every process, in bounded time: a job that hangs in an upload loses
more than the one checkpoint. botocore's own timeouts bound connecting and
reading, not sending a body to a server that stopped reading it, so every
request of an asynchronous filesystem (s3fs, gcsfs, adlfs) runs under fsspec's
``timeout``, which cancels it: :data:`REQUEST_TIMEOUT_S`, a request's whole time.
"""

from __future__ import annotations

import errno
from typing import Any, Callable, TypeVar

from trainfold.errors import CheckpointError

#: the longest one request to a store may take (a part of an upload is at most ``upload.WRITE_PART`` bytes)
REQUEST_TIMEOUT_S = 120.0

_T = TypeVar("_T")


def guarded(what: str, fn: Callable[[], _T]) -> _T:
    """``fn()``, its failure an ``OSError`` that says what was being done (a ``CheckpointError`` passes as it is)."""
    try:
        return fn()
    except TimeoutError:  # fsspec's FSTimeoutError: the request was cancelled
        raise OSError(
            errno.ETIMEDOUT, f"{what} failed: the store did not answer within {REQUEST_TIMEOUT_S:.0f} s"
        ) from None
    except (CheckpointError, OSError):
        raise
    except Exception as exc:  # botocore's and the other stores' own errors, fsspec's timeout: a failed request
        raise OSError(errno.EIO, f"{what} failed: {type(exc).__name__}: {exc}{_advice(exc)}") from exc


def call(fs: Any, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """``fs.<method>(*args, **kwargs)``, bounded by :data:`REQUEST_TIMEOUT_S` on an asynchronous filesystem, guarded."""
    if getattr(fs, "async_impl", False):
        kwargs["timeout"] = REQUEST_TIMEOUT_S
    return guarded(what, lambda: getattr(fs, method)(*args, **kwargs))


def protocol_of(fs: Any) -> str:
    """The filesystem's protocol (``s3``, ``memory``...): its first name where it has several."""
    protocol = fs.protocol
    return str(protocol[0] if isinstance(protocol, (tuple, list)) else protocol)


def _advice(exc: Exception) -> str:
    name = type(exc).__name__
    if "Credentials" in name:
        return (
            " (no credentials found: set the provider's usual variables, such as AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, a profile, or pass storage_options={'key': ..., 'secret': ...})"
        )
    if "Timeout" in name:
        return f" (the store did not answer within {REQUEST_TIMEOUT_S:.0f} s)"
    if "Endpoint" in name or "Connect" in name:
        return " (the store cannot be reached: check its URL, endpoint_url and the network)"
    return ""
