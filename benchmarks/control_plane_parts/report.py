"""The results file (benchmarks/results/control_plane.md): one table per figure, N across, both sides; the goals
as checked / unchecked lines; and the plot of each time against N."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from common import Results, table

CAP = "> cap"
#: the side behind the job secret's relay (trial.SECRET_SIDE)
SECRET = "fabriclite-secret"
TIMES = (("rendezvous_s", "rendezvous (every rank / agent has met)"),
         ("failure_stop_s", "one rank fails -> every node has stopped its ranks"),
         ("next_round_s", "one rank fails -> every node has agreed and starts the next round"),
         ("preempt_s", "one node preempted -> every node has agreed to stop"))


READING = """- fabriclite-secret is fabriclite's side with the job secret: node 0's store on loopback behind fabriclite's real
  `RelayServer` (a process of its own, its CPU counted as node 0's), each worker process's simulated nodes behind a
  real `RelayClient` (a process per worker; on a real cluster each node runs its own). Every connection proves
  the secret (HMAC-SHA256 over both nonces) before its first request, as a real node's does; both fabriclite sides
  get the same number of connections per node (node 0's relay holds two files per connection, which sets the
  fold at large N).
- Each side's figures come from its real protocol code on a real libuv TCPStore in a process of its own;
  the nodes are simulated, thousands per worker process, on this machine's 2 cores (shared with whatever else
  runs: the load average is in the table). A simulated node's own work (its supervisor's or agent's CPU) is
  therefore done on those 2 cores for every node at once, where a real cluster gives each node its own machine;
  the model's lag (how late a scheduled task started) says when that CPU, not the protocol, set the pace.
- torchelastic's agents keep one rendezvous state, pickled, with every node in it, behind one key: every agent's
  read returns all of it, and every change is a compare-and-set of all of it that fails and is retried when
  another agent changed it first. Its time and its lag grow with N for that reason, on the store and in the
  agents alike; on a real cluster the agents' share of that work would be spread over N machines, so the model
  overstates its times by up to the lag shown.
- "> cap": the phase did not finish within the cap; a side whose rendezvous did not finish at some N is not run
  at larger N (recorded as "> cap" there too). A "> cap" is never counted as a win for that side.
- Order at each N: connections, rendezvous, steady state at each step rate, a failure and the restart, (fabriclite)
  a preemption, then the memory phase (its 10,000 steps run in the round after the preemption, pulses and all).
- fabriclite's failure -> stopped: the moment each node's supervisor saw the flag (when it would signal its
  ranks); next round: each node has the decision (when it would start its ranks). torchelastic's: each agent
  saw a node waiting (it would stop its workers), then each finished the next round's rendezvous."""


def _get(run: Optional[Dict[str, Any]], path: str) -> Any:
    value: Any = run
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _cell(run: Optional[Dict[str, Any]], path: str, fmt: str, reached: bool = True) -> str:
    if run is None:
        return "not run"
    value = _get(run, path)
    if value is None:
        return CAP if reached else "n/a"
    return fmt.format(value)


def _ratio(run: Optional[Dict[str, Any]], floor: Optional[Dict[str, Any]], path: str) -> str:
    value, base = _get(run, path), _get(floor, path)
    if run is None or floor is None:
        return "not run"
    if value is None or not base:
        return "n/a"
    return f"{value / base:.2f}x"


def _runs(runs: List[Dict[str, Any]]) -> Tuple[List[int], Dict[Tuple[str, int], Dict[str, Any]]]:
    nodes = sorted({r["nodes"] for r in runs})
    return nodes, {(r["side"], r["nodes"]): r for r in runs}


