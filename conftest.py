"""pytest set-up shared by the tests and the docstring examples."""

import pytest
import torch

import trainfold
from trainfold import testing


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
