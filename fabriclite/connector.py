"""``Fabric(...)`` arguments + the process environment -> the parts (accelerator, strategy,
precision, cluster environment).

Every argument is validated here, before anything starts; each bad value raises ValueError or
TypeError naming the value, what is valid, and the fix.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import warnings
from typing import Any, Iterable, List, Optional, Union

from fabriclite.accelerators import ACCELERATORS, Accelerator, accelerator_class
from fabriclite.checkpoint.checkpoint_io import CheckpointIO
from fabriclite.compat.user_warnings import PossibleUserWarning
from fabriclite.environments import (FORCE_ENVIRONMENT_VAR, ClusterEnvironment, FabricliteEnvironment,
                                     LocalEnvironment, SLURMEnvironment, TorchElasticEnvironment, detect_environment)
from fabriclite.environments.process_rank import current_rank
from fabriclite.supervision.agent.restarts import resolve_max_restarts
from fabriclite.precision import Precision, normalize_precision, precision_plugin
from fabriclite.strategies import (FAULT_TOLERANT, STRATEGIES, DDPStrategy, SingleDeviceStrategy, Strategy,
                                   create_strategy)

#: variables `fabriclite run` sets in its ranks: CLI flags that fill what the code leaves unset
CLI_ENV = {
    "accelerator": "FABRICLITE_CLI_ACCELERATOR",
    "strategy": "FABRICLITE_CLI_STRATEGY",
    "devices": "FABRICLITE_CLI_DEVICES",
    "num_nodes": "FABRICLITE_CLI_NUM_NODES",
    "precision": "FABRICLITE_CLI_PRECISION",
}
#: set by `fabriclite run` in its ranks: the processes exist, so ``Fabric(...)`` joins the job in ``__init__``
CLI_USED_ENV = "FABRICLITE_CLI_USED"
#: Lightning's CLI contract (`fabric run`): LT_CLI_USED=1 and one LT_<NAME> variable per flag
LT_CLI_USED_ENV = "LT_CLI_USED"
#: Lightning Fabric's registered names that fabriclite does not have (the rows of docs/compat.md say why)
LIGHTNING_ONLY_STRATEGIES = frozenset({
    "deepspeed", "deepspeed_stage_1", "deepspeed_stage_1_offload", "deepspeed_stage_2", "deepspeed_stage_2_offload",
    "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme", "dp", "single_tpu",
    "xla_fsdp",
})
LIGHTNING_ONLY_PRECISIONS = frozenset({"transformer-engine", "transformer-engine-float16"})
HOROVOD_RECIPE = ("install it with `make env-horovod` (see docs/backends.md: horovod 0.28.1 built from source with "
                  "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1) and run under horovodrun")
XLA_RECIPE = "install it with `pip install torch==2.9.1 torch-xla==2.9.0` (or `make env-xla`; see docs/backends.md)"


class Connector:
    """Resolves the Fabric arguments into ``accelerator``, ``strategy``, ``precision`` and
    ``cluster_environment``; also ``num_nodes`` and ``num_processes`` (ranks per node)."""

    def __init__(
        self,
        accelerator: Union[str, Accelerator] = "auto",
        strategy: Union[str, Strategy] = "auto",
        devices: Union[List[int], str, int] = "auto",
        num_nodes: Optional[int] = None,
        precision: Union[str, int, None] = None,
        plugins: Optional[Any] = None,
        max_restarts: Optional[int] = None,
        *,
        launcher_chosen: bool = False,
    ) -> None:
        """``launcher_chosen``: the caller is a launcher the user chose (``fabriclite run``), so Lightning's hint
        that ``srun`` exists but is not used is not given."""
        accelerator = _from_cli("accelerator", accelerator, "auto")
        strategy = _from_cli("strategy", strategy, "auto")
        devices = _from_cli("devices", devices, "auto")
        num_nodes = _from_cli("num_nodes", num_nodes, None)
        precision = _from_cli("precision", precision, None)

        forced_env, precision_instance, checkpoint_io = _split_plugins(plugins)
        self.num_nodes_given = num_nodes is not None
        self.num_nodes = _check_num_nodes(num_nodes)
        if precision is not None and precision_instance is not None:
            raise ValueError(f"precision={precision!r} and a Precision plugin {precision_instance!r} were both "
                             "given; pass only one.")
        if isinstance(precision, str) and precision.lower() in LIGHTNING_ONLY_PRECISIONS:
            raise ValueError(f"precision={precision!r} is a Lightning Fabric precision that fabriclite does not support "
                             "(see docs/compat.md); use '16-mixed', 'bf16-mixed' or a '-true' precision.")
        precision_name = normalize_precision(precision if precision is not None else "32-true")
        if isinstance(strategy, str):
            strategy = strategy.lower()
            if strategy in LIGHTNING_ONLY_STRATEGIES and strategy not in STRATEGIES:
                raise ValueError(f"strategy={strategy!r} is a Lightning Fabric strategy that fabriclite does not "
                                 f"support (see docs/compat.md); use one of {sorted(STRATEGIES)}.")
            if strategy != "auto" and strategy not in STRATEGIES:
                raise ValueError(f"strategy={strategy!r} is not supported; expected 'auto', one of "
                                 f"{sorted(STRATEGIES)} or a Strategy instance (see docs/compat.md).")
        elif not isinstance(strategy, Strategy):
            raise TypeError(f"strategy={strategy!r} ({type(strategy).__name__}) is not valid; expected a name "
                            f"such as 'ddp' or a Strategy instance.")
        if strategy == "horovod" and importlib.util.find_spec("horovod") is None:
            raise ValueError(f"strategy='horovod' needs the horovod package, which is not installed: {HOROVOD_RECIPE}.")

        self.accelerator = self._resolve_accelerator(accelerator, strategy)
        env = forced_env or (strategy.cluster_environment if isinstance(strategy, Strategy) else None)
        self.cluster_environment: ClusterEnvironment = detect_environment(env)
        if env is None and not launcher_chosen:
            _hint_srun(self.cluster_environment)
        self.num_processes, parallel_devices = self._resolve_devices(devices)
        self.precision: Precision = precision_instance or precision_plugin(
            precision_name, parallel_devices[0].type)
        self.strategy = self._resolve_strategy(strategy, parallel_devices)
        if checkpoint_io is not None:
            if getattr(self.strategy, "_checkpoint_io", None) is not None:
                raise ValueError("checkpoint_io set through both strategy class and plugins, choose one")
            self.strategy.checkpoint_io = checkpoint_io  # sharded strategies: NotImplementedError, as in Lightning
        self.max_restarts = resolve_max_restarts(max_restarts)
        if self.max_restarts:
            self._check_restartable()

    def _check_restartable(self) -> None:
        """ValueError when restarts cannot take effect: no fabriclite supervisor runs (or will run) the ranks."""
        env, strategy, n = self.cluster_environment, self.strategy, self.max_restarts
        if env.creates_processes_externally and not isinstance(env, FabricliteEnvironment):
            raise ValueError(f"max_restarts={n} needs fabriclite's supervisor, but the ranks were started by "
                             f"{type(env).__name__} ({env.name}): use its own restarts (torchrun --max-restarts, "
                             "srun --requeue / sbatch --requeue, your MPI scheduler's), or start the job with "
                             "`fabriclite run --max-restarts N`.")
        if getattr(strategy, "start_method", "popen") != "popen":
            raise ValueError(f"max_restarts={n} is not supported with strategy={strategy.name!r} "
                             f"(start method {getattr(strategy, 'start_method')!r}): the launching process is yours "
                             "and cannot be restarted. Use strategy='ddp' (script mode) or `fabriclite run "
                             "--max-restarts N`, or catch JobFailed from launch() and call it again.")
        if not env.creates_processes_externally and strategy.launcher is None:
            raise ValueError(f"max_restarts={n} needs a supervisor, but strategy={strategy.name!r} runs in this "
                             "one process; run the script with `fabriclite run --max-restarts N`.")

    # ------------------------------------------------------------------ accelerator
    def _resolve_accelerator(self, accelerator: Any, strategy: Any) -> Accelerator:
        if isinstance(accelerator, Accelerator):
            return accelerator
        if not isinstance(accelerator, str):
            raise TypeError(f"accelerator={accelerator!r} ({type(accelerator).__name__}) is not valid; expected "
                            f"'auto', one of {sorted(ACCELERATORS)} or an Accelerator instance.")
        name = accelerator.lower()
        if name == "auto":
            name = "tpu" if strategy in ("xla", "single_xla") else _auto_accelerator()
        if name not in ACCELERATORS:
            raise ValueError(f"accelerator={accelerator!r} is not supported; expected 'auto' or one of "
                             f"{sorted(ACCELERATORS)}.")
        if name in ("cuda", "gpu"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"accelerator={accelerator!r} but no CUDA GPU is available (torch "
                                 f"{torch.__version__}, torch.cuda.is_available() is False). Use accelerator='cpu' "
                                 "or 'auto', or run on a machine with a GPU and a CUDA build of torch.")
        if name == "tpu" and importlib.util.find_spec("torch_xla") is None:
            raise ValueError(f"accelerator={accelerator!r} needs torch_xla, which is not installed: {XLA_RECIPE}.")
        cls = accelerator_class(name)
        if name == "mps" and not cls.is_available():
            raise ValueError("accelerator='mps' but MPS is not available on this machine; use 'cpu' or 'auto'.")
        return cls()

    # ------------------------------------------------------------------ devices
    def _resolve_devices(self, devices: Any) -> tuple:
        env = self.cluster_environment
        external = env.creates_processes_externally
        if isinstance(devices, str) and devices.strip().lower() == "auto":
            if external:
                per_node = env.local_world_size()
                if per_node is None:
                    nodes = env.num_nodes() or self.num_nodes
                    per_node = max(1, env.world_size() // nodes)
                parsed = self.accelerator.parse_devices(per_node)
                if isinstance(parsed, list):  # one GPU per local rank, chosen by local rank
                    parsed = list(range(per_node))
            else:
                parsed = self.accelerator.parse_devices(self.accelerator.auto_device_count() or 1)
        else:
            parsed = self.accelerator.parse_devices(devices)
        parallel_devices = self.accelerator.get_parallel_devices(parsed)
        count = len(parallel_devices)
        if external and not self.num_nodes_given:
            self.num_nodes = env.num_nodes() or max(1, env.world_size() // count)
        if not external or isinstance(env, LocalEnvironment):  # ranks by fabriclite, or started by hand (Lightning's)
            env.set_world_size(count * self.num_nodes)
            env.set_global_rank(env.node_rank() * count + env.local_rank())
            if env.node_rank() >= self.num_nodes:
                raise ValueError(f"node rank {env.node_rank()} (NODE_RANK / --node-rank) is out of range for "
                                 f"num_nodes={self.num_nodes}; expected 0..{self.num_nodes - 1}.")
        env.validate(count, self.num_nodes)
        return count, parallel_devices

    # ------------------------------------------------------------------ strategy
    def _resolve_strategy(self, strategy: Any, parallel_devices: list) -> Strategy:
        world = self.num_processes * self.num_nodes
        env = self.cluster_environment
        if env.creates_processes_externally:
            world = env.world_size()
        if strategy == "auto":
            if getattr(self.accelerator, "name", "") in ("tpu", "xla"):
                strategy = "xla" if world > 1 else "single_xla"
            else:
                strategy = "ddp" if world > 1 else "single_device"
        if isinstance(strategy, str):
            if strategy == "ddp" and _interactive() and not env.creates_processes_externally:
                raise ValueError("strategy='ddp' re-runs the script in new processes and cannot start from an "
                                 "interactive session (a notebook or REPL); use strategy='ddp_notebook'.")
            if strategy == "single_device" and world > 1:
                raise ValueError(f"strategy='single_device' runs one process, but devices={self.num_processes} "
                                 f"and num_nodes={self.num_nodes} ask for {world}; use strategy='ddp'.")
            strategy = create_strategy(strategy)
        if strategy.accelerator is None:
            strategy.accelerator = self.accelerator
        strategy.cluster_environment = env  # the instance's own, when it brought one, was detected as forced
        strategy.precision = self.precision
        if isinstance(strategy, DDPStrategy):
            strategy.parallel_devices = strategy.parallel_devices or parallel_devices
            strategy.num_nodes = self.num_nodes
        elif isinstance(strategy, SingleDeviceStrategy):
            strategy.set_device(parallel_devices[0])
        check = getattr(strategy, "check_configuration", None)  # sharded strategies: what they cannot run on
        if check is not None:
            check(getattr(self.accelerator, "name", type(self.accelerator).__name__), world)
        return strategy


def _hint_srun(env: ClusterEnvironment) -> None:
    """Lightning's hint (a PossibleUserWarning, on rank 0): ``srun`` exists on this machine, but this process was
    not started by it (nor by torchrun, nor forced), so a SLURM job would run each rank's processes on its own."""
    if isinstance(env, TorchElasticEnvironment) or os.environ.get(FORCE_ENVIRONMENT_VAR, "").strip():
        return
    if shutil.which("srun") is None or SLURMEnvironment.detect() or current_rank() != 0:
        return
    hint = " ".join(["srun", os.path.basename(sys.executable), *sys.argv])[:64]
    warnings.warn("The `srun` command is available on your system but is not used. HINT: If your intention is to run "
                  f"on SLURM, prepend your python command with `srun` like so: {hint} ...", PossibleUserWarning,
                  stacklevel=4)


