"""A dead worker group comes back: restarted by `shoal run`'s launcher (Downpour, Local SGD, Distributed Hogwild),
or by hand (Downpour), into the running job; so does a dead process of a synchronous group of replicas (AllReduce
under cluster.max_restarts), restarted by the launcher.

A process of AllReduce's replicas knocks and is admitted at the next step: after that step's update the chief
broadcasts it the params and the updater's state (runtime/exchanges/replicated.py, shoal.comm.quorum), and it trains
from the step after it. Its door is keyed by its rank (all its workers are group 0's).

A Local SGD / DiLoCo group's new process knocks and joins at the groups' next meeting, from the chief's group's
state (runtime/exchanges/periodic.py, shoal.comm.quorum). A Distributed Hogwild group's new process knocks at each
live group, takes the live values of the slices they master and its own slices as they last synced them, and goes
on from the step of its last sync (runtime/exchanges/hogwild.py). A Downpour server process is restarted too
(`ranks.heals`, counted against the same N per process): the launcher announces its restart at the door before the
new process starts, the stubs wait for it, and the chief heals it from its mirror (runtime/exchanges/downpour_mirror.py);
its heal is one line on the terminal and one record in rejoins.jsonl ("server", "group": null). The rest of this
text is Downpour's worker groups'.

The servers hold the live params, so a new process of the group needs nothing else: it connects
to the job's store (not to the world process group, which cannot take a new member), announces a
new incarnation of its group (shoal.comm.channels.Door), opens a channel to every server and
pulls the live values, their version and the steps its group has done; then it trains the steps
left. The servers keep every update they applied; a push in flight when the old process died is
lost whole.

- Automatic: `shoal run JOB --max-restarts N` (cluster.max_restarts; SHOAL_MAX_RESTARTS overrides) restarts a process that hosts
  only a Downpour group other than 0 (`ranks.expendable`) up to N times. The launcher announces
  the restart before the process starts, so the chief's last request waits for it; restarted
  processes fork from a server that imported shoal already (multiprocessing's forkserver), so a
  restart costs no Python start-up.
- By hand: `shoal run JOB --rejoin RANK` (with --workspace as the job's; --master HOST:PORT for the
  job's store when it is not in WORKSPACE/logs/store.json) starts one process in RANK's place. It
  needs the job's secret (shoal.comm.auth): SHOAL_JOB_SECRET or SHOAL_JOB_SECRET_FILE, else
  WORKSPACE/logs/job.secret, which the launcher writes (0600, as store.json) for a Downpour job.

Under torchrun or srun (`shoal run JOB --max-restarts N` as each rank's command) the process the launcher starts for
a rank that may rejoin is its supervisor (shoal.launcher.supervisor), which restarts the rank's training process
through this Restarter, as `shoal run`'s launcher does; the store is torchrun's agent's (or process 0's).

A Downpour group over several processes comes back whole: when one of its processes dies or stalls, `shoal run`'s
launcher (hosting all of them) ends the others, announces one new incarnation of the group and restarts every one of
its processes; they form the group's process group afresh on the job's store (shoal.comm.regroup), its stub pulls
the live values and gives them to the rest (DownpourExchange.rejoin). One line says it, naming the processes; each
process's restarts count against N once per death of the group. --rejoin (one process by hand) refuses such a group,
as does a rank's supervisor under torchrun or srun (it restarts its own rank only), and a user's loop's group over
several processes is not restarted (not tried). (Local SGD's and Distributed Hogwild's groups are one process each.)

Each rejoin is one line on the terminal and in the process's log, one JSON line in
WORKSPACE/logs/rejoins.jsonl, and, once the job ended, a `rejoins` list in summary.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from shoal.comm import auth, channels, heartbeat, quorum, succession
from shoal.comm import dist as comm
from shoal.comm.channels import DOWNPOUR_DOOR, MEETING_DOOR, STEP_DOOR
from shoal.errors import ShoalError, warn
from shoal.planning.plan import JobPlan
from shoal.launcher import faults, stalls
from shoal.launcher.ranks import chief_replaceable, describe_process, heals, rank_output, replicas_go_on, servers_heal_here
from shoal.launcher.workspace import check_workspace
from shoal.report.writes import own_folder, replace_file
from shoal.runtime.rejoined import RECORDS_FILE
from shoal.report.terminal import also_on_the_terminal, write_line

if TYPE_CHECKING:
    from shoal.launcher.launchers import LaunchedProcess

STORE_FILE = "store.json"  # WORKSPACE/logs/store.json: where the job's store is, for --rejoin


class RejoinRefused(ShoalError, ValueError):
    """--rejoin asked for a process that cannot come back (one line saying why)."""


def rejoins(plan: JobPlan) -> bool:
    """Whether a dead process of this job may be restarted into it (its strategy's groups rejoin, its replicas go on, or
    its servers heal)."""
    return workers_rejoin(plan) or servers_heal_here(plan)


def workers_rejoin(plan: JobPlan) -> bool:
    """Whether a dead worker process of this job may be restarted into it (not only its servers: a user's loop's
    Sandblaster restarts the whole job for a worker process where its worker processes are no replicas that go on,
    exchange_choice.loop_served_replicas)."""
    return plan.strategy.rejoins or replicas_go_on(plan)


def why_not(plan: JobPlan, rank: int, whole_group: bool = False) -> Optional[str]:
    """Why process `rank` cannot rejoin the running job (None: it can). `whole_group`: the caller restarts all the
    processes of `rank`'s worker group together (`shoal run`'s launcher hosting all of them), as a group over several
    processes needs (where its strategy `regroups`)."""
    if replicas_go_on(plan):
        if not 0 <= rank < plan.nprocs:
            return f"the job has processes 0..{plan.nprocs - 1}"
        if rank == 0 and not chief_replaceable(plan):
            return f"{describe_process(plan, rank)} is the chief, whose state the others heal from: resume from a checkpoint instead"
        return None
    if 0 <= rank < plan.nprocs and heals(plan, rank):  # a Downpour or Sandblaster server: restarted, healed from the mirror
        return None
    if not plan.strategy.rejoins:
        why = "its worker processes restart the whole job" if servers_heal_here(plan) else "its groups are threads of one process"
        return f"only Downpour, Local SGD and Distributed Hogwild worker groups can rejoin a running job ({plan.label} cannot: {why})"
    if not 0 <= rank < plan.nprocs:
        return f"the job has processes 0..{plan.nprocs - 1}"
    proc = plan.process(rank)
    groups = sorted({w.group for w in proc.workers})
    if not proc.workers or any(s.group not in groups for s in proc.servers):  # (Distributed Hogwild's are its group's own)
        return f"{describe_process(plan, rank)} is a server: the job cannot go on without it (resume from a checkpoint)"
    if 0 in groups and not chief_replaceable(plan):
        return f"{describe_process(plan, rank)} hosts worker group 0, the chief's: resume from a checkpoint instead"
    spread = [g for g in groups if len(plan.ranks_of_group(g)) > 1]
    regroups = plan.strategy.regroups and not plan.own_loop  # (a user's loop's group over processes: not tried)
    if spread and not (whole_group and regroups):
        ranks = ", ".join(map(str, plan.ranks_of_group(spread[0])))
        if not regroups:
            return f"worker group {spread[0]} spans processes {ranks}: only a group hosted by one process can rejoin"
        return (f"worker group {spread[0]} spans processes {ranks}: it comes back only when `shoal run`'s launcher, "
                "hosting all of them, restarts them together (--max-restarts N)")
    return None


def supervises(plan: JobPlan, launched: "LaunchedProcess") -> bool:
    """Whether this launched process (torchrun, srun, env://) runs its rank in a child it restarts into the running job
    (launcher/supervisor.py): restarts allowed, a strategy whose processes rejoin, a rank that may (the chief's where
    another process takes its place, its supervisor then hosting the store where torchrun's agent does not,
    `store_by_supervisor`)."""
    return (plan.nprocs > 1 and plan.max_restarts > 0 and rejoins(plan)
            and (launched.rank != 0 or chief_replaceable(plan)) and why_not(plan, launched.rank) is None)


def store_by_supervisor(plan: JobPlan, launched: "LaunchedProcess") -> bool:
    """Whether rank 0's supervisor hosts the world's store (every rank computes the same from the plan): under srun
    or env://, where no agent hosts it, when rank 0 is supervised, so that the store outlives rank 0's process."""
    return not launched.agent_store and supervises(plan, dataclasses.replace(launched, rank=0))


def group_of(plan: JobPlan, rank: int) -> int:
    return plan.process(rank).workers[0].group


def door_key(plan: JobPlan, rank: int) -> int:
    """What the door counts restarts of for process `rank`: its worker group, or for a group of replicas its rank."""
    return rank if replicas_go_on(plan) else group_of(plan, rank)


def door_of(plan: JobPlan) -> str:
    """The store's door through which the launcher announces a group's restarts (and gives up on one) to the job."""
    if replicas_go_on(plan):
        return STEP_DOOR
    if plan.strategy.rejoin_door is not None:  # (Distributed Hogwild's)
        return plan.strategy.rejoin_door
    return MEETING_DOOR if plan.strategy.meets else DOWNPOUR_DOOR


def by_hand(plan: JobPlan) -> bool:
    """Whether `shoal run JOB --rejoin RANK` can bring a group back (Downpour; a Local SGD or Distributed Hogwild group
    comes back only when the launcher restarts it)."""
    return plan.strategy.rejoins and not plan.strategy.meets and plan.strategy.rejoin_door is None


# -- the launcher's side -----------------------------------------------------------------------------
class Restarter:
    """What `shoal run`'s launcher does when an expendable process of a Downpour, Local SGD or Distributed Hogwild job
    exits with an error."""

    def __init__(self, plan: JobPlan, meeting, spec, process_setup: Optional[Callable[[], None]], environment: dict[str, str],
                 restarts: bool = True, rank_main: Optional[Callable] = None, notes_store: bool = True,
                 ranks_here: Optional[list[int]] = None):
        """`environment`: the ranks' (holding the job's secret): restarted processes get it too. `restarts` False: a dead
        process is given up on, never restarted. `rank_main`: what a restarted process runs instead of run_process
        (shoal.session's user script, from the top: its session takes the chief's state, a live Local SGD group's at the
        next meeting, or Distributed Hogwild's live values, at run.batches()). `notes_store` False: no store.json for
        --rejoin by hand (a rank's supervisor under torchrun or srun, which may start before the workspace exists).
        `ranks_here`: the ranks of the context's processes, in order (`shoal run`'s launcher): a worker group whose
        processes are all among them is restarted whole (`_restart_group`); None: a rank's supervisor, which restarts
        only its own."""
        self.plan, self.meeting, self.spec, self.process_setup = plan, meeting, spec, process_setup
        self.rank_main = rank_main
        self.environment, self.secret = environment, auth.required_secret("the launcher", environment)
        self.limit = plan.max_restarts if rejoins(plan) and restarts else 0  # cluster.max_restarts, --max-restarts
        self.restarts: dict[int, int] = {}
        self.ranks_here = list(ranks_here or [])
        self._from_the_chief: dict[int, int] = {}  # restarted ranks told they heal from the chief: their incarnations
        self._nobody_left = False  # a worker process's death left no living one holding the job's state
        self.started = time.time()  # rejoins.jsonl may hold an earlier run's rejoins (a resumed workspace)
        self._door = self._store = self._server_door = None
        self._context = None
        if notes_store:
            self._note_store()
        if plan.max_restarts > 0 and not rejoins(plan):
            warn(f"WARNING: --max-restarts: only Downpour, Local SGD and Distributed Hogwild worker groups are restarted; "
                 f"{plan.label}'s are not")
        if rejoins(plan):  # the servers (the meetings' chief) hear from it which dead groups will not come back
            self._connect()
        if self.limit > 0:
            self._door.restarts_dead_groups()
            self._context = _forkserver()

    def _note_store(self) -> None:
        """Where the job's store is and its secret, for `shoal run JOB --rejoin RANK` (on this host; pass --master
        elsewhere): files only this user can read."""
        if not by_hand(self.plan):
            return
        logs = Path(self.spec.workspace) / "logs"
        own_folder(logs)  # a real folder of this user's, never a link: write_private writes inside it, following none
        auth.write_private(logs / auth.SECRET_FILE, auth.to_text(self.secret) + "\n")
        auth.write_private(logs / STORE_FILE, json.dumps({"host": self.meeting.store_host, "port": self.meeting.store_port,
                                                          "nnodes": self.meeting.nnodes, "interface": self.meeting.interface}) + "\n")

    def _connect(self) -> None:
        self._store = channels.job_store_client(self.meeting.store_host, self.meeting.store_port, self.secret,
                                                attempt=self.meeting.attempt, timeout_s=self.plan.comm_timeout_s)
        self._door = channels.Door(door_of(self.plan), self._store, self.secret)
        # a server's restarts are told at Downpour's door, where its stubs read them (Sandblaster's workers are replicas)
        self._server_door = (self._door if door_of(self.plan) == DOWNPOUR_DOOR
                             else channels.Door(DOWNPOUR_DOOR, self._store, self.secret))

    def chief_after_the_last_step(self, rank: int) -> bool:
        """Whether `rank` is the chief, never restarted, and its meetings are over: nobody takes its place after the
        loop (the run log it had to close, what its script does after the loop), so its death is one the job cannot
        lose, as before the chief became replaceable (`ranks.chief_replaceable`). Downpour's and Hogwild's: the process
        speaking for the job, past its last word or with nobody left to succeed it (`_speaker_nobody_replaces`)."""
        if self._store is None or not chief_replaceable(self.plan):
            return False
        if self.plan.strategy.chief_succeeded_by_a_group(self.plan):  # (Downpour, Hogwild: shoal.comm.succession)
            return self._speaker_nobody_replaces(rank)
        return rank == 0 and not self.restarts.get(0) and quorum.meetings_over(self._store)

    def _speaker_nobody_replaces(self, rank: int) -> bool:
        """Whether `rank`'s death is that of the process speaking for a Downpour or Distributed Hogwild job (the chief,
        or the one that took its place) that nobody can replace: it said its last word to the groups already, a user's
        loop's chief had not reached its first step, or no other worker process that started with the job is left (a
        restarted process never takes the chief's place)."""
        if rank != succession.speaker(self._store) or self.restarts.get(rank):
            return False
        if succession.chief_done(self._store):
            return True
        if rank == 0 and self.plan.own_loop and not succession.chief_started(self._store):
            return True  # (a loop's chief dead before its first step: the others' first values were to come from it)
        stubs = [r for r in range(self.plan.nprocs) if self.plan.is_group_stub(r)]  # (those that may take its place)
        return not [r for r in stubs if r != rank and not self.restarts.get(r)]

    def can_restart(self, rank: int) -> bool:
        """Whether process `rank` would be restarted now (restarts left, and it may rejoin)."""
        return (self.limit > 0 and why_not(self.plan, rank, self._whole_group_here(rank)) is None
                and self.restarts.get(rank, 0) < self.limit)

    def _whole_group_here(self, rank: int) -> bool:
        """Whether every process of `rank`'s worker group is this launcher's to end and restart."""
        proc = self.plan.process(rank)
        return bool(proc.workers) and set(self.plan.ranks_of_group(proc.workers[0].group)) <= set(self.ranks_here)

    def restart(self, context, index: int, rank: int, code: int, how: Optional[str] = None) -> bool:
        """Start a new process in dead process `rank`'s place (it replaces context.processes[index]); False: not restarted.
        `how`: how it ended, for the line (default: from its exit code)."""
        if heals(self.plan, rank):
            return self._restart_server(context, index, rank, code, how)
        if context.processes[index].exitcode is None:  # restarted already with the rest of its group (both stopped)
            return True
        if self.limit <= 0:
            if self._door is not None:  # a group that died before it connected holds no server waiting for it
                self._door.give_up(door_key(self.plan, rank), self._door.incarnation(door_key(self.plan, rank)))
            return False
        reason = why_not(self.plan, rank, self._whole_group_here(rank))
        done = self.restarts.get(rank, 0)
        if reason is None and self._store is not None and quorum.meetings_over(self._store):
            # (a user's loop restarted now would get no step: code after its loop would meet names never bound)
            self._door.give_up(door_key(self.plan, rank), self._door.incarnation(door_key(self.plan, rank)))
            warn(f"WARNING: {describe_process(self.plan, rank)} {how or _ended(code)} after the job's last step; not "
                 f"restarted: nothing is left to train (see {self.spec.workspace}/logs/rank{rank}.log)")
            return True  # reported
        group = door_key(self.plan, rank)
        replicas = replicas_go_on(self.plan)
        ended = how or (_ended(code) if replicas else f"exited with code {code}")
        if reason is not None or done >= self.limit:
            if self._door is not None:  # not restarted: the servers stop waiting for the group
                self._door.give_up(group, self._door.incarnation(group))
            why = reason or f"restarted {done} time(s) already (--max-restarts {self.limit})"
            others = "the other processes go on without it" if replicas else "the other worker groups go on"
            warn(f"WARNING: {describe_process(self.plan, rank)} {ended}; not restarted: {why}; "
                 f"{others} (see {self.spec.workspace}/logs/rank{rank}.log)")
            return True  # reported
        if not replicas and len(self.plan.ranks_of_group(group)) > 1:
            return self._restart_group(context, rank, how or _ended(code), group)
        detected_at = time.time()
        self.restarts[rank] = done + 1
        heartbeat.say_gone(self._store, rank)  # no stall warnings for a process the launcher saw die
        incarnation = self._door.next_incarnation(group)  # the servers wait for it from now on
        if replicas:  # (once the chief died, the lowest living process decides the steps and is the donor: quorum.py)
            decides = ("decides the steps and pushes to the servers now" if servers_heal_here(self.plan)  # (Sandblaster's)
                       else "decides the steps now")
            from_the_chief = rank != 0 and not self.restarts.get(0) and not self._chief_died(context)
            donor = "process 0's state" if from_the_chief else f"the state of the lowest living process, which {decides}"
            warn(f"WARNING: {describe_process(self.plan, rank)} {ended}; the other processes go on without it; restarting it "
                 f"(restart {done + 1} of {self.limit}); it rejoins at the next step, from {donor}{self._heal_elsewhere(rank)}")
            if from_the_chief:
                self._from_the_chief[rank] = incarnation
        else:
            source = "at the groups' next meeting, from a live group's state" if self.plan.strategy.meets else self.plan.strategy.rejoins_from
            succeeded = rank == 0 and done == 0 and self.plan.strategy.chief_succeeded_by_a_group(self.plan)  # (the chief's own death)
            others = "; the other worker groups go on, the lowest living one taking the chief's place" if succeeded else ""
            source = f"as an ordinary group, {source}" if succeeded else source
            warn(f"WARNING: {describe_process(self.plan, rank)} {ended}{others}; restarting it "
                 f"(restart {done + 1} of {self.limit}); it rejoins {source}")
        context.processes[index] = self._start(rank, incarnation, detected_at, done + 1)  # watched, stopped, joined
        return True

    def _restart_group(self, context, rank: int, ended: str, group: int) -> bool:
        """Process `rank` of worker group `group`, which spans several processes of this launcher's, died (`ended`
        says how): end the group's other processes still running, announce one new incarnation of the group and
        restart every one of its processes; they form their group afresh and rejoin from the live values. One line."""
        members = self.plan.ranks_of_group(group)
        done = max(self.restarts.get(r, 0) for r in members)
        detected_at = time.time()
        incarnation = self._door.next_incarnation(group)  # the servers wait for it from now on
        fates = []
        for member in members:
            process = context.processes[self.ranks_here.index(member)]
            if member != rank:
                if process.exitcode is None:
                    process.kill()  # (it would wait on its dead peer in the group's collectives until the comm timeout)
                    process.join()
                    fates.append(f"the launcher ended process {member} (SIGKILL)")
                else:
                    fates.append(f"process {member} {_ended(process.exitcode)} too")
            context.sentinels.pop(process.sentinel, None)  # torch's join must not fail the job for it
            heartbeat.say_gone(self._store, member)  # no stall warnings for processes the launcher ended or saw die
            self.restarts[member] = done + 1
        processes = ", ".join(map(str, members))
        chiefs = group == 0 and done == 0  # (the chief's group's first death: its place is taken by another group's stub)
        others = ("the other worker groups go on, the lowest living one's stub taking the chief's place" if chiefs
                  else "the other worker groups go on")
        how = "as an ordinary group " if chiefs else ""
        warn(f"WARNING: {describe_process(self.plan, rank)} {ended}; worker group {group} spans processes {processes}: "
             f"{', '.join(fates)}; {others}; restarting processes {processes} (restart {done + 1} of {self.limit}); they "
             f"form their group afresh and rejoin {how}{self.plan.strategy.rejoins_from}")
        for member in members:
            context.processes[self.ranks_here.index(member)] = self._start(member, incarnation, detected_at, done + 1)
        return True

    def _heal_elsewhere(self, rank: int) -> str:
        """The chief `rank` died after the lines of restarted processes said they heal from its state (two processes
        dead at once: the other's death seen first): those not admitted yet heal from its successor instead."""
        if rank != 0:
            return ""
        promised, self._from_the_chief = self._from_the_chief, {}
        pending = [r for r, incarnation in sorted(promised.items()) if not quorum.admitted(self._store, r, incarnation)]
        if not pending:
            return ""
        who = f"process {pending[0]}" if len(pending) == 1 else "processes " + ", ".join(map(str, pending))
        return f" (so {'does' if len(pending) == 1 else 'do'} {who}, restarted before it and not admitted yet)"

    def _restart_server(self, context, index: int, rank: int, code: int, how: Optional[str]) -> bool:
        """A Downpour server process died (or was stopped past the stall timeout and ended): announce its restart (its
        stubs wait for it instead of failing) and start it; it heals from the chief's mirror. False: no restart left
        (its stubs are told, and the job cannot go on: the caller ends it)."""
        server = self.plan.process(rank).servers[0].id
        done = self.restarts.get(rank, 0)
        if self.limit <= 0 or done >= self.limit:
            if self._door is not None:
                self._server_door.give_up_server(server, self._server_door.server_restart(server))
            return False
        detected_at = time.time()
        self.restarts[rank] = done + 1
        heartbeat.say_gone(self._store, rank)  # its stubs' watches wait for the new process, not for its silence
        restart = self._server_door.next_server_restart(server)
        mirror = ("the mirror of the process that takes the dead chief's place (none, where it has none yet)"
                  if self._chief_died(context) else "worker group 0's mirror of its state")
        warn(f"WARNING: {describe_process(self.plan, rank)} {how or _ended(code)}; restarting it (restart {done + 1} of "
             f"{self.limit}); it heals from {mirror}, the other processes wait for it")
        context.processes[index] = self._start(rank, restart, detected_at, done + 1)  # (shoal.session: its script serves)
        return True

    def _start(self, rank: int, incarnation: int, detected_at: float, restart: int):
        """Start process `rank` again, as its `incarnation` (its group's, or its server's restart), for its `restart`-th
        restart; the caller puts it in the context, watched, stopped and joined with the others from now on."""
        args = (rank, self.meeting, self.plan.job.SerializeToString(), str(self.spec.workspace),
                [str(d) for d in self.spec.base_dirs], self.process_setup, self.spec.initial_values, incarnation, detected_at,
                self.environment, self.rank_main)
        process = self._context.Process(target=_entry, args=args, name=f"shoal-rank{rank}-restart{restart}", daemon=False)
        process.start()
        return process

    def nobody_left_to_heal_from(self, context, rank: int) -> bool:
        """Whether process `rank`'s death leaves no living worker process that holds the job's state (one host: another
        host's processes are not seen here). A group of replicas, or Local SGD's groups, admit a restarted process only
        at a meeting a living member decides, and hand it a living member's state: with every other worker process dead
        too, or restarted and not admitted yet (every worker process died at once), a restart would knock for ever. The
        job cannot go on (the launcher restarts the whole job from its checkpoint, where restarts are left)."""
        if self._store is None or not (replicas_go_on(self.plan) or self.plan.strategy.meets):
            return False
        if len(context.processes) != self.plan.nprocs:
            return False
        for other, process in enumerate(context.processes):  # (one host: index i is rank i's)
            if other == rank or not self.plan.process(other).workers or process.exitcode is not None:
                continue
            if not self.restarts.get(other) or quorum.admitted(self._store, other, self._door.incarnation(door_key(self.plan, other))):
                return False
        self._nobody_left = True
        return True

    def why_nobody_is_left(self, rank: int) -> str:
        """What `nobody_left_to_heal_from` found, for the launcher's line on process `rank`'s death ("" if nothing): the
        line names whichever dead process torch's join reports first, one of those that died at once."""
        if not self._nobody_left:
            return ""
        others = [r for r in range(self.plan.nprocs) if r != rank and self.plan.process(r).workers]
        who = f"process {others[0]} died" if len(others) == 1 else f"processes {', '.join(map(str, others))} died"
        restarted = " and no restart was admitted back yet" if any(self.restarts.get(r) for r in others) else ""
        return f" ({who} too{restarted}: no living process holds the job's state)"

    def _chief_died(self, context) -> bool:
        """Whether the chief's process died, its place taken by another (shoal.comm.succession, or Sandblaster's worker
        processes' quorum: `ranks.chief_replaceable`): restarted already, or seen dead now (one host:
        context.processes[0] is rank 0's)."""
        if not chief_replaceable(self.plan):
            return False
        here = len(context.processes) == self.plan.nprocs
        return bool(self.restarts.get(0)) or (here and context.processes[0].exitcode not in (None, 0))

    def finish(self) -> None:
        """The job ended: its summary lists the rejoins (the chief closed it before)."""
        add_rejoins_to_summary(Path(self.spec.workspace), since=self.started)


def _ended(code: int) -> str:
    """`died (SIGKILL)`, or `exited with code 3`: how a process ended, from its exit code."""
    if code < 0:
        try:
            return f"died ({signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited with code {code}"


def _forkserver():
    """A multiprocessing context whose server imported this module (torch, shoal) once, now: restarts start in milliseconds."""
    from shoal.config.plugins import forkserver_context

    return forkserver_context([__name__])  # (started by launch already, unless it died: then without the working folder)


def add_rejoins_to_summary(workspace: Path, since: float) -> None:
    """summary.json's `rejoins`: this run's lines of logs/rejoins.jsonl (those written since `since`)."""
    records_path, summary_path = workspace / "logs" / RECORDS_FILE, workspace / "summary.json"
    if not records_path.exists() or not summary_path.exists():
        return
    records = [r for r in (json.loads(line) for line in records_path.read_text().splitlines() if line.strip()) if r["time"] >= since]
    if not records:
        return
    summary = json.loads(summary_path.read_text())
    summary["rejoins"] = records
    replace_file(summary_path, (json.dumps(summary, indent=1) + "\n").encode(), temp_name=summary_path.name + ".tmp")


def _entry(rank: int, meeting, job_bytes: bytes, workspace: str, base_dirs: list[str], process_setup, initial_values,
           incarnation: int, detected_at: Optional[float], environment: dict[str, str], rank_main=None) -> None:
    """A restarted process (forked from the forkserver): rank `rank` again, a client of the job's store only."""
    os.environ.clear()  # the launcher's environment now, not the forkserver's when it started
    os.environ.update(environment)

    with rank_output(Path(workspace), rank, restarted=True) as log_file:
        try:
            run_rejoined(job_bytes, meeting.nnodes, rank, meeting.store_host, meeting.store_port, meeting.interface,
                         Path(workspace), [Path(d) for d in base_dirs], incarnation, detected_at, write_line,
                         process_setup, initial_values, rank_main, attempt=meeting.attempt)
        except Exception:  # noqa: BLE001 (e.g. its server died meanwhile: the launcher's line tells the story)
            # into the rank's log, not the terminal (multiprocessing would print it there); the exit status is the same
            traceback.print_exc(file=log_file)
            log_file.flush()
            raise SystemExit(1) from None


def run_rejoined(job_bytes: bytes, nnodes: int, rank: int, store_host: str, store_port: int, interface: Optional[str],
                 workspace: Path, base_dirs: list[Path], incarnation: int, detected_at: Optional[float],
                 log: Callable[[str], None], process_setup=None, initial_values=None, rank_main=None,
                 attempt: Optional[int] = 0) -> None:
    """Run rank `rank` of a running job as incarnation `incarnation` of its group, to the group's last step (`rank_main`:
    shoal.session's script instead of run_process; `attempt`: the prefix of the world's keys in the store, Meeting's)."""
    from shoal.config.plugins import decode_job
    from shoal.planning.plan import plan_job
    from shoal.runtime.assemble import Rejoin, RunSpec, run_process
    from shoal.runtime.endings import JobOver, MeetingsOver
    from shoal.strategies.registry import REGISTRY

    if process_setup is not None:
        process_setup()
    plan = plan_job(decode_job(job_bytes), nnodes=nnodes, strategies=REGISTRY)
    channels.join_as_client(store_host, store_port, interface, auth.required_secret("a process rejoining a job"), plan.comm_timeout_s,
                            attempt=attempt)
    spec = RunSpec(workspace, base_dirs, None, log=log, progress=False, initial_values=initial_values,
                   rejoin=Rejoin(incarnation, detected_at), faults=faults.from_environment(incarnation))
    try:
        with stalls.watching(plan, rank, workspace):
            (rank_main or run_process)(plan, rank, spec)
    except (JobOver, MeetingsOver) as err:  # nothing left to train: not a failure
        log(str(err))
        also_on_the_terminal(str(err))  # (the launcher's line said it would rejoin: the job's terminal hears how it ended)
    stalls.exit_if_abandoned()


# -- by hand: shoal run JOB --rejoin RANK ----------------------------------------------------------------
def rejoin_by_hand(plan: JobPlan, workspace: Path, rank: int, master: Optional[str], base_dirs: list[Path],
                   log: Callable[[str], None] = write_line) -> None:
    """Start process `rank` of the running job `plan` again, in this process (refused in one line when it cannot)."""
    check_workspace(workspace)  # as every run: before its job.secret and store.json are read or its logs written
    reason = why_not(plan, rank)
    if reason is None and heals(plan, rank):
        reason = f"{describe_process(plan, rank)} is a server: it rejoins only when the launcher restarts it (shoal run --max-restarts N)"
    if reason is None and not by_hand(plan):
        what = "processes" if replicas_go_on(plan) else "worker groups"
        reason = f"{plan.label}'s {what} rejoin only when the launcher restarts them (shoal run --max-restarts N)"
    if reason is not None:
        raise RejoinRefused(f"--rejoin {rank}: {reason}")
    host, port, interface = _store_address(workspace, master)
    secret = _job_secret(workspace)
    group = group_of(plan, rank)
    try:  # a short probe, not the plan's comm_timeout_s: whether a running job answers there at all
        if not auth.holds_same_secret(channels.public_store_client(host, port, timeout_s=3), 0, secret):
            raise RejoinRefused(f"--rejoin {rank}: this process's job secret differs from the running job's at {host}:{port}")
        door = channels.Door(DOWNPOUR_DOOR, channels.job_store_client(host, port, secret, timeout_s=3), secret)
    except RejoinRefused:
        raise
    except (RuntimeError, ValueError, OSError) as err:
        raise RejoinRefused(f"--rejoin {rank}: no running job's store at {host}:{port}: {comm.describe_error(err)}") from None
    os.environ[auth.SECRET_VARIABLE] = auth.to_text(secret)  # this process's copy, as a restarted process gets it
    state = door.state(0, group)
    if door.closed(0) or state == "finished":
        raise RejoinRefused(f"--rejoin {rank}: worker group {group} has nothing left to do (the job or the group finished)")
    if state is None or state.startswith("serving"):
        raise RejoinRefused(f"--rejoin {rank}: worker group {group} is still running ({state or 'not connected yet'}); "
                            "only a group whose process died can rejoin")
    incarnation = door.next_incarnation(group)
    with rank_output(workspace, rank):
        write_line(f"process {rank} rejoins by hand as restart {incarnation} of worker group {group}")
        run_rejoined(plan.job.SerializeToString(), plan.nnodes, rank, host, port, interface, workspace, base_dirs,
                     incarnation, None, write_line if rank else log)


def _job_secret(workspace: Path) -> bytes:
    """SHOAL_JOB_SECRET or SHOAL_JOB_SECRET_FILE, else what the launcher wrote in WORKSPACE/logs/job.secret."""
    secret = auth.given_secret()
    if secret is not None:
        return secret
    path = workspace / "logs" / auth.SECRET_FILE
    if not path.exists():
        raise RejoinRefused(f"--rejoin: no job secret: {path} is missing; set {auth.SECRET_VARIABLE} or "
                            f"{auth.SECRET_FILE_VARIABLE} to the running job's")
    return auth.read_secret_file(path)


def _store_address(workspace: Path, master: Optional[str]) -> tuple[str, int, Optional[str]]:
    """--master HOST:PORT, else what the launcher wrote in WORKSPACE/logs/store.json."""
    if master:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise RejoinRefused(f"--master {master}: expected HOST:PORT")
        return host, int(port), None
    path = workspace / "logs" / STORE_FILE
    try:
        noted = json.loads(path.read_text())
        return str(noted["host"]), int(noted["port"]), noted.get("interface")
    except (OSError, ValueError, KeyError, TypeError):
        raise RejoinRefused(f"--rejoin: {path} does not say where the job's store is (is the job running there?); "
                            "pass --master HOST:PORT") from None
