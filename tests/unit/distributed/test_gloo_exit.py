"""distributed.gloo_exit: a rank's teardown waits for gloo's worker threads to stop running (else a worker's late
release of a finished collective aborts the process at interpreter shutdown, pytorch#179291). The detection reads
thread names and states from /proc, so these tests name threads of their own and make them run or sleep."""
import ctypes
import hashlib
import sys
import threading

import pytest

from fabriclite.distributed import gloo_exit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and states from /proc")

NAME = "fl_test_worker"  # not gloo's name: a real gloo thread of another test cannot interfere
PR_SET_NAME = 15


def _named(body, started: threading.Event):
    def run() -> None:
        ctypes.CDLL(None).prctl(PR_SET_NAME, NAME.encode(), 0, 0, 0)  # names the calling thread
        started.set()
        body()
    return run


def test_a_running_worker_is_waited_for_until_it_stops():
    stop, started = threading.Event(), threading.Event()
    data = b"x" * 8_000_000

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()  # runs without the GIL: the thread stays runnable, as a busy worker does

    thread = threading.Thread(target=_named(spin, started), daemon=True)
    thread.start()
    started.wait(5)
    try:
        assert any(gloo_exit.running_workers(NAME) == 1 for _ in range(20))  # seen running (it leaves the GIL's
        # wait between two hashes for a moment)
        assert gloo_exit.wait_for_idle_workers(timeout_s=0.3, name=NAME) is False
    finally:
        stop.set()
        thread.join(5)
    assert gloo_exit.wait_for_idle_workers(timeout_s=2.0, name=NAME) is True  # (join returns a moment before the
    assert gloo_exit.running_workers(NAME) == 0                                 # thread's last instructions run)


def test_a_sleeping_worker_is_idle():
    stop, started = threading.Event(), threading.Event()
    thread = threading.Thread(target=_named(lambda: stop.wait(30), started), daemon=True)
    thread.start()
    started.wait(5)
    try:
        assert NAME in _thread_names()  # the thread is there, named, and asleep
        assert gloo_exit.wait_for_idle_workers(timeout_s=2.0, name=NAME) is True
        assert thread.is_alive() and gloo_exit.running_workers(NAME) == 0
    finally:
        stop.set()
        thread.join(5)


def _thread_names():
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names
