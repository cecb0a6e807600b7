"""trainfold's implementation, private: any module here may move or change without notice.

The public API is ``trainfold`` (its ``__all__``), ``trainfold.testing``, the ``trainfold``
command line and the pytest plugin. The folders below are layers, each importing only
those before it: base, backend, distributed, core, checkpoint, compose (see the
architecture guide).
"""
