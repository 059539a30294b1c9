"""Elastic resume of a loader's position, in one process: the dealing of an epoch's rest
(``fabriclite.data.elastic_dealing``) checked against torch's own DistributedSampler, and FabricDataLoaders whose
DistributedSamplers stand for W ranks (``num_replicas=W, rank=r``, one loader per rank) saved at W and loaded at
W' != W: every sample of the epoch once apart from the named padding, every rank the same number of batches, later
epochs as a run at W' draws them. The bad inputs (another batch size or dataset length, a state that cannot move)
are clear errors."""
from __future__ import annotations

import collections
import re
import warnings
from typing import Dict, List, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from fabriclite import Fabric
from fabriclite.checkpoint import resume_state
from fabriclite.data import elastic_dealing

FABRIC = Fabric(accelerator="cpu", devices=1)


def sampler_ranks(length: int, world: int, epoch: int, seed: int, shuffle: bool, drop_last: bool) -> List[List[int]]:
    """Every rank's indices of epoch ``epoch`` as torch's DistributedSampler deals them."""
    out = []
    for rank in range(world):
        sampler = DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


# ---------------------------------------------------------------------- the dealing itself
@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 120), world=st.integers(1, 9), epoch=st.integers(0, 5), seed=st.integers(0, 2 ** 31),
       shuffle=st.booleans(), drop_last=st.booleans())
def test_dealing_from_the_start_is_distributed_samplers_epoch(length, world, epoch, seed, shuffle, drop_last):
    dealt = elastic_dealing.deal_rest(length, 0, world, epoch, seed, shuffle, drop_last)
    assert dealt.shares == sampler_ranks(length, world, epoch, seed, shuffle, drop_last)
    ranks = [list(elastic_dealing.RestSampler(length, 0, world, r, epoch, seed, shuffle, drop_last))
             for r in range(world)]
    assert ranks == dealt.shares
    assert all(len(elastic_dealing.RestSampler(length, 0, world, r, epoch, seed, shuffle, drop_last)) == len(share)
               for r, share in enumerate(ranks))


@settings(max_examples=400, deadline=None)
@given(data=st.data(), length=st.integers(1, 150), world=st.integers(1, 8), new_world=st.integers(1, 8),
       batch=st.integers(1, 9), epoch=st.integers(0, 3), shuffle=st.booleans(), drop_last=st.booleans())
def test_the_rest_of_an_epoch_dealt_at_another_world_size_consumes_each_sample_once(
        data, length, world, new_world, batch, epoch, shuffle, drop_last):
    per_rank = len(sampler_ranks(length, world, epoch, 5, shuffle, drop_last)[0])
    batches = -(-per_rank // batch)
    if batches < 2:
        return  # no position inside the epoch
    k = data.draw(st.integers(1, batches - 1), label="steps at the old world size")
    consumed = [i for share in sampler_ranks(length, world, epoch, 5, shuffle, drop_last) for i in share[:k * batch]]
    start = k * batch * world
    # the samples k steps consumed at W are the order's first k x B x W, no padding among them
    assert sorted(consumed) == sorted(elastic_dealing.epoch_order(length, epoch, 5, shuffle)[:start])
    dealt = elastic_dealing.deal_rest(length, start, new_world, epoch, 5, shuffle, drop_last)
    assert len({len(share) for share in dealt.shares}) == 1  # every rank the same number of samples
    counts = collections.Counter(consumed + [i for share in dealt.shares for i in share])
    assert len(dealt.repeats) <= new_world - 1 and not (dealt.repeats and dealt.left_out)
    extra = collections.Counter({i: c - 1 for i, c in counts.items() if c > 1})
    assert extra == collections.Counter(dealt.repeats)  # the only samples seen twice are the named repeats
    missing = set(range(length)) - set(counts)
    assert missing == set(dealt.left_out)  # drop_last leaves out only what it names ...
    assert len(dealt.left_out) < new_world  # ... fewer than W' of them
    if not drop_last:
        assert not missing


def test_new_rank_seeds_are_deterministic_and_differ_by_rank():
    import torch

    state = torch.Generator().manual_seed(3).get_state()
    seeds = [resume_state.new_rank_seed(state, rank) for rank in range(2, 6)]
    assert seeds == [resume_state.new_rank_seed(state.clone(), rank) for rank in range(2, 6)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2 ** 63 for s in seeds)
    assert resume_state.new_rank_seed(torch.Generator().manual_seed(4).get_state(), 2) != seeds[0]


def test_bad_dealing_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="start must be within the dataset's 10 samples; got 11"):
        elastic_dealing.deal_rest(10, 11, 2, 0, 0, True)
    with pytest.raises(ValueError, match="world_size must be >= 1; got 0"):
        elastic_dealing.deal(range(4), 0)
    with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
        elastic_dealing.RestSampler(10, 0, 2, 2, 0, 0, True)


