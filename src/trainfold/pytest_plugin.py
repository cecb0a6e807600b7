"""trainfold's pytest plugin: installing trainfold gives a user's tests the ``isolated`` fixture.

Registered as the ``pytest11`` entry point ``trainfold``; pytest loads it at start-up.
It imports nothing of trainfold, torch or Accelerate until a test asks for the fixture.
"""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture
def isolated() -> Iterator[None]:
    """Fresh Accelerate process state for the test, reset again after it (:func:`trainfold.testing.isolated_accelerate`).

    Accelerate keeps its state per process: a test that builds an Accelerator with
    other settings than an earlier test's needs it. Use it by name, or make it
    apply to every test of a module with ``pytestmark = pytest.mark.usefixtures("isolated")``.
    """
    from trainfold.testing import isolated_accelerate

    with isolated_accelerate():
        yield
