"""The torchft family: the strategies of ``fabriclite run --fault-tolerant`` (each node one torchft replica group,
healed from a live peer) and the parts they build on torchft 0.2.0.

``replica_strategy`` (``strategy="fault_tolerant"``: the per-step path, gradients all-reduced across the groups),
``replica_parts`` (torchft's Manager, DDP, optimizer wrapper and checkpoint transport as that strategy uses them),
``diloco`` (``strategy="diloco"`` / ``"local_sgd"``: the groups meet every ``sync_every`` steps), ``diloco_sync``
(torchft's DiLoCo and LocalSGD with their commit vote, as those strategies use them), ``diloco_settings`` (their
settings, checked before a Manager exists, and a model's fragments).

Only ``replica_parts`` and ``diloco_sync`` import torchft, and only when a strategy first needs them: importing this
package, ``replica_strategy``, ``diloco`` or ``diloco_settings`` never does. Every import here is absolute, so the
name of this folder never stands for the torchft package.

May import: ``strategies.ddp`` (a replica group is a DDP strategy), the floors below ``strategies``, and torchft.
Nothing else in ``strategies/`` imports this folder (the registry names its classes by strings). Entry points:
``FaultTolerantStrategy``, ``DiLoCoStrategy``, ``LocalSGDStrategy`` (``fabriclite.strategies.STRATEGIES``).
"""
