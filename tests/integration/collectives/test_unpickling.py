"""Nothing unpickled from strangers (issue 42, part 3), on real ranks (a 2-rank gloo pool): an object whose
``__reduce__`` would run code, sent by one rank, raises ``pickle.UnpicklingError`` on the ranks that receive it,
naming its class and ``fabriclite.add_safe_globals``, and its code never runs (no marker file appears); the
default types and the classes a user allows still travel."""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import pickle
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fabriclite


class Planted:
    """Creates the file ``marker`` when unpickled by a plain ``pickle.loads``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class PlantedBySystem(Planted):
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class PlantedInState:
    """Creates the file ``marker`` in ``__setstate__``: its pickle names this class itself."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __getstate__(self):
        return {"marker": self.marker}

    def __setstate__(self, state):
        open(state["marker"], "w").close()


PLANTED = {"exec": (Planted, "builtins.exec"), "system": (PlantedBySystem, "system"),
           "setstate": (PlantedInState, "test_unpickling.PlantedInState")}


@dataclass
class AllowedConfig:
    """A user's dataclass, allowed with fabriclite.add_safe_globals in the test that sends it."""
    lr: float
    tags: tuple


@dataclass
class NotAllowedConfig:
    lr: float


def _outcome(fn):
    try:
        return ("ok", fn())
    except pickle.UnpicklingError as err:
        return ("UnpicklingError", str(err))


def _hostile(fabric, marker: str, how: str):
    """Every way an object reaches another rank, with a planted object from rank 0 (or every rank)."""
    rank = fabric.global_rank
    planted = PLANTED[how][0](marker)
    out = {}
    out["broadcast"] = _outcome(lambda: type(fabric.broadcast(planted if rank == 0 else None, src=0)).__name__)
    out["broadcast_nested"] = _outcome(
        lambda: type(fabric.broadcast({"w": torch.ones(2), "x": [planted]} if rank == 0 else None)).__name__)
    out["all_gather"] = _outcome(lambda: len(fabric.all_gather({"t": torch.ones(1), "obj": planted})["obj"]))
    out["gather"] = _outcome(lambda: fabric.gather({"obj": planted}, dst=1) is None)
    out["all_gather_object"] = _outcome(lambda: len(fabric.strategy.all_gather_object(planted)))
    out["broadcast_object"] = _outcome(
        lambda: type(fabric.strategy.broadcast_object(planted if rank == 0 else None, 0)).__name__)
    out["usable_after"] = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
    return out


@pytest.mark.parametrize("how", sorted(PLANTED))
def test_planted_objects_are_refused_on_the_receiving_ranks(pool2, tmp_path, how):
    marker = str(tmp_path / "marker")
    cls, named = PLANTED[how]
    # the payload works: a plain pickle.loads runs it
    pickle.loads(pickle.dumps(cls(str(tmp_path / "control"))))
    assert os.path.exists(tmp_path / "control")

    r0, r1 = pool2.run(_hostile, marker, how)
    assert not os.path.exists(marker), "the planted object's code ran"
    for rank, results in ((0, r0), (1, r1)):
        assert results.pop("usable_after") == 2.0
        for call, (kind, message) in results.items():
            receives = rank == 1 or call not in ("broadcast", "broadcast_nested", "broadcast_object")
            receives = receives and not (call == "gather" and rank == 0)
            if receives:
                assert kind == "UnpicklingError", (rank, call, kind, message)
                assert named in message, message  # what the pickle asked for: the class, or its __reduce__'s callable
                assert "fabriclite.add_safe_globals" in message, message
            else:  # the sender gets its own object back, unpickled nowhere
                assert kind == "ok", (rank, call, kind, message)


def _classes(fabric):
    rank = fabric.global_rank
    out = {}
    out["refused"] = _outcome(lambda: fabric.broadcast(NotAllowedConfig(0.1) if rank == 0 else None))
    fabriclite.add_safe_globals([AllowedConfig])
    out["allowed"] = _outcome(lambda: fabric.broadcast(AllowedConfig(0.5, ("a",)) if rank == 0 else None))
    out["allowed_gathered"] = _outcome(lambda: fabric.strategy.all_gather_object(AllowedConfig(rank, ())))
    return out


