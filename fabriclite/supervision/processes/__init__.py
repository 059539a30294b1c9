"""A process's ending, as its parent sees it: ``stopping`` (kill a process group, reap, exit), ``reaper`` (a small
process that outlives a killed supervisor to kill its ranks' helpers), ``failures`` (a rank's exit and error file
read as one ``Failure``, and the one summary of a failed round).

May import: the floors below ``supervision`` only.
"""
