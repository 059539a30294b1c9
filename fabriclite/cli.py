"""``fabriclite run [options] SCRIPT [SCRIPT ARGS]``: start and supervise one node's ranks.
``fabriclite consolidate FOLDER [--output_file F]``: a sharded checkpoint as one file ``torch.load`` reads.

One call per node. The script's ``Fabric(...)`` joins the job; the flags fill what the code leaves
unset, and a conflicting value in the code is a ValueError.

The CLI's error rule (every subcommand, every flag): bad input is found before anything starts and ends the
program with one last line ``fabriclite <command>: error: <message>`` and exit code 2 (argparse's usage line
may come before it); never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, NoReturn, Optional, Tuple

from fabriclite.accelerators import ACCELERATORS
from fabriclite.supervision.output_forwarding import OutputOptions
from fabriclite.supervision.preemption import PreemptOptions, parse_grace
from fabriclite.supervision.restarts import MAX_RESTARTS_ENV, RestartPolicy, parse_max_restarts, parse_seconds
from fabriclite.launchers.subprocess_script import run_supervised
from fabriclite.supervision.stopping import exit_process
from fabriclite.supervision.supervisor import Layout
from fabriclite.distributed.rendezvous import resolve_timeout
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
    run.add_argument("--max-restarts", "--max_restarts", default=None,
                     help="after a failure, start every rank again up to N times "
                          "(default $FABRICLITE_MAX_RESTARTS or 0)")
    run.add_argument("--restart-window", "--restart_window", default=None,
                     help="seconds after the start within which restarts may happen (default: no limit)")
    run.add_argument("--preempt-grace", "--preempt_grace", default=None,
                     help="seconds ranks get to save and exit after SIGTERM/SIGUSR1 "
                          "(default $FABRICLITE_PREEMPT_GRACE or 20)")
    run.add_argument("--no-requeue", "--no_requeue", action="store_true",
                     help="under SLURM, do not run `scontrol requeue` after SIGUSR1 (or $FABRICLITE_REQUEUE=0)")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    merge = sub.add_parser("consolidate", help="write a sharded checkpoint folder as one file torch.load reads")
    merge.add_argument("checkpoint_folder", help="a sharded checkpoint (torch.distributed.checkpoint files + meta.pt)")
    merge.add_argument("--output_file", "--output-file", default=None,
                       help="where to write it (must not exist; default FOLDER.consolidated)")
    return parser


class UsageError(ValueError):
    """Bad command-line input, found before anything starts."""


def fail(command: str, message: str) -> NoReturn:
    """The CLI's error rule: one line ``fabriclite <command>: error: <message>`` on stderr, exit code 2."""
    sys.stderr.write(f"fabriclite {command}: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``fabriclite``: the job's exit code. Called without ``argv`` (the program
    itself), it exits the process with that code instead of returning. Bad input: see the error rule above."""
    args = _parser().parse_args(argv)
    if args.command == "consolidate":
        try:
            folder, output = _prepare_consolidate(args)
        except (ValueError, TypeError) as err:
            fail(args.command, str(err))
        _consolidate(folder, output)
        return 0
    try:
        job = _prepare_run(args)
    except (ValueError, TypeError) as err:  # UsageError and every check of the connector
        fail(args.command, str(err))
    code = run_supervised(*job)  # _prepare_run returns run_supervised's arguments, in its order
    if argv is None:  # the program itself: end now, without the interpreter's slow teardown of torch
        exit_process(code)
    return code


def _prepare_run(args: argparse.Namespace) -> Tuple[Any, ...]:
    """Validate every flag of ``fabriclite run`` the way ``Fabric(...)`` would; the arguments of
    ``run_supervised``. Starts nothing."""
    from fabriclite.connector import CLI_ENV, CLI_USED_ENV, Connector

    num_nodes = args.num_nodes if args.num_nodes is not None else 1
    node_rank = args.node_rank if args.node_rank is not None else _env_int("NODE_RANK")
    if num_nodes < 1:
        raise UsageError(f"--num-nodes {num_nodes}: expected a positive int.")
    if not 0 <= node_rank < num_nodes:
        raise UsageError(f"--node-rank {node_rank} is out of range for --num-nodes {num_nodes}; "
                         f"expected 0..{num_nodes - 1}.")
    if not os.path.isfile(args.script):
        raise UsageError(f"script {args.script!r} not found; pass the path of a Python script.")
    # validate every flag the way Fabric(...) would, before starting anything
    connector = Connector(accelerator=args.accelerator or "auto", strategy=args.strategy or "auto",
                          devices=args.devices or "auto", num_nodes=num_nodes, precision=args.precision)
    flags: Dict[str, Optional[str]] = {
        "accelerator": args.accelerator, "strategy": args.strategy, "devices": args.devices,
        "num_nodes": str(num_nodes) if args.num_nodes is not None else None, "precision": args.precision,
    }
    extra_env = {CLI_ENV[k]: v for k, v in flags.items() if v is not None}
    extra_env[CLI_USED_ENV] = "1"  # the ranks' Fabric(...) joins the job in __init__
    restarts = _restart_policy(args)
    if args.timeout is not None:
        extra_env["FABRICLITE_TIMEOUT"] = str(args.timeout)
    main_address = args.main_address or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    main_port = args.main_port if args.main_port is not None else _env_int("MASTER_PORT")
    layout = Layout(num_nodes, node_rank, connector.num_processes)
    output = OutputOptions(prefix=args.rank_prefix, log_dir=args.log_dir)
    if not (output.prefix or output.log_dir):
        output = OutputOptions.from_env()
    command = [sys.executable, args.script, *args.script_args]
    preempt = PreemptOptions.from_env()
    if args.preempt_grace is not None:
        preempt.grace_s = parse_grace(args.preempt_grace, "--preempt-grace")
    preempt.requeue = preempt.requeue and not args.no_requeue
    return (command, layout, main_address, main_port, resolve_timeout(args.timeout), output, extra_env, restarts,
            preempt)


def _restart_policy(args: argparse.Namespace) -> RestartPolicy:
    """--max-restarts / --restart-window (else their environment variables) as a RestartPolicy."""
    raw = args.max_restarts if args.max_restarts is not None else os.environ.get(MAX_RESTARTS_ENV) or "0"
    where = "--max-restarts" if args.max_restarts is not None else f"${MAX_RESTARTS_ENV}"
    policy = RestartPolicy.from_env(parse_max_restarts(raw, where))
    if args.restart_window is not None:
        policy.window_s = parse_seconds(args.restart_window, "--restart-window", allow_zero=False)
    return policy


def _prepare_consolidate(args: argparse.Namespace) -> Tuple[str, str]:
    """(folder, output file) of ``fabriclite consolidate``, checked (Lightning's checks); writes nothing."""
    folder = os.path.abspath(args.checkpoint_folder)
    if not os.path.exists(folder):
        raise UsageError(f"the checkpoint folder {args.checkpoint_folder!r} does not exist.")
    if not os.path.isdir(folder):
        raise UsageError(f"{args.checkpoint_folder!r} must be a folder holding a sharded checkpoint's files; "
                         "a single file is already consolidated.")
    if not os.path.isfile(os.path.join(folder, "meta.pt")):
        raise UsageError(f"{args.checkpoint_folder!r} is not a sharded checkpoint saved by fabriclite or Lightning "
                         "(it has no meta.pt).")
    output = os.path.abspath(args.output_file) if args.output_file else folder + ".consolidated"
    if os.path.exists(output):
        raise UsageError(f"the output {output!r} already exists; pass another --output_file or move it first.")
    return folder, output


def _consolidate(folder: str, output: str) -> None:
    from fabriclite.checkpoint.atomic import atomic_save
    from fabriclite.checkpoint.dcp import consolidate

    try:
        merged = consolidate(folder)
    except FileNotFoundError as err:  # a shard missing: named, nothing written
        fail("consolidate", str(err))
    atomic_save(merged, output)


def _env_int(name: str) -> int:
    value = os.environ.get(name, "") or "0"
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"${name}={value!r}: expected an int.") from None


if __name__ == "__main__":
    raise SystemExit(main())
