"""DDP's gradient buckets, recorded in a checkpoint and handed back on resume: bit-exact resume of plain ``ddp``
at any rank count.

Why: with ``find_unused_parameters=False`` torch's DDP runs its first backward with one bucket holding every
parameter, then (in the next forward) rebuilds its buckets once, in the order the gradients became ready, and
broadcasts rank 0's layout. An all-reduce's sum of 3 or more numbers depends on where each gradient sits in its
bucket (gloo's ring and NCCL's algorithms sum chunks of the buffer starting at different ranks), so a resumed run,
whose first step uses the one-bucket layout again, sums in another order than the run that never stopped and its
last bits differ.

What: :func:`record` (at save time; a collective when the rebuild is still pending: it runs it now, the same
rebuild the next forward would run) returns the rebuilt layout as parameter names, bucket by bucket, in the
reducer's order. :func:`apply` (on resume; a collective) gives an already-built DDP a new reducer whose
parameters are listed in the recorded order and has it rebuild at once: torch's own rebuild then computes the
recorded buckets (same parameters, same order, same size limits), marks them rebuilt (no further rebuild), and
the resumed run's first step sums exactly as the uninterrupted run's did. No backward pass runs. An
uninterrupted run is unchanged: its buckets are torch's, only rebuilt at the save instead of the next forward.

This uses private parts of torch (named in :data:`REDUCER_PARTS` / :data:`DDP_PARTS`, checked before use) and
checks, after the rebuild, that the reducer's buckets are the recorded ones: a torch that moved either fails loudly
with its version. ``FABRICLITE_DDP_BUCKET_LAYOUT=0`` switches recording and applying off (torch's behaviour:
exact only on 1 or 2 ranks, or with ``find_unused_parameters=True``).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

#: "0" switches the layout's recording and applying off
SWITCH_ENV = "FABRICLITE_DDP_BUCKET_LAYOUT"
#: the private methods of torch's C++ Reducer this module calls
REDUCER_PARTS = ("_rebuild_buckets", "_push_all_rebuilt_params", "_get_zeros_like_grad_buckets",
                 "_remove_autograd_hooks")
#: the private members of DistributedDataParallel this module uses
DDP_PARTS = ("_build_params_for_reducer", "_ddp_init_helper", "_build_debug_param_to_name_mapping",
             "_has_rebuilt_buckets", "_comm_hooks", "reducer", "static_graph", "find_unused_parameters")

#: one module's layout: its buckets, each a list of parameter names (``module.named_parameters()``), in order
Layout = List[List[str]]


def enabled() -> bool:
    """Whether recording and applying are on (``$FABRICLITE_DDP_BUCKET_LAYOUT`` is not "0")."""
    return os.environ.get(SWITCH_ENV, "1").strip() != "0"


def unsupported(ddp_kwargs: Dict[str, Any]) -> Optional[str]:
    """Why DDP built with ``ddp_kwargs`` gets no recorded layout (None when it does): ``find_unused_parameters``
    (DDP never rebuilds: nothing to record) and ``static_graph`` (its own first-iteration bookkeeping) are left to
    torch."""
    if ddp_kwargs.get("find_unused_parameters"):
        return "find_unused_parameters=True (DDP keeps its buckets)"
    if ddp_kwargs.get("static_graph"):
        return "static_graph=True"
    return None


def _why_not(ddp: DistributedDataParallel) -> Optional[str]:
    if getattr(ddp, "find_unused_parameters", False):
        return "find_unused_parameters=True"
    if getattr(ddp, "static_graph", False):
        return "static_graph=True"
    if getattr(ddp, "_use_python_reducer", False):
        return "the Python reducer"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP's mixed_precision"
    return None


def _check_parts(ddp: DistributedDataParallel) -> None:
    """Raise RuntimeError naming torch's version when a private part this module needs is gone."""
    missing = [f"DistributedDataParallel.{name}" for name in DDP_PARTS if not hasattr(ddp, name)]
    reducer = getattr(ddp, "reducer", None)
    missing += [f"Reducer.{name}" for name in REDUCER_PARTS if not hasattr(reducer, name)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} has no {', '.join(missing)}: fabriclite's bit-exact resume of DDP relies on "
            f"these private parts of torch (checked with torch 2.13) and this torch moved them. Set {SWITCH_ENV}=0 "
            f"to resume without the recorded gradient buckets (not bit-exact on 3 or more ranks), or use a torch "
            f"version fabriclite supports.")


def _names(ddp: DistributedDataParallel) -> Dict[int, str]:
    return {id(p): name for name, p in ddp.module.named_parameters()}


