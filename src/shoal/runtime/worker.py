"""Worker: SINGA's training loop for one worker.

Per step, in SINGA 0.3's order: validate → test → checkpoint → train one batch
→ display. Each of these fires when `freq > 0 and step >= after and
(step - after) % freq == 0`; training stops at `train_steps`, after which a
final checkpoint is written (and, unlike SINGA, a final test when testing is
configured, so every run ends with a test number).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from shoal import checkpoint as ckpt_io
from shoal.algorithms import train_one_batch
from shoal.config import job_pb2
from shoal.layers.base import Context
from shoal.metrics import MetricWindow, MetricsLog, display_line
from shoal.net import NeuralNet
from shoal.params import ParamStore
from shoal.runtime.feed import InputFeed, make_feeds
from shoal.runtime.server import Server


def fires(freq: int, after: int, step: int) -> bool:
    """SINGA's trigger rule for display, test, validation and checkpoints."""
    return freq > 0 and step >= after and (step - after) % freq == 0


@dataclass
class History:
    """What a run produced: every metrics record, plus where it lives."""

    workspace: Path
    records: list[dict] = field(default_factory=list)

    def phase(self, name: str) -> list[dict]:
        return [r for r in self.records if r["phase"] == name]

    @property
    def final_test(self) -> Optional[dict]:
        tests = self.phase("test")
        return tests[-1] if tests else None


