"""The restricted unpickler's rules in one process (fabriclite.collectives.object_pickle): what it refuses,
what it loads by default, and add_safe_globals' checks."""
from __future__ import annotations

import collections
import io
import os
import pickle
import typing

import numpy as np
import pytest
import torch

from fabriclite.collectives import object_pickle
from fabriclite.collectives.object_pickle import add_safe_globals, dumps, loads

Plain = collections.namedtuple("Plain", "a b")


class Typed(typing.NamedTuple):
    a: int
    b: str = "x"


class Reconstructed(typing.NamedTuple):
    a: int

    def __reduce__(self):
        return (os.system, ("true",))


class Subclassed(Plain):
    def __new__(cls, a, b):
        return super().__new__(cls, a, b)


@pytest.mark.parametrize("payload", [eval, exec, getattr, open, __import__, os.system, torch.load])
def test_functions_are_refused(payload):
    with pytest.raises(pickle.UnpicklingError, match="never loads it") as refused:
        loads(pickle.dumps(payload))
    assert "add_safe_globals([" not in str(refused.value)  # never the advice to allow a function that runs code


def test_a_tensor_pickled_by_torch_is_refused():
    """torch's own reduction of a tensor needs torch.storage._load_from_bytes (torch.load(weights_only=False))."""
    with pytest.raises(pickle.UnpicklingError, match="_rebuild_tensor_v2|_load_from_bytes"):
        loads(pickle.dumps(torch.ones(2)))


def test_tensors_travel_out_of_band_by_value():
    value = {"a": torch.arange(6, dtype=torch.float64).view(2, 3), "e": torch.empty(0, 2), "s": torch.tensor(7),
             "b": torch.ones(3, dtype=torch.bfloat16), "t": torch.arange(4)[::2]}
    back = loads(dumps(value))
    for key, tensor in value.items():
        assert torch.equal(back[key], tensor) and back[key].dtype == tensor.dtype, key


def test_forged_tensor_ids_are_refused():
    class Forger(pickle.Pickler):
        def persistent_id(self, obj):
            return obj if isinstance(obj, tuple) and obj[:1] == (object_pickle.TENSOR_TAG,) else None

    for pid in [(object_pickle.TENSOR_TAG, "load", (1,), b"x"), (object_pickle.TENSOR_TAG, "float32", (2,), b"x"),
                (object_pickle.TENSOR_TAG, "float32", ("1",), b"abcd")]:
        out = io.BytesIO()
        Forger(out, protocol=4).dump([pid])
        with pytest.raises(pickle.UnpicklingError):
            loads(out.getvalue())


def test_plain_namedtuples_load_and_others_do_not():
    assert loads(dumps(Plain(1, [2]))) == Plain(1, [2])
    assert loads(dumps(Typed(3))) == Typed(3)
    with pytest.raises(pickle.UnpicklingError, match="Subclassed"):
        loads(dumps(Subclassed(1, 2)))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        loads(dumps(Reconstructed(1)))


def test_numpy_object_arrays_hold_only_allowed_objects():
    assert loads(dumps(np.array([1, "a"], dtype=object))).tolist() == [1, "a"]
    holder = np.empty(1, dtype=object)
    holder[0] = Subclassed(1, 2)
    with pytest.raises(pickle.UnpicklingError, match="Subclassed"):
        loads(dumps(holder))


class Local:
    pass


def test_add_safe_globals_takes_classes_and_named_pairs():
    add_safe_globals([Local, (Local, "elsewhere.Renamed")])
    assert isinstance(loads(dumps(Local())), Local)
    assert object_pickle.SafeUnpickler(io.BytesIO(b"")).find_class("elsewhere", "Renamed") is Local
    allowed = object_pickle.user_safe_globals()
    assert Local in allowed and (Local, "elsewhere.Renamed") in allowed


@pytest.mark.parametrize("bad", ["Local", [1], [("x", "noname")], None])
def test_add_safe_globals_refuses_what_is_not_a_class(bad):
    with pytest.raises(TypeError, match="add_safe_globals"):
        add_safe_globals(bad)
