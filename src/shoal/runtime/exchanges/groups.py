"""Asynchronous worker groups in one process: in-memory Hogwild / Downpour.

SINGA's rule: the workers of a group are synchronous, groups are asynchronous
to each other. With share_memory (the default) every group of a process reads
and writes one param store and one server: each group computes on its own data
(its own random_skip draw, or an evenly spaced start when random_skip is 0),
and its aggregated gradient is applied to the shared values as soon as it is
ready, without locks (Hogwild). The updater's slots (momentum, AdaGrad
history) live with the server, so they are shared too: one velocity for the
one set of params, where PyTorch's mnist_hogwild example keeps one optimizer,
and so one velocity, per process.

The step an LR schedule sees is the server's update count (SINGA's slice
version), so with G groups a schedule advances G times per round of steps; each
update also names the group and its own step, which a torch scheduler follows
under shoal.fit's scheduler_steps="group".

Staleness of an update = updates applied by other groups between the moment a
group read the params (start of its step) and the moment its own update lands.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from shoal.errors import ShoalError, warn
from shoal.neuralnet.algorithms import Grads
from shoal.report.metrics import MetricWindow
from shoal.neuralnet.params import ParamStore
from shoal.runtime.interfaces import TrainerHook
from shoal.runtime.exchanges.local import aggregate, clipped
from shoal.runtime.exchanges.server import Server
from shoal.runtime.exchanges.staleness import StalenessStats, histogram, may_apply

if TYPE_CHECKING:
    from shoal.runtime.trainer import History, Trainer

WAIT_SLICE_S = 0.5  # condition waits wake up this often, so a dead group never blocks the rest


class GroupsAborted(RuntimeError):
    """Raised in a group's thread when the job ends early (the chief group failed or was interrupted)."""


class GroupFailed(ShoalError, RuntimeError):
    """A worker group failed in a job that cannot go on without it (its strategy does not outlive a dead group): one
    line naming the group, its error and why the job stops."""