class Worker:
    """Runs one worker's loop against a Server (the single-worker case of the runtime)."""

    def __init__(
        self,
        job: job_pb2.JobProto,
        workspace: Path,
        base_dirs: list[Path],
        device: torch.device,
        log: Callable[[str], None] = print,
        progress: Optional[bool] = None,
        train: bool = True,
    ):
        self.job = job
        self.workspace = Path(workspace)
        self.device = device
        self.log = log
        self.progress = sys.stderr.isatty() if progress is None else progress

        init_gen = torch.Generator().manual_seed(job.seed)
        self.store = ParamStore()
        self.nets: dict[int, NeuralNet] = {}
        if train:
            self.nets[job_pb2.kTrain] = NeuralNet(job.neuralnet, job_pb2.kTrain, self.store, init_gen)
        for phase, steps in ((job_pb2.kTest, job.test_steps), (job_pb2.kVal, job.validate_steps if train else 0)):
            if steps > 0:
                self.nets[phase] = NeuralNet(job.neuralnet, phase, self.store, init_gen)
        if device.type != "cpu":
            for name in self.store.values:
                self.store.values[name] = self.store.values[name].to(device)
            for net in self.nets.values():
                net.bind()

        data_rng = np.random.default_rng(job.seed)
        self.feeds: dict[int, dict[str, InputFeed]] = {
            phase: make_feeds(net, base_dirs, 0, 1, data_rng, device) for phase, net in self.nets.items()
        }
        self.generator = torch.Generator(device=device).manual_seed(job.seed + 1)
        self.server: Optional[Server] = None
        self.cursors: dict[int, int] = {job_pb2.kTest: 0, job_pb2.kVal: 0}
        self.window = MetricWindow()
        self.start_step = 0
        self.resumed = False
        self.elapsed_before = 0.0

    # -- state ------------------------------------------------------------
    def attach_server(self, server: Server) -> None:
        self.server = server

    def load_params(self, paths: list[Path]) -> int:
        """Initialise params by name from earlier checkpoints (SINGA's checkpoint_path); return the last one's step."""
        step = 0
        for path in paths:
            ckpt = ckpt_io.load(path)
            loaded = self.store.load(ckpt.params)
            self.log(f"Load from checkpoint file {path} ({len(loaded)} params)")
            step = ckpt.step
        return step

    def save_checkpoint(self, step: int) -> Path:
        trainer = {
            "job": self.job.name,
            "cursors": {str(k): v for k, v in self.cursors.items()},
            "skips": {str(phase): {n: f.skip for n, f in feeds.items()} for phase, feeds in self.feeds.items()},
            "window": self.window.state(),
            "elapsed": self.metrics.elapsed() if hasattr(self, "metrics") else self.elapsed_before,
        }
        ckpt = ckpt_io.Checkpoint(
            step=step,
            params=self.store.state_dict(),
            updater_state=self.server.state_dict() if self.server else {},
            rng={"worker": self.generator.get_state()},
            trainer=trainer,
        )
        return ckpt_io.save(ckpt_io.checkpoint_file(self.workspace, step), ckpt)

    def restore(self, path: Path) -> None:
        """Continue from a checkpoint exactly where the run that wrote it stood."""
        ckpt = ckpt_io.load(path)
        self.store.load(ckpt.params, strict=True)
        if self.server is not None:
            self.server.load_state(ckpt.updater_state)
        if "worker" in ckpt.rng:
            self.generator.set_state(ckpt.rng["worker"])
        t = ckpt.trainer
        self.cursors.update({int(k): int(v) for k, v in t.get("cursors", {}).items()})
        for phase, skips in t.get("skips", {}).items():
            for name, skip in skips.items():
                if name in self.feeds.get(int(phase), {}):
                    self.feeds[int(phase)][name].skip = int(skip)
        self.window.load_state(t.get("window", {}))
        self.start_step = ckpt.step
        self.resumed = True
        self.elapsed_before = float(t.get("elapsed", 0.0))
        self.log(f"Resume from checkpoint file {path} at step {ckpt.step}")

    # -- phases -----------------------------------------------------------
    def _context(self, phase: int, feeds: dict[str, InputFeed], cursor: int, window: MetricWindow) -> Context:
        return Context(
            phase=phase,
            generator=self.generator,
            feeds={name: feed.batch(cursor, self.device) for name, feed in feeds.items()},
            report=window.report,
            device=self.device,
        )

    def evaluate(self, phase: int, steps: int) -> dict[str, float]:
        """Run `steps` batches of the test or validation net; the store cursor moves on as SINGA's does."""
        net, feeds = self.nets[phase], self.feeds[phase]
        batch = max((f.global_batch for f in feeds.values()), default=0)
        window = MetricWindow()
        with torch.no_grad():
            for _ in range(steps):
                net.forward(self._context(phase, feeds, self.cursors[phase], window))
                self.cursors[phase] += batch
        return window.averages()

    def train_step(self, step: int) -> int:
        """Train one batch; return the number of samples it used."""
        feeds = self.feeds[job_pb2.kTrain]
        batch = max((f.global_batch for f in feeds.values()), default=0)
        ctx = self._context(job_pb2.kTrain, feeds, step * batch, self.window)
        grads = train_one_batch(self.job.train_one_batch, self.nets[job_pb2.kTrain], ctx)
        self.server.update(step, grads)
        return batch

    # -- the loop ---------------------------------------------------------
    def run(self, metrics: MetricsLog) -> History:
        job, history = self.job, History(self.workspace)
        self.metrics = metrics
        record = lambda step, phase, values, **kw: history.records.append(metrics.write(step, phase, values, **kw))

        def run_phase(step: int, phase: int, steps: int, label: str) -> None:
            values = self.evaluate(phase, steps)
            self.log(display_line(label, step, values))
            record(step, label.lower(), values)

        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=job.train_steps, initial=self.start_step, unit="step", dynamic_ncols=True, leave=False)
            self.log = lambda line, _print=self.log: bar.write(line)
        window_start, window_samples = time.perf_counter(), 0
        step = self.start_step
        while step < job.train_steps:
            resumed_here = self.resumed and step == self.start_step
            if not resumed_here:  # the checkpoint we resumed from was taken after these ran
                if job.validate_steps > 0 and fires(job.validate_freq, job.validate_after, step):
                    run_phase(step, job_pb2.kVal, job.validate_steps, "Validate")
                if job.test_steps > 0 and fires(job.test_freq, job.test_after, step):
                    run_phase(step, job_pb2.kTest, job.test_steps, "Test")
                if fires(job.checkpoint_freq, job.checkpoint_after, step):
                    self.save_checkpoint(step)
            window_samples += self.train_step(step)
            if fires(job.disp_freq, job.disp_after, step):
                now = time.perf_counter()
                values = self.window.averages()
                self.log(display_line("Train", step, values))
                record(step, "train", values, samples_per_sec=round(window_samples / max(now - window_start, 1e-9), 2))
                self.window.reset()
                window_start, window_samples = now, 0
            if bar is not None:
                bar.update(1)
            step += 1
        if bar is not None:
            bar.close()
        if self.resumed and self.start_step >= job.train_steps:
            return history  # resumed from the final checkpoint: nothing left to do
        if job.test_steps > 0 and job.test_freq > 0:
            run_phase(job.train_steps, job_pb2.kTest, job.test_steps, "Test")
        path = self.save_checkpoint(job.train_steps)
        self.log(f"Checkpoint written to {path}")
        return history

    def test_only(self, metrics: Optional[MetricsLog], step: int) -> dict[str, float]:
        values = self.evaluate(job_pb2.kTest, self.job.test_steps)
        self.log(display_line("Test", step, values))
        if metrics is not None:
            metrics.write(step, "test", values, mode="test-only")
        return values
