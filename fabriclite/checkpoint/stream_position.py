"""The path ``StreamPositionError`` was first given (it lives in ``fabriclite.data.stream_kinds``)."""
from fabriclite.data.stream_kinds import StreamPositionError  # noqa: F401
