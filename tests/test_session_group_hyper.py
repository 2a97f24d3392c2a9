"""In-memory Downpour and Hogwild in a user's loop: each group's push carries its own optimizer's hyper-parameters, as
its scheduler set them, and the in-process server sets them before that push's update (as Downpour's pushes over
processes carry TAG_HYPER). Driven through `shoal run script.py`: a LambdaLR whose factor is 0 from the first step on
leaves every param where it started; a server that applied the recipe's lr (0.5) would have moved them."""
from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import load_file

from layouts import LAYOUTS
from test_session_groups import DOWNPOUR, HOGWILD
from test_session_workers import shoal_run

FROZEN_BY_SCHEDULE = textwrap.dedent('''
    import sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    initial = torch.nn.Linear(4, 1)
    save_file({k: v.clone() for k, v in initial.state_dict().items()}, str(out / "initial.safetensors"))

    def train(worker):
        import copy
        model = worker.model(copy.deepcopy(initial))
        opt = worker.optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # lr 0 from the first push on
        for step, (xb, yb) in worker.batches(data, batch_size=8, shuffle=False):
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step(); opt.zero_grad(); sched.step()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"worker{worker.index}.safetensors"))

    shoal.session(train_steps=4).each_worker(train)
''')


@pytest.mark.parametrize("row", [DOWNPOUR, HOGWILD])
def test_each_push_carries_its_groups_scheduled_learning_rate(row, tmp_path):
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN_BY_SCHEDULE)
    proc = shoal_run(script, tmp_path, tmp_path / "ws", *LAYOUTS[row].cli())
    assert proc.returncode == 0, proc.stderr
    initial = load_file(str(tmp_path / "initial.safetensors"))
    for worker in (0, 1):
        final = load_file(str(tmp_path / f"worker{worker}.safetensors"))
        assert all(torch.equal(final[k], initial[k]) for k in initial), (row, worker, final, initial)