def current(ddp: DistributedDataParallel) -> Layout:
    """The reducer's buckets now, as parameter names (bucket order, then order inside each bucket)."""
    _check_parts(ddp)
    names = _names(ddp)
    return [[names[id(p)] for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def record(ddp: DistributedDataParallel) -> Optional[Layout]:
    """The rebuilt bucket layout of ``ddp`` (call on every rank: running a pending rebuild is a collective), or None
    when there is none to record: before the first backward (a resumed run rebuilds as the first run did), or
    under settings torch keeps its buckets for (see :func:`unsupported`)."""
    if _why_not(ddp) is not None:
        return None
    _check_parts(ddp)
    if ddp.reducer._rebuild_buckets():  # the rebuild the next forward would run (broadcasts rank 0's layout)
        ddp._has_rebuilt_buckets = True
    if not ddp._has_rebuilt_buckets:
        return None
    return current(ddp)


def validate(ddp: DistributedDataParallel, layout: Any) -> Layout:
    """``layout`` checked against ``ddp``'s parameters: ValueError naming the difference (before any
    communication)."""
    if not isinstance(layout, (list, tuple)) or not all(
            isinstance(b, (list, tuple)) and all(isinstance(n, str) for n in b) for b in layout):
        raise ValueError(f"the checkpoint's DDP bucket layout is {layout!r}; expected a list of buckets, each a list "
                         f"of parameter names (written by fabric.resume_state()).")
    params, _ = ddp._build_params_for_reducer()
    names = _names(ddp)
    have = [names[id(p)] for p in params]
    flat = [n for bucket in layout for n in bucket]
    if sorted(flat) != sorted(have):
        extra, lacking = sorted(set(flat) - set(have)), sorted(set(have) - set(flat))
        raise ValueError(f"the checkpoint's DDP bucket layout does not fit this model: parameters only in the "
                         f"checkpoint {extra}, only in the model {lacking}{'' if extra or lacking else ' (repeated)'}. "
                         f"Load it into the model it was saved from, or set {SWITCH_ENV}=0.")
    return [list(b) for b in layout]


def apply(ddp: DistributedDataParallel, layout: Any) -> None:
    """Give ``ddp`` (built, before or between steps) the recorded ``layout``: a new reducer over the parameters in
    the recorded order, rebuilt at once, so every step from now on sums as in ``layout``. Call on every rank (the
    rebuild broadcasts rank 0's buckets). Raises RuntimeError naming torch's version when the buckets obtained differ
    from the recorded ones."""
    why = _why_not(ddp)
    if why is not None:
        raise ValueError(f"the checkpoint holds a DDP bucket layout, but this DDP uses {why}, which keeps torch's "
                         f"own buckets; build it as the saved run did, or set {SWITCH_ENV}=0.")
    _check_parts(ddp)
    layout = validate(ddp, layout)
    params, sparse = ddp._build_params_for_reducer()
    names = _names(ddp)
    position = {names[id(p)]: i for i, p in enumerate(params)}
    order = [position[n] for bucket in layout for n in bucket]
    ordered = [params[i] for i in order]
    ddp.reducer._remove_autograd_hooks()  # the old reducer's hooks would reduce every gradient a second time
    ddp._ddp_init_helper(ordered, [sparse[i] for i in order], ddp._build_debug_param_to_name_mapping(ordered),
                         ddp.static_graph)
    for hook, state in ddp._comm_hooks:  # hooks registered before the load move to the new reducer
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp.reducer._push_all_rebuilt_params()  # "ready" in the recorded order
    rebuilt = ddp.reducer._rebuild_buckets()
    ddp._has_rebuilt_buckets = True
    obtained = current(ddp)
    if not rebuilt or obtained != layout:
        raise RuntimeError(
            f"torch {torch.__version__}: DDP's reducer did not take the recorded gradient buckets (rebuilt="
            f"{rebuilt}; recorded {_short(layout)}, obtained {_short(obtained)}). fabriclite's bit-exact resume of DDP "
            f"relies on private parts of torch (checked with torch 2.13) that this torch changed, or the bucket "
            f"size settings (bucket_cap_mb) differ from the saved run's. Set {SWITCH_ENV}=0 to resume without it "
            f"(not bit-exact on 3 or more ranks).")


def _short(layout: Sequence[Sequence[str]]) -> str:
    text = repr([list(b) for b in layout])
    return text if len(text) <= 300 else text[:300] + "...]"


__all__ = ["Layout", "SWITCH_ENV", "apply", "current", "enabled", "record", "unsupported", "validate"]
