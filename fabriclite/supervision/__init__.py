"""Watching ranks: what turns one rank's failure into one clear ending of the job, restarts it, or lets it
save when the cluster preempts it. Four folders, one job each (torch.distributed.elastic's ``agent/``,
``multiprocessing/``, ``events/`` and ``timer/`` keep the same concerns apart):

- ``agent/``: the node's supervisor and its rounds (start, watch, stop, restart, preempt), its signal handlers, the
  node's layout and the ranks' output.
- ``watch/``: what the supervisor watches its ranks for: hangs (with live stacks), stragglers, the events record
  and goodput.
- ``rank/``: the rank's side, run inside a rank: the error file and dying with the supervisor, preemption
  signals, the collective watch, the progress record the supervisor reads, the bootstrap that installs the stack
  handler before anything is imported.
- ``processes/``: a process's ending: stopping and reaping, the reaper that outlives a killed supervisor, a
  failure read from a rank's exit and error file.

``lighthouse`` (torchft's lighthouse process under ``--fault-tolerant``, kept up by node 0's supervisor) sits
beside them. What supervisors and ranks say to each other through the job's store is
``fabriclite.distributed.control_plane``'s.

Inside: ``agent`` may import ``watch``, ``rank``, ``processes`` and ``lighthouse``; ``lighthouse`` and ``watch`` may
import ``rank`` and ``processes``; ``rank`` and ``processes`` import neither each other nor anything above them.
May import: ``accelerators``, ``environments``, ``precision``, ``distributed``. Never ``launchers``,
``strategies`` or anything above them.
"""
