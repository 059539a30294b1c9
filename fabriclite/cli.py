"""``fabriclite run [options] SCRIPT [SCRIPT ARGS]``: start and supervise one node's ranks.

One call per node. The script's ``Fabric(...)`` joins the job; the flags fill what the code leaves
unset, and a conflicting value in the code is a ValueError.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional

from fabriclite.accelerators import ACCELERATORS
from fabriclite.launchers.output import OutputOptions
from fabriclite.launchers.subprocess_script import run_supervised
from fabriclite.launchers.supervisor import Layout, exit_process
from fabriclite.rendezvous import resolve_timeout
from fabriclite.strategies import STRATEGIES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fabriclite", description="Run a fabriclite script on this node.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start and supervise this node's ranks of SCRIPT")
    run.add_argument("--accelerator", default=None, choices=["auto", *sorted(ACCELERATORS)])
    run.add_argument("--strategy", default=None, choices=["auto", *sorted(STRATEGIES)])
    run.add_argument("--devices", default=None, help='processes (cpu) or GPUs on this node: int, "0,1", -1, "auto"')
    run.add_argument("--num-nodes", "--num_nodes", type=int, default=None)
    run.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's index (default $NODE_RANK or 0)")
    run.add_argument("--main-address", "--main_address", default=None, help="node 0's address (default $MASTER_ADDR or 127.0.0.1)")
    run.add_argument("--main-port", "--main_port", type=int, default=None,
                     help="node 0's port (default $MASTER_PORT; one node: a free port; several: 29500)")
    run.add_argument("--precision", default=None)
    run.add_argument("--timeout", type=float, default=None, help="seconds for rendezvous and each collective (default $FABRICLITE_TIMEOUT or 1800)")
    run.add_argument("--rank-prefix", action="store_true", help="prefix every output line with [rank N]")
    run.add_argument("--log-dir", default=None, help="also write each rank's output to LOG_DIR/rank_N.log")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``fabriclite``: the job's exit code. Called without ``argv`` (the program
    itself), it exits the process with that code instead of returning."""
    args = _parser().parse_args(argv)
    from fabriclite.connector import CLI_ENV, Connector

    num_nodes = args.num_nodes if args.num_nodes is not None else 1
    node_rank = args.node_rank if args.node_rank is not None else int(os.environ.get("NODE_RANK", 0) or 0)
    if not 0 <= node_rank < max(1, num_nodes):
        raise SystemExit(f"fabriclite run: --node-rank {node_rank} is out of range for --num-nodes {num_nodes}; "
                         f"expected 0..{num_nodes - 1}.")
    if not os.path.isfile(args.script):
        raise SystemExit(f"fabriclite run: script {args.script!r} not found.")
    # validate every flag the way Fabric(...) would, before starting anything
    connector = Connector(accelerator=args.accelerator or "auto", strategy=args.strategy or "auto",
                          devices=args.devices or "auto", num_nodes=num_nodes, precision=args.precision)
    flags: Dict[str, Optional[str]] = {
        "accelerator": args.accelerator, "strategy": args.strategy, "devices": args.devices,
        "num_nodes": str(num_nodes) if args.num_nodes is not None else None, "precision": args.precision,
    }
    extra_env = {CLI_ENV[k]: v for k, v in flags.items() if v is not None}
    if args.timeout is not None:
        extra_env["FABRICLITE_TIMEOUT"] = str(args.timeout)
    main_address = args.main_address or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    main_port = args.main_port if args.main_port is not None else int(os.environ.get("MASTER_PORT", 0) or 0)
    layout = Layout(num_nodes, node_rank, connector.num_processes)
    output = OutputOptions(prefix=args.rank_prefix, log_dir=args.log_dir)
    if not (output.prefix or output.log_dir):
        output = OutputOptions.from_env()
    command = [sys.executable, args.script, *args.script_args]
    code = run_supervised(command, layout, main_address, main_port, resolve_timeout(args.timeout), output, extra_env)
    if argv is None:  # the program itself: end now, without the interpreter's slow teardown of torch
        exit_process(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
