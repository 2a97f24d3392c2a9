"""Errors of the data layer: one line naming the file and where in it."""


class StoreError(ValueError):
    """A record store (or dataset source file) is missing, truncated or corrupt."""