def _auto_accelerator() -> str:
    """A TPU through torch_xla, then cuda, then mps, then cpu."""
    if importlib.util.find_spec("torch_xla") is not None and accelerator_class("tpu").is_available():
        return "tpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if accelerator_class("mps").is_available():
        return "mps"
    return "cpu"


def _check_num_nodes(num_nodes: Any) -> int:
    if num_nodes is None:
        return 1
    if isinstance(num_nodes, str) and num_nodes.strip().isdigit():
        num_nodes = int(num_nodes)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int):
        raise TypeError(f"num_nodes={num_nodes!r} ({type(num_nodes).__name__}) must be an int >= 1.")
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be an int >= 1 (the number of machines).")
    return num_nodes


def _split_plugins(plugins: Any) -> tuple:
    """``(cluster environment, precision plugin, CheckpointIO)`` from ``plugins``, each None when absent."""
    if plugins is None:
        return None, None, None
    items: Iterable[Any] = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    env = precision = checkpoint_io = None
    for plugin in items:
        if isinstance(plugin, ClusterEnvironment):
            if env is not None:
                raise ValueError(f"plugins has two cluster environments, {env!r} and {plugin!r}; pass one.")
            env = plugin
        elif isinstance(plugin, Precision):
            if precision is not None:
                raise ValueError(f"plugins has two precision plugins, {precision!r} and {plugin!r}; pass one.")
            precision = plugin
        elif isinstance(plugin, CheckpointIO):
            if checkpoint_io is not None:
                raise ValueError(f"plugins has two CheckpointIO plugins, {checkpoint_io!r} and {plugin!r}; pass one "
                                 "(wrap one in the other, e.g. AsyncCheckpointIO(MyCheckpointIO())).")
            checkpoint_io = plugin
        else:
            raise TypeError(f"plugins: {plugin!r} ({type(plugin).__name__}) is not supported; expected a "
                            "ClusterEnvironment, a Precision plugin or a CheckpointIO.")
    return env, precision, checkpoint_io


