"""Errors of the data layer: one line naming the file and where in it."""
from shoal.errors import ShoalError


class StoreError(ShoalError, ValueError):
    """A record store (or dataset source file) is missing, truncated or corrupt."""
