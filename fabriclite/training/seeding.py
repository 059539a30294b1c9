"""Seeding: ``seed_everything`` for python / numpy / torch, and the ``worker_init_fn`` that gives every
DataLoader worker of every rank its own reproducible seeds.

The seed is also written to the environment under Lightning's names (``PL_GLOBAL_SEED``,
``PL_SEED_WORKERS``), so processes started later inherit it and scripts mixing the two agree.
"""
from __future__ import annotations

import logging
import os
import random
import warnings
from typing import List, Optional

import torch

from fabriclite.environments.process_rank import current_rank, rank_from_env

log = logging.getLogger(__name__)
SEED_ENV = "PL_GLOBAL_SEED"
SEED_WORKERS_ENV = "PL_SEED_WORKERS"
_MAX_SEED = 2**32 - 1


def seed_everything(seed: Optional[int] = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed python's ``random``, numpy and torch (all devices) with ``seed`` and return it.

    ``seed=None`` reads ``$PL_GLOBAL_SEED`` (0 when unset, with a warning on rank 0 when ``verbose``).
    ``workers=True`` makes ``setup_dataloaders`` add ``worker_init_fn`` to loaders that have none, so that worker
    ``w`` of rank ``r`` gets seeds that differ across (rank, worker) and repeat run after run. The distributed sampler's
    shuffling seed is this seed too. ValueError for a seed outside 0 .. 2**32-1.
    """
    if seed is None:
        raw = os.environ.get(SEED_ENV)
        if raw is None:
            seed = 0
            if verbose and current_rank() == 0:  # Lightning's rank_zero_warn, its message
                warnings.warn(f"No seed found, seed set to {seed}", stacklevel=2)
        else:
            try:
                seed = int(raw)
            except ValueError:
                raise ValueError(f"${SEED_ENV}={raw!r} is not an integer seed.") from None
    if isinstance(seed, bool) or not isinstance(seed, int):
        try:
            seed = int(seed)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise TypeError(f"seed={seed!r} must be an integer in 0..{_MAX_SEED}.") from None
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed} is out of range; expected an integer in 0..{_MAX_SEED} (numpy's limit).")
    if verbose:
        env_rank = rank_from_env()  # Lightning's message: "[rank: r] " when the environment names a rank
        log.info("%sSeed set to %d", "" if env_rank is None else f"[rank: {env_rank}] ", seed)
    os.environ[SEED_ENV] = str(seed)
    os.environ[SEED_WORKERS_ENV] = str(int(bool(workers)))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    torch.manual_seed(seed)
    return seed


def global_seed(default: int = 0) -> int:
    """The seed ``seed_everything`` set (``default`` when it was not called)."""
    raw = os.environ.get(SEED_ENV)
    return int(raw) if raw is not None and raw.strip().lstrip("-").isdigit() else default


def seed_workers_enabled() -> bool:
    """Whether ``seed_everything(..., workers=True)`` was called."""
    return os.environ.get(SEED_WORKERS_ENV) == "1"


def worker_init_fn(worker_id: int, rank: int = 0) -> None:
    """Seed python / numpy / torch in DataLoader worker ``worker_id`` of global rank ``rank``.

    The seeds derive from (the loader's per-epoch base seed, worker id, rank): distinct for every
    (rank, worker) pair and every epoch, and the same when the run is repeated with the same seed.
    Pass it as ``functools.partial(worker_init_fn, rank=rank)``.
    """
    base_seed = torch.initial_seed() - worker_id  # torch gives worker w the seed base + w
    seeds = _seed_sequence(base_seed, worker_id, rank, 4)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    try:
        import numpy as np

        np.random.seed(np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4))
    except ImportError:  # pragma: no cover
        pass


def _seed_sequence(base_seed: int, worker_id: int, rank: int, count: int) -> List[int]:
    """``count`` well-mixed 64-bit seeds from (base_seed, worker_id, rank) (murmur3 finaliser + LCG)."""
    mask = (1 << 64) - 1
    x = ((base_seed << 32) ^ (worker_id << 16) ^ rank) & mask
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & mask
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & mask
    x ^= x >> 33
    out = []
    for _ in range(count):
        x = (x * 6364136223846793005 + 1) & mask
        out.append(x)
    return out
