"""Not imported: this folder holds the ``sitecustomize`` that a supervisor puts first on its ranks' ``PYTHONPATH``
(see supervision/watch/stacks.py); the ``__init__`` makes it part of the installed package."""