@dataclass
class GroupBoard:
    """What the groups of a job share besides params: steps done, liveness, samples, staleness.

    max_staleness ≥ 0 bounds how many steps a group may run ahead of the slowest
    live group (stale-synchronous parallel); max_update_lag ≥ 0 bounds the lag
    of every update (shoal.runtime.exchanges.staleness); warmup_steps lets group
    0 train alone first. Finished and dead groups never hold the others back.
    """

    ngroups: int
    max_staleness: int = -1
    warmup_steps: int = 0
    max_update_lag: int = -1
    steps: list[int] = field(init=False)
    running: list[bool] = field(init=False)
    samples: int = 0
    aborted: bool = False
    window: StalenessStats = field(default_factory=StalenessStats)
    by_group: dict[int, StalenessStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.steps = [0] * self.ngroups
        self.running = [True] * self.ngroups
        self._reads: dict[int, list[int]] = {}  # per group computing, the version it read (may_apply's shape), for max_update_lag
        self._cond = threading.Condition()

    def start_at(self, steps: list[int]) -> None:
        """Where each group starts: groups other than 0 join at the end of the warm-up (or where a resumed run stood)."""
        with self._cond:
            self.steps = [steps[0]] + [max(s, self.warmup_steps) for s in steps[1:]]

    def first_step(self, group: int) -> int:
        return self.steps[group]

    def _may_start(self, group: int, step: int) -> bool:
        if group != 0 and self.running[0] and self.steps[0] < self.warmup_steps:
            return False
        if self.max_staleness < 0:
            return True
        live = [s for s, r in zip(self.steps, self.running) if r]
        return not live or step - min(live) <= self.max_staleness

    def wait_turn(self, group: int, step: int) -> None:
        with self._cond:
            while not self.aborted and not self._may_start(group, step):
                self._cond.wait(WAIT_SLICE_S)

    def read(self, group: int, version: Callable[[], int]) -> None:
        """The group computes its next update on the params of `version()`, taken under the lock: a version taken
        before it could be several updates old by the time it counts, leaving a budget below what may_apply's
        safety assumes, and every group could then wait for the others for ever."""
        with self._cond:
            self._reads[group] = [version()]

    def apply(self, group: int, version: Callable[[], int], update: Callable[[], None]) -> int:
        """Run `update` (which bumps the server's `version()`) once max_update_lag allows it; return its lag."""
        with self._cond:  # held while updating when the lag is bounded: the check and the update are one
            while not self.aborted and not may_apply(group, version(), self._reads, self.max_update_lag):
                self._cond.wait(WAIT_SLICE_S)
            lag = version() - self._reads.pop(group, [version()])[0]
            if self.max_update_lag >= 0:
                update()
        if self.max_update_lag < 0:  # unbounded: Hogwild's lock-free update
            update()
        return lag

    def step_done(self, group: int, step: int, samples: int, lag: int) -> None:
        with self._cond:
            self.steps[group] = step + 1
            self.samples += samples
            self.window.add(lag)
            self.by_group.setdefault(group, StalenessStats()).add(lag)
            self._cond.notify_all()

    def stop(self, group: int) -> None:
        """The group finished or died: nobody waits for it any more."""
        with self._cond:
            self.running[group] = False
            self._reads.pop(group, None)
            self._cond.notify_all()

    def histogram(self) -> dict:
        with self._cond:
            return histogram(self.by_group)

    def abort(self) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()

    def take_window(self) -> dict[str, float]:
        """Samples trained by every group, and staleness, since the previous call."""
        with self._cond:
            values = {"samples": self.samples, "staleness": self.window.mean, "staleness_max": self.window.max}
            self.samples, self.window = 0, StalenessStats()
        return values


class GroupExchange:
    """One group's path to the server its process shares with the other groups (lock-free)."""
    job_bytes_sent: Optional[int] = None  # nothing crosses a wire: no bytes counted
    absent_groups: frozenset[int] = frozenset()  # every group stays in the job (only Local SGD's meetings leave one out)

    def __init__(self, server: Server, board: GroupBoard, group: int, replica: Optional[ParamStore] = None):
        """replica: the group's own copy of the params (share_memory: false), refreshed after each update."""
        self.server, self.board, self.group, self.replica = server, board, group, replica
        self.chief = group == 0
        self._restored: dict[str, dict[str, torch.Tensor]] = {}  # from a checkpoint: "server" / "replica" values
        self.hyper: Optional[Callable[[], torch.Tensor]] = None  # a user's loop (carry_hyper): what each push carries

    def carry_hyper(self, hyper: Callable[[], torch.Tensor]) -> None:
        """A user's loop (shoal.session): each push carries `hyper()`, this group's optimizer's hyper-parameters now (a
        float64 vector, as DownpourExchange's pushes over processes), which the server sets before the push's update."""
        self.hyper = hyper

    def begin(self, step: int) -> None:
        if self.board.aborted:
            raise GroupsAborted(f"worker group {self.group} stops: the job is ending")
        self.board.wait_turn(self.group, step)
        if self.replica is not None and self.group != 0 and step == self.board.warmup_steps > 0:
            # Downpour: a group starts from the values group 0's warm-up reached (as over processes, DownpourStub.begin)
            for name, value in self.server.store.values.items():
                self.replica.values[name].copy_(value)
        self.board.read(self.group, lambda: self.server.updates)

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        grads = clipped(aggregate(parts, target=self.server.store.device), self.server)  # the group's own gradient
        hyper = self.hyper() if self.hyper is not None else None
        lag = self.board.apply(self.group, lambda: self.server.updates,
                               lambda: self.server.update(self.server.updates, grads, group_step=(self.group, step), hyper=hyper))
        if self.replica is not None:  # Downpour: continue from the freshest params the server has
            for name, value in self.server.store.values.items():
                self.replica.values[name].copy_(value)
        self.board.step_done(self.group, step, sum(share for _, share in parts), lag)

    def view_updater(self):
        """With one shared store (Hogwild), a worker updates the views it computed alone in place,
        at the server's update count as every update of this server; with copies (Downpour), none."""
        if self.replica is not None:
            return None
        return lambda step, view, grad: self.server.update_view(self.server.updates, view, grad)

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """This group's losses; the chief adds the job's samples and staleness since its last display."""
        return window.averages() | self.board.take_window() if self.chief else window.averages()

    def updater_state(self):
        return self.server.state_dict()

    def load_updater_state(self, state) -> None:
        self.server.load_state(state)

    def finish(self) -> None:
        """Each update was applied in its step; the chief waits for the other groups with a hook (run_groups)."""

    def own_state(self) -> dict[str, torch.Tensor]:
        """What the chief's file does not hold: the chief adds the server's update count (the step an LR schedule
        sees) and, when groups have copies (Downpour), the server's values; any group its own copy."""
        tensors = {f"replica/{n}": v for n, v in self.replica.values.items()} if self.replica is not None and not self.chief else {}
        if self.chief:
            tensors["count/server_updates"] = torch.tensor(self.server.updates, device="cpu")
            if self.replica is not None:
                tensors |= {f"server/{n}": v for n, v in self.server.store.values.items()}
        return tensors

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for kind in ("server", "replica"):
            values = {k[len(kind) + 1:]: v for k, v in tensors.items() if k.startswith(kind + "/")}
            if values:
                self._restored[kind] = values
        if "count/server_updates" in tensors:
            self.server.updates = int(tensors["count/server_updates"])

    def start_from(self, values: ParamStore) -> None:
        """Before training: the server's values (set once, by the chief) and this group's copy are `values`
        (initial, loaded or resumed), or what the checkpoint holds of them."""
        for store, kind in ((self.server.store if self.chief else None, "server"), (self.replica, "replica")):
            if store is not None and store is not values:
                store.load(self._restored.get(kind) or values.state_dict(), strict=kind in self._restored)


class _WaitForGroups(TrainerHook):
    """The chief's final test and checkpoint come once every group has finished."""

    def __init__(self, board: GroupBoard, threads: list[threading.Thread]):
        self.board, self.threads = board, threads

    def before_final_test(self) -> None:
        self.board.stop(0)  # the chief is done training: never hold the others back
        for thread in self.threads:
            thread.join()


def run_groups(trainers: list["Trainer"], board: GroupBoard, metrics, log) -> "History":
    """Run every group's loop at once: group 0 (the chief) here, the others on threads.

    A group that fails is dropped with a warning naming it and the others go on,
    as SINGA's servers keep serving the groups that remain, where the strategy says
    the groups outlive a dead one (Hogwild, Downpour, Local SGD: its meetings go on
    without the group, which leaves them); where they cannot, the job stops with one
    line naming the group. The chief runs the final test once every group has finished.
    If the chief fails, the others stop.
    """
    failures: list[str] = []
    fatal: list[tuple[int, str]] = []  # a group the job cannot go on without, and its error
    strategy = trainers[0].plan.strategy

    def run_group(trainer) -> None:
        try:
            trainer.run(None)
        except GroupsAborted:
            pass
        except Exception as err:  # noqa: BLE001 - any failure of one group is reported: dropped, or the job stops
            if board.aborted:  # the job is ending (another group failed first): not this group's story
                return
            line = str(err).splitlines()[0] if str(err) else type(err).__name__
            failures.append(f"worker group {trainer.group}")
            if strategy.outlives_a_dead_group:
                warn(f"WARNING: worker group {trainer.group} died at step {board.steps[trainer.group]}: {line}; the other groups go on")
            else:
                fatal.append((trainer.group, line))
                board.abort()
        finally:
            board.stop(trainer.group)

    threads = [threading.Thread(target=run_group, args=(t,), name=f"shoal-group{t.group}", daemon=True) for t in trainers[1:]]
    chief = trainers[0]

    chief.add_hook(_WaitForGroups(board, threads))
    for thread in threads:
        thread.start()
    try:
        history = chief.run(metrics)
    except BaseException:
        board.abort()
        if fatal:  # the chief stopped because that group did: its line, not the broken meeting's
            group, line = fatal[0]
            why = strategy.why_a_dead_group_stops_the_job(chief.plan) or "the job cannot go on without it"
            raise GroupFailed(f"worker group {group} failed: {line}; {chief.plan.label} cannot go on without it: {why}") from None
        raise
    if fatal:  # the chief finished: the group failed after the last meeting it needed it for
        warn(f"WARNING: worker group {fatal[0][0]} failed after the groups' last meeting: {fatal[0][1]}")
    history.failed_groups = failures
    return history
