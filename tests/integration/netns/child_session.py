"""Run by test_teardown.py in a child pytest (not collected by the main run: the name is not test_*).

It brings the ``cluster`` fixture up, starts in every node a process that ignores SIGTERM, prints
``CLUSTER <prefix> <pids>``, then ends as CHILD_ENDING says: "fail" (an assertion fails) or "wait" (sleeps
until the parent interrupts or kills it).
"""
import os
import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.netns
def test_child(cluster) -> None:
    procs = [cluster.exec(node, ["sh", "-c", "trap '' TERM; while :; do sleep 1; done"], dict(os.environ),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for node in range(cluster.num_nodes)]
    # the parent interrupts with SIGINT: take it as Ctrl-C even where this run inherited it ignored (a job started
    # in the background by a non-interactive shell), or the interrupt never arrives and the parent times out
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"CLUSTER {cluster.prefix} {' '.join(str(p.pid) for p in procs)}", file=sys.stderr, flush=True)
    assert os.environ["CHILD_ENDING"] != "fail", "the failure test_teardown asked for"
    time.sleep(600)
