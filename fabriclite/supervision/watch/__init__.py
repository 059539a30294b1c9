"""What a node's supervisor watches its ranks for: ``hangs`` (the optimizer-step watch, the stack snapshot before a
collective timeout), ``stacks`` (live stacks: py-spy or the ranks' faulthandler), ``stragglers`` (ranks slower than
the median), ``step_rates`` (each rank's steps per second), ``events`` (the job's events record) and ``goodput``
(the share of wall time in steps that counted).

May import: ``supervision.rank``, ``supervision.processes`` and the floors below ``supervision``; never
``supervision.agent``.
"""
