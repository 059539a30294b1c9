"""Checkpoints: writing and reading the state a script passes to ``fabric.save`` / ``load``.

- ``atomic``: the one publish protocol (temporary name beside the target, every rank done, rank 0 swaps it in)
  for files and directories, and recovery of a swap a crash interrupted.
- ``saving``: ``save_checkpoint`` / ``load_checkpoint``: a state dict to one file (rank 0) or, for sharded
  strategies, to a torch.distributed.checkpoint directory (``dcp``), and back.
- ``safe_loading``: every file read with ``weights_only=True`` unless the caller passes False (also under
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``), DCP folders read without running code, the torch < 2.10 warning.
- ``manifest``: ``save(..., keep=K)`` records complete checkpoints in the directory's manifest (the commit point)
  and ``latest`` finds the newest one for ``fabric.load_latest``.
- ``resume_state``: every rank's RNG states, and a new rank's seeds when the world size changed (what makes a
  resumed run draw the same random numbers); where a loader stands is ``fabriclite.data``'s.
- ``stream_position``, ``elastic``: the paths ``StreamPositionError``, ``deal_rest``, ``RestSampler`` and
  ``new_rank_seed`` were first given, one import line per module (the first three live in ``fabriclite.data``).

May import: ``data``, ``collectives``, ``distributed`` and what lies below them (a strategy is duck-typed here).
Never ``strategies``, ``training``, ``fabric``, ``connector`` or ``cli``.
"""
