"""On 4 CPU ranks (data_parallel 2 x tensor_parallel 2): a small Llama-style transformer (attention and feed-forward
split column-/row-wise, FSDP2 over the data dim, meta init, ``loss_parallel``) under fabriclite's
ModelParallelStrategy gives the same losses and weights as under Lightning's, running the same parallelize_fn."""
from __future__ import annotations

import math

import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.strategies import ModelParallelStrategy
from fabriclite.checkpoint.dcp import full_module_state
from test_model_parallel import _torchrun_env

DIM, HEADS, VOCAB, LAYERS, SEQ = 24, 4, 48, 2, 12


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        head_dim = DIM // HEADS
        q, k, v = (w(x).view(b, s, -1, head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # local heads under TP
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Tensor parallel inside each layer (column-wise in, row-wise out), FSDP2 over the data-parallel dim."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
    })
    for layer in model.layers:
        parallelize_module(layer, tp, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def init_weights(model: nn.Module) -> None:
    """The model's own init, run on the sharded parameters (same RNG on every rank: DTensor init is SPMD)."""
    torch.manual_seed(0)
    for name, param in sorted(model.named_parameters()):
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(DIM))


def _train(fabric, model, steps: int = 4):
    from torch.distributed.tensor.parallel import loss_parallel

    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    dp_rank = fabric.global_rank // 2  # the batch depends on the data-parallel rank only
    g = torch.Generator().manual_seed(dp_rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        opt.zero_grad()
        with loss_parallel():
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(0, 1))
            fabric.backward(loss)
        opt.step()
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return losses, full_module_state(model._forward_module)


def _both(fabric):
    import lightning.fabric as lf
    from lightning.fabric.strategies import ModelParallelStrategy as LightningModelParallel

    ours = Fabric(accelerator="cpu", devices=4,
                  strategy=ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2))
    ours.launch()
    with ours.init_module(empty_init=True):
        model = Llama()
    model = ours.setup(model)
    init_weights(model)
    mine = _train(ours, model)
    with _torchrun_env(fabric):
        theirs = lf.Fabric(accelerator="cpu", devices=4,
                           strategy=LightningModelParallel(parallelize, data_parallel_size=2, tensor_parallel_size=2))
        theirs.launch()
        with theirs.init_module(empty_init=True):
            lmodel = Llama()
        lmodel = theirs.setup(lmodel)
        init_weights(lmodel)
        lightning = _train(theirs, lmodel)
    return mine, lightning


def test_llama_dp2_tp2_matches_lightning(pool4):
    results = pool4.run(_both)
    for (losses, weights), (l_losses, l_weights) in results:
        assert losses == l_losses
        assert all(torch.isfinite(torch.tensor(losses)))
        assert sorted(weights) == sorted(l_weights)
        assert all(torch.equal(weights[k], l_weights[k]) for k in weights)
    assert len(results[0][0][1]) == 3 + LAYERS * 9  # the full state, gathered on rank 0
