"""First contact: ranks' printed lines (up to 4 KiB) arrive whole in every launch mode, with and without
--rank-prefix, even under PYTHONUNBUFFERED=1 (which splits a print into text and newline writes); a progress
bar redrawing with \\r stays live."""
from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

from helpers import clean_env, run, write_script

pytestmark = pytest.mark.slow
N = 60

LINES = """
    import sys
    from fabriclite import Fabric

    def body(fabric):
        ch = "AB"[fabric.global_rank]
        for i in range({n}):
            print(ch * 4095)                          # 4 KiB with its newline
            print(ch + "-" + str(i), ch * 100, "end", sep="|")  # several writes per print unbuffered
        return 0

    mode = sys.argv[1]
    if mode == "script":
        fabric = Fabric(accelerator="cpu", devices=2)
        fabric.launch()
        body(fabric)
    elif mode == "cli":
        body(Fabric())
    elif __name__ == "__main__":
        Fabric(accelerator="cpu", devices=2, strategy=mode).launch(body)
"""


@pytest.mark.parametrize("mode", ["script", "ddp_spawn", "ddp_fork", "cli", "cli-prefix"])
def test_lines_arrive_whole(tmp_path, mode):
    script = str(write_script(tmp_path, LINES.format(n=N)))
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if mode.startswith("cli"):
        flags = ["--rank-prefix"] if mode == "cli-prefix" else []
        result = run([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2", *flags,
                      script, "cli"], env=env, timeout=120)
    else:
        result = run([sys.executable, script, mode], env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    if mode == "cli-prefix":
        assert all(re.match(r"\[rank [01]\] ", line) for line in lines), [ln[:40] for ln in lines[:5]]
        lines = [line.split("] ", 1)[1] for line in lines]
    for ch in "AB":
        assert lines.count(ch * 4095) == N, mode
        assert sorted(line for line in lines if line.startswith(ch + "-")) == \
            sorted(f"{ch}-{i}|{ch * 100}|end" for i in range(N))
    assert len(lines) == 4 * N, [line[:30] for line in lines if len(line) not in (4095,) and "|end" not in line][:5]


BAR = """
    import os, sys, time
    from fabriclite import Fabric

    def wait_for(name):
        path = os.path.join(sys.argv[1], name)
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise SystemExit("the test never saw the output: " + name)
            time.sleep(0.01)

    fabric = Fabric()
    if fabric.global_rank == 0:
        sys.stdout.write("\\rstep 1")   # no newline, no flush: the \\r must push it out
        wait_for("go1")
        sys.stdout.write("\\rstep 2\\n")
    else:
        wait_for("go0")
        print("hello from 1")
"""


def _read_until(proc: subprocess.Popen, seen: bytearray, needle: bytes, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {needle!r}; got {bytes(seen)!r}"
        if select.select([proc.stdout], [], [], left)[0]:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"output ended before {needle!r}; got {bytes(seen)!r}"
            seen += chunk


@pytest.mark.parametrize("prefix", [False, True])
def test_progress_bar_stays_live(tmp_path, prefix):
    script = str(write_script(tmp_path, BAR))
    flags = ["--rank-prefix"] if prefix else []
    env = clean_env({"OMP_NUM_THREADS": "1"})
    del env["PYTHONUNBUFFERED"]  # block-buffered stdout by default: fabriclite must line-buffer it
    proc = subprocess.Popen([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2",
                             *flags, script, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = bytearray()
    try:
        _read_until(proc, seen, b"step 1")  # drawn while rank 0 is still waiting: live
        (tmp_path / "go0").touch()
        _read_until(proc, seen, b"hello from 1")
        (tmp_path / "go1").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    seen += out
    assert proc.returncode == 0, err.decode()
    if prefix:  # the supervisor ends the open bar line before rank 1's line; the bar redraws on the next
        assert bytes(seen) == b"\r[rank 0] step 1\n[rank 1] hello from 1\n\r[rank 0] step 2\n"
    else:
        assert bytes(seen) == b"\rstep 1hello from 1\n\rstep 2\n"
