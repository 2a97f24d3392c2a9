"""The one error the reporting commands raise for bad input (one line, exit status 2)."""


class ReportError(ValueError):
    """A run folder, metrics file or option that cannot be reported on; the message names it."""
