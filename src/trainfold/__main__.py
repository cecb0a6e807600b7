"""``python -m trainfold``: the checkpoint command line (:mod:`trainfold.cli`)."""

from .cli import main

raise SystemExit(main())
