"""A workspace nobody else can redirect or feed (issue 37, point 3).

What the audit did, as root: `--workspace` naming a link to a folder of root's wrote into that folder; a `.shoal`
link planted in a workspace had its lock and job copy written where it pointed; a workspace folder owned by
`nobody` was accepted, so that nobody could swap in a checkpoint `--resume` then loaded. Each is refused now in one
line naming the path, before anything is written or read; the opt-in (SHOAL_TRUST_WORKSPACE) takes another
user's folder, never a link or a folder every user can write.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import one_line_error, run_cli

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")


def shoal(*args, env=None) -> subprocess.CompletedProcess:
    return run_cli(*args, "--no-progress", env=env, timeout=180)



def contents(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder` (links not followed), with a file's bytes."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else "")
            for p in sorted(folder.rglob("*"))}


def trained(blobs_job, ws: Path) -> Path:
    """A workspace holding a 2-step run of the blobs job; returns the job file."""
    job = blobs_job(train_steps=2)
    proc = shoal("run", job, "--workspace", ws)
    assert proc.returncode == 0, proc.stderr
    return job


def test_a_workspace_that_is_a_link_is_refused_and_nothing_is_written_where_it_points(blobs_job, tmp_path):
    job = blobs_job(train_steps=2)
    target = tmp_path / "roots-only"
    target.mkdir(mode=0o700)
    (target / "passwd").write_text("root:x:0:0\n")
    (tmp_path / "ws").symlink_to(target)
    line = one_line_error(shoal("run", job, "--workspace", tmp_path / "ws"))  # (the umask test below: a real process)
    assert f"workspace {tmp_path / 'ws'}: is a symbolic link (to {target})" in line
    assert contents(target) == {"passwd": b"root:x:0:0\n"}


@pytest.mark.parametrize("planted", [".shoal", "checkpoint", "metrics.jsonl"])
def test_a_link_planted_under_one_of_shoals_names_is_refused_and_its_target_untouched(blobs_job, tmp_path, planted):
    """The audit's `.shoal` link (its lock and job copy overwritten where it pointed), and the checkpoint/ a
    --resume would read from and write into, and metrics.jsonl a run appends to."""
    ws = tmp_path / "ws"
    job = trained(blobs_job, ws)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (ws / planted).rename(elsewhere / planted)  # what the link leads to: a copy of shoal's own, in another folder
    (ws / planted).symlink_to(elsewhere / planted)
    os.lchown(ws / planted, NOBODY, NOBODY) if os.geteuid() == 0 else None  # planted by another user
    before = contents(elsewhere)
    line = one_line_error(shoal("run", job, "--workspace", ws, "--resume", "--set", "train_steps=4"))
    assert f"{ws / planted} is a symbolic link, where shoal keeps its own" in line
    assert contents(elsewhere) == before
    assert not (ws / "checkpoint" / "step4-worker0.safetensors").exists()


def test_testing_does_not_read_a_checkpoint_folder_that_is_a_link(blobs_job, tmp_path):
    ws = tmp_path / "ws"
    job = trained(blobs_job, ws)
    theirs = tmp_path / "theirs"
    (ws / "checkpoint").rename(theirs)
    (ws / "checkpoint").symlink_to(theirs)
    line = one_line_error(shoal("run", job, "--test", "--workspace", ws))
    assert f"{ws / 'checkpoint'} is a symbolic link" in line
    assert not (ws / "visualization" / "test_net.json").exists()


@as_root
def test_a_workspace_another_user_owns_is_refused_unless_trusted(blobs_job, tmp_path):
    """As git refuses a repository another user owns: nobody could swap the checkpoint --resume loads."""
    ws = tmp_path / "ws"
    job = trained(blobs_job, ws)
    for path in [ws, *ws.rglob("*")]:
        os.lchown(path, NOBODY, NOBODY)
    before = contents(ws)
    resume = ("run", job, "--workspace", ws, "--resume", "--set", "train_steps=4")
    line = one_line_error(shoal(*resume))
    assert f"workspace {ws}: is owned by user nobody, not by you or root" in line
    assert "SHOAL_TRUST_WORKSPACE=1" in line
    assert contents(ws) == before
    proc = shoal(*resume, env=dict(os.environ, SHOAL_TRUST_WORKSPACE="1"))
    assert proc.returncode == 0, proc.stderr
    assert (ws / "checkpoint" / "step4-worker0.safetensors").is_file()
    line = one_line_error(shoal("run", job, "--test", "--workspace", ws))  # nor is a checkpoint tested there
    assert f"workspace {ws}: is owned by user nobody" in line


@as_root
def test_a_fresh_folder_another_user_owns_is_refused_before_anything_is_written(blobs_job, tmp_path):
    job, ws = blobs_job(train_steps=2), tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, NOBODY, NOBODY)
    line = one_line_error(shoal("run", job, "--workspace", ws))
    assert "is owned by user nobody" in line and list(ws.iterdir()) == []


@as_root
def test_a_checkpoint_another_user_owns_is_refused(blobs_job, tmp_path):
    """The swapped-in checkpoint itself, in a workspace of this user's."""
    ws = tmp_path / "ws"
    job = trained(blobs_job, ws)
    checkpoint = ws / "checkpoint" / "step2-worker0.safetensors"
    os.chown(checkpoint, NOBODY, NOBODY)
    line = one_line_error(shoal("run", job, "--workspace", ws, "--resume", "--set", "train_steps=4"))
    assert f"{checkpoint} is owned by user nobody" in line


