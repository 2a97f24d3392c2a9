"""ReplicatedExchange: one synchronous group over processes that goes on without a dead or stalled process
(AllReduce under cluster.max_restarts; issue 38, point 1).

Every process holds a whole replica: the params, and the updater's state for all of them. Each step, a process sums
its own workers' gradients weighted by their rows (Σ rows_w · g_w), and the processes all-reduce that sum, a
has-gradient flag per param and the rows, through the job's quorum (shoal.comm.quorum, `Quorum.meet(step, step, ...)`:
the chief decides after the all-reduce which members' sum counts, and a failed sum is summed again over the members
that remain, on a gloo group re-formed over them). Every replica then divides by the rows that came and applies the
job's updater to that same mean: the replicas stay equal without any values travelling.

A step without a member is the mean of the gradients of the members that came, each weighted by its rows: the batch
is not re-shared among the living. Re-sharing would mean computing the missing rows again after the fault was seen
(a second forward and backward behind the user's loop, docs/architecture.md "The step boundary"), and what each
survivor computed would then depend on when it saw the fault; as it is, which members came to which step decides
the result, so a run is deterministic for a given fault schedule. The lost member's rows of those steps are skipped:
every process's feed moves with the step (its rows are a pure function of the cursor), so a process that comes back
reads what it would have read.

A process the launcher restarts (cluster.max_restarts, shoal.launcher.rejoin) knocks; the chief admits it at the
next step's commit, and after that step's update the chief broadcasts it the params (every value, running statistics
too) and the updater's state over the new group; it trains on from the next step. Its workers' random generators
start from their seeds (this layout's nets draw nothing at random in training unless they use dropout: such a
process's dropout masks then differ from the dead one's).

Compressed (cluster.compression: bf16, fp16, top-k; runtime/exchanges/compression.py), each process encodes its
Σ rows_w · g_w with its own codec (top-k and the casts keep their error feedback: what was not sent is this process's
residual, added to its next step's sum), the processes all-gather the encodings, and every process decodes them and
sums them in rank order in float32: the same bytes in the same order, so every replica computes the same mean. Not an
all-reduce: top-k's members send different indices, which no reduction can add, and a bf16 all-reduce would round
every partial sum to bf16 in an order the backend picks. A member's residual moves on only when the chief commits a
step with its encoding in it (`encode_tentatively`): a step this member was left out of, or that failed, leaves its
residual as it was. The residual is the member's own error feedback, not model state: a restarted process starts it
at zero (as SparseLoCo's accumulators, docs/architecture.md "The step boundary", point 5), and a checkpoint holds each
process's own (`own_state`: the chief's file the chief's, each other process's part its own, in a user's loop too; a
process that resumes without its own, as one the last step went on without, starts at zero).

Two public phases, so that a user's own loop (shoal.session) can call them from an end-of-backward hook:
`mean_gradients(step, parts)` (the agreed mean), then the user's update, then `heal(step)`; `step(step, parts)` is
the three for the SINGA trainer, the job's updater doing the update.

The Train line's loss and accuracy are the group's, as the job path's sliced exchange gives them: every member's
window averaged, weighted by its rows. No collective carries them (one over the world could not go on without a
member): at a display each other member that came to the step tells the decider its window's sums and counts (one
signed store write, JSON, not waited for: `Quorum.tell`), and the decider hears each, or learns that it is gone
(`Quorum.hear`), and adds them in rank order after its own. Its samples count the rows of every member that came.
"""
from __future__ import annotations

import json
from typing import Callable, Optional

import torch

from shoal.comm import collectives
from shoal.comm import quorum as quorums
from shoal.comm.channels import STEP_DOOR
from shoal.neuralnet.algorithms import Grads
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import Updater
from shoal.report.metrics import MetricWindow
from shoal.runtime.exchanges.compression import Codec, encode_tentatively, wire_bytes
from shoal.runtime.exchanges.local import aggregate, clipped
from shoal.runtime.endings import MeetingsOver
from shoal.runtime.exchanges.server import Server
from shoal.runtime.rejoined import fingerprint
from shoal.runtime.interfaces import GroupDropped

