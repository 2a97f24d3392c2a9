"""What every framework strategy answers, and how the one that runs a layout is found. Pure.

A framework (SINGA's names for cluster layouts: AllReduce, Downpour, Local SGD, ...) is one
`Strategy` object, defined in one module of `shoal.strategies` and listed in
`shoal.strategies.registry.REGISTRY`. The planning side of a strategy (this base class) is pure:
recognising its layout, its refusals and notes for `shoal plan`, its labels. Its runtime side (building its
exchanges in the assembly, what it restores, whether its groups rejoin) is implemented in the same module;
planning only declares it. Its cost model (bytes, messages, time terms) is not a strategy's: it is
planning/framework_costs/<framework>.py's, found by the plan's Framework.

planning/ never imports the strategies (they import runtime/, which imports planning/), not even by
name: every planning function that needs them takes the registry as an argument, and where none is
given uses the installed one, which `shoal.strategies.registry` hands to `install()` when it is
imported (the launcher's and the front ends' callers of plan_job import it and pass it; issue 41).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Optional

from shoal.config import job_pb2
from shoal.errors import ShoalError

if TYPE_CHECKING:  # (JobPlan, in the annotations below, is planning/plan.py's, which imports this module)
    from shoal.planning.partition import PartitionPlan
    from shoal.planning.placement import Placement


class UnsupportedClusterError(ShoalError, ValueError):
    """A cluster layout this build of the runtime cannot run yet (said in one line)."""


class Framework(enum.Enum):
    """The names users see in `shoal plan` (the value is the display name); what each does is its Strategy's."""

    SINGLE_WORKER = "single worker"
    ALLREDUCE = "AllReduce"
    SANDBLASTER = "Sandblaster"
    IN_MEMORY_HOGWILD = "in-memory Hogwild"
    IN_MEMORY_DOWNPOUR = "in-memory Downpour"
    DOWNPOUR = "Downpour"
    DISTRIBUTED_HOGWILD = "Distributed Hogwild"
    LOCAL_SGD = "Local SGD"

    @property
    def strategy(self) -> "Strategy":
        return installed_registry()[self]

    @property
    def synchronous(self) -> bool:
        return self.strategy.synchronous

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Layout:
    """What recognising a framework looks at: the job, where its members are placed, how a group's net is cut."""

    job: job_pb2.JobProto
    placement: "Placement"
    parts: "PartitionPlan"

    @property
    def cluster(self) -> job_pb2.ClusterProto:
        return self.job.cluster

    @property
    def nprocs(self) -> int:
        return len(self.placement.processes)

    @property
    def asynchronous_groups(self) -> bool:
        """Several worker groups that do not meet in lockstep (no cluster.local_steps)."""
        return self.cluster.nworker_groups > 1 and self.cluster.local_steps <= 0


class Strategy:
    """One framework: everything specific to it. Subclasses live in shoal/strategies/, one module each."""

    framework: Framework
    synchronous = False  # every step applies every worker's gradient on fresh params (bit-exact with one worker)
    compressed: Optional[str] = None  # what cluster.compression encodes over processes (None: nothing moves)
    compensates_async_momentum = False  # outstanding updates add momentum: the servers' is lowered (plan.server_updater)
    meets = False  # groups meet every cluster.local_steps (Local SGD): outer updater, disjoint shards, complete parts
    overlaps_push = False  # cluster.overlap_push applies (a group computes its next step while its push is out)
    rejoins = False  # a dead worker group's process may be restarted into the running job (launcher/rejoin.py)
    # where a restarted group's process knocks when not at Downpour's servers or Local SGD's meetings (the store's door,
    # shoal.comm.channels.Door; such a group comes back only when the launcher restarts it), and what it rejoins from
    rejoin_door: Optional[str] = None
    rejoins_from = "from the servers' live params"
    # a worker group over several processes rejoins too: the launcher restarts all of them, and the new processes form
    # the group's process group afresh on the job's store (shoal.comm.regroup; launcher/rejoin.py's `why_not`)
    regroups = False
    # a worker group other than 0 may die or stall and the others train on (nothing of theirs waits for it): the
    # launcher and the heartbeat drop it instead of stopping the job, and only then say "the other groups go on"
    outlives_a_dead_group = False
    servers_hold_trainers = True  # a process of servers only builds a trainer (False: the server restores itself)
    bounds_update_lag = False  # cluster.max_update_lag applies: updates land late, by how many is bounded
    params_on_host = False  # over processes the params stay in host memory: request/response over gloo's point-to-point
    # each process's group updates its own replica and syncs values with the other groups' masters every
    # cluster.sync_freq steps (Distributed Hogwild): a user's loop runs it with its own optimizer as the local update
    syncs_with_peers = False
    # the steps a restarted group skipped are trained by every group past train_steps (Distributed Hogwild): its
    # exchange says where a group's loop ends (`steps_to_train`) and, on the chief, who trained them (`job_notes`)
    retrains_skipped_steps = False
    separate_servers = False  # a synchronous group's servers in processes of their own (Sandblaster)

    # -- planning (pure) ------------------------------------------------------------------------------
    def recognises(self, layout: Layout) -> bool:
        """Whether `layout` is this framework's (exactly one strategy of a registry says yes)."""
        raise NotImplementedError

    def refuse(self, layout: Layout) -> None:
        """Raise UnsupportedClusterError (one line) for what this framework cannot run of a layout it recognises."""

    def label(self, plan: "JobPlan") -> str:
        """The framework as users name this plan's layout."""
        return self.framework.value

    def compressed_in(self, plan: "JobPlan") -> Optional[str]:
        """What cluster.compression encodes over processes in `plan` (None: nothing moves)."""
        return self.compressed

    def notes(self, plan: "JobPlan") -> list[str]:
        """What `shoal plan` says of this framework's run (besides the common notes)."""
        return []

    def process_groups(self, placement: "Placement", devices, nnodes: int, partition: "PartitionPlan") -> tuple:
        """The named process groups its exchanges' collectives (and a partitioned group's bridges across processes)
        run over, for a layout of several processes (planning/process_groups.py: created on every rank in this
        order); none by default."""
        return ()

    def round_steps(self, cluster: job_pb2.ClusterProto) -> tuple[int, str]:
        """Steps between two meetings of the processes, and what such a meeting is called (the plan's round_steps: how
        far a trainer runs ahead of the chief between checkpoints; the meeting `shoal plan --recommend` times)."""
        return 1, "step"

    # -- runtime (implemented next to the planning side, in shoal/strategies/<framework>.py) -------------
    def attach_exchanges(self, run: Any) -> None:
        """Give each trainer of `run` (runtime.assemble.ProcessRun) its exchange (or make the process a server)."""
        raise NotImplementedError

    def shares_one_store(self) -> bool:
        """Whether the groups of one process compute on one copy of the params."""
        return False

    def loads_checkpoint_path(self, trainer: Any) -> bool:
        """Whether `trainer` takes job.checkpoint_path's values (False: it gets them otherwise, e.g. from the servers)."""
        return True

    def restore_server(self, run: Any, resumed: Any) -> None:
        """A server process (run.server) restores its part of checkpoint `resumed`."""

    def after_values(self, run: Any, spec: Any) -> None:
        """After initial values and a restored checkpoint: where each trainer starts, from what."""

    def staleness_histogram(self, run: Any) -> Optional[dict]:
        """How many updates landed at each lag (asynchronous frameworks; the chief's process, after the run)."""
        return None

    def why_a_dead_group_stops_the_job(self, plan: "JobPlan") -> Optional[str]:
        """Where the job has several worker groups but cannot outlive one (not `outlives_a_dead_group`): why it stops,
        a clause for the line that says so (None: nothing to add)."""
        return None

    def goes_on_without_a_process(self, plan: "JobPlan") -> bool:
        """Whether this plan's one synchronous group goes on without a dead or stalled process other than the chief's
        (each process a whole replica, every step's quorum decided by the chief: AllReduce under cluster.max_restarts);
        the launcher then drops or restarts such a process (launcher/ranks.py). Pure: the plan decides."""
        return False

    def chief_succeeded_by_a_group(self, plan: "JobPlan") -> bool:
        """Whether the chief's death drops its group like any other asynchronous group, the lowest living worker process
        taking the chief's duties (Downpour and Distributed Hogwild with one process per group, under cluster.max_restarts,
        in a job file or a user's loop: shoal.comm.succession; launcher/ranks.py's `chief_replaceable`). Pure: the plan
        decides."""
        return False

    def servers_heal(self, plan: "JobPlan") -> bool:
        """Whether a dead server process of this plan is restarted into the running job and heals from a mirror
        (Downpour under cluster.max_restarts; launcher/ranks.py's `heals`). Pure: the plan decides."""
        return False

    def groups_formed_afresh(self, plan: "JobPlan", rank: int, incarnation: int) -> dict:
        """A process restarted into the running job (no world): the process groups its exchanges need, by name, formed
        by its group's new incarnations (where `regroups`); none by default."""
        return {}

    def complete_rejoin(self, run: Any, incarnation: int) -> tuple[int, int, Any]:
        """A restarted process takes its group's live state: (step, version, digests). Only where `rejoins`."""
        raise NotImplementedError


Registry = Mapping[Framework, Strategy]

_installed: Optional[Registry] = None


class NoStrategiesError(ShoalError, RuntimeError):
    """Planning was asked for the installed strategies before any were installed."""


def install(registry: Registry) -> None:
    """Make `registry` the installed strategies: what plan_job (and Framework.strategy) use where no registry is
    passed. shoal.strategies.registry installs its REGISTRY when it is imported."""
    global _installed
    _installed = registry


def installed_registry() -> Registry:
    """The installed strategies (shoal.strategies.registry's REGISTRY once that is imported)."""
    if _installed is None:
        raise NoStrategiesError("no framework strategies installed: pass plan_job(..., strategies=REGISTRY) "
                                "(shoal.strategies.registry, which installs itself when imported)")
    return _installed


def make_registry(*strategies: Strategy) -> Registry:
    """A read-only registry, in the order given (one strategy per framework)."""
    table = {s.framework: s for s in strategies}
    if len(table) != len(strategies):
        raise ValueError("make_registry: two strategies for one framework")
    return MappingProxyType(table)


def recognise(layout: Layout, registry: Registry) -> Strategy:
    """The one strategy of `registry` whose layout this is, after its refusals."""
    claims = [s for s in registry.values() if s.recognises(layout)]
    if len(claims) != 1:  # a registry bug, not a user's: every layout is someone's, and one's only
        raise AssertionError(f"layout recognised by {[s.framework.value for s in claims]}: exactly one strategy must")
    claims[0].refuse(layout)
    return claims[0]
