"""Checkpoints: writing and reading the state a script passes to ``fabric.save`` / ``load``.

- ``atomic``: the one publish protocol (temporary name beside the target, every rank done, rank 0 swaps it in)
  for files and directories, and recovery of a swap a crash interrupted.
- ``saving``: ``save_checkpoint`` / ``load_checkpoint``: a state dict to one file (rank 0) or, for sharded
  strategies, to a torch.distributed.checkpoint directory (``dcp``), and back.
- ``manifest``: ``save(..., keep=K)`` records complete checkpoints in the directory's manifest (the commit point)
  and ``latest`` finds the newest one for ``fabric.load_latest``.
- ``resume_state`` (every rank's RNG states) and ``loader_position`` (where a loader stands in its epoch): what
  makes a resumed run continue exactly.
- ``elastic``: what a checkpoint of W ranks means at W' != W (the rest of an epoch dealt over the new ranks, new
  ranks' seeds, the load's one warning).

May import: ``strategies`` (for types only), ``collectives``, ``distributed`` and what lies below them. Never
``training``, ``fabric``, ``connector`` or ``cli``.
"""
