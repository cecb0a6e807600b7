"""The README's and the guides' code runs as written.

The README's snippets and those of the guides in docs/guides/, in the site's order (mkdocs.yml's nav), run as cells
of one notebook: the README's first snippet defines the data, model and loss the later ones use. Two guides are
test files and programs of their own: testing.md (a user's test file, run by pytest) and embedding.md (each snippet a
script).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import helpers

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = ROOT / "docs" / "guides"
#: Guides whose snippets are not notebook cells: each has its own test below.
APART = ("testing.md", "embedding.md")


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def guides_in_site_order():
    """The guides as mkdocs.yml's nav lists them (the order a reader meets them)."""
    return [
        ROOT / "docs" / name
        for name in re.findall(r"^\s+- [^:\n]+: (guides/[\w-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    ]


def test_the_site_lists_every_guide_once():
    assert sorted(guides_in_site_order()) == sorted(GUIDES.glob("*.md"))


_RUNNER = """
import re, sys
from accelerate.state import AcceleratorState, GradientState

namespace = {"__name__": "readme"}
count = 0
for path in sys.argv[1:]:
    for i, block in enumerate(re.findall(r"```python\\n(.*?)```", open(path).read(), re.S)):
        if "the docs test skips this one" in block.splitlines()[0]:
            continue
        if count > 0 and "Accelerator(" in block:  # a snippet that makes its own Accelerator: Accelerate's state is process-wide
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        print(f"--- {path} snippet {i + 1}", flush=True)
        exec(compile(block, f"{path} snippet {i + 1}", "exec"), namespace)
        count += 1
print("all snippets ran", count)
"""


def test_the_readme_and_the_guides_run_in_order_as_written(tmp_path):
    """Every ```python block of the README and then of each guide, in the site's order, in one namespace (cells of one
    notebook), in a fresh process whose working directory is empty; the DeepSpeed, peft and Ray ones are skipped (their
    first lines say so)."""
    (tmp_path / "run_docs.py").write_text(_RUNNER)
    files = [README, *(g for g in guides_in_site_order() if g.name not in APART)]

    done = subprocess.run(
        [sys.executable, "run_docs.py", *map(str, files)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=helpers.scaled(600),
    )

    assert 0 == done.returncode, done.stdout[-2000:] + done.stderr[-4000:]
    ran = int(done.stdout.rsplit("all snippets ran", 1)[1])
    skipped = [b for f in files for b in _blocks(f) if "the docs test skips this one" in b.splitlines()[0]]
    assert len(skipped) == 3  # the DeepSpeed one, the peft one and the Ray one
    assert ran == sum(len(_blocks(f)) for f in files) - len(skipped)


def test_each_snippet_of_the_embedding_guide_runs_on_its_own(tmp_path):
    for i, block in enumerate(_blocks(GUIDES / "embedding.md")):
        script = tmp_path / f"snippet{i}.py"
        script.write_text(block)
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=helpers.scaled(600)
        )
        assert 0 == done.returncode, f"docs/guides/embedding.md snippet {i + 1}:\n{done.stderr[-3000:]}"


def test_the_testing_guide_passes(tmp_path):
    """The testing guide's snippets are a user's test file: together, under pytest, every test in them passes, the
    `isolated` fixture coming from trainfold's pytest plugin (an entry point), no conftest."""
    blocks = _blocks(GUIDES / "testing.md")
    (tmp_path / "test_from_docs.py").write_text("\n\n".join(blocks))
    expected = sum(block.count("\ndef test_") + block.startswith("def test_") for block in blocks)

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_from_docs.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=helpers.scaled(600),
    )

    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert expected >= 2 and f"{expected} passed" in done.stdout
