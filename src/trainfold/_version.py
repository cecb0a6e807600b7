"""trainfold's version, in one place: ``trainfold.__version__`` re-exports it, and the packaging reads it from here."""

__version__ = "0.1.0"
