"""The pieces of live stacks and the hang watch, in-process and fast: parsing py-spy's and faulthandler's dumps,
the summary's order (the rank not waiting first, user frames before library frames, identical stacks merged), the
rank's progress record, the step watch, and the rank bootstrap's handler in a real interpreter (also one still
importing torch, which must not die of the signal)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fabriclite.supervision.rank import progress as rank_progress
from fabriclite.supervision.watch import stacks
from fabriclite.supervision.processes.failures import Failure
from fabriclite.supervision.watch.hangs import HangWatch, hang_timeout, is_hang
from fabriclite.supervision.watch.progress_records import ProgressRecords
from fabriclite.supervision.rank.child import STACK_SIGNAL

PYSPY = '''Process 8924: python3 train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 8924 (idle): "MainThread"
    __getitem__ (/home/me/train.py:15)
    fetch (/usr/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py:54)
    main (/home/me/train.py:29)
    <module> (/home/me/train.py:46)
Thread 8966 (idle): "worker"
    wait (/usr/lib/python3.11/threading.py:331)
'''
FAULTHANDLER = '''Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/home/me/train.py", line 5 in helper

Current thread 0x00007f0000000002 (most recent call first):
  File "/home/me/train.py", line 15 in __getitem__
  File "/home/me/train.py", line 46 in <module>
'''


def test_both_dump_formats_parse_into_threads_innermost_first():
    threads = stacks.parse_pyspy(PYSPY)
    assert [t.name for t in threads] == ["MainThread", "worker"]
    assert threads[0].frames[0] == stacks.Frame("__getitem__", "/home/me/train.py", 15)
    assert [f.is_user for f in threads[0].frames] == [True, False, True, True]
    threads = stacks.parse_faulthandler(FAULTHANDLER.replace("line 15", "line 16"))
    assert [t.name for t in threads] == ["thread 0x00007f0000000001", "current thread 0x00007f0000000002"]
    assert threads[1].frames[0] == stacks.Frame("__getitem__", "/home/me/train.py", 16)


def test_user_files_are_not_pythons_packages_or_fabriclites():
    assert stacks.is_user_file("/home/me/train.py")
    assert not stacks.is_user_file(stacks.__file__)
    assert not stacks.is_user_file(os.__file__)
    assert not stacks.is_user_file("/x/lib/python3.11/site-packages/torch/nn/modules/module.py")
    assert not stacks.is_user_file("<frozen importlib._bootstrap>")


def _stack(rank: int, frames):
    return stacks.RankStack(rank, 100 + rank, "py-spy dump", [stacks.Thread("MainThread", list(frames))])


def test_the_summary_puts_the_rank_not_waiting_first_and_merges_identical_stacks():
    waiting = [stacks.Frame("_engine_run_backward", "/x/site-packages/torch/autograd/graph.py", 979),
               stacks.Frame("main", "/home/me/train.py", 37)]
    stuck = [stacks.Frame("time_sleep", "/usr/lib/python3.11/site-packages/lib.py", 3),
             stacks.Frame("__getitem__", "/home/me/train.py", 15)]
    taken = {0: _stack(0, waiting), 1: _stack(1, waiting), 2: _stack(2, stuck), 3: _stack(3, waiting)}
    records = {r: None for r in taken}
    text = stacks.format_stacks(taken, records, 0, "hung")
    lines = text.splitlines()
    assert lines[0].startswith("--- live stacks of node 0's ranks (hung; all threads; py-spy dump)")
    assert lines[1].startswith("rank 2:  <- not waiting on the others")
    assert "ranks 0, 1, 3:" in text and text.count('train.py", line 37') == 1
    block = text[text.index("rank 2:"):text.index("ranks 0, 1, 3:")]
    assert block.index('train.py", line 15, in __getitem__') < block.index("lib.py")  # user frames first


def test_progress_records_steps_collectives_and_waits(tmp_path, monkeypatch):
    path = str(tmp_path / "progress")
    rank_progress.create(path)
    assert rank_progress.read(path) is None  # no rank opened it yet
    record = rank_progress.RankProgress(path)
    record.collective_entered("all_reduce", 4)
    seen = rank_progress.read(path)
    assert seen["inside"] and seen["entered"] == 4 and seen["entered_name"] == "all_reduce" and seen["waiting_since"]
    assert "in all_reduce #4 for" in rank_progress.describe(seen)
    record.collective_finished("all_reduce", 4)
    record.step_done()
    seen = rank_progress.read(path)
    assert not seen["inside"] and seen["finished"] == 4 and seen["steps"] == 1 and seen["waiting_since"] is None
    assert rank_progress.describe(seen).startswith("in no collective; last finished all_reduce #4; last optimizer "
                                                   "step 1 (")


def test_the_step_watch_is_armed_by_the_first_step_and_fires_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRICLITE_HANG_TIMEOUT", "0.3")
    monkeypatch.setenv("FABRICLITE_STACKS", "off")
    progress = ProgressRecords(lambda r: r)
    progress.tmpdir = str(tmp_path)
    watch = HangWatch(0, progress, timeout_s=100.0)
    env = progress.rank_env(0)
    workers = {0: (os.getpid(), True)}
    record = rank_progress.RankProgress(env[rank_progress.PROGRESS_FILE_ENV])
    time.sleep(0.6)
    assert watch.observe(progress.view(workers)) == []  # no step yet: start-up is no hang
    record.step_done()
    assert progress.view(workers) is None  # read less than CHECK_EVERY_S ago
    progress._next_read = 0.0
    assert watch.observe(progress.view(workers)) == []
    time.sleep(0.6)
    progress._next_read = 0.0
    events = watch.observe(progress.view(workers))
    assert [(e.kind, e.ends_round) for e in events] == [("hang", True)]
    assert "no rank of node 0 completed an optimizer step for 1 s (hang timeout 0.3 s" in events[0].fields["reason"]


def test_hang_settings_and_what_counts_as_a_hang(monkeypatch):
    monkeypatch.setenv("FABRICLITE_HANG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"\$FABRICLITE_HANG_TIMEOUT='soon' is not a number of seconds"):
        hang_timeout(10)
    monkeypatch.delenv("FABRICLITE_HANG_TIMEOUT")
    assert hang_timeout(10) == 10
    timeout = Failure(0, 1, 1, 1, error="CollectiveTimeout: fabriclite: all_reduce #3 timed out after 5 s")
    gloo = Failure(0, 1, 1, 1, error="RuntimeError: [gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    lost = Failure(0, 1, 1, 1, error="PeerLost: timed out", secondary=True)
    assert is_hang(timeout) and is_hang(gloo)
    assert not is_hang(lost) and not is_hang(Failure(0, 1, 1, 1, error="ValueError: boom"))


def _start(tmp_path, code: str):
    stack_file = str(tmp_path / "stack.txt")
    env = {**os.environ, **stacks.rank_env(stack_file, os.environ.get("PYTHONPATH", ""))}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(stack_file) and time.monotonic() < deadline:
        time.sleep(0.005)
    return proc, stack_file


@pytest.mark.slow  # a fresh rank process importing torch: 1.8 s alone, 35 s at load 19
def test_the_bootstrap_handler_answers_even_while_the_rank_imports_torch(tmp_path, monkeypatch):
    # the handler is installed before the script runs: signalled while it imports torch, it dumps and goes on
    proc, stack_file = _start(tmp_path, "import os, sys, torch; print('imported', os.environ.get('PYTHONPATH'), "
                                        "'FABRICLITE_STACK_FILE' in os.environ, flush=True)")
    monkeypatch.setenv("FABRICLITE_STACKS", "handler")
    taken = stacks.take({0: (proc.pid, stack_file)})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert taken[0].method == "faulthandler" and taken[0].threads, taken
    # the bootstrap's own traces are gone before the script runs: not on PYTHONPATH, no stack file for children
    assert stacks.BOOTSTRAP_DIR not in out and out.strip().endswith("False"), out
    assert STACK_SIGNAL > 0


def test_pyspy_reads_a_live_rank_and_names_its_threads(tmp_path):
    if stacks.pyspy_path() is None:
        pytest.skip("py-spy is not installed (pip install py-spy; it is in the test extra)")
    proc, stack_file = _start(tmp_path, "import threading, time\n"
                                        "threading.Thread(target=time.sleep, args=(60,), name='sleeper', daemon=True)"
                                        ".start()\nprint('up', flush=True)\ntime.sleep(60)\n")
    try:
        assert proc.stdout.readline().strip() == "up"
        taken = stacks.take({3: (proc.pid, stack_file)})[3]
    finally:
        proc.kill()
        proc.wait()
    assert taken.method == "py-spy dump", taken
    assert {t.name for t in taken.threads} == {"MainThread", "sleeper"}


def test_fabriclite_frames_are_not_the_users_code_when_imported_from_a_source_tree() -> None:
    import fabriclite
    import fabriclite.strategies.base

    root = os.path.dirname(os.path.abspath(fabriclite.__file__))
    assert stacks.package_root() == root
    for module in (fabriclite.fabric, fabriclite.precision, fabriclite.strategies.base, stacks):
        assert not stacks.is_user_file(module.__file__), module.__file__
    assert stacks.is_user_file(os.path.join(os.path.dirname(root), "train.py"))  # a script beside the package
