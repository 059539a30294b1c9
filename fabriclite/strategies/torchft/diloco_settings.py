"""The settings of DiLoCo / LocalSGD (fabriclite.strategies.torchft.diloco), checked before anything starts: at
``Fabric(...)`` (the strategy's constructor) or when ``fabriclite run`` parses its flags (:func:`cli_env`), before a
Manager exists; and the model cut into fragments (:func:`fragments_of`). Imports neither torchft nor the strategy:
``fabriclite.strategies.torchft.diloco_sync`` (torchft's classes) and the strategy both read it.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from torch import nn
from torch.optim import Optimizer

from fabriclite.distributed.rendezvous import resolve_timeout

#: the settings ``fabriclite run`` passes to its ranks, as JSON (the flags given, nothing else)
SETTINGS_ENV = "FABRICLITE_LOW_COMMUNICATION"
#: the lighthouse's join timeout (fabriclite.supervision.lighthouse reads it): see cli_env
JOIN_TIMEOUT_ENV = "FABRICLITE_FT_JOIN_TIMEOUT_MS"
#: ``fabriclite run`` flag -> (setting, type)
FLAGS = {"--sync-every": ("sync_every", int), "--fragments": ("fragments", int),
         "--fragment-sync-delay": ("fragment_sync_delay", int),
         "--fragment-update-alpha": ("fragment_update_alpha", float), "--outer-lr": ("outer_lr", float),
         "--outer-momentum": ("outer_momentum", float)}
#: what only DiLoCo has (LocalSGD averages the parameters: no fragments, no outer optimizer)
DILOCO_ONLY = ("fragments", "fragment_sync_delay", "fragment_update_alpha", "outer_optimizer", "outer_lr",
               "outer_momentum", "should_quantize")

OuterOptimizer = Union[str, Callable[[List[nn.Parameter]], Optimizer]]


@dataclass(frozen=True)
class Settings:
    """One scheme's settings, checked (:meth:`check`). ``outer_optimizer``: ``"sgd"`` (SGD with ``outer_lr``,
    ``outer_momentum``, Nesterov) or a callable building the outer optimizer from a fragment's parameters."""

    scheme: str
    sync_every: int
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    outer_optimizer: OuterOptimizer = "sgd"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    should_quantize: bool = False

    def check(self) -> "Settings":
        """ValueError naming the bad setting and the fix; the settings otherwise."""
        name = f"strategy={self.scheme!r}"
        for key in ("sync_every", "fragments", "fragment_sync_delay"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: {key}={value!r} must be an int.")
        if self.sync_every < 1:
            raise ValueError(f"{name}: sync_every={self.sync_every} must be >= 1 (inner steps between syncs).")
        if self.fragments < 1:
            raise ValueError(f"{name}: fragments={self.fragments} must be >= 1 (1: plain DiLoCo).")
        if self.sync_every < self.fragments:
            raise ValueError(f"{name}: sync_every={self.sync_every} is smaller than fragments={self.fragments}: "
                             f"one fragment syncs at a time, so a round of syncs takes at least as many steps as "
                             f"there are fragments. Use sync_every >= {self.fragments}.")
        if self.sync_every % self.fragments:
            raise ValueError(f"{name}: sync_every={self.sync_every} is not divisible by fragments={self.fragments}"
                             f" (each fragment syncs every sync_every / fragments steps); use e.g. sync_every="
                             f"{self.sync_every - self.sync_every % self.fragments or self.fragments}.")
        interval = self.sync_every // self.fragments
        if not 0 <= self.fragment_sync_delay < interval:
            raise ValueError(f"{name}: fragment_sync_delay={self.fragment_sync_delay} must be >= 0 and below "
                             f"sync_every / fragments = {interval} (a fragment's sync must finish before the next "
                             f"one starts); use 0..{interval - 1}.")
        alpha = self.fragment_update_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"{name}: fragment_update_alpha={alpha!r} must be a number in [0, 1] (0: take the "
                             f"global weights, 1: keep the local ones).")
        if not (self.outer_optimizer == "sgd" or callable(self.outer_optimizer)):
            raise ValueError(f"{name}: outer_optimizer={self.outer_optimizer!r}; expected 'sgd' or a callable "
                             f"building an optimizer from a fragment's parameters.")
        for key in ("outer_lr", "outer_momentum"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}: {key}={value!r} must be a number >= 0.")
        if self.should_quantize and importlib.util.find_spec("triton") is None:
            raise ValueError(f"{name}: should_quantize=True needs Triton, which is not installed: torchft 0.2 then "
                             f"sends the pseudo-gradients unquantized without saying so. Install triton (GPUs "
                             f"only) or leave should_quantize=False.")
        return self

    def outer(self, params: List[nn.Parameter]) -> Optimizer:
        """The outer optimizer of one fragment's parameters."""
        if callable(self.outer_optimizer):
            return self.outer_optimizer(params)
        import torch

        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=True)


