"""A run's workspace: shoal writes only under its own names, and one run at a time.

Layout: a workspace may hold the user's own files (SINGA's examples use the
example's folder, with its job.conf and data, as the workspace). shoal writes
only under OUTPUT_NAMES at the top (checkpoint/, logs/, metrics.jsonl, ...) and
under .shoal/, where it keeps its marker, its lock and its copy of the job, so
a user's job.conf is never touched. It refuses in one line when one of those
names is the user's: a file or folder of that name was there when shoal first
claimed the folder (WORKSPACE/.shoal/workspace.json records which), or a file
stands where shoal needs a folder. A workspace written by an older shoal (only
shoal's files in it, its job copy at the top as job.conf) is adopted and its
job copy still read.

Trust: nobody but this user (and root) may be able to redirect or feed a workspace. Before anything is
written, `check_trusted` refuses a workspace that is a symbolic link, one under a folder another user can
write (without the sticky bit) or owns, as ssh's StrictModes checks every folder above ~/.ssh, and a
workspace another user owns or can write, as git refuses a repository another user owns (both unless
SHOAL_TRUST_WORKSPACE says so: TRUST_VARIABLE). `check_own_names` refuses any of shoal's names there that is
a link, not the kind of file shoal keeps, or another user's. The files shoal writes are opened through no
link (shoal.report.writes.open_in_workspace).

Lock: WORKSPACE/.shoal/lock is held with an OS-level lock (flock) for the whole
run; the kernel releases it when the process dies however it dies, so a killed
run never leaves the workspace stuck. A second run on a workspace in use is
refused with one line naming the job that holds it.
"""
from __future__ import annotations

import fcntl
import grp
import json
import os
import platform
import pwd
import stat
import time
from pathlib import Path
from typing import Optional

from shoal.errors import ShoalError, warn
from shoal.report.job_copy import JOB_COPY, META
from shoal.report.writes import (WorkspaceWriteError, cause_of, open_in_workspace, own_folder, own_folders, write_file,
                                 writing)

# what a run writes at a workspace's top level (and set-aside copies of them: metrics.jsonl.2, visualization.1)
OUTPUT_NAMES = ("checkpoint", "logs", "visualization", "tensorboard", "metrics.jsonl", "summary.json")
FOLDERS = {META, "checkpoint", "logs", "visualization", "tensorboard", "data"}
FIT_DATA = "data"  # shoal.fit writes the arrays it is given here
LEGACY_JOB_COPY = "job.conf"  # where shoal kept that copy before workspaces could hold the user's files
# what older shoals wrote at the top: a folder holding only these, without the marker, is an older shoal workspace
LEGACY_ENTRIES = {META, *OUTPUT_NAMES, LEGACY_JOB_COPY, FIT_DATA}
# names the marker records when they were the user's at the claim: shoal never writes or reads them as its own
RECORDED = (*OUTPUT_NAMES, FIT_DATA, LEGACY_JOB_COPY)


class WorkspaceError(ShoalError, ValueError):
    """The workspace cannot be used as asked (a name of shoal's is the user's, in use, would overwrite, ...)."""


