"""shoal.fit's torch optimizers wherever each framework updates: owner-sharded over processes (ZeRO-1's shape).

The model is test_fit_module's tiny GPT (1 layer, 32 wide, block 16) on its tiny corpus.
"""
from __future__ import annotations

import math

import pytest
import torch

import shoal
from layouts import LAYOUTS, Layout, assert_ran
from shoal.config import job_pb2
from shoal.data.in_place import epoch_order
from shoal.frontend.module_path import FitError
from shoal.neuralnet import checkpoint
from shoal.neuralnet.torch_optimizer import OptimizerError
from test_fit_module import BLOCK, VOCAB, GPT, GPTConfig, adamw, fit, next_char_loss, quiet, tiny_gpt, train_losses, windows

ALLREDUCE = "AllReduce, 2 processes, 2 server slices"  # both processes own slices of params


def on_the_job_path(monkeypatch) -> None:
    """fit keeps its job path for AllReduce's server slices (the job path's owners' own runs and splits: job files
    still run them); fit runs the layout on the session otherwise."""
    from shoal.frontend import fit as fitting

    monkeypatch.setattr(fitting, "ON_SESSION", fitting.ON_SESSION - {"AllReduce over processes with server slices"})


def assert_close_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        # the key bias's gradient is 0 in exact arithmetic: Adam normalises its rounding noise into steps
        # (test_fit_module measured 7e-5 for a 2-share sum)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-3 if name.endswith("attn.c_attn.bias") else 1e-6, msg=name)


def test_adamw_with_decay_groups_over_two_processes_equals_one_worker(tmp_path):
    single, h1 = fit(tmp_path, "single", steps=16, updater=None, optimizer=adamw)
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    sharded, h2 = fit(tmp_path, "sharded", steps=16, updater=None, optimizer=adamw, cluster=cluster)
    assert_ran(tmp_path / "sharded", ALLREDUCE)
    assert train_losses(h2) == pytest.approx(train_losses(h1), rel=1e-5)  # every step
    assert_close_params(single, sharded)


