"""``python -m trainfold``: the checkpoint command line (:mod:`trainfold.cli`)."""

from trainfold.cli import main

raise SystemExit(main())