#: each scheme's defaults: DiLoCo's paper (H = 500; outer SGD lr 0.7, momentum 0.9, Nesterov); LocalSGD every 100
DEFAULTS = {"diloco": {"sync_every": 500}, "local_sgd": {"sync_every": 100}}


def resolve(scheme: str, given: Dict[str, Any], cli: Optional[Dict[str, Any]] = None) -> Settings:
    """The checked settings of ``scheme``: ``given`` (the constructor's, None = not given) and ``cli`` (the flags of
    ``fabriclite run``, default: read from its environment) over the defaults. ValueError for a setting given in
    both places with different values, for one the scheme does not have, and for every bad value."""
    given = {key: value for key, value in given.items() if value is not None}
    cli = from_env() if cli is None else cli
    for key, value in cli.items():
        if key in given and given[key] != value:
            flag = next(f for f, (setting, _) in FLAGS.items() if setting == key)
            raise ValueError(f"strategy={scheme!r}: {key}={given[key]!r} conflicts with `fabriclite run {flag} "
                             f"{value}`; pass the value in one place only.")
    merged = {**DEFAULTS[scheme], **cli, **given}
    if scheme == "local_sgd":
        extra = sorted(key for key in merged if key in DILOCO_ONLY)
        if extra:
            raise ValueError(f"strategy='local_sgd' averages the parameters and has no {', '.join(extra)}; use "
                             f"strategy='diloco' for fragments and an outer optimizer.")
    return Settings(scheme, **merged).check()


def from_env() -> Dict[str, Any]:
    """The settings ``fabriclite run`` passed (its flags), {} without any."""
    raw = os.environ.get(SETTINGS_ENV)
    return json.loads(raw) if raw else {}


def cli_env(args: Any) -> Dict[str, str]:
    """The ranks' environment for this family's flags of ``fabriclite run`` (argparse's namespace: ``strategy``,
    ``fault_tolerant``, ``sync_every``, ...); {} when none is used. ValueError for such a flag without
    ``--fault-tolerant --strategy diloco|local_sgd`` and for every bad setting, before anything starts."""
    given = {setting: getattr(args, setting) for setting, _ in FLAGS.values() if getattr(args, setting) is not None}
    if args.strategy not in DEFAULTS:
        if given:
            flag = next(f for f, (setting, _) in FLAGS.items() if setting in given)
            raise ValueError(f"{flag} is a setting of --strategy diloco (or local_sgd) under --fault-tolerant; "
                             f"add those flags or drop {flag}.")
        return {}
    if not args.fault_tolerant:
        raise ValueError(f"--strategy {args.strategy} runs with --fault-tolerant (each node one torchft replica "
                         f"group, synced every --sync-every steps); add --fault-tolerant.")
    resolve(args.strategy, {}, given)
    # the lighthouse (node 0's supervisor) waits for every group still heartbeating to reach its sync, within the
    # job's timeout: with torchft's join timeout (300 ms here) a group slower by more than that over an interval,
    # or the live groups arriving after a returning group has waited, would form quorums without the others
    join_ms = int(resolve_timeout(args.timeout).total_seconds() * 1000)
    return {JOIN_TIMEOUT_ENV: str(join_ms), **({SETTINGS_ENV: json.dumps(given)} if given else {})}


def add_flags(parser: Any) -> None:
    """``fabriclite run``'s flags of this family (each also spelled with underscores)."""
    for flag, (setting, kind) in FLAGS.items():
        parser.add_argument(flag, flag.replace("-", "_").replace("__", "--"), type=kind, default=None,
                            help=f"with --fault-tolerant --strategy diloco|local_sgd: {setting} "
                                 f"(docs/slow_links.md)")


class Fragment(nn.Module):
    """Some of a model's parameters under their names in the model (what torchft's DiLoCo reads of a fragment)."""

    def __init__(self, named: List[Tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.named = named

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, param in self.named:
            yield prefix + name, param


def fragments_of(module: nn.Module, count: int) -> List[nn.Module]:
    """``module``'s trainable parameters, in order, cut into ``count`` contiguous fragments of about equal size
    (a parameter goes to the fragment its middle falls in). ValueError when there are fewer parameters than
    fragments."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if count > len(named):
        raise ValueError(f"strategy='diloco': fragments={count}, but the model has only {len(named)} trainable "
                         f"parameter tensors; use fragments <= {len(named)}.")
    total = sum(p.numel() for _, p in named)
    out: List[nn.Module] = []
    start, done = 0, 0
    for k in range(count):
        end, done = start + 1, done + named[start][1].numel()
        last = len(named) - (count - k - 1)  # leave at least one parameter for each later fragment
        while end < last and (k == count - 1 or done + named[end][1].numel() / 2 <= total * (k + 1) / count):
            done += named[end][1].numel()
            end += 1
        out.append(Fragment(named[start:end]))
        start = end
    return out
