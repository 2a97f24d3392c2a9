"""WORKSPACE/summary.json: what a run was (job, layout, devices) and what it reached.

The chief writes it when the run starts, rewrites it after every test (so a
crashed run still has one) and once more when the run ends; a launcher whose
processes were stopped by a signal says so (`mark_ended`). Every number in
it is derived from metrics.jsonl by `summarize`, which `shoal compare` also
uses on runs that never wrote a summary.
"""
from __future__ import annotations

import errno
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.report.metrics import higher_is_better, read_metrics
from shoal.report.targets import RunGoals, goals_of, run_goals, time_to_targets
from shoal.report.writes import WorkspaceWriteError, open_in_workspace, write_error, write_file

if TYPE_CHECKING:
    from shoal.planning.plan import JobPlan

SUMMARY_FILE = "summary.json"
THRESHOLDS = (0.90, 0.95, 0.97, 0.98, 0.99)


def threshold_key(threshold: float) -> str:
    return f"{threshold:.2f}"


@dataclass
class RunInfo:
    """What the run is, fixed at its start: the part of the summary not derived from metrics."""

    job: str
    framework: str  # the layout's framework as users name it (shoal.planning.plan.JobPlan.label)
    label: str  # framework and layout in a few words, for legends and tables
    cluster: dict
    processes: int
    workers: int
    servers: int
    devices: list[str]
    threads_per_worker: int
    train_steps: int
    host: dict = field(default_factory=dict)


def describe_layout(plan: "JobPlan") -> tuple[str, str]:
    """(framework, label): e.g. ("Sandblaster", "Sandblaster, 2 workers + 2 servers, 4 processes")."""
    nprocs = plan.nprocs
    framework = plan.label  # one process of several synchronous workers: in-memory Sandblaster
    if plan.nworkers == 1 and nprocs == 1:
        return framework, framework
    groups = plan.nworker_groups
    parts = [f"{groups} groups × {_count(plan.nworkers_per_group, 'worker')}" if groups > 1 else _count(plan.nworkers, "worker")]
    if plan.server_worker_separate:
        parts[0] += f" + {_count(plan.nservers, 'server')}"
    parts.append(f"{nprocs} process{'es' if nprocs > 1 else ''}" if nprocs > 1 else "threads")
    return framework, f"{framework}, {', '.join(parts)}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def run_info(plan: "JobPlan", devices: list[str]) -> RunInfo:
    import torch

    framework, label = describe_layout(plan)
    return RunInfo(
        job=plan.job.name,
        framework=framework,
        label=label,
        cluster=plan.layout_fields,
        processes=plan.nprocs,
        workers=plan.nworkers,
        servers=plan.nservers,
        devices=devices,
        threads_per_worker=plan.threads_per_worker,
        train_steps=plan.job.train_steps,
        host={"name": platform.node(), "machine": platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__},
    )


def clean_records(records: list[dict]) -> list[dict]:
    """Records as one run: a resumed run re-records the steps after its checkpoint, keep the latest.

    A `resume` record (written when a run resumes at step N) supersedes what the stopped run recorded
    after its checkpoint at N, even what the resumed run never reaches again: train records from step N
    on, tests and validations after N (those at N ran before the checkpoint, as SINGA orders a step).
    """
    latest: dict[tuple, dict] = {}
    for r in records:
        if "step" not in r or "phase" not in r:
            continue
        if r["phase"] == "resume":
            latest = {k: v for k, v in latest.items() if not superseded(v, r["step"])}
            continue
        latest[(r["phase"], r["step"], r.get("mode"))] = r
    return sorted(latest.values(), key=lambda r: (r["step"], r.get("time") or 0.0))


def superseded(record: dict, resumed_at: int) -> bool:
    """Whether a run that resumed at step `resumed_at` re-records what `record` (written before it) recorded: train
    records from that step on, tests and validations after it (those at it ran before the checkpoint)."""
    if record.get("mode") == "test-only" or not isinstance(record.get("step"), int):
        return False
    return record["step"] > resumed_at or (record["step"] == resumed_at and record.get("phase") == "train")


def as_one_run(records: list[dict]) -> list[dict]:
    """Records in the order they were written, without those a later resume record supersedes (an earlier resume
    record at or after its step too): a job restarted from its checkpoint (--max-restarts) read as one run."""
    kept: list[dict] = []
    for r in records:
        if r.get("phase") == "resume" and isinstance(r.get("step"), int):
            kept = [k for k in kept if not superseded(k, r["step"])
                    and not (k.get("phase") == "resume" and k["step"] >= r["step"])]
        kept.append(r)
    return kept


def _point(record: dict | None) -> dict | None:
    if record is None:
        return None
    keep = {k: v for k, v in record.items() if k not in ("phase", "mode") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return keep


def samples_per_sec(train: list[dict]) -> float | None:
    """Training throughput: samples over seconds of every display window but the first (warm-up)."""
    windows = [r for r in train if r.get("samples") and r.get("window_sec")]
    if len(windows) > 1:
        windows = windows[1:]
    if windows:
        return sum(r["samples"] for r in windows) / sum(r["window_sec"] for r in windows)
    rates = [r["samples_per_sec"] for r in train if r.get("samples_per_sec")]  # older metrics files
    return statistics.mean(rates) if rates else None


def steps_trained(records: list[dict]) -> int:
    """Steps trained by the last record: a display at step s follows training step s (s + 1 steps done),
    a test, validation or resume at step s comes before it (s steps done)."""
    return max((r["step"] + 1 if r["phase"] == "train" else r["step"] for r in records), default=0)


# keys of eval records that are not metrics (metrics.RECORD_KEYS)
NOT_METRICS = ("step", "time", "samples", "mode", "phase")


def eval_metrics(records: list[dict], phase: str, declared: dict | None = None) -> dict:
    """{metric: {"final", "best", "best_step", "higher_is_better"}} over the `phase` records (validate, test)."""
    rows = [r for r in records if r.get("phase") == phase and r.get("mode") != "test-only"]
    names = sorted({k for r in rows for k, v in r.items()
                    if k not in NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)})
    out = {}
    for name in names:
        scored = [r for r in rows if isinstance(r.get(name), (int, float))]
        higher = higher_is_better(name, declared)
        best = (max if higher else min)(scored, key=lambda r: r[name])  # the first of equals
        out[name] = {"final": scored[-1][name], "best": best[name], "best_step": best["step"], "higher_is_better": higher}
    return out


def summarize(records: list[dict], thresholds: tuple[float, ...] = THRESHOLDS, finished_at: int | None = None,
              elapsed: float | None = None, goals: RunGoals | None = None, targets: tuple = ()) -> dict:
    """The derived part of a summary: steps, wall time, throughput, final/best test, time to accuracy.

    finished_at: the job's train_steps when the run finished (its last steps need not have been displayed);
    elapsed: the run's wall time when it ended (after its last record). `latest_run` is the part since the
    last --resume (the whole run when it never resumed). goals: the run's declared metric directions and
    targets; `targets` more targets (shoal compare --target).
    """
    goals = goals or RunGoals()
    resumes = [r for r in records if r.get("phase") == "resume" and isinstance(r.get("step"), int)]
    records = clean_records(records)
    train = [r for r in records if r["phase"] == "train"]
    tests = [r for r in records if r["phase"] == "test" and r.get("mode") != "test-only"]
    scored = [r for r in tests if isinstance(r.get("accuracy"), (int, float))]
    if scored:
        # ties (a run at 100%) go to the lower loss
        best = max(scored, key=lambda r: (r["accuracy"], -(r.get("loss") if isinstance(r.get("loss"), (int, float)) else 0.0)))
    else:
        losses = [r for r in tests if isinstance(r.get("loss"), (int, float))]
        best = min(losses, key=lambda r: r["loss"]) if losses else None
    reached = {}
    for threshold in thresholds:
        first = next((r for r in scored if r["accuracy"] >= threshold), None)
        if first is not None:
            reached[threshold_key(threshold)] = {"step": first["step"], "time": first["time"]}
    staleness = [r["staleness"] for r in train if isinstance(r.get("staleness"), (int, float))]
    steps = max(steps_trained(records + resumes[-1:]), finished_at or 0)
    wall_time = max([r.get("time") or 0.0 for r in records] + [round(elapsed, 4) if elapsed is not None else 0.0])
    return {
        "steps": steps,
        "wall_time": wall_time,
        "samples_per_sec": samples_per_sec(train),
        "latest_run": latest_run(train, resumes[-1] if resumes else None, steps, wall_time),
        "final_train": _point(train[-1] if train else None),
        "final_test": _point(tests[-1] if tests else None),
        "best_test": _point(best),
        "time_to_accuracy": reached,
        "validate": eval_metrics(records, "validate", goals.higher_is_better),
        "test": eval_metrics(records, "test", goals.higher_is_better),
        "time_to_target": time_to_targets(records, tuple(goals.targets) + tuple(t for t in targets if t not in goals.targets)),
        "staleness_mean": statistics.mean(staleness) if staleness else None,
    }


def latest_run(train: list[dict], since: dict | None, steps: int, wall_time: float) -> dict:
    """summary.json's `latest_run`: the part of the run since `since` (the resume record it started from; None: step 0).
    `train`: the run's train records, as clean_records leaves them."""
    since = since or {"step": 0, "time": 0.0}
    latest_train = [r for r in train if r["step"] >= since["step"]]  # a resume drops the stopped run's records from its step
    return {"from_step": since["step"], "steps": steps - since["step"],
            "wall_time": round(max(wall_time - (since.get("time") or 0.0), 0.0), 4),
            "samples_per_sec": samples_per_sec(latest_train)}


def note_job_restarts(workspace: Path, restarts: list[dict], since: dict | None, reason: str | None = None,
                      started: str | None = None) -> None:
    """The launcher's word on the whole-job restarts of one `shoal run` (--max-restarts; shoal.launcher.job_restarts):
    summary.json's `job_restarts` (one entry each) and `steps_redone`, `latest_run` counted from where that `shoal
    run` started (`since`: its first resume record; None: step 0) rather than from its last restart, `started` as its
    first start wrote it, and `reason` where it ended failed. Best effort, after the chief closed the summary."""
    summary = read_summary(workspace)
    if summary is None or not restarts:
        return
    summary["job_restarts"] = restarts
    summary["steps_redone"] = sum(r.get("steps_redone") or 0 for r in restarts)
    metrics = Path(workspace) / "metrics.jsonl"
    train = [r for r in clean_records(read_metrics(metrics) if metrics.exists() else []) if r["phase"] == "train"]
    summary["latest_run"] = latest_run(train, since, summary.get("steps") or 0, summary.get("wall_time") or 0.0)
    if reason and summary.get("status") == "failed":
        summary["reason"] = reason
    if started:
        summary["started"] = started
    _write_if_possible(Path(workspace) / SUMMARY_FILE, summary)


