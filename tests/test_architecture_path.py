"""docs/architecture.md's "The path of one step": the shoal modules each way in passes through up to its first
training step, and its calls back up the layers, traced (sys.setprofile) and compared with what the page says.

Each way runs in this process, one worker: `shoal run job.conf` (a SINGA job), `shoal.fit` (a torch module) and
`shoal.session()` (a user's own loop, to the end of its second step). A traced call is a function of shoal's called
while the way runs (not while a module is imported); a call back up the layers is one from a module of a lower layer
(docs/architecture.md's order: frontend, launcher, strategies, runtime, planning, neuralnet and data, config) into
a module of a higher one: a callback, or a strategy reached through the plan. When the code changes the way, this
test fails with the page's new text (`python tests/test_architecture_path.py` prints it)."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import shoal
from shoal.frontend.cli import main

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
SRC = str(Path(shoal.__file__).parent) + "/"
LAYERS = ["frontend", "launcher", "strategies", "runtime", "planning", "neuralnet", "config"]
BLOCK = re.compile(r"^```text\npath of one step: (?P<way>[^\n]+?) \((?P<files>\d+) files, (?P<up>\d+) calls back up the layers\)\n"
                   r"(?P<body>.*?)\n```$", re.M | re.S)


def layer(module: str):
    top = module.split("/")[0]
    top = "neuralnet" if top == "data" else top
    return LAYERS.index(top) if top in LAYERS else None  # report, comm, errors: beside the layers


class _Reached(Exception):
    pass


def trace(run: Callable[[], None], stop: Callable[[str, str], bool]) -> tuple[list[str], list[str]]:
    """The shoal modules `run` calls into, in order of first call, and its calls back up the layers (caller -> callee),
    up to the first call `stop(module, function)` accepts."""
    order: list[str] = []
    up: list[str] = []

    def importing(frame) -> bool:
        while frame is not None:
            code = frame.f_code
            if code.co_name == "<module>" or not code.co_flags & inspect.CO_OPTIMIZED:  # a module's or class's body
                return True
            if code is run.__code__:
                return False
            frame = frame.f_back
        return True

    def profile(frame, event, _arg):
        if event != "call" or not frame.f_code.co_filename.startswith(SRC) or importing(frame):
            return
        module, function = frame.f_code.co_filename[len(SRC):], frame.f_code.co_name
        if module not in order:
            order.append(module)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(SRC):
            caller = caller.f_back
        if caller is not None:
            frm = caller.f_code.co_filename[len(SRC):]
            if layer(frm) is not None and layer(module) is not None and layer(module) < layer(frm):
                up.append(f"{frm}:{caller.f_code.co_name} -> {module}:{function}")
        if stop(module, function):
            raise _Reached

    sys.setprofile(profile)
    try:
        run()
    except _Reached:
        pass
    finally:
        sys.setprofile(None)
    return order, up


def _first_exchange_step(module: str, function: str) -> bool:
    return module.startswith("runtime/exchanges/") and function == "step"


def _blobs_job(tmp_path: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import mlp_job_text, write_store  # the suite's small job on its blob stores

    rng = torch.Generator().manual_seed(0)
    for name, n in (("train.bin", 256), ("test.bin", 64)):
        write_store(tmp_path / name, torch.randn(n, 16, generator=rng).numpy(), torch.randint(0, 4, (n,), generator=rng).numpy())
    job = tmp_path / "job.conf"
    job.write_text(mlp_job_text(tmp_path, train_steps=3))
    return job


def _shoal_run(tmp_path: Path):
    job = _blobs_job(tmp_path)
    return lambda: main(["run", str(job), "--workspace", str(tmp_path / "ws"), "--no-progress"])


def _fit(tmp_path: Path):
    x = torch.randn(64, 8)
    data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(8, 2))
    return lambda: shoal.fit(model, torch.nn.functional.cross_entropy, data, steps=3, batch_size=16,
                             workspace=str(tmp_path / "ws"))


def _session(tmp_path: Path):
    x = torch.randn(64, 8)
    data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())

    def loop() -> None:
        run = shoal.session(train_steps=3, workspace=str(tmp_path / "ws"))
        model = run.model(torch.nn.Sequential(torch.nn.Linear(8, 2)))
        opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step, (xb, yb) in run.batches(data, batch_size=16):
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(step, loss=loss)
            if step == 1:
                break

    return loop


WAYS = {
    "shoal run job.conf": (_shoal_run, _first_exchange_step),
    "shoal.fit": (_fit, _first_exchange_step),
    "shoal.session(), two steps": (_session, lambda module, function: False),
}


def page_text(way: str, order: list[str], up: list[str]) -> str:
    """The page's block for `way`: its modules, a line per package in order of first call, and its calls up."""
    lines, package = [], None
    for module in order:
        top = module.split("/")[0] if "/" in module else "shoal"
        if top != package:
            lines.append(f"{top}: ")
            package = top
        lines[-1] += ("" if lines[-1].endswith(": ") else " ") + module
    calls = sorted(set(up), key=up.index)
    lines += ["calls back up the layers:"] + [f"  {c}{f' (x{up.count(c)})' if up.count(c) > 1 else ''}" for c in calls]
    return f"```text\npath of one step: {way} ({len(order)} files, {len(up)} calls back up the layers)\n" + "\n".join(lines) + "\n```"


def documented() -> dict[str, str]:
    return {m["way"]: m.group(0) for m in BLOCK.finditer(PAGE.read_text())}


def traced_blocks(ways) -> dict[str, str]:
    """Each way's block as the code runs it now, each traced in a process of its own (in one process a way traced
    after another would miss what the first left cached): one fresh interpreter imports this file (torch, shoal) once
    and forks a child per way, each child in the state a fresh interpreter is in after those imports."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, __file__, "--json", *ways], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return dict(zip(ways, json.loads(proc.stdout.strip().splitlines()[-1])))


def _traced_in_forks(ways) -> list[str]:
    """Each way's block, traced in a child forked from this process (nothing of shoal run yet), the children side by
    side."""
    import json
    import os
    import tempfile

    children = []
    for name in ways:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: trace, send the block, end without running the parent's exit handlers
            os.close(read)
            status = 1
            try:
                with tempfile.TemporaryDirectory() as folder:
                    os.chdir(folder)
                    make, stop = WAYS[name]
                    with os.fdopen(write, "w") as out:
                        out.write(json.dumps(page_text(name, *trace(make(Path(folder)), stop))))
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        children.append((pid, read))
    blocks = []
    for pid, read in children:
        with os.fdopen(read) as result:
            blocks.append(json.loads(result.read() or "null"))
        _, status = os.waitpid(pid, 0)
        assert status == 0, f"tracing {ways[len(blocks) - 1]} failed (wait status {status})"
    return blocks


def test_the_page_shows_the_path_of_one_step():
    page = documented()
    for way, block in traced_blocks(list(WAYS)).items():
        assert page.get(way) == block, f"docs/architecture.md's path of one step for {way} is not the code's: put this block there\n{block}"


if __name__ == "__main__":  # `python tests/test_architecture_path.py [WAY]`: the page's blocks as the code runs them now
    import json
    import os
    import tempfile

    if sys.argv[1:2] == ["--json"]:  # traced_blocks: the blocks of the ways named, as one JSON list
        print(json.dumps(_traced_in_forks(sys.argv[2:])))
        sys.exit(0)
    if not sys.argv[1:]:
        print("\n\n".join(traced_blocks(list(WAYS)).values()))
    for name in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as folder:
            os.chdir(folder)
            make, stop = WAYS[name]
            print(json.dumps(page_text(name, *trace(make(Path(folder)), stop))))
