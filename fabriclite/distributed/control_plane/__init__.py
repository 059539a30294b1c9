"""The control plane: what supervisors, ranks and node 0's store say to each other, apart from starting and
reaping processes. Every function and class here takes a store (a ``torch.distributed.Store``: TCPStore in a
job, HashStore in a simulation) and nothing of a process, so a simulation of many nodes drives the same code as
a real job.

``keys`` (every key: its name, writer, reader and when it goes), ``meeting`` (a round's part of the store, the
ranks' check-in at launch, torchrun starts' meeting), ``failure_flag`` (the job's first failure, and the waits
that end on it), ``liveness`` (supervisors' heartbeats; node 0 keeping the store up), ``restart_agreement``
(whether and when the next round starts), ``straggler_reports`` (each node's busy times per window),
``collective_progress`` (each rank's collective counts), ``rank_zero_first`` (the first rank's word), ``polling``
(how every wait polls: O(1) requests per poll, a backoff; a simulation turns the same pollers from an event
loop).

May import: ``fabriclite.distributed.rendezvous`` (its error), ``fabriclite.distributed.store_client`` (its clock)
and nothing else of fabriclite.
"""
