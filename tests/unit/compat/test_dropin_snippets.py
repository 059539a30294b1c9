"""Drop-in, round 2 (issue 21), in one process: each behaviour is one public-API snippet run under Lightning Fabric
2.6.6 and under fabriclite, with the same outcome asserted (value, exception type, warning). The behaviours that
need ranks (a method bypassing DDP, rank_zero_* before launch, ranks started by hand, a compiled module under DDP)
run on real ranks in tests/integration/dropin/test_dropin_manual_launch.py."""
from __future__ import annotations

import csv
import dataclasses
import importlib
import os
import signal
import shutil
import socket
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from torch import nn

import lightning.fabric  # noqa: F401  (the reference: a test dependency pinned in pyproject's test extras)

FRAMEWORKS = ("lightning.fabric", "fabriclite")


def fw(framework: str, sub: str = "") -> Any:
    """``lightning.fabric<sub>`` or ``fabriclite<sub>``."""
    return importlib.import_module(framework + sub)


def _category(warning: Any) -> str:
    """A warning's category name; a deprecation is a DeprecationWarning (Lightning's own subclass included)."""
    return "DeprecationWarning" if issubclass(warning.category, DeprecationWarning) else warning.category.__name__


def outcome(snippet: Callable[[str], Any], framework: str, match: str = "") -> Tuple[Tuple[str, Any], List[str]]:
    """``(("value", v) or ("raises", type name), [categories of the warnings whose text contains match])``.
    ``os.environ`` is restored afterwards (Lightning's environments write MASTER_ADDR / MASTER_PORT into it)."""
    saved = dict(os.environ)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Tuple[str, Any] = ("value", snippet(framework))
        except Exception as err:  # noqa: BLE001 -- the exception type is the outcome compared
            result = ("raises", type(err).__name__)
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return result, [_category(w) for w in caught if match and match in str(w.message)]


def same_outcome(snippet: Callable[[str], Any], match: str = "") -> Tuple[Tuple[str, Any], List[str]]:
    """Run ``snippet`` under both frameworks; assert the outcomes are equal and return fabriclite's."""
    theirs, ours = (outcome(snippet, f, match) for f in FRAMEWORKS)
    assert ours == theirs, f"Lightning: {theirs}\nfabriclite: {ours}"
    return ours


