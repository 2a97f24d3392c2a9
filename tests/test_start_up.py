"""What a job of several processes costs before its first step (issue 40, point 1: shoal's start-up around the loop).

shoal.fit starts the server its ranks fork from (multiprocessing's forkserver) as soon as the layout is known to need
processes, so its imports run beside the parent's checks and planning; a fit with a torch optimizer has the server
import torch._dynamo too (torch's optimizers import it on first use: about a second of CPU), so the ranks inherit it
instead of each importing it after it started.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import sys

    import torch

    import shoal


    class Recording(torch.nn.Linear):
        """Notes, where a rank unpickles it (before the rank builds anything), whether torch._dynamo was imported."""

        def __setstate__(self, state):
            super().__setstate__(state)
            with open(state["record_to"], "a") as f:
                f.write(f"{'torch._dynamo' in sys.modules}\\n")


    def loss(output, target):
        return torch.nn.functional.mse_loss(output, target)


    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)


    if __name__ == "__main__":
        torch.manual_seed(0)
        model = Recording(4, 1)
        model.record_to = sys.argv[1]
        x = torch.randn(64, 4)
        shoal.fit(model, loss, (x, x.sum(1, keepdim=True)), steps=4, batch_size=8, optimizer=adamw,
                  cluster=shoal.Cluster(nworker_groups=2, local_steps=2), workspace=sys.argv[2], log=lambda line: None)
''')


def test_the_ranks_of_a_fit_with_a_torch_optimizer_inherit_torch_dynamo(tmp_path):
    script, record = tmp_path / "job.py", tmp_path / "ranks.txt"
    script.write_text(SCRIPT)
    # a fresh interpreter: the forkserver is one per process, and this test's must be started by the fit call
    done = subprocess.run([sys.executable, str(script), str(record), str(tmp_path / "ws")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = record.read_text().split()  # one line per unpickling (each rank unpickles the module at least once)
    assert len(seen) >= 2 and set(seen) == {"True"}  # every rank: imported before it started
