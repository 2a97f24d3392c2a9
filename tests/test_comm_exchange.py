"""The sliced exchange's pieces: bucket planning (pure) and gradients streaming out of backward."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import shoal
from layouts import LAYOUTS
from shoal.neuralnet.algorithms import back_propagation, register_algorithm
from shoal.planning.placement import ParamSlice, place, slice_params
from shoal.comm import collectives, dist as comm
from shoal.planning.buckets import plan_buckets
from shoal.planning.plan import plan_job
from shoal.planning.process_groups import job_group, sliced_groups
from shoal.runtime.exchanges.local import LocalExchange
from shoal.runtime.exchanges.sliced import SlicedExchange
from shoal.runtime.exchanges.server import Server
from shoal.runtime.trainer import Trainer
from shoal.neuralnet.updaters import make_updater


def random_slicing(seed: int) -> tuple[list[ParamSlice], dict[int, int]]:
    rng = random.Random(seed)
    sizes = {f"p{i}": rng.choice([1, 3, 10, 64, 500, 4096]) for i in range(rng.randint(1, 12))}
    nslices = rng.randint(1, 6)
    nranks = rng.randint(1, nslices)
    return slice_params(sizes, nslices), {i: i % nranks for i in range(nslices)}


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("cap", [1, 7, 100, 1 << 20])
def test_buckets_cover_every_slice_once_in_backward_order_one_owner_each(seed, cap):
    slices, owner = random_slicing(seed)
    buckets = plan_buckets(slices, owner, cap)
    pieces = [s for b in buckets for s in b.slices]
    assert glue(pieces) == list(reversed(slices))  # every element once, last param first
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert {owner[s.index] for s in b.slices} == {b.owner}
        assert 0 < b.numel <= cap
        assert b.offsets == tuple(sum(s.size for s in b.slices[:k]) for k in range(len(b.slices)))
    for a, b in zip(buckets, buckets[1:]):  # closed only when the owner changes or the cap is reached
        assert a.owner != b.owner or a.numel + b.slices[0].size > cap


def glue(pieces: list[ParamSlice]) -> list[ParamSlice]:
    """Adjacent pieces of one slice joined back."""
    out: list[ParamSlice] = []
    for p in pieces:
        if out and (out[-1].param, out[-1].index, out[-1].stop) == (p.param, p.index, p.start):
            out[-1] = ParamSlice(p.param, p.index, out[-1].start, p.stop)
        else:
            out.append(p)
    return out


def test_a_bucket_cap_below_one_element_is_refused():
    slices, owner = random_slicing(0)
    with pytest.raises(ValueError, match="cap"):
        plan_buckets(slices, owner, 0)


@register_algorithm("test-bp-without-hooks")
def _bp_by_other_means(conf, net, ctx):
    return back_propagation(conf, net, ctx)


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank (this process), so the exchange runs for real."""
    comm.init(0, 1, "127.0.0.1", comm.free_port())
    yield
    comm.shutdown()


def build(job_path: Path, tmp_path: Path, sliced: bool, cap: int = 40) -> Trainer:
    job = shoal.load_job(job_path)
    plan = plan_job(job)
    trainer = Trainer(plan, tmp_path / ("sliced" if sliced else "local"), [job_path.parent], torch.device("cpu"), log=lambda *a: None, progress=False)
    if sliced:
        # one process: the plan names no group (it needs none); the sliced one it would name over processes, on gloo
        devices = [[] for _ in plan.placement.processes]
        groups = collectives.create(sliced_groups(plan.placement, devices) + (job_group(devices),))
        trainer.attach_exchange(SlicedExchange(trainer.store, make_updater(job.updater), plan.placement, 0, trainer.global_batch,
                                               trainer.workers, cap, groups=groups))
    else:
        trainer.attach_exchange(LocalExchange(Server(trainer.store, make_updater(job.updater))))
    return trainer


@pytest.mark.parametrize("alg", ["alg: kBP", 'alg: kUserAlg user_alg: "test-bp-without-hooks"'])
@pytest.mark.parametrize("layout", ["single worker", "in-memory Sandblaster, 2 threads, 2 server slices"])
def test_gradients_leave_during_backward_and_the_result_is_the_in_memory_one(blobs_job, tmp_path, one_rank_group, alg, layout):
    job = blobs_job(updater="type: kAdam", layout=layout)
    assert "alg: kBP" in job.read_text()
    job.write_text(job.read_text().replace("alg: kBP", alg))
    local, sliced = build(job, tmp_path, False), build(job, tmp_path, True)
    assert len(sliced.workers) == LAYOUTS[layout].workers
    events: list[tuple[int, str]] = []
    send = sliced.exchange._send_gradients
    sliced.exchange._send_gradients = lambda r, b: (events.append((r.step, f"bucket {b.index}")), send(r, b))
    for w in sliced.workers:
        compute = w.compute
        w.compute = lambda step, report, compute=compute: (grads := compute(step, report), events.append((step, "backward done")))[0]
    for step in range(4):
        local.train_step(step)
        sliced.train_step(step)
    for name, value in local.store.values.items():
        torch.testing.assert_close(sliced.store.values[name], value, rtol=1e-5, atol=1e-6)
    nbuckets = len(sliced.exchange.buckets)
    assert nbuckets > 2  # the 40-element cap cuts the blobs MLP into several messages
    for step in range(4):
        order = [what for s, what in events if s == step]
        buckets = [what for what in order if what.startswith("bucket")]
        assert buckets == [f"bucket {i}" for i in range(nbuckets)]  # last layer first
        if alg == "alg: kBP":  # every bucket left before the last worker's backward returned
            assert order.index(buckets[-1]) < max(i for i, what in enumerate(order) if what == "backward done")
        else:  # no hooks: handed over after every worker finished
            assert order.index(buckets[0]) > max(i for i, what in enumerate(order) if what == "backward done")


class CountingGroup:
    """A process group that counts the collectives launched on it (and runs them on the real one)."""

    def __init__(self, group, calls: list[str]):
        self.group, self.calls = group, calls

    def __getattr__(self, name):
        attribute = getattr(self.group, name)
        if name in ("reduce_sum", "broadcast", "all_reduce_sum", "gather", "gather_others", "all_gather"):
            return lambda *args, **kw: (self.calls.append(name), attribute(*args, **kw))[1]
        return attribute


def test_a_step_issues_one_gather_and_one_broadcast_per_bucket_and_nothing_else(blobs_job, tmp_path, one_rank_group):
    """The flags ride in each owner's last bucket: no reduce of its own per step; each bucket one gather to its owner
    and one broadcast back (the step's collectives, counted on the exchange's process groups)."""
    job = blobs_job(updater="type: kSGD momentum: 0.9", layout="in-memory Sandblaster, 2 threads, 2 server slices")
    sliced = build(job, tmp_path, True)
    calls: list[str] = []
    exchange = sliced.exchange
    exchange.group_of = {owner: CountingGroup(group, calls) for owner, group in exchange.group_of.items()}
    for step in range(2):
        sliced.train_step(step)
    nbuckets = len(exchange.buckets)
    assert nbuckets > 2 and exchange.flagged == {exchange.buckets[-1].index: exchange.params_of[0]}
    assert sorted(calls) == sorted(["gather_others"] * nbuckets * 2 + ["broadcast"] * nbuckets * 2)