@pytest.fixture
def plain_process(no_launch_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variables, no seed, and rank_zero_only's rank 0 (what both give a plain process)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    no_launch_env.delenv("PL_GLOBAL_SEED", raising=False)
    no_launch_env.setattr(rank_zero_only, "rank", 0, raising=False)
    return no_launch_env


# ---------------------------------------------------------------------------------------------- 2, 3: precision
class Probe(nn.Module):
    """Records the dtypes its forward receives."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen: Dict[str, str] = {}

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.seen = {"x": str(x.dtype), "mask": str(mask.dtype)}
        return self.lin(x) * mask


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "64-true", "32-true"])
def test_forward_inputs_and_outputs_are_cast_as_lightning(plain_process, precision):
    def snippet(f):
        fabric = fw(f).Fabric(accelerator="cpu", devices=1, precision=precision)
        torch.manual_seed(0)
        model = fabric.setup(Probe())
        out = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.ones(3, 2, dtype=torch.int64))
        return model.module.seen, str(out.dtype), out.detach().double().tolist()

    (kind, (seen, out_dtype, _)), _ = same_outcome(snippet)
    assert kind == "value"
    if precision == "bf16-mixed":  # issue 21 item 2: floating inputs in the autocast dtype, integers untouched
        assert seen == {"x": "torch.bfloat16", "mask": "torch.int64"} and out_dtype == "torch.float32"


def test_64_true_keeps_complex_parameters_and_buffers(plain_process):
    class WithComplex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.real = nn.Linear(2, 2)
            self.phase = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
            self.register_buffer("kernel", torch.tensor([0.5j], dtype=torch.complex64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.real(x)

    def snippet(f):
        torch.manual_seed(0)
        model = fw(f).Fabric(accelerator="cpu", devices=1, precision="64-true").setup(WithComplex())
        return {k: (str(v.dtype), v.detach().tolist()) for k, v in model.state_dict().items() if k != "real.bias"}

    (kind, state), warned = same_outcome(snippet, match="imaginary")
    assert kind == "value" and warned == []  # torch's "discards the imaginary part" warning: in neither
    assert state["phase"] == ("torch.complex64", [1 + 2j, 3 - 1j]) and state["real.weight"][0] == "torch.float64"


# ---------------------------------------------------------------------------------------------- 9: zero_grad
def test_zero_grad_forwards_only_the_callers_arguments(plain_process):
    class NoArgZeroGrad(torch.optim.SGD):
        def zero_grad(self) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

    def snippet(f):
        fabric = fw(f).Fabric(accelerator="cpu", devices=1)
        model = nn.Linear(2, 1)
        model, custom, sgd = fabric.setup(model, NoArgZeroGrad(model.parameters(), lr=0.1),
                                          torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(1, 2)).sum().backward()
        custom.zero_grad()  # takes no argument
        cleared = [p.grad for p in model.parameters()]
        model(torch.ones(1, 2)).sum().backward()
        sgd.zero_grad(set_to_none=False)  # the caller's own argument reaches the optimizer
        return cleared, [p.grad.tolist() for p in model.parameters()]

    assert same_outcome(snippet)[0] == ("value", ([None, None], [[[0.0, 0.0]], [0.0]]))


# ---------------------------------------------------------------------------------------------- 13: log a tensor
def _recording_logger(f: str) -> Any:
    class Recording(fw(f, ".loggers").Logger):
        def __init__(self) -> None:
            super().__init__()
            self.seen: List[Any] = []

        @property
        def name(self) -> str:
            return "rec"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics, step=None):
            self.seen.append((dict(metrics), step))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    return Recording()


@pytest.mark.parametrize("loggers", [True, False], ids=["with-logger", "without-logger"])
def test_logging_a_tensor_of_several_elements_is_a_value_error(plain_process, loggers):
    def snippet(f):
        fabric = fw(f).Fabric(accelerator="cpu", devices=1, loggers=[_recording_logger(f)] if loggers else None)
        fabric.log("loss", torch.tensor([1.0, 2.0]))

    assert same_outcome(snippet)[0] == ("raises", "ValueError")

    def nested(f):
        logger = _recording_logger(f)
        fabric = fw(f).Fabric(accelerator="cpu", devices=1, loggers=[logger])
        fabric.log_dict({"a": torch.tensor(1.5), "b": {"c": torch.tensor([2])}}, step=3)
        return logger.seen

    assert same_outcome(nested)[0] == ("value", [({"a": 1.5, "b": {"c": 2}}, 3)])


def test_value_error_names_the_key(plain_process):
    from fabriclite import Fabric

    with pytest.raises(ValueError, match="'loss' is a tensor with 2 elements"):
        Fabric(accelerator="cpu", devices=1).log("loss", torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------------------------------------- 14: launch(None)
@pytest.mark.parametrize("function", [None, 3, lambda: None], ids=["None", "int", "takes-nothing"])
def test_launch_with_a_non_function_is_a_type_error(plain_process, function):
    assert same_outcome(lambda f: fw(f).Fabric(accelerator="cpu", devices=1).launch(function))[0] == \
        ("raises", "TypeError")
    assert same_outcome(lambda f: fw(f).Fabric(accelerator="cpu", devices=1).launch(lambda fabric, x: x + 1, 2))[0] \
        == ("value", 3)


# ---------------------------------------------------------------------------------------------- 12: seeding
@pytest.mark.parametrize("verbose", [False, True])
def test_seed_everything_without_a_seed_warns_only_when_verbose(plain_process, verbose):
    result, warned = same_outcome(lambda f: fw(f).seed_everything(verbose=verbose), match="No seed found")
    assert result == ("value", 0) and warned == (["UserWarning"] if verbose else [])


def test_seed_warning_is_rank_zero_only(plain_process):
    from lightning_utilities.core.rank_zero import rank_zero_only

    plain_process.setattr(rank_zero_only, "rank", 1)
    assert same_outcome(lambda f: fw(f).seed_everything(), match="No seed found") == (("value", 0), [])


# ---------------------------------------------------------------------------------------------- sharded_model
def test_sharded_model_warns_and_gives_a_context(plain_process):
    def snippet(f):
        fabric = fw(f).Fabric(accelerator="cpu", devices=1)
        with fabric.sharded_model():
            model = nn.Linear(2, 2)
        return type(model.weight).__name__, str(model.weight.device)

    assert same_outcome(snippet, match="sharded_model") == (("value", ("Parameter", "cpu")), ["DeprecationWarning"])


# ---------------------------------------------------------------------------------------------- torch.compile
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).relu()


@pytest.mark.parametrize("reapply", [True, False])
def test_compiled_module_is_unwrapped_set_up_and_compiled_again(plain_process, reapply):
    def snippet(f):
        torch.manual_seed(0)
        plain = Net()
        compiled = torch.compile(plain, backend="eager")
        compiled.__dict__.pop("_compile_kwargs", None)  # what Lightning's import patch records: fabriclite needs none
        if f == "lightning.fabric":
            compiled._compile_kwargs = {"backend": "eager"}
        fabric = fw(f).Fabric(accelerator="cpu", devices=1)
        model = fabric.setup_module(compiled, _reapply_compile=reapply)
        inner = model._forward_module
        # (Lightning's model.module fails on a compiled module: `original or forward` asks OptimizedModule for len())
        return (fw(f).is_wrapped(model), model._original_module is (plain if reapply else compiled),
                type(inner).__name__, inner._orig_mod is plain, sorted(model.state_dict()),
                model(torch.ones(1, 4)).tolist())

    result, _ = same_outcome(snippet)
    assert result[0] == "value" and result[1][:4] == (True, True, "OptimizedModule", True)
    keys = result[1][4]
    assert keys == (["layer.bias", "layer.weight"] if reapply else ["_orig_mod.layer.bias", "_orig_mod.layer.weight"])


# ---------------------------------------------------------------------------------------------- 10: warnings switch
PUW_SCRIPT = """
import importlib, json, os, sys, warnings
framework = sys.argv[1]
fabric = importlib.import_module(framework).Fabric(accelerator="cpu", devices=1)
PossibleUserWarning = importlib.import_module(framework + ".utilities.warnings").PossibleUserWarning
with warnings.catch_warnings(record=True) as caught:  # records what the filters let through
    warnings.warn("maybe intended", PossibleUserWarning)
    warnings.warn("a real one", UserWarning)
print("SEEN " + json.dumps([str(w.message) for w in caught]))
"""


@pytest.mark.slow  # two fresh interpreters per case importing lightning / fabriclite: 4-5 s alone, 40-61 s at load 19
@pytest.mark.parametrize("switch", ["0", "off", "OFF", "1", None])
def test_possible_user_warnings_switch(tmp_path, switch):
    import subprocess
    import sys

    from helpers import clean_env

    script = tmp_path / "warn.py"
    script.write_text(PUW_SCRIPT)
    seen = {}
    for framework in FRAMEWORKS:
        env = clean_env()
        env.pop("POSSIBLE_USER_WARNINGS", None)
        if switch is not None:
            env["POSSIBLE_USER_WARNINGS"] = switch
        out = subprocess.run([sys.executable, str(script), framework], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        seen[framework] = [line for line in out.stdout.splitlines() if line.startswith("SEEN ")]
    assert seen["fabriclite"] == seen["lightning.fabric"]
    silenced = switch is not None and switch.lower() in ("0", "off")
    assert seen["fabriclite"] == ['SEEN ["a real one"]' if silenced else 'SEEN ["maybe intended", "a real one"]']


# ---------------------------------------------------------------------------------------------- 5, 6, 7: TensorBoard
def _hparams_in(log_dir: str) -> Dict[str, Any]:
    """The hyperparameters a TensorBoard event file records (name -> value as TensorBoard shows it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(log_dir)
    acc.Reload()
    out = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        for name, value in data.session_start_info.hparams.items():
            out[name] = value.WhichOneof("kind"), getattr(value, value.WhichOneof("kind"))
    return out


@dataclasses.dataclass
class Config:
    width: int = 4
    act: str = "relu"


def test_tensorboard_log_hyperparams_sanitises_like_lightning(plain_process, tmp_path):
    params = {"tensor": torch.tensor([0.5]), "matrix": torch.ones(2, 2), "array": np.arange(3),
              "np_float": np.float32(2),
              "cls": nn.Linear, "none": None, "list": [1, 2], "dicts": [{"a": 1}, {"b": 2}], "cfg": Config(),
              "ns": Namespace(lr=0.1), "nested": {"x": {"y": True}}}

    def snippet(f):
        logger = fw(f, ".loggers").TensorBoardLogger(tmp_path / f, name="tb", version=0)
        logger.log_hyperparams(params, metrics={"acc": 0.5})
        logger.finalize("success")
        return _hparams_in(logger.log_dir)

    kind, recorded = same_outcome(snippet)[0]
    assert kind == "value" and recorded["cls"] == ("string_value", "<class 'torch.nn.modules.linear.Linear'>")
    assert recorded["dicts/1/b"] == ("number_value", 2.0) and recorded["cfg/act"] == ("string_value", "relu")
    assert recorded["array"] == ("string_value", "[0 1 2]") and recorded["tensor"] == ("number_value", 0.5)


def test_tensorboard_records_a_0_dim_tensor_as_its_number(plain_process, tmp_path):
    """Lightning passes it to torch's hparams, which fails (IndexError); fabriclite records the number (compat.md)."""
    logger = fw("fabriclite", ".loggers").TensorBoardLogger(tmp_path, version=0)
    logger.log_hyperparams({"lr": torch.tensor(0.25)})
    logger.finalize("success")
    assert _hparams_in(logger.log_dir) == {"lr": ("number_value", 0.25)}
    assert outcome(lambda f: fw(f, ".loggers").TensorBoardLogger(tmp_path / "l", version=0).log_hyperparams(
        {"lr": torch.tensor(0.25)}), "lightning.fabric")[0] == ("raises", "IndexError")


@pytest.mark.parametrize("form", ["~/runs", "$RUNS_ROOT/runs", "${RUNS_ROOT}/runs"])
def test_tensorboard_root_dir_expands_user_and_variables(plain_process, tmp_path, form):
    plain_process.setenv("HOME", str(tmp_path / "home"))
    plain_process.setenv("RUNS_ROOT", str(tmp_path / "home"))

    def snippet(f):
        (tmp_path / "cwd" / f).mkdir(parents=True)
        os.chdir(tmp_path / "cwd" / f)
        logger = fw(f, ".loggers").TensorBoardLogger(form, name=f)
        logger.log_metrics({"x": 1.0}, step=0)
        logger.finalize("success")
        expected = os.path.join(str(tmp_path / "home"), "runs", f, "version_0")
        return logger.log_dir == expected, len(os.listdir(expected))

    plain_process.chdir(tmp_path)
    assert same_outcome(snippet)[0] == ("value", (True, 1))
    # no literal "~" / "$RUNS_ROOT" directory where the script runs (Lightning's fsspec makes a literal "$RUNS_ROOT")
    assert os.listdir(tmp_path / "cwd" / "fabriclite") == []


@pytest.mark.parametrize("case", ["no-input", "untraceable-input", "tensor"])
def test_tensorboard_log_graph_warns_without_a_traceable_input(plain_process, tmp_path, case):
    def snippet(f):
        logger = fw(f, ".loggers").TensorBoardLogger(tmp_path / f, name="tb", version=0)
        model = Net()
        if case == "untraceable-input":
            model.example_input_array = {"x": torch.ones(1, 4)}
        elif case == "tensor":
            model.example_input_array = torch.ones(1, 4)
        logger.log_graph(model)
        logger.finalize("success")
        return len(os.listdir(logger.log_dir)) if os.path.isdir(logger.log_dir) else None

    result, warned = same_outcome(snippet, match="Could not log computational graph")
    assert result == ("value", 1 if case == "tensor" else None)  # no graph, no event file: a warning says why
    assert warned == ([] if case == "tensor" else ["UserWarning"])


# ---------------------------------------------------------------------------------------------- 11: CSVLogger
def test_csv_logger_experiment_buffer_and_step_numbering(plain_process, tmp_path):
    def snippet(f):
        logger = fw(f, ".loggers").CSVLogger(tmp_path / f, flush_logs_every_n_steps=2)
        facts = []
        for value in (1.0, 2.0, 3.0):
            logger.log_metrics({"v": value})  # default step: rows since the last flush
            exp = logger.experiment
            facts.append((len(exp.metrics), sorted(exp.metrics_keys)))
        logger.log_metrics({"w": torch.tensor(4.0)}, step=10)
        logger.experiment.log_metrics({"direct": 5.0})
        logger.finalize("success")
        facts.append((logger.experiment.metrics, os.path.relpath(logger.experiment.log_dir, tmp_path / f),
                      os.path.basename(logger.experiment.metrics_file_path)))
        return facts, Path(logger.log_dir, "metrics.csv").read_text()

    kind, (facts, text) = same_outcome(snippet)[0]
    assert kind == "value" and facts[:3] == [(1, []), (0, ["step", "v"]), (1, ["step", "v"])]
    rows = list(csv.DictReader(text.splitlines()))
    assert [r["step"] for r in rows] == ["0", "1", "0", "10", "2"]


def test_csv_logger_reusing_a_version_warns_and_replaces_metrics(plain_process, tmp_path):
    def snippet(f):
        loggers = fw(f, ".loggers")
        first = loggers.CSVLogger(tmp_path / f, version=0)
        first.log_metrics({"old": 1.0}, step=0)
        first.finalize("success")
        again = loggers.CSVLogger(tmp_path / f, version=0)
        again.log_metrics({"new": 2.0}, step=0)
        again.finalize("success")
        return Path(again.log_dir, "metrics.csv").read_text().splitlines()

    result, warned = same_outcome(snippet, match="exists and is not empty")
    assert result == ("value", ["new,step", "2.0,0"]) and warned == ["UserWarning"]


# ---------------------------------------------------------------------------------------------- ThroughputMonitor
CHIPS = ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 SXM1", "NVIDIA H200 NVL1",
         "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA A10G", "NVIDIA L4", "Tesla L40", "NVIDIA GeForce RTX 4090",
         "NVIDIA GeForce RTX 3080 Ti", "NVIDIA GeForce RTX 4080 SUPER", "NVIDIA RTX A6000", "Tesla T4",
         "Tesla V100-SXM2-16GB", "Tesla V100-PCIE-32GB", "Tesla V100S-PCIE-32GB", "Quadro RTX 5000", "NVIDIA TITAN RTX",
         "NVIDIA GeForce GTX 1080", "NVIDIA B200"]


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
def test_peak_flops_table_matches_lightnings(plain_process, chip, dtype):
    # a GPU cannot exist here: its name and compute capability (Ampere: 8) are what torch.cuda would report
    plain_process.setattr(torch.cuda, "get_device_name", lambda device=None: chip)
    plain_process.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))

    def peak(f):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flops = fw(f, ".utilities.throughput").get_available_flops(torch.device("cuda", 0), dtype)
        return flops, [str(w.message) for w in caught]

    theirs, ours = (peak(f) for f in FRAMEWORKS)
    assert ours == theirs
    if chip == "NVIDIA H100 80GB HBM3" and dtype is torch.bfloat16:
        assert ours == (int(989.4e12), [])


