"""Draw docs/report_page.png: the page `fabriclite report` writes for a real job, shot in headless Chromium.

The job: two nodes of 2 CPU ranks on this machine (two `fabriclite run`), `--max-restarts 1`; a checkpoint every
SAVE_EVERY steps that holds the loop for a moment; rank 3 slower than the others (a straggler); rank 2 SIGKILLed at
step KILL_AT of the first round, so both nodes restart and resume from the last checkpoint.

    .venv/bin/python scripts/report_page.py [--output docs/report_page.png] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

JOB = r'''
import os, signal, time
import torch
from fabriclite import Fabric

STEPS, SAVE_EVERY, KILL_AT = 90, 25, 60


class Slow:  # a checkpoint that holds the loop
    def state_dict(self):
        time.sleep(0.4)
        return {}

    def load_state_dict(self, state):
        pass


fabric = Fabric()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0, "slow": Slow()}
fabric.load_latest(os.environ["CKPT"], state)
while state["step"] < STEPS:
    fabric.backward(model(torch.randn(16, 8)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(0.06 + (0.04 if fabric.global_rank == 3 else 0.0))
    state["step"] += 1
    if state["step"] % SAVE_EVERY == 0:
        fabric.save(os.path.join(os.environ["CKPT"], f"step-{state['step']}.ckpt"), state, keep=2)
    if state["step"] == KILL_AT and fabric.global_rank == 2 and fabric.restart_count == 0:
        os.kill(os.getpid(), signal.SIGKILL)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join("docs", "report_page.png"))
    parser.add_argument("--keep", default=None, help="run in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("report_page.py: error: no chromium on PATH (Debian: apt-get install chromium)")
    work = args.keep or tempfile.mkdtemp(prefix="fabriclite-report-page-")
    os.makedirs(work, exist_ok=True)
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(JOB))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CKPT": os.path.join(work, "ckpt"),
           "FABRICLITE_LOG_DIR": os.path.join(work, "events"), "FABRICLITE_RUN_ID": "report-page-demo",
           "FABRICLITE_STEPS_EVERY": "1", "FABRICLITE_STRAGGLER_WINDOW": "10", "FABRICLITE_STRAGGLER_WINDOWS": "2"}
    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2",
                               "--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1",
                               "--main-port", port, "--max-restarts", "1", "train.py"], env=env, cwd=work)
             for node in (0, 1)]
    codes = [p.wait(timeout=600) for p in nodes]
    if codes != [0, 0]:
        raise SystemExit(f"report_page.py: error: the job ended with exit codes {codes}")
    page = os.path.join(work, "report.html")
    subprocess.run([sys.executable, "-m", "fabriclite", "report", os.path.join(work, "events"), "--output", page],
                   check=True)
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={os.path.join(work, 'browser')}", f"--screenshot={os.path.abspath(args.output)}",
                    "--window-size=1280,1240", "file://" + page], check=True, capture_output=True)
    print(f"report_page.py: {args.output} (from {page})")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