# ---------------------------------------------------------------------- FabricDataLoaders standing for W ranks
def loaders(length: int, world: int, batch: int, seed: int = 11, shuffle: bool = True, drop_last: bool = False,
            sampler_drop_last: bool = False) -> list:
    """One set-up loader per rank of a job of ``world`` ranks (their DistributedSamplers say which rank)."""
    data = list(range(length))
    return [FABRIC.setup_dataloaders(DataLoader(data, batch_size=batch, drop_last=drop_last, sampler=DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=sampler_drop_last)))
        for rank in range(world)]


def run_steps(ranks: list, steps: int, log: Dict[int, collections.Counter], per_rank: Dict[int, List[int]]) -> list:
    """Advance every rank's loader ``steps`` batches (one iterator each, kept); record the samples per epoch."""
    iterators = [iter(loader) for loader in ranks]
    for _ in range(steps):
        for rank, iterator in enumerate(iterators):
            batch = next(iterator).tolist()
            log[ranks[rank].epoch - 1].update(batch)
            per_rank.setdefault(rank, []).append(len(batch))
    return iterators


def finish_epoch(ranks: list, log: Dict[int, collections.Counter], iterators=None) -> List[int]:
    """Run every rank to the end of its epoch; the batches each yielded."""
    counts = []
    for rank, loader in enumerate(ranks):
        iterator = iterators[rank] if iterators else iter(loader)
        n = 0
        for batch in iterator:
            log[loader.epoch - 1].update(batch.tolist())
            n += 1
        counts.append(n)
    return counts


