"""How an exchange says a process's part ended without a failure of its own, or with a peer's: the exchanges raise
these, and the launcher reads them to say what ended a process (so it imports no exchange module)."""
from __future__ import annotations

from shoal.comm.quorum import MeetingsOver  # (said here with the others; defined where the quorum raises it)
from shoal.errors import ShoalError

__all__ = ["JobOver", "MeetingsOver", "ServerLost"]


class JobOver(ShoalError):  # not a RuntimeError: no channel failed
    """A process rejoined too late: the servers finished serving (the job ended without it)."""


class ServerLost(ShoalError, RuntimeError):
    """A server of the job died or stopped answering: the job cannot go on (resume from a checkpoint)."""