# SHOAL_TRUST_WORKSPACE=1 (any workspace) or =PATH (that one): its folders may be another user's, or writable
# by a group with other members (as git's safe.directory). Never trusted: a link, a folder every user can write.
TRUST_VARIABLE = "SHOAL_TRUST_WORKSPACE"
META_FILES = ("workspace.json", "lock", "job.conf")  # in .shoal/
CHECKED_NAMES = (META, *OUTPUT_NAMES)  # what shoal reads back or writes: never the user's in a workspace shoal uses
ENTRIES_CHECKED = ("checkpoint", "logs")  # folders whose every entry shoal reads back (a resume, a rejoin)


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def _ours(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _private_group(gid: int, owner: int) -> bool:
    """Nobody but `owner` is in group `gid` (a user's private group, root's own): its write bit lets in no one else."""
    try:
        owner_name = pwd.getpwuid(owner).pw_name
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return False
    members |= {user.pw_name for user in pwd.getpwall() if user.pw_gid == gid}
    return members <= {owner_name}


def _stranger(st: os.stat_result, holds_shoals_names: bool) -> tuple[str, bool] | None:
    """Who besides this user and root could change what a folder holds, and whether the opt-in may trust them.

    A folder above the workspace may be writable by everyone with the sticky bit (/tmp): nobody can then rename or
    remove an entry of another's. The workspace and shoal's folders in it may not: whoever writes there can
    plant one of shoal's names.
    """
    sticky = bool(st.st_mode & stat.S_ISVTX) and not holds_shoals_names
    if st.st_mode & stat.S_IWOTH and not sticky:
        return "is writable by every user" + ("" if holds_shoals_names else " and has no sticky bit"), False
    if not _ours(st.st_uid):
        return f"is owned by {_user(st.st_uid)}, not by you or root", True
    if st.st_mode & stat.S_IWGRP and not sticky and not _private_group(st.st_gid, st.st_uid):
        try:
            group = f"group {grp.getgrgid(st.st_gid).gr_name}"
        except KeyError:
            group = f"group {st.st_gid}"
        return f"is writable by {group}, which has other members", True
    return None


def _trusted_by_opt_in(workspace: Path) -> bool:
    given = os.environ.get(TRUST_VARIABLE, "").strip()
    if given in ("1", "yes", "true"):
        return True
    return bool(given) and os.path.realpath(os.path.expanduser(given)) == os.path.realpath(workspace)


def _refuse(workspace: Path, path: Path | None, problem: str, trustable: bool, why: str) -> WorkspaceError:
    where = f"{path} " if path is not None else ""
    remedy = f"; set {TRUST_VARIABLE}=1 if you trust them" if trustable else ""
    return WorkspaceError(f"workspace {workspace}: {where}{problem} ({why}){remedy}")


def check_trusted(workspace: Path) -> None:
    """Refuse, in one line, a workspace another user could redirect or feed: see the module's "Trust". Writes nothing.

    Every folder on the way is checked where it really is: a link on the way (/var/run -> /run) is followed, and
    both the folder holding the link and the folders it leads through must be trusted.
    """
    given = Path(workspace).expanduser()
    path = Path(os.getcwd()) / given  # ".." kept: the kernel resolves it after the links before it
    trusted = _trusted_by_opt_in(path)
    seen: set[str] = set()
    for prefix in reversed(path.parents):
        try:
            link = os.lstat(prefix)
        except (FileNotFoundError, NotADirectoryError):
            break  # made by this run, as this user (or refused then: a file on the way)
        except OSError as err:
            raise WorkspaceError(f"workspace {given}: {prefix} cannot be read ({cause_of(err)})") from None
        if stat.S_ISLNK(link.st_mode) and not _ours(link.st_uid) and not trusted:
            raise _refuse(given, prefix, f"is a link owned by {_user(link.st_uid)}", True, "they could point the workspace elsewhere")
        real = Path(os.path.realpath(prefix))
        for folder in [*reversed(real.parents), real]:
            if str(folder) in seen:
                continue
            seen.add(str(folder))
            try:
                found = _stranger(os.stat(folder), holds_shoals_names=False)
            except OSError as err:
                raise WorkspaceError(f"workspace {given}: {folder} cannot be read ({cause_of(err)})") from None
            if found and not (found[1] and trusted):
                raise _refuse(given, folder, found[0], found[1], "another user could replace the workspace")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise WorkspaceError(f"workspace {given}: cannot be read ({cause_of(err)})") from None
    if stat.S_ISLNK(st.st_mode):
        raise WorkspaceError(f"workspace {given}: is a symbolic link (to {os.readlink(path)}); shoal writes into no "
                             "link another user could redirect: give the folder itself")
    if stat.S_ISDIR(st.st_mode):
        found = _stranger(st, holds_shoals_names=True)
        if found and not (found[1] and trusted):
            raise _refuse(given, None, found[0], found[1], "another user could change its checkpoints and files")


def check_own_names(workspace: Path, users: "set[str] | None" = None, only_meta: bool = False) -> None:
    """Refuse, in one line, any of shoal's names in the workspace that is a link, not the kind of file shoal keeps
    there, or another user's (a regular file where shoal keeps a folder is left to `claim`'s refusal, which says
    it is the user's). `users`: the names the claim takes as the user's; given, an older shoal's job copy at
    the top is checked too unless it is one of them. only_meta: .shoal/ and its files alone. Writes nothing."""
    folder = Path(workspace)
    trusted = _trusted_by_opt_in(folder)

    def check(path: Path, kind: str) -> bool:
        """True when `path` is a folder, checked."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError as err:
            raise WorkspaceError(f"workspace {workspace}: {path} cannot be read ({cause_of(err)})") from None
        if stat.S_ISLNK(st.st_mode):
            raise WorkspaceError(f"workspace {workspace}: {path} is a symbolic link, where shoal keeps its own {kind} "
                                 "(it follows no link in a workspace); remove it or give another --workspace")
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            raise WorkspaceError(f"workspace {workspace}: {path} is not a regular file or folder, where shoal keeps its "
                                 f"own {kind}; remove it or give another --workspace")
        if kind == "file" and stat.S_ISDIR(st.st_mode):
            raise WorkspaceError(f"workspace {workspace}: {path} is a folder where shoal keeps a file; "
                                 "move it or give another --workspace")
        found = _stranger(st, holds_shoals_names=True)
        if found and not (found[1] and trusted):
            raise _refuse(workspace, path, found[0], found[1], "another user could change what shoal reads there")
        return stat.S_ISDIR(st.st_mode)

    if check(folder / META, "folder"):
        for name in META_FILES:
            check(folder / META / name, "file")
    if only_meta:
        return
    legacy = (LEGACY_JOB_COPY,) if users is not None and LEGACY_JOB_COPY not in users else ()
    for name in (*CHECKED_NAMES[1:], *legacy):
        if check(folder / name, "folder" if name in FOLDERS else "file") and name in ENTRIES_CHECKED:
            for entry in os.scandir(folder / name):
                check(Path(entry.path), "folder" if entry.is_dir(follow_symlinks=False) else "file")


def check_workspace(workspace: Path) -> None:
    """The checks of a workspace another user could redirect or feed (check_trusted, check_own_names), before any
    write and before anything is read from it (--resume, --test)."""
    check_location(workspace)
    check_trusted(workspace)
    if Path(workspace).is_dir():
        check_own_names(workspace)


def _legacy(name: str) -> bool:
    """One of the files older shoals wrote, or a set-aside copy of one (metrics.jsonl.2, visualization.1)."""
    base = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name
    return name in LEGACY_ENTRIES or base in LEGACY_ENTRIES


def check_location(workspace: Path) -> Path:
    """Refuse places no run should write into; return the resolved folder."""
    resolved = Path(workspace).expanduser().resolve()
    if resolved == Path(resolved.anchor):
        raise WorkspaceError(f"workspace {workspace}: is the filesystem root; give a folder of its own")
    if resolved == Path.home().resolve():
        raise WorkspaceError(f"workspace {workspace}: is your home directory itself; give a folder of its own")
    if resolved.exists() and not resolved.is_dir():
        raise WorkspaceError(f"workspace {workspace}: exists and is not a folder")
    return resolved


def claim(workspace: Path, writes: tuple[str, ...] = ()) -> None:
    """Create the workspace, or check that none of the names shoal writes (OUTPUT_NAMES and `writes`) is the user's.

    The first claim of a folder records which of shoal's names were already the
    user's (so a later shoal.fit never writes into the user's data/); nothing is
    written when a name is refused.
    """
    folder = Path(workspace)
    resolved = check_location(folder)
    check_trusted(folder)  # before anything is written or read there
    if folder.is_dir():
        check_own_names(folder, only_meta=True)  # .shoal/ and its marker first: they say which names are the user's
    marker = folder / META / "workspace.json"
    fresh = not marker.is_file()
    if fresh:
        try:  # writable by this user only, the parents it makes too, whatever the umask: shoal's next run checks them
            own_folders(folder)
        except WorkspaceWriteError as err:
            raise WorkspaceError(f"workspace {workspace}: cannot be created ({err.cause})") from None
        entries = {p.name for p in folder.iterdir()}
        older_shoal = (all(map(_legacy, entries)) and not any(os.path.islink(folder / e) for e in entries)
                       and _holds_shoals_run(folder))
        users = set() if older_shoal else entries & set(RECORDED)
    else:
        users = set(user_entries(folder))
    check_own_names(folder, users)
    names = (*OUTPUT_NAMES, *writes) + ((META,) if fresh else ())
    taken = [n for n in names if os.path.lexists(folder / n) and (n in users or is_users(folder, n))]
    if taken:
        shown = ", ".join(str(resolved / n) for n in taken[:2]) + (", ..." if len(taken) > 2 else "")
        raise WorkspaceError(
            f"workspace {workspace}: {shown} {'is' if len(taken) == 1 else 'are'} not shoal's but shoal writes "
            f"its own {', '.join(taken[:2])} there; move {'it' if len(taken) == 1 else 'them'} or give another --workspace"
        )
    if fresh:
        own_folder(folder / META)
        write_file(marker, (json.dumps({"created_by": "shoal", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                        "user_entries": sorted(users)}) + "\n").encode())


def _holds_shoals_run(folder: Path) -> bool:
    """shoal's checkpoints or summary are there (a user's file merely named metrics.jsonl is not enough)."""
    from shoal.neuralnet import checkpoint as ckpt_io
    from shoal.report.summary import read_summary

    summary = read_summary(folder) if (folder / "summary.json").is_file() else None
    return bool(ckpt_io.list_checkpoints(folder)) or (isinstance(summary, dict) and {"schema", "status"} <= summary.keys())


def user_entries(workspace: Path) -> list[str]:
    """Which of shoal's names were the user's when shoal claimed the workspace (none for an older shoal's marker)."""
    try:
        recorded = json.loads((Path(workspace) / META / "workspace.json").read_text()).get("user_entries", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in recorded if isinstance(n, str)] if isinstance(recorded, list) else []


def is_users(workspace: Path, name: str) -> bool:
    """WORKSPACE/name is the user's, not shoal's (recorded so at the claim, or a file where shoal keeps a folder)."""
    path = Path(workspace) / name
    if not os.path.lexists(path):
        return False
    return name in user_entries(workspace) or (name in FOLDERS and not path.is_dir())


def job_copy(workspace: Path) -> Optional[Path]:
    """The workspace's copy of its job: .shoal/job.conf, or an older shoal's job.conf at the top (never the user's)."""
    current = Path(workspace) / JOB_COPY
    if current.is_file():
        return current
    legacy = Path(workspace) / LEGACY_JOB_COPY
    if legacy.is_file() and LEGACY_JOB_COPY not in user_entries(workspace):
        return legacy
    return None


class WorkspaceLock:
    """Held for a whole run: `with WorkspaceLock(ws, job_name): ...`."""

    def __init__(self, workspace: Path, job_name: str):
        self.path = Path(workspace) / META / "lock"
        self.job_name = job_name
        self._file = None

    def __enter__(self) -> "WorkspaceLock":
        own_folder(self.path.parent)
        f = os.fdopen(open_in_workspace(self.path, os.O_RDWR | os.O_CREAT), "r+")  # no link followed
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _holder(f.read())
            f.close()
            raise WorkspaceError(f"workspace {self.path.parent.parent} is in use by {holder}; "
                                 "wait for it to end or give another --workspace") from None
        try:
            with writing(self.path):
                f.seek(0)
                f.truncate()
                f.write(json.dumps({"job": self.job_name, "pid": os.getpid(), "host": platform.node(),
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
                f.flush()
        except BaseException:
            f.close()
            raise
        self._file = f
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the lock
            self._file = None


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"job {info['job']!r} (pid {info['pid']} on {info['host']}, started {info['started']})"
    except (ValueError, KeyError, TypeError):
        return "another run"


def prepare(workspace: Path, resume: bool, log) -> Optional[Path]:
    """Refuse to clobber an earlier run; clean what a killed run left; return the checkpoint to resume from."""
    from shoal.neuralnet import checkpoint as ckpt_io

    for stale in ckpt_io.remove_stale_temporaries(workspace):
        log(f"Removed {stale}: a checkpoint a stopped run did not finish writing")
    existing = ckpt_io.list_checkpoints(workspace)
    if resume:
        if not existing:
            raise WorkspaceError(f"{workspace}: no checkpoint to resume from")
        return newest_readable(existing)
    if existing:
        raise WorkspaceError(
            f"{workspace} already holds checkpoints (newest: {existing[-1][1].name}); "
            "use --resume to continue that run or --workspace to start a new one"
        )
    metrics = Path(workspace) / "metrics.jsonl"
    if metrics.exists():  # an earlier run that died before its first checkpoint: keep its metrics
        n = 1
        while os.path.lexists(metrics.with_name(f"metrics.jsonl.{n}")):
            n += 1
        metrics.rename(metrics.with_name(f"metrics.jsonl.{n}"))
    return None


def newest_readable(checkpoints: list[tuple[int, Path]]) -> Path:
    """The newest checkpoint that loads and matches its checksum; a warning for each newer one that does not."""
    from shoal.neuralnet import checkpoint as ckpt_io

    unreadable = []
    for _, path in reversed(checkpoints):
        try:
            ckpt_io.load(path, parts=True)  # a resume needs every part
        except ckpt_io.CheckpointError as err:
            unreadable.append(str(err))
            continue
        for problem in unreadable:
            warn(f"WARNING: {problem}; resuming from the older {path.name}")
        return path
    raise WorkspaceError(f"{checkpoints[-1][1].parent}: no readable checkpoint to resume from (newest: {unreadable[0]})")
