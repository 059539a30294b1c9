"""Watching ranks: what turns one rank's failure into one clear ending of the job, restarts it, or lets it
save when the cluster preempts it.

The supervisor's side (one process per node that starts nothing itself: the launchers call it):
``supervisor`` (start, watch, stop one node's ranks; a round's ranks in ``round_ranks``, its signal handlers in
``supervisor_signals``), ``failures`` (the one summary), ``restarts`` (rounds,
``--max-restarts``), ``preemption`` (grace period, forwarding, requeue), ``reaper`` (outlives a killed
supervisor to kill its ranks' helpers), ``linger`` (node 0 keeps the store up), ``stopping`` (kill and reap),
``output_forwarding`` ([rank N] prefixes, per-rank log files), ``hang_watch`` (hangs: the optimizer-step watch, the
stack snapshot before a collective timeout) and ``stacks`` (live stacks: py-spy or the ranks' faulthandler).

The rank's side, in files named ``rank_*`` (they run inside a rank): ``rank_child`` (error file, die with the
supervisor), ``rank_signals`` (record SIGTERM / SIGUSR1, agree on preemption), ``rank_watch`` (the collective
watch thread that names the ranks a failed collective waited for), ``rank_progress`` (steps, collectives and waits
in a shared-memory record the supervisor reads); ``rank_bootstrap/sitecustomize.py`` installs the stack handler
before anything is imported.

May import: ``accelerators``, ``environments``, ``precision``, ``distributed``. Never ``launchers``,
``strategies`` or anything above them.
"""