def goals(runs: List[Dict[str, Any]], args: Any) -> List[str]:
    nodes, by = _runs(runs)
    fab = [by[("fabriclite", n)] for n in nodes if ("fabriclite", n) in by]
    big = by.get(("fabriclite", 4096))
    anchor = by.get(("torchelastic", 4096))
    lines = []

    def line(ok: bool, text: str) -> None:
        lines.append(f"- [{'x' if ok else ' '}] {text}")

    growth = [(r["nodes"], _get(r, "memory.keys_growth_per_1000"), _get(r, "memory.rss_growth_mb_per_1000"))
              for r in fab]
    flat = bool(growth) and all(k is not None and k < 1 and m is not None and m < 1.0 for _, k, m in growth)
    line(flat, "Nothing at the store grows with the number of steps: keys and memory flat after warm-up (keys "
               "per 1,000 steps after step 2,000: " + ", ".join(f"{n}: {k if k is None else f'{k:+.0f}'}"
                                                                 for n, k, _ in growth) +
         "; store MB per 1,000 steps: " + ", ".join(f"{n}: {m if m is None else f'{m:+.2f}'}" for n, _, m in growth)
         + ")")
    cpu = [(r["nodes"], _get(r, f"steady_{args.rates[-1]:g}.node0_cpu_s_per_s")) for r in fab]
    linear = len(cpu) >= 2 and all(c is not None for _, c in cpu) and \
        cpu[-1][1] <= max(cpu[0][1], 1e-3) * (cpu[-1][0] / cpu[0][0]) * 1.5
    line(linear, "No per-poll or per-window work is O(N) per node; node 0's work grows at most linearly in N "
                 "(node 0's CPU s/s at " + f"{args.rates[-1]:g} steps/s: " +
         ", ".join(f"{n}: {c if c is None else f'{c:.3f}'}" for n, c in cpu) + ")")
    stop, agree = _get(big, "failure_stop_s"), _get(big, "next_round_s")
    line(stop is not None and stop <= 2.0, f"At 4,096 nodes: failure -> every node stopped <= 2 s "
                                           f"(measured: {CAP if stop is None else f'{stop:.2f} s'})")
    line(agree is not None and agree <= 5.0, f"At 4,096 nodes: the next round agreed <= 5 s "
                                             f"(measured: {CAP if agree is None else f'{agree:.2f} s'})")
    if any(side == "torchelastic" for side, _ in by):
        ours, theirs = _get(big, "rendezvous_s"), _get(anchor, "rendezvous_s")
        faster = ours is not None and (theirs is None or ours <= theirs)
        line(faster, "Rendezvous at 4,096 nodes no slower than torchelastic's on the same machine (fabriclite "
                     f"{CAP if ours is None else f'{ours:.2f} s'}, torchelastic "
                     f"{CAP if theirs is None else f'{theirs:.2f} s'})")
    for side in ("fabriclite", SECRET):
        runs_of = [by[(side, n)] for n in nodes if (side, n) in by]
        if not runs_of:
            continue
        per_node = [(r["nodes"], rate, _get(r, f"steady_{rate:g}.per_node_s")) for r in runs_of for rate in args.rates]
        ok = bool(per_node) and all(p is not None and p <= 1.0 for _, _, p in per_node)
        line(ok, "Steady-state traffic <= 1 request per node per second (supervisor and 8 ranks together"
                 + (", with the job secret: every connection through node 0's relay" if side == SECRET else "")
                 + "; " + ", ".join(f"{n} nodes at {rate:g} steps/s: {p if p is None else f'{p:.2f}'}"
                                    for n, rate, p in per_node) + ")")
    closed = by.get((SECRET, 4096))
    if closed is not None:
        for key, what in (("rendezvous_s", "rendezvous"), ("failure_stop_s", "failure -> every node stopped")):
            value, floor = _get(closed, key), _get(big, key)
            within = value is not None and floor is not None and value <= 1.2 * floor
            line(within, f"At 4,096 nodes with the job secret: {what} <= 1.2x the same run's figure without it "
                         f"(measured: {CAP if value is None else f'{value:.2f} s'}; floor, no secret: "
                         f"{CAP if floor is None else f'{floor:.2f} s'}"
                         + (f"; {value / floor:.2f}x" if value is not None and floor else "") + ")")
    return lines


