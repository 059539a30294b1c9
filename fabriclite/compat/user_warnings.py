"""``PossibleUserWarning`` (warnings that may be deliberate in user code) and the switches that silence them:
``disable_possible_user_warnings()``, and ``POSSIBLE_USER_WARNINGS=0`` / ``off`` in the environment, which Lightning
reads when ``lightning.fabric`` is imported and fabriclite when a ``Fabric`` is created (importing changes no
warning filter)."""
from __future__ import annotations

import os
import warnings

#: the environment variable that silences PossibleUserWarning (Lightning's name and values)
SWITCH_ENV = "POSSIBLE_USER_WARNINGS"


class PossibleUserWarning(UserWarning):
    """A warning about something that is often a mistake but may be intended."""


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore ``PossibleUserWarning`` from ``module`` (a regex on the module name; "" means every module)."""
    warnings.filterwarnings("ignore", module=module, category=PossibleUserWarning)


def apply_env_switch() -> None:
    """``disable_possible_user_warnings()`` when ``$POSSIBLE_USER_WARNINGS`` is ``0`` or ``off`` (any case)."""
    if os.environ.get(SWITCH_ENV, "").lower() in ("0", "off"):
        disable_possible_user_warnings()
