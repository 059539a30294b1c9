"""How objects travel between ranks: pickled with their tensors out of band, loaded with a restricted unpickler.

Every object a rank receives from another (``fabric.broadcast`` / ``all_gather`` / ``gather`` of objects, the
object leaves of a mixed collection, the strategies' ``all_gather_object`` / ``broadcast_object`` that fabriclite's
own checkpoint code uses) is loaded by ``SafeUnpickler``, which resolves only the globals it allows
(``find_class``) and never imports a module to do so. Allowed by default:

- builtin values: int, float, complex, bool, str, bytes, bytearray, None, list, tuple, dict, set, frozenset,
  slice, range, Ellipsis (and those types themselves, e.g. a ``defaultdict(list)``'s factory);
- ``collections`` OrderedDict, defaultdict, Counter, deque; ``pathlib`` paths; ``datetime`` date, time,
  datetime, timedelta, timezone; ``argparse.Namespace``, ``types.SimpleNamespace``, ``uuid.UUID``,
  ``decimal.Decimal``, ``fractions.Fraction``;
- numpy arrays, scalars and dtypes (not object-holding ones built from raw bytes: numpy refuses those);
- plain namedtuples (``plain_namedtuple``: a tuple with names, whose pickling namedtuple itself made) of a
  module already imported;
- torch's dtypes, layouts, ``torch.device`` and ``torch.Size``. Tensors never go through
  pickle's globals: ``dumps`` takes each one out of band (a persistent id holding its dtype, shape and
  bytes), so ``torch.storage._load_from_bytes`` (``torch.load(weights_only=False)``) is never needed.

Never builtin functions (``eval``, ``exec``, ``getattr``, ``__import__``, ``open``, ...) nor anything a user did
not name. ``add_safe_globals([Config, ...])`` (also ``fabriclite.add_safe_globals``) allows more, in the spirit
of ``torch.serialization.add_safe_globals``: call it on every rank, before the collective. A refused global
raises ``pickle.UnpicklingError`` on the receiving rank naming it and that call. What was added is also allowed
in the checkpoints fabriclite loads with ``weights_only=True`` (``user_safe_globals``, read at each load).

May import: torch (the allow-list's modules, numpy among them, once, when a first pickle is loaded). Imports no
collectives stage.
"""
from __future__ import annotations

import functools
import importlib
import io
import math
import pickle
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor

Key = Tuple[str, str]
#: a persistent id for a tensor pickled out of band with its bytes: (TENSOR_TAG, dtype name, shape, bytes)
TENSOR_TAG = "fabriclite.tensor"
#: builtins allowed as globals (types whose call builds a value, and constants)
_BUILTINS = ("int", "float", "complex", "bool", "str", "bytes", "bytearray", "list", "tuple", "dict", "set",
             "frozenset", "slice", "range", "Ellipsis", "NotImplemented")
#: (module, name) pairs found by importing ``module``, only these (numpy's under both its 1.x and 2.x names)
_BY_NAME: Tuple[Key, ...] = tuple(
    [("collections", n) for n in ("OrderedDict", "defaultdict", "Counter", "deque")]
    + [("pathlib", n) for n in ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")]
    + [("datetime", n) for n in ("date", "time", "datetime", "timedelta", "timezone")]
    + [("argparse", "Namespace"), ("types", "SimpleNamespace"), ("uuid", "UUID"), ("decimal", "Decimal"),
       ("fractions", "Fraction"), ("torch", "device"), ("torch", "Size"), ("torch.serialization", "_get_layout")]
    + [("numpy", "ndarray"), ("numpy", "dtype")])
#: numpy's reconstructors, under ``numpy._core`` (numpy 2) or ``numpy.core`` (numpy 1)
_NUMPY_CORE = (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer"))

_defaults: Optional[Dict[Key, Any]] = None
_added: Dict[Key, Any] = {}
Global = Union[Callable[..., Any], type, Tuple[Any, str]]


def add_safe_globals(safe_globals: Iterable[Global]) -> None:
    """Allow the classes (or functions) in ``safe_globals`` in the objects this rank receives from other ranks,
    and in the checkpoints fabriclite loads with ``weights_only=True``. Each item is a class or function (known
    by its ``__module__`` and ``__qualname__``) or a pair ``(obj, "module.qualified.name")`` for one pickled
    under another name, as ``torch.serialization.add_safe_globals`` takes them. Call it on every rank that
    receives, before the collective (once, e.g. next to the class). Only add what you trust: loading an allowed
    class runs its ``__reduce__`` / ``__setstate__`` as its sender arranged. TypeError for anything else."""
    if isinstance(safe_globals, (str, bytes)) or not isinstance(safe_globals, Iterable):
        raise TypeError(f"add_safe_globals({safe_globals!r}): expected a list of classes or functions, e.g. "
                        "add_safe_globals([MyConfig]).")
    found: Dict[Key, Any] = {}
    for item in safe_globals:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str) and "." in item[1]:
            module, _, name = item[1].rpartition(".")
            found[(module, name)] = item[0]
        elif callable(item) and isinstance(getattr(item, "__module__", None), str) \
                and isinstance(getattr(item, "__qualname__", None), str):
            found[(item.__module__, item.__qualname__)] = item
        else:
            raise TypeError(f"add_safe_globals: {item!r} is neither a class or function nor a pair (obj, "
                            "'module.name'); pass the class itself, e.g. add_safe_globals([MyConfig]).")
    _added.update(found)


def user_safe_globals() -> List[Any]:
    """What ``add_safe_globals`` allowed, in torch's form (objects, or ``(obj, name)`` pairs where the name is
    not the object's own): for ``torch.serialization.safe_globals`` around a weights-only load."""
    out: List[Any] = []
    for (module, name), obj in _added.items():
        own = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)) == (module, name)
        out.append(obj if own else (obj, f"{module}.{name}"))
    return out