def load_all(ranks: list, state: dict) -> List[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with elastic_dealing.one_warning(True):
            for loader in ranks:
                loader.load_state_dict(state)
    return [str(w.message) for w in caught if "Elastic resume" in str(w.message)]


def named_repeats(message: str) -> Tuple[int, List[int]]:
    found = re.search(r"(\d+) repeated as padding(?: \[([\d, ]*)\])?", message)
    assert found, message
    names = [int(v) for v in found.group(2).split(",")] if found.group(2) else []
    assert int(found.group(1)) == len(names)
    return int(found.group(1)), names


@settings(max_examples=60, deadline=None)
@given(data=st.data(), length=st.integers(4, 90), world=st.integers(1, 5), new_world=st.integers(1, 5),
       batch=st.integers(1, 6), shuffle=st.booleans(), drop_last=st.booleans(), sampler_drop_last=st.booleans())
def test_loaders_saved_at_w_resume_at_w_prime_with_exact_sample_accounting(
        data, length, world, new_world, batch, shuffle, drop_last, sampler_drop_last):
    first = loaders(length, world, batch, shuffle=shuffle, drop_last=drop_last, sampler_drop_last=sampler_drop_last)
    batches = len(first[0])
    if batches < 2 or world == new_world:
        return
    k = data.draw(st.integers(1, batches - 1), label="steps before the checkpoint")
    log: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    run_steps(first, batches, log, {})  # epoch 0 whole
    run_steps(first, k, log, {})  # epoch 1: k steps, then the checkpoint
    state = first[0].state_dict()
    assert state["epoch"] == 1 and state["samples"] == k * batch * world
    assert all(loader.state_dict() == state for loader in first)  # every rank's position is the same
    second = loaders(length, new_world, batch, shuffle=shuffle, drop_last=drop_last,
                     sampler_drop_last=sampler_drop_last)
    messages = load_all(second, state)
    assert len(messages) == 1, messages  # one warning for every loader of the job
    assert f"from {batch * world} ({batch} x {world} ranks) to {batch * new_world} ({batch} x {new_world} ranks)" \
        in messages[0]
    count, repeats = named_repeats(messages[0])
    rest_batches = finish_epoch(second, log)
    assert len(set(rest_batches)) == 1  # every rank the same number of batches
    epoch1 = log[1]
    left_out = re.search(r"(\d+) left out by drop_last \[([\d, ]*)\]", messages[0])
    dropped = {int(v) for v in left_out.group(2).split(",")} if left_out else set()
    assert set(range(length)) - set(epoch1) == dropped
    assert collections.Counter({i: c - 1 for i, c in epoch1.items() if c > 1}) == collections.Counter(repeats)
    assert count <= new_world - 1
    # later epochs: exactly what a run at W' draws
    assert all(loader.epoch == 2 for loader in second)
    expected = sampler_ranks(length, new_world, 2, 11, shuffle, sampler_drop_last)
    for rank, loader in enumerate(second):
        got = [i for b in loader for i in b.tolist()]
        whole = len(expected[rank]) // batch * batch if drop_last else len(expected[rank])
        assert got == expected[rank][:whole]


def test_a_resume_that_moves_twice_still_consumes_each_sample_once():
    """3 ranks -> 2 (a checkpoint again inside the dealt rest) -> 4; and that rest's checkpoint loaded at 2 ranks
    continues it batch for batch: a position in a rest counts from where the rest began."""
    log: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    first = loaders(61, 3, 2)
    run_steps(first, 3, log, {})
    second = loaders(61, 2, 2)
    load_all(second, first[0].state_dict())
    iterators = run_steps(second, 2, log, {})
    state = second[0].state_dict()
    assert (state["start"], state["batch"], state["samples"]) == (18, 2, 26)
    same = loaders(61, 2, 2)
    assert load_all(same, state) == []  # the same world size: no warning, the same batches
    assert [[b.tolist() for b in loader] for loader in same] == [[b.tolist() for b in it] for it in iterators]
    third = loaders(61, 4, 2)
    (message,) = load_all(third, state)
    assert "continues after the first 26 of its 61 samples" in message
    finish_epoch(third, log)
    assert sorted(log[0]) == list(range(61))
    _, repeats = named_repeats(message)
    assert repeats and sum(log[0].values()) == 61 + len(repeats)
    assert collections.Counter({i: c - 1 for i, c in log[0].items() if c > 1}) == collections.Counter(repeats)


def test_the_same_world_size_skips_the_same_batches_as_before():
    """At the saved world size nothing changes: the saved batches are skipped in the rank's own order (bit-exact)."""
    reference = loaders(40, 2, 3)
    whole = [[b.tolist() for b in loader] for loader in reference]
    first = loaders(40, 2, 3)
    run_steps(first, 2, collections.defaultdict(collections.Counter), {})
    resumed = loaders(40, 2, 3)
    assert load_all(resumed, first[0].state_dict()) == []
    assert [[b.tolist() for b in loader] for loader in resumed] == [w[2:] for w in whole]


def test_an_old_state_keeps_loading_at_its_world_size_and_cannot_move():
    old = {"epoch": 0, "batch": 2, "world_size": 2, "batch_size": 3}  # written before elastic resume
    reference = loaders(40, 2, 3)
    whole = [[b.tolist() for b in loader] for loader in reference]
    resumed = loaders(40, 2, 3)
    load_all(resumed, old)
    assert [[b.tolist() for b in loader] for loader in resumed] == [w[2:] for w in whole]
    with pytest.raises(ValueError, match="saved with world_size 2; this loader has world_size 3. That state cannot "
                                         "carry over.*older fabriclite.*set_epoch\\(0\\)"):
        loaders(40, 3, 3)[0].load_state_dict(old)


def test_another_batch_size_or_dataset_length_is_an_error_naming_both():
    first = loaders(40, 2, 3)
    run_steps(first, 2, collections.defaultdict(collections.Counter), {})
    state = first[0].state_dict()
    with pytest.raises(ValueError, match="saved with batch_size 3; this loader has batch_size 4"):
        loaders(40, 3, 4)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="saved for a dataset of 40 samples; this loader's dataset has 41"):
        loaders(41, 3, 3)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="saved for a dataset of 40 samples; this loader's dataset has 41"):
        loaders(41, 2, 3)[0].load_state_dict(state)
    loaders(41, 3, 4)[0].load_state_dict({**state, "batch": 0, "start": 0, "samples": 0})  # a boundary: any size
    without_length = {key: value for key, value in state.items() if key != "dataset_length"}
    loaders(41, 2, 3)[0].load_state_dict(without_length)  # a state without the length loads as before
    with pytest.raises(ValueError, match="samples 7 is not start \\+ batch x batch_size x world_size = 12"):
        loaders(40, 3, 3)[0].load_state_dict({**state, "samples": 7})


def test_a_sampler_of_ones_own_cannot_be_dealt_at_another_world_size():
    first = loaders(40, 2, 3)
    run_steps(first, 2, collections.defaultdict(collections.Counter), {})
    state = first[0].state_dict()

    class Mine(DistributedSampler):
        pass

    data = list(range(40))
    custom = FABRIC.setup_dataloaders(DataLoader(data, batch_size=3, sampler=Mine(data, num_replicas=3, rank=0)))
    with pytest.raises(ValueError, match="needs the loader dealt by setup_dataloaders' plain DistributedSampler"):
        custom.load_state_dict(state)
    plain = FABRIC.setup_dataloaders(DataLoader(data, batch_size=3, sampler=RandomSampler(data)))
    assert "seed" not in plain.state_dict()  # nothing to move from: not dealt by a DistributedSampler