def test_throughput_monitor_on_cpu_has_no_peak_and_the_same_metrics(plain_process):
    def snippet(f):
        fabric = fw(f).Fabric(accelerator="cpu", devices=1)
        monitor = fw(f, ".utilities").ThroughputMonitor(fabric, window_size=2)
        for i in (1, 2, 3):
            monitor.update(time=float(i), batches=i, samples=4 * i, flops=100)
        return monitor.available_flops, sorted(monitor.compute())

    result = same_outcome(snippet)[0]
    assert result[0] == "value" and result[1][0] is None and "device/mfu" not in result[1][1]


def test_throughput_monitor_mfu_uses_the_table(plain_process, monkeypatch):
    """fabriclite's monitor looks the peak up for the fabric's device and precision (a CUDA device faked by name)."""
    from fabriclite.training import throughput_monitor

    seen = []
    monkeypatch.setattr(throughput_monitor, "get_available_flops", lambda device, dtype: seen.append(dtype) or 1e3)
    fabric = fw("fabriclite").Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    monitor = fw("fabriclite", ".utilities").ThroughputMonitor(fabric, window_size=2)
    for i in (1, 2):
        monitor.update(time=float(i), batches=i, samples=i, flops=500)
    assert seen == [torch.bfloat16] and monitor.compute()["device/mfu"] == 0.5


