"""Warm spares (fabriclite/launchers/warm_spare.py): an interpreter started ahead of need becomes a rank that runs
the script exactly as ``python script.py args`` would: its environment, argv, ``__main__``, ``sys.path[0]``, exit
code and output; and when spares are made at all."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fabriclite.launchers.warm_spare import SPARES_ENV, Spares, SpareWorker
from fabriclite.supervision.output_forwarding import OutputOptions

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


def test_spares_only_for_a_restartable_python_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = str(spare_script(tmp_path))
    output = OutputOptions()
    assert Spares.for_job([sys.executable, script], output, max_restarts=1) is not None
    assert Spares.for_job([sys.executable, script], output, max_restarts=0) is None
    assert Spares.for_job([sys.executable, "-m", "pkg"], output, max_restarts=1) is None
    assert Spares.for_job([sys.executable, "-u", script], output, max_restarts=1) is None
    monkeypatch.setenv(SPARES_ENV, "0")
    assert Spares.for_job([sys.executable, script], output, max_restarts=1) is None
