"""The processes that hold the simulated nodes. Node 0 has a process of its own (its CPU time is node 0's
supervisor's); the other nodes are dealt over a few more. The controller sends each a phase by name with its
arguments; the worker runs it on its loop and answers with what it measured. With a job secret (``spec["secret"]``),
each worker but node 0's starts its nodes' relay to node 0's (store_host.RelayHost) and its nodes connect there."""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any, Dict, List

from control_plane_parts.loop import Loop


def _main(pipe: Any, spec: Dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    relay = None
    if spec.get("secret") and spec["worker"] != 0:  # node 0's own connections go to the store on its loopback
        from control_plane_parts.store_host import RelayHost

        relay = RelayHost("client", spec["relay_port"], spec["secret"])
        spec = {**spec, "port": relay.port}
    if spec["side"] == "torchelastic":
        from control_plane_parts.elastic_nodes import ElasticNodes as Model
    else:
        from control_plane_parts.fabric_nodes import FabricNodes as Model
    loop = Loop(spec.get("threads", 4))
    try:
        model = Model(spec, loop)
        pipe.send({"ok": True})
    except Exception:
        pipe.send({"error": traceback.format_exc()})
        if relay is not None:
            relay.close()
        return
    while True:
        name, kwargs = pipe.recv()
        if name == "quit":
            break
        cpu, wall = time.process_time(), time.monotonic()
        relay_cpu = relay.cpu_s() if relay is not None else 0.0
        loop.lag(reset=True)
        try:
            result = getattr(model, name)(**kwargs)
        except Exception:
            result = {"error": traceback.format_exc()}
        result["cpu_s"] = time.process_time() - cpu
        result["wall_s"] = time.monotonic() - wall
        if relay is not None:  # this worker's nodes' relay (on a real cluster: spread over their machines)
            result["relay_cpu_s"] = relay.cpu_s() - relay_cpu
        result["lag_median_s"], result["lag_max_s"] = loop.lag(reset=True)
        if loop.errors:
            result.setdefault("task_errors", []).extend(loop.errors[:3])
            result["task_error_count"] = len(loop.errors)
            loop.errors.clear()
        pipe.send(result)
    loop.stop()
    if relay is not None:
        relay.close()


class Workers:
    """``Workers(side, num_nodes, processes, port, **spec)``: node 0 alone in worker 0, the rest dealt round-robin
    over ``processes - 1`` more. ``run(phase, **kwargs)`` runs a phase in every worker at once; the answers."""

    def __init__(self, side: str, num_nodes: int, processes: int, port: int, **spec: Any) -> None:
        ctx = mp.get_context("fork")
        others = max(1, processes - 1)
        groups: List[List[int]] = [[0]] + [list(range(1 + i, num_nodes, others)) for i in range(others)]
        groups = [g for g in groups if g]
        self.groups = groups
        self.pipes, self.procs = [], []
        for index, nodes in enumerate(groups):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_main, args=(there, {**spec, "side": side, "nodes": nodes,
                                                            "num_nodes": num_nodes, "port": port, "worker": index}),
                               daemon=True)
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)
        errors = [a["error"] for a in (p.recv() for p in self.pipes) if "error" in a]
        if errors:
            self.close()
            raise RuntimeError("a worker did not start:\n" + errors[0])

    def send(self, phase: str, **kwargs: Any) -> None:
        """Start ``phase`` in every worker at once (collect the answers with :meth:`collect`)."""
        for pipe in self.pipes:
            pipe.send((phase, kwargs))
        self._phase = phase

    def collect(self, timeout: float) -> List[Dict[str, Any]]:
        """Every worker's answer to the phase sent last; TimeoutError past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        answers = []
        for pipe in self.pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"phase {self._phase}: a worker did not answer within {timeout:.0f} s")
            answers.append(pipe.recv())
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            raise RuntimeError(f"phase {self._phase} failed in a worker:\n{errors[0]}")
        return answers

    def run(self, phase: str, timeout: float, **kwargs: Any) -> List[Dict[str, Any]]:
        self.send(phase, **kwargs)
        return self.collect(timeout)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("quit", {}))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def rss_mb(self) -> float:
        """The worker processes' resident memory, MB in all."""
        total = 0
        for proc in self.procs:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                pass
        return total / 1024


def merge_times(answers: List[Dict[str, Any]], key: str = "times") -> Dict[int, float]:
    out: Dict[int, float] = {}
    for a in answers:
        out.update({int(k): v for k, v in a.get(key, {}).items()})
    return out
