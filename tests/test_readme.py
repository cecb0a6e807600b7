"""The README's code runs as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # spawns processes: run serially, not under pytest-xdist

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_test_snippet_runs_with_the_isolated_fixture_trainfold_installs(tmp_path):
    """`def test_my_step(isolated)`: the fixture comes from trainfold's pytest plugin (an entry point), no conftest."""
    (tmp_path / "test_from_readme.py").write_text(_snippet_after("## Testing your own steps"))

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_from_readme.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)

    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout
