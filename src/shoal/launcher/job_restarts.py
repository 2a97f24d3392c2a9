"""Whole-job restarts: `shoal run JOB --max-restarts N`, when a process dies that the job cannot go on without.

Deaths a framework outlives never come here: a Downpour, Distributed Hogwild or Local SGD group other than 0 is
dropped or restarted into the running job (shoal.launcher.rejoin), and so is whatever else `ranks.expendable` and
the strategy's `outlives_a_dead_group` let the job lose, and a Downpour server process, restarted into the running
job and healed from the chief's mirror (`ranks.heals`). Everything else is the fallback for every framework: a
server process of a partitioned Sandblaster group (or of Downpour or Sandblaster once its restarts are spent), the chief (process 0) where nobody takes
its place (`ranks.chief_replaceable`),
any process of a framework with no quorum. The launcher has stopped the remaining processes (torch's process context: SIGTERM, then
SIGKILL; the job's store closed with its port), and the whole job starts again from its newest readable checkpoint,
as `--resume` would (from step 0 when none was written yet: the start is done over, its metrics kept aside as
`--resume`-less starts keep them). Each restart counts against N, as torchrun's elastic agent counts its restarts of
the workers, and says one line; when none is left the job fails with one line naming the death. Only a death with
no error of its own restarts (launch.ProcessLost: a signal, an exit, a stall, a lost connection): an error a
process raised (bad data, a full disk) would only happen again.

On one host (`shoal run`'s own processes). Over several hosts, or under torchrun/Slurm, their launchers restart the
job (torchrun --max-restarts with --resume=auto).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable, Optional

from shoal.errors import warn
from shoal.launcher.launch import ProcessFailed, ProcessLost
from shoal.launcher.ranks import describe_process
from shoal.launcher.workspace import newest_readable, prepare
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.planning.plan import JobPlan
from shoal.report.metrics import read_metrics
from shoal.report.summary import as_one_run, note_job_restarts, read_summary
from shoal.runtime.trainer import History

METRICS_FILE = "metrics.jsonl"


class JobRestarts:
    """The whole-job restarts of one `shoal run` (plan.max_restarts of them at most), and what they did to the run."""

    def __init__(self, plan: JobPlan, workspace: Path, log: Callable[[str], None] = print):
        self.plan, self.workspace, self.log = plan, Path(workspace), log
        self.limit = plan.max_restarts
        self.done: list[dict] = []
        self.metrics = self.workspace / METRICS_FILE
        self.run_start = self._metrics_size()  # this `shoal run`'s records begin here (a --resume appends)
        self.attempt_start = self.run_start  # and the current attempt's here
        self.started_from: Optional[dict] = None  # the resume record this `shoal run` started from (None: step 0)
        self.started: Optional[str] = None  # summary.json's `started` of the first start (each start writes its own)

    def _metrics_size(self) -> int:
        return self.metrics.stat().st_size if self.metrics.exists() else 0

    def _attempt_records(self) -> list[dict]:
        return read_metrics(self.metrics, self.attempt_start) if self.metrics.exists() else []

    def resume_point(self, lost: ProcessLost) -> Optional[Path]:
        """After `lost` ended the job's processes: the checkpoint the whole job starts again from (None: step 0),
        said in one line. Raises ProcessFailed, one line naming the death, when no restart is left."""
        records = self._attempt_records()
        if not self.done:
            self.started = (read_summary(self.workspace) or {}).get("started")
            if records and records[0].get("phase") == "resume":
                self.started_from = records[0]
        cause, about = self._cause(lost)
        trained = self._trained(lost, records)
        if len(self.done) >= self.limit:
            at = f" after step {trained}" if trained is not None and trained >= 0 and lost.rank is not None else ""
            line = (f"{cause}{at}{about}; no restarts left (--max-restarts {self.limit}, restarted "
                    f"{'once' if self.limit == 1 else f'{self.limit} times'}); see {self._logs(lost)}")
            self.finish(None, reason=line)
            raise ProcessFailed(line) from None
        for stale in ckpt_io.remove_stale_temporaries(self.workspace):
            self.log(f"Removed {stale}: a checkpoint the stopped processes did not finish writing")
        existing = ckpt_io.list_checkpoints(self.workspace)
        if existing:
            checkpoint: Optional[Path] = newest_readable(existing)
            from_step = next(step for step, path in existing if path == checkpoint)
            whence = f"from the checkpoint of step {from_step}"
        else:  # the first checkpoint was not written yet: the start is done over, as a new run
            checkpoint, from_step = None, 0
            prepare(self.workspace, False, self.log)  # metrics.jsonl -> metrics.jsonl.N: the next start's records alone
            self.run_start, self.started_from = 0, None
            whence = "from step 0 (no checkpoint was written yet)"
        trained = max(trained if trained is not None else from_step - 1, from_step - 1)  # the checkpoint was of step from_step
        self.done.append({"cause": cause, "after_step": trained, "from_step": from_step,
                          "checkpoint": checkpoint.name if checkpoint else None, "steps_redone": trained + 1 - from_step,
                          "time": round(time.time(), 3)})
        at = f" after step {trained}" if lost.rank is not None and trained >= 0 else ""
        warn(f"WARNING: {cause}{at}{about}; restarting the whole job {whence} (restart {len(self.done)} of {self.limit})")
        self.attempt_start = self._metrics_size()
        return checkpoint

    def _cause(self, lost: ProcessLost) -> tuple[str, str]:
        """(what happened, what it means for the job) in words for the lines."""
        if lost.rank is None:  # a stall or a lost connection: the launcher's line names it already
            return str(lost).split("; see ")[0], ""
        who = describe_process(self.plan, lost.rank)
        if lost.code is not None and lost.code < 0:
            try:
                how = f"died ({signal.Signals(-lost.code).name})"
            except ValueError:
                how = f"died (signal {-lost.code})"
        else:
            how = f"exited with code {lost.code}"
        return f"{who} {how}", f": the job cannot go on without it{lost.why}"

    def _logs(self, lost: ProcessLost) -> str:
        logs = self.workspace / "logs"
        return str(logs / f"rank{lost.rank}.log") if lost.rank is not None else str(logs)

    @staticmethod
    def _trained(lost: ProcessLost, records: list[dict]) -> Optional[int]:
        """The last step the chief is known to have trained before the job stopped: the one before the step its last
        heartbeat said it started, or its last record's (a display at step s follows training step s; a test at s
        comes before it), whichever is further; None when neither says. The death came after it: the steps re-done
        are at least the ones from the checkpoint to it."""
        said = [lost.step - 1] if lost.step is not None else []
        for r in records:
            if isinstance(r.get("step"), int) and r.get("mode") != "test-only":
                said.append(r["step"] if r.get("phase") == "train" else r["step"] - 1)
        return max(said) if said else None

    def finish(self, history: Optional[History], reason: Optional[str] = None) -> None:
        """The job ended (history: it finished; None: it failed, `reason` saying why): summary.json says how many
        whole-job restarts there were and the steps they re-did, and the History holds the run's records as one run."""
        if not self.done:
            return
        note_job_restarts(self.workspace, self.done, self.started_from, reason, self.started)
        if history is not None and self.metrics.exists():
            history.records = as_one_run(read_metrics(self.metrics, self.run_start))
