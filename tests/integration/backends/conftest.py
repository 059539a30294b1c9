"""Backend lanes are collected only inside their own environment: ``FABRICLITE_LANE=<lane>`` (set by
``make test-<lane>``) selects ``tests/integration/backends/lane_<lane>``; the main run (``pytest tests``) collects none of them."""
import os

_LANES = ("horovod", "xla", "mpi", "ft", "data")
_lane = os.environ.get("FABRICLITE_LANE", "")

# folders are named lane_<lane>, not <lane>: a folder named like the package (horovod) would shadow it
collect_ignore = [f"lane_{lane}" for lane in _LANES if lane != _lane]
