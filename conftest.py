"""pytest set-up shared by the tests and the docstring examples."""

import os
import shutil
import tempfile

import pytest
import torch

import trainfold
from trainfold import testing


_TRACKIO_DIR = []


def pytest_configure(config):
    """Trackio's local store in a folder of this session's (it reads ``TRACKIO_DIR`` once, at import), never the user's."""
    if "TRACKIO_DIR" not in os.environ:
        _TRACKIO_DIR.append(tempfile.mkdtemp(prefix="trainfold-tests-trackio-"))
        os.environ["TRACKIO_DIR"] = _TRACKIO_DIR[-1]


def pytest_unconfigure(config):
    """Remove the session's Trackio store."""
    for folder in _TRACKIO_DIR:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def isolated():
    """Every test starts with fresh Accelerate process state (it is process-wide)."""
    with testing.isolated_accelerate():
        yield


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """Docstring examples see the public API as `from trainfold import *` gives it, and torch."""
    doctest_namespace.update({name: getattr(trainfold, name) for name in trainfold.__all__})
    doctest_namespace["torch"] = torch


@pytest.fixture(autouse=True)
def _no_lease_outlives_its_test():
    """A Context a test leaves open on a store renews its root's lease from a thread, after the test's server is gone
    ("renewing the lock ... failed" printed after the run): stop the renewals with the test (the thread only: the
    server may be gone, and the lock object with it)."""
    yield
    from trainfold._src.checkpoint.storage import lease

    for url, (lock, _) in list(lease._HELD.items()):
        lock._stop.set()
        del lease._HELD[url]
