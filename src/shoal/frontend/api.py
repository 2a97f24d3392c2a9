"""shoal's Python API; the CLI is a thin face over these functions."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from shoal.frontend import script
from shoal.config import job_pb2
from shoal.config.loader import job_from_dict, load_job as _load_file
from shoal.config.plugins import load_job_plugins
from shoal.config.validate import validate
from shoal.launcher.run_job import RunOptions, test_job, train_job
from shoal.runtime.trainer import History
from shoal.neuralnet.shapes import check_shapes

if TYPE_CHECKING:
    from shoal.neuralnet.params import ParamStore
    from shoal.planning.estimate import Hosts
    from shoal.planning.plan import JobPlan
    from shoal.launcher.launch import Nodes

JobLike = Union[str, Path, dict, job_pb2.JobProto]


# digests of jobs validated in this process: a job loaded, then handed to train(), is not validated twice
_VALIDATED: set[bytes] = set()


def _digest(job: job_pb2.JobProto) -> bytes:
    return hashlib.sha256(job.SerializeToString(deterministic=True)).digest()


def load_job(path: Union[str, Path], overrides: tuple[str, ...] | list[str] = (),
             plugins: Sequence[Union[str, Path]] = ()) -> job_pb2.JobProto:
    """Parse and validate a job.conf / job.yaml; raises JobError with file:line:col.

    plugins: plugin files to load, as `shoal.load_plugins` does, but after the .proto plugins the job
    names (a .py module imports their `_pb2`). A job file itself may name only .proto plugins, or .py
    ones the user loaded: these, or earlier ones.
    """
    job = _load_file(path, list(overrides), shape_check=check_shapes, plugins=plugins)
    _VALIDATED.add(_digest(job))
    return job


def as_job(job: JobLike) -> tuple[job_pb2.JobProto, list[Path]]:
    """(validated JobProto, folders relative paths resolve against) from any accepted job form.

    Under `shoal run script.py`, the command line's --set overrides apply (shoal.frontend.script).
    """
    if isinstance(job, (str, Path)):
        proto = load_job(job, script.overrides())
    elif isinstance(job, dict):
        proto = job_from_dict(job, shape_check=check_shapes, overrides=script.overrides())
    elif isinstance(job, job_pb2.JobProto):
        proto = script.applied(job)
        # a JobProto may have been read from a file too: its .py plugins must be loaded already (spawned processes load them)
        load_job_plugins(proto.plugin, [proto.job_dir] if proto.job_dir else [])
        if _digest(proto) not in _VALIDATED:
            validate(proto, None, shape_check=check_shapes)
            _VALIDATED.add(_digest(proto))
    else:
        raise TypeError(f"a job is a path, a dict or a JobProto, not {type(job).__name__}")
    return proto, base_dirs(proto)


def base_dirs(job: job_pb2.JobProto) -> list[Path]:
    """Relative paths resolve against the working directory (as SINGA), then the job file's folder."""
    return [Path.cwd()] + ([Path(job.job_dir)] if job.job_dir else [])


def train(
    job: JobLike,
    workspace: Optional[Union[str, Path]] = None,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: Optional[bool] = False,
    tensorboard: Optional[bool] = None,
    *,
    nodes: Optional["Nodes"] = None,
    job_file: Optional[str] = None,
    process_setup: Optional[Callable[[], None]] = None,
    initial_values: Optional[Callable[["ParamStore"], None]] = None,
    plan: Optional["JobPlan"] = None,
    rank_main: Optional[Callable] = None,
) -> History:
    """Train a job as its cluster section says; returns every metrics record.

    The one way into training: `shoal run`, `shoal.fit` and scripts come through here.
    tensorboard=True also writes TensorBoard event files (None: as the job's `tensorboard` field says);
    progress=None draws a bar when stderr is a terminal; nodes: several hosts (shoal.launcher.launch.Nodes).
    shoal.fit passes process_setup (run first in every spawned process: registers its layer types; picklable)
    and initial_values (sets the params from the module's own values), and the plan it checked its optimizer
    against (used when it is this job's: the job is planned once), and over processes what each rank runs instead of
    the job file's rank (`rank_main`, picklable; fit's: its chief's lines to its log file, relayed to fit's log=).
    """
    proto, base_dirs = as_job(job)
    script.plan_instead(proto)  # `shoal plan script.py`: this job is planned, not trained
    if tensorboard is not None:
        proto.tensorboard = tensorboard
    workspace, resume = script.workspace(workspace), script.resume(resume)
    options = RunOptions(workspace=Path(workspace) if workspace else None, resume=resume, base_dirs=base_dirs, log=log,
                         progress=progress, nodes=nodes, process_setup=process_setup, initial_values=initial_values,
                         plan=plan, rank_main=rank_main)
    return train_job(proto, options, job_file=job_file or (str(job) if isinstance(job, (str, Path)) else "<python>"))