# ---------------------------------------------------------------------------------------------- environments
def _env_facts(env: Any) -> Tuple[Any, ...]:
    return (env.creates_processes_externally, env.world_size(), env.global_rank(), env.local_rank(), env.node_rank(),
            env.main_address, env.main_port)


SLURM = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train.py"}


@pytest.mark.parametrize("extra", [
    {"SLURM_NODELIST": "node[007-008]", "SLURM_JOB_ID": "1234567"},
    {"SLURM_NODELIST": "gpu3,gpu4"},  # no job id: Lightning's port 12910
    {},  # no node list: Lightning's 127.0.0.1
    {"SLURM_NODELIST": "node[1-2]", "SLURM_JOB_ID": "77", "MASTER_ADDR": "head", "MASTER_PORT": "2345"},
], ids=["nodelist-and-job", "no-job-id", "no-nodelist", "master-vars"])
def test_slurm_gives_lightnings_ranks_address_and_port(plain_process, extra):
    for name, value in {**SLURM, **extra}.items():
        plain_process.setenv(name, value)
    assert same_outcome(lambda f: _env_facts(fw(f, ".plugins.environments").SLURMEnvironment()))[0][0] == "value"
    ddp = same_outcome(lambda f: type(fw(f).Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp")
                                      .strategy.cluster_environment).__name__)
    assert ddp[0] == ("value", "SLURMEnvironment")


