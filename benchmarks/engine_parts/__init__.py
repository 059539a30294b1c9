"""The parts of each engine's recovery, one module per engine (slurm, torchrun, ray), for benchmarks/engines.py.

Each module exposes ``available() -> Optional[str]`` (None when the engine can run here, else why not, one line)
and ``measure(repeats: int) -> Dict[str, List[float]]``: the recovery's parts in order (part name -> seconds,
one value per repeat), e.g. ``{"signal -> saved": [...], "saved -> requeued": [...], ...}``."""
