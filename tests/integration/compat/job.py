"""Runs compat programs in this process and saves what each returned: ``job.py OUTDIR cli|spawn PROGRAM...``.

``cli``: started on every rank by ``fabric run`` / ``fabriclite run``; writes ``OUTDIR/rank<R>.pt``.
``spawn``: a plain ``python`` process whose programs launch their own ranks; writes ``OUTDIR/spawn.pt``.
A program that raises is recorded as ``{"error": traceback}`` and the next one runs.
"""
import atexit
import importlib
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _destroy_group_at_exit() -> None:
    """Lightning Fabric leaves a rank's process group alive when the rank ends (fabriclite's teardown does what
    follows itself, so this is a no-op there). A gloo worker thread that releases a finished collective after the
    interpreter started shutting down kills the rank with SIGABRT ("terminate called without an active exception",
    pytorch#179291) after its results are sent. So, while the interpreter is whole: wait for gloo's workers to go
    idle (fabriclite.distributed.gloo_exit says why), then destroy the group, as torch asks every program to. It
    runs in every rank, ``cli`` or spawned (a spawned rank imports this file as ``__mp_main__``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from fabriclite.distributed.gloo_exit import wait_for_idle_workers

        wait_for_idle_workers()
        dist.destroy_process_group()


atexit.register(_destroy_group_at_exit)


def run_all(outdir, names):
    results = {}
    for name in names:
        workdir = os.path.join(outdir, name)
        os.makedirs(workdir, exist_ok=True)
        try:
            results[name] = importlib.import_module(name).main(workdir)
        except BaseException:  # noqa: BLE001 -- recorded, compared by the test
            results[name] = {"error": traceback.format_exc()}
            print(results[name]["error"], file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    outdir, mode, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    results = run_all(outdir, names)
    if mode == "cli":
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    else:
        torch.save(results, os.path.join(outdir, "spawn.pt"))