def _default_globals() -> Dict[Key, Any]:
    """The default allow-list, resolved once (imports only the modules it names; numpy's entries where numpy
    has them)."""
    global _defaults
    if _defaults is not None:
        return _defaults
    import builtins

    found: Dict[Key, Any] = {("builtins", name): getattr(builtins, name) for name in _BUILTINS}
    numpy_core = _numpy_core()
    for module, name in _BY_NAME + tuple((f"{numpy_core}.{m}", n) for m, n in _NUMPY_CORE if numpy_core):
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # numpy absent, or the other major version's name
            continue
        found[(module, name)] = obj
        if isinstance(obj, type):  # pickled under its own module (pathlib._local on Python 3.13, ...)
            found[(obj.__module__, obj.__qualname__)] = obj
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout)):
            found[("torch", name)] = value
    _defaults = found
    return found


def plain_namedtuple(module: str, name: str) -> Optional[type]:
    """The class ``module.name`` if it is a plain namedtuple (``collections.namedtuple`` or ``typing.NamedTuple``,
    a direct subclass of tuple whose ``__new__`` and pickling methods are the ones namedtuple made) in a module
    this process has already imported; None otherwise. Nothing is imported and no ``__getattr__`` runs: a
    namedtuple is rebuilt as a tuple is, so it is as safe to load as one."""
    obj: Any = sys.modules.get(module)
    for part in name.split("."):
        obj = vars(obj).get(part) if obj is not None and hasattr(obj, "__dict__") else None
    if not isinstance(obj, type) or obj.__bases__ != (tuple,) or not isinstance(obj.__dict__.get("_fields"), tuple):
        return None
    own = obj.__dict__
    new = getattr(own.get("__new__"), "__func__", None)
    made_new = getattr(new, "__globals__", {}).get("__name__", "").startswith("namedtuple_")
    made_args = getattr(own.get("__getnewargs__"), "__code__", None) is _namedtuple_code()
    overridden = any(k in own for k in ("__reduce__", "__reduce_ex__", "__setstate__", "__getstate__",
                                        "__getnewargs_ex__", "__init__"))
    return obj if made_new and made_args and not overridden else None


@functools.lru_cache(maxsize=None)
def _namedtuple_code() -> Any:
    """The code of the ``__getnewargs__`` every ``collections.namedtuple`` class gets."""
    import collections

    return collections.namedtuple("_Probe", "x").__getnewargs__.__code__


def _numpy_core() -> Optional[str]:
    """Where this numpy keeps its reconstructors (``numpy._core`` or ``numpy.core``); None without numpy."""
    try:
        import numpy
    except ImportError:
        return None
    return "numpy._core" if int(numpy.__version__.split(".")[0]) >= 2 else "numpy.core"


#: modules whose globals a pickle names only to run code (``__reduce__`` payloads): never suggested for allowing
_CODE_MODULES = frozenset({"builtins", "posix", "nt", "os", "subprocess", "sys", "importlib", "runpy", "shutil",
                           "socket", "io", "pickle", "marshal", "ctypes", "code", "codecs", "pty", "webbrowser",
                           "torch.storage", "torch.serialization", "torch._utils"})


