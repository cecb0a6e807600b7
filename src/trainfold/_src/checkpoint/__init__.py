"""Checkpoints that cannot lie: the save and load protocol over formats (what the bytes are) and storages (where they go).

It imports the core and below; the composition layer uses it (``checkpoint_every``,
the loop's last save, ``fit``).
"""
