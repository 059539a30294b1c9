"""The lowest floor: what every process of a job shares below the strategies.

``rendezvous`` (hosting and joining the job's key-value store, its timeouts, the run's id), ``control_plane/``
(what supervisors and ranks say to each other through that store: every key in ``control_plane/keys.py``, the
ranks' meeting, the failure flag, heartbeats, the restart agreement, straggler reports, collective progress,
rank_zero_first; store protocol only, no processes),
``network`` (which interface gloo should use), ``gloo_exit`` (letting gloo's worker threads go idle before a
rank exits) and ``shared_filesystem`` (whether every rank sees one directory).

May import: nothing else of fabriclite.
"""
