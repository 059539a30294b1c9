"""ft lane: ReplicaDDP's gradient buckets (fabriclite.strategies.torchft.replica_parts.plain_bucket_caps) are the
ones plain DDP ends up with after its first step (its rebuilt layout), although torchft's DDP never rebuilds its
buckets (``find_unused_parameters=True``): checked on real DDP modules over a real one-rank gloo process group, for
MLPs of random depths and widths (buckets of one parameter, of several, the first one over 1 MiB or not, more than
one 25 MiB bucket)."""
from __future__ import annotations

from typing import Iterator, List

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

from ft_harness import free_port

from fabriclite.strategies.torchft.replica_parts import plain_bucket_caps


@pytest.fixture(scope="module", autouse=True)
def group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def mlp(widths: List[int]) -> nn.Module:
    layers: List[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def rebuilt_buckets(module: nn.Module) -> str:
    """Plain DDP's buckets after its rebuild (in the second forward; its logging data has them from the third)."""
    ddp = nn.parallel.DistributedDataParallel(module)
    for _ in range(3):
        ddp(torch.ones(2, module[0].in_features)).sum().backward()
    return ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([1, 16, 100, 512, 1024, 1800, 3000]), min_size=2, max_size=5))
def test_replica_buckets_are_plain_ddps_rebuilt_ones(widths: List[int]) -> None:
    module = mlp(widths)
    ours = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True,  # as torchft's DDP
                                               bucket_cap_mb_list=plain_bucket_caps(module))
    assert ours._get_ddp_logging_data()["bucket_sizes"] == rebuilt_buckets(module)


def test_torchfts_own_buckets_differ_on_the_benchmarks_mlp() -> None:
    """The layout the caps fix: without them the 4 MiB weight shares a bucket with the first layer's gradients."""
    module = mlp([16, 1024, 1024, 1])
    torchft = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
    assert torchft._get_ddp_logging_data()["bucket_sizes"] == "8196, 4263936"
    assert rebuilt_buckets(module) == "4202500, 69632"