def read_summary(workspace: Path) -> dict | None:
    """summary.json of a run folder, or None when it has none (or an unreadable one)."""
    try:
        return json.loads((Path(workspace) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None


class SummaryFile:
    """Keeps WORKSPACE/summary.json current: a MetricsLog observer on the chief."""

    def __init__(self, workspace: Path, info: RunInfo, metrics_path: Path, started: float | None = None):
        """`started`: when the run started (seconds since the epoch; None: now), for a run log another process
        continues (a dead chief's, report/succession.py)."""
        self.path = Path(workspace) / SUMMARY_FILE
        self.info = info
        self.metrics_path = Path(metrics_path)
        self.started = time.time() if started is None else started
        self.extra: dict = {}  # MetricsLog.annotate's fields
        self.write("running")

    def observe(self, record: dict) -> None:
        if record.get("phase") in ("test", "validate"):
            self.write("running")

    def annotate(self, fields: dict) -> None:
        self.extra.update(fields)

    def close(self, status: str, elapsed: float) -> None:
        if status == "finished":
            self.write(status, elapsed)
            return
        try:  # the run failed (perhaps for want of disk): say so where the disk still takes it
            self.write(status, elapsed, last_word=True)
        except WorkspaceWriteError:
            pass  # the error that ended the run is the one to report

    def write(self, status: str, elapsed: float | None = None, last_word: bool = False) -> None:
        # the whole metrics file, so a resumed run's summary covers every step (a few hundred lines)
        records = read_metrics(self.metrics_path) if self.metrics_path.exists() else []
        # a finished run trained all its steps, the last ones perhaps after its last display
        goals = run_goals()
        derived = summarize(records, finished_at=self.info.train_steps if status == "finished" else None, elapsed=elapsed,
                            goals=goals)
        declared = {"higher_is_better": goals.higher_is_better, "targets": [t.label for t in goals.targets]}
        summary = {"schema": 1, **asdict(self.info), "status": status, "goals": declared,
                   "started": _iso(self.started), "updated": _iso(time.time()), **derived, **self.extra}
        missed = missed_updates(self.extra.get("staleness_histogram"))
        if missed:
            summary["missed_updates"] = missed
        _write(self.path, summary, in_place_when_full=last_word)


def missed_updates(histogram: dict | None) -> dict[str, dict]:
    """summary.json's `missed_updates`: each worker group whose updates applied in this run fall short of the steps it
    was to train, {group: {"applied": N, "expected": M}}, from the staleness histogram's per-group counts (where the
    strategy gives each group's `expected`: Downpour, in-memory Hogwild)."""
    groups = (histogram or {}).get("groups") or {}
    return {g: {"applied": counts["updates"], "expected": counts["expected"]} for g, counts in groups.items()
            if isinstance(counts.get("expected"), int) and counts.get("updates", 0) < counts["expected"]}


def note_group_ends(workspace: Path, ends: dict[int, str]) -> None:
    """The launcher's word on the worker groups whose process ended early (died, dropped for a stall, restarted): its
    `why` beside each group of `missed_updates`, or, where the job counts no group's updates (Distributed Hogwild),
    an entry of its own. Best effort, after the chief closed the summary."""
    summary = read_summary(workspace)
    if not ends or summary is None:
        return
    missed = summary.setdefault("missed_updates", {})
    counted = bool((summary.get("staleness_histogram") or {}).get("groups"))
    rejoined: dict[str, list[int]] = {}  # the steps each restarted group rejoined at (summary.json's rejoins)
    skipped: dict[str, list[list[int]]] = {}  # Distributed Hogwild: the steps it skipped at each, [first, joined)
    for record in summary.get("rejoins") or []:
        rejoined.setdefault(str(record["group"]), []).append(record["step"])
        if record.get("skipped_steps") and record["skipped_steps"][1] > record["skipped_steps"][0]:
            skipped.setdefault(str(record["group"]), []).append(record["skipped_steps"])
    for group, why in sorted(ends.items()):
        if str(group) in missed or not counted:
            entry = missed.setdefault(str(group), {})
            entry["why"] = f"{why}; {entry['why']}" if entry.get("why") else why  # the chief's word (Local SGD's meetings) after it
            if not counted and str(group) in rejoined:  # Distributed Hogwild: no count of updates says it came back
                entry["rejoined_at"] = rejoined[str(group)]
    if skipped:  # as AllReduce's chief counts a process's (missed_steps): the steps whose rows a restarted group skipped
        summary["missed_steps"] = {group: {"missed": sum(stop - first for first, stop in spells), "of": summary.get("train_steps"),
                                           "why": "; ".join((f"skipped steps {first} to {stop - 1}" if stop - first > 1 else
                                                             f"skipped step {first}") + f", back at step {stop}"
                                                            for first, stop in spells)}
                                   for group, spells in sorted(skipped.items(), key=lambda item: int(item[0]))}
    if missed or skipped:
        _write_if_possible(Path(workspace) / SUMMARY_FILE, summary)


def restate_reason(workspace: Path, reason: str) -> None:
    """A failed run's reason said better by its chief's process once it knows more than its collective did (who
    stopped answering, a peer's own line, a connection that closed): replaces the reason the chief closed with."""
    summary = read_summary(workspace)
    if summary is None or summary.get("status") != "failed" or summary.get("reason") == reason:
        return
    summary["reason"] = reason
    _write_if_possible(Path(workspace) / SUMMARY_FILE, summary)


def mark_ended(workspace: Path, metrics_path: Path, status: str, reason: str | None = None, root_cause: bool = False) -> None:
    """Say how a run ended when its chief could not: a signal killed it mid-step, or another process died.

    Only a summary still saying `running` changes (a chief that closed its log knew
    better); its numbers are brought up to the last record of metrics.jsonl. Best
    effort: a workspace that can no longer be written keeps the summary it has.
    """
    path = Path(workspace) / SUMMARY_FILE
    summary = read_summary(workspace)
    if summary is None:
        return
    if summary.get("status") != "running":  # the chief closed its log: its status stands; the launcher adds why
        if reason and ("reason" not in summary or (root_cause and summary["reason"] != reason)):
            if "reason" in summary:
                summary["chief_reason"] = summary["reason"]  # what the first failure did to the chief
            summary["reason"] = reason
            _write_if_possible(path, summary)
        return
    records = read_metrics(metrics_path) if Path(metrics_path).exists() else []
    summary.update(summarize(records, goals=goals_of(summary)), status=status, updated=_iso(time.time()))
    if reason:
        summary["reason"] = reason
    _write_if_possible(path, summary)


def _write_if_possible(path: Path, summary: dict) -> None:
    try:
        _write(path, summary, in_place_when_full=True)
    except WorkspaceWriteError:
        pass


def _write(path: Path, summary: dict, in_place_when_full: bool = False) -> None:
    """A new summary.json, through a temp file: readers never see half a summary.

    in_place_when_full: the run's last word on a full disk (no room for a temp file): the old summary's own
    blocks take the new one when it fits in them, so a run that died of a full disk still says so.
    """
    data = (json.dumps(summary, indent=1) + "\n").encode()
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_file(tmp, data)  # through no link; the rename replaces a link at summary.json, never follows it
        os.replace(tmp, path)
    except (OSError, WorkspaceWriteError) as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(err, OSError) or err.errno is not None:  # the machine's refusal: named as summary.json's
            failure = write_error(path, err) if isinstance(err, OSError) else WorkspaceWriteError(path, err.cause, err.errno)
        else:  # a link or a special file at the temp's name: named as it is
            failure = err
        if not (in_place_when_full and failure.errno in (errno.ENOSPC, errno.EDQUOT) and _rewrite_in_place(path, data)):
            raise failure from None


def _rewrite_in_place(path: Path, data: bytes) -> bool:
    """Overwrite `path` with `data` when it fits in the blocks the file already holds (no new space needed);
    the old content is put back if the write fails anyway. True when written."""
    try:
        fd = open_in_workspace(path, os.O_RDWR)
    except WorkspaceWriteError:
        return False
    try:
        held = os.fstat(fd).st_blocks * 512
        if len(data) > held:
            return False
        old = os.pread(fd, held, 0)
        for content in (data, old):
            try:
                _pwrite_all(fd, content)
                os.ftruncate(fd, len(content))
                return content is data
            except OSError:
                continue
        return False
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes) -> None:
    view, offset = memoryview(data), 0
    while offset < len(data):
        offset += os.pwrite(fd, view[offset:], offset)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