def secret_costs(runs: List[Dict[str, Any]], args: Any) -> List[str]:
    """Where the job secret's time goes, from the largest N run on both fabriclite sides (empty without one)."""
    nodes, by = _runs(runs)
    both = [n for n in nodes if (SECRET, n) in by and ("fabriclite", n) in by]
    if not both:
        return []
    n = both[-1]
    closed, open_ = by[(SECRET, n)], by[("fabriclite", n)]

    def two(path: str) -> str:
        a, b = _get(closed, path), _get(open_, path)
        return f"{'n/a' if a is None else f'{a:.2f} s'} with the secret, {'n/a' if b is None else f'{b:.2f} s'} without"

    rate = args.rates[0]
    relay, others = (_get(closed, f"steady_{rate:g}.relay_cpu_s_per_s"),
                     _get(closed, f"steady_{rate:g}.node_relays_cpu_s_per_s"))
    cpu = ("n/a" if relay is None or others is None else
           f"{relay:.3f} CPU s per s and the other nodes' relays {others:.3f} in all")
    return [
        f"- At {n} nodes the model fell further behind with the secret: its worst lag in the rendezvous was "
        f"{two('rendezvous_lag_max_s')}, in the failure and restart {two('failure_lag_max_s')}. The relays' work "
        f"is CPU on the same 2 cores that run every simulated node: in steady state at {rate:g} steps/s node 0's "
        f"relay took {cpu}, and more in the rendezvous' burst of check-ins. On a real cluster each node's relay runs on its own machine and only node 0's relay stays "
        f"with node 0, so these times with the secret overstate a real cluster's by up to the extra lag, as the "
        f"model's lag does for torchelastic's.",
        f"- The steady-state request rate with the secret at {n} nodes counts more than the protocol's own "
        f"traffic: the model's worst lag there ({_get(closed, f'steady_{rate:g}.lag_max_s') or 0:.2f} s at "
        f"{rate:g} steps/s, {_get(open_, f'steady_{rate:g}.lag_max_s') or 0:.2f} s without the secret) exceeds the "
        f"2 s the count waits after the phase starts, so the phase's first collective-progress records (one per "
        f"rank, due in its first second) were still going out inside the counted window.",
        "- The relay forwards each request as it comes (one read, one send, TCP_NODELAY on every connection) and "
        "its loop does no work in the number of connections; node 0's relay's CPU per request served (its CPU s "
        "per s over the requests/s at the store, steady state at " + f"{rate:g} steps/s): " +
        ", ".join(f"{m} nodes: {_per_request_us(by[(SECRET, m)], rate)}" for m in both) + "."
    ]


def _per_request_us(run: Dict[str, Any], rate: float) -> str:
    cpu, requests = _get(run, f"steady_{rate:g}.relay_cpu_s_per_s"), _get(run, f"steady_{rate:g}.requests_s")
    return "n/a" if not cpu or not requests else f"{cpu / requests * 1e6:.0f} us"


