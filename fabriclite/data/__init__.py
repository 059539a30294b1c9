"""What a loader yields and where it stands: the samples dealt over the ranks, and a loader's position inside an
epoch, saved in a checkpoint and carried to this run's world size and number of workers (or refused, before the
first batch).

- ``sampling``: distributed sampling (``shard``: a ``DistributedSampler``, or ``DistributedSamplerWrapper`` around a
  sampler of your own) and ``gather_eval`` (every rank's per-sample results, the sampler's padding removed).
- ``epoch_position``: a loader's place in its epoch (``{"epoch", "batch", ...}`` and the sizes it holds for), and
  how an epoch resumes from it: batches skipped in the sampler, or the rest dealt over another world size.
- ``elastic_dealing``: an epoch's rest dealt over W' ranks as ``DistributedSampler`` deals it, and the one warning
  of a load at another world size.
- ``streams``: a stream's position (an ``IterableDataset``, a torchdata ``StatefulDataLoader``) across a
  checkpoint; ``stream_kinds`` (its kind, the sizes it holds for, ``StreamPositionError``), ``worker_snapshots``
  (a stream's state taken in each worker for the consumed batches) and ``hf_shards`` (a Hugging Face stream's
  shards dealt, and dealt again) serve it.

``training.wrapping``'s ``FabricDataLoader`` and ``training.module_setup.setup_dataloader`` call into it;
``checkpoint.resume_state`` adds its notes to the one warning. May import: ``collectives`` and what lies below it;
never ``checkpoint``, ``strategies`` (a strategy is duck-typed here), ``training`` or anything above. Optional
packages (``datasets``, ``torchdata``) are imported only where used, when used.
"""
