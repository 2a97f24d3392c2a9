"""`shoal run script.py` (SINGA's singa-run.sh -exec): a Python program run with the command line's cluster settings."""
from __future__ import annotations

import json

import pytest
from cli_in_process import run_cli
from conftest import REPO

from shoal.neuralnet import checkpoint as ckpt_io
from shoal.frontend.cli import main

NARROW = [f"--set=neuralnet.layer[name=fc{k}].innerproduct_conf.num_output=32" for k in range(1, 6)]  # the MLP at 784-32×5-10


def records(workspace):
    return [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]


def test_mlp_script_runs_on_the_cluster_the_command_line_sets(mnist_dir, tmp_path):
    ws = tmp_path / "ws"
    # in this process, as `shoal run` (the 2 ranks are real processes): no interpreter started and torch imported for it
    proc = run_cli("run", REPO / "examples" / "mnist" / "mlp.py", "--workspace", ws, *NARROW, "--set", "train_steps=4",
                   "--set", "test_steps=2", "--set", "cluster.nworkers_per_group=2", "--data", mnist_dir, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((ws / "summary.json").read_text())
    # mlp.py asks for one worker in one process; the command line made it a 2-process AllReduce group
    assert (summary["framework"], summary["processes"], summary["workers"], summary["train_steps"]) == ("AllReduce", 2, 2, 4)
    assert summary["cluster"]["nworkers_per_group"] == 2 and summary["status"] == "finished"
    assert [(r["phase"], r["step"]) for r in records(ws)] == [("test", 0), ("train", 0), ("test", 4)]
    assert ckpt_io.load(ckpt_io.latest(ws)).params["w1"].shape == (32, 784)
    assert "{4: {'loss': " in proc.stdout  # the script's own evaluate() found the checkpoint in --workspace


def test_every_job_a_script_trains_gets_the_settings(blobs_job, tmp_path, capsys):
    """shoal.train in a script: --set applies, --workspace wins over the workspace the script passes, --resume continues."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, shoal\n"
        "if __name__ == '__main__':\n"
        f"    history = shoal.train({str(blobs_job(train_steps=30))!r}, workspace=sys.argv[1], log=lambda line: None)\n"
        "    print('steps', max(r['step'] for r in history.records))\n"
    )
    assert main(["run", str(script), "--set", "train_steps=10", "--workspace", str(tmp_path / "given"), str(tmp_path / "ignored")]) == 0
    assert "steps 10" in capsys.readouterr().out
    assert ckpt_io.latest(tmp_path / "given").name == "step10-worker0.safetensors" and not (tmp_path / "ignored").exists()
    assert main(["run", str(script), "--set", "train_steps=15", "--workspace", str(tmp_path / "given"), "--resume", "--", str(tmp_path / "ignored")]) == 0
    assert "steps 15" in capsys.readouterr().out
    assert ckpt_io.latest(tmp_path / "given").name == "step15-worker0.safetensors"
    steps = [(r["phase"], r["step"]) for r in records(tmp_path / "given")]
    assert steps == [("test", 0), ("train", 0), ("train", 5), ("test", 10), ("resume", 10), ("train", 10), ("test", 15)]  # on from step 10


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "no such script"),
        ("x = (\n", "script.py:1: SyntaxError: '(' was never closed"),
        ("def f():\n    return {}['k']\n\nf()\n", "script.py:2: KeyError: 'k'"),
        ("raise RuntimeError('\\n  Some tensors share memory')\n", "script.py:1: RuntimeError: Some tensors share memory"),  # text after a newline
        ("import shoal\nshoal.train({'name': 'x'}, log=print)\n", "--set clusterr.nworkers_per_group=2: JobProto has no field 'clusterr'"),
    ],
)
def test_a_missing_or_broken_script_is_one_line_and_a_failure(tmp_path, capsys, text, message):
    script = tmp_path / "script.py"
    if text is not None:
        script.write_text(text)
    status = main(["run", str(script), "--set", "clusterr.nworkers_per_group=2"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert message in err


def test_job_file_options_are_refused_for_scripts(tmp_path, capsys):
    (tmp_path / "script.py").write_text("")
    assert main(["run", str(tmp_path / "script.py"), "--test"]) == 2
    assert "--test only for job files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(tmp_path / "job.conf"), "--steps", "3"])  # unknown arguments go to scripts only
