"""DDP's gradient bucket layout in fabric.resume_state(), on real ranks (fabriclite.strategies.ddp_buckets): what a
save records (the rebuild pending after the first backward is run at the save), that a load hands it to a freshly
built DDP before its first step (also when loaded before setup, and recorded at another world size), that an in-process
resume on 3 ranks is then bit-exact while the same resume without it is not, the torch-moved checks (a private part
gone, a layout not taken: a clear error naming torch's version), bad layouts, version 1 states, and the warning that
is left."""
from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
from torch import nn

from fabriclite.checkpoint import resume_state
from fabriclite.strategies import ddp_buckets

#: the uninterrupted run's buckets: gradient-ready order (head, mid, embed; bias first)
READY = [["head.bias", "head.weight", "mid.bias", "mid.weight", "embed.bias", "embed.weight"]]


class Reordered(nn.Module):
    """Registered head, embed, mid; used embed -> mid -> head (float32)."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.head = nn.Linear(width, 3)
        self.embed = nn.Linear(6, 48)
        self.mid = nn.Linear(48, width)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.embed(x)))))


def _setup(fabric, width=24):
    gc.collect()  # the modules of earlier tests on these ranks are gone: layouts map to the live ones
    torch.manual_seed(0)
    model = Reordered(width)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, optimizer, {"model": model, "optimizer": optimizer, "resume": fabric.resume_state()}


def _step(fabric, model, optimizer, step):
    g = torch.Generator().manual_seed(100 * step + fabric.global_rank)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    optimizer.zero_grad()
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()


def _ddp(model):
    return model._forward_module


def _resume(fabric, path, switched_off, width=24):
    model, optimizer, state = _setup(fabric, width)
    fresh = ddp_buckets.current(_ddp(model))
    _step(fabric, model, optimizer, 1)
    pending = ddp_buckets.current(_ddp(model))  # the rebuild waits for the next forward
    fabric.save(path, state)
    saved = torch.load(path, weights_only=True)["resume"]
    for step in range(2, 6):
        _step(fabric, model, optimizer, step)
    reference = [p.detach().clone() for p in model.parameters()]
    del model, optimizer, state
    model, optimizer, state = _setup(fabric, width)
    if switched_off:
        os.environ[ddp_buckets.SWITCH_ENV] = "0"
    try:
        fabric.load(path, state)
    finally:
        os.environ.pop(ddp_buckets.SWITCH_ENV, None)
    loaded = ddp_buckets.current(_ddp(model))
    for step in range(2, 6):
        _step(fabric, model, optimizer, step)
    exact = all(torch.equal(a, p) for a, p in zip(reference, model.parameters()))
    return fresh, pending, saved["version"], saved["ddp_buckets"], loaded, exact


def test_a_save_records_the_rebuilt_buckets_and_a_load_hands_them_to_a_new_ddp(pool3, tmp_path):
    path = str(tmp_path / "b.ckpt")
    fresh, pending, version, recorded, loaded, exact = pool3.run(_resume, path, False)[0]
    initial = [["head.weight", "head.bias", "embed.weight", "embed.bias", "mid.weight", "mid.bias"]]
    assert fresh == pending == initial  # one bucket in parameter order until the rebuild
    assert version == 2 and recorded == [READY]
    assert loaded == READY  # the new DDP has the recorded buckets before its first step
    assert exact


def test_negative_control_switched_off_the_resume_on_3_ranks_is_not_bit_exact(pool3, tmp_path):
    results = pool3.run(_resume, str(tmp_path / "c.ckpt"), True)
    fresh, _, _, recorded, loaded, exact = results[0]
    assert recorded == [READY] and loaded == fresh  # the layout was in the file, and not applied
    assert not exact, "the control matched: the test could not have failed"


def test_two_rebuilt_buckets_are_recorded_and_applied(pool3, tmp_path):
    # mid.weight of 48 x 6000 floats is more than the first bucket's 1 MiB: the rebuild makes two buckets
    _, _, _, recorded, loaded, exact = pool3.run(_resume, str(tmp_path / "w.ckpt"), False, 6000)[0]
    assert recorded == [[["head.bias", "head.weight", "mid.bias", "mid.weight"], ["embed.bias", "embed.weight"]]]
    assert loaded == recorded[0] and exact


def _load_before_setup(fabric, path):
    gc.collect()
    torch.manual_seed(0)
    state = {"resume": fabric.resume_state()}
    fabric.load(path, state)  # before the model is set up: its layout waits for setup
    model, _, _ = _setup(fabric)
    return ddp_buckets.current(_ddp(model))


def _record_only(fabric, path):
    model, optimizer, state = _setup(fabric)
    _step(fabric, model, optimizer, 1)
    fabric.save(path, state)


def test_a_layout_loaded_before_setup_or_recorded_at_another_world_size_is_applied(pool3, pool2, tmp_path):
    path = str(tmp_path / "w3.ckpt")
    pool3.run(_record_only, path)
    assert pool3.run(_load_before_setup, path) == [READY] * 3
    assert pool2.run(_load_before_setup_any_world, path) == [READY] * 2  # per parameter, not per rank


def _load_before_setup_any_world(fabric, path):
    gc.collect()
    torch.manual_seed(0)
    state = {"resume": fabric.resume_state()}
    fabric.load(path, state, strict=False)  # the random states need the same world size; the layout does not
    model, _, _ = _setup(fabric)
    return ddp_buckets.current(_ddp(model))


def _torch_moved(fabric, path, how):
    model, optimizer, state = _setup(fabric)
    if how == "part gone":
        ddp_buckets.REDUCER_PARTS = (*ddp_buckets.REDUCER_PARTS, "_rebuild_buckets_renamed")
    else:  # the reducer did not take the layout: what a torch that changed the rebuild would do
        real = ddp_buckets.current
        ddp_buckets.current = lambda ddp: [real(ddp)[0][::-1]]
    try:
        fabric.load(path, state)
    except RuntimeError as err:
        return str(err)
    finally:
        if how == "part gone":
            ddp_buckets.REDUCER_PARTS = ddp_buckets.REDUCER_PARTS[:-1]
        else:
            ddp_buckets.current = real
    return None


@pytest.mark.parametrize("how", ["part gone", "layout not taken"])
def test_a_torch_that_moved_its_private_parts_fails_loudly_naming_its_version(pool3, tmp_path, how):
    path = str(tmp_path / "m.ckpt")
    pool3.run(_record_only, path)
    for message in pool3.run(_torch_moved, path, how):
        assert message is not None and f"torch {torch.__version__}" in message
        assert ddp_buckets.SWITCH_ENV in message  # the way out
        if how == "part gone":
            assert "Reducer._rebuild_buckets_renamed" in message
        else:
            assert "did not take the recorded gradient buckets" in message


def _bad_layout(fabric, path, layout):
    model, _, state = _setup(fabric)
    saved = torch.load(path, weights_only=True)
    saved["resume"]["ddp_buckets"] = layout
    try:
        state["resume"].load_state_dict(saved["resume"])
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("layout, expected", [
    ([[["head.bias", "gone.weight"]]], "parameters only in the checkpoint ['gone.weight']"),
    ([["not a list"]], "expected a list of buckets"),
    ("buckets", "expected a list, one entry per module"),
])
def test_a_layout_that_does_not_fit_is_a_clear_error_on_every_rank(pool2, tmp_path, layout, expected):
    path = str(tmp_path / "bad.ckpt")
    pool2.run(_record_only, path)
    for message in pool2.run(_bad_layout, path, layout):
        assert message is not None and expected in message, message


def _not_applied(fabric, path, how):
    gc.collect()
    torch.manual_seed(0)
    if how == "find_unused":  # a DDP that keeps torch's buckets (set up by hand: the pool's strategy is plain ddp)
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(Reordered(), find_unused_parameters=True)
        fabric.strategy._ddp_modules.append(__import__("weakref").ref(ddp))
        resume = fabric.resume_state()
    else:  # strict=False: a layout that does not fit is skipped
        model, _, state = _setup(fabric)
        ddp, resume = _ddp(model), state["resume"]
        resume.strict = False
    saved = torch.load(path, weights_only=True)["resume"]
    if how == "misfit":
        saved["ddp_buckets"] = [[["head.bias", "gone.weight"]]]
    before = ddp_buckets.current(ddp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume.load_state_dict(saved)
    return before == ddp_buckets.current(ddp), [str(w.message) for w in caught if "bucket layout" in str(w.message)]


@pytest.mark.parametrize("how, expected", [
    ("find_unused", "this DDP uses find_unused_parameters=True, which keeps torch's own buckets: not applied"),
    ("misfit", "Not applied (strict=False)"),
])
def test_a_layout_that_cannot_be_applied_is_left_with_one_warning(pool2, tmp_path, how, expected):
    path = str(tmp_path / "n.ckpt")
    pool2.run(_record_only, path)
    (kept, warned), (kept_1, warned_1) = pool2.run(_not_applied, path, how)
    assert kept and kept_1  # the buckets are the DDP's own
    assert len(warned) == 1 and expected in warned[0] and warned_1 == []  # rank 0 says it once


def _version_1(fabric, path):
    model, _, state = _setup(fabric)
    saved = torch.load(path, weights_only=True)["resume"]
    old = {key: value for key, value in saved.items() if key != "ddp_buckets"}
    old["version"] = 1
    state["resume"].load_state_dict(old)  # loads: no layout, torch's buckets
    return ddp_buckets.current(_ddp(model))


def test_a_version_1_state_without_a_layout_still_loads(pool2, tmp_path):
    path = str(tmp_path / "v1.ckpt")
    pool2.run(_record_only, path)
    assert pool2.run(_version_1, path) == [[["head.weight", "head.bias", "embed.weight", "embed.bias", "mid.weight",
                                             "mid.bias"]]] * 2


def _warnings(fabric, switched_off, kwargs):
    from fabriclite.strategies import create_strategy

    strategy = create_strategy("ddp", **kwargs)
    strategy.cluster_environment = fabric.strategy.cluster_environment
    if switched_off:
        os.environ[ddp_buckets.SWITCH_ENV] = "0"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resume_state.ResumeState(strategy)
    finally:
        os.environ.pop(ddp_buckets.SWITCH_ENV, None)
    return len([w for w in caught if str(w.message) == resume_state.NOT_EXACT_ON_3_RANKS])


@pytest.mark.parametrize("switched_off, kwargs, warned", [
    (False, {}, 0),  # plain ddp: exact, no warning
    (True, {}, 1),  # switched off: rank 0 warns once
    (False, {"static_graph": True}, 1),  # static_graph: not recorded
])
def test_only_the_cases_left_inexact_on_3_ranks_warn(pool3, switched_off, kwargs, warned):
    assert pool3.run(_warnings, switched_off, kwargs) == [warned, 0, 0]
