"""The path docs/reliability.md gave elastic resume's names: the dealing lives in ``fabriclite.data.elastic_dealing``,
a new rank's seed in ``fabriclite.checkpoint.resume_state``. One import line per module."""
from fabriclite.checkpoint.resume_state import new_rank_seed  # noqa: F401
from fabriclite.data.elastic_dealing import RestSampler, deal_rest  # noqa: F401