@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_a_workspace_under_a_folder_every_user_can_write_needs_the_sticky_bit(blobs_job, tmp_path, mode):
    """As ssh's StrictModes: without the sticky bit, another user could rename the workspace away and put their own
    in its place; with it (/tmp), nobody can touch an entry of another's."""
    job = blobs_job(train_steps=2)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    ws = shared / "ws"
    proc = shoal("run", job, "--workspace", ws, env=dict(os.environ, SHOAL_TRUST_WORKSPACE="1"))
    if mode & 0o1000:
        assert proc.returncode == 0, proc.stderr
        return
    line = one_line_error(proc)  # the opt-in trusts a user, never every user
    assert f"workspace {ws}: {shared} is writable by every user and has no sticky bit" in line
    assert not ws.exists()


@as_root
def test_a_workspace_under_a_folder_a_group_with_other_members_can_write_is_refused(blobs_job, tmp_path):
    job = blobs_job(train_steps=2)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 0, NOBODY)  # nogroup: nobody's own group, and not root's
    shared.chmod(0o775)
    line = one_line_error(shoal("run", job, "--workspace", shared / "ws"))
    assert f"{shared} is writable by group" in line and "SHOAL_TRUST_WORKSPACE=1" in line
    assert not (shared / "ws").exists()


def test_a_workspace_every_user_can_write_is_refused_even_with_the_sticky_bit(blobs_job, tmp_path):
    ws = tmp_path / "ws"
    job = trained(blobs_job, ws)
    ws.chmod(0o1777)
    line = one_line_error(shoal("run", job, "--workspace", ws, "--resume", "--set", "train_steps=4"))
    assert f"workspace {ws}: is writable by every user" in line