def test_slurm_environment_keeps_lightnings_requeue_arguments(plain_process):
    def snippet(f):
        envs = fw(f, ".plugins.environments")
        default, custom = envs.SLURMEnvironment(), envs.SLURMEnvironment(auto_requeue=False,
                                                                           requeue_signal=signal.SIGHUP)
        return default.auto_requeue, default.requeue_signal, custom.auto_requeue, custom.requeue_signal

    assert same_outcome(snippet)[0] == ("value", (True, signal.SIGUSR1, False, signal.SIGHUP))


@pytest.mark.parametrize("group_rank", [None, "1"])
def test_torchelastic_gives_lightnings_ranks(plain_process, group_rank):
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "2222"}.items():
        plain_process.setenv(name, value)
    if group_rank is not None:
        plain_process.setenv("GROUP_RANK", group_rank)
        assert same_outcome(lambda f: _env_facts(fw(f, ".plugins.environments").TorchElasticEnvironment()))[0][0] \
            == "value"
    # without GROUP_RANK (not a torchrun worker) Lightning still detects torchelastic; fabriclite does not (compat.md)
    assert fw("fabriclite", ".plugins.environments").TorchElasticEnvironment.detect() == (group_rank is not None)


def test_lsf_detection_ranks_address_and_port_are_lightnings(plain_process, tmp_path):
    me = socket.gethostname()
    rankfile = tmp_path / "rankfile"
    rankfile.write_text(f"launch\nother\nother\n{me}\n{me}\n")
    for name, value in {"LSB_JOBID": "4321", "JSM_NAMESPACE_SIZE": "4", "JSM_NAMESPACE_RANK": "2",
                        "JSM_NAMESPACE_LOCAL_RANK": "0"}.items():
        plain_process.setenv(name, value)
    detect = (lambda f: fw(f, ".plugins.environments").LSFEnvironment.detect())
    assert same_outcome(detect)[0] == ("value", False)  # no LSB_DJOB_RANKFILE: not detected by either
    plain_process.setenv("LSB_DJOB_RANKFILE", str(rankfile))
    assert same_outcome(detect)[0] == ("value", True)
    facts = same_outcome(lambda f: _env_facts(fw(f, ".plugins.environments").LSFEnvironment()))[0]
    assert facts == ("value", (True, 4, 2, 0, 1, "other", 10321))


