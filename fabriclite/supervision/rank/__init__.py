"""The rank's side of supervision: what runs inside a rank.

``child`` (the error file, dying with the supervisor, the stack handler), ``signals`` (record SIGTERM / SIGUSR1,
agree on preemption), ``collective_watch`` (the thread that names the ranks a failed collective waited for),
``progress`` (steps, collectives and waits in a shared-memory record the supervisor reads); ``bootstrap/`` holds
the ``sitecustomize`` that installs the stack handler before anything is imported.

May import: the floors below ``supervision`` only (never ``agent``, ``watch`` or ``processes``).
"""