def test_a_users_class_needs_add_safe_globals(pool2):
    r0, r1 = pool2.run(_classes)
    kind, message = r1["refused"]
    assert kind == "UnpicklingError" and "NotAllowedConfig" in message
    assert "fabriclite.add_safe_globals([NotAllowedConfig])" in message
    assert r0["refused"] == ("ok", NotAllowedConfig(0.1))
    assert r1["allowed"] == ("ok", AllowedConfig(0.5, ("a",)))
    assert r0["allowed_gathered"] == r1["allowed_gathered"] == ("ok", [AllowedConfig(0, ()), AllowedConfig(1, ())])


def _defaults(fabric):
    rank = fabric.global_rank
    value = {
        "path": pathlib.Path("/data") / f"r{rank}", "when": datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc),
        "args": argparse.Namespace(lr=0.1, name="run"), "ordered": OrderedDict(b=1, a=2), "array": np.arange(3) + rank,
        "dtype": np.dtype("float32"), "torch": (torch.float16, torch.device("cpu"), torch.Size([2, 3])),
        "builtins": (1, 2.5, 3j, True, "s", b"b", None, {1, 2}, frozenset([3]), slice(1, 2), range(4)),
        "nested_tensor": [{"rng": torch.arange(4, dtype=torch.uint8) + rank}],
    }
    got = fabric.broadcast(value if rank == 0 else None)
    gathered = fabric.strategy.all_gather_object(value)
    return got, gathered


def test_the_types_users_broadcast_most_travel_by_default(pool2):
    (b0, g0), (b1, g1) = pool2.run(_defaults)
    assert b1["path"] == pathlib.Path("/data/r0") and b1["args"] == argparse.Namespace(lr=0.1, name="run")
    assert b1["when"] == datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)
    assert list(b1["ordered"]) == ["b", "a"] and isinstance(b1["ordered"], OrderedDict)
    assert np.array_equal(b1["array"], np.arange(3)) and b1["dtype"] == np.dtype("float32")
    assert b1["torch"] == (torch.float16, torch.device("cpu"), torch.Size([2, 3]))
    assert b1["builtins"] == b0["builtins"]
    assert torch.equal(b1["nested_tensor"][0]["rng"], torch.arange(4, dtype=torch.uint8))
    for gathered in (g0, g1):
        assert [g["path"] for g in gathered] == [pathlib.Path("/data/r0"), pathlib.Path("/data/r1")]
        assert [g["nested_tensor"][0]["rng"].tolist() for g in gathered] == [[0, 1, 2, 3], [1, 2, 3, 4]]


JOB = '''
import torch
from fabriclite import Fabric


class Planted:
    def __reduce__(self):
        return (exec, ("open(MARKER, 'w').close()",))


fabric = Fabric(accelerator="cpu", devices=2)
fabric.launch()
fabric.broadcast(Planted() if fabric.global_rank == 0 else None)
fabric.barrier()
print("NOT REACHED on rank", fabric.global_rank)
'''


def test_a_job_whose_rank_receives_a_planted_object_ends_naming_it(tmp_path):
    """A real 2-rank job (script mode, gloo): rank 1's broadcast raises, the job ends non-zero naming the refused
    global, and the planted code ran nowhere."""
    from helpers import REPO, python, write_script

    marker = tmp_path / "marker"
    script = write_script(tmp_path, JOB.replace("MARKER", repr(str(marker))))
    done = python(script, env={"PYTHONPATH": str(REPO)}, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "UnpicklingError" in output and "builtins.exec" in output and "fabriclite.add_safe_globals" in output
    assert "NOT REACHED on rank 1" not in output, output
    assert not marker.exists(), "the planted object's code ran"
