"""strategy="fsdp" (FSDP2) on real ranks: parity with DDP (losses, weights, clipping, accumulation), memory,
the set-up paths (optimizer built before sharding, setup_module first, meta init), bad input.

Model dimensions are multiples of 6, so FSDP2's padding is the same on 2 and 3 ranks. Each job runs many checks
in one pool call (starting ranks is what costs here)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.strategies import FSDPStrategy
from fabriclite.strategies import fsdp2 as sharding

STEPS = 10


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def build(seed: int = 0, width: int = 12, depth: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), *[Block(width) for _ in range(depth)], nn.Linear(width, 6))


def fsdp_fabric(world: int, **kwargs) -> Fabric:
    """A Fabric on the pool's ranks (the process group exists: launch() joins it)."""
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FSDPStrategy(**kwargs) if kwargs else "fsdp")
    fabric.launch()
    return fabric


def batches(rank: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(8, 6, generator=g) for _ in range(steps)]


def train(fabric, model, opt, steps: int = STEPS, accumulate: int = 1, clip: bool = True):
    """Rank-local losses and the clipping norms of ``steps`` AdamW steps."""
    losses, norms = [], []
    data = batches(fabric.global_rank, steps * accumulate)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x = data[step * accumulate + micro]
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = model(x).pow(2).mean()
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        if clip:
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.05)))
        opt.step()
    return losses, norms


def full_weights(fabric, model):
    state = fabric.strategy.get_module_state_dict(model._forward_module)
    return {k: v.clone() for k, v in state.items()}


def _parity(fabric):
    """DDP (the pool's own fabric) and fsdp from the same start: every path, one call."""
    out = {}
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    out["ddp"] = train(fabric, model, opt) + (model.module.state_dict(),)
    out["ddp_bytes"] = sharding.counted_bytes(model.module, [opt.optimizer])
    model = build()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["ddp_accumulated"] = train(fabric, model, opt, steps=3, accumulate=2)[0]

    fsdp = fsdp_fabric(fabric.world_size, auto_wrap_policy={Block})
    # the optimizer built before sharding
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fsdp.setup(model, opt)
    out["fsdp"] = train(fsdp, model, opt) + (full_weights(fsdp, model),)
    out["fsdp_bytes"] = sharding.counted_bytes(model._forward_module, [opt.optimizer])
    out["dtensor"] = type(next(model.parameters())).__name__
    out["fsdp_modules"] = sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP"))
    # Lightning's order: setup_module, then the optimizer from the sharded parameters
    model = fsdp.setup_module(build())
    opt = fsdp.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["fsdp_module_first"] = train(fsdp, model, opt) + (full_weights(fsdp, model),)
    # accumulation under no_backward_sync
    model = build()
    model, opt = fsdp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["fsdp_accumulated"] = train(fsdp, model, opt, steps=3, accumulate=2)[0]
    # meta init: nothing allocated until sharding; then the same start loaded from a full state dict
    with fsdp.init_module(empty_init=True):
        meta = build(seed=5)
    out["meta_before"] = all(p.is_meta for p in meta.parameters())
    model, opt = fsdp.setup(meta, torch.optim.AdamW(meta.parameters(), lr=1e-2))
    out["meta_after"] = not any(p.is_meta for p in model.parameters())
    fsdp.strategy.load_module_state_dict(model._forward_module, build().state_dict())
    out["fsdp_meta"] = train(fsdp, model, opt) + (full_weights(fsdp, model),)
    # collectives go over the same group
    out["all_reduce"] = fsdp.all_reduce(torch.tensor(float(fsdp.global_rank + 1)), reduce_op="sum").item()
    return out


def _close(a, b, rel=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.allclose(a, b, rtol=rel, atol=1e-7)


def test_fsdp_matches_ddp_on_every_setup_path(pool2):
    results = pool2.run(_parity)
    for rank, r in enumerate(results):
        ddp_losses, ddp_norms, ddp_weights = r["ddp"]
        assert r["dtensor"] == "DTensor" and "FSDPBlock" in r["fsdp_modules"] and "FSDPSequential" in r["fsdp_modules"]
        for path in ("fsdp", "fsdp_module_first", "fsdp_meta"):
            losses, norms, weights = r[path]
            assert _close(losses, ddp_losses), (path, losses, ddp_losses)
            assert _close(norms, ddp_norms), (path, norms, ddp_norms)  # the global norm, as DDP computes it
            if rank == 0:  # full state gathered on rank 0
                assert sorted(weights) == sorted(ddp_weights)
                for key, value in ddp_weights.items():
                    assert _close(weights[key], value), (path, key)
        assert _close(r["fsdp_accumulated"], r["ddp_accumulated"])
        assert r["meta_before"] and r["meta_after"]
        assert r["all_reduce"] == 3.0
        assert r["fsdp_bytes"] <= 1.05 * r["ddp_bytes"] / 2, (r["fsdp_bytes"], r["ddp_bytes"])
        assert min(ddp_norms) > 0.05  # clipping was active, so the norms mattered


def _meta_budget(fabric, budget: int):
    fsdp = fsdp_fabric(fabric.world_size, auto_wrap_policy={Block})
    with fsdp.init_module(empty_init=True):
        model = build(width=96, depth=3)
    full = 4 * 4 * sum(p.numel() for p in model.parameters())  # fp32 parameter + gradient + 2 AdamW moments
    model, opt = fsdp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses, _ = train(fsdp, model, opt, steps=3, clip=False)
    return full, sharding.counted_bytes(model._forward_module, [opt.optimizer]), losses


def test_meta_init_trains_a_model_larger_than_the_per_rank_budget(pool2):
    budget = 1_000_000  # counted bytes per rank
    for full, counted, losses in pool2.run(_meta_budget, budget):
        assert full > budget >= counted, (full, counted)
        assert all(torch.isfinite(torch.tensor(losses)))


def _bad_setups(fabric):
    fsdp = fsdp_fabric(fabric.world_size)
    errors = {}
    model = build()
    stepped = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="already holds state") as info:
        fsdp.setup(model, stepped)
    errors["stateful"] = str(info.value)
    other = build()
    with pytest.raises(ValueError, match="another copy of the model"):
        fsdp.setup(build(), torch.optim.AdamW(other.parameters()))

    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(6, 6))

        def forward(self, x):
            return x @ self.w

    with fsdp.init_module(empty_init=True):
        bad = nn.Sequential(nn.Linear(6, 6), NoReset())
    with pytest.raises(RuntimeError, match=r"\['NoReset'\] have no reset_parameters"):
        fsdp.setup(bad)
    return errors


