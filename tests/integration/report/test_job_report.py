"""``fabriclite report`` of real jobs, rendered by a real browser: a crash and restart (rank 1 SIGKILLed after step 7,
``--max-restarts 1``, a checkpoint every 5 steps), a preemption (SIGUSR1 to the supervisor, the ranks save and exit
75) and a hang (a deadlocked rank, ended by the 3 s step watch, with its stacks). The three jobs run together.

Each job's page is loaded in headless Chromium (Debian's ``chromium``): it loads with no console message (a script
error or a fetch the page's content security policy blocked would be one), and the rendered DOM (``--dump-dom``)
holds one mark per failure, restart, checkpoint, preemption notice and hang event of the record, counted from the
JSON lines themselves. ``--format perfetto`` gives events with ``name``, ``ph``, ``ts``, ``pid``, ``tid`` (and
``dur`` for ``X``). The record is schema 2's: the page shows the command and, from the ``steps`` events (every
0.5 s here), each rank's steps per second. Without Chromium the page tests skip, unless
``FABRICLITE_REQUIRE_CHROMIUM=1`` (``.ci/run`` installs it and sets that) makes them fail."""
from __future__ import annotations

import contextlib
import html
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from fabriclite import cli
from faults_harness import Job, kill_tree
from hang_harness import hang_script
from restart_harness import SCRIPT as RESTART_SCRIPT

pytestmark = pytest.mark.slow

#: the kinds of marks counted, and the events they stand for
COUNTED = {"failure": "failure", "restart": "restart", "checkpoint": "checkpoint",
           "preemption": "preemption_notice", "hang": "hang"}
#: each job ended within this; they took 25-45 s together at load 6-9 on the 2-core machine (start-up dominates)
JOB_TIMEOUT_S = 180


def _cli_run(*flags: str) -> List[str]:
    return [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", *flags,
            RESTART_SCRIPT]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The three jobs, run together; each one's run folder (no --log-dir: ``$XDG_STATE_HOME/fabriclite/runs/<run
    id>/``, as the summary of a failed or preempted job names it)."""
    tmp = tmp_path_factory.mktemp("report")
    folders = {name: tmp / name for name in ("crash", "preempt", "hang")}
    common = {"FABRICLITE_RESTART_BACKOFF": "0.05", "STEPS": "12", "FABRICLITE_STEPS_EVERY": "0.5"}
    started = [
        Job("crash", _cli_run("--max-restarts", "1"), {**common, "KILL_AT": "7:1", "CKPT_DIR": str(
            folders["crash"] / "ckpt"), "OUT": str(folders["crash"] / "w.pt")}, timeout=JOB_TIMEOUT_S),
        Job("preempt", _cli_run("--preempt-grace", "60"), {**common, "WAIT_AT": "4", "CHECK_PREEMPTED": "1",
                                                          "CKPT_DIR": str(folders["preempt"] / "ckpt"),
                                                          "OUT": str(folders["preempt"] / "w.pt")},
            timeout=JOB_TIMEOUT_S),
        Job("hang", [sys.executable, str(hang_script(tmp))], {"HANG": "deadlock", "FABRICLITE_TIMEOUT": "30",
                                                               "FABRICLITE_HANG_TIMEOUT": "3",
                                                               "FABRICLITE_STACKS": "handler"},
            timeout=JOB_TIMEOUT_S),
    ]
    began = time.time()
    try:
        for job in started:
            job.env.update({"XDG_STATE_HOME": str(folders[job.name] / "state"),
                            "FABRICLITE_RUN_ID": f"report_{job.name}"})
            job.start()
        signalled = False
        while not all([job.poll() for job in started]):
            preempt = started[1]
            if not signalled and any("WAITING" in line for line in list(preempt.out)):
                assert preempt.proc is not None
                preempt.proc.send_signal(signal.SIGUSR1)
                signalled = True
            time.sleep(0.05)
    except BaseException:
        for job in started:
            kill_tree(job)
        raise
    print(f"3 jobs in {time.time() - began:.1f} s")
    codes = {job.name: job.returncode for job in started}
    assert codes["crash"] == 0, started[0].output
    assert codes["preempt"] == 75, started[1].output
    assert codes["hang"] not in (0, None), started[2].output
    runs = {name: folders[name] / "state" / "fabriclite" / "runs" / f"report_{name}" for name in folders}
    named = re.search(r"this run's events are in (\S+) ", "".join(started[2].err))  # the failed job says where
    assert named and Path(named.group(1)) == runs["hang"], started[2].output
    return runs


def record(folder: Path) -> List[dict]:
    """The job's events, read as docs/reliability.md shows (independently of fabriclite.report)."""
    return [json.loads(line) for path in sorted(folder.glob("events-node*.jsonl"))
            for line in path.read_text().splitlines()]


