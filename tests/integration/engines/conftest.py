"""Engine lanes are collected only inside their own run: ``FABRICLITE_ENGINE=<lane>`` (set by
``make test-engine-<lane>``) selects ``tests/integration/engines/lane_<lane>``; the main run (``pytest tests``)
collects none of them."""
import os

_LANES = ("slurm", "torchrun", "ray")
_lane = os.environ.get("FABRICLITE_ENGINE", "")

# folders are named lane_<lane>, not <lane>: a folder named like a package (ray) would shadow it
collect_ignore = [f"lane_{lane}" for lane in _LANES if lane != _lane]
