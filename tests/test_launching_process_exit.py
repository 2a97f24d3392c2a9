"""The exit of the process that launched a job's ranks (issue 40, point 1: shoal's time around the loop).

That process (a user's script around shoal.fit) holds torch's heap; its interpreter's teardown searched it for cycles
again and again: 0.85 s after the full example GPT's last step on a busy 2-core machine (0.5 s now), where torchft's
job process holds no torch. It now collects once at exit, so the program's last garbage is still finalized, then
freezes the heap (gc.freeze, as `python -m shoal` does), so the teardown's walks leave it out.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# registered first, so run last (atexit: last in, first out): what the teardown that follows will walk
SAYS_IF_FROZEN = 'import atexit, gc\natexit.register(lambda: print("frozen:", gc.get_freeze_count() > 0, flush=True))\n'

GARBAGE_AT_EXIT = textwrap.dedent('''
    class Noted:
        def __del__(self):
            print("finalized", flush=True)


    gc.disable()  # (the garbage below waits for a collection: the exit's)
    garbage = Noted()
    garbage.itself = garbage
    del garbage
''')


def test_the_launching_process_collects_its_garbage_then_freezes_its_heap_at_exit(tmp_path):
    """Once registered (twice here: once is kept), the exit finalizes the cyclic garbage the program left, then freezes
    the heap before the teardown; without it, the teardown found that garbage after the last handler, heap unfrozen."""
    script = SAYS_IF_FROZEN + "from shoal.launcher import process_server\n\n" + GARBAGE_AT_EXIT + textwrap.dedent('''
        process_server.end_without_walking_the_heap()
        process_server.end_without_walking_the_heap()
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["finalized", "frozen: True"]


FIT = textwrap.dedent('''
    import torch

    import shoal


    def loss(output, target):
        return torch.nn.functional.mse_loss(output, target)


    if __name__ == "__main__":
        x = torch.randn(64, 4)
        shoal.fit(torch.nn.Linear(4, 1), loss, (x, x.sum(1, keepdim=True)), steps=4, batch_size=8,
                  cluster=shoal.Cluster(nworker_groups=2, local_steps=2), workspace="ws", log=lambda line: None)
''')


@pytest.mark.slow  # a fit of 2 processes in a fresh interpreter: about 5 s (the test above checks the exit itself)
def test_a_script_whose_fit_started_processes_ends_with_its_heap_frozen(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SAYS_IF_FROZEN + FIT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "frozen: True"
