"""The one error the reporting commands raise for bad input (one line, exit status 2)."""
from shoal.errors import ShoalError


class ReportError(ShoalError, ValueError):
    """A run folder, metrics file or option that cannot be reported on; the message names it."""
