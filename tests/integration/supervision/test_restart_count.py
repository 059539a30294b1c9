"""``fabric.restart_count`` agreed over a real gloo group: under torchrun each agent counts its own restarts (one
that joined late starts at 0), so the ranks take the maximum at launch (one all_reduce; restarts.agree_restart_count)."""
from __future__ import annotations

import os


def _agree_with_counts_that_differ(fabric):
    from fabriclite.supervision.agent.restarts import agree_restart_count

    saved = {k: os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT",
                                             "FABRICLITE_RESTART_COUNT")}
    try:
        os.environ.pop("SLURM_RESTART_COUNT", None)
        os.environ.pop("FABRICLITE_RESTART_COUNT", None)
        os.environ["TORCHELASTIC_RUN_ID"] = "job"
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(2 * fabric.global_rank)  # rank 0's agent joined late
        torchrun = agree_restart_count(fabric.strategy)
        del os.environ["TORCHELASTIC_RUN_ID"]  # not torchrun: no collective, each rank's own (equal) count
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
        os.environ["SLURM_RESTART_COUNT"] = "1"
        slurm = agree_restart_count(fabric.strategy)
        return torchrun, slurm
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_every_rank_gets_the_largest_count_under_torchrun(pool3):
    assert pool3.run(_agree_with_counts_that_differ) == [(4, 1)] * 3
