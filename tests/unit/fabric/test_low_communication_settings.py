"""DiLoCo / LocalSGD settings (fabriclite.strategies.torchft.diloco), checked before anything starts: at
``Fabric(...)`` (the strategy's constructor, or the name with `fabriclite run`'s settings in the environment) and
when `fabriclite run` parses its flags; and the fragments streaming DiLoCo cuts a model into. No torchft needed
(the strategies run in the ft lane: tests/integration/backends/lane_ft/test_lane_ft_diloco.py)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from fabriclite import Fabric, cli
from fabriclite.strategies import DiLoCoStrategy, LocalSGDStrategy
from fabriclite.strategies.torchft.diloco_settings import SETTINGS_ENV, fragments_of

BAD = [
    (dict(sync_every=7, fragments=2), r"sync_every=7 is not divisible by fragments=2.*sync_every=6"),
    (dict(sync_every=2, fragments=3), r"sync_every=2 is smaller than fragments=3.*sync_every >= 3"),
    (dict(sync_every=0), r"sync_every=0 must be >= 1"),
    (dict(sync_every=10, fragments=0), r"fragments=0 must be >= 1"),
    (dict(sync_every=10, fragments=2, fragment_sync_delay=5), r"fragment_sync_delay=5 must be >= 0 and below "
                                                               r"sync_every / fragments = 5.*0\.\.4"),
    (dict(sync_every=10, fragment_sync_delay=-1), r"fragment_sync_delay=-1 must be >= 0"),
    (dict(sync_every=10, fragment_update_alpha=1.5), r"fragment_update_alpha=1\.5 must be a number in \[0, 1\]"),
    (dict(sync_every=10, fragment_update_alpha=-0.1), r"fragment_update_alpha=-0\.1 must be a number in \[0, 1\]"),
    (dict(sync_every=2.5), r"sync_every=2\.5 must be an int"),
    (dict(sync_every=10, outer_lr=-1.0), r"outer_lr=-1\.0 must be a number >= 0"),
    (dict(sync_every=10, outer_optimizer="adam"), r"outer_optimizer='adam'; expected 'sgd' or a callable"),
]


@pytest.fixture(autouse=True)
def no_cli_settings(monkeypatch):
    monkeypatch.delenv(SETTINGS_ENV, raising=False)


@pytest.mark.parametrize("kwargs, pattern", BAD)
def test_each_bad_setting_is_a_value_error_at_fabric(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Fabric(accelerator="cpu", strategy=DiLoCoStrategy(**kwargs))


@pytest.mark.parametrize("kwargs, pattern", BAD[:2])
def test_a_bad_setting_from_the_cli_fails_fabric_by_name(monkeypatch, kwargs, pattern):
    monkeypatch.setenv(SETTINGS_ENV, json.dumps(kwargs))
    with pytest.raises(ValueError, match=pattern):
        Fabric(accelerator="cpu", strategy="diloco")


def test_defaults_are_the_papers_and_the_cli_fills_what_the_code_leaves_unset(monkeypatch):
    settings = DiLoCoStrategy().settings
    assert (settings.sync_every, settings.fragments, settings.outer_lr, settings.outer_momentum) == (500, 1, 0.7, 0.9)
    outer = settings.outer([nn.Parameter(torch.zeros(2))])
    assert isinstance(outer, torch.optim.SGD) and outer.defaults["nesterov"] and outer.defaults["lr"] == 0.7
    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"sync_every": 20, "fragments": 2}))
    settings = DiLoCoStrategy(fragment_sync_delay=3).settings
    assert (settings.sync_every, settings.fragments, settings.fragment_sync_delay) == (20, 2, 3)
    with pytest.raises(ValueError, match=r"sync_every=40 conflicts with `fabriclite run --sync-every 20`"):
        DiLoCoStrategy(sync_every=40)
    assert DiLoCoStrategy(sync_every=20).settings.sync_every == 20  # the same value twice is no conflict


def test_local_sgd_has_no_diloco_settings(monkeypatch):
    assert LocalSGDStrategy().settings.sync_every == 100
    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"sync_every": 8, "outer_lr": 0.5}))
    with pytest.raises(ValueError, match=r"strategy='local_sgd' averages the parameters and has no outer_lr"):
        LocalSGDStrategy()


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="checks the refusal without Triton")
def test_quantizing_without_triton_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"should_quantize=True needs Triton.*sends the pseudo-gradients "
                                         r"unquantized"):
        DiLoCoStrategy(sync_every=10, should_quantize=True)


def run_cli(capsys, *args: str) -> tuple:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", *args, __file__])
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("args, expected", [
    (["--fault-tolerant", "--strategy", "diloco", "--sync-every", "7", "--fragments", "2"],
     "strategy='diloco': sync_every=7 is not divisible by fragments=2"),
    (["--fault-tolerant", "--strategy", "diloco", "--sync-every", "2", "--fragments", "3"],
     "sync_every=2 is smaller than fragments=3"),
    (["--fault-tolerant", "--strategy", "diloco", "--sync-every", "10", "--fragments", "2",
      "--fragment-sync-delay", "5"], "fragment_sync_delay=5 must be >= 0 and below sync_every / fragments = 5"),
    (["--fault-tolerant", "--strategy", "diloco", "--fragment-update-alpha", "2"],
     "fragment_update_alpha=2.0 must be a number in [0, 1]"),
    (["--fault-tolerant", "--strategy", "local_sgd", "--fragments", "2"],
     "strategy='local_sgd' averages the parameters and has no fragments"),
    (["--fault-tolerant", "--sync-every", "10"],
     "--sync-every is a setting of --strategy diloco (or local_sgd) under --fault-tolerant"),
    (["--strategy", "diloco", "--num-nodes", "2"], "--strategy diloco runs with --fault-tolerant"),
])
def test_the_cli_refuses_bad_settings_in_one_line_before_starting(capsys, args, expected):
    code, line = run_cli(capsys, *args)
    assert code == 2 and line.startswith("fabriclite run: error: ") and expected in line, line


def test_fragments_are_contiguous_runs_of_about_equal_size():
    model = nn.Sequential(nn.Linear(4, 100), nn.Linear(100, 100), nn.Linear(100, 3))
    names = [name for name, _ in model.named_parameters()]
    for count in range(1, len(names) + 1):
        fragments = fragments_of(model, count)
        assert len(fragments) == count and all(list(f.parameters()) for f in fragments)
        assert [name for f in fragments for name, _ in f.named_parameters()] == names  # all, in order, once
    sizes = [sum(p.numel() for p in f.parameters()) for f in fragments_of(model, 3)]
    assert sizes == [500, 10000, 403]  # the 100x100 weight alone: no cut could be more even
    frozen = nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    assert [n for n, _ in fragments_of(frozen, 1)[0].named_parameters()] == ["weight"]
    with pytest.raises(ValueError, match=r"fragments=7, but the model has only 6 trainable parameter tensors"):
        fragments_of(model, 7)


def test_under_fault_tolerant_a_script_may_choose_diloco_but_not_contradict_the_flag(monkeypatch):
    from fabriclite.connector import CLI_ENV

    monkeypatch.setenv(CLI_ENV["strategy"], "fault_tolerant")  # `fabriclite run --fault-tolerant`, no --strategy
    for strategy in ("diloco", DiLoCoStrategy(sync_every=10), LocalSGDStrategy()):
        with pytest.raises(ValueError, match=r"strategy='(diloco|local_sgd)' (needs torchft|runs in a script)"):
            Fabric(accelerator="cpu", strategy=strategy)  # accepted by the CLI check; then this process is no rank
    monkeypatch.setenv(CLI_ENV["strategy"], "diloco")
    with pytest.raises(ValueError, match=r"conflicts with `fabriclite run --strategy diloco`"):
        Fabric(accelerator="cpu", strategy="local_sgd")