DOOR = STEP_DOOR  # the launcher's word on dead and restarted processes (shoal.comm.channels.Door), keyed by rank
WINDOW = "window"  # the quorum's topic of a member's display window (Quorum.tell / hear)


class ReplicatedExchange:
    """One process's replica of a synchronous group whose processes each hold the whole params (see the module's text)."""

    absent_groups: frozenset[int] = frozenset()  # one group, always there: a missing process is a missing replica
    # restarted processes are admitted at the mean's meeting (a user's loop's Sandblaster admits them at its values'
    # meeting instead, which its loop's handover follows: runtime/exchanges/sandblaster_loop.py)
    admits_at_the_mean = True
    duties_taken_over = "it decides the steps, tests and validates, writes the run log and the checkpoints"

    def __init__(self, store: ParamStore, updater: Updater, quorum: quorums.Quorum, rank: int, global_batch: int,
                 first: Optional[collectives.Group] = None, log: Callable[[str], None] = print,
                 annotate: Optional[Callable[[dict], None]] = None, codecs: Optional[Callable[..., Codec]] = None):
        """`quorum`: this process's side of the steps' quorum (its first group the world's processes; a restarted
        process's has none: it knocks, `rejoin`); `first`: the world (None for a restarted process); `log`: the
        chief's lines (a step that went on without a process); `annotate`: the chief's summary.json; `codecs`:
        cluster.compression's codec factory (None: float32, one all-reduce)."""
        self.store, self.server, self.quorum, self.rank = store, Server(store, updater), quorum, rank
        self.names = self.server.names
        self.global_batch, self.first, self.log, self.annotate = global_batch, first, log, annotate
        self.joining = quorum.group is None
        self.present: tuple[int, ...] = quorum.all_ranks  # the processes whose gradients the last step's mean holds
        self._came: tuple[int, ...] = quorum.all_ranks  # those that came to the last step (present less this step's joiners)
        self._last_step = -1  # the last step met: a display's windows are told and heard under it
        # a successor decides the step it takes the chief's place at before its trainer hands it the job's log: the
        # lines it has to say meanwhile wait for it (`speak_for_the_job`), as Sandblaster's stub line does
        self._before_speaking: Optional[list[str]] = None if rank == quorum.chief_rank and not self.joining else []
        # the job's bytes (summary.json's bytes_sent), counted alike on every replica: the member that takes a dead
        # chief's place (quorum.py, `replaceable`) has the count the chief had
        self.job_bytes_sent: Optional[int] = 0
        self._window_rows = 0  # rows of every member that came, since the last display
        self.sent_bytes = 0  # what this process sent since the last display (metrics' sent_bytes, as the sliced exchange's)
        self._held = 0  # steps of this run
        self._missed: dict[int, list[int]] = {}  # rank -> the steps of this run it missed
        self._back: dict[int, list[int]] = {}  # rank -> the steps it rejoined at
        self.codec: Optional[Codec] = codecs() if codecs is not None else None  # this process's encoder, its residual

    # -- a step --------------------------------------------------------------------------------------
    def meeting_of(self, step: int) -> int:
        """The quorum's meeting of step `step`'s mean: one a step (Sandblaster's exchange holds two, its servers'
        values the second: runtime/exchanges/sandblaster.py)."""
        return step

    def begin(self, step: int) -> None:
        """Nothing to prepare: the workers' gradients are summed after they all finished."""

    def step(self, step: int, parts: list[tuple[Grads, int]]) -> None:
        """The agreed mean, the job's updater applied to it (every replica alike), then the processes admitted at this
        step take the state."""
        self.server.update(step, clipped(self.mean_gradients(step, parts), self.server))
        self.heal(step)

    def mean_gradients(self, step: int, parts: list[tuple[Grads, int]]) -> Grads:
        """The mean gradient over the rows of every member that came to step `step` (the chief's word), on the store's
        device; a param nobody had a gradient for is None. Summed again over the survivors when a member is lost."""
        rows = sum(share for _, share in parts)
        values, device = self.store.values, self.store.device
        if rows and len(parts) == 1 and all(g is None or (g.dtype == torch.float32 and g.device == device) for g in parts[0][0].values()):
            local, scale = parts[0][0], float(rows)  # rows · g as one multiply over the flat (the same values)
        else:
            local, scale = (aggregate(parts, total=1, target=device) if rows else {}), 1.0  # Σ rows_w · g_w
        flags = [0.0 if local.get(name) is None else 1.0 for name in self.names]

        def contribution() -> torch.Tensor:
            """This attempt's own flat copy (summed in place: a sum given up on may still write into it)."""
            pieces = [torch.zeros(values[name].numel(), device=device) if local.get(name) is None
                      else local[name].detach().reshape(-1).float() for name in self.names]
            flat = torch.cat(pieces + [torch.tensor(flags + [float(rows)], device=device)])
            if scale != 1.0:
                flat[:-1 - len(self.names)].mul_(scale)
            return flat

        if self.codec is not None:
            return self._compressed_mean(step, contribution()[:-1 - len(self.names)], flags, rows)
        first = contribution()
        try:
            met = self.quorum.meet(self.meeting_of(step), step, lambda attempt: attempt.all_reduce_sum(
                first if attempt.attempt == 0 else contribution(), in_place=True), admit=self.admits_at_the_mean)
        except quorums.LeftOut as err:  # it came too late (it was stalled): the others went on without it
            raise GroupDropped(str(err)) from None
        total = met.result
        self.job_bytes_sent += wire_bytes([total]) * len(met.came)
        self.sent_bytes += int(wire_bytes([total]) * 2 * (len(met.came) - 1) / len(met.came))  # a ring all-reduce's share
        self._note_attendance(step, met.came)
        came_rows = float(total[-1])
        self._window_rows += int(came_rows)
        mean: Grads = {}
        had = total[-1 - len(self.names):-1].tolist()
        summed = total[:-1 - len(self.names)].div_(came_rows)  # one division over the flat sum; each mean is a view of it
        offset = 0
        for i, name in enumerate(self.names):
            size = values[name].numel()
            mean[name] = summed[offset:offset + size].view_as(values[name]).to(values[name].dtype) if had[i] > 0 else None
            offset += size
        return mean

    def _compressed_mean(self, step: int, flat: torch.Tensor, flags: list[float], rows: int) -> Grads:
        """mean_gradients under cluster.compression: this process's encoding of its Σ rows · g (`flat`) all-gathered with
        its flags and rows as one byte tensor, every member's decoded and summed in rank order (see the module's text)."""
        sent, residual = encode_tentatively(self.codec, flat)  # the same encoding on every attempt of the step
        tail = torch.tensor(flags + [float(rows)], device=flat.device)
        packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in [tail] + sent])
        try:
            met = self.quorum.meet(self.meeting_of(step), step, lambda attempt: attempt.all_gather(packed),
                                   admit=self.admits_at_the_mean)
        except quorums.LeftOut as err:  # the others went on without it: its residual is still owed
            raise GroupDropped(str(err)) from None
        self.codec.residual = residual  # committed with this encoding in it (a member not in `came` was left out above)
        self.job_bytes_sent += packed.numel() * len(met.came) * (len(met.came) - 1)  # each encoding reached every other member
        self.sent_bytes += packed.numel() * (len(met.came) - 1)  # (a ring all-gather passes P - 1 encodings on)
        self._note_attendance(step, met.came)
        total = torch.zeros(flat.numel(), device=flat.device)
        had = torch.zeros(len(tail), device=flat.device)
        for part in met.result:  # in rank order: every member adds the same terms in the same order
            had += part[:tail.numel() * 4].clone().view(torch.float32)
            offset, received = tail.numel() * 4, []
            for t in sent:
                size = t.numel() * t.element_size()
                received.append(part[offset:offset + size].clone().view(t.dtype))
                offset += size
            total += self.codec.decode(received, flat.numel())
        came_rows = float(had[-1])
        self._window_rows += int(came_rows)
        total.div_(came_rows)
        values, mean, offset = self.store.values, {}, 0
        for i, name in enumerate(self.names):
            size = values[name].numel()
            mean[name] = total[offset:offset + size].view_as(values[name]).to(values[name].dtype) if had[i] > 0 else None
            offset += size
        return mean

    def heal(self, step: int, state: Optional[Callable[[], list[torch.Tensor]]] = None) -> tuple[int, ...]:
        """After step `step`'s update: when the quorum changed at it, the next group is made, and the processes
        admitted at it take `state()` (default: the params and the updater's state) from the chief. Returns their ranks."""
        joined = self.quorum.welcome(state or self._handover)
        if joined:
            self.job_bytes_sent += len(joined) * wire_bytes((state or self._handover)())
            self.present = tuple(sorted(set(self.present) | set(joined)))
            for rank in joined:
                self._back.setdefault(rank, []).append(step + 1)
            self._annotate()
        return joined

    @property
    def chief(self) -> bool:
        """Whether this process decides the steps now: the chief, or the member that took a dead chief's place."""
        return self.quorum.chief

    def speak_for_the_job(self, log: Callable[[str], None], annotate: Callable[[dict], None]) -> None:
        """This process took a dead chief's place (the quorum made it the decider): the chief's lines and summary.json
        are its from now on, and summary.json says at once what the dead chief would have (missed_steps)."""
        self.log, self.annotate = log, annotate
        for line in self._before_speaking or ():
            self.log(line)
        self._before_speaking = None
        self._annotate()

    # -- who came ------------------------------------------------------------------------------------
    def _note_attendance(self, step: int, came: tuple[int, ...]) -> None:
        left = [r for r in self.present if r not in came]
        self.present = self._came = came
        self._last_step = step
        self._held += 1
        for rank in self.quorum.all_ranks:
            if rank not in came:
                self._missed.setdefault(rank, []).append(step)
        if left and self.chief:
            whose = f"{_processes(list(came))}, weighted by their rows" if len(came) > 1 else f"process {came[0]} alone"
            self._say(f"Step {step} went on without {_processes(left)} (died or stopped answering): the mean over the "
                      f"gradients of {whose}")
            self._annotate()

    def _say(self, line: str) -> None:
        """A line of the process that decides the steps: on the job's log, or held until its trainer hands it that log
        (`speak_for_the_job`: a successor decides the step it takes the chief's place at first)."""
        if self._before_speaking is None:
            self.log(line)
        else:
            self._before_speaking.append(line)

    def _absence(self, rank: int) -> str:
        """`missing from steps 37 to 44, back at step 45`: each spell away, as the chief saw it."""
        spells: list[list[int]] = []
        for step in self._missed[rank]:
            if spells and step == spells[-1][1] + 1:
                spells[-1][1] = step
            else:
                spells.append([step, step])
        said = []
        for first, last in spells:
            text = f"missing from step {first}" if first == last else f"missing from steps {first} to {last}"
            if last + 1 in self._back.get(rank, ()):
                text += f", back at step {last + 1}"
            said.append(text)
        return "; ".join(said)

    def _annotate(self) -> None:
        """The chief's word in summary.json (missed_steps): each process that missed steps, how many of this run's."""
        if not self.chief or self.annotate is None or not self._missed:
            return
        self.annotate({"missed_steps": {str(r): {"missed": len(steps), "of": self._held, "why": self._absence(r)}
                                        for r, steps in sorted(self._missed.items())}})

    # -- a process restarted into the job --------------------------------------------------------------
    def _handover(self) -> list[torch.Tensor]:
        """What a process joining at a step starts from, in one order on both sides: every value (running statistics
        too), then the updater's slots, param by param."""
        tensors = [self.store.values[n] for n in self.store.names()]
        state = self.server.state_dict()
        return tensors + [state[n][slot] for n in self.names for slot in sorted(state.get(n, {}))]

    def rejoin(self, incarnation: int, state: Optional[Callable[[], list[torch.Tensor]]] = None) -> tuple[int, int, dict]:
        """This process was restarted into the job (incarnation `incarnation`): knock, and once the chief admits it at a
        step, take what the chief hands over after that step's update (`_handover`, or `state()`); returns (the step to
        train from, the step it was admitted at, what it took)."""
        before = fingerprint(self._handover())
        try:
            admission = self.quorum.join(incarnation)
        except quorums.MeetingsOver:
            raise MeetingsOver(f"process {self.rank} was restarted after the job's last step: nothing left to join") from None
        self.quorum.receive((state or self._handover)(), admission.donor)
        self.joining = False
        self.present = tuple(m.rank for m in admission.members)
        took = {"who": f"Process {self.rank}", "before": before, "received": fingerprint(self._handover()),
                "from_process": admission.donor,
                "took": f"the params and the updater's state from process {admission.donor}, after step {admission.step}"}
        return admission.step + 1, admission.step, took

    def start_from(self) -> None:
        """Before the first step: every replica starts from the chief's values (a broadcast over the world, every
        process being there; a restarted process takes them when admitted instead)."""
        if self.first is None or self.joining:
            return
        for tensor in [self.store.values[n] for n in self.store.names()]:
            host = tensor.detach().to("cpu") if not self.first.on_nccl else tensor.detach().clone()
            self.first.broadcast(host, self.quorum.chief_rank).wait()
            tensor.copy_(host)

    # -- the Exchange contract ---------------------------------------------------------------------------
    def view_updater(self):
        """Every param goes through the step's mean."""
        return None

    def metrics(self, window: MetricWindow) -> dict[str, float]:
        """The group's averages (every member's window that came to the last step, weighted by its rows: the decider's
        result; another member's are its own), the rows of every member that came in the window, the processes of the
        last step, the bytes this process sent in the window. Every member calls it at each display."""
        if self.chief:
            heard = self.quorum.hear(WINDOW, self._last_step, self._came)
            values = window.averages_with([w for w in map(_window_state, heard.values()) if w is not None])
        else:
            self.quorum.tell(WINDOW, self._last_step, _window_text(window.state()))
            values = window.averages()
        values |= {"samples": self._window_rows, "processes": len(self.present), "sent_bytes": self.sent_bytes}
        self._window_rows = self.sent_bytes = 0
        return values

    def updater_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.server.state_dict()

    def load_updater_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.server.load_state(state)

    def own_state(self) -> dict[str, torch.Tensor]:
        """The chief's count of the job's bytes (a resumed run counts on) and, compressed, this process's residual, keyed
        by its rank (a process loading another's file takes none: its own error feedback starts at zero)."""
        own = {"count/job_bytes_sent": torch.tensor(self.job_bytes_sent, device="cpu")} if self.chief else {}
        if self.codec is not None and self.codec.residual is not None:
            own[f"residual/r{self.rank}"] = self.codec.residual
        return own

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if "count/job_bytes_sent" in tensors:
            self.job_bytes_sent = int(tensors["count/job_bytes_sent"])
        if self.codec is not None:
            saved = tensors.get(f"residual/r{self.rank}")
            self.codec.residual = None if saved is None else saved.to(self.store.device).clone()

    def finish(self) -> None:
        """Every update was applied in its step. The chief says the steps are over (a process still knocking has
        nothing left to join); every other member waits for its word, and takes its place if it died after the last
        step's commit (`Quorum.await_close`: its trainer then writes the final test and checkpoint)."""
        self.quorum.await_close()
        if self.chief:
            self.quorum.close()
            self._annotate()



def _window_text(state: dict) -> str:
    """A display window's sums and counts as JSON (a float's repr round-trips exactly, NaN too); a window too large for one
    store value (hundreds of metrics) is told empty: the group's averages then hold the other members' rows only."""
    text = json.dumps(state, separators=(",", ":"))
    return text if len(text) <= 12 * 1024 else json.dumps({"sums": {}, "counts": {}})


def _window_state(text: Optional[str]) -> Optional[dict]:
    """A member's window as `_window_text` wrote it (None: not heard, or not that shape)."""
    try:
        state = json.loads(text) if text is not None else None
        sums, counts = state["sums"], state["counts"]
        if all(isinstance(k, str) and type(v) in (int, float) for k, v in sums.items()) and \
                all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in counts.items()):
            return {"sums": sums, "counts": counts}
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def _processes(ranks: list[int]) -> str:
    """'process 2', or 'processes 0, 1' (two that died at once)."""
    return f"process {ranks[0]}" if len(ranks) == 1 else f"processes {', '.join(map(str, ranks))}"