def report(folder: Path, *flags: str) -> str:
    """``fabriclite report`` of the job's events folder (the CLI's ``main``, in this process); what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["report", str(folder), *flags]) == 0
    return out.getvalue()


def chromium() -> str:
    """The browser, or skip (fail under FABRICLITE_REQUIRE_CHROMIUM=1)."""
    found = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                  if shutil.which(name)), None)
    if found is None:
        if os.environ.get("FABRICLITE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("FABRICLITE_REQUIRE_CHROMIUM=1 but no chromium on PATH: apt-get install chromium")
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    return found


def render(page: Path, profile: Path) -> tuple:
    """``(DOM after the page's script ran, console messages)`` of ``page`` in headless Chromium."""
    done = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--dump-dom",
                           page.as_uri()], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return done.stdout, console


@pytest.mark.parametrize("name", ["crash", "preempt", "hang"])
def test_the_page_of_a_real_job_loads_cleanly_with_one_mark_per_event(jobs, name, tmp_path) -> None:
    folder = jobs[name]
    events = record(folder)
    expected = {kind: sum(1 for e in events if e["event"] == event) for kind, event in COUNTED.items()}
    # what each job must have shown, so that equal counts cannot come from an empty page
    needed = {"crash": ("failure", "restart", "checkpoint"), "preempt": ("preemption", "checkpoint"),
              "hang": ("failure", "hang")}[name]
    assert all(expected[k] >= 1 for k in needed), (expected, events)
    page = tmp_path / "report.html"
    assert str(page) in report(folder, "--output", str(page))
    dom, console = render(page, tmp_path / "profile")
    assert console == [], console
    found = re.findall(r'data-mark="(\w+)"', dom)
    assert {kind: found.count(kind) for kind in COUNTED} == expected
    assert f"report_{name}" in dom and "Goodput" in dom
    # schema 2: the command, and each rank's steps per second (one bar per rank and steps event)
    start = next(e for e in events if e["event"] == "job_start")
    assert start["schema"] == "fabriclite.events/2" and html.escape(shlex.join(start["command"]), quote=False) in dom
    rates = sum(len(e["per_second"]) for e in events if e["event"] == "steps")
    assert dom.count('class="rate"') == rates and (rates > 0 or name == "hang"), events
    if name == "crash":
        assert "killed by SIGKILL" in dom  # the failure's cause
    if name == "hang":
        assert ", in deadlock" in dom  # the hung rank's stack (hang_harness's deadlock())


def test_the_perfetto_trace_has_the_required_fields(jobs, tmp_path) -> None:
    out = tmp_path / "trace.json"
    report(jobs["crash"], "--format", "perfetto", "-o", str(out))
    events = json.loads(out.read_text())["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(e) and (e["ph"] != "X" or e["dur"] >= 0), e
    names = [e["name"] for e in events if e["ph"] in ("X", "i")]
    assert names.count("round 0") == 1 and names.count("round 1") == 1 and names.count("failure") == 1, names
    assert names.count("checkpoint") == sum(1 for e in record(jobs["crash"]) if e["event"] == "checkpoint")
