"""The job secret: what lets a node into a multi-node job's control plane (docs/security.md).

A multi-node job that fabriclite supervises (``fabriclite run``, script mode) needs the same secret on every node,
read from a file (``--job-secret-file`` / ``$FABRICLITE_JOB_SECRET_FILE``) that only its owner can read. Without
one it refuses to start, naming the flag, the recipe and ``--insecure`` (``$FABRICLITE_INSECURE=1``), the explicit
way to run open. A one-node job needs none: its store listens on loopback only, nothing peer-facing exists.

The secret travels only as the file's path: never in argv, a log, the events record or a store value; the relay
(``store_relay``) proves it with HMAC-SHA256 over both sides' nonces and never sends it.

Lowest floor: imports nothing of fabriclite.
"""
from __future__ import annotations

import os
import secrets
import stat
import sys
from typing import Optional

SECRET_FILE_ENV = "FABRICLITE_JOB_SECRET_FILE"
INSECURE_ENV = "FABRICLITE_INSECURE"
#: the fewest bytes a secret may have (after surrounding whitespace is stripped): 128 bits as hex
MIN_SECRET_BYTES = 16
#: the most a secret file may hold (a secret, not a data file)
MAX_SECRET_BYTES = 4096
RECIPE = ("make one with 'fabriclite new-secret FILE' (a file only you can read) on a folder every node sees, "
          "then pass --job-secret-file FILE (or set $FABRICLITE_JOB_SECRET_FILE) on every node")


class JobSecretError(ValueError):
    """The job secret is missing, unreadable, too short or readable by others; the message names the file and
    the fix."""


def read_secret(path: str) -> bytes:
    """The secret in ``path``: its bytes with surrounding whitespace stripped. JobSecretError when the file is
    missing, not a regular file, unreadable, readable or writable by group or others, shorter than
    MIN_SECRET_BYTES or longer than MAX_SECRET_BYTES."""
    where = f"job secret file {path!r}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise JobSecretError(f"{where} does not exist; {RECIPE}.") from None
    except OSError as err:
        raise JobSecretError(f"{where} cannot be read ({err.strerror}); it must be readable by the user the job "
                             f"runs as. {RECIPE[0].upper() + RECIPE[1:]}.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise JobSecretError(f"{where} is not a regular file; {RECIPE}.")
        if info.st_mode & 0o077:
            raise JobSecretError(f"{where} is readable or writable by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                                 f"make it readable by you alone: chmod 600 {path}")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise JobSecretError(f"{where} holds more than {MAX_SECRET_BYTES} bytes: it is not a secret file; {RECIPE}.")
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise JobSecretError(f"{where} holds {len(secret)} bytes, fewer than the {MIN_SECRET_BYTES} a job secret "
                             f"needs; {RECIPE}.")
    return secret


def write_new_secret(path: str) -> None:
    """Create ``path`` (it must not exist) holding 32 random bytes as hex, readable by its owner alone."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
    finally:
        os.close(fd)


def insecure_requested() -> bool:
    """Whether ``$FABRICLITE_INSECURE`` asks to run a multi-node job open (``1``, ``true``, ``yes``)."""
    return os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def for_job(num_nodes: int, fault_tolerant: bool = False) -> Optional[bytes]:
    """The secret a supervised job runs with: None for one node (nothing peer-facing), under ``--fault-tolerant``
    (torchft's own clients cannot prove a secret: docs/security.md says what stays open) and under ``--insecure``;
    else the secret in ``$FABRICLITE_JOB_SECRET_FILE``. JobSecretError when a multi-node job has neither a secret
    nor ``--insecure``, or the file is bad."""
    path = os.environ.get(SECRET_FILE_ENV, "").strip()
    if path:
        secret = read_secret(path)  # a bad file is an error even where it would not be used
        return None if num_nodes <= 1 or fault_tolerant else secret
    if num_nodes <= 1 or fault_tolerant or insecure_requested():
        return None
    raise JobSecretError(
        f"a job of {num_nodes} nodes needs a job secret, so that only its own nodes can reach its control plane: "
        f"{RECIPE} (docs/security.md has recipes for SLURM and torchrun). To run it open to anyone who can reach "
        f"node 0's port, pass --insecure (or set ${INSECURE_ENV}=1).")


def insecure_line(where: str) -> str:
    """The one line a node started with ``--insecure`` prints."""
    return (f"fabriclite: --insecure: this job's store at {where} accepts anyone who can reach it, who can then stop, "
            f"hang or read the job (docs/security.md)")


def say_insecure(where: str) -> None:
    """Print :func:`insecure_line` on stderr."""
    sys.stderr.write(insecure_line(where) + "\n")
    sys.stderr.flush()
