"""trainfold's version, in one place: ``trainfold.__version__`` re-exports it, and the packaging reads it from here.

Until a release, the version is a development release of the next one (PEP 440: ``0.1.0.dev0``), and
CHANGELOG.md's ``[Unreleased]`` section says which release it becomes; tests/test_release.py keeps the two agreeing.
"""

__version__ = "0.1.0.dev0"
