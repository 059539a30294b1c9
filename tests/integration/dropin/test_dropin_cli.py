"""CLI-launched scripts: under `fabriclite run` and under Lightning's CLI contract (LT_* variables, as `fabric run`
sets them for torchrun), `Fabric(...)` joins the job in __init__; launch() is then a no-op and launch(fn) runs fn
on this rank. Plus Lightning's LT_* conflict rule (checked against Lightning's own connector) and the CLI error rule."""
from __future__ import annotations

import sys

import pytest

from helpers import free_port, json_lines, run, write_script

NO_LAUNCH = """
    import json, sys
    import torch
    import torch.distributed as dist
    from fabriclite import Fabric

    fabric = Fabric()  # no launch(): the CLI made this process a rank, Fabric joins here
    joined = dist.is_initialized()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.full((2, 4), float(fabric.global_rank + 1))
    fabric.backward(model(x).sum())
    opt.step()
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    none = fabric.launch()                                      # a no-op
    value = fabric.launch(lambda f, k: f.global_rank * 10 + k, 7)  # runs on this rank
    print("FACTS " + json.dumps(dict(
        rank=fabric.global_rank, world=fabric.world_size, joined=joined, total=total.item(), none=none,
        value=value, weight=model.weight.detach().flatten().tolist(), args=sys.argv[1:])), flush=True)
"""


