"""The paths the docs first gave data's names still import, and name the very objects ``fabriclite.data`` holds
(``fabriclite.training.dataloaders``, ``fabriclite.checkpoint.elastic``, ``fabriclite.checkpoint.stream_position``
are one import line per module, as ``fabriclite.utilities``)."""
from __future__ import annotations

from fabriclite.checkpoint import resume_state
from fabriclite.data import elastic_dealing, sampling, stream_kinds
from fabriclite.training import module_setup


def test_the_old_paths_name_the_same_objects() -> None:
    from fabriclite.checkpoint.elastic import RestSampler, deal_rest, new_rank_seed
    from fabriclite.checkpoint.stream_position import StreamPositionError
    from fabriclite.training.dataloaders import DistributedSamplerWrapper, setup_dataloader

    assert (RestSampler, deal_rest) == (elastic_dealing.RestSampler, elastic_dealing.deal_rest)
    assert new_rank_seed is resume_state.new_rank_seed
    assert StreamPositionError is stream_kinds.StreamPositionError and issubclass(StreamPositionError, ValueError)
    assert DistributedSamplerWrapper is sampling.DistributedSamplerWrapper
    assert setup_dataloader is module_setup.setup_dataloader
