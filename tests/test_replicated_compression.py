"""AllReduce with cluster.compression on the replicated exchange (issues 38 and 39): the exchange that goes on without a
dead process and that a user's own loop runs.

The exchange's rules, in one test process (its quorum a stand-in that runs the members' all-gather on threads): every
member computes the same mean from the rank-ordered encodings; a member's error-feedback residual moves on only with a
step committed with its encoding (a step it was left out of leaves it as it was; a retried attempt sends the same
encoding); the residual is checkpointed as the member's own. Then real processes through the CLI: a user's loop
(`shoal run script.py`) under AllReduce with bf16 and top-k trains as the plain loop does, within stated bounds, and
its plan says the replicated exchange runs, its checkpoint holding process 1's residual in process 1's part; resumed from
that checkpoint, the top-k loop ends where the uninterrupted one did (slow); a compressed job file under `--max-restarts`
goes on without a SIGKILLed process, which rejoins, and resumed from a checkpoint it ends where the uninterrupted run
did (both slow).
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from cli_in_process import run_cli
from fault_runs import SLOW, assert_no_library_text, pids, runs, summary  # noqa: F401 (runs: a fixture)
from shoal.comm import quorum as quorums
from shoal.config import job_pb2
from shoal.neuralnet.params import ParamStore
from shoal.neuralnet.updaters import make_updater
from shoal.report.metrics import MetricWindow
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.exchanges.replicated import ReplicatedExchange
from shoal.runtime.interfaces import GroupDropped
from test_cli import leftover_processes

SHAPES = {"w": (6, 5), "b": (5,)}


class Meeting:
    """The members' all-gather, as the quorum's group runs it: each member's bytes, in rank order, once all gave theirs."""

    def __init__(self, size: int):
        self.barrier, self.parts = threading.Barrier(size), {}

    def all_gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = tensor.clone()
        self.barrier.wait(timeout=10)
        return [self.parts[r] for r in sorted(self.parts)]


class StandInQuorum:
    """A member's side of the quorum: `meet` runs `contribute` over `attempts` attempts (all but the last failing, as
    a lost peer makes them), then commits, or leaves this member out (`left_out`)."""

    def __init__(self, rank: int, ranks=(0, 1), meeting: Meeting | None = None, attempts: int = 1, left_out: bool = False):
        self.rank, self.all_ranks, self.chief_rank, self.group = rank, tuple(ranks), 0, object()
        self.chief = rank == 0  # (the real one's: whether this member decides the steps now)
        self.meeting, self.attempts, self.left_out, self.sent = meeting, attempts, left_out, []

    def meet(self, meeting: int, step: int, contribute, admit: bool = True):  # (admit: the real one's; nobody knocks here)
        result = None
        for attempt in range(self.attempts):
            result = contribute(self._attempt(attempt))
        if self.left_out:
            raise quorums.LeftOut(f"process {self.rank} was left out of the meeting after step {step}")
        return quorums.Met(result, self.all_ranks)

    def _attempt(self, attempt: int):
        quorum = self

        class Attempt:
            def all_gather(self, tensor):
                quorum.sent.append(tensor.clone())
                if quorum.meeting is not None and attempt == quorum.attempts - 1:
                    return quorum.meeting.all_gather(quorum.rank, tensor)
                return [tensor.clone() for _ in quorum.all_ranks]
        return Attempt()

    def welcome(self, state):
        return ()

    def tell(self, topic: str, step: int, text: str) -> None:  # (a display's window, for the decider: nobody hears it here)
        pass

    def hear(self, topic: str, step: int, ranks) -> dict:
        return {}


def exchange(quorum, compression=job_pb2.kTopK, fraction=0.2) -> ReplicatedExchange:
    torch.manual_seed(0)
    store = ParamStore.viewing([(n, torch.zeros(shape)) for n, shape in SHAPES.items()])
    updater = make_updater(job_pb2.UpdaterProto(type=job_pb2.kSGD, learning_rate=job_pb2.LRGenProto(type=job_pb2.kFixed, base_lr=0.1)))
    return ReplicatedExchange(store, updater, quorum, quorum.rank, 8, codecs=codec_factory(compression, fraction))


def gradients(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=generator) for n, shape in SHAPES.items()}


