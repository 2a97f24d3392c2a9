"""The written contracts between the trainer and what it drives.

A Trainer runs SINGA's loop for one worker group. Each step it asks its
GroupMembers (a Worker, or a PartitionedGroup presenting several workers as
one) for gradients, and hands them to its Exchange, which turns them into
updated params: in memory, through servers in other processes, or
asynchronously. A new framework is a new strategy (shoal.strategies) building
its Exchange (shoal.runtime.exchanges); the trainer does not change.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol

import torch

from shoal.neuralnet.algorithms import Grads

if TYPE_CHECKING:
    from shoal.report.metrics import MetricWindow
    from shoal.runtime.feed import InputFeed

# (step, view, gradient) -> None: the server's updater applied in place to a view of a param
ViewUpdater = Callable[[int, object, torch.Tensor], None]


# the job's counts in an exchange's checkpoint state (own_state): alike on every process of a group of replicas, so
# each process restores them from the chief's file, ready to count on if it takes the chief's place after a resume
JOB_COUNTS = frozenset({"count/job_bytes_sent", "count/meetings_bytes_sent"})


class Exchange(Protocol):
    """How one group's gradients become updated params (LocalExchange, SlicedExchange, GroupExchange,
    DownpourExchange, HogwildExchange).

    An exchange that holds state of its own (a group's copy, an anchor, residuals, last syncs) also has
    `own_state() -> dict[str, Tensor]` and `load_own_state(tensors)`: its trainer's part of every checkpoint. Under a strategy
    whose `retrains_skipped_steps` (Distributed Hogwild's: every group trains a share of the steps a restarted group
    skipped, past train_steps) it also has `steps_to_train(train_steps) -> int` (where this group's loop ends, asked
    once it reached the end it knew) and `job_notes` (a dict for summary.json: the steps skipped and who re-trained them).
    One attached with `may_take_over` (a group of replicas, whose quorum makes the lowest living process the decider
    when the chief dies) also has `chief` (whether this process decides now), `speak_for_the_job(log, annotate)` and
    `duties_taken_over` (what its successor does, for the line saying it took the chief's place)."""

    # the job's bytes to its last message, known after `finish` on the chief (summary.json's bytes_sent); None where
    # this exchange does not count them (in one process nothing crosses a wire)
    job_bytes_sent: Optional[int]
    # worker groups no longer in the job (a Local SGD group left out of the meetings): their checkpoint parts are optional
    absent_groups: frozenset[int]

    def begin(self, step: int) -> None:
        """Before the group computes step `step`: wait for its turn, ready the gradient hooks."""

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        """The group's (gradients, batch share) per worker of this process: update the params."""

    def view_updater(self) -> Optional[ViewUpdater]:
        """How a worker updates a param view it alone computes (in its own thread); None: all go through step."""

    def metrics(self, window: "MetricWindow") -> dict[str, float]:
        """The display values of this window (asynchronous exchanges add the job's samples and staleness)."""

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The updater's slots for a checkpoint (collective where servers are in other processes)."""

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        ...

    def finish(self) -> None:
        """After the last step, before the final test: wait for whatever else must end first."""


class GroupMember(Protocol):
    """What a trainer drives: one worker, or a partitioned group's workers presented as one."""

    index: int
    generator: torch.Generator
    feeds: dict[str, "InputFeed"]

    @property
    def share(self) -> int:
        """Rows of the group's batch this member's gradient is the mean over (its weight in the sum)."""

    def take_rows(self, offset: int, share: int) -> None:
        """Compute rows offset .. offset + share of each batch from now on (balanced shares)."""

    def compute(self, step: int, report: Callable[[str, float, int], None]) -> Grads:
        ...

    def stream_gradients(self, ready: Callable[[str, torch.Tensor], None]) -> bool:
        """Hand each param's gradient to `ready` as backward produces it; False if it cannot."""

    def use_view_updater(self, update_view: Optional[ViewUpdater]) -> None:
        """Views this member alone computes are updated with `update_view` where it computes them."""

    def placed_workers(self) -> list[tuple[int, str]]:
        """(worker id, device name) of every worker this member computes with."""

    def computed_nodes(self) -> Iterator[tuple[int, str, object]]:
        """(worker id, train_net.json node id, node) of every node this member computes."""


class TrainerHook:
    """Extras a trainer calls at named points (debug norms, heartbeats, fault injection, waiting for other
    groups): subclass and override what you need; the trainer calls every hook at every point."""

    def before_step(self, step: int) -> None:
        """Before the group computes step `step` (after validation, test and checkpoint)."""

    def after_step(self, step: int) -> None:
        """After step `step`'s update, before its display line."""

    def before_final_test(self) -> None:
        """After the last step and the exchange's finish, before the final test and checkpoint."""


class GroupDropped(Exception):
    """An asynchronous exchange found its group dropped by the servers (it stalled too long): the process leaves.

    Control flow, not a user's error: exchanges raise it and never exit; the launcher's process entry
    catches it and decides how the process ends (shoal.launcher.stalls.watching)."""


class ComputeDelay(Protocol):
    def extra_seconds(self, compute_seconds: float, samples: int) -> float:
        """Seconds a worker sleeps after computing `samples` rows in `compute_seconds`."""


class FaultInjection:
    """Faults a test or a benchmark injects, handed to the assembly as hooks (RunSpec.faults). This base
    injects none; shoal.launcher.faults reads the settings, and no other module does."""

    def process_hooks(self, rank: int) -> list[TrainerHook]:
        """For every trainer of process `rank` (it exits or hangs at a step)."""
        return []

    def group_hooks(self, group: int) -> list[TrainerHook]:
        """For the trainer of worker group `group` when the groups run in one process (it fails at a step)."""
        return []

    def compute_delay(self, worker: int, group: int) -> Optional[ComputeDelay]:
        """How much longer worker `worker` of group `group` computes (a slower device); None: as fast as it can."""
        return None

    def server_update_hook(self, rank: int) -> Optional[Callable[[int], None]]:
        """Called with the version after each update of process `rank`'s Downpour server."""
        return None


def summary_annotator(trainer) -> Callable[[dict], None]:
    """How an exchange adds fields to summary.json: through `trainer`'s run log (a Trainer's, or the session's member's
    in a user's loop), once it has one (a successor's, once it took a dead chief's place)."""
    def annotate(fields: dict) -> None:
        if trainer.metrics is not None:
            trainer.metrics.annotate(**fields)
    return annotate
