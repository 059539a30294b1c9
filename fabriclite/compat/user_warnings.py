"""``PossibleUserWarning`` (warnings that may be deliberate in user code) and the switch to silence them."""
from __future__ import annotations

import warnings


class PossibleUserWarning(UserWarning):
    """A warning about something that is often a mistake but may be intended."""


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore ``PossibleUserWarning`` from ``module`` (a regex on the module name; "" means every module)."""
    warnings.filterwarnings("ignore", module=module, category=PossibleUserWarning)
