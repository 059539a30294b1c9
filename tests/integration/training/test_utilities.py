"""fabriclite.utilities and the small API additions the conformance test asked for, checked against
Lightning's own implementations where one exists (an independent reference), and on real ranks where
they communicate."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections import namedtuple

import pytest
import torch
from torch import nn

import fabriclite
from fabriclite import utilities
from fabriclite.precision import HalfPrecision, MixedPrecision, Precision
from fabriclite.strategies import DDPStrategy, SingleDeviceStrategy

import lightning.fabric.utilities as lightning_utilities  # a test dependency (pinned in pyproject)


def test_attribute_dict_matches_lightning():
    ours, theirs = utilities.AttributeDict(b=2, a=[1]), lightning_utilities.AttributeDict(b=2, a=[1])
    ours.c, theirs.c = "x", "x"
    ours.b += 1
    theirs.b += 1
    assert ours == theirs and repr(ours) == repr(theirs) and repr(utilities.AttributeDict()) == ""
    del ours.c
    assert "c" not in ours
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        ours.missing
    with pytest.raises(KeyError):
        del ours.missing


def test_lightning_enum_is_lightnings():
    assert utilities.LightningEnum is lightning_utilities.LightningEnum


def test_move_data_to_device_matches_lightning():
    Pair = namedtuple("Pair", "x y")

    class Box:  # a user type with to(): moved like a tensor
        def __init__(self, t):
            self.t = t

        def to(self, device, **kwargs):
            return Box(self.t.to(device))

    batch = {"a": torch.ones(2), "b": [Pair(torch.zeros(1), "label"), (3, torch.arange(3))], "box": Box(torch.ones(1))}
    ours = utilities.move_data_to_device(batch, "meta")
    theirs = lightning_utilities.move_data_to_device(batch, torch.device("meta"))
    assert ours["a"].device.type == "meta" and ours["box"].t.device.type == "meta"
    assert isinstance(ours["b"][0], Pair) and ours["b"][0].y == "label" and ours["b"][1][0] == 3
    flat = lambda b: [b["a"], b["b"][0].x, b["b"][1][1], b["box"].t]  # noqa: E731
    assert [(t.device, t.dtype, t.shape) for t in flat(ours)] == [(t.device, t.dtype, t.shape) for t in flat(theirs)]
    assert batch["a"].device.type == "cpu"  # the input is left as it was


def test_suggested_max_num_workers_matches_lightning():
    for ranks in (1, 2, 3, 64):
        assert utilities.suggested_max_num_workers(ranks) == lightning_utilities.suggested_max_num_workers(ranks)
    with pytest.raises(ValueError, match="local_world_size=0"):
        utilities.suggested_max_num_workers(0)


def test_measure_flops_matches_lightning():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        x = torch.randn(8, 32)
    forward = lambda: model(x)  # noqa: E731
    loss = lambda y: y.sum()  # noqa: E731
    assert utilities.measure_flops(model, forward) == lightning_utilities.measure_flops(model, forward) == \
        2 * 8 * (32 * 64 + 64 * 4)
    assert utilities.measure_flops(model, forward, loss) == lightning_utilities.measure_flops(model, forward, loss)


def test_disable_possible_user_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        utilities.disable_possible_user_warnings()
        warnings.warn("maybe intended", utilities.PossibleUserWarning)
        warnings.warn("a real one", UserWarning)
    assert [str(w.message) for w in caught] == ["a real one"]


def test_rank_from_env_reads_lightnings_variables_in_order(monkeypatch):
    from fabriclite.environments.process_rank import rank_from_env

    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert rank_from_env() is None
    monkeypatch.setenv("JSM_NAMESPACE_RANK", "4")
    assert rank_from_env() == 4
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert rank_from_env() == 3
    monkeypatch.setenv("LOCAL_RANK", "0")  # before SLURM_PROCID, as in Lightning
    assert rank_from_env() == 0
    monkeypatch.setenv("RANK", "1")
    assert rank_from_env() == 1


def test_rank_zero_only_gets_its_rank_on_first_use_not_on_import():
    code = ("import sys, fabriclite\n"
            "from lightning_utilities.core.rank_zero import rank_zero_only as shared\n"
            "from fabriclite.utilities import rank_zero_only\n"
            "from fabriclite.utilities.rank_zero import rank_zero_warn\n"
            "print(hasattr(shared, 'rank'))\n"  # importing set nothing
            "print(rank_zero_only(lambda: 'ran')())\n"  # first use: the rank from RANK
            "print(shared.rank, rank_zero_only.rank)\n"
            "shared.rank = 0\n"  # one rank for fabriclite, Lightning and lightning_utilities
            "print(rank_zero_only.rank, 'lightning' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "RANK": "1"}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "None", "1", "1", "0", "False"]


def _ranks_and_shared_fs(fabric, path):
    from fabriclite.utilities import is_shared_filesystem, rank_zero_only

    shared = is_shared_filesystem(fabric.strategy, path)
    per_rank = is_shared_filesystem(fabric.strategy, os.path.join(path, f"rank{fabric.global_rank}"))
    try:
        is_shared_filesystem(fabric.strategy, os.path.join(path, "missing"))
        missing = "no error"
    except FileNotFoundError as e:
        missing = str(e)
    return rank_zero_only.rank, shared, per_rank, missing, sorted(os.listdir(path))


def test_rank_zero_only_and_is_shared_filesystem_on_two_ranks(pool2, tmp_path):
    for r in (0, 1):
        (tmp_path / f"rank{r}").mkdir()
    results = pool2.run(_ranks_and_shared_fs, str(tmp_path))
    assert [r[0] for r in results] == [0, 1]  # set by the strategy when each rank joined
    assert [r[1] for r in results] == [True, True]
    assert [r[2] for r in results] == [False, False]  # the paths differ between the ranks
    assert all("does not exist on every rank" in r[3] for r in results)
    assert results[0][4] == ["rank0", "rank1"]  # the marker file is gone


def test_find_usable_cuda_devices():
    from fabriclite.accelerators import find_usable_cuda_devices

    assert find_usable_cuda_devices(0) == []
    if torch.cuda.is_available():
        assert find_usable_cuda_devices(-1) == list(range(torch.cuda.device_count()))
        assert find_usable_cuda_devices(1) == [0]
        with pytest.raises(ValueError, match="has only"):
            find_usable_cuda_devices(torch.cuda.device_count() + 1)
    else:
        with pytest.raises(ValueError, match="no visible CUDA devices"):
            find_usable_cuda_devices(1)


def test_strategies_take_lightnings_positional_order_and_a_checkpoint_io():
    precision = HalfPrecision("bf16-true")
    ddp = DDPStrategy(None, None, None, None, precision, "gloo")
    assert ddp.precision is precision and ddp.process_group_backend == "gloo"
    assert SingleDeviceStrategy("cpu", None, None, precision).precision is precision
    from fabriclite.plugins.io import TorchCheckpointIO

    for make in (lambda io: DDPStrategy(checkpoint_io=io), lambda io: SingleDeviceStrategy(checkpoint_io=io)):
        io = TorchCheckpointIO()
        assert make(io).checkpoint_io is io
        assert type(make(None).checkpoint_io) is TorchCheckpointIO  # Lightning's default
        with pytest.raises(TypeError, match="checkpoint_io=<object .* is not a CheckpointIO"):
            make(object())


def test_parallel_strategies_share_lightnings_base_class():
    from fabriclite.strategies import ParallelStrategy

    ddp = DDPStrategy(parallel_devices=[torch.device("cpu")] * 3)
    assert isinstance(ddp, ParallelStrategy) and not isinstance(SingleDeviceStrategy(), ParallelStrategy)
    assert ddp.num_processes == 3 and ddp.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_precision_hooks_run_in_lightnings_order():
    calls = []

    class Recording(Precision):
        def pre_backward(self, tensor, module):
            calls.append("pre")
            return tensor

        def backward(self, tensor, model, *args, **kwargs):
            calls.append("backward")
            super().backward(tensor, model, *args, **kwargs)

        def post_backward(self, tensor, module):
            calls.append("post")
            return tensor

        def teardown(self):
            calls.append("teardown")

    strategy = SingleDeviceStrategy(precision=Recording())
    weight = torch.ones(2, requires_grad=True)
    strategy.backward((weight * 3).sum(), None)
    strategy.teardown()
    assert calls == ["pre", "backward", "post", "teardown"] and torch.equal(weight.grad, torch.full((2,), 3.0))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    assert list(Precision().main_params(optimizer)) == [weight]
    assert MixedPrecision("bf16-mixed", "cpu").precision == "bf16-mixed"
    MixedPrecision("bf16-mixed", "cpu").load_state_dict(state_dict={})  # Lightning's keyword


def test_top_level_and_plugin_names():
    from fabriclite import plugins
    from fabriclite import wrappers

    assert fabriclite.is_wrapped is wrappers.is_wrapped and not fabriclite.is_wrapped(nn.Linear(1, 1))
    assert plugins.MixedPrecision is MixedPrecision and plugins.Precision is Precision
    from fabriclite.accelerators import TPUAccelerator, XLAAccelerator

    assert TPUAccelerator is XLAAccelerator


def test_seed_everything_workers_default_matches_lightning(monkeypatch):
    from lightning.fabric.utilities.seed import seed_everything as lightning_seed

    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    lightning_seed(3, verbose=False)
    theirs = os.environ["PL_SEED_WORKERS"]
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    fabriclite.seed_everything(3, verbose=False)
    assert os.environ["PL_SEED_WORKERS"] == theirs == "0"
    fabriclite.Fabric.seed_everything(3, verbose=False)
    assert os.environ["PL_SEED_WORKERS"] == "1"  # Fabric.seed_everything defaults workers to True, as Lightning's


def _throughput_run(make):
    meter = make()
    out = []
    for i in range(1, 7):
        meter.update(time=0.5 * i + 0.01 * i * i, batches=i, samples=4 * i, lengths=40 * i, flops=1000 + i)
        out.append(meter.compute())
    with pytest.raises(ValueError, match="increase"):
        meter.update(time=0.1, batches=99, samples=99)
    meter.reset()
    meter.update(time=9.0, batches=1, samples=1)
    return out, meter.compute()


def test_throughput_matches_lightning():
    for kwargs in ({}, {"world_size": 2, "window_size": 3, "available_flops": 50.0, "separator": "|"}):
        ours = _throughput_run(lambda: utilities.Throughput(**kwargs))
        theirs = _throughput_run(lambda: lightning_utilities.Throughput(**kwargs))
        assert ours == theirs, kwargs
    assert "device|mfu" in ours[0][-1] and "flops_per_sec" in ours[0][-1]


def test_throughput_monitor_logs_like_lightnings():
    import lightning.fabric as lf

    def run(fabric_module, utils):
        class Recorder(fabric_module.loggers.Logger):
            name, version = "r", 0
            records = []

            def log_metrics(self, metrics, step=None):
                self.records.append((dict(metrics), step))

            def log_hyperparams(self, params, *args, **kwargs):
                pass

        recorder = Recorder()
        fabric = fabric_module.Fabric(accelerator="cpu", devices=1, loggers=recorder)
        monitor = utils.ThroughputMonitor(fabric, window_size=2)
        for i in range(1, 4):
            monitor.update(time=float(i), batches=i, samples=2 * i)
            monitor.compute_and_log(step=None if i < 3 else 10)
        return recorder.records

    assert run(fabriclite, utilities) == run(lf, lightning_utilities)
