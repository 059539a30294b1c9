"""Warm spares under ``fabriclite run --max-restarts`` (launchers/warm_spare.py), with real ranks and a real SIGKILL
(tests/support/restart_script.py on 2 ranks): the new round's ranks are the spares that waited (their pids, their
processes started before the kill), the job ends with the weights of the run that never stopped, and nothing is left
behind; ``--no-warm-spares`` starts the new round cold; a supervisor SIGKILLed while its spares wait leaves no
process; the first restart is immediate and the second backs off."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest

from restart_harness import DEADLINE_S, SCRIPT, _command, _env, reference, same, weights  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow
#: the backoff before the second restart in the crash-loop job (the first is immediate)
BACKOFF_S = 2.0
#: every process of a job is gone this long after its end (ranks and spares die with the supervisor: PDEATHSIG;
#: measured 0.23-0.26 s at load 11 for ranks, test_checkpoint_faults.py; 40x margin for a loaded machine)
GONE_S = 10.0


def processes_naming(path: str) -> List[int]:
    """Live processes whose command line names ``path`` (a test's own copy of the script: a spare's names it too)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if path in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry))
            except OSError:
                pass
    return found


def gone(path: str) -> bool:
    deadline = time.monotonic() + GONE_S
    while processes_naming(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not processes_naming(path)


def phases(out: str, name: str) -> List[Dict[str, float]]:
    return [{"rank": int(r), "t": float(t), "pid": int(p)}
            for r, t, p in re.findall(rf"PHASE {name} rank=(\d+) t=([\d.]+) pid=(\d+)", out)]


def job(tmp: Path, name: str, flags: List[str], env: Dict[str, str]) -> subprocess.Popen:
    folder = tmp / name
    folder.mkdir()
    script = folder / "restart_copy.py"
    shutil.copy(SCRIPT, script)
    full = _env({"CKPT_DIR": str(folder / "ckpt"), "OUT": str(folder / "w.pt"), "PHASES": "1",
                 "PYTHONUNBUFFERED": "1", **env})
    proc = subprocess.Popen(_command(flags, str(script)), env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.script, proc.folder = str(script), folder  # type: ignore[attr-defined]
    return proc


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, tuple]:
    """The jobs, run at once (3 jobs of 2 ranks on the shared 2 cores), each ``(proc, stdout, stderr)``."""
    tmp = tmp_path_factory.mktemp("spares")
    kill = {"KILL_AT": "13:1"}
    procs = {
        "spares": job(tmp, "spares", ["--max-restarts", "1"], {**kill, "WAIT_SPARES": "13:1"}),
        "cold": job(tmp, "cold", ["--max-restarts", "1", "--no-warm-spares"], kill),
        "loop": job(tmp, "loop", ["--max-restarts", "2", "--log-dir", str(tmp / "loop" / "logs")],
                    {**kill, "KILL_ALWAYS": "1", "FABRICLITE_RESTART_BACKOFF": str(BACKOFF_S)}),
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=DEADLINE_S)
        results[name] = (proc, out, err)
    return results


def test_the_new_round_s_ranks_are_the_spares_and_nothing_is_left(jobs, reference) -> None:
    proc, out, err = jobs["spares"]
    assert proc.returncode == 0, out + err
    assert "restarting every rank now (round 1, restart 1 of 1)" in err  # the first restart: immediate
    spares = {int(p) for p in re.search(r"SPARES READY pids=([\d,]+) ", out).group(1).split(",")}
    killed = float(re.search(r"KILLED t=([\d.]+)", out).group(1))
    new_ranks = {p["pid"] for p in phases(out, "stepped")[2:]}  # round 1's first step, on both ranks
    assert len(spares) == 2 and new_ranks == spares, out
    round1 = [p for p in phases(out, "start") if p["pid"] in new_ranks]
    assert len(round1) == 2 and all(p["t"] < killed for p in round1), out  # their processes predate the failure
    assert "ROUND 1 resumed from step-0010.ckpt at step 10" in out, out
    assert same(weights(str(proc.folder / "w.pt")), reference)
    assert gone(proc.script), processes_naming(proc.script)  # no rank, no spare left


def test_no_warm_spares_starts_the_new_round_cold(jobs, reference) -> None:
    proc, out, err = jobs["cold"]
    assert proc.returncode == 0, out + err
    killed = float(re.search(r"KILLED t=([\d.]+)", out).group(1))
    starts = phases(out, "start")
    assert len(starts) == 4 and all(p["t"] > killed - 0.02 for p in starts[2:]), out  # new processes (10 ms ticks)
    assert same(weights(str(proc.folder / "w.pt")), reference)
    assert gone(proc.script)


def test_the_first_restart_is_immediate_and_a_crash_loop_backs_off(jobs) -> None:
    proc, out, err = jobs["loop"]
    assert proc.returncode == 137, out + err  # SIGKILLed in every round: the restarts are used up
    assert "restarting every rank now (round 1, restart 1 of 2)" in err
    assert f"restarting every rank in {BACKOFF_S:g} s (round 2, restart 2 of 2)" in err
    events = [json.loads(line) for line in (proc.folder / "logs" / "events-node0.jsonl").read_text().splitlines()]
    assert [e["backoff"] for e in events if e["event"] == "restart"] == [0, BACKOFF_S]
    ends = {e["round"]: e["time"] for e in events if e["event"] == "round_end"}
    starts = {e["round"]: e["time"] for e in events if e["event"] == "round_start"}
    assert starts[2] - ends[1] >= BACKOFF_S, events
    assert gone(proc.script)


def test_a_supervisor_killed_while_its_spares_wait_leaves_no_process(tmp_path: Path) -> None:
    proc = job(tmp_path, "killed", ["--max-restarts", "1"], {"WAIT_SPARES": "3:0", "WAIT_AT": "3"})
    seen = []
    deadline = time.monotonic() + DEADLINE_S
    assert proc.stdout is not None
    for line in proc.stdout:  # rank 0 waits for the spares, then for a preemption signal that never comes
        seen.append(line)
        if line.startswith("WAITING"):
            break
        assert time.monotonic() < deadline, "".join(seen)
    spares = [int(p) for p in re.search(r"SPARES READY pids=([\d,]+) ", "".join(seen)).group(1).split(",")]
    assert len(spares) == 2 and all(pid in processes_naming(proc.script) for pid in spares), "".join(seen)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert gone(proc.script), processes_naming(proc.script)