def test_a_link_on_the_way_to_the_workspace_is_followed_where_only_this_user_could_make_it(blobs_job, tmp_path):
    """/var/run -> /run: a link above the workspace, in a folder nobody else can write, is fine."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    trained(blobs_job, tmp_path / "via" / "ws")
    assert (real / "ws" / "checkpoint" / "step2-worker0.safetensors").is_file()


def test_shoals_writers_follow_no_link_planted_after_the_check(tmp_path):
    """The last line of defence, for a link that appears between the check and the write: the lock, the job
    copy, metrics.jsonl and summary.json are opened through no link, and say so in one line."""
    from shoal.launcher.workspace import WorkspaceLock
    from shoal.report.job_copy import write_job_copy
    from shoal.report.metrics import MetricsLog
    from shoal.report.summary import _write
    from shoal.report.writes import WorkspaceWriteError

    ws, target = tmp_path / "ws", tmp_path / "target"
    (ws / ".shoal").mkdir(parents=True)
    target.write_text("root's\n")
    for name in (".shoal/lock", ".shoal/job.conf", "metrics.jsonl", "summary.json.tmp"):
        (ws / name).symlink_to(target)
    writes = {".shoal/lock": lambda: WorkspaceLock(ws, "job").__enter__(),
              ".shoal/job.conf": lambda: write_job_copy("name: 'x'\n", ws),
              "metrics.jsonl": lambda: MetricsLog(ws / "metrics.jsonl"),
              "summary.json.tmp": lambda: _write(ws / "summary.json", {})}
    for name, write in writes.items():
        with pytest.raises(WorkspaceWriteError) as refused:
            write()
        assert str(refused.value) == f"shoal: cannot write {ws / name}: is a symbolic link (shoal follows no link where it writes in a workspace)"
    shutil.rmtree(ws / ".shoal")
    (ws / ".shoal").symlink_to(tmp_path)  # the folder holding the file, as well
    with pytest.raises(WorkspaceWriteError, match="is a symbolic link"):
        write_job_copy("name: 'x'\n", ws)
    assert target.read_text() == "root's\n" and sorted(p.name for p in tmp_path.iterdir()) == ["target", "ws"]


def test_every_writer_in_the_workspace_follows_no_link_planted_after_the_check(blobs_job, tmp_path):
    """The rank logs, the net drawing, a checkpoint (its temp file and its name), TensorBoard's folder and the
    summary a rejoin rewrites: each writer, called as a run calls it with a link planted at its name, refuses in
    one line and leaves the link's target as it was."""
    import torch

    from shoal.frontend import api
    from shoal.launcher.ranks import rank_output
    from shoal.launcher.rejoin import add_rejoins_to_summary
    from shoal.neuralnet import checkpoint as ckpt_io
    from shoal.planning.plan import plan_job
    from shoal.report.tensorboard import TensorBoardLog
    from shoal.report.writes import NOT_FOLLOWED, WorkspaceWriteError
    from shoal.runtime.visualization import write_train_net

    plan = plan_job(api.load_job(blobs_job(train_steps=2)))
    ws, target = tmp_path / "ws", tmp_path / "target"
    target.write_text("root's\n")
    for folder in ("logs", "visualization", "checkpoint"):
        (ws / folder).mkdir(parents=True)
    (ws / "logs" / "rejoins.jsonl").write_text('{"time": 1e10}\n')
    (ws / "summary.json").write_text("{}\n")

    def checkpoint():
        ckpt_io.save(ckpt_io.checkpoint_file(ws, 2), ckpt_io.Checkpoint(step=2, params={"w": torch.ones(3)}))

    def rank_log():
        with rank_output(ws, 0):
            pass

    writes = {"logs/rank0.log": rank_log,
              "visualization/train_net.json": lambda: write_train_net(plan, ws, fresh=False),
              "checkpoint/step2-worker0.safetensors.tmp": checkpoint,
              "checkpoint/step2-worker0.safetensors": checkpoint,
              "summary.json.tmp": lambda: add_rejoins_to_summary(ws, since=0)}
    if importlib.util.find_spec("tensorboard"):  # its event file TensorBoard opens itself, in a folder shoal checks
        writes["tensorboard"] = lambda: TensorBoardLog(ws)
    for name, write in writes.items():
        (ws / name).symlink_to(target)
        with pytest.raises(WorkspaceWriteError) as refused:
            write()
        assert str(refused.value) == f"shoal: cannot write {ws / name}: {NOT_FOLLOWED}", name
        (ws / name).unlink()
    assert not (ws / "checkpoint" / "step2-worker0.safetensors.tmp").exists()  # the temp is not left behind
    for folder in ("logs", "visualization", "checkpoint"):  # the folder holding the file, as well
        shutil.rmtree(ws / folder)
        (ws / folder).symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    for name in ("logs/rank0.log", "visualization/train_net.json", "checkpoint/step2-worker0.safetensors"):
        with pytest.raises(WorkspaceWriteError) as refused:
            writes[name]()
        assert str(refused.value).startswith(f"shoal: cannot write {ws / name.split('/')[0]}: {NOT_FOLLOWED}"), name
    assert target.read_text() == "root's\n" and list((tmp_path / "elsewhere").iterdir()) == []