def refusal(module: str, name: str) -> str:
    """The message of a refused global ``module.name``."""
    if module in _CODE_MODULES or module.split(".")[0] in _CODE_MODULES:
        return (f"fabriclite refused to unpickle {module}.{name} received from another rank: a pickle names it to "
                "run code or read files on the receiver (a __reduce__ payload, or a tensor pickled by torch rather "
                "than sent as a tensor), and fabriclite never loads it. Send plain values, tensors and the types "
                "docs/security.md ('Pickles and checkpoints') lists; fabriclite.add_safe_globals allows classes of "
                "your own.")
    return (f"fabriclite refused to unpickle {module}.{name} received from another rank: it is not among the "
            "types fabriclite loads from other ranks by default (builtin values, tensors, numpy arrays, paths, "
            "datetimes, Namespace, OrderedDict, ...: docs/security.md, 'Pickles and checkpoints'). If you trust "
            f"it, call fabriclite.add_safe_globals([{name}]) on every rank before the collective, or send plain "
            "values (e.g. dataclasses.asdict(obj)).")


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only allowed globals (``extra``, then ``add_safe_globals``', then the
    defaults) and loads the out-of-band tensors ``dumps`` wrote. ``refuse(module, name)`` makes the message of
    a refused global (default ``refusal``)."""

    def __init__(self, file: Any, extra: Optional[Dict[Key, Any]] = None,
                 refuse: Callable[[str, str], str] = refusal) -> None:
        super().__init__(file)
        self._extra = extra or {}
        self._refuse = refuse

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        for table in (self._extra, _added):
            if key in table:
                return table[key]
        found = _default_globals().get(key)
        if found is None:
            found = plain_namedtuple(module, name)
        if found is None:
            raise pickle.UnpicklingError(self._refuse(module, name))
        return found

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == TENSOR_TAG:
            _, dtype_name, shape, raw = pid
            return _tensor(dtype_name, shape, raw)
        raise pickle.UnpicklingError(f"fabriclite: unknown persistent id {str(pid)[:80]!r} in a pickle from another "
                                     "rank (not one fabriclite writes).")


def dtype_named(dtype_name: Any) -> torch.dtype:
    """The torch dtype called ``dtype_name`` (``"float32"``); UnpicklingError for anything else."""
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"fabriclite: {str(dtype_name)[:80]!r} in a pickle from another rank is not a "
                                     "torch dtype.")
    return dtype


def check_shape(shape: Any) -> Tuple[int, ...]:
    """``shape`` if it is a tuple of ints >= 0; UnpicklingError otherwise."""
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise pickle.UnpicklingError(f"fabriclite: {str(shape)[:80]!r} in a pickle from another rank is not a tensor "
                                     "shape.")
    return shape


def _tensor(dtype_name: Any, shape: Any, raw: Any) -> Tensor:
    dtype, shape = dtype_named(dtype_name), check_shape(shape)
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != math.prod(shape) * dtype.itemsize:
        raise pickle.UnpicklingError(f"fabriclite: a tensor of shape {shape} and dtype {dtype} in a pickle from "
                                     "another rank does not come with its bytes.")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)


class _InlinePickler(pickle.Pickler):
    """Pickles everything but tensors; each tensor becomes (TENSOR_TAG, dtype, shape, its bytes)."""

    def persistent_id(self, obj: Any) -> Optional[Tuple[str, str, Tuple[int, ...], bytes]]:
        if not isinstance(obj, Tensor):
            return None
        if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            raise pickle.PicklingError(f"fabriclite sends tensors inside objects as their bytes; a {obj.layout} / "
                                       f"quantized / meta tensor ({type(obj).__name__}, {obj.dtype}) cannot be sent "
                                       "that way: send it as a collective's tensor leaf, or convert it first.")
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return (TENSOR_TAG, str(obj.dtype).replace("torch.", ""), tuple(obj.shape), raw)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for another rank: tensors (at any depth) by value out of band, loaded back on the CPU."""
    out = io.BytesIO()
    _InlinePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def loads(data: Any, extra: Optional[Dict[Key, Any]] = None) -> Any:
    """``data`` (bytes, or a buffer) loaded with ``SafeUnpickler``; UnpicklingError naming a refused global."""
    return SafeUnpickler(io.BytesIO(data), extra).load()


__all__ = ["SafeUnpickler", "add_safe_globals", "check_shape", "dtype_named", "dumps", "loads", "refusal",
           "user_safe_globals"]