def write(results: Results, args: Any, runs: List[Dict[str, Any]]) -> None:
    nodes, by = _runs(runs)
    sides = args.side_list
    folded = [f"{n} nodes: {by[('fabriclite', n)]['rank_conns']} per node" for n in nodes
              if ("fabriclite", n) in by and by[("fabriclite", n)]["rank_conns"] < args.ranks_per_node]
    header = results.header([
        ("model", f"{args.ranks_per_node} ranks per node; steady state {args.steady_s:g} s at each of "
                  f"{', '.join(f'{r:g}' for r in args.rates)} steps/s; memory after {args.memory_steps} steps at "
                  f"{args.memory_rate:g} steps/s; straggler window {args.window}; a rank_zero_first block every "
                  f"{args.zero_first_every} steps; cap {args.cap:g} s per N and side; {args.processes} worker "
                  f"processes x {args.threads} threads"),
        ("rank connections", "each rank its own" + (f", except (folded, same request rate): {'; '.join(folded)}"
                                                     if folded else " at every N")),
    ])
    head = ["figure"] + [f"{n} nodes" for n in nodes]
    rows = []
    for key, label in TIMES:
        for side in sides:
            if side == "torchelastic" and key == "preempt_s":
                rows.append([f"{label}, {side}"] + ["n/a (no such agreement)" for _ in nodes])
                continue
            rows.append([f"{label}, {side} (s)"] + [_cell(by.get((side, n)), key, "{:.2f}") for n in nodes])
    if SECRET in sides and "fabriclite" in sides:
        for key, label in TIMES:
            rows.append([f"{label}, with the job secret / without"] +
                        [_ratio(by.get((SECRET, n)), by.get(("fabriclite", n)), key) for n in nodes])
    for rate in args.rates:
        for side in sides:
            rows.append([f"steady state at {rate:g} steps/s: requests/s at the store, {side}"] +
                        [_cell(by.get((side, n)), f"steady_{rate:g}.requests_s", "{:.0f}") for n in nodes])
            rows.append([f"... per node per second, {side}"] +
                        [_cell(by.get((side, n)), f"steady_{rate:g}.per_node_s", "{:.2f}") for n in nodes])
            rows.append([f"... node 0's CPU s per s, {side}"] +
                        [_cell(by.get((side, n)), f"steady_{rate:g}.node0_cpu_s_per_s", "{:.3f}") for n in nodes])
            if side == SECRET:
                rows.append([f"... of which node 0's relay, {side}"] +
                            [_cell(by.get((side, n)), f"steady_{rate:g}.relay_cpu_s_per_s", "{:.3f}")
                             for n in nodes])
                rows.append([f"... the other nodes' relays, CPU s per s in all, {side}"] +
                            [_cell(by.get((side, n)), f"steady_{rate:g}.node_relays_cpu_s_per_s", "{:.3f}")
                             for n in nodes])
    for side in sides:
        rows.append([f"store memory after {args.memory_steps} steps (MB), {side}"] +
                    [_cell(by.get((side, n)), "memory.rss_mb", "{:.1f}") for n in nodes])
        rows.append([f"... growth per 1,000 steps after step 2,000 (MB), {side}"] +
                    [_cell(by.get((side, n)), "memory.rss_growth_mb_per_1000", "{:+.2f}") for n in nodes])
        rows.append([f"store keys after {args.memory_steps} steps, {side}"] +
                    [_cell(by.get((side, n)), "memory.keys", "{:d}") for n in nodes])
        rows.append([f"... growth per 1,000 steps after step 2,000, {side}"] +
                    [_cell(by.get((side, n)), "memory.keys_growth_per_1000", "{:+.0f}") for n in nodes])
    for side in sides:
        rows.append([f"the model's worst lag in the rendezvous (a task started late by, s), {side}"] +
                    [_cell(by.get((side, n)), "rendezvous_lag_max_s", "{:.2f}") for n in nodes])
        rows.append([f"... in the failure and restart (s), {side}"] +
                    [_cell(by.get((side, n)), "failure_lag_max_s", "{:.2f}") for n in nodes])
        rows.append([f"connections opened in (s), {side}"] +
                    [_cell(by.get((side, n)), "connect_s", "{:.1f}") for n in nodes])
        rows.append([f"load average (1 min) after the run, {side}"] +
                    [_cell(by.get((side, n)), "load_after", "{:.1f}") for n in nodes])
    notes = [f"- {r['side']} at {r['nodes']} nodes: {note}" for r in runs for note in r.get("notes", [])]
    if "torchelastic" not in sides:
        notes.append("- torchelastic: not run in this run; the last run against it (2026-11-29) is kept in "
                     "benchmarks/results/control_plane_torchelastic.md")
    made = sorted({(r["command"], r["date"][:10]) for r in runs if r.get("command")})
    notes += [f"- runs made by `{command}` ({date})" for command, date in made]
    body = "\n\n".join([header, "## Goals", "\n".join(goals(runs, args)), "## Figures", table(head, rows),
                         "## How to read it", READING] +
                       (["## Where the job secret's time goes", "\n".join(secret_costs(runs, args))]
                        if secret_costs(runs, args) else []) +
                       (["## Notes", "\n".join(notes)] if notes else []))
    with open(args.results, "w") as f:
        f.write(body + "\n")
    print(f"wrote {args.results}")
    if args.plot:
        plot(args.plot, runs, sides)


def plot(path: str, runs: List[Dict[str, Any]], sides: List[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes, by = _runs(runs)
    fig, axes = plt.subplots(1, len(TIMES), figsize=(4 * len(TIMES), 3.6))
    for ax, (key, label) in zip(axes, TIMES):
        for side, style in zip(sides, ("o-", "^:", "s--")):
            xs = [n for n in nodes if _get(by.get((side, n)), key) is not None]
            ax.plot(xs, [_get(by[(side, n)], key) for n in xs], style, label=side)
            capped = [n for n in nodes if (side, n) in by and _get(by[(side, n)], key) is None
                      and not (side == "torchelastic" and key == "preempt_s")]
            if capped:
                ax.plot(capped, [600] * len(capped), "x", color="red", label=f"{side}: > cap")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated nodes")
        ax.set_ylabel("seconds")
        ax.set_title(label, fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
