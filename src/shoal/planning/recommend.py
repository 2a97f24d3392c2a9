"""`shoal plan --recommend`: settings derived from the prediction, each with its one-line reason. Pure.

The timeouts of a job over processes (docs/planning.md, "Recommended timeouts"): how long a
collective waits for a peer and how long a silent heartbeat is tolerated, as a fixed multiple of
the predicted time between two meetings of the processes, never under a floor; the rendezvous's,
which the step does not bound. Each is a cluster field (`--set cluster.comm_timeout_s=…`).

The settings for W workers on the given links (docs/planning.md, "Recommended settings"): the
framework, Local SGD's H, the compression and max_update_lag, chosen by fixed rules from the
predicted samples/s and bytes of candidate layouts (`candidates`: real plans, estimated), their
accuracy side cited from measurements (planning/measured_tradeoffs.py), never assumed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.planning import measured_tradeoffs as measured
from shoal.planning.costs import Calibration, Kernel
from shoal.planning.estimate import Estimate, Hosts, estimate, plan_kernels
from shoal.planning.plan import TIMEOUT_OVERRIDES, Framework, JobPlan, plan_job

# the job's defaults (config/job.proto); tests/test_recommend.py checks that a default job's plan holds them and that
# the fallbacks of code that runs without a plan (shoal.comm.dist) agree
_CLUSTER = job_pb2.ClusterProto()
COMM_DEFAULT_S, STALL_DEFAULT_S, JOIN_DEFAULT_S = _CLUSTER.comm_timeout_s, _CLUSTER.stall_timeout_s, _CLUSTER.join_timeout_s
# a collective waits for its slowest peer's step: 20 of them leave room for skew, a test or a checkpoint
# between steps on one rank; below the default (validated under load 10 on 2 cores) it never goes
COMM_STEPS, COMM_FLOOR_S = 20, COMM_DEFAULT_S
# heartbeats come from their own thread four times per stall timeout whatever the step; a few steps of silence
# (a process paused by swapping, a long collection) is not yet a stall, nor is less than the floor
STALL_STEPS, STALL_FLOOR_S = 3, STALL_DEFAULT_S


@dataclass(frozen=True)
class Recommendation:
    setting: str  # the cluster field (`--set cluster.<field>=<value>`)
    value: float  # seconds
    default: float
    reason: str
    variable: str = ""  # the environment variable that overrides the field (planning/plan.py: TIMEOUT_OVERRIDES)


def interval(plan: JobPlan) -> tuple[int, str]:
    """Steps between two meetings of the processes, and what such a meeting is called."""
    return plan.strategy.round_steps(plan.job.cluster)


def timeouts(plan: JobPlan, e: Estimate) -> list[Recommendation]:
    """The stall, collective and rendezvous timeouts for `plan`, whose prediction is `e` (none for one process)."""
    if plan.nprocs == 1:
        return []
    steps, what = interval(plan)
    between = steps * e.step_s
    span = f"the predicted {what} ({_seconds(between)})"
    comm = max(COMM_FLOOR_S, _whole_seconds(COMM_STEPS * between))
    stall = max(STALL_FLOOR_S, _whole_seconds(STALL_STEPS * between))
    return [
        Recommendation("cluster.comm_timeout_s", comm, COMM_DEFAULT_S,
                       f"a collective waits for its slowest peer: {COMM_STEPS} × {span} = {_seconds(COMM_STEPS * between)}"
                       + (f", under the {COMM_FLOOR_S:g} s floor" if comm == COMM_FLOOR_S else ""), TIMEOUT_OVERRIDES["comm_timeout_s"]),
        Recommendation("cluster.stall_timeout_s", stall, STALL_DEFAULT_S,
                       f"heartbeats beat four times per stall timeout whatever the step; {STALL_STEPS} × {span} = "
                       f"{_seconds(STALL_STEPS * between)} of silence is a stall" + (f", under the {STALL_FLOOR_S:g} s floor" if stall == STALL_FLOOR_S else ""),
                       TIMEOUT_OVERRIDES["stall_timeout_s"]),
        Recommendation("cluster.join_timeout_s", JOIN_DEFAULT_S, JOIN_DEFAULT_S,
                       "the nodes meet before the first step, so the step does not bound it: the slowest host's start does (torchrun's default)",
                       TIMEOUT_OVERRIDES["join_timeout_s"]),
    ]


def _whole_seconds(s: float) -> int:
    """Up to the next second (from the tenth: 60.002 s is 60, not 61)."""
    return math.ceil(round(s, 1))


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.1 else f"{s * 1000:.3g} ms"


# -- settings ------------------------------------------------------------------------------------
# the exchange at most this share of synchronous training's step: its exactness is worth more than the rest
COMM_SHARE = 0.2
# another framework must predict this many times synchronous training's samples/s to be worth its drift or staleness
WORTH = 1.25
# the exchange at most this share of a step: nothing left worth compressing, and Local SGD's smallest such H is enough
SMALL_SHARE = 0.1
# a codec must predict this many times the uncompressed samples/s to be worth its loss
CODEC_GAIN = 1.1
CODECS = {"bf16": {"compression": job_pb2.kBF16}, "topk": {"compression": job_pb2.kTopK, "topk_fraction": 0.01}}
CLEARED = ("local_steps", "local_warmup_steps", "compression", "topk_fraction", "max_update_lag", "overlap_push")


@dataclass(frozen=True)
class Setting:
    setting: str  # "framework" or the cluster field
    value: str
    sets: tuple[str, ...]  # the --set arguments that give it
    samples_per_s: float  # predicted, with this setting
    bytes_per_sample: float  # sent between processes, per sample trained
    reason: str
    measured: tuple[str, ...] = ()  # the measurements the accuracy side rests on (measured_tradeoffs.Measured.cite)


def candidate_layouts(workers: int) -> dict[str, dict]:
    """The layouts a recommendation chooses from, for `workers` workers, one a process: synchronous, Local SGD at each
    measured H and Downpour, each without and with each codec."""
    bases = {"sync": {"nworkers_per_group": workers, "nservers_per_group": workers},
             **{f"local{h}": {"nworker_groups": workers, "local_steps": h} for h in measured.MEASURED_H},
             "downpour": {"nworker_groups": workers, "server_worker_separate": True}}
    out = {}
    for key, fields in bases.items():
        out[key] = fields | {"nworkers_per_procs": 1}
        for codec, extra in CODECS.items():
            out[f"{key}+{codec}"] = out[key] | extra
    return out


def variant(job: job_pb2.JobProto, fields: dict) -> job_pb2.JobProto:
    from shoal.planning.alternatives import with_cluster

    out = with_cluster(job, {})
    for name in CLEARED:
        out.cluster.ClearField(name)
    if "local_steps" not in fields:
        out.cluster.ClearField("outer_updater")  # DiLoCo's outer updater is Local SGD's only
    for name, value in fields.items():
        setattr(out.cluster, name, value)
    return out


def candidates(job: job_pb2.JobProto, calibrated: Callable[[list[Kernel]], Calibration], workers: int,
               hosts: Optional[Hosts] = None) -> dict[str, Optional[Estimate]]:
    """Each candidate layout estimated for `workers` workers on this host, or one worker on each of `hosts`
    (None where the runtime would refuse it)."""
    cores = (hosts.cores or calibrated([]).cores) if hosts else None
    plans = {}
    for key, fields in candidate_layouts(workers).items():
        try:
            plans[key] = plan_job(variant(job, fields), cores=cores, nnodes=hosts.count if hosts else 1)
        except ShoalError:
            plans[key] = None
    calib = calibrated([k for plan in plans.values() if plan for k in plan_kernels(plan)])
    return {key: estimate(plan, calib, hosts) if plan else None for key, plan in plans.items()}


def bytes_per_sample(e: Estimate) -> float:
    """Bytes every process sends per sample trained (a Local SGD step trains every group's batch; Downpour's traffic
    is one group's step, as the estimate counts it)."""
    samples = e.global_batch * (e.ngroups if Framework(e.framework).strategy.meets else 1)
    return sum(p.sent for p in e.processes) / max(1, samples)


def exchange_share(e: Estimate) -> float:
    return e.phases.get("exchange", 0.0) / e.step_s if e.step_s > 0 else 0.0


def _setting(name: str, value: str, sets: tuple[str, ...], e: Optional[Estimate], reason: str, cited=()) -> Setting:
    return Setting(name, value, sets, e.samples_per_s if e else 0.0, bytes_per_sample(e) if e else 0.0, reason,
                   tuple(m.cite() for m in cited))


def settings(est: dict[str, Optional[Estimate]], workers: int, module: bool, job: Optional[Estimate] = None,
             overlap_push: bool = False) -> list[Setting]:
    """The framework, H, compression and max_update_lag for `workers` workers from the candidates' estimates (pure).

    module: the job trains an opaque torch module (shoal.fit), for which top-k was measured to cost loss.
    job: the job's own estimate; when it is asynchronous (Downpour, Hogwild), max_update_lag is for its groups.
    """
    h, h_line = _local_steps(est)
    framework, line = _framework(est, workers, h, module)
    return [line, h_line, _compression(est, framework, module), _lag(est, framework, workers, job, overlap_push)]


def _framework(est, workers: int, h: int, module: bool) -> tuple[str, Setting]:
    sync, local, downpour = est.get("sync"), est.get(f"local{h}"), est.get("downpour")
    sync_sets = (f"cluster.nworkers_per_group={workers}", f"cluster.nservers_per_group={workers}", "cluster.nworkers_per_procs=1")
    local_sets = (f"cluster.nworker_groups={workers}", f"cluster.local_steps={h}", "cluster.nworkers_per_procs=1")
    down_sets = (f"cluster.nworker_groups={workers}", "cluster.server_worker_separate=true", "cluster.nworkers_per_procs=1")
    if sync is None:
        return "sync", _setting("framework", "none", (), None, "synchronous training over processes is refused for this job; see `shoal plan --compare`")
    share = exchange_share(sync)
    if share <= COMM_SHARE:
        return "sync", _setting("framework", sync.label, sync_sets, sync,
                                f"the exchange is {share:.0%} of the predicted step, so synchronous training loses little to it "
                                f"and stays step for step one worker's", [measured.SYNC_EXACT_GPT])
    rivals = [(key, e) for key, e in ((f"local{h}", local), ("downpour", downpour)) if e and e.samples_per_s >= WORTH * sync.samples_per_s]
    if not rivals:
        return "sync", _setting("framework", sync.label, sync_sets, sync,
                                f"the exchange is {share:.0%} of the predicted step, but neither Local SGD (H={h}) nor Downpour "
                                f"predicts {WORTH:g}x its {sync.samples_per_s:.0f} samples/s; compress instead (below)", [measured.SYNC_EXACT_GPT])
    # Local SGD unless Downpour is worth its staleness over it too: fewer bytes, and measured as accurate as synchronous
    key, e = max(rivals, key=lambda r: r[1].samples_per_s * (WORTH if r[0] != "downpour" else 1))
    gain = f"{e.samples_per_s / sync.samples_per_s:.1f}x synchronous training's {sync.samples_per_s:.0f} samples/s, whose exchange is {share:.0%} of its step"
    if key == "downpour":
        return key, _setting("framework", e.label, down_sets, e, f"Downpour predicts {gain}; its updates are stale (max_update_lag, below)",
                             [measured.LAG_DOWNPOUR])
    unmeasured = "; not yet measured on a transformer" if module else ""
    return "local", _setting("framework", f"Local SGD / DiLoCo, {workers} groups meeting every {h} steps", local_sets, e,
                             f"Local SGD predicts {gain}; for DiLoCo add shoal.fit's outer_optimizer (Nesterov, lr 0.7, momentum 0.9)"
                             f"{unmeasured}", [measured.LOCAL_SGD_H50, measured.DILOCO_H50])


def _local_steps(est) -> tuple[int, Setting]:
    """The smallest measured H whose exchange is a small share of the step, else the largest measured."""
    tried = [(h, est.get(f"local{h}")) for h in sorted(measured.MEASURED_H)]
    tried = [(h, e) for h, e in tried if e is not None]
    if not tried:
        return max(measured.MEASURED_H), _setting("cluster.local_steps", "none", (), None, "Local SGD is refused for this job")
    h, e = next(((h, e) for h, e in tried if exchange_share(e) <= SMALL_SHARE), tried[-1])
    smaller = [f"H={k} spends {exchange_share(x):.0%}" for k, x in tried if k < h]
    reason = f"meeting every {h} steps, the exchange is {exchange_share(e):.0%} of Local SGD's predicted step"
    reason += f" ({', '.join(smaller)})" if smaller else ""
    reason += "; no larger H was measured here" if exchange_share(e) > SMALL_SHARE else ""
    return h, _setting("cluster.local_steps", f"{h} (for Local SGD / DiLoCo)", (f"cluster.local_steps={h}",), e, reason,
                       [measured.LOCAL_SGD_H10, measured.LOCAL_SGD_H50])


def _compression(est, framework: str, module: bool) -> Setting:
    key = _chosen_local(est) if framework == "local" else framework  # the framework line's layout
    base = est.get(key)
    if base is None:
        return _setting("cluster.compression", "none", (), None, "its layout is refused for this job")
    share = exchange_share(base)
    if share <= SMALL_SHARE:
        return _setting("cluster.compression", "none", (), base,
                        f"the exchange is {share:.0%} of the predicted step: compressing it gains at most that")
    bf16, topk = est.get(f"{key}+bf16"), est.get(f"{key}+topk")
    cited_topk = {"sync": measured.TOPK_ALLREDUCE_MLP, "downpour": measured.TOPK_DOWNPOUR_MLP}.get(key, measured.LOCAL_SGD_H10)
    if module:
        topk = None  # the one transformer measured lost 22 % validation loss with it
    if topk is not None and topk.samples_per_s >= CODEC_GAIN * max(base.samples_per_s, bf16.samples_per_s if bf16 else 0):
        return _setting("cluster.compression", "top-k 1 % with error feedback", ("cluster.compression=kTopK", "cluster.topk_fraction=0.01"),
                        topk, f"the exchange is {share:.0%} of the step; top-k predicts {topk.samples_per_s / base.samples_per_s:.1f}x "
                        f"the uncompressed samples/s", [cited_topk])
    why_not_topk = "; not top-k: the one transformer measured lost loss with it" if module else ""
    if bf16 is not None and bf16.samples_per_s >= CODEC_GAIN * base.samples_per_s:
        return _setting("cluster.compression", "bf16", ("cluster.compression=kBF16",), bf16,
                        f"the exchange is {share:.0%} of the step; bf16 halves its bytes and predicts "
                        f"{bf16.samples_per_s / base.samples_per_s:.1f}x the uncompressed samples/s{why_not_topk}",
                        [measured.BF16_ALLREDUCE_MLP] + ([measured.TOPK_ALLREDUCE_GPT] if module else []))
    return _setting("cluster.compression", "none", (), base,
                    f"the exchange is {share:.0%} of the step, but no codec predicts {CODEC_GAIN:g}x the samples/s{why_not_topk}",
                    [measured.TOPK_ALLREDUCE_GPT] if module else [])


def _chosen_local(est) -> str:
    h, _ = _local_steps(est)
    return f"local{h}"


def _lag(est, framework: str, workers: int, job: Optional[Estimate], overlap_push: bool) -> Setting:
    """The least bound the groups allow (nworker_groups − 1, 2·nworker_groups − 1 with overlap_push) plus one, as measured."""
    if job is not None and Framework(job.framework).strategy.bounds_update_lag and job.ngroups > 1:
        groups, e = job.ngroups, job
    elif framework == "downpour":
        groups, e = workers, est.get("downpour")
    else:
        groups, e = 0, None
    if not groups:
        return _setting("cluster.max_update_lag", "none (-1)", (), None,
                        "the recommended framework applies no stale updates (Local SGD's groups meet in lockstep)"
                        if framework == "local" else "the recommended framework applies no stale updates")
    least = 2 * groups - 1 if overlap_push else groups - 1
    return _setting("cluster.max_update_lag", str(least + 1), (f"cluster.max_update_lag={least + 1}",), e,
                    f"{groups} asynchronous groups allow no less than {least}; one more lets a group up to twice as fast as "
                    f"the slowest go on without waiting", [measured.LAG_DOWNPOUR])
