"""Lightning's ``lightning.fabric.utilities.throughput`` path (re-exports of fabriclite.training.throughput_monitor)."""
from fabriclite.training.throughput_monitor import Throughput  # noqa: F401
from fabriclite.training.throughput_monitor import ThroughputMonitor  # noqa: F401
from fabriclite.training.throughput_monitor import measure_flops  # noqa: F401
from fabriclite.training.throughput_monitor import get_available_flops  # noqa: F401