def test_a_rejoin_by_hand_checks_the_workspace_before_it_reads_the_secret(blobs_job, tmp_path):
    """`shoal run JOB --rejoin RANK` reads logs/job.secret and logs/store.json and writes logs/: a logs/ planted as a
    link (to another job's secret and store) is refused as a run refuses it, before anything is read there."""
    job = blobs_job(train_steps=10, layout="Downpour, 2 groups + 1 server, 3 processes")
    ws, theirs = tmp_path / "ws", tmp_path / "theirs"
    ws.mkdir()
    theirs.mkdir()
    (theirs / "store.json").write_text('{"host": "127.0.0.1", "port": 9, "nnodes": 1, "interface": null}\n')
    (ws / "logs").symlink_to(theirs)
    before = contents(theirs)
    line = one_line_error(shoal("run", job, "--workspace", ws, "--rejoin", "1"))
    assert f"workspace {ws}: {ws / 'logs'} is a symbolic link, where shoal keeps its own folder" in line
    assert contents(theirs) == before


@as_root
def test_a_rejoin_by_hand_into_a_workspace_another_user_owns_is_refused(blobs_job, tmp_path):
    job = blobs_job(train_steps=10, layout="Downpour, 2 groups + 1 server, 3 processes")
    ws = tmp_path / "ws"
    (ws / "logs").mkdir(parents=True)
    (ws / "logs" / "store.json").write_text('{"host": "127.0.0.1", "port": 9, "nnodes": 1, "interface": null}\n')
    for path in (ws, ws / "logs", ws / "logs" / "store.json"):
        os.chown(path, NOBODY, NOBODY)
    line = one_line_error(shoal("run", job, "--workspace", ws, "--rejoin", "1"))
    assert f"workspace {ws}: is owned by user nobody, not by you or root" in line


@pytest.mark.parametrize("layout", ["single worker", pytest.param("AllReduce, 2 processes", marks=pytest.mark.slow)])
def test_under_a_umask_of_000_shoals_own_output_passes_its_own_check(blobs_job, tmp_path, layout):
    """Every folder and file shoal makes has its own mode (0755, 0644), which a umask can narrow but not widen: a
    run under umask 000 (or 002 with a shared group) leaves nothing another user may write, so --resume takes it.
    Over 2 processes: the rank logs, and TensorBoard's event file where the package is installed."""
    job = blobs_job(train_steps=2, layout=layout)
    ws = tmp_path / "runs" / "ws"  # its parent made by the run too
    launched = layout != "single worker"
    tensorboard = ["--tensorboard"] if launched and importlib.util.find_spec("tensorboard") else []
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(ws), "--no-progress",
                           *tensorboard], capture_output=True, text=True, timeout=180, preexec_fn=lambda: os.umask(0))
    assert proc.returncode == 0, proc.stderr
    writable = [f"{p} {stat.S_IMODE(p.lstat().st_mode):o}" for p in [ws.parent, ws, *ws.rglob("*")]
                if p.lstat().st_mode & 0o022]
    assert writable == []
    if launched:
        assert {"rank0.log", "rank1.log"} <= {p.name for p in (ws / "logs").iterdir()}
    proc = shoal("run", job, "--workspace", ws, "--resume", "--set", "train_steps=4")
    assert proc.returncode == 0, proc.stderr
    assert (ws / "checkpoint" / "step4-worker0.safetensors").is_file()
