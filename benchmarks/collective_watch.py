"""What counting a collective costs: ``CollectiveWatch.enter`` per call, the bookkeeping every collective of a
DDP-family strategy pays (its publisher thread is not started here, as in a job between two publications).

    python benchmarks/collective_watch.py [--calls 100000] [--repeats 5]

writes benchmarks/results/collective_watch.md (``--results PATH`` elsewhere).

Prints the best and median time per call over ``--repeats`` runs of ``--calls`` calls, with the load average (the
number is only meaningful on a quiet machine; it was a test's assertion, < 5 us, before it moved here, since a
wall-clock bound per call fails on a loaded machine whatever the code does).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(__file__))
from common import Results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/collective_watch.md)")
    args = parser.parse_args()
    results = Results("collective_watch")

    from fabriclite.distributed import rendezvous
    from fabriclite.distributed.control_plane import meeting
    from fabriclite.supervision.rank.collective_watch import CollectiveWatch

    server = rendezvous.host_store("127.0.0.1", 0, timedelta(seconds=10))
    store = meeting.job_view(server)
    per_call = []
    for _ in range(args.repeats):
        watch = CollectiveWatch(store, rank=0, world_size=2, timeout_s=60)
        start = time.perf_counter()
        for _ in range(args.calls):
            watch.enter("all_reduce", None, None)
        per_call.append((time.perf_counter() - start) / args.calls)
    text = (f"CollectiveWatch.enter: best {min(per_call) * 1e6:.2f} us, median "
            f"{statistics.median(per_call) * 1e6:.2f} us per call ({args.repeats} x {args.calls} calls)")
    print(text)
    results.write(text, path=args.results)


if __name__ == "__main__":
    main()