@pytest.mark.parametrize("compression", [job_pb2.kTopK, job_pb2.kBF16], ids=["top-k", "bf16"])
def test_every_member_computes_the_same_mean_from_the_rank_ordered_encodings(compression):
    """Two members' encodings all-gathered: both compute the same mean to the bit, the decoded sum over the rows that
    came; top-k sends k entries each and keeps the rest as the member's residual (its next step sends it)."""
    meeting = Meeting(2)
    members = [exchange(StandInQuorum(r, meeting=meeting), compression) for r in range(2)]
    grads, rows = [gradients(1), gradients(2)], [3, 5]
    means = [None, None]

    def run(r):
        means[r] = members[r].mean_gradients(0, [(grads[r], rows[r])])
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    assert all(torch.equal(means[0][n], means[1][n]) for n in SHAPES)
    dense = {n: (rows[0] * grads[0][n] + rows[1] * grads[1][n]) / sum(rows) for n in SHAPES}
    sent = {n: torch.zeros(shape) for n, shape in SHAPES.items()}
    for r in range(2):
        flat = torch.cat([rows[r] * grads[r][n].reshape(-1) for n in SHAPES])
        kept = flat - members[r].codec.residual  # what member r sent (bf16-rounded values, on its top-k entries)
        offset = 0
        for n, shape in SHAPES.items():
            size = torch.Size(shape).numel()
            sent[n] += kept[offset:offset + size].view(shape)
            offset += size
        if compression == job_pb2.kTopK:
            assert int((kept != 0).sum()) == 7  # k = ceil(0.2 · 35)
    for n in SHAPES:
        torch.testing.assert_close(means[0][n], sent[n] / sum(rows), rtol=1e-6, atol=1e-6)
        if compression == job_pb2.kBF16:
            torch.testing.assert_close(means[0][n], dense[n], rtol=1e-2, atol=1e-2)
    # summary.json's count: each member's bytes reach the other; the display's sent_bytes: what this process sent
    assert members[0].job_bytes_sent == 2 * members[0].quorum.sent[0].numel()
    assert members[1].metrics(MetricWindow())["sent_bytes"] == members[1].quorum.sent[0].numel()


def test_a_step_not_committed_with_a_members_encoding_leaves_its_residual_as_it_was():
    """The uncommitted-step rule: a member left out of a step (the chief went on without it) keeps the residual it had,
    so what it still owes is sent when it next counts; a step that took two attempts sends the same encoding twice and
    consumes the residual once; a committed step moves it on."""
    committed = exchange(StandInQuorum(0))
    committed.mean_gradients(0, [(gradients(1), 4)])
    owed = committed.codec.residual.clone()
    assert owed.abs().sum() > 0

    left_out = exchange(StandInQuorum(0, left_out=True))
    left_out.codec.residual = owed.clone()
    with pytest.raises(GroupDropped, match="left out"):
        left_out.mean_gradients(1, [(gradients(2), 4)])
    assert torch.equal(left_out.codec.residual, owed)

    retried = exchange(StandInQuorum(0, attempts=2))
    retried.codec.residual = owed.clone()
    retried.mean_gradients(1, [(gradients(2), 4)])
    first, second = retried.quorum.sent
    assert torch.equal(first, second)  # the retry sent the very encoding the failed attempt did
    committed.mean_gradients(1, [(gradients(2), 4)])  # the same step, committed at the first attempt
    assert torch.equal(retried.codec.residual, committed.codec.residual)
    assert not torch.equal(committed.codec.residual, owed)


def test_the_residual_is_each_members_own_in_a_checkpoint():
    """own_state keys the residual by rank: the member that wrote it takes it back, another rank (one resumed without
    its own part) starts its error feedback at zero, as a restarted member does."""
    chief = exchange(StandInQuorum(0))
    chief.mean_gradients(0, [(gradients(1), 4)])
    saved = chief.own_state()
    assert set(saved) == {"count/job_bytes_sent", "residual/r0"}
    again = exchange(StandInQuorum(0))
    again.load_own_state(saved)
    assert torch.equal(again.codec.residual, chief.codec.residual)
    other = exchange(StandInQuorum(1))
    other.load_own_state(saved)
    assert other.codec.residual is None


# A user's loop on MNIST-sized rows (784 features, 10 classes, a random linear teacher's labels). Rank 0 also runs the
# same loop as plain PyTorch on the whole batch of each step and writes its loss over the whole data set.
LOOP = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(1024, 784)
    y = (x @ torch.randn(784, 10)).argmax(1)
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Linear(784, 10)
    STEPS, BATCH, LR = 60, 32, 0.05

    def loss_of(model, xb, yb):
        return torch.nn.functional.cross_entropy(model(xb), yb)

    run = shoal.session(train_steps=STEPS, disp_freq=20)
    said = {}
    if run.rank == 0:
        import copy
        plain = copy.deepcopy(model)
        opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)
        for step in range(STEPS):
            start = step * BATCH % len(x)
            loss_of(plain, x[start:start + BATCH], y[start:start + BATCH]).backward()
            opt.step(); opt.zero_grad()
        with torch.no_grad():
            said["plain"] = float(loss_of(plain, x, y))
    model = run.model(model)
    opt = run.optimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    with torch.no_grad():
        said["first"] = float(loss_of(model, x, y))
    for step, (xb, yb) in run.batches(data, batch_size=BATCH, shuffle=False):
        loss = loss_of(model, xb, yb)
        loss.backward()
        opt.step(); opt.zero_grad()
        run.log(step, loss=loss)
    with torch.no_grad():
        said["final"] = float(loss_of(model, x, y))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
    (out / f"rank{run.rank}.json").write_text(json.dumps(said | {"label": run.label, "processes": run.processes}))
