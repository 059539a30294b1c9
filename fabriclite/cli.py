"""``fabriclite run [options] SCRIPT [SCRIPT ARGS]``: start and supervise one node's ranks.
``fabriclite consolidate FOLDER [--output_file F] [--trusted]``: a sharded checkpoint as one file ``torch.load``
reads (``--trusted``: read it with ``weights_only=False``).
``fabriclite new-secret FILE``: a new job secret file (readable by you alone) for ``--job-secret-file``.
``fabriclite report RUN_FOLDER_OR_EVENTS [--output F] [--format html|perfetto] [--run ID] [--beside TRACE]``: a
job's history as one self-contained HTML page, or as Chrome trace-event JSON for Perfetto (fabriclite/report/).

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
from fabriclite.environments.hostlist import first_host
from fabriclite.environments.slurm import INTERACTIVE_JOB_NAMES, SLURMEnvironment, parse_signal
from fabriclite.supervision.agent.output_forwarding import OutputOptions
from fabriclite.supervision.watch.goodput import GOODPUT_MODES, goodput_from_env
from fabriclite.supervision.agent.preemption import PreemptOptions, parse_grace
from fabriclite.supervision.agent.restarts import MAX_RESTARTS_ENV, RestartPolicy, parse_max_restarts, parse_seconds
from fabriclite.launchers.subprocess_script import run_supervised
from fabriclite.supervision.processes.stopping import exit_process
from fabriclite.supervision.agent.node_layout import NodeLayout
from fabriclite.distributed.control_plane.liveness import LOSS_ENV, loss_timeout
from fabriclite.distributed import job_secret
from fabriclite.distributed.rendezvous import resolve_timeout
from fabriclite.supervision.agent.heartbeat import SLOW_LINK_ENV, slow_link_policy
from fabriclite.strategies import FAULT_TOLERANT, STRATEGIES
from fabriclite.strategies.torchft import diloco_settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fabriclite", description="Run a fabriclite script on this node.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start and supervise this node's ranks of SCRIPT")
    run.add_argument("--accelerator", default=None, choices=["auto", *sorted(ACCELERATORS)])
    run.add_argument("--strategy", default=None, choices=["auto", *sorted(STRATEGIES)])
    run.add_argument("--devices", default=None, help='processes (cpu) or GPUs on this node: int, "0,1", -1, "auto"')
    run.add_argument("--num-nodes", "--num_nodes", type=int, default=None,
                     help="nodes of the job (default: in a SLURM step, $SLURM_STEP_NUM_NODES; else 1)")
    run.add_argument("--node-rank", "--node_rank", type=int, default=None,
                     help="this node's index (default: in a SLURM step, $SLURM_NODEID; else $NODE_RANK or 0)")
    run.add_argument("--main-address", "--main_address", default=None,
                     help="node 0's address (default $MASTER_ADDR; in a SLURM step, the step's first node; else "
                          "127.0.0.1)")
    run.add_argument("--main-port", "--main_port", type=int, default=None,
                     help="node 0's port (default $MASTER_PORT; in a SLURM step, 15000 + the job id's last 4 digits; "
                          "one node: a free port; several: 29500)")
    run.add_argument("--precision", default=None)
    run.add_argument("--timeout", type=float, default=None, help="seconds for rendezvous and each collective (default $FABRICLITE_TIMEOUT or 1800)")
    run.add_argument("--heartbeat-timeout", "--heartbeat_timeout", default=None,
                     help="seconds after which a node whose heartbeat stopped (or that cannot reach node 0's store) "
                          "ends the job, naming it (default $FABRICLITE_HEARTBEAT_TIMEOUT, or 15, at most half of "
                          "--timeout)")
    run.add_argument("--slow-link", "--slow_link", default=None,
                     help="when a node's link to node 0 turns slow (its heartbeats take seconds, its steps collapse): "
                          "report (default: say so, naming the node and its step rates, and go on) or stop (end "
                          "the job, naming it); or $FABRICLITE_SLOW_LINK")
    run.add_argument("--rank-prefix", action="store_true", help="prefix every output line with [rank N]")
    run.add_argument("--log-dir", default=None, help="also write each rank's output to LOG_DIR/rank_N.log, and the "
                     "events record there (default: the run's folder, $XDG_STATE_HOME/fabriclite/runs/<run id>/)")
    run.add_argument("--goodput", choices=GOODPUT_MODES, default=None,
                     help="when node 0 prints the goodput line: auto (default: after a failure, restart, preemption, "
                          "hang or straggler, or a run over 10 minutes), always, never (or $FABRICLITE_GOODPUT)")
    run.add_argument("--max-restarts", "--max_restarts", default=None,
                     help="after a failure, start every rank again up to N times "
                          "(default $FABRICLITE_MAX_RESTARTS or 0)")
    run.add_argument("--no-warm-spares", "--no_warm_spares", action="store_true",
                     help="with --max-restarts: start no warm spares (interpreters with torch imported that become "
                          "the next round's ranks; or $FABRICLITE_WARM_SPARES=0)")
    run.add_argument("--restart-window", "--restart_window", default=None,
                     help="seconds after the start within which restarts may happen (default: no limit)")
    run.add_argument("--preempt-grace", "--preempt_grace", default=None,
                     help="seconds ranks get to save and exit after SIGTERM/SIGUSR1 "
                          "(default $FABRICLITE_PREEMPT_GRACE or 20)")
    run.add_argument("--no-requeue", "--no_requeue", action="store_true",
                     help="under SLURM, do not run `scontrol requeue` after the requeue signal (or "
                          "$FABRICLITE_REQUEUE=0): save and exit 75")
    run.add_argument("--requeue-signal", "--requeue_signal", default=None,
                     help="the signal that means save, exit and requeue: USR1 (default; sbatch --signal=USR1@90), "
                          "USR2, ... (or $FABRICLITE_REQUEUE_SIGNAL)")
    run.add_argument("--fault-tolerant", "--fault_tolerant", action="store_true",
                     help="live recovery on torchft: each node is a replica group; a failed node is restarted "
                          "(--max-restarts) and heals from a live peer while the others keep training")
    run.add_argument("--min-replicas", "--min_replicas", type=int, default=None,
                     help="with --fault-tolerant: replica groups needed to commit a step (default 1)")
    run.add_argument("--first-quorum-timeout", "--first_quorum_timeout", type=float, default=None,
                     help="with --fault-tolerant: seconds the job's first quorum waits for every node's replica "
                          "group (--num-nodes) before failing with the missing ones named (default 300)")
    run.add_argument("--lighthouse", default=None,
                     help="with --fault-tolerant: HOST:PORT of a running torchft lighthouse (default: node 0's "
                          "supervisor starts one at --main-address:--main-port)")
    run.add_argument("--job-secret-file", "--job_secret_file", default=None, metavar="FILE",
                     help="a multi-node job's secret, the same file on every node (or $FABRICLITE_JOB_SECRET_FILE; "
                          "'fabriclite new-secret FILE' makes one): only nodes that hold it reach the job's store")
    run.add_argument("--insecure", action="store_true",
                     help="run a multi-node job without a job secret: anyone who reaches node 0's port can stop, "
                          "hang or read it (or $FABRICLITE_INSECURE=1)")
    diloco_settings.add_flags(run)
    run.add_argument("script", help="the Python script to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    merge = sub.add_parser("consolidate", help="write a sharded checkpoint folder as one file torch.load reads")
    merge.add_argument("checkpoint_folder", help="a sharded checkpoint (torch.distributed.checkpoint files + meta.pt)")
    merge.add_argument("--output_file", "--output-file", default=None,
                       help="where to write it (must not exist; default FOLDER.consolidated)")
    merge.add_argument("--trusted", action="store_true",
                       help="the folder is yours: read meta.pt and the non-tensor items with weights_only=False "
                            "(loading them runs any code they hold); by default nothing read runs code")
    secret = sub.add_parser("new-secret", help="write a new job secret file, readable by you alone")
    secret.add_argument("file", help="where to write it (must not exist): a folder every node of the job sees")
    report = sub.add_parser("report", help="a job's history (its events record) as an HTML page or a Perfetto trace")
    report.add_argument("sources", nargs="+", metavar="RUN_FOLDER_OR_EVENTS",
                        help="a run folder, a folder of events-node<N>.jsonl files, or such files")
    report.add_argument("--output", "-o", default=None, help="default report.html (perfetto: trace.json)")
    report.add_argument("--format", choices=["html", "perfetto"], default="html")
    report.add_argument("--run", default=None, help="the run id to show (default: the latest run in the record)")
    report.add_argument("--beside", default=None, metavar="TRACE",
                        help="with --format perfetto: a torch profiler trace to merge the job's events into")
    return parser


class UsageError(ValueError):
    """Bad command-line input, found before anything starts."""


def usage_error(command: str, message: str) -> NoReturn:
    """The CLI's error rule: one line ``fabriclite <command>: error: <message>`` on stderr, exit code 2."""
    sys.stderr.write(f"fabriclite {command}: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``fabriclite``: the job's exit code. Called without ``argv`` (the program
    itself), it exits the process with that code instead of returning. Bad input: see the error rule above."""
    args = _parser().parse_args(argv)
    if args.command == "report":
        return _report(args)
    if args.command == "new-secret":
        return _new_secret(args.file)
    if args.command == "consolidate":
        try:
            folder, output = _prepare_consolidate(args)
        except (ValueError, TypeError) as err:
            usage_error(args.command, str(err))
        _consolidate(folder, output, args.trusted)
        return 0
    try:
        job = _prepare_run(args)
    except (ValueError, TypeError) as err:  # UsageError and every check of the connector
        usage_error(args.command, str(err))
    if args.no_warm_spares:
        os.environ["FABRICLITE_WARM_SPARES"] = "0"  # launchers/warm_spare.py's switch
    code = run_supervised(*job)  # _prepare_run returns run_supervised's arguments, in its order
    if argv is None:  # the program itself: end now, without the interpreter's slow teardown of torch
        exit_process(code)
    return code


def _prepare_run(args: argparse.Namespace) -> Tuple[Any, ...]:
    """Validate every flag of ``fabriclite run`` the way ``Fabric(...)`` would; the arguments of
    ``run_supervised``. Starts nothing."""
    from fabriclite.connector import CLI_ENV, CLI_USED_ENV, Connector

    slurm = _slurm_step(args)
    num_nodes = args.num_nodes if args.num_nodes is not None else (slurm["num_nodes"] if slurm else 1)
    node_rank = args.node_rank if args.node_rank is not None else (
        slurm["node_rank"] if slurm else _env_int("NODE_RANK"))
    if slurm and args.main_address is None and not os.environ.get("MASTER_ADDR"):
        args.main_address = slurm["main_address"]
    if slurm and args.main_port is None and not os.environ.get("MASTER_PORT"):
        args.main_port = slurm["main_port"]
    if num_nodes < 1:
        raise UsageError(f"--num-nodes {num_nodes}: expected a positive int.")
    if not 0 <= node_rank < num_nodes:
        raise UsageError(f"--node-rank {node_rank} is out of range for --num-nodes {num_nodes}; "
                         f"expected 0..{num_nodes - 1}.")
    if not os.path.isfile(args.script):
        raise UsageError(f"script {args.script!r} not found; pass the path of a Python script.")
    if not args.fault_tolerant:
        for flag in ("min_replicas", "lighthouse", "first_quorum_timeout"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} needs --fault-tolerant.")
    if args.job_secret_file is not None:  # the path travels, never the secret (distributed/job_secret.py)
        os.environ[job_secret.SECRET_FILE_ENV] = os.path.abspath(args.job_secret_file)
    if args.insecure:
        os.environ[job_secret.INSECURE_ENV] = "1"
    job_secret.for_job(num_nodes, args.fault_tolerant)  # JobSecretError (a ValueError) names the file or the flags
    args.strategy_env = diloco_settings.cli_env(args)  # --strategy diloco|local_sgd and their settings
    if args.heartbeat_timeout is not None:  # this supervisor's (control_plane/liveness.py); ValueError names it
        os.environ[LOSS_ENV] = str(loss_timeout(resolve_timeout(args.timeout).total_seconds(), args.heartbeat_timeout))
    if args.slow_link is not None:
        os.environ[SLOW_LINK_ENV] = slow_link_policy(args.slow_link)
    if args.fault_tolerant:
        return _prepare_live(args, num_nodes, node_rank)
    # validate every flag the way Fabric(...) would, before starting anything
    connector = Connector(accelerator=args.accelerator or "auto", strategy=args.strategy or "auto",
                          devices=args.devices or "auto", num_nodes=num_nodes, precision=args.precision,
                          plugins=_own_ranks(), launcher_chosen=True)
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
    layout = NodeLayout(num_nodes, node_rank, connector.num_processes)
    output, preempt = _output_and_preempt(args)
    command = [sys.executable, args.script, *args.script_args]
    return (command, layout, main_address, main_port, resolve_timeout(args.timeout), output, extra_env, restarts,
            preempt)


def _prepare_live(args: argparse.Namespace, num_nodes: int, node_rank: int) -> Tuple[Any, ...]:
    """``run_supervised``'s arguments under --fault-tolerant: this node alone (its own store on a free port at
    its advertised address, its own restarts), plus where the lighthouse is. Checks every refused combination
    first; starts nothing."""
    import importlib.util

    from fabriclite.connector import CLI_ENV, CLI_USED_ENV, Connector
    from fabriclite.supervision.lighthouse import (FIRST_QUORUM_TIMEOUT_S, FT_EXTRA, LiveOptions,
                                                   advertised_address, parse_address)

    if importlib.util.find_spec("torchft") is None:
        raise UsageError(f"--fault-tolerant needs torchft, which is not installed: {FT_EXTRA}.")
    if args.strategy not in (None, "auto", "ddp", *FAULT_TOLERANT):
        raise UsageError(f"--fault-tolerant with --strategy {args.strategy} is not supported: each node is one "
                         "torchft replica group running DDP (torchft 0.2 has no sharded mode over gloo); drop "
                         "--strategy or pass --strategy ddp, diloco or local_sgd.")
    connector = Connector(accelerator=args.accelerator or "auto", strategy="ddp", devices=args.devices or 1,
                          num_nodes=1, precision=args.precision, plugins=_own_ranks(), launcher_chosen=True)
    ranks_per_group = connector.num_processes  # --devices: the ranks of this node's replica group
    if ranks_per_group != 1 and args.strategy in ("diloco", "local_sgd"):
        raise UsageError(f"--fault-tolerant --strategy {args.strategy} with --devices {args.devices}: DiLoCo and "
                         "LocalSGD run one rank per replica group for now; pass --devices 1, or drop --strategy for "
                         f"replica groups of {ranks_per_group} ranks with DDP inside each.")
    min_replicas = 1 if args.min_replicas is None else args.min_replicas
    if not 1 <= min_replicas <= num_nodes:
        raise UsageError(f"--min-replicas {min_replicas} is out of range for --num-nodes {num_nodes}; expected "
                         f"1..{num_nodes}.")
    first_quorum_timeout = FIRST_QUORUM_TIMEOUT_S if args.first_quorum_timeout is None else args.first_quorum_timeout
    if not first_quorum_timeout > 0:
        raise UsageError(f"--first-quorum-timeout {args.first_quorum_timeout:g}: expected seconds > 0 (how long the "
                         f"job's first quorum waits for all {num_nodes} nodes' replica groups; default "
                         f"{FIRST_QUORUM_TIMEOUT_S:g}).")
    main_address = args.main_address or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    main_port = args.main_port if args.main_port is not None else (_env_int("MASTER_PORT") or 29500)
    if args.lighthouse is not None:
        host, port = parse_address(args.lighthouse, "--lighthouse")
    else:
        host, port = main_address, main_port
    address = advertised_address(host)
    live = LiveOptions(f"{host}:{port}", node_rank, num_nodes, min_replicas, address,
                       host_lighthouse=node_rank == 0 and args.lighthouse is None,
                       first_quorum_timeout=first_quorum_timeout)
    strategy = args.strategy if args.strategy in FAULT_TOLERANT else "fault_tolerant"
    os.environ.update(args.strategy_env)  # also this supervisor's: node 0's lighthouse reads its join timeout
    extra_env = {CLI_ENV["strategy"]: strategy, CLI_ENV["devices"]: str(ranks_per_group), CLI_USED_ENV: "1",
                 **live.to_env(),
                 **args.strategy_env,
                 "RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # torchft's Rust side logs every quorum at info
    for name, value in (("accelerator", args.accelerator), ("precision", args.precision)):
        if value is not None:
            extra_env[CLI_ENV[name]] = value
    if args.timeout is not None:
        extra_env["FABRICLITE_TIMEOUT"] = str(args.timeout)
    output, preempt = _output_and_preempt(args)
    command = [sys.executable, args.script, *args.script_args]
    return (command, NodeLayout(1, 0, ranks_per_group), address, 0, resolve_timeout(args.timeout), output, extra_env,
            _restart_policy(args), preempt, live)


def _output_and_preempt(args: argparse.Namespace) -> Tuple[OutputOptions, PreemptOptions]:
    """--rank-prefix / --log-dir / --goodput (else the environment's) and the preemption options of
    ``fabriclite run``."""
    output = OutputOptions(prefix=args.rank_prefix, log_dir=args.log_dir)
    if not (output.prefix or output.log_dir):
        output = OutputOptions.from_env()
    output.goodput = args.goodput or goodput_from_env()
    preempt = PreemptOptions.from_env()
    if args.preempt_grace is not None:
        preempt.grace_s = parse_grace(args.preempt_grace, "--preempt-grace")
    preempt.requeue = preempt.requeue and not args.no_requeue
    if args.requeue_signal is not None:
        preempt.requeue_signal = parse_signal(args.requeue_signal, "--requeue-signal")
    return output, preempt


def _own_ranks() -> Optional[List[Any]]:
    """Inside a SLURM task (``srun fabriclite run``) the CLI's checks count the ranks it will start itself, not
    SLURM's tasks (one per node): the local environment, forced. None elsewhere (detection as usual)."""
    if not SLURMEnvironment.detect():
        return None
    from fabriclite.environments import LocalEnvironment

    return [LocalEnvironment()]


def _slurm_step(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """Inside a SLURM job step with one ``fabriclite run`` per node (``srun --ntasks-per-node=1 fabriclite run
    ...``): the job's nodes (``$SLURM_STEP_NUM_NODES``), this node's rank (``$SLURM_NODEID``), node 0's address
    (the step's first host) and port (15000 + the job id's last 4 digits, as SLURMEnvironment's). None outside a
    step, or where the flags give all of them. UsageError for a step with several tasks on a node (each would
    start the node's ranks), or for the batch script of a multi-node job (one supervisor for many nodes)."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        return None
    given = args.num_nodes is not None and args.node_rank is not None and args.main_address is not None
    if not env.get("SLURM_STEP_ID"):  # the batch script itself (or an salloc shell): not one task per node
        if env.get("SLURM_JOB_NAME", "").strip() in INTERACTIVE_JOB_NAMES:
            return None
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
        if nodes.strip() not in ("", "1") and args.num_nodes is None and not given:
            raise UsageError(f"fabriclite run in the batch script of a {nodes}-node SLURM job would start the ranks "
                             "of one node only; start one per node: srun --ntasks-per-node=1 fabriclite run ... "
                             "(or pass --num-nodes and --node-rank yourself).")
        return None
    if given:
        return None
    nodes = _env_int("SLURM_STEP_NUM_NODES") or _env_int("SLURM_NNODES") or 1
    tasks = _env_int("SLURM_STEP_NUM_TASKS") or _env_int("SLURM_NTASKS") or nodes
    if tasks != nodes:
        raise UsageError(f"this SLURM step runs {tasks} tasks on {nodes} nodes, so several `fabriclite run` would "
                         "start on one node; start one per node: srun --ntasks-per-node=1 fabriclite run ... "
                         "(fabriclite run starts the node's ranks itself: --devices), or pass --num-nodes, "
                         "--node-rank and --main-address yourself.")
    slurm_env = SLURMEnvironment()
    return {"num_nodes": nodes, "node_rank": _env_int("SLURM_NODEID"),
            "main_address": first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or
                                       "127.0.0.1"),
            "main_port": slurm_env.main_port if nodes > 1 else None}


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


def _consolidate(folder: str, output: str, trusted: bool = False) -> None:
    import pickle
    import re

    from fabriclite.checkpoint.atomic import atomic_save
    from fabriclite.checkpoint.dcp import consolidate

    try:
        merged = consolidate(folder, weights_only=False if trusted else None)
    except FileNotFoundError as err:  # a shard missing: named, nothing written
        usage_error("consolidate", str(err))
    except pickle.UnpicklingError as err:  # something that would run code: refused, nothing written
        found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(err))  # torch's weights-only refusal
        first = found.group(1) if found else (str(err).strip().splitlines() or [type(err).__name__])[0]
        hint = "" if "--trusted" in first else " If the folder is yours, pass --trusted."
        usage_error("consolidate", f"nothing was written: {folder} holds what would run code when loaded "
                                   f"({first}).{hint}")
    atomic_save(merged, output)


def _new_secret(path: str) -> int:
    """``fabriclite new-secret FILE``: 0, or the error rule when FILE exists or cannot be written."""
    try:
        job_secret.write_new_secret(path)
    except FileExistsError:
        usage_error("new-secret", f"{path!r} exists already; a job secret file is never overwritten: remove it or "
                                  f"pick another path.")
    except OSError as err:
        usage_error("new-secret", f"cannot write {path!r}: {err.strerror}.")
    print(f"fabriclite: wrote a new job secret to {path} (mode 0600); pass --job-secret-file {path} on every node.")
    return 0


def _report(args: argparse.Namespace) -> int:
    """``fabriclite report``: read the record (bad input: the CLI's error rule), write the page or the trace, name
    the file written."""
    from fabriclite.report import html_page, job_history, perfetto_trace

    try:
        if args.beside is not None and args.format != "perfetto":
            raise UsageError(f"--beside {args.beside} needs --format perfetto (it merges into a trace).")
        history = job_history.load(args.sources, args.run)
        beside = perfetto_trace.read_trace(args.beside) if args.beside is not None else None
    except (ValueError, OSError) as err:
        usage_error(args.command, str(err))
    if args.format == "perfetto":
        path = perfetto_trace.write(history, args.output or "trace.json", beside)
    else:
        path = html_page.write(history, args.output or "report.html")
    print(f"fabriclite report: run {history.run}: {path}")
    return 0


def _env_int(name: str) -> int:
    value = os.environ.get(name, "") or "0"
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"${name}={value!r}: expected an int.") from None


if __name__ == "__main__":
    raise SystemExit(main())