def test_bad_setups_raise_on_every_rank(pool2):
    for errors in pool2.run(_bad_setups):
        assert "optimizer 0 (AdamW)" in errors["stateful"]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(state_dict_type="half"), ValueError, r"state_dict_type='half'.*'sharded'.*'full'"),
    (dict(auto_wrap_policy=42), TypeError, r"auto_wrap_policy=42.*set of module classes"),
    (dict(auto_wrap_policy={int}), TypeError, r"only nn.Module subclasses"),
    (dict(activation_checkpointing_policy="Block"), TypeError, r"activation_checkpointing_policy='Block'"),
    (dict(sharding_strategy="QUARTER"), ValueError, r"sharding_strategy='QUARTER'.*FULL_SHARD"),
    (dict(mixed_precision="bf16"), TypeError, r"mixed_precision='bf16'.*MixedPrecisionPolicy"),
    (dict(cpu_offload="yes"), TypeError, r"cpu_offload='yes'"),
    (dict(bucket_cap_mb=4), TypeError, r"unexpected keyword arguments \['bucket_cap_mb'\]"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


@pytest.mark.parametrize("fabric_kwargs, match", [
    (dict(strategy="fsdp", devices=1), r"single process shards nothing.*devices=2"),
    (dict(strategy="fsdp_cpu_offload", devices=2), r"cpu_offload=True.*accelerator='cpu'"),
    (dict(strategy=FSDPStrategy(cpu_offload=True), devices=2), r"cpu_offload=True"),
])
def test_unsupported_configurations_fail_before_anything_starts(fabric_kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fabric(accelerator="cpu", **fabric_kwargs)


@pytest.mark.parametrize("accelerator", ["mps", "tpu"])
def test_fsdp_names_the_accelerators_it_runs_on(accelerator):
    with pytest.raises(ValueError, match=rf"runs on cpu.*cuda.*accelerator='{accelerator}'.*not supported"):
        FSDPStrategy().check_configuration(accelerator, 2)


def test_policies_in_every_accepted_form():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    block, linear = Block(6), nn.Linear(6, 6)
    for policy in ({Block}, [Block], ModuleWrapPolicy({Block}), lambda m: isinstance(m, Block),
                   lambda module, recurse, nonwrapped_numel: isinstance(module, Block)):
        selected = sharding.as_policy(policy, "auto_wrap_policy")
        assert selected(block) and not selected(linear)
    assert sharding.sharding_plan("shard_grad_op") == ("SHARD_GRAD_OP", "1d", False)
    from torch.distributed.fsdp import ShardingStrategy

    assert sharding.sharding_plan(ShardingStrategy.HYBRID_SHARD) == ("HYBRID_SHARD", "2d", True)


VARIANTS = {
    "SHARD_GRAD_OP": dict(sharding_strategy="SHARD_GRAD_OP"),
    "NO_SHARD": dict(sharding_strategy="NO_SHARD"),
    "HYBRID_SHARD": dict(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block}),
    "activation checkpointing": dict(activation_checkpointing_policy={Block}, auto_wrap_policy={Block}),
}


def _variants(fabric):
    out = {}
    model = build()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["ddp"] = train(fabric, model, opt, steps=5)[0]
    for name, kwargs in VARIANTS.items():
        fsdp = fsdp_fabric(fabric.world_size, **kwargs)
        model = fsdp.setup_module(build())
        opt = fsdp.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        out[name] = train(fsdp, model, opt, steps=5)[0]
        out[name + " mesh"] = tuple(fsdp.strategy.device_mesh.shape)
    for precision in ("bf16-mixed", "bf16-true"):
        fsdp = Fabric(accelerator="cpu", devices=fabric.world_size, precision=precision,
                      strategy=FSDPStrategy(auto_wrap_policy={Block}))
        fsdp.launch()
        model = build()
        model, opt = fsdp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        out[precision] = train(fsdp, model, opt, steps=5)[0]
        out[precision + " policy"] = str(fsdp.strategy.mixed_precision_config.param_dtype)
    return out


def test_every_sharding_strategy_and_precision_trains_like_ddp(pool2):
    for r in pool2.run(_variants):
        for name in VARIANTS:
            assert _close(r[name], r["ddp"]), (name, r[name], r["ddp"])
        assert r["SHARD_GRAD_OP mesh"] == (2,) and r["NO_SHARD mesh"] == (2, 1) and r["HYBRID_SHARD mesh"] == (1, 2)
        for precision in ("bf16-mixed", "bf16-true"):  # bf16 arithmetic: close to fp32, not equal
            assert _close(r[precision], r["ddp"], rel=2e-2), (precision, r[precision], r["ddp"])
        assert r["bf16-mixed policy"] == "torch.bfloat16" and r["bf16-true policy"] == "None"
