"""The position of a Hugging Face stream dealt by shards (fabriclite.data.hf_shards) and the decision of what a stream
position can become at another size (fabriclite.data.stream_kinds.plan), in one process.

The property: a real ``datasets.IterableDataset`` of shards of random lengths is read by W ranks x nw workers as a
plain epoch deals it (by shards when they divide by W, else by examples); each worker stops after a random number of
its examples (the ranks sharing a stream in step, as ranks do that consumed the same batches); the snapshots are merged
(``rest``) and dealt over W' x nw' (``deal``, by examples); reading the dealt streams to their ends gives every
example not consumed before, plus at most W' - 1 padding repeats, and every rank's workers the same numbers of
examples.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

datasets = pytest.importorskip("datasets")

from fabriclite.data.stream_kinds import StreamPositionError, plan  # noqa: E402
from fabriclite.data.hf_shards import ShardStream, deal, plain_plan, rest  # noqa: E402


def _rows(shards: List[List[int]]) -> Any:
    for shard in shards:
        for index in shard:
            yield {"index": index}


def stream_of(lengths: List[int]) -> Any:
    """A Hugging Face IterableDataset whose shard ``s`` holds ``lengths[s]`` consecutive indices."""
    shards, start = [], 0
    for length in lengths:
        shards.append(list(range(start, start + length)))
        start += length
    return datasets.IterableDataset.from_generator(_rows, gen_kwargs={"shards": shards})


def read(stream: ShardStream, count: int) -> List[int]:
    out = []
    for example in stream:
        out.append(example["index"])
        if len(out) == count:
            break
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_rest_dealt_anew_is_every_example_left_once(data: Any) -> None:
    lengths = data.draw(st.lists(st.integers(0, 7), min_size=2, max_size=9), label="shard lengths")
    shards, total = len(lengths), sum(lengths)
    world = data.draw(st.integers(1, 3), label="W")
    workers = data.draw(st.integers(1, max(1, min(3, shards // world))), label="nw")
    base = stream_of(lengths)
    consumed: List[int] = []
    rank_states: List[Dict[str, Any]] = []
    for_worker = {w: data.draw(st.integers(0, total), label=f"worker {w} examples per rank") for w in range(workers)}
    for rank in range(world):
        plans = {w: plain_plan(shards, rank, world, w, workers) for w in range(workers)}
        tags = {}
        for worker, worker_plan in plans.items():
            stream = ShardStream(base, shards, {**worker_plan, "position": 0, "kept": 0, "done": []})
            got = read(stream, for_worker[worker])
            consumed += got
            if got:
                tags[worker] = {"worker": worker, "state": stream.snapshot(), "end": False}
        rank_states.append({"plans": plans, "workers": tags})
    assert len(consumed) == len(set(consumed))
    new_world, new_workers = data.draw(st.integers(1, 3), label="W'"), data.draw(st.integers(1, 3), label="nw'")
    left = rest(rank_states, "test")
    again: List[int] = []
    per_rank = []
    for rank_plans in deal(left, new_world, new_workers):
        counts = []
        for _, worker_plan in sorted(rank_plans.items()):
            got = read(ShardStream(base, shards, {**worker_plan, "position": 0, "kept": 0, "done": []}), -1)
            counts.append(len(got))
            again += got
        per_rank.append(counts)
    assert set(consumed + again) == set(range(total))
    # every example left once, plus at most W' - 1 padding (a rank one short repeats its first)
    padding = len(consumed) + len(again) - total
    assert 0 <= padding <= new_world - 1, (padding, per_rank)
    # every rank's workers hold the same numbers of examples: the same batches on every rank
    assert all(counts == per_rank[0] for counts in per_rank), per_rank


def test_ranks_out_of_step_on_a_shared_stream_refuse() -> None:
    """Split by examples (3 shards over 2 ranks), rank 1 ahead of rank 0 by two examples: not a prefix, refused."""
    base = stream_of([4, 4, 4])
    rank_states = []
    for rank, count in ((0, 1), (1, 3)):
        plans = {0: plain_plan(3, rank, 2, 0, 1)}
        stream = ShardStream(base, 3, {**plans[0], "position": 0, "kept": 0, "done": []})
        read(stream, count)
        rank_states.append({"plans": plans, "workers": {0: {"worker": 0, "state": stream.snapshot()}}})
    with pytest.raises(StreamPositionError, match=r"consumed \[1, 3\] examples"):
        rest(rank_states, "The loader's position")


STATE = {"epoch": 1, "batch": 7, "world_size": 2, "num_workers": 2}


@pytest.mark.parametrize("kind,world,workers,expected", [
    ("stateful", 2, 2, "states"), ("stateless", 2, 2, "replay"), ("shards", 2, 2, "states"),
    ("shards", 3, 2, "deal"), ("shards", 2, 4, "deal"),
    ("stateful", 3, 2, StreamPositionError), ("stateless", 2, 1, StreamPositionError),
])
def test_plan(kind: str, world: int, workers: int, expected: Any) -> None:
    state = {**STATE, "stream": kind}
    if isinstance(expected, str):
        assert plan(state, kind, world, workers) == expected
        return
    with pytest.raises(expected) as raised:
        plan(state, kind, world, workers)
    message = str(raised.value)
    for part in ("batch 7 of epoch 1", "2 ranks x 2 workers", f"{world} ranks x {workers} worker",
                 "loader.ignore_stream_position()", "loader.set_epoch(1)"):
        assert part in message, (part, message)


def test_plan_opt_out_and_kind_change() -> None:
    assert plan({**STATE, "stream": "stateless"}, "stateless", 3, 1, ignore=True) == "restart"
    with pytest.raises(StreamPositionError, match="fewer than ranks x workers"):
        plan({**STATE, "stream": "shards"}, "stateful", 3, 2, refusal="it has 4 shards, fewer than ranks x workers")


def test_the_dealer_leaves_the_users_split_alone() -> None:
    """fabriclite reads the shards of an unsplit copy; the dataset the user split keeps its split (datasets' own copy
    shares its attributes with the original)."""
    from datasets.distributed import split_dataset_by_node

    from fabriclite.data.hf_shards import ShardDealer

    split = split_dataset_by_node(stream_of([2, 2, 2, 2]), rank=1, world_size=2)
    dealer = ShardDealer(split, rank=1, world_size=2)
    assert split._distributed is not None and split._distributed.rank == 1
    assert [e["index"] for e in dealer.stream(0, 1, None)] == [2, 3, 6, 7]
    assert [e["index"] for e in split] == [2, 3, 6, 7]