@pytest.mark.parametrize("variables", [
    {"LOCAL_RANK": "1", "NODE_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "3456"},
    {"LOCAL_RANK": "0", "GROUP_RANK": "2", "MASTER_PORT": "3456"},
    {"NODE_RANK": "1", "GROUP_RANK": "2"},
    {},
], ids=["started-by-hand", "group-rank", "node-rank-wins", "plain"])
def test_default_environment_reads_lightnings_variables(plain_process, variables):
    for name, value in variables.items():
        plain_process.setenv(name, value)

    def snippet(f):
        env = fw(f, ".plugins.environments").LightningEnvironment()
        return env.creates_processes_externally, env.local_rank(), env.node_rank(), env.main_address

    assert same_outcome(snippet)[0][0] == "value"
    if "MASTER_PORT" in variables:  # ranks started by hand: the world from devices and num_nodes, nothing launched
        def ranks(f):
            fabric = fw(f).Fabric(accelerator="cpu", devices=2, num_nodes=3, strategy="ddp")
            return fabric.world_size, fabric.strategy.cluster_environment.creates_processes_externally

        assert same_outcome(ranks)[0] == ("value", (6, True))


def test_ranks_started_by_hand_without_master_port_get_a_clear_error(plain_process):
    from fabriclite import Fabric

    plain_process.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="LOCAL_RANK='1' is set.*MASTER_PORT is not set"):
        Fabric(accelerator="cpu", devices=2, strategy="ddp")
    plain_process.setenv("MASTER_PORT", "4567")
    plain_process.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="makes 2 ranks, but WORLD_SIZE=3"):
        Fabric(accelerator="cpu", devices=2, strategy="ddp")


def test_srun_on_the_path_but_unused_gives_lightnings_hint(plain_process):
    # the real srun (Debian's slurm-wlm, which the slurm engine lane installs): no program stands in for it
    if shutil.which("srun") is None:
        pytest.skip("srun is not installed (make env-engine-slurm installs SLURM's tools)")
    snippet = (lambda f: fw(f).Fabric(accelerator="cpu", devices=1) and None)
    assert same_outcome(snippet, match="`srun` command is available") == (("value", None), ["PossibleUserWarning"])
