"""Training across slow links: plain ddp, ``--fault-tolerant`` ddp, LocalSGD, DiLoCo (H = 10, 50) and streaming
DiLoCo (2 fragments) on 3 hosts of the network-namespace cluster (tests/integration/netns/cluster.py), one rank
each, each host's eth0 shaped by ``tc qdisc ... tbf rate R`` (``netem`` does not work on this kernel; unthrottled:
a plain ``pfifo``, for its byte counter). The script: benchmarks/slow_links_train.py (a ~2.2 M-parameter causal
transformer LM on synthetic tokens, AdamW inside, batch 4 x 32 tokens, 300 steps per group (``--steps``), one thread
per rank).

    $(bash scripts/backend_env.sh ft --path)/bin/python benchmarks/slow_links.py \
        [--rates none,100mbit,20mbit] [--schemes ddp,ft,local_sgd,diloco10,diloco50,streaming] [--kills ...]
    python benchmarks/slow_links.py --plot docs/slow_links_benchmark.png   # from the JSON, needs matplotlib

Needs root, network namespaces and ``tc`` (the ft lane's interpreter: torchft). Writes
benchmarks/results/slow_links.md (and .json, the raw figures the plot reads). Columns:

- samples/s: the 3 groups' samples per second together, after 3 warm-up steps;
- MB sent per step: bytes one host sent on eth0 per step (``tc -s qdisc``: every byte, quorum and heartbeats too),
  mean of the hosts;
- stall per sync: the median step with a sync minus the median step without one (ddp, ``--fault-tolerant``: every
  step syncs; their stall is against the DiLoCo H=50 run's steps without a sync at the same rate);
- eval loss: the final model of group 0 on a fixed held-out batch (every group ends on the same global model).

A ddp run stops after ``CAP_S`` of training (the others never reach it): its samples/s is measured on the steps it
made, and the loss to compare at equal samples is the unthrottled run's (ddp's math does not depend on the rate).
The kill runs (one per scheme with a group that can come back: not plain ddp, which restarts whole): group 2
SIGKILLs itself after step 30 and is restarted (``--max-restarts 1``, a 2 s backoff); its return time is the kill
to its first step after the restart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "tests" / "integration" / "netns"))

from common import Results, table  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "slow_links_train.py"
JSON = ROOT / "benchmarks" / "results" / "slow_links.json"
STEPS, BATCH, KILL_STEP, CAP_S = 300, 4, 30, 120
GROUPS = 3
SCHEMES = {
    "ddp": ("plain ddp", None),
    "ft": ("--fault-tolerant ddp", []),
    "local_sgd": ("LocalSGD H=10", ["--strategy", "local_sgd", "--sync-every", "10"]),
    "diloco10": ("DiLoCo H=10", ["--strategy", "diloco", "--sync-every", "10"]),
    "diloco50": ("DiLoCo H=50", ["--strategy", "diloco", "--sync-every", "50"]),
    "streaming": ("streaming DiLoCo H=50, 2 fragments, delay 12",
                  ["--strategy", "diloco", "--sync-every", "50", "--fragments", "2", "--fragment-sync-delay", "12"]),
}
RATES = {"none": "unthrottled", "100mbit": "100 Mbit/s", "20mbit": "20 Mbit/s"}
BITS_PER_S = {"none": None, "100mbit": 100e6, "20mbit": 20e6}


def shape(cluster: Any, rate: str) -> None:
    """Each host's eth0: tbf at ``rate`` (burst 64 KiB, 100 ms of queue), or a plain pfifo ("none")."""
    for node in range(cluster.num_nodes):
        qdisc = ["pfifo"] if rate == "none" else ["tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
        subprocess.run(["ip", "netns", "exec", cluster.host(node), "tc", "qdisc", "replace", "dev", "eth0", "root",
                        *qdisc], check=True)


def run(cluster: Any, scheme: str, rate: str, out: Path, steps: int, kill: bool = False) -> List[Dict[str, Any]]:
    """One job (3 nodes); the groups' summaries."""
    from ft_harness import start_nodes, wait_nodes

    shape(cluster, rate)
    flags = SCHEMES[scheme][1]
    env = {"OMP_NUM_THREADS": "1", "FABRICLITE_TIMEOUT": "300", "SL_TIME_CAP": str(CAP_S)}
    args = ["--main-address", cluster.addr(0)]
    if kill:
        env.update({"SL_KILL_GROUP": "2", "SL_KILL_STEP": str(KILL_STEP), "FABRICLITE_FIRST_RESTART_BACKOFF": "2"})
        args += ["--max-restarts", "1"]
    started = time.time()
    nodes = start_nodes(out, steps, args=[*args, *(flags or [])], env=env, script=SCRIPT, port=29541,
                        fault_tolerant=flags is not None,
                        spawn=lambda rank, cmd, full_env, **kw: cluster.exec(rank, cmd, full_env, **kw))
    nodes = wait_nodes(nodes, 420)
    for node in nodes:
        if node.code != 0:
            raise RuntimeError(f"{scheme} at {rate}: node {node.rank} exited {node.code}:\n{node.output[-3000:]}")
    print(f"  {scheme} at {rate}{' (kill)' if kill else ''}: {time.time() - started:.0f} s", file=sys.stderr)
    return [json.loads((out / f"summary-{g}.json").read_text()) for g in range(3)]


def steps_of(summary: Dict[str, Any]) -> List[tuple]:
    """(duration, synced) of each step after warm-up (the rows of the last incarnation)."""
    rows = [r for r in summary["rows"] if r[1] >= summary["warm"][1]]
    return [(b[1] - a[1], b[3]) for a, b in zip(rows, rows[1:])]


def figures(summaries: List[Dict[str, Any]]) -> Dict[str, Any]:
    """samples/s, MB per step per host, median step with and without a sync, eval loss, capped."""
    rate = sum((s["end"][0] - s["warm"][0]) * BATCH / (s["end"][1] - s["warm"][1]) for s in summaries)
    per_step = statistics.mean((s["end"][2] - s["warm"][2]) / max(1, s["end"][0] - s["warm"][0]) for s in summaries)
    durations = steps_of(summaries[0])
    with_sync = [d for d, synced in durations if synced]
    without = [d for d, synced in durations if not synced]
    return {"samples_s": rate, "mb_per_step": per_step / 1e6, "eval_loss": summaries[0]["eval_loss"],
            "sync_step_s": statistics.median(with_sync) if with_sync else None,
            "plain_step_s": statistics.median(without) if without else None,
            "steps": summaries[0]["end"][0], "capped": any(s.get("capped") for s in summaries)}


def kill_figures(summaries: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The killed group's return time and group 0's loss before the kill, after the return, and at the end."""
    dead = summaries[2]
    killed = dead["killed"]
    back = next(r[1] for r in dead["rows"] if r[1] > killed)
    rows = summaries[0]["rows"]
    before = [r[2] for r in rows if r[1] <= killed][-5:]
    after = [r[2] for r in rows if r[1] >= back][:5]
    return {"return_s": back - killed, "loss_before": statistics.mean(before),
            "loss_after": statistics.mean(after) if after else None, "eval_loss": summaries[0]["eval_loss"],
            "source": dead["starts"][-1][3]}


def stall(entry: Dict[str, Any], reference: Optional[Dict[str, Any]]) -> Optional[float]:
    if entry["plain_step_s"] is not None and entry["sync_step_s"] is not None:
        return entry["sync_step_s"] - entry["plain_step_s"]
    if reference and reference.get("plain_step_s") is not None and entry["sync_step_s"] is not None:
        return entry["sync_step_s"] - reference["plain_step_s"]
    return None


def floor(entry: Dict[str, Any], rate: str, reference: Optional[Dict[str, Any]]) -> Optional[float]:
    """The hand-computed floor of a run: its samples/s if each step cost only the longer of its compute (the run's
    median step without a sync; for a scheme that syncs every step, the DiLoCo H=50 run's at the same rate) and the
    bytes it sent per step at the link's rate: the two fully overlapped, no latency, no quorum."""
    compute = entry["plain_step_s"] if entry["plain_step_s"] is not None else (reference or {}).get("plain_step_s")
    if compute is None:
        return None
    bits = BITS_PER_S[rate]
    link = entry["mb_per_step"] * 8e6 / bits if bits else 0.0
    return GROUPS * BATCH / max(compute, link)


def report(data: Dict[str, Any], results: Results) -> str:
    runs, kills = data["runs"], data["kills"]
    rows = []
    for rate in RATES:
        for scheme in SCHEMES:
            entry = runs.get(f"{scheme}@{rate}")
            if entry is None:
                continue
            ref = runs.get(f"diloco50@{rate}")
            gap = stall(entry, ref)
            plain = entry["plain_step_s"]
            best = floor(entry, rate, ref)
            rows.append([RATES[rate], SCHEMES[scheme][0], f"{entry['samples_s']:.1f}",
                         "n/a" if best is None else f"{best:.1f} ({entry['samples_s'] / best:.2f}x)",
                         f"{entry['mb_per_step']:.2f}", "n/a" if gap is None else f"{gap:.2f} s",
                         "every step syncs" if plain is None else f"{plain:.2f} s",
                         f"{entry['eval_loss']:.3f}", f"{entry['steps']}{' (capped)' if entry['capped'] else ''}"])
    body = ["## Throughput, traffic and loss", "",
            table(["link", "scheme", "samples/s", "floor samples/s (run / floor)", "MB sent per step (per host)",
                   "stall per sync", "step without a sync (median)", "eval loss", "steps"], rows), "",
            "The step without a sync is compute alone: where it differs between runs of one scheme, the machine's "
            "load changed the compute, not the link (compare samples/s within a run's own row first). The floor is "
            "computed by hand from the same run: each step costs the longer of its compute and the bytes it sent per "
            "step at the link's rate (the two fully overlapped, no latency, no quorum); run / floor says how far the "
            "run is from it."]
    missing = [f"{scheme}@{rate}" for rate in RATES for scheme in SCHEMES if f"{scheme}@{rate}" not in runs]
    if missing:
        body += ["", f"**Reduced grid**: not run here: {', '.join(missing)} (the machine's time did not allow the "
                     f"full grid; see the command above)."]
    if kills:
        krows = [[SCHEMES[s][0], f"{k['return_s']:.1f} s", k["source"], f"{k['loss_before']:.3f}",
                  "n/a" if k["loss_after"] is None else f"{k['loss_after']:.3f}", f"{k['eval_loss']:.3f}"]
                 for s, k in kills.items()]
        body += ["", "## One group killed and back (unthrottled)", "",
                 f"Group 2 SIGKILLs itself after step {KILL_STEP}; `--max-restarts 1` restarts it after a 2 s backoff.",
                 "", table(["scheme", "kill -> its first step back", "healed from", "group 0's loss, 5 steps before",
                            "5 steps after it is back", "final eval loss"], krows)]
    if data.get("failed"):
        body += ["", "Failed jobs (not in the tables): " + "; ".join(f"{k}: {v.splitlines()[0]}"
                                                                  for k, v in data["failed"].items())]
    body += ["", "## Goals", ""] + goals(runs, data.get("steps", STEPS))
    return "\n".join(body)


def goals(runs: Dict[str, Any], steps: int) -> List[str]:
    """The issue's goals, each as a checked or unchecked box with the figures that decide it."""
    diloco = [s for s in ("diloco10", "diloco50", "streaming") if f"{s}@100mbit" in runs and f"{s}@none" in runs]
    if not diloco or "ddp@100mbit" not in runs or "ddp@none" not in runs:
        return ["- [ ] not decided: the grid lacks DiLoCo or ddp at 100 Mbit/s and unthrottled"]
    best = max(diloco, key=lambda s: runs[f"{s}@100mbit"]["samples_s"])
    fast, slow = runs[f"{best}@100mbit"], runs[f"{best}@none"]
    own = fast["samples_s"] / slow["samples_s"]
    ddp = fast["samples_s"] / runs["ddp@100mbit"]["samples_s"]
    loss = runs[f"{best}@none"]["eval_loss"] / runs["ddp@none"]["eval_loss"] - 1
    name = SCHEMES[best][0]
    return [f"- [{'x' if own >= 0.9 else ' '}] at 100 Mbit/s, the best DiLoCo setting ({name}) runs at >= 0.9x its "
            f"own unthrottled speed: {fast['samples_s']:.1f} / {slow['samples_s']:.1f} samples/s = {own:.2f}x",
            f"- [{'x' if ddp >= 4 else ' '}] at 100 Mbit/s it runs >= 4x faster than plain ddp: "
            f"{fast['samples_s']:.1f} / {runs['ddp@100mbit']['samples_s']:.1f} samples/s = {ddp:.2f}x",
            f"- [{'x' if abs(loss) <= 0.05 else ' '}] its final loss is within 5 % of plain ddp's at equal samples "
            f"({steps} steps of each group, unthrottled runs): {runs[f'{best}@none']['eval_loss']:.3f} vs "
            f"{runs['ddp@none']['eval_loss']:.3f} ({loss * 100:+.1f} %)"]


def plot(data: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    schemes = [s for s in SCHEMES if any(f"{s}@{r}" in runs for r in RATES)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(RATES)
    for i, rate in enumerate(RATES):
        values = [runs.get(f"{s}@{rate}", {}).get("samples_s", 0.0) for s in schemes]
        ax.bar([x + i * width for x in range(len(schemes))], values, width, label=RATES[rate])
    ax.set_xticks([x + width for x in range(len(schemes))])
    ax.set_xticklabels([SCHEMES[s][0].replace(", ", "\n") for s in schemes], fontsize=8)
    ax.set_ylabel("samples/s (3 groups)")
    ax.set_title("3 hosts, one rank each, ~2.2 M-parameter LM: speed by link rate (benchmarks/results/slow_links.md)",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default=",".join(RATES))
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--kills", default="ft,local_sgd,diloco10,diloco50,streaming",
                        help="schemes with one kill-and-rejoin run (unthrottled); '' for none")
    parser.add_argument("--only", default="", help="comma-separated scheme@rate runs instead of the grid")
    parser.add_argument("--steps", type=int, default=STEPS, help="inner steps per group")
    parser.add_argument("--keep", action="store_true", help="add to the JSON's runs instead of starting over")
    parser.add_argument("--plot", default=None, help="only draw the plot from the JSON into this PNG")
    parser.add_argument("--report-only", action="store_true", help="only write the results file from the JSON")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(JSON.read_text()), args.plot)
        return
    if args.report_only:
        write_report(json.loads(JSON.read_text()), Results("slow_links"))
        return
    from cluster import Cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"slow_links: needs network namespaces: {reason}")
    results = Results("slow_links")
    data = json.loads(JSON.read_text()) if args.keep and JSON.exists() else {"runs": {}, "kills": {}}
    if data.setdefault("steps", args.steps) != args.steps:
        raise SystemExit(f"slow_links: --keep adds to runs of {data['steps']} steps; pass --steps {data['steps']}")
    grid = [item.split("@") for item in args.only.split(",") if item] or \
        [(s, r) for r in args.rates.split(",") for s in args.schemes.split(",")]
    kills = [s for s in args.kills.split(",") if s]
    cluster = Cluster(3, prefix=f"sl{os.getpid() % 100000}").up()
    try:
        with tempfile.TemporaryDirectory(prefix="slow_links_") as tmp:
            jobs = [(f"{s}@{r}", s, r, False) for s, r in grid] + [(f"kill:{s}", s, "none", True) for s in kills]
            for key, scheme, rate, kill in jobs:
                try:
                    summaries = run(cluster, scheme, rate, Path(tmp) / key.replace(":", "-").replace("@", "-"),
                                    args.steps, kill)
                    entry = kill_figures(summaries) if kill else figures(summaries)
                except Exception as err:  # noqa: BLE001 - one failed job is reported, the others still run
                    print(f"  {key} failed: {err}", file=sys.stderr)
                    data.setdefault("failed", {})[key] = str(err)[-500:]
                    continue
                data["kills" if kill else "runs"][key.split(":")[-1] if kill else key] = entry
                data.get("failed", {}).pop(key, None)
                JSON.write_text(json.dumps(data, indent=1))
    finally:
        cluster.down()
    write_report(data, results)


def write_report(data: Dict[str, Any], results: Results) -> None:
    results.write(report(data, results), extra=[
        ("interpreter", "the ft lane's: `$(bash scripts/backend_env.sh ft --path)/bin/python`"),
        ("torchft", "0.2.0"),
        ("hosts", "3 network namespaces on this machine (one rank each, OMP_NUM_THREADS=1), eth0 shaped by tc tbf"),
        ("model", f"causal transformer LM, ~2.2 M parameters; AdamW lr 1e-3; batch {BATCH} x 32 tokens; "
                  f"{data.get('steps', STEPS)} steps per group (a ddp run: at most {CAP_S} s of training)")])


if __name__ == "__main__":
    main()
