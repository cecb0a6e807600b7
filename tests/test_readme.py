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
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)

    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout


_RUNNER = '''
import re, sys
from accelerate.state import AcceleratorState, GradientState

text = open(sys.argv[1]).read()
blocks = re.findall(r"```python\\n(.*?)```", text, re.S)
namespace = {"__name__": "readme"}
for i, block in enumerate(blocks):
    if "the README test skips this one" in block.splitlines()[0]:
        continue
    if i > 0 and "Accelerator(" in block:  # a snippet that makes its own Accelerator: Accelerate's state is process-wide
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    print(f"--- snippet {i + 1}", flush=True)
    exec(compile(block, f"README.md snippet {i + 1}", "exec"), namespace)
print("all snippets ran", len(blocks))
'''


def test_every_readme_snippet_runs_in_order_as_written(tmp_path):
    """Every ```python block of the README, in order, in one namespace (as cells of one notebook), in a fresh
    process whose working directory is empty; the DeepSpeed one is skipped (it says so in its first line)."""
    (tmp_path / "run_readme.py").write_text(_RUNNER)

    done = subprocess.run([sys.executable, "run_readme.py", str(README)], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    assert 0 == done.returncode, done.stdout[-2000:] + done.stderr[-4000:]
    assert "all snippets ran" in done.stdout


DOCS = README.parent / "docs"


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_each_snippet_of_docs_embedding_runs_on_its_own(tmp_path):
    for i, block in enumerate(_blocks(DOCS / "embedding.md")):
        script = tmp_path / f"snippet{i}.py"
        script.write_text(block)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert 0 == done.returncode, f"docs/embedding.md snippet {i + 1}:\n{done.stderr[-3000:]}"


def test_the_tests_of_docs_testing_pass_as_a_test_file(tmp_path):
    """docs/testing.md's snippets are a user's test file: together, under pytest, every test in them passes."""
    blocks = _blocks(DOCS / "testing.md")
    (tmp_path / "test_from_docs.py").write_text("\n\n".join(blocks))
    expected = sum(block.count("\ndef test_") + block.startswith("def test_") for block in blocks)

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_from_docs.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)

    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{expected} passed" in done.stdout
