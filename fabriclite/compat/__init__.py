"""What exists only for Lightning Fabric compatibility and has no other home: the ``run()`` override
(``run_method``), hooking up a LightningModule (``lightning_module``), the rank ``rank_zero_only`` starts with
(``rank_zero_env``) and ``PossibleUserWarning`` (``user_warnings``).

May import: ``environments`` and ``distributed`` only; ``fabric`` imports it. fabriclite never imports lightning itself.
"""
