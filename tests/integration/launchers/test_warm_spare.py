"""Warm spares (fabriclite/launchers/warm_spare.py): an interpreter started ahead of need becomes a rank that runs
the script exactly as ``python script.py args`` would: its environment, argv, ``__main__``, ``sys.path[0]``, exit
code and output; and when spares are made at all."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fabriclite.launchers.warm_spare import (IMPORT_NICE, LIVE_PRELOAD, READY_NAME, RESTART_PRELOAD, SPARES_ENV, Job,
                                             Spares, SpareWorker, parse_command)
from fabriclite.supervision.agent.output_forwarding import OutputOptions

SCRIPT = """
import os, sys
import helper_beside_the_script
print("RAN", __name__, sys.argv[1:], os.environ["SPARE_TEST"], os.path.basename(__file__), flush=True)
print("STDIN", repr(sys.stdin.read()), flush=True)
raise SystemExit(int(sys.argv[1]))
"""


def spare_script(tmp_path: Path) -> Path:
    (tmp_path / "helper_beside_the_script.py").write_text("")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return script


@pytest.mark.slow
def test_a_spare_runs_the_script_as_python_would(tmp_path: Path) -> None:
    script = spare_script(tmp_path)
    output = OutputOptions(prefix=True)  # captured: its lines come back prefixed
    spare = SpareWorker([sys.executable, str(script), "3", "x y"], output, preload=("json",))
    time.sleep(0.2)  # it waits, imports done, for its job
    assert spare.poll() is None
    worker = spare.become({"SPARE_TEST": "yes"}, output, global_rank=5)
    deadline = time.monotonic() + 120
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    output.close()
    assert worker.poll() == 3  # the script's own exit code


@pytest.mark.slow
def test_a_spare_s_output_and_environment(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    script = spare_script(tmp_path)
    output = OutputOptions(prefix=True)
    worker = SpareWorker([sys.executable, str(script), "0", "x y"], output, preload=()).become(
        {"SPARE_TEST": "yes"}, output, global_rank=5)
    deadline = time.monotonic() + 120
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    output.close()
    out = capfd.readouterr().out
    assert worker.poll() == 0, out
    assert "[rank 5] RAN __main__ ['0', 'x y'] yes job.py" in out, out
    assert "[rank 5] STDIN ''" in out, out  # its stdin is not the supervisor's pipe


def test_spares_only_for_a_restartable_python_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = str(spare_script(tmp_path))
    output = OutputOptions()
    assert Spares.for_job([sys.executable, script], output, max_restarts=1) is not None
    assert Spares.for_job([sys.executable, script], output, max_restarts=0) is None
    assert Spares.for_job([sys.executable, "-m", "pkg"], output, max_restarts=1) is not None
    assert Spares.for_job([sys.executable, "-u", script], output, max_restarts=1) is not None
    assert Spares.for_job([sys.executable, "-c", "pass"], output, max_restarts=1) is None
    live = Spares.for_job([sys.executable, script], output, max_restarts=1, live=True, local_ranks=4)
    restart = Spares.for_job([sys.executable, script], output, max_restarts=1, live=False, local_ranks=4)
    assert live is not None and not live.deferred and live.preload == LIVE_PRELOAD
    assert restart is not None and restart.deferred and restart.preload == RESTART_PRELOAD
    assert "torch._dynamo" in RESTART_PRELOAD and restart.local_ranks == 4
    monkeypatch.setenv(SPARES_ENV, "0")
    assert Spares.for_job([sys.executable, script], output, max_restarts=1) is None
    assert Spares.for_job([sys.executable, script], output, max_restarts=1, live=False) is None


def test_the_launch_forms_a_spare_runs(tmp_path: Path) -> None:
    script = str(spare_script(tmp_path))
    py = sys.executable
    assert parse_command([py, script, "a", "-b"]) == Job([py], script, None, ["a", "-b"])
    assert parse_command([py, "-u", "-X", "importtime", "-W", "error", script, "a"]) == Job(
        [py, "-u", "-X", "importtime", "-W", "error"], script, None, ["a"])
    assert parse_command([py, "-O", "-m", "pkg.mod", "--flag"]) == Job([py, "-O"], None, "pkg.mod", ["--flag"])
    for unsupported in ([py], [py, "-c", "pass"], [py, "-"], [py, "-u"], [py, str(tmp_path / "missing.py")],
                        [py, "-mpkg"], [py, "-uc", "pass"]):
        assert parse_command(unsupported) is None, unsupported
    with pytest.raises(ValueError, match="a warm spare cannot run"):
        SpareWorker([py, "-c", "pass"], OutputOptions(), preload=())


@pytest.mark.slow
def test_a_spare_runs_a_module_as_python_m_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(
        "import os, sys\nprint('RAN', __name__, sys.argv, sys.path[0] == os.getcwd(), sys.flags.optimize, "
        "os.environ['SPARE_TEST'], flush=True)\n")
    monkeypatch.chdir(tmp_path)
    output = OutputOptions(prefix=True)
    worker = SpareWorker([sys.executable, "-O", "-m", "pkg.job", "x"], output, preload=()).become(
        {"SPARE_TEST": "yes"}, output, global_rank=1)
    wait_exit(worker)
    output.close()
    out = capfd.readouterr().out
    assert worker.poll() == 0, out
    assert f"[rank 1] RAN __main__ [{str(tmp_path / 'pkg' / 'job.py')!r}, 'x'] True 1 yes" in out, out


def thread_nices(pid: int) -> dict:
    """Thread id -> nice value, of every thread of ``pid`` (/proc)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])
        except (OSError, IndexError):
            pass  # the thread ended meanwhile
    return found


def wait_exit(worker: SpareWorker) -> None:
    deadline = time.monotonic() + 120
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
def test_a_deferred_spare_imports_at_low_priority_and_runs_the_script_at_normal_priority(
        tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    script = tmp_path / "prio.py"
    script.write_text("import os, sys\nprint('NICE', os.getpriority(os.PRIO_PROCESS, 0), 'torch' in sys.modules, "
                      "open('/proc/self/comm').read().strip() != 'warm-spare', flush=True)\n")
    output = OutputOptions()
    spare = SpareWorker([sys.executable, str(script)], output, preload=("torch",), nice=IMPORT_NICE)
    deadline, main, others = time.monotonic() + 120, set(), set()
    while Path(f"/proc/{spare.pid}/comm").read_text().strip() != READY_NAME and time.monotonic() < deadline:
        nices = thread_nices(spare.pid)
        main.add(nices.pop(spare.pid, 0))
        others.update(nices.values())  # torch's import takes seconds: the import thread is seen at work
        time.sleep(0.005)
    assert main == {0} and IMPORT_NICE in others, (main, others)  # (seen at 0 too: before its setpriority)
    assert spare.poll() is None  # imports done (its name says so), waiting
    spare.become({}, output, global_rank=0)
    wait_exit(spare)
    out = capfd.readouterr().out
    assert spare.poll() == 0 and "NICE 0 True True" in out, out  # the script: normal priority, imports done, renamed


@pytest.mark.slow
def test_spares_top_up_replace_a_dead_one_and_close(tmp_path: Path) -> None:
    script = str(spare_script(tmp_path))
    spares = Spares([sys.executable, script], OutputOptions(), preload=(), local_ranks=2, deferred=True)
    try:
        assert spares.start(0, {}, 0, restart=False) is None and spares.pids == []  # deferred: none yet
        spares.top_up()
        first = spares.pids
        assert len(first) == 2 and spares.pids == first
        spares.top_up()
        assert spares.pids == first  # one per local rank
        os.kill(first[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while spares._waiting[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert spares.start(1, {"SPARE_TEST": "x"}, 1, restart=True) is None  # dead: a cold start instead
        spares.top_up()
        assert spares.pids[0] == first[0] and spares.pids[1] != first[1]
    finally:
        pids = spares.pids
        spares.close()
    assert spares.pids == [] and not any(Path(f"/proc/{pid}").exists() for pid in pids)  # reaped, gone
