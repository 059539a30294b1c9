"""What a training loop touches: the module / optimizer / dataloader wrappers ``Fabric.setup*`` return
(``wrapping``, made by ``module_setup``; a set-up module's methods other than ``forward``: ``forward_methods``), sharding a DataLoader
over the ranks and gathering eval results (``dataloaders``), seeding (``seeding``), callbacks (``callbacks``),
the rank-0 progress bar (``progress_bar``), throughput and FLOPs (``throughput_monitor``), moving collections to
a device (``device_transfer``) and small data helpers (``data_helpers``).

May import: ``checkpoint`` (the loader's position), ``strategies``, ``collectives``, ``precision`` and everything
below them (``accelerators`` for peak FLOP/s, ``environments`` for the pre-launch rank). Never ``fabric``,
``connector`` or ``cli``. Entry points: ``module_setup.setup_module``, ``module_setup.setup_optimizers``,
``dataloaders.setup_dataloader``, ``seeding.seed_everything``.
"""
