"""The parts of benchmarks/control_plane.py, the scale model of the control plane: a sandbox to run in (sandbox),
the store in a process of its own (store_host), the event loop that drives many simulated nodes from a few threads
(loop), the worker processes that hold the nodes (workers), the fabriclite side (fabric_nodes) and the anchor,
torchelastic's dynamic rendezvous (elastic_nodes)."""
