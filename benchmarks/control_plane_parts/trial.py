"""One side (fabriclite, fabriclite-secret or torchelastic) at one N: a fresh store (and, with the job secret, node
0's relay in front of it), the workers, the phases in order, under a cap.

A phase that does not finish before the cap leaves its figure and every later one as None ("> cap")."""
from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any, Dict, List, Optional

from control_plane_parts.store_host import RelayHost, StoreHost
from control_plane_parts.workers import Workers, merge_times


#: the side that runs fabriclite's protocol behind the job secret's relay
SECRET_SIDE = "fabriclite-secret"


def _spread(times: Dict[int, float], start: float) -> Optional[float]:
    return max(times.values()) - start if times else None


class Trial:
    def __init__(self, side: str, nodes: int, args: Any, rank_conns: int) -> None:
        self.side, self.nodes, self.args, self.rank_conns = side, nodes, args, rank_conns
        self.started = time.monotonic()
        self.deadline = self.started + args.cap
        self.result: Dict[str, Any] = {"side": side, "nodes": nodes, "rank_conns": rank_conns, "notes": []}
        self.relay: Optional[RelayHost] = None
        self.secret: Optional[bytes] = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self) -> Dict[str, Any]:
        r = self.result
        secret = secrets.token_hex(32).encode() if self.side == SECRET_SIDE else None
        try:
            with StoreHost() as host, (RelayHost("server", host.port, secret) if secret
                                       else contextlib.nullcontext()) as relay:
                r["reads_per_request"] = host.calibrate()
                self.relay, self.secret = relay, secret
                self._phases(host)
        except (TimeoutError, _Capped) as err:
            r["notes"].append(f"stopped at the cap: {err}")
        r["total_s"] = time.monotonic() - self.started
        return r

    def _phases(self, host: StoreHost) -> None:
        args, r = self.args, self.result
        t = time.monotonic()
        relayed = {} if self.relay is None else {"secret": self.secret, "relay_port": self.relay.port}
        workers = Workers(self.side, self.nodes, args.processes, host.port, threads=args.threads, cap_s=args.cap,
                          ranks_per_node=args.ranks_per_node, rank_conns=self.rank_conns, window=args.window,
                          zero_first_every=args.zero_first_every, **relayed)
        try:
            r["connect_s"] = time.monotonic() - t
            r["workers_rss_mb"] = workers.rss_mb()
            # rendezvous
            start = time.monotonic() + 1.0
            answers = self._run(workers, "rendezvous", start=start, deadline=self.deadline)
            if not all(a.get("finished") for a in answers):
                raise _Capped("the rendezvous did not finish")
            r["rendezvous_s"] = _spread(merge_times(answers), start)
            r["rendezvous_lag_max_s"] = max(a["lag_max_s"] for a in answers)
            # steady state at each step rate
            for rate in args.rates:
                start = time.monotonic() + 1.0
                until = start + args.steady_s
                workers.send("steady", start=start, until=until, rate=rate)
                time.sleep(max(0.0, start + 2.0 - time.monotonic()))  # past the chains' first round
                req0, t0, relay0 = host.requests(), time.monotonic(), self._relay_cpu_s()
                time.sleep(max(0.0, until - time.monotonic()))
                seconds = time.monotonic() - t0
                requests_s = (host.requests() - req0) / seconds
                relay_cpu_s = (self._relay_cpu_s() - relay0) / seconds
                answers = self._errors(f"steady {rate:g}", workers.collect(self.left()))
                node0 = answers[0]
                r[f"steady_{rate:g}"] = {
                    "requests_s": requests_s, "per_node_s": requests_s / self.nodes,
                    # node 0's supervisor hosts the relay: its CPU is node 0's too
                    "node0_cpu_s_per_s": node0["cpu_s"] / node0["wall_s"] + relay_cpu_s,
                    "relay_cpu_s_per_s": relay_cpu_s if self.relay is not None else None,
                    "node_relays_cpu_s_per_s": (sum(a.get("relay_cpu_s", 0.0) for a in answers) / node0["wall_s"]
                                                if self.relay is not None else None),
                    "lag_max_s": max(a["lag_max_s"] for a in answers),
                    "split": _sum_split(answers, until - start)}
                self._check_left("steady state")
            # a failure: every node stopped, then the next round agreed
            start = time.monotonic() + 1.0
            answers = self._run(workers, "failure", start=start, node=self.nodes - 1, deadline=self.deadline)
            if not all(a.get("finished") for a in answers):
                r["failure_stop_s"] = _spread(merge_times(answers, "stopped"), start) \
                    if all(a.get("stopped_all") for a in answers) else None
                raise _Capped("the failure's restart did not finish")
            r["failure_stop_s"] = _spread(merge_times(answers, "stopped"), start)
            r["next_round_s"] = _spread(merge_times(answers), start)
            r["failure_lag_max_s"] = max(a["lag_max_s"] for a in answers)
            # preemption
            if self.side.startswith("fabriclite"):
                start = time.monotonic() + 1.0
                answers = self._run(workers, "preempt", start=start, node=self.nodes // 2, deadline=self.deadline)
                if not all(a.get("finished") for a in answers):
                    raise _Capped("the preemption agreement did not finish")
                r["preempt_s"] = _spread(merge_times(answers), start)
                r["preempt_decisions"] = sorted({str(d) for a in answers for d in a.get("decisions", [])})
            # memory over 10,000 steps, last (on a loaded machine the model may fall behind its step rate here)
            r["memory"] = self._memory(workers, host)
        finally:
            r["workers_rss_mb_end"] = workers.rss_mb()
            workers.close()

    def _relay_cpu_s(self) -> float:
        return self.relay.cpu_s() if self.relay is not None else 0.0

    def _memory(self, workers: Workers, host: StoreHost) -> Dict[str, Any]:
        args = self.args
        steps, rate = args.memory_steps, args.memory_rate
        start = time.monotonic() + 1.0
        workers.send("memory", start=start, steps=steps, rate=rate)
        samples: List[Dict[str, float]] = [{"step": 0, "rss_mb": host.rss_mb(), "keys": host.num_keys()}]
        for k in range(1000, steps + 1, 1000):
            when = start + k / rate
            time.sleep(max(0.0, when - time.monotonic()))
            if time.monotonic() > self.deadline:
                raise _Capped("the memory phase did not finish")
            samples.append({"step": k, "rss_mb": host.rss_mb(), "keys": host.num_keys()})
        answers = self._errors("memory", workers.collect(self.left()))
        samples.append({"step": steps, "rss_mb": host.rss_mb(), "keys": host.num_keys()})  # every step done
        late = max(a.get("behind_steps", 0) for a in answers)
        base = next((s for s in samples if s["step"] >= 2000), samples[0])
        last = samples[-1]
        per_k = max(1, (last["step"] - base["step"]) / 1000)
        return {"samples": samples, "rss_mb": last["rss_mb"], "keys": last["keys"],
                "rss_growth_mb_per_1000": (last["rss_mb"] - base["rss_mb"]) / per_k,
                "keys_growth_per_1000": (last["keys"] - base["keys"]) / per_k, "behind_steps": late,
                "lag_max_s": max(a["lag_max_s"] for a in answers)}

    def _run(self, workers: Workers, phase: str, **kwargs: Any) -> List[Dict[str, Any]]:
        self._check_left(phase)
        return self._errors(phase, workers.run(phase, timeout=self.left() + 30, **kwargs))

    def _errors(self, phase: str, answers: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Any chain that raised in ``phase`` goes into the notes (the figure is then suspect)."""
        count = sum(a.get("task_error_count", 0) for a in answers)
        if count:
            first = next(a["task_errors"][0] for a in answers if a.get("task_errors"))
            self.result["notes"].append(f"{count} chains raised in phase {phase}; the first: {first[-600:]}")
        return answers

    def _check_left(self, what: str) -> None:
        if self.left() <= 0:
            raise _Capped(f"no time left for {what}")


def _sum_split(answers: List[Dict[str, Any]], seconds: float) -> Dict[str, float]:
    """The requests the workers counted themselves, per kind, per second."""
    total: Dict[str, float] = {}
    for a in answers:
        for kind, count in a.get("requests", {}).items():
            total[kind] = total.get(kind, 0) + count / seconds
    return total


class _Capped(Exception):
    pass
