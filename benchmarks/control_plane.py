"""The control plane at scale, by simulation: fabriclite's store protocol, open and behind the job secret's relay,
against torchelastic's dynamic rendezvous, from 16 to 4,096 simulated nodes, each side on its own real libuv
TCPStore in a process of its own.

    python benchmarks/control_plane.py [--nodes 16,256,1024,4096] [--sides fabriclite,fabriclite-secret,torchelastic]
                                       [--cap 600] [--plot docs/control_plane.png]

Sides: ``fabriclite`` (no secret: every connection straight to the store), ``fabriclite-secret`` (the same protocol,
each simulated node reaching the store through a real ``store_relay.RelayClient`` and node 0's real
``RelayServer``, every connection proving the secret first; control_plane_parts/store_host.py), ``torchelastic``.

Runs inside a network namespace of its own (root; see control_plane_parts/sandbox.py). Each simulated node has
one connection for its supervisor (torchrun's agent, for the anchor); fabriclite's simulated ranks (8 per node)
get their own connections while the open-files limit and the ephemeral ports allow, and beyond that share fewer
connections at the same request rate (the results say how many). Nodes are dealt over a few worker processes
(node 0 alone in one, so its CPU time is node 0's supervisor's), each driving its nodes' chains of store requests
from a small thread pool (control_plane_parts/loop.py). What each side runs is its real protocol code: fabriclite's
fabriclite/distributed/control_plane modules, torchelastic's DynamicRendezvousHandler.

Writes benchmarks/results/control_plane.md (``--results PATH`` elsewhere) and, with ``--plot``, the times
against N.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, Results  # noqa: E402
from control_plane_parts import sandbox  # noqa: E402

SIDES = ("fabriclite", "fabriclite-secret", "torchelastic")


def rank_connections(nodes: int, ranks_per_node: int, relayed: bool = False) -> int:
    """Connections per node for the ranks: their own (``ranks_per_node``) while every connection fits in the
    open-files limit and the ephemeral ports (with room to spare), else as many as fit, at least 1. ``relayed``:
    node 0's relay holds two files per connection (the node's and its own to the store)."""
    budget = min(sandbox.open_files_limit() // (2 if relayed else 1), sandbox.ephemeral_ports()) - 1000
    return max(1, min(ranks_per_node, (budget - nodes) // nodes))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="16,256,1024,4096", help="simulated node counts, comma-separated")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--cap", type=float, default=600.0, help="seconds per N and side")
    parser.add_argument("--rates", default="1,10", help="steady-state step rates (steps/s)")
    parser.add_argument("--steady-s", type=float, default=20.0, help="seconds of steady state per rate")
    parser.add_argument("--memory-steps", type=int, default=10000)
    parser.add_argument("--memory-rate", type=float, default=100.0, help="steps/s while counting to --memory-steps")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--window", type=int, default=50, help="straggler window (steps; the default's)")
    parser.add_argument("--zero-first-every", type=int, default=2500, help="a rank_zero_first block every N steps")
    parser.add_argument("--processes", type=int, default=4, help="worker processes (node 0 alone in one)")
    parser.add_argument("--threads", type=int, default=4, help="threads per worker process")
    parser.add_argument("--run-past-cap", action="store_true",
                        help="run a side at larger N even after its rendezvous did not finish within the cap")
    parser.add_argument("--from-json", default="",
                        help="write the results from these --json files (comma-separated) instead of running")
    parser.add_argument("--results", default=os.path.join(RESULTS, "control_plane.md"))
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--plot", default=None, help="a PNG of each time against N")
    args = parser.parse_args(argv)
    args.node_counts = [int(n) for n in args.nodes.split(",")]
    args.side_list = [s for s in args.sides.split(",") if s]
    args.rates = [float(r) for r in args.rates.split(",")]
    return args


def main() -> int:
    if not sandbox.inside():
        reason = sandbox.unavailable_reason()
        if reason:
            print(f"control_plane: cannot run: {reason}", file=sys.stderr)
            return 1
        return sandbox.reexec_inside([os.path.abspath(__file__), *sys.argv[1:]])
    args = parse_args()
    from control_plane_parts.report import write
    from control_plane_parts.trial import Trial

    results = Results("control_plane")
    runs: List[Dict[str, Any]] = []
    for path in filter(None, args.from_json.split(",")):  # runs made earlier, by separate invocations
        with open(path) as f:
            runs += [r for r in json.load(f) if r["side"] in args.side_list]
    if args.from_json:
        args.node_counts = []
    capped: Dict[str, int] = {}  # side -> the N at which its rendezvous did not finish within the cap
    for nodes in args.node_counts:
        # the same connections for both fabriclite sides, so that the job secret's figure has its floor in the run
        conns = rank_connections(nodes, args.ranks_per_node, relayed="fabriclite-secret" in args.side_list)
        for side in args.side_list:
            if side in capped and not args.run_past_cap:
                runs.append({"side": side, "nodes": nodes, "rank_conns": 0, "notes": [
                    f"not run: its rendezvous did not finish within the cap at {capped[side]} nodes"]})
                continue
            print(f"control_plane: {side} at {nodes} nodes ...", flush=True)
            t = time.monotonic()
            run = Trial(side, nodes, args, conns if side.startswith("fabriclite") else 0).run()
            run["load_after"] = os.getloadavg()[0]
            run["command"] = results.command
            run["date"] = time.strftime("%Y-%m-%d %H:%M")
            runs.append(run)
            if run.get("rendezvous_s") is None:
                capped[side] = nodes
            print(f"  {time.monotonic() - t:.0f} s: " + json.dumps({k: v for k, v in run.items()
                                                                  if k not in ("memory",)}, default=str)[:1500],
                  flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(runs, f, indent=1, default=str)
    write(results, args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
