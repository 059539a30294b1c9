"""What a training loop touches: the module / optimizer / dataloader wrappers ``Fabric.setup*`` return
(``wrappers``), sharding a DataLoader over the ranks and gathering eval results (``dataloaders``), seeding
(``seeding``), callbacks (``callbacks``), the rank-0 progress bar (``progress_bar``), throughput and FLOPs
(``throughput_monitor``), moving collections to a device (``device_transfer``) and small data helpers
(``data_helpers``).

May import: ``checkpoint`` (the loader's position), ``strategies``, ``collectives``, ``precision`` and everything
below them. Never ``fabric``, ``connector`` or ``cli``. Entry points: ``wrappers.setup_module``,
``wrappers.setup_optimizers``, ``dataloaders.setup_dataloader``, ``seeding.seed_everything``.
"""