def evaluate(
    job: JobLike,
    checkpoint: Optional[Union[str, Path]] = None,
    workspace: Optional[Union[str, Path]] = None,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Test-only run: load `checkpoint` (else checkpoint_path, else the workspace's newest) and test."""
    proto, base_dirs = as_job(job)
    workspace = script.workspace(workspace)
    options = RunOptions(workspace=Path(workspace) if workspace else None, base_dirs=base_dirs, log=log, progress=False)
    return test_job(proto, options, Path(checkpoint) if checkpoint else None)


def plot_runs(
    runs: Sequence[Union[str, Path]],
    out: Union[str, Path],
    x: Sequence[str] = ("step", "time"),
    title: Optional[str] = None,
) -> Path:
    """Loss and accuracy of run workspaces against step and/or wall-clock time, drawn into `out`."""
    from shoal.report.plot import plot_runs as plot

    return plot(runs, out, x=x, title=title)


def draw_net(
    net: Union[JobLike, str, Path],
    out: Union[str, Path],
    title: Optional[str] = None,
) -> Path:
    """Draw a job's partitioned train net, or a node-link file (WORKSPACE/visualization/*.json), into `out`.

    One column per worker; .png, .svg or .pdf by `out`'s suffix. Returns `out`.
    """
    from shoal.report.net_draw import draw_graph
    from shoal.report.node_link import check_node_link, read_node_link
    from shoal.planning.plan import plan_job
    from shoal.runtime.visualization import train_net_graph
    from shoal.strategies.registry import REGISTRY

    if isinstance(net, (str, Path)) and Path(net).suffix == ".json":
        graph = read_node_link(Path(net))
    elif isinstance(net, dict) and "nodes" in net and "links" in net:
        check_node_link(net, "net")
        graph = net
    else:
        graph = train_net_graph(plan_job(as_job(net)[0], strategies=REGISTRY))
    return draw_graph(graph, Path(out), title=title)


def estimate(
    job: JobLike,
    *,
    compare: bool = False,
    suggest: bool = False,
    hosts: Optional["Hosts"] = None,
    workers: Optional[int] = None,
    recalibrate: bool = False,
    recommend: bool = False,
    out: Optional[Union[str, Path]] = None,
    log: Callable[[str], None] = lambda line: None,
) -> dict:
    """Predict before running (docs/planning.md): the job's step time, samples/s, bytes and memory per process.

    compare: every framework layout for `workers` workers (default: the job's group, else this host's cores,
    at least 2), ranked by predicted samples/s. suggest: partition_dim per layer for such a group.
    hosts (shoal.planning.estimate.Hosts): samples/s of each framework on 1..hosts.count hosts, drawn
    into `out` when given. recommend: the job's timeouts from its predicted step (docs/planning.md).
    The machine is calibrated once and cached (recalibrate: measure again).
    Returns what `shoal plan --estimate --json` prints.
    """
    import os
    from dataclasses import asdict

    from shoal.planning import alternatives
    from shoal.planning.estimate import estimate as predict, plan_kernels
    from shoal.planning.plan import plan_job
    from shoal.report.estimates import calibrated_line
    from shoal.runtime import calibrate
    from shoal.strategies.registry import REGISTRY  # (installed: the layouts compared below are planned with it too)

    proto, _ = as_job(job)
    plan = plan_job(proto, strategies=REGISTRY)
    used = {k.key for k in plan_kernels(plan)}  # the timings this answer's estimates read (every compared layout's too)
    calib = calibrate.calibration(plan_kernels(plan), recalibrate=recalibrate, log=log)

    def calibrated(kernels):
        used.update(k.key for k in kernels)
        return calibrate.calibration(kernels, log=log)

    def calibration_json(calib) -> dict:
        """The calibration with its age, the load now, and the one line `shoal plan` prints beside each estimate; of
        the cache's timings taken under contention, those this answer read (not another job's)."""
        age = calibrate.age_of(calib)
        data = calib.to_json() | {"kernels": len(calib.kernels), "load_now": round(os.getloadavg()[0], 2),
                                  "age_s": None if age is None else round(age.total_seconds()),
                                  "contended_kernels": [k for k in calib.contended_kernels if k in used]}
        return data | {"calibrated": calibrated_line(data)}

    count = workers or (proto.cluster.nworkers_per_group if proto.cluster.nworkers_per_group > 1 else max(2, calib.cores))
    predicted = predict(plan, calib)
    result = {"calibration": {}, "estimate": predicted.to_json()}  # the calibration last: with what the comparisons timed
    if recommend:
        from shoal.planning.module_costs import module_costs_of
        from shoal.planning.recommend import candidates, settings, timeouts

        result["recommend"] = {"label": predicted.label, "nprocs": plan.nprocs, "step_s": predicted.step_s,
                               "timeouts": [asdict(r) for r in timeouts(plan, predicted)]}
        far = hosts if hosts is not None and hosts.count > 1 else None  # one worker a host; else `count` on this one
        chosen = far.count if far else count
        est = candidates(proto, calibrated, chosen, far)
        link = (f"{far.count} hosts joined by {far.link_gbps * 8 or calib.link_gbps * 8:g} Gbit/s, "
                f"{(far.latency_s or calib.link_latency_s) * 1e6:g} µs links" if far else
                f"this host (loopback {calib.link_gbps * 8:.3g} Gbit/s, {calib.link_latency_s * 1e6:.0f} µs)")
        result["recommend"] |= {"workers": chosen, "links": link, "settings": [asdict(s) for s in settings(
            est, chosen, module=module_costs_of(plan.partition) is not None, job=predicted, overlap_push=proto.cluster.overlap_push)]}
    if compare:
        result["compare"] = [
            {"layout": r.layout.name, "about": r.layout.about, "cluster": r.layout.cluster, "refused": r.refused,
             "estimate": r.estimate.to_json() if r.estimate else None}
            for r in alternatives.compare(proto, calibrated, count)
        ]
    if suggest:
        s = alternatives.suggest(proto, calibrated, count)
        result["suggest"] = {"workers": count, "partition_dim": s.dims, "tried": s.tried,
                             "best": {"step_s": s.best.step_s, "samples_per_s": s.best.samples_per_s, "bytes": s.bytes_best},
                             "batch_split": {"step_s": s.batch_split.step_s, "samples_per_s": s.batch_split.samples_per_s, "bytes": s.bytes_batch}}
    if hosts is not None:
        points = alternatives.scaling(proto, calibrate.calibration(log=log), hosts)
        result["scaling"] = {"hosts": asdict(hosts), "points": [asdict(p) for p in points],
                             "stops": {k: {"hosts": h, "bottleneck": b, "stopped": stopped}
                                       for k, (h, b, stopped) in alternatives.stops_scaling(points).items()}}
        if out:
            from shoal.report.estimates import plot_scaling

            plot_scaling(result["scaling"], Path(out), title=f"{proto.name}: predicted samples/s")
    result["calibration"] = calibration_json(calibrate.calibration(log=log))
    return result


def compare_runs(runs: Sequence[Union[str, Path]], targets: Sequence[str] = ()) -> list[dict]:
    """One dict per run workspace: layout, samples/s, time to 90/95/97% test accuracy and to each target
    ("val_loss<=1.9", besides those the run declared), final validation metrics, final accuracy, staleness."""
    from shoal.report.compare import compare_runs as compare

    return compare(runs, targets=targets)
