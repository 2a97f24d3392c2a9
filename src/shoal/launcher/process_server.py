"""Starting the server a job's processes fork from (multiprocessing's forkserver) as early as the layout is known, and
ending the process that launched them without walking its heap.

The server imports torch and shoal once, before any rank forks (launch.start_method): seconds of CPU. Started by the
launcher, it would begin only after the launching process had imported torch and planned the job, one import after
the other; started here, as soon as the layout is known to need several processes (`shoal run JOB` before it imports
torch, `shoal.fit` at its call) or when a script says so first (`shoal.prestart()`), its imports run beside the
launching process's own work. Torch-free on purpose: it must run before torch's import to gain anything.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
from typing import Optional, Sequence

from shoal.config import job_pb2
from shoal.errors import ShoalError


def start_for(cluster: Optional[job_pb2.ClusterProto], preload: Sequence[str]) -> bool:
    """Start the server, importing `preload`, if `cluster` places several processes that shoal will start here (not
    under torchrun or srun, whose processes are the ranks); whether it started. A cluster that cannot be placed
    starts nothing: planning names its problem later, in its own words."""
    from shoal.planning.placement import process_count

    if cluster is None or not _ranks_start_here():
        return False
    try:
        if process_count(cluster) < 2:
            return False
    except ShoalError:  # a layout planning refuses: it says so later
        return False
    _start(preload)
    return True


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


def _start(preload: Sequence[str]) -> None:
    from shoal.config.plugins import forkserver_context

    forkserver_context(preload)


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
