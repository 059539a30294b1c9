"""Training on real ranks: DDP parity with one process, accumulation, dataloader sharding, evaluation
gathering, wrappers under DDP. Each ``_fn(fabric, ...)`` runs on every rank of a pool."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

N, D, C = 48, 6, 3  # samples, features, classes


def _data():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, C))


def _opt(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _setup(fabric, seed: int, kind: str):
    model = _model(seed)
    return fabric.setup(model, _opt(model, kind))


# ---------------------------------------------------------------------- parity: 2 x B == 1 x 2B
def _ddp_train(fabric, batch: int, epochs: int, kind: str):
    fabric.seed_everything(7)
    x, y = _data()
    model, opt = _setup(fabric, 0, kind)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True))
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.shuffle
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            fabric.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _single_train(batch: int, epochs: int, kind: str, world: int = 2):
    x, y = _data()
    model = _model()
    opt = _opt(model, kind)
    for epoch in range(epochs):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(7 + epoch)).tolist()  # DistributedSampler's
        # rank r takes perm[r::world]; step i sees, on every rank together, perm[i*B*world:(i+1)*B*world]
        for i in range(N // (batch * world)):
            idx = perm[i * batch * world:(i + 1) * batch * world]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.state_dict()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_two_ranks_match_one_process_with_double_batch(pool2, kind):
    results = pool2.run(_ddp_train, 4, 2, kind)
    expected = _single_train(4, 2, kind)
    for params in results:
        assert params.keys() == expected.keys()  # no "module." prefix under DDP
        for name in expected:
            torch.testing.assert_close(params[name], expected[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- accumulation
def _accumulate(fabric, accumulate: int, micro: int):
    x, y = _data()
    ranks_x, ranks_y = x[fabric.global_rank::2], y[fabric.global_rank::2]

    def run(steps_per_update: int, batch: int):
        model, opt = _setup(fabric, 3, "sgd")
        unsynced = None
        for start in range(0, accumulate * micro * 2, batch):
            idx = slice(start, start + batch)
            last = (start // batch + 1) % steps_per_update == 0
            with fabric.no_backward_sync(model, enabled=not last):
                loss = nn.functional.cross_entropy(model(ranks_x[idx]), ranks_y[idx]) / steps_per_update
                fabric.backward(loss)
            if not last and unsynced is None:
                grad = next(model.parameters()).grad.clone()
                unsynced = fabric.strategy.all_gather_object(grad)
            if last:
                opt.step()
                opt.zero_grad()
        return {k: v.clone() for k, v in model.state_dict().items()}, unsynced

    accumulated, unsynced = run(accumulate, micro)
    large, _ = run(1, accumulate * micro)
    return accumulated, large, unsynced


def test_accumulation_under_no_backward_sync_equals_large_batch(pool2):
    for accumulated, large, unsynced in pool2.run(_accumulate, 3, 4):
        for name in large:
            torch.testing.assert_close(accumulated[name], large[name], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(unsynced[0], unsynced[1]), "no_backward_sync did not skip the gradient sync"


# ---------------------------------------------------------------------- dataloaders
class _EveryThird(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs = []

    def __iter__(self):
        return iter(range(0, self.n, 3))

    def __len__(self) -> int:
        return len(range(0, self.n, 3))

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class _PairBatches(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, self.n, 2)])

    def __len__(self) -> int:
        return self.n // 2


def _loaders(fabric):
    ds = TensorDataset(torch.arange(11))
    out = {}
    shuffled = fabric.setup_dataloaders(DataLoader(ds, batch_size=2, shuffle=True))
    out["shuffle"] = shuffled.sampler.shuffle
    out["epochs"] = [[int(v) for (b,) in shuffled for v in b] for _ in range(3)]
    seq = fabric.setup_dataloaders(DataLoader(ds, batch_size=4, drop_last=True))
    out["seq_shuffle"] = seq.sampler.shuffle
    out["seq"] = [b.tolist() for (b,) in seq]
    custom_sampler = _EveryThird(11)
    custom = fabric.setup_dataloaders(DataLoader(ds, batch_size=1, sampler=custom_sampler))
    out["custom_type"] = type(custom.sampler).__name__
    out["custom"] = [int(v) for _ in range(2) for (b,) in custom for v in b]
    out["custom_epochs"] = custom_sampler.epochs
    batches = fabric.setup_dataloaders(DataLoader(ds, batch_sampler=_PairBatches(10)))
    out["batches"] = [b.tolist() for (b,) in batches]
    out["untouched"] = type(fabric.setup_dataloaders(DataLoader(ds), use_distributed_sampler=False).sampler).__name__
    nested = fabric.setup_dataloaders(DataLoader([{"a": torch.ones(2), "b": [torch.zeros(1)]}] * 4, batch_size=2))
    out["nested_devices"] = {str(t.device) for batch in nested for t in (batch["a"], batch["b"][0])}
    return out


def test_dataloader_sampler_epochs_and_batches(pool2):
    r0, r1 = pool2.run(_loaders)
    assert r0["shuffle"] and not r0["seq_shuffle"]
    # shuffled: each epoch, the two ranks together cover all 11 samples (one padding duplicate) ...
    for e in range(3):
        assert sorted(set(r0["epochs"][e]) | set(r1["epochs"][e])) == list(range(11))
        assert len(r0["epochs"][e]) == len(r1["epochs"][e]) == 6
    # ... in a different order every epoch (set_epoch is called per epoch)
    assert r0["epochs"][0] != r0["epochs"][1] != r0["epochs"][2]
    # sequential, drop_last kept on the per-rank batches: 6 samples per rank -> one full batch of 4
    assert r0["seq"] == [[0, 2, 4, 6]] and r1["seq"] == [[1, 3, 5, 7]]
    # a custom sampler is wrapped and sharded, its set_epoch called
    assert r0["custom_type"] == "DistributedSamplerWrapper"
    assert sorted(r0["custom"][:2] + r1["custom"][:2]) == [0, 3, 6, 9]
    assert r0["custom_epochs"] == [0, 1]
    # a custom batch sampler is sharded batch by batch
    assert r0["batches"] == [[0, 1], [4, 5], [8, 9]] and r1["batches"] == [[2, 3], [6, 7], [0, 1]]
    assert r0["untouched"] == "SequentialSampler"
    assert r0["nested_devices"] == {"cpu"}


def _eval_gather(fabric, n: int, shuffle: bool):
    ds = TensorDataset(torch.arange(n), torch.arange(n).float() * 10)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=3, shuffle=shuffle))
    idx, preds = [], []
    for i, v in loader:
        idx.append(i)
        preds.append(v)
    gathered = fabric.gather_eval({"index": torch.cat(idx), "pred": torch.cat(preds)}, loader)
    return gathered["index"].tolist(), gathered["pred"].tolist()


@pytest.mark.parametrize("n,shuffle", [(11, False), (12, False), (13, True)])
def test_gather_eval_count_is_exact(pool2, n, shuffle):
    for index, pred in pool2.run(_eval_gather, n, shuffle):
        assert len(index) == n and sorted(index) == list(range(n))
        assert pred == [i * 10.0 for i in index]
        if not shuffle:
            assert index == list(range(n))


def _eval_gather_bad(fabric):
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(11)), batch_size=2))
    with pytest.raises(ValueError, match="samples along dim 0"):
        fabric.gather_eval(torch.zeros(2), loader)
    dropping = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(11)), batch_size=2, drop_last=True))
    with pytest.raises(ValueError, match="drop_last"):
        fabric.gather_eval(torch.zeros(4), dropping)


def test_gather_eval_refuses_what_it_cannot_undo(pool2):
    pool2.run(_eval_gather_bad)


# ---------------------------------------------------------------------- wrappers under DDP
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.tag = "net"

    def forward(self, x):
        return self.layer(x)

    def twice(self, x):
        return 2 * self.layer(x)

    def shape_of(self, x):  # runs no submodule: passes through the wrapper as it is
        return x.shape

    def training_step(self, x):
        return self.layer(x).sum()


def _wrappers(fabric):
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, wrapped_opt = fabric.setup(net, opt)
    out = {
        "module_is_original": model.module is net,
        "forward_type": type(model._forward_module).__name__,
        "keys": sorted(model.state_dict()),
        "attr": model.tag,
        "method": model.shape_of(torch.ones(1, 2)),
        "isinstance": isinstance(wrapped_opt, torch.optim.SGD),
        "optimizer": wrapped_opt.optimizer is opt,
        "lr": wrapped_opt.param_groups[0]["lr"],
    }
    try:  # runs the network outside DDP's forward: refused (Lightning's RuntimeError) until marked
        model.twice(torch.ones(1, 2))
        out["unmarked"] = "no error"
    except RuntimeError as err:
        out["unmarked"] = str(err)
    model.mark_forward_method("twice")
    out["marked"] = model.twice(torch.ones(1, 2)).shape
    model.tag = "changed"
    out["setattr"] = net.tag
    # training_step goes through DDP's forward: its gradients are synchronised
    fabric.backward(model.training_step(torch.full((1, 2), float(fabric.global_rank + 1))))
    out["synced_grad"] = net.layer.weight.grad.clone()

    weight, bias = net.layer.weight.detach().clone(), net.layer.bias.detach().clone()
    calls = []

    def closure():
        wrapped_opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        fabric.backward(loss)
        calls.append(loss.item())
        return loss

    returned = wrapped_opt.step(closure)
    out["closure_calls"] = calls
    out["closure_returned"] = returned.detach().clone() if torch.is_tensor(returned) else returned
    # by hand: loss = sum(W @ 1 + b); its gradient is 1 for every weight and bias (same input on both ranks, so
    # DDP's mean changes nothing); one SGD step (lr 0.1) subtracts 0.1 from each
    out["closure_expected"] = (weight.sum(1) + bias).sum().item()
    out["after_step"] = (net.layer.weight.detach().clone(), net.layer.bias.detach().clone())
    out["expected_after_step"] = (weight - 0.1, bias - 0.1)
    copy_net = copy.deepcopy(net)
    with pytest.raises(ValueError, match="not parameters of the _Net"):
        fabric.setup(copy_net, torch.optim.SGD(_Net().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="set up already"):
        fabric.setup(model)
    with pytest.raises(TypeError, match="fabric.setup"):
        fabric.no_backward_sync(net)
    return out


def test_wrappers_forward_to_the_original_under_ddp(pool2):
    r0, r1 = pool2.run(_wrappers)
    assert r0["module_is_original"] and r0["forward_type"] == "DistributedDataParallel"
    assert r0["keys"] == ["layer.bias", "layer.weight"]
    assert r0["attr"] == "net" and r0["method"] == (1, 2) and r0["setattr"] == "changed"
    assert "mark_forward_method('twice')" in r0["unmarked"] and r0["marked"] == (1, 2)
    assert r0["isinstance"] and r0["optimizer"] and r0["lr"] == 0.1
    torch.testing.assert_close(r0["synced_grad"], r1["synced_grad"])
    torch.testing.assert_close(r0["synced_grad"], torch.full((2, 2), 1.5))  # mean of rank inputs 1 and 2
    for r in (r0, r1):  # step(closure) runs the closure once, returns its loss and steps with its gradients
        assert len(r["closure_calls"]) == 1, r["closure_calls"]
        assert torch.is_tensor(r["closure_returned"]), r["closure_returned"]
        torch.testing.assert_close(r["closure_returned"].item(), r["closure_expected"])
        torch.testing.assert_close(r["closure_calls"][0], r["closure_expected"])
        torch.testing.assert_close(r["after_step"], r["expected_after_step"])


# ---------------------------------------------------------------------- progress bar: rank 0 draws, others do not
def _progress_bars(fabric):
    import io
    import sys

    captured = io.StringIO()
    real, sys.stderr = sys.stderr, captured  # tqdm writes to sys.stderr as it is when the bar is made
    try:
        items = list(fabric.progress_bar(range(3), desc=f"bar-of-rank-{fabric.global_rank}", disable=False))
    finally:
        sys.stderr = real
    return items, captured.getvalue()


def test_progress_bar_draws_on_global_rank_zero_only(pool2):
    (items0, drawn0), (items1, drawn1) = pool2.run(_progress_bars)
    assert items0 == items1 == [0, 1, 2]
    assert "bar-of-rank-0" in drawn0 and "3/3" in drawn0, drawn0
    assert drawn1 == "", drawn1
