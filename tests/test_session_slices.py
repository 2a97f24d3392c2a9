"""Server slices in a user's own loop (AllReduce over processes, cluster.nservers_per_group K > 1, no restarts): each
process holds the user's optimizer's state for its slices alone (ZeRO-1's shape, as the job path's sliced exchange),
the loop trains as one worker with the whole batch does, and a checkpoint holds every slice's state and resumes
exactly, onto another slice count too, and in a loop without slices (and the other way). Driven as a user would: `shoal run script.py --set cluster.…`, real processes.
"""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli_in_process import run_cli
from layouts import LAYOUTS, assert_ran
from shoal.planning.placement import slice_params

# A user's loop with AdamW, a scheduler and clip_grad_norm_. Rank 0 also runs it as plain PyTorch over the whole batch
# of each step; every rank writes its values, the optimizer state it holds (live tensors) and its user optimizer's.
LOOP = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    import torch, shoal
    from safetensors.torch import save_file

    out, stop_after = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, :4].sum(1, keepdim=True) > x[:, 4:].sum(1, keepdim=True)).float()
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # no gradient: no state, no decay
    STEPS, BATCH = 16, 12

    def loss_of(model, xb, yb):
        return torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)

    class NotElementwise(torch.optim.SGD):  # (a class shoal cannot know updates each element alone)
        pass

    def step(opt, sched, params):
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step(); opt.zero_grad(); sched.step()

    run = shoal.session(train_steps=STEPS, disp_freq=4)
    if run.rank == 0 and stop_after < 0:
        import copy
        plain = copy.deepcopy(model)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        for s in range(STEPS):
            start = s * BATCH % len(x)
            loss_of(plain, x[start:start + BATCH], y[start:start + BATCH]).backward()
            step(opt, sched, plain.parameters())
        save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(out / "plain.safetensors"))
    model = run.model(model)
    opt = run.optimizer(NotElementwise(model.parameters(), lr=0.1) if stop_after == -3 else
                        torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    for s, (xb, yb) in run.batches(data, batch_size=BATCH, shuffle=False):
        loss_of(model, xb, yb).backward()
        step(opt, sched, model.parameters())
        run.log(s)
        if s == 7:
            run.checkpoint()
        if s == stop_after:
            sys.exit(3)
        if stop_after == -2 and run.rank == 1 and s == 3:  # process 1 dies: its slices' state with it
            os._exit(9)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{run.rank}.safetensors"))
    (out / f"rank{run.rank}.json").write_text(json.dumps({"state": run.optimizer_state_elements, "users": len(opt.state),
                                                          "lr": opt.param_groups[0]["lr"]}))
''')

SLICES_2 = "AllReduce, 2 processes, 2 server slices"
SLICES_3 = "AllReduce, 3 processes"  # nservers_per_group 3
# the module's trained params in named_parameters order (the Sequential's own first), cut as the plan cuts them
PARAMS = {"unused": 3, "0.weight": 128, "0.bias": 16, "2.weight": 16, "2.bias": 1}
TRAINED = {name: size for name, size in PARAMS.items() if name != "unused"}  # (those with a gradient: with state)


def shoal_run(script: Path, out: Path, workspace: Path, *options: str, stop_after: int = -1):
    out.mkdir(parents=True, exist_ok=True)
    return run_cli("run", str(script), "--workspace", str(workspace), *options, "--", str(out), str(stop_after),
                   cwd=out, timeout=240)


def ended(out: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(out / f"rank{rank}.safetensors")), json.loads((out / f"rank{rank}.json").read_text())


def slices_state(nslices: int, rank: int) -> int:
    """AdamW's state of rank `rank`'s slices: exp_avg and exp_avg_sq per element, a step per slice."""
    return sum(2 * s.size + 1 for s in slice_params(PARAMS, nslices) if s.index == rank and s.param in TRAINED)


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slices") / "loop.py"
    path.write_text(LOOP)
    return path


@pytest.fixture(scope="module")
def sliced(script, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sliced")
    proc = shoal_run(script, out, out / "ws", *LAYOUTS[SLICES_2].cli())
    assert proc.returncode == 0, proc.stderr
    assert_ran(out / "ws", SLICES_2)
    return out


SHARED_RUNS = pytest.mark.xdist_group("session_slices_runs")


@SHARED_RUNS
def test_each_process_holds_its_slices_state_and_the_loop_trains_as_one_worker(sliced):
    plain = load_file(str(sliced / "plain.safetensors"))
    (values0, said0), (values1, said1) = ended(sliced, 0), ended(sliced, 1)
    assert all(torch.equal(values0[k], values1[k]) for k in values0)  # the replicas equal to the bit
    assert all(torch.allclose(values0[k], plain[k], rtol=1e-5, atol=1e-6) for k in plain), "not one worker's values"
    assert torch.equal(values0["unused"], torch.ones(3))  # no gradient: never updated, no weight decay
    # the measured state: each process its slices' AdamW state alone, the user's optimizer none
    whole = 2 * sum(TRAINED.values()) + len(TRAINED)
    assert (said0["state"], said1["state"]) == (slices_state(2, 0), slices_state(2, 1))
    assert said0["users"] == said1["users"] == 0
    assert max(said0["state"], said1["state"]) < 0.6 * whole  # (164 elements cut at 82: each about half)
    # summary.json's bytes_sent: each step's all-reduce of [grads, a flag per param, rows] by both processes, and the
    # all-gather of each process's slices (padded to the longer, 82 elements) to the other
    per_member, gathered = 4 * (sum(PARAMS.values()) + len(PARAMS) + 1), 4 * 82
    assert json.loads((sliced / "ws" / "summary.json").read_text())["bytes_sent"] == 16 * 2 * (per_member + gathered)
    assert said0["lr"] == said1["lr"] == pytest.approx(1e-2 / (1 + 0.1 * 16))  # the user's scheduler ran on both


@SHARED_RUNS
@pytest.mark.slow  # (about 8 s: a stopped run and three resumed ones; tests/test_fit_optim.py's fit resume is slow too)
def test_a_checkpoint_holds_every_slice_and_resumes_exactly_onto_another_slice_count(script, sliced, tmp_path):
    stopped = tmp_path / "stopped"
    proc = shoal_run(script, stopped, stopped / "ws", *LAYOUTS[SLICES_2].cli(), stop_after=9)
    assert proc.returncode != 0
    written = stopped / "ws" / "checkpoint"
    # the chief's file and process 1's part each hold their own slices' state (keys name the param's elements)
    chief = [k for k in load_file(str(written / "step8-worker0.safetensors")) if k.startswith("exchange/slices/")]
    part = [k for k in load_file(str(written / "step8-group0-rank1.safetensors")) if k.startswith("exchange/slices/")]
    for keys, rank in ((chief, 0), (part, 1)):
        assert sorted(keys) == sorted(f"exchange/slices/0/{s.param}/{s.start}:{s.stop}/{slot}"
                                      for s in slice_params(PARAMS, 2) if s.index == rank and s.param in TRAINED
                                      for slot in ("step", "exp_avg", "exp_avg_sq"))
    again = tmp_path / "again"
    proc = shoal_run(script, again, stopped / "ws", *LAYOUTS[SLICES_2].cli(), "--resume")
    assert proc.returncode == 0, proc.stderr
    whole, _ = ended(sliced, 0)
    resumed, _ = ended(again, 0)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole), "a resume onto the same slices is not exact"
    # onto 3 processes and 3 slices: each takes its new slices of the params' state (the rows split 4+4+4, not 6+6)
    three = tmp_path / "three"
    proc = shoal_run(script, three, stopped / "ws", *LAYOUTS[SLICES_3].cli(), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert [ended(three, r)[1]["state"] for r in range(3)] == [slices_state(3, r) for r in range(3)]
    resliced, _ = ended(three, 0)
    assert all(torch.allclose(resliced[k], whole[k], rtol=1e-5, atol=1e-6) for k in whole)
    # a checkpoint of whole params' state (a loop without slices) resumed with slices: each process takes its slices
    replicated = tmp_path / "replicated"
    proc = shoal_run(script, replicated, replicated / "ws", *LAYOUTS["AllReduce, 2 processes"].cli(), stop_after=9)
    onto = tmp_path / "onto-slices"
    proc = shoal_run(script, onto, replicated / "ws", *LAYOUTS[SLICES_2].cli(), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert [ended(onto, r)[1]["state"] for r in range(2)] == [slices_state(2, r) for r in range(2)]
    assert all(torch.equal(ended(onto, 0)[0][k], whole[k]) for k in whole)


@SHARED_RUNS
def test_a_sliced_checkpoint_resumes_in_a_loop_without_slices(script, sliced, tmp_path):
    """Each param's AdamW state assembled from every process's slices (the chief's file and process 1's part) into the
    replicas' own optimizers: the run ends where the sliced one did, to the bit (the same sums, element-wise updates)."""
    workspace = tmp_path / "ws"
    shutil.copytree(sliced / "ws", workspace)
    proc = shoal_run(script, tmp_path / "out", workspace, *LAYOUTS["AllReduce, 2 processes"].cli(), "--resume")
    assert proc.returncode == 0, proc.stderr
    whole, _ = ended(sliced, 0)
    resumed, said = ended(tmp_path / "out", 0)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert said["users"] == 4  # (the replicas' own AdamW holds every trained param's state again)


@pytest.mark.slow  # (about 3 s: a run whose process 1 dies)
def test_a_dead_process_stops_the_job_in_one_line(script, tmp_path):
    """Its slices' optimizer state died with it: the replicated exchange's mean would go on without it, the slices
    cannot (AllReduce.goes_on_without_a_process): the launcher stops the others, saying so, and the job fails."""
    proc = shoal_run(script, tmp_path / "out", tmp_path / "ws", *LAYOUTS[SLICES_2].cli(), stop_after=-2)
    assert proc.returncode != 0
    assert "process 1 (worker(group=0, id=1), server(group=0, id=1)) exited with code 9; the other processes were " \
           "stopped" in proc.stderr, proc.stderr
    assert "go on without" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "rank0.json").exists()


def test_an_optimizer_not_known_element_wise_is_refused_in_one_line_where_a_param_is_cut(script, tmp_path):
    """Slices cut 0.weight over both processes: an update of a slice must read only its elements."""
    proc = shoal_run(script, tmp_path / "out", tmp_path / "ws", *LAYOUTS[SLICES_2].cli(), stop_after=-3)
    assert proc.returncode != 0
    assert ("run.optimizer: NotElementwise is not known to be element-wise, and server slices "
            "(cluster.nservers_per_group 2) cut 0.weight over processes") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_shoal_plan_says_what_server_slices_do_in_a_users_loop(script, tmp_path):
    planned = run_cli("plan", str(script), *LAYOUTS[SLICES_2].cli(), "--", str(tmp_path), "-1", cwd=tmp_path, timeout=60)
    assert "each process updates its slices with your optimizer and holds their state alone" in planned.stdout
    assert "the group cannot go on without a process" in planned.stdout, planned.stdout


THREADS_2X2 = "AllReduce, 2 processes x 2 threads"  # (nservers_per_group 2: each process one server's slices)
THREADS_PARAMS = {"0.weight": 128, "0.bias": 16, "2.weight": 16, "2.bias": 1}  # (tests/test_session_workers.py's module)


@pytest.fixture(scope="module")
def threads_script(tmp_path_factory) -> Path:
    from test_session_workers import LOOP as WORKERS_LOOP

    path = tmp_path_factory.mktemp("slices-threads") / "loop.py"
    path.write_text(WORKERS_LOOP + '(out / f"state{run.rank}.json").write_text(json.dumps(run.optimizer_state_elements))\n')
    return path


def test_threads_of_each_process_share_its_slices_update(threads_script, tmp_path):
    """2 processes x 2 threads: each process updates its slices once a step (its threads meet at opt.step()) and copies
    the values into its other replica; the process's state is its slices' alone, and all 4 replicas are one worker's
    (tests/test_session_workers.py's check: equal to the bit, one worker's to float rounding)."""
    from test_session_workers import check_one_worker

    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli("run", str(threads_script), "--workspace", str(out / "ws"), *LAYOUTS[THREADS_2X2].cli(), "--", str(out),
                   cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    check_one_worker(out, THREADS_2X2)
    held = [json.loads((out / f"state{rank}.json").read_text()) for rank in range(2)]
    assert held == [sum(2 * s.size + 1 for s in slice_params(THREADS_PARAMS, 2) if s.index == rank) for rank in range(2)]