def cli_used() -> bool:
    """Whether a CLI started this process and its peers (`fabriclite run`, or Lightning's `fabric run`, which
    sets ``LT_CLI_USED=1``): ``Fabric(...)`` then joins the job in ``__init__``."""
    if os.environ.get(CLI_USED_ENV) == "1":
        return True
    try:
        return bool(int(os.environ.get(LT_CLI_USED_ENV, "0") or "0"))
    except ValueError:
        return False


def _from_cli(name: str, value: Any, default: Any) -> Any:
    """A `fabriclite run` flag fills an argument the code left at its default; a different explicit
    value is a conflict. Lightning's ``LT_<NAME>`` variables follow Lightning's rule: the variable wins;
    under ``LT_CLI_USED=1`` a code value that is not the default and differs from it is a conflict."""
    raw = os.environ.get(CLI_ENV[name])
    if raw is None:
        return _from_lightning_cli(name, value, default)
    cli: Any = raw
    if name == "num_nodes":
        cli = int(raw)
    if _is_default(value, default):
        return cli
    if name == "strategy" and _in_family(value, cli):
        return value
    if str(value).lower().replace(" ", "") != str(cli).lower().replace(" ", ""):
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"Fabric({name}={value!r}) conflicts with `fabriclite run {flag} {raw}`; pass the value "
                         "in one place only.")
    return value


