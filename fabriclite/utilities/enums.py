"""``LightningEnum``: a ``str`` enum comparing case-insensitively with strings (lightning_utilities' StrEnum,
which Lightning exports under this name)."""
from lightning_utilities.core.enums import StrEnum as LightningEnum

__all__ = ["LightningEnum"]
