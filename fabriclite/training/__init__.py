"""What a training loop touches: the module / optimizer / dataloader wrappers ``Fabric.setup*`` return
(``wrapping``, made by ``module_setup``; a set-up module's methods other than ``forward``: ``forward_methods``),
seeding (``seeding``), callbacks (``callbacks``), the rank-0 progress bar (``progress_bar``), throughput and FLOPs
(``throughput_monitor``), moving collections to a device (``device_transfer``), small data helpers
(``data_helpers``) and ``load_latest`` (``live_recovery``). What a loader yields and where it stands (sampling,
positions, streams) is ``fabriclite.data``'s: the dataloader wrapper and its set-up call into it. ``dataloaders``
is the path ``DistributedSamplerWrapper`` and ``setup_dataloader`` were first given (one import line per module).

May import: ``strategies``, ``checkpoint``, ``data``, ``collectives``, ``precision`` and everything below them
(``accelerators`` for peak FLOP/s, ``environments`` for the pre-launch rank). Never ``fabric``, ``connector`` or
``cli``. Entry points: ``module_setup.setup_module``, ``module_setup.setup_optimizers``,
``module_setup.setup_dataloader``, ``seeding.seed_everything``.
"""