def _in_family(value: Any, cli: str) -> bool:
    """Under `fabriclite run --fault-tolerant` a script may choose its strategy of that family (a name or an
    instance: DiLoCo, LocalSGD); with `--strategy diloco` it may pass a DiLoCoStrategy with its settings."""
    name = value.lower() if isinstance(value, str) else getattr(value, "name", None)
    return name in FAULT_TOLERANT and cli in (name, "fault_tolerant")


def _from_lightning_cli(name: str, value: Any, default: Any) -> Any:
    raw = os.environ.get("LT_" + name.upper())
    if raw is None:
        return value
    lightning_default = 1 if name == "num_nodes" else default  # Lightning's Fabric(num_nodes=1)
    is_default = _is_default(value, default) or str(value) == str(lightning_default)
    if raw != str(value) and not is_default and cli_used():
        raise ValueError(f"Fabric({name}={value!r}) conflicts with `--{name}={raw}` set through the CLI "
                         f"(LT_{name.upper()}); pass the value in one place only.")
    if name == "num_nodes":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"LT_NUM_NODES={raw!r}: expected an int >= 1.") from None
    return raw


def _is_default(value: Any, default: Any) -> bool:
    if default is None:
        return value is None
    return isinstance(value, str) and value.lower() == default


def _interactive() -> bool:
    import __main__

    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or not hasattr(__main__, "__file__") and \
        "-c" not in getattr(sys, "orig_argv", [])
