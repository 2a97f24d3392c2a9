"""The files a store may be: regular files only, so that a device or a named pipe cannot hang a run."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from shoal.data.errors import StoreError


def regular_file(path: Path, what: str = "store") -> Path:
    """`path` when it is a regular file (after symlinks); StoreError naming it otherwise.

    `/dev/zero` would be read for ever and a named pipe blocks until someone writes to it.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise StoreError(f"{path}: no such {what} (prepare it with `shoal prepare ...`)") from None
    except OSError as err:
        raise StoreError(f"{path}: cannot read the {what} ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else "a device or socket"
        raise StoreError(f"{path}: is {kind}, not a regular file: a {what} is a file")
    return path
