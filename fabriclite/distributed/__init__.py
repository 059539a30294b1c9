"""The lowest floor: what every process of a job shares below the strategies.

``rendezvous`` (the job's key-value store, its timeouts, the failure flag a failed node publishes),
``network`` (which interface gloo should use), ``gloo_exit`` (letting gloo's worker threads go idle before a
rank exits) and ``shared_filesystem`` (whether every rank sees one directory).

May import: nothing else of fabriclite.
"""