def _expected_weight():
    """Plain torch, one process: DDP averages the two ranks' gradients."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for rank in range(2):
        model.zero_grad()
        model(torch.full((2, 4), float(rank + 1))).sum().backward()
        grads.append(model.weight.grad.clone())
    model.weight.grad = (grads[0] + grads[1]) / 2
    model.bias.grad = torch.full_like(model.bias, 2.0)  # d(sum)/d(bias) = batch size on both ranks
    opt.step()
    return model.weight.detach().flatten().tolist()


def _check(result, args):
    assert result.returncode == 0, result.stderr
    facts = sorted(json_lines(result.stdout), key=lambda f: f["rank"])
    assert [f["rank"] for f in facts] == [0, 1], result.stdout
    weight = _expected_weight()
    for f in facts:
        assert f["world"] == 2 and f["joined"] is True and f["total"] == 1.0 and f["none"] is None
        assert f["value"] == f["rank"] * 10 + 7 and f["args"] == args
        assert f["weight"] == pytest.approx(weight, abs=1e-6)


@pytest.mark.slow
def test_fabriclite_run_joins_in_init(tmp_path):
    script = write_script(tmp_path, NO_LAUNCH)
    result = run([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2", str(script),
                  "--lr", "1"], env={"OMP_NUM_THREADS": "1"}, timeout=120)
    _check(result, ["--lr", "1"])


@pytest.mark.slow
def test_lightning_cli_contract_joins_in_init(tmp_path):
    """What `fabric run --accelerator=cpu --devices=2` does: LT_* variables, then torchrun."""
    port = free_port()
    script = write_script(tmp_path, NO_LAUNCH)
    env = {"LT_CLI_USED": "1", "LT_ACCELERATOR": "cpu", "LT_DEVICES": "2", "LT_NUM_NODES": "1",
           "OMP_NUM_THREADS": "1"}
    result = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
                  "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), "x"], env=env, timeout=120)
    _check(result, ["x"])


# ---------------------------------------------------------------------- LT_* variables, in this process
CASES = [  # (name, code value, default, LT value, LT_CLI_USED)
    ("devices", "auto", "auto", "2", "1"), ("devices", 3, "auto", "2", "1"), ("devices", "2", "auto", "2", "1"),
    ("devices", 3, "auto", "2", "0"), ("accelerator", "cuda", "auto", "cpu", "1"),
    ("accelerator", "auto", "auto", "cpu", "1"), ("precision", None, None, "bf16-mixed", "1"),
    ("precision", "64-true", None, "bf16-mixed", "1"), ("num_nodes", 1, 1, "2", "1"),
    ("num_nodes", 3, 1, "2", "1"), ("strategy", "ddp_spawn", "auto", "ddp", "0"),
]


#: fabriclite's defaults of Fabric(...) (Lightning's num_nodes default is 1: both count as unset)
OUR_DEFAULTS = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": None, "precision": None}


@pytest.mark.parametrize("name,value,default,lt_value,used", CASES)
def test_lt_variables_follow_lightnings_rule(no_launch_env, name, value, default, lt_value, used):
    """Lightning's own connector is the reference: the LT_ value wins, unless LT_CLI_USED=1 and the code gives a
    value that is neither the default nor the LT_ value (a ValueError)."""
    from lightning.fabric.connector import _Connector

    from fabriclite.connector import _from_cli

    no_launch_env.setenv("LT_" + name.upper(), lt_value)
    no_launch_env.setenv("LT_CLI_USED", used)
    try:
        expected = _Connector._argument_from_env(name, value, default=default)
    except ValueError:
        with pytest.raises(ValueError, match="conflicts"):
            _from_cli(name, value, OUR_DEFAULTS[name])
        return
    assert str(_from_cli(name, value, OUR_DEFAULTS[name])) == str(expected)


def test_run_override_under_the_cli_is_a_type_error(no_launch_env):
    from lightning.fabric import Fabric as LightningFabric

    from fabriclite import Fabric

    class Mine(Fabric):
        def run(self):
            return 1

    class Theirs(LightningFabric):
        def run(self):
            return 1

    for env in ({"FABRICLITE_CLI_USED": "1"}, {"LT_CLI_USED": "1"}):
        for k, v in env.items():
            no_launch_env.setenv(k, v)
        with pytest.raises(TypeError, match="Overriding `Fabric.run\\(\\)` and launching from the CLI"):
            Mine(accelerator="cpu", devices=1)
        if "LT_CLI_USED" in env:
            with pytest.raises(TypeError, match="Overriding `Fabric.run\\(\\)` and launching from the CLI"):
                Theirs(accelerator="cpu", devices=1)
        for k in env:
            no_launch_env.delenv(k)


def test_unsupported_lightning_arguments_name_compat_md(no_launch_env):
    from fabriclite import Fabric
    from fabriclite.connector import LIGHTNING_ONLY_STRATEGIES
    from fabriclite.strategies import STRATEGIES
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    missing = set(STRATEGY_REGISTRY.available_strategies()) - set(STRATEGIES)
    assert missing <= LIGHTNING_ONLY_STRATEGIES  # every Lightning name we lack has the pointed error
    for name in sorted(missing):
        with pytest.raises(ValueError, match=f"strategy='{name}'.*docs/compat.md"):
            Fabric(accelerator="cpu", strategy=name)
    with pytest.raises(ValueError, match="transformer-engine.*docs/compat.md"):
        Fabric(accelerator="cpu", precision="transformer-engine")
    with pytest.raises(TypeError, match="plugins"):
        Fabric(accelerator="cpu", plugins=[object()])


# ---------------------------------------------------------------------- the CLI error rule
@pytest.mark.parametrize("argv,message", [
    (["--devices", "abc"], "abc"),
    (["--node-rank", "3", "--num-nodes", "2"], "--node-rank 3 is out of range"),
])
def test_cli_errors_end_with_one_line_and_exit_2(tmp_path, capsys, no_launch_env, argv, message):
    from fabriclite.cli import main

    script = write_script(tmp_path, "raise SystemExit('must not run')\n")
    with pytest.raises(SystemExit) as info:
        main(["run", "--accelerator", "cpu", *argv, str(script)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fabriclite run: error: ") and message in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_cli_missing_script_exits_2(tmp_path, capsys, no_launch_env):
    from fabriclite.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", "--accelerator", "cpu", str(tmp_path / "nope.py")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fabriclite run: error: script ") and "nope.py" in err[-1]


@pytest.mark.slow
def test_cli_error_rule_end_to_end(tmp_path):
    script = write_script(tmp_path, "raise SystemExit('must not run')\n")
    result = run([sys.executable, "-m", "fabriclite", "run", "--devices", "abc", str(script)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("fabriclite run: error: ") and "abc" in lines[-1]
    assert "Traceback" not in result.stderr and "must not run" not in result.stderr
