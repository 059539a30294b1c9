"""Reading launcher variables from ``os.environ`` with errors that name the variable and its value.

Every reader looks at ``os.environ`` when it is called (nothing is cached), and none writes to it.
"""

import os
from typing import Callable, Optional, Sequence


def first_set(names: Sequence[str]) -> Optional[str]:
    """The first of ``names`` that is set in ``os.environ`` (an empty value counts as unset), or None."""
    for name in names:
        if os.environ.get(name, "").strip():
            return name
    return None


def read_optional_str(name: str) -> Optional[str]:
    """The value of ``name``, stripped, or None when unset or empty."""
    return os.environ.get(name, "").strip() or None


def all_set(names: Sequence[str]) -> bool:
    """True when every one of ``names`` is set in ``os.environ`` to a non-empty value."""
    return all(os.environ.get(name, "").strip() for name in names)


def read_str(name: str, env: str) -> str:
    """The value of ``name``; ValueError naming ``name`` (and the ``env`` that needs it) when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        raise ValueError(
            f"The {env} cluster environment needs the environment variable {name}, but it is not set. "
            f"Check that the process was started by the launcher this environment belongs to."
        )
    return raw


def parse_int(name: str, raw: str, env: str, minimum: int = 0) -> int:
    """``raw`` (the value of ``name``) as an int >= ``minimum``; ValueError naming the variable and value otherwise."""
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(
            f"The {env} cluster environment read {name}={raw!r}, which is not an integer."
        ) from None
    if value < minimum:
        raise ValueError(
            f"The {env} cluster environment read {name}={raw!r}, but it must be an integer >= {minimum}."
        )
    return value


def read_int(name: str, env: str, minimum: int = 0, default: Optional[int] = None) -> int:
    """The value of ``name`` as an int >= ``minimum``.

    Unset or empty gives ``default`` when one is given, else a ValueError naming the variable.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        if default is not None:
            return default
        read_str(name, env)  # raises the "not set" error
    return parse_int(name, raw, env, minimum)


def read_optional_int(name: str, env: str, minimum: int = 0) -> Optional[int]:
    """The value of ``name`` as an int >= ``minimum``, or None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    return parse_int(name, raw, env, minimum) if raw else None


def read_port(name: str, env: str) -> int:
    """The value of ``name`` as a TCP port in 1..65535; ValueError naming the variable and value otherwise."""
    port = read_int(name, env, minimum=1)
    if port > 65535:
        raise ValueError(
            f"The {env} cluster environment read {name}={os.environ[name]!r}, which is not a TCP port (1..65535)."
        )
    return port


def main_address_or(derive: Callable[[], str]) -> str:
    """``MASTER_ADDR`` when set, else ``derive()``: the rule of every launcher that may leave it unset (SLURM, MPI,
    XLA)."""
    return read_optional_str("MASTER_ADDR") or derive()


def main_port_or(env: str, derive: Callable[[], int]) -> int:
    """``MASTER_PORT`` when set (a TCP port; ValueError naming it otherwise), else ``derive()``: the rule of every
    launcher that may leave it unset (SLURM, MPI, LSF)."""
    if os.environ.get("MASTER_PORT", "").strip():
        return read_port("MASTER_PORT", env)
    return derive()
