"""library_streams without the libraries (the data lane runs them): what it recognises, and its states' plainness."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from fabriclite.data import library_streams, stream_kinds


class Numbers(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


def test_other_loaders_are_no_library() -> None:
    for loader in (DataLoader(range(4)), DataLoader(Numbers())):
        assert library_streams.library_of(loader) is None
    assert stream_kinds.stream_kind(DataLoader(Numbers()), 1) == "stateless"


def test_a_state_is_made_plain_and_loads_with_weights_only() -> None:
    state = {"epoch": np.int64(2), "seed": np.float32(0.5), "region": [(0, np.int32(3))], "path": "/x", "none": None}
    made = library_streams.plain(state)
    assert made == {"epoch": 2, "seed": 0.5, "region": [[0, 3]], "path": "/x", "none": None}
    assert type(made["epoch"]) is int and type(made["region"][0][1]) is int
    buffer = io.BytesIO()
    torch.save(made, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == made


def test_a_state_that_cannot_be_plain_names_where() -> None:
    with pytest.raises(TypeError, match=r"state\['loader'\]\[1\] is a object"):
        library_streams.plain({"loader": [1, object()]})