@pytest.mark.slow  # four more runs over processes: the default suite's 5-minute budget
def test_adamw_over_two_processes_resumes_exactly_and_takes_one_workers_loop_state(tmp_path):
    single, _ = fit(tmp_path, "single", steps=16, updater=None, optimizer=adamw)
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    sharded, _ = fit(tmp_path, "sharded", steps=16, updater=None, optimizer=adamw, cluster=cluster)
    fit(tmp_path, "parts", steps=9, updater=None, optimizer=adamw, cluster=cluster, checkpoint_freq=9)
    resumed, h3 = fit(tmp_path, "parts", steps=16, updater=None, optimizer=adamw, cluster=cluster, resume=True)
    assert (tmp_path / "parts" / "checkpoint" / "step9-worker0.safetensors").exists()
    for (name, a), b in zip(sharded.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name  # the same layout: the sharded moments and steps restored bit for bit
    # one worker's fit (a loop on the session, its AdamW state whole) resumed over the processes' slices (fit's loop on
    # the session too): each process takes its slices of every param's moments and step, and ends as one worker does
    fit(tmp_path, "moved", steps=9, updater=None, optimizer=adamw, checkpoint_freq=9)
    moved, _ = fit(tmp_path, "moved", steps=16, updater=None, optimizer=adamw, cluster=cluster, resume=True)
    assert_close_params(single, moved)


class GPTWithAnIdleHead(GPT):
    """The tiny GPT with a head forward never calls: its weight and bias never get a gradient."""

    def __init__(self, config):
        super().__init__(config)
        self.idle = torch.nn.Linear(config.n_embd, config.n_embd)


def idle_head_gpt():
    torch.manual_seed(0)
    return GPTWithAnIdleHead(GPTConfig(vocab_size=len(VOCAB), block_size=BLOCK, n_layer=1, n_head=2, n_embd=32))


def test_adamw_over_two_processes_leaves_a_param_without_gradients_as_one_worker_does(tmp_path, monkeypatch):
    """An owner updates each run of params of one param group as one flat shard; a run holding a param nobody has a
    gradient for is split, and that param stays where it is (torch skips a param whose .grad is None). The job path's
    owners (fit runs this layout on the session: tests/test_session_slices.py has the session's unused param)."""
    on_the_job_path(monkeypatch)
    models = {}
    for name, cluster in (("single", shoal.Cluster()), ("sharded", LAYOUTS[ALLREDUCE].fit_cluster())):
        models[name] = idle_head_gpt()
        shoal.fit(models[name], next_char_loss, windows(), steps=6, batch_size=8, cluster=cluster, optimizer=adamw,
                  workspace=tmp_path / name, log=quiet)
    assert_ran(tmp_path / "sharded", ALLREDUCE)
    untouched = idle_head_gpt()
    assert torch.equal(models["sharded"].idle.weight, untouched.idle.weight)
    assert torch.equal(models["sharded"].idle.bias, untouched.idle.bias)
    assert not torch.equal(models["sharded"].wte.weight, untouched.wte.weight)
    assert_close_params(models["single"], models["sharded"])
    state = checkpoint.load(checkpoint.checkpoint_file(tmp_path / "sharded", 6)).updater_state
    assert float(state["idle.weight"]["step"]) == 0 and float(state["ln_f.weight"]["step"]) == 6


@pytest.mark.slow  # two more runs over processes: the default suite's 5-minute budget
def test_a_resume_splits_the_runs_whose_params_saved_different_steps(tmp_path, monkeypatch):
    """The checkpoint holds step 0 for the idle head and 3 for the rest of its param group: a resumed owner cannot
    update them as one shard with one step count, and goes on exactly as the uninterrupted run (the job path's)."""
    on_the_job_path(monkeypatch)
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    models = {name: idle_head_gpt() for name in ("whole", "first", "resumed")}
    shoal.fit(models["whole"], next_char_loss, windows(), steps=6, batch_size=8, cluster=cluster, optimizer=adamw,
              workspace=tmp_path / "whole", log=quiet)
    shoal.fit(models["first"], next_char_loss, windows(), steps=3, batch_size=8, cluster=cluster, optimizer=adamw,
              workspace=tmp_path / "parts", log=quiet, checkpoint_freq=3)
    shoal.fit(models["resumed"], next_char_loss, windows(), steps=6, batch_size=8, cluster=cluster, optimizer=adamw,
              workspace=tmp_path / "parts", log=quiet, resume=True)
    for (name, a), b in zip(models["whole"].named_parameters(), models["resumed"].parameters()):
        assert torch.equal(a, b), name
    whole, resumed = (checkpoint.load(checkpoint.checkpoint_file(tmp_path / ws, 6)).updater_state for ws in ("whole", "parts"))
    assert float(resumed["idle.weight"]["step"]) == 0  # the idle head's own count, not its group's
    for name, slots in whole.items():
        for slot, value in slots.items():
            assert torch.equal(value, resumed[name][slot]), (name, slot)


class NormScaled(torch.optim.SGD):
    """SGD whose step reads a whole-tensor norm: a slice's update differs from the whole's."""


class DeclaredElementwise(torch.optim.SGD):
    shoal_elementwise = True


def declared_sgd(params):  # a module-level factory: spawned processes unpickle it by name
    return DeclaredElementwise(params, lr=0.1)


def test_an_optimizer_not_known_element_wise_is_refused_over_slices_unless_declared(tmp_path):
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    with pytest.raises(OptimizerError, match="NormScaled is not known to be element-wise"):
        fit(tmp_path, "norms", steps=2, updater=None, optimizer=lambda p: NormScaled(p, lr=0.1), cluster=cluster)
    assert not (tmp_path / "norms").exists()
    fit(tmp_path, "whole", steps=2, updater=None, optimizer=lambda p: NormScaled(p, lr=0.1))  # one owner: whole params
    _, history = fit(tmp_path, "declared", steps=2, updater=None, optimizer=declared_sgd, cluster=cluster)
    assert len(train_losses(history)) == 2


def untrained_loss(data):
    with torch.no_grad():
        return next_char_loss(tiny_gpt(), torch.utils.data.default_collate([data[i] for i in range(len(data))])).item()


def downpour_two_servers():
    base = LAYOUTS["Downpour, 2 groups + 1 server, 3 processes"]
    return Layout({**base.cluster, "nservers_per_group": 2}, base.processes + 1, base.workers, "Downpour")


@pytest.mark.slow  # the default suite's 5-minute budget
def test_downpour_servers_train_the_gpt_with_adamw_and_a_resume_keeps_its_state(tmp_path):
    """AdamW at 2 servers, each over its slices."""
    layout, data = downpour_two_servers(), windows()
    run = dict(updater=None, optimizer=adamw, cluster=layout.fit_cluster(), test_data=data)
    fit(tmp_path, "downpour", steps=24, checkpoint_freq=12, **run)
    _, history = fit(tmp_path, "downpour", steps=48, resume=True, **run)
    assert_ran(tmp_path / "downpour", layout)
    assert history.final_test["loss"] < 0.8 * untrained_loss(data)
    saved = servers_state(checkpoint.load(checkpoint.checkpoint_file(tmp_path / "downpour", 24)))
    final = servers_state(checkpoint.load(checkpoint.checkpoint_file(tmp_path / "downpour", 48)))
    assert sorted(final) == sorted(n for n, p in tiny_gpt().named_parameters() if p.requires_grad)
    for name, slots in final.items():
        assert set(slots) == {"step", "exp_avg", "exp_avg_sq"}, name
        # every server update moved every param: by step 24 of a group, both groups' 48 pushes
        assert float(saved[name]["step"]) == 48, name
        assert float(slots["step"]) == 96, name  # the resumed servers went on from the saved moments and counts
        assert slots["exp_avg_sq"].abs().sum() > 0, name


def servers_state(saved) -> dict:
    """The servers' optimizer state in a checkpoint, {param: {slot: tensor}}: fit's loop on the session (Downpour over
    processes) keeps it as the exchange's (`updater/<param>/<slot>`), the job path as the checkpoint's updater state."""
    from shoal.runtime.session_exchange import whole_updater_state

    return whole_updater_state(saved.exchange) if saved.trainer.get("session") else saved.updater_state


def test_in_memory_hogwild_groups_share_one_adamw(tmp_path):
    data = windows()
    _, history = fit(tmp_path, "hogwild", steps=40, updater=None, optimizer=adamw, test_data=data,
                     cluster=LAYOUTS["in-memory Hogwild, 2 groups"].fit_cluster())
    assert_ran(tmp_path / "hogwild", "in-memory Hogwild, 2 groups")
    assert history.final_test["loss"] < 0.8 * untrained_loss(data)
    state = checkpoint.load(checkpoint.checkpoint_file(tmp_path / "hogwild", 40)).updater_state
    assert all(float(slots["step"]) == 80 for slots in state.values())  # one optimizer: 40 updates of each group


def nesterov(params):
    """DiLoCo's outer optimizer (Douillard et al. 2023), on the groups' mean pseudo-gradient."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


DILOCO_THREADS = Layout(dict(nworker_groups=2, local_steps=4, nworkers_per_procs=2), 1, 2, "Local SGD")
DILOCO_PROCESSES = Layout(dict(nworker_groups=2, local_steps=4), 2, 2, "Local SGD")


@pytest.mark.slow  # the default suite's 5-minute budget
def test_diloco_inner_adamw_outer_nesterov_threads_equal_processes_and_resume_exactly(tmp_path):
    run = dict(updater=None, optimizer=adamw, outer_optimizer=nesterov)
    threads, _ = fit(tmp_path, "threads", steps=16, cluster=DILOCO_THREADS.fit_cluster(), **run)
    processes, _ = fit(tmp_path, "processes", steps=16, cluster=DILOCO_PROCESSES.fit_cluster(), **run)
    assert_ran(tmp_path / "threads", DILOCO_THREADS)
    assert_ran(tmp_path / "processes", DILOCO_PROCESSES)
    assert_close_params(threads, processes)
    fit(tmp_path, "parts", steps=10, cluster=DILOCO_PROCESSES.fit_cluster(), **run)  # mid-round: meetings after 3, 7, 11, 15
    resumed, _ = fit(tmp_path, "parts", steps=16, cluster=DILOCO_PROCESSES.fit_cluster(), resume=True, **run)
    for (name, a), b in zip(processes.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name  # inner AdamW moments of both groups, the anchor and the outer momentum restored
    # fit runs both on the session (its loop's checkpoint): the exchange holds each param's anchor and outer momentum,
    # the inner AdamW's state is torch's (by index); threads and processes end to the bit alike there
    # (tests/test_session_local_sgd_threads.py)
    saved = checkpoint.load(checkpoint.checkpoint_file(tmp_path / "parts", 16), parts=True)
    assert saved.trainer["session"] and saved.updater_state["optimizer.0"]
    assert all({f"updater/{name}/outer.anchor", f"updater/{name}/outer.momentum_buffer"} <= set(saved.exchange)
               for name, _ in processes.named_parameters())
    plain_average, _ = fit(tmp_path, "average", steps=16, cluster=DILOCO_THREADS.fit_cluster(), updater=None, optimizer=adamw)
    assert any(not torch.allclose(a, b) for a, b in zip(plain_average.parameters(), threads.parameters()))  # the outer step acted


def test_an_outer_optimizer_needs_local_sgd(tmp_path):
    with pytest.raises(FitError, match="outer_optimizer= is Local SGD / DiLoCo's"):
        fit(tmp_path, "sync", steps=2, updater=None, optimizer=adamw, outer_optimizer=nesterov)
    assert not (tmp_path / "sync").exists()


def warmup_cosine(optimizer, warmup=4, total=20):
    """Linear warm-up then cosine decay to 0, nanoGPT's schedule, as a LambdaLR on the optimizer's lr."""
    def factor(update):
        if update < warmup:
            return (update + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (update - warmup) / (total - warmup))))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def plain_loop(steps, seed, *, scheduler=None, clip=None):
    """The plain PyTorch loop on the rows shoal.fit reads (test_fit_module's)."""
    plain, data, losses = tiny_gpt(), windows(), []
    optimizer = adamw(plain.named_parameters())
    schedule = scheduler(optimizer) if scheduler else None
    orders = [epoch_order(len(data), seed, epoch, True) for epoch in range(2)]
    for step in range(steps):
        rows = [int(orders[p // len(data)][p % len(data)]) for p in range(step * 8, step * 8 + 8)]
        loss = next_char_loss(plain, torch.utils.data.default_collate([data[i] for i in rows]))
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return plain, losses


@pytest.mark.slow  # the default suite's 5-minute budget
def test_a_warmup_cosine_schedule_steps_once_per_update_as_a_plain_loop_over_layouts_and_resumes(tmp_path):
    run = dict(updater=None, optimizer=adamw, scheduler=warmup_cosine, seed=5)
    model, history = fit(tmp_path, "single", steps=20, **run)
    plain, losses = plain_loop(20, 5, scheduler=warmup_cosine)
    assert train_losses(history) == losses
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    sharded, h2 = fit(tmp_path, "sharded", steps=20, cluster=cluster, **run)
    assert train_losses(h2) == pytest.approx(losses, rel=1e-5)
    assert_close_params(plain, sharded)
    fit(tmp_path, "parts", steps=13, cluster=cluster, **run)  # in the cosine part: the resume must replay the warm-up
    resumed, _ = fit(tmp_path, "parts", steps=20, cluster=cluster, resume=True, **run)
    for (name, a), b in zip(sharded.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    unscheduled, _ = fit(tmp_path, "constant", steps=20, updater=None, optimizer=adamw, seed=5)
    assert any(not torch.allclose(a, b) for a, b in zip(unscheduled.parameters(), model.parameters()))


def test_a_scheduler_needs_a_torch_optimizer_and_no_metric(tmp_path):
    with pytest.raises(FitError, match="scheduler= steps a torch optimizer"):
        fit(tmp_path, "singa", steps=2, scheduler=warmup_cosine)
    with pytest.raises(OptimizerError, match="got ReduceLROnPlateau"):
        fit(tmp_path, "plateau", steps=2, updater=None, optimizer=adamw,
            scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert not (tmp_path / "plateau").exists()


def test_clipping_by_the_global_norm_equals_torchs_in_a_plain_loop_and_over_two_processes(tmp_path):
    """A bound the gradients exceed at every step (their norms measured 0.96-1.76 here): the scale always acts."""
    run = dict(updater=None, optimizer=adamw, clip_grad_norm=0.5, seed=5)
    model, history = fit(tmp_path, "single", steps=20, **run)
    plain, losses = plain_loop(20, 5, clip=0.5)
    assert train_losses(history) == losses  # torch's clip_grad_norm_, bit for bit
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    sharded, h2 = fit(tmp_path, "sharded", steps=20, cluster=LAYOUTS[ALLREDUCE].fit_cluster(), **run)
    assert train_losses(h2) == pytest.approx(losses, rel=1e-5)  # one scale from both owners' sums of squares
    assert_close_params(plain, sharded)
    unclipped, _ = fit(tmp_path, "unclipped", steps=20, updater=None, optimizer=adamw, seed=5)
    assert any(not torch.allclose(a, b) for a, b in zip(unclipped.parameters(), model.parameters()))


def test_clipping_needs_a_torch_optimizer_and_a_positive_bound(tmp_path):
    with pytest.raises(FitError, match="clip_grad_norm= is a positive bound"):
        fit(tmp_path, "singa", steps=2, clip_grad_norm=1.0)
    with pytest.raises(FitError, match="clip_grad_norm= is a positive bound"):
        fit(tmp_path, "zero", steps=2, updater=None, optimizer=adamw, clip_grad_norm=0.0)


def test_the_async_momentum_compensation_is_said_and_torch_optimizers_are_not_compensated(tmp_path):
    """pytorch/examples' mnist_hogwild momentum 0.5 over 2 groups: fit compensates by default, 1 - 2·(1 - 0.5) = 0 at
    the server, said in one line; kAsConfigured keeps it (no line)."""
    layout, singa = LAYOUTS["in-memory Hogwild, 2 groups"], {"type": "kSGD", "momentum": 0.5, "learning_rate": {"base_lr": 0.1}}
    lines = []
    shoal.fit(tiny_gpt(), next_char_loss, windows(), steps=2, batch_size=8, cluster=layout.fit_cluster(async_momentum=job_pb2.kAsConfigured),
              log=lines.append, updater=singa, workspace=tmp_path / "kept")
    assert lines and not [line for line in lines if line.startswith("updater.momentum")]
    lines.clear()
    cluster = layout.fit_cluster()
    shoal.fit(tiny_gpt(), next_char_loss, windows(), steps=2, batch_size=8, cluster=cluster, log=lines.append,
              updater=singa, workspace=tmp_path / "singa")
    assert [line for line in lines if line.startswith("updater.momentum")] == [
        "updater.momentum 0.5 -> 0 at the servers: 2 asynchronous groups add momentum of their own "
        "(cluster.async_momentum: kAsConfigured keeps the job's)"]
    lines.clear()
    shoal.fit(tiny_gpt(), next_char_loss, windows(), steps=2, batch_size=8, cluster=cluster, log=lines.append,
              optimizer=momentum_sgd, workspace=tmp_path / "torch")
    assert lines and not [line for line in lines if line.startswith("updater.momentum")]
    state = checkpoint.load(checkpoint.checkpoint_file(tmp_path / "torch", 2)).updater_state
    assert all("momentum_buffer" in slots for slots in state.values())  # torch's own momentum, as the user set it


def momentum_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("name, updates", [("in-memory Hogwild, 2 groups", 20),
                                           pytest.param("Downpour, 2 groups + 1 server, 3 processes", 20, marks=pytest.mark.slow)])
def test_an_asynchronous_group_clips_its_own_push(tmp_path, name, updates):
    """Plain SGD moves the params by lr·‖clipped g‖ ≤ 0.1 · 0.01 per server update; unclipped, ‖g‖ is about 1."""
    before = torch.cat([p.detach().reshape(-1) for p in tiny_gpt().parameters()])
    run = dict(steps=10, updater=None, optimizer=plain_sgd, cluster=LAYOUTS[name].fit_cluster())
    clipped, _ = fit(tmp_path, "clipped", clip_grad_norm=0.01, **run)
    free, _ = fit(tmp_path, "free", **run)
    assert_ran(tmp_path / "clipped", name)
    moved = lambda model: float((torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before).norm())
    assert moved(clipped) <= updates * 0.1 * 0.01 * (1 + 1e-4)  # both groups' 10 pushes each
    assert moved(free) > 10 * updates * 0.1 * 0.01


def test_adamw_over_a_compressed_allreduce_applies_the_decoded_sum_everywhere(tmp_path):
    """bf16 gradients: every process holds every slice's AdamW state and applies the owner's decoded sum."""
    _, single = fit(tmp_path, "single", steps=12, updater=None, optimizer=adamw)
    cluster = LAYOUTS[ALLREDUCE].fit_cluster()
    cluster.compression = job_pb2.kBF16
    _, history = fit(tmp_path, "bf16", steps=12, updater=None, optimizer=adamw, cluster=cluster)
    assert train_losses(history)[-1] == pytest.approx(train_losses(single)[-1], rel=1e-3)  # measured 1.5e-5


def test_fit_plans_its_job_once(tmp_path, monkeypatch):
    """The optimizers' layout checks and the run share one plan of the module's net (planning builds it: not three
    times); before it, fit's layout is decided from the session's job (no net: nothing of the module's is placed).
    (DiLoCo's groups in one process run on the session since 2026-11-29: kept on the job path here, which plans them.)"""
    from shoal.frontend import fit as fitting
    from shoal.planning import plan as planning

    monkeypatch.setattr(fitting, "ON_SESSION", fitting.ON_SESSION - {"Local SGD / DiLoCo groups in one process"})
    planned, place = [], planning.place
    monkeypatch.setattr(planning, "place", lambda cluster, sizes, *args, **kw: planned.append(dict(sizes)) or
                        place(cluster, sizes, *args, **kw))
    fit(tmp_path, "diloco", steps=2, cluster=DILOCO_THREADS.fit_cluster(), updater=None, optimizer=adamw, outer_optimizer=nesterov)
    assert_ran(tmp_path / "diloco", DILOCO_THREADS)
    assert [bool(sizes) for sizes in planned] == [False, True]  # the session's job, then the module's net, once