''')
ELEMENTS, TENSORS, STEPS = 784 * 10 + 10, 2, 60


def encoded(compression: str) -> int:
    """A process's bytes a step: its flags and rows (float32), then its encoding (runtime/exchanges/compression.py)."""
    body = {"kNone": 4 * ELEMENTS, "kBF16": 2 * ELEMENTS, "kTopK": 6 * -(-ELEMENTS // 100)}[compression]
    return 4 * (TENSORS + 1) + body


@pytest.mark.parametrize("compression", [
    pytest.param("kNone", marks=pytest.mark.slow),  # (tests/test_session.py runs the dense loop in the default suite)
    pytest.param("kBF16", marks=pytest.mark.slow),
    "kTopK",
])
def test_allreduce_with_compression_trains_a_users_loop(tmp_path, compression):
    """`shoal run loop.py --set cluster.compression=…` under AllReduce over 2 processes: the replicas end equal to the
    bit; dense, the plain loop's loss; bf16 within 0.1 % of it; top-k 1 % (about 67x fewer bytes) within 0.1 nats of it
    and below a tenth of the first loss; summary.json counts the bytes each process sent the other. Its checkpoint
    (step 30) is the chief's file and, compressed, process 1's part with process 1's own residual, which it lists."""
    run_loop(tmp_path, compression, tmp_path / "ws", tmp_path)
    said = json.loads((tmp_path / "rank0.json").read_text())
    assert said["label"] == "AllReduce" and said["processes"] == 2
    replicas = [load(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
    plain, final = said["plain"], said["final"]
    if compression == "kNone":
        assert abs(final - plain) <= 1e-5 * plain, (final, plain)
    elif compression == "kBF16":
        assert abs(final - plain) <= 1e-3 * plain, (final, plain)
    else:
        assert final - plain < 0.1 and final < said["first"] / 10, said
    assert summary(tmp_path / "ws")["bytes_sent"] == STEPS * 2 * encoded(compression)
    from shoal.neuralnet import checkpoint as ckpt_io

    ckpt = ckpt_io.load(tmp_path / "ws" / "checkpoint" / "step30-worker0.safetensors", parts=True)
    assert {k for k in ckpt.exchange if "residual" in k} == ({"own/residual/r0"} if compression != "kNone" else set())
    if compression != "kNone":
        (part,) = ckpt.parts.values()  # process 1's: its residual only (its params are the chief's, equal to the bit)
        assert list(part.exchange) == ["own/residual/r1"] and not part.params
        assert not torch.equal(part.exchange["own/residual/r1"], ckpt.exchange["own/residual/r0"])
    else:
        assert not ckpt.parts


def run_loop(tmp_path: Path, compression: str, workspace: Path, out: Path, *extra: str) -> None:
    """`shoal run loop.py` (LOOP) under AllReduce over 2 processes, compressed, checkpointing every 30 steps."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    # in this process (no interpreter to start and torch to import for the launcher): its ranks are real processes
    proc = run_cli("run", script, "--workspace", workspace, "--no-progress",
                   "--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=1",
                   "--set", f"cluster.compression={compression}", "--set", "checkpoint_freq=30", *extra,
                   "--", out, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # a second run of 2 processes (about 7 s on the busy 2-core machine)
def test_a_resumed_compressed_users_loop_ends_where_the_uninterrupted_one_did(tmp_path):
    """A user's loop under AllReduce with top-k, resumed (`shoal run loop.py --resume`) from its step-30 checkpoint,
    ends at step 60 with the uninterrupted loop's params to the bit on both processes: process 1 takes its own
    residual back from its part of the checkpoint (before, it started its error feedback at zero)."""
    import shutil

    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    run_loop(tmp_path, "kTopK", tmp_path / "ws", tmp_path / "first")
    shutil.copytree(tmp_path / "ws", tmp_path / "resumed")
    for path in (tmp_path / "resumed" / "checkpoint").glob("step60*"):
        path.unlink()
    run_loop(tmp_path, "kTopK", tmp_path / "resumed", tmp_path / "again", "--resume")
    for rank in range(2):
        a, b = load(tmp_path / "first" / f"rank{rank}.safetensors"), load(tmp_path / "again" / f"rank{rank}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rank


def load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


@pytest.mark.slow  # 8 to 14 s on the busy 2-core machine: a kill, a restart and the rejoin to wait for
def test_a_compressed_job_goes_on_without_a_killed_process(blobs_job, tmp_path, runs):
    """AllReduce with top-k under `--max-restarts 1` runs the replicated exchange: process 1 of 2 is SIGKILLed mid-run,
    the chief (same pid to the end) goes on alone at the next step, the launcher restarts process 1 into the running
    job (not the job from a checkpoint), it rejoins with its residual at zero, and the job exits 0 and learns."""
    steps = 200  # 2 s or more (SLOW): time for the restarted process to start and knock, under load
    job = blobs_job(train_steps=steps, cluster_extra=dict(nworkers_per_group=2, compression="kTopK", topk_fraction=0.1))
    run = runs.start(job, tmp_path, "--max-restarts", "1", env=SLOW)
    chief = run.pid_once_training(0)
    victim = run.signal(1, signal.SIGKILL)
    stdout, stderr = run.finished()
    left = int(re.search(r"^Step (\d+) went on without process 1 \(died or stopped answering\)", stdout, re.M)[1])
    back = int(re.search(r"^Process 1 rejoined at step (\d+) \(restart 1\): ", stdout, re.M)[1])
    assert 10 <= left < back < steps, (left, back)
    assert pids(run.ws, 0) == [chief] and pids(run.ws, 1)[0] == victim and len(set(pids(run.ws, 1))) == 2
    got = summary(run.ws)
    assert got["status"] == "finished" and got["final_test"]["accuracy"] > 0.8, got
    assert "job_restarts" not in got and "the other processes go on without it; restarting it (restart 1 of 1)" in stderr
    assert_no_library_text(stdout, stderr)
    assert leftover_processes(tmp_path) == []


def test_shoal_plan_says_the_replicated_exchange_runs_compressed():
    """A user's loop's plan (as `shoal plan script.py` prints it) under AllReduce with top-k: accepted, the replicated
    exchange noted with its all-gather, what is encoded, and that the run is not bit-exact with one worker."""
    from shoal.frontend.session_start import plan_session, session_job
    from shoal.planning.describe import describe

    cluster = job_pb2.ClusterProto(nworkers_per_group=2, nworkers_per_procs=1, compression=job_pb2.kTopK)
    plan = plan_session(session_job(cluster, 10, 0, 5, 0, "loop"))
    notes = describe(plan)["partition_notes"]
    assert "gradients (each process's, gathered by every process) compressed (top-0.01 with error feedback): the run does " \
           "not compute what uncompressed AllReduce would (no longer bit-exact with one worker)" in notes
    assert "replicated over 2 processes (a loop on the session: yours, or shoal.fit's): each process updates the whole params from one all-gather of each " \
           "process's encoded gradients a step, decoded and summed in process order; a dead or stalled process other than 0 " \
           "is left out (the mean over the rows that came)" in notes
    assert describe(plan)["compression"] == {"setting": "top-0.01", "applied": True, "bit_exact_with_one_worker": False}


@pytest.mark.slow  # two runs of 2 processes
def test_a_resumed_compressed_job_ends_where_the_uninterrupted_one_did(blobs_job, tmp_path):
    """Every process's residual is in the checkpoint (the chief's in its file, process 1's in its part): a job file
    under `--max-restarts` (the replicated exchange) resumed from step 10 ends at step 20 with the uninterrupted run's
    params to the bit."""
    import shutil
    from test_local_sgd_faults import params

    job = blobs_job(train_steps=20, extra="checkpoint_freq: 10",
                    cluster_extra=dict(nworkers_per_group=2, compression="kTopK", topk_fraction=0.1))
    ws, again = tmp_path / "ws", tmp_path / "resumed"

    def run(workspace, *extra):
        proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(workspace), "--no-progress",
                               "--max-restarts", "1", *extra], capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    run(ws)
    shutil.copytree(ws, again)
    for path in (again / "checkpoint").glob("step20*"):
        path.unlink()
    from safetensors.torch import load_file
    parts = [load_file(str(p)) for p in (again / "checkpoint").glob("step10*")]
    assert {k for part in parts for k in part if "residual" in k} >= {"exchange/residual/r0", "exchange/residual/r1"}, \
        [sorted(part) for part in parts]
    run(again, "--resume")
    a, b = params(ws, 20), params(again, 20)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
