"""Network faults, fabriclite against the same job under raw torch and under Lightning Fabric: 3 hosts of the
network-namespace cluster (tests/integration/netns/cluster.py), one rank each, a DDP loop (fabriclite:
tests/integration/netns/network_faults_job.py under ``fabriclite run --timeout 30 --heartbeat-timeout 10``; raw torch:
``init_process_group(gloo, timeout=30 s)``; Lightning: ``Fabric(num_nodes=3)`` with its default timeout, each
process started by hand: benchmarks/network_faults_peer.py). At step 200 the network is faulted:

- ``down``: host 2's port on the bridge goes down for good (a pulled cable: both sides see silence);
- ``store``: host 0's (the store's host) does;
- ``gray``: host 1's outgoing link is shaped to 50 kbit/s (``tc tbf``).

Figures: from the fault to every process of the job gone (``> cap`` when some still ran ``--cap`` seconds later:
they are then killed), the exit codes, and whether every other host's output names the host that went away; for
``gray``, from the shaping to node 0's line that names host 1's slow link (host 1's own comes up to a pulse earlier). The floor: the heartbeat timeout itself
(the earliest a silent peer can be told from a slow one without a timeout of its own).

    python benchmarks/network_faults.py [--sides fabriclite,torch,lightning] [--cases down,store,gray] [--cap 90]

Needs root, network namespaces and ``tc``. Writes benchmarks/results/network_faults.md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "integration" / "netns"))

from cluster import Cluster, lifetime, unavailable_reason  # noqa: E402
from common import Results, table  # noqa: E402
from fabriclite.distributed import job_secret  # noqa: E402

JOB = REPO / "tests" / "integration" / "netns" / "network_faults_job.py"
PEER = HERE / "network_faults_peer.py"
NODES, HEARTBEAT_S, START_S = 3, 10.0, 180.0
LOST = {"down": 2, "store": 0, "gray": 1}
_port = [29700]


def start(cluster: Cluster, side: str, out: Path) -> List[subprocess.Popen]:
    _port[0] += 1
    port = _port[0]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FABRICLITE_", "MASTER_", "SLURM_"))}
    base.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), STEPS="100000",
                OUT=str(out / f"{side}.pt"))
    secret = out / "job.secret"  # fabriclite's jobs run closed, as a user's must (docs/security.md)
    if not secret.exists():
        job_secret.write_new_secret(str(secret))
    procs = []
    for k in range(NODES):
        if side == "fabriclite":
            cmd = [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "1",
                   "--num-nodes", str(NODES), "--node-rank", str(k), "--main-address", cluster.host(0),
                   "--main-port", str(port), "--timeout", "30", "--heartbeat-timeout", str(HEARTBEAT_S),
                   "--job-secret-file", str(secret), str(JOB)]
            env = base
        else:
            cmd = [sys.executable, str(PEER), side]
            env = {**base, "MASTER_ADDR": cluster.host(0), "MASTER_PORT": str(port), "WORLD_SIZE": str(NODES),
                   "RANK": str(k), "NODE_RANK": str(k), "LOCAL_RANK": "0"}
        with open(out / f"{side}-node{k}.out", "w") as o, open(out / f"{side}-node{k}.err", "w") as e:
            procs.append(cluster.exec(k, cmd, env, stdout=o, stderr=e))
    return procs


def fault(cluster: Cluster, case: str, on: bool) -> None:
    node = LOST[case]
    if case == "gray":
        tc = ["ip", "netns", "exec", cluster.host(node), "tc", "qdisc"]
        if on:
            subprocess.run([*tc, "add", "dev", "eth0", "root", "tbf", "rate", "50kbit", "burst", "4kb", "latency",
                            "500ms"], check=True)
        else:
            subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True)
    else:
        subprocess.run(["ip", "-n", cluster.hub, "link", "set", cluster.host(node), "down" if on else "up"],
                       check=True)


def run_case(cluster: Cluster, side: str, case: str, out: Path, cap: float) -> Dict[str, object]:
    folder = out / f"{side}-{case}"
    folder.mkdir(parents=True)
    procs = start(cluster, side, folder)
    deadline = time.monotonic() + START_S
    while "AT " not in (folder / f"{side}-node0.out").read_text():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            cluster.kill_all()
            raise RuntimeError(f"{side} {case}: the job never reached the fault step; see {folder}")
        time.sleep(0.05)
    start_t = time.monotonic()
    fault(cluster, case, True)
    lost, result = LOST[case], {"side": side, "case": case}
    try:
        names = (cluster.host(lost), cluster.addr(lost))
        while time.monotonic() - start_t < cap:
            errs = [(folder / f"{side}-node{k}.err").read_text(errors="replace") for k in range(NODES)]
            if case == "gray" and "slow link" in errs[0] and names[0] in errs[0]:  # node 0: the job's view
                result["seconds"] = time.monotonic() - start_t
                break
            if case != "gray" and all(p.poll() is not None for p in procs):
                result["seconds"] = time.monotonic() - start_t
                break
            time.sleep(0.1)
        result.setdefault("seconds", None)
        result["codes"] = [p.poll() for p in procs]
        errs = [(folder / f"{side}-node{k}.err").read_text(errors="replace") for k in range(NODES)]
        # hard faults: every other host names the lost one; gray: node 0 names host 1 (as the whole job's view)
        others = [0] if case == "gray" else [k for k in range(NODES) if k != lost]
        result["named"] = all(any(n in errs[k] for n in names) for k in others)
    finally:
        fault(cluster, case, False)
        cluster.kill_all()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default="fabriclite,torch,lightning")
    parser.add_argument("--cases", default="down,store,gray")
    parser.add_argument("--cap", type=float, default=90.0, help="seconds after the fault before the job is killed")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"network_faults: {reason}")
    results = Results("network_faults")
    rows = []
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"network_faults-{os.getpid()}"
    for cluster in lifetime(NODES):
        for case in args.cases.split(","):
            for side in args.sides.split(","):
                print(f"network_faults: {side} / {case} ...", file=sys.stderr, flush=True)
                row = run_case(cluster, side, case, out, args.cap)
                print(f"  {row}", file=sys.stderr, flush=True)
                rows.append(row)
    results.write(report(rows, args.cap), extra=[("hosts", f"{NODES} namespace hosts on a bridge, one rank each"),
                                                 ("heartbeat timeout (fabriclite)", f"{HEARTBEAT_S:g} s")])


def report(rows: List[Dict[str, object]], cap: float) -> str:
    what = {"down": "host 2's link down: fault -> every process gone (s)",
            "store": "host 0's (the store's) link down: fault -> every process gone (s)",
            "gray": "host 1 at 50 kbit/s: shaping -> node 0 names host 1's slow link (s)"}

    def seconds(row: Dict[str, object]) -> str:
        value = row["seconds"]
        return f"> cap ({cap:g})" if value is None else f"{value:.1f}"

    lines = []
    body = []
    for row in rows:
        floor = HEARTBEAT_S if row["case"] != "gray" else None
        vs = f"{row['seconds'] / floor:.2f}x" if floor and row["seconds"] is not None else "-"
        body.append([what[str(row["case"])], row["side"], seconds(row), vs, " ".join(map(str, row["codes"])),
                     "yes" if row["named"] else "no"])
    fl = {(r["case"], r["side"]): r for r in rows}
    goals = []
    for case in ("down", "store"):
        row = fl.get((case, "fabriclite"))
        if row is not None:
            ok = row["seconds"] is not None and row["seconds"] <= HEARTBEAT_S + 10 and row["named"]
            goals.append(f"- [{'x' if ok else ' '}] {case}: every process of the fabriclite job gone within the heartbeat "
                         f"timeout + 10 s, the lost host named on every other host (measured: {seconds(row)} s)")
    row = fl.get(("gray", "fabriclite"))
    if row is not None:
        ok = row["seconds"] is not None and row["seconds"] <= 60
        goals.append(f"- [{'x' if ok else ' '}] gray: node 0 names host 1's slow link within 60 s (measured: "
                     f"{seconds(row)} s)")
    lines += ["## Goals", "", *goals, "", "## Figures", "",
              table(["fault", "side", "seconds", "vs floor (heartbeat timeout)", "exit codes (node 0, 1, 2)",
                     "lost host named on every other host (gray: on node 0)"], body), "",
              "## How to read it", "",
              "- exit codes `None`: the process still ran at the cap and was killed.",
              "- raw torch and Lightning have no supervisor: each rank ends when gloo's timeout fires (raw torch's 30 s, "
              "Lightning's default 30 minutes), if it fires; the rank that lost its link may wait in TCP longer.",
              "- gray: the job keeps running on every side (fabriclite's default `--slow-link report`); the figure is "
              "the time to node 0's line that names host 1's slow link."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
