"""Starting the server a job's processes fork from (multiprocessing's forkserver) as early as the layout is known, and
ending the process that launched them without walking its heap.

The server imports torch and shoal once, before any rank forks (launch.start_method): seconds of CPU. Started by the
launcher, it would begin only after the launching process had imported torch and planned the job, one import after
the other; started here, as soon as the layout is known to need several processes (`shoal.fit` at its call) or when
a script says so first (`shoal.prestart()`), its imports run beside the launching process's own work. Torch-free on
purpose: it must run before torch's import to gain anything. `shoal run JOB` (and `shoal run script.py` whose --set
places several processes), whose process has done nothing yet, imports them itself and forks the server from it
(_fork_server): one import of torch instead of two. So does a `shoal run` that torchrun or srun started with restarts
allowed, for the children its rank's supervisor (launcher/supervisor.py) runs and restarts (_may_be_supervised).
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
from typing import Optional, Sequence

from shoal.config import job_pb2
from shoal.errors import ShoalError


def start_for(cluster: Optional[job_pb2.ClusterProto], preload: Sequence[str], fork_here: bool = False,
              fork_only: bool = False) -> bool:
    """Start the server, importing `preload`, if `cluster` places several processes that shoal will start here (under
    torchrun or srun, whose processes are the ranks: only forked here, for a supervisor's children); whether it started.
    A cluster that cannot be placed starts nothing: planning names its problem later, in its own words. `fork_here`
    (`shoal run JOB`, whose process has done nothing yet but read its arguments): import `preload` here and fork the
    server from this process (_fork_server) instead of starting an interpreter that imports them all again;
    `fork_only`: where it cannot, start none (the caller's processes start theirs when they need it, as before)."""
    from shoal.planning.placement import process_count

    if cluster is None:
        return False
    if not _ranks_start_here():
        return fork_here and _may_be_supervised(cluster) and _fork_server(preload)
    try:
        if process_count(cluster) < 2:
            return False
    except ShoalError:  # a layout planning refuses: it says so later
        return False
    if fork_here and _fork_server(preload):
        return True
    if fork_only:
        return False
    _start(preload)
    return True


# what a user's loop's ranks import beside the launcher's entry: torch._dynamo (torch imports it at a torch optimizer's
# first add_param_group: a second of CPU in each rank) and the session's start
SESSION_RANK_IMPORTS = ("shoal.launcher.launch", "shoal.frontend.session_start", "torch._dynamo")


def prestart() -> bool:
    """`shoal.prestart()`, first in a script whose `shoal.fit` will start several processes, before it imports torch:
    start the server they fork from now, so that its imports (torch, shoal, torch._dynamo for torch's optimizers:
    about 2 s of CPU) run beside the script's own instead of after them (fit starts the server at its call, when the
    script has imported torch already). Whether it started: not in a process a launcher (torchrun, srun) or shoal
    started (a rank imports the script again: it forks from the server it has), nor where multiprocessing has no
    forkserver. Without it, fit starts the server as before; with it and a layout of one process, the server idles."""
    # a process multiprocessing started: its parent is known once it runs, and while it imports the script again
    # (before that) it is `_inheriting`, multiprocessing's own mark for that phase (spawn._check_not_importing_main)
    in_a_child = multiprocessing.parent_process() is not None or getattr(multiprocessing.current_process(), "_inheriting", False)
    if in_a_child or not _ranks_start_here():
        return False
    _start(["shoal.launcher.launch", "torch._dynamo"])
    return True


def _ranks_start_here() -> bool:
    """Whether shoal starts a job's processes from this one: multiprocessing has a forkserver, and no launcher
    (torchrun, srun) started this process (its processes are the ranks)."""
    from shoal.launcher.launchers import detect

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    try:
        return detect(os.environ) is None
    except ShoalError:  # a launcher's variables that do not add up: the run says so, in one line
        return False


def _may_be_supervised(cluster: job_pb2.ClusterProto) -> bool:
    """Whether this process, a rank a launcher (torchrun, srun, env://) started, may run its rank in a child that its
    supervisor restarts (launcher/supervisor.py): restarts allowed (SHOAL_MAX_RESTARTS, else cluster.max_restarts, as
    planning reads them). The children fork from a server: forked here (`shoal run`, before torch's import), it saves
    each such rank an interpreter importing torch and shoal again. Whether the plan supervises this rank is known only
    once it is planned (after torch's import): where it does not, the server idles and ends with this process."""
    from shoal.launcher.launchers import detect
    from shoal.planning.cluster_facts import restarts_override

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    try:
        return detect(os.environ) is not None and restarts_override(os.environ, cluster.max_restarts) > 0
    except ShoalError:  # a launcher's variables or a restart count that do not add up: the run says so, in one line
        return False


def _start(preload: Sequence[str]) -> None:
    from shoal.config.plugins import forkserver_context

    forkserver_context(preload)


# the Pythons whose multiprocessing.forkserver keeps the fields _fork_server sets (_lock, _forkserver_address,
# _forkserver_alive_fd, _forkserver_pid) and takes clients without authenticating them (3.14 authenticates)
FORKSERVER_LAID_OUT = ((3, 10), (3, 13))


def _fork_server(preload: Sequence[str]) -> bool:
    """multiprocessing's forkserver, forked from this process once it has imported `preload` (torch, shoal) itself,
    where this process has done nothing else yet: no torch imported (so nothing computed: OpenMP's threads not
    started), one thread, no server running. Whether it did; if not, the caller starts one as before.

    The launching process imports torch and shoal anyway; a server started as its own interpreter imported them
    again beside it (about 1.5 s of CPU, a quarter of a small job's whole `shoal run`). Forked right after those
    imports, the server holds the same modules (frozen, as shoal.config.forkserver_heap does) and is ready as
    soon as an interpreter's would be: same wall time, half the imports. Its process is what multiprocessing's
    would be: it keeps only stdin, stdout, stderr and its two channels (multiprocessing passes the same to the
    interpreter it starts), never returns into this process's code (it ends with os._exit), and OpenMP read its
    settings with RANK_ENVIRONMENT_DEFAULTS, as in a server started with them."""
    import gc
    import importlib
    import socket
    import sys
    import threading
    from multiprocessing import connection, forkserver, resource_tracker

    from shoal.config.plugins import RANK_ENVIRONMENT_DEFAULTS

    first, last = FORKSERVER_LAID_OUT
    if not first <= sys.version_info[:2] <= last:  # another layout: the server starts as an interpreter instead
        return False
    server = forkserver._forkserver
    if "torch" in sys.modules or threading.active_count() != 1 or server._forkserver_pid is not None:
        return False
    # OpenMP reads its settings once, when torch loads it (below): the ranks' defaults, as the server's own
    # environment gives them to a server started as an interpreter; this process's environment stays the user's
    defaults = {name: value for name, value in RANK_ENVIRONMENT_DEFAULTS.items() if name not in os.environ}
    os.environ.update(defaults)
    try:
        for name in preload:
            importlib.import_module(name)
    finally:
        for name in defaults:
            os.environ.pop(name, None)
    resource_tracker.ensure_running()  # (before the fork: a rank is handed the tracker's channel, as multiprocessing does)
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # every client holds the write end: when all are gone, the server ends
        gc.collect()
        pid = os.fork()
        if pid == 0:  # the server: never back into this process's code
            try:
                keep = sorted({0, 1, 2, listener.fileno(), alive_r})
                for low, high in zip([2] + keep, keep + [os.sysconf("SC_OPEN_MAX")]):
                    if low + 1 < high:  # (closerange(3, 0) would close everything from 3 up)
                        os.closerange(low + 1, high)
                gc.freeze()
                forkserver.main(listener.fileno(), alive_r, [])
            finally:
                os._exit(0)
        os.close(alive_r)
    finally:
        listener.close()
    with server._lock:
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


_ENDS_WITHOUT_WALKING_THE_HEAP = False


def end_without_walking_the_heap() -> None:
    """At the exit of the process that launches a job's ranks (a user's script around shoal.fit, shoal.train's caller),
    leave out the interpreter's teardown searches for cycles through torch's heap, which ran after the job's last step
    while the ranks (forked from a frozen server) end at once: the full example GPT's script ended in 0.5 s instead of
    0.85 s on a busy 2-core machine. At exit, after the handlers registered later (atexit runs them last in, first out),
    one collection still finalizes the garbage the program left, then gc.freeze() (as `python -m shoal` and the ranks'
    server do): what is reachable then is freed by reference counting as the teardown clears it; only an object in a
    reference cycle is not finalized (Python does not promise it at exit). Registered once per process."""
    global _ENDS_WITHOUT_WALKING_THE_HEAP
    if not _ENDS_WITHOUT_WALKING_THE_HEAP:
        _ENDS_WITHOUT_WALKING_THE_HEAP = True
        atexit.register(_collect_then_freeze)


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()
