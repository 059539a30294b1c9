"""The node's supervisor and its rounds (runs in the launching process, never in a rank).

``supervisor`` (start, watch, stop one node's ranks; drives the watchers of ``supervision.watch`` once per poll),
``round_ranks`` (a round's ranks started, polled, stopped; its first-step signal for warm spares), ``restarts``
(rounds, ``--max-restarts``, backoff), ``preemption`` (grace period, forwarding, requeue), ``supervisor_signals``
(its signal handlers), ``node_layout`` (which ranks a node runs), ``output_forwarding`` ([rank N] prefixes,
per-rank log files). What the supervisors say to each other through the job's store
(the failure flag, heartbeats, the restart agreement) is ``fabriclite.distributed.control_plane``'s.

May import: ``supervision.watch``, ``supervision.rank``, ``supervision.processes``, ``supervision.lighthouse`` and
the floors below ``supervision``.
"""
