"""One version, agreed: trainfold.__version__ (src/trainfold/_version.py), the packaging's metadata, and CHANGELOG.md."""

import re
from importlib import metadata
from pathlib import Path

from packaging.version import Version

import trainfold

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_pep_440_and_the_installed_metadata_carries_it():
    version = Version(trainfold.__version__)

    assert str(version) == trainfold.__version__
    assert metadata.version("trainfold") == trainfold.__version__


def test_the_changelog_agrees_with_the_version():
    """A `.devN` version: the changelog's [Unreleased] section names the release it becomes, and no section claims it is out.
    A release: its `## [X.Y.Z] - date` section is the newest."""
    text = (ROOT / "CHANGELOG.md").read_text()
    version = Version(trainfold.__version__)
    released = re.findall(r"^## \[(\d[^\]]*)\]", text, re.M)

    if version.is_devrelease:
        unreleased = text[text.index("## [Unreleased]") :]
        assert f"**{version.base_version}**" in unreleased.split("\n### ")[0]
        assert version.base_version not in released
    else:
        assert released and released[0] == str(version)


def test_no_docstring_names_a_version_after_this_one():
    """A `versionadded`/`versionchanged`/`deprecated` note, or a "before X.Y", naming a version after this one is false."""
    version = Version(Version(trainfold.__version__).base_version)
    for path in (ROOT / "src" / "trainfold").rglob("*.py"):
        for named in re.findall(
            r"(?:\.\. (?:versionadded|versionchanged|deprecated)::|\bbefore) ([0-9]+\.[0-9.]*[0-9])", path.read_text()
        ):
            assert Version(named) <= version, f"{path.relative_to(ROOT)} names version {named}, after {version}"
