"""No code from data (issue 27): a job (file, dict, `--set plugin=`) may name .proto plugins, which are
declarative; a .py plugin runs only when the user gives it (`--plugin`, `shoal.load_plugins`,
`shoal.load_job(..., plugins=)`). A plugin that exits, raises or is interrupted at import is one line
naming it, exit 2. The positive paths (SINGA's rnnlm through the CLI, a plugin layer trained over
processes) are in tests/test_plugins.py; here the refusals, and what the user's own word allows.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import run_cli
from conftest import REPO

import shoal
from shoal.config import JobError, job_pb2
from shoal.config.loader import job_from_dict
from shoal.config.plugins import PluginRefused

# what a downloaded job could bring along: code that leaves a mark, then ends the process "successfully"
EVIL = """\
import pathlib, sys
pathlib.Path(__file__).with_name("marker").write_text("evil.py ran")
sys.exit(0)
"""


def shoal_process(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


def side_by_side(*commands) -> list[subprocess.CompletedProcess]:
    """`python -m shoal ARGS` for each ARGS, the processes running at the same time (their start-ups overlap)."""
    started = [subprocess.Popen([sys.executable, "-m", "shoal", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for args in commands]
    done = []
    for proc in started:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "evil.py").write_text(EVIL)
    (tmp_path / "job.conf").write_text('name: "x"\nplugin: "evil.py"\n')
    (tmp_path / "job.yaml").write_text("name: x\nplugin: [evil.py]\n")
    (tmp_path / "plain.conf").write_text('name: "x"\n')
    return tmp_path


FORMS = {  # how a job names the plugin -> (arguments, where the one line points)
    "job.conf": (["job.conf"], "job.conf:2:9: "),
    "job.yaml": (["job.yaml"], "job.yaml:2:10: plugin[0]: "),
    "--set plugin=": (["plain.conf", "--set", "plugin=evil.py"], "--set plugin=evil.py: "),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("command", ["plan", "viz", "run"])
def test_a_job_naming_a_py_plugin_is_refused_and_runs_nothing(folder, command, form):
    args, where = FORMS[form]
    before = sorted(p.name for p in folder.iterdir())
    proc = run_cli(command, *args, cwd=folder)
    assert proc.returncode == 2, proc
    assert proc.stderr == (f'{where}plugin "evil.py": a job may name only .proto plugins, since a .py plugin runs code; '
                           f"pass it yourself: --plugin {folder / 'evil.py'} (shoal run, plan, viz; Python: shoal.load_plugins)\n")
    assert sorted(p.name for p in folder.iterdir()) == before  # no marker, no workspace: nothing written
    assert "evil" not in sys.modules


def test_the_refusal_holds_in_a_real_process(folder):
    proc = shoal_process("run", "job.conf", cwd=folder)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--plugin" in proc.stderr, proc.stderr
    assert not (folder / "marker").exists()


def test_the_same_plugin_given_on_the_command_line_runs(folder):
    # the user's word: plan runs it (here it exits at import: one line naming it, never exit 0)
    proc = shoal_process("plan", "job.conf", "--plugin", "evil.py", cwd=folder)
    assert (folder / "marker").read_text() == "evil.py ran"
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"{folder / 'evil.py'}:3: cannot load plugin: it exits at import (SystemExit: 0)\n"


@pytest.mark.parametrize(
    "body, said",
    [
        ("import sys\nsys.exit(3)\n", "it exits at import (SystemExit: 3)"),
        ("raise SystemExit\n", "it exits at import (SystemExit: None)"),
        ("x = 1\nraise KeyboardInterrupt\n", "KeyboardInterrupt at import"),
        ("import os\nos.environ['HOME'] + 1\n", "TypeError: can only concatenate str (not \"int\") to str"),
    ],
    ids=["sys.exit(3)", "SystemExit", "KeyboardInterrupt", "raises"],
)
def test_a_plugin_that_exits_or_raises_at_import_is_one_line_naming_it(blobs_job, tmp_path, body, said):
    job = blobs_job()
    (tmp_path / "quits.py").write_text(body)
    proc = run_cli("plan", job, "--plugin", tmp_path / "quits.py")  # (a real process: the sys.exit(0) test above)
    line = body.count("\n")
    assert (proc.returncode, proc.stdout) == (2, ""), proc
    assert proc.stderr == f"{tmp_path / 'quits.py'}:{line}: cannot load plugin: {said}\n"


def test_a_given_py_plugin_that_the_job_also_names_is_accepted(blobs_job, tmp_path):
    # SINGA-style job that names its own layer module, or the workspace's job copy: the user gives the file
    (tmp_path / "trusted_marks.py").write_text('import pathlib\npathlib.Path(__file__).with_name("marked").write_text("yes")\n')
    job = blobs_job(extra='plugin: "trusted_marks.py"')
    with pytest.raises(JobError, match=r'job\.conf:\d+:9: plugin "trusted_marks\.py": a job may name only \.proto plugins'):
        shoal.load_job(job)
    assert not (tmp_path / "marked").exists()
    loaded = shoal.load_job(job, plugins=[tmp_path / "trusted_marks.py"])
    assert (tmp_path / "marked").read_text() == "yes"
    assert str(tmp_path / "trusted_marks.py") in loaded.plugin  # the processes it spawns load it too
    assert shoal.train(loaded, tmp_path / "ws").records  # a JobProto naming a plugin the user loaded trains


def test_the_python_api_refuses_what_a_file_would_bring(folder):
    with pytest.raises(JobError, match=r'^<python>: plugin\[0\]: plugin "evil.py": a job may name only \.proto plugins'):
        job_from_dict({"name": "x", "plugin": ["evil.py"]}, job_dir=folder)
    proto = job_pb2.JobProto(name="x", plugin=[str(folder / "evil.py")])  # e.g. text_format.Parse of a downloaded file
    with pytest.raises(PluginRefused):
        shoal.train(proto, folder / "ws")
    assert not (folder / "marker").exists() and not (folder / "ws").exists()


def test_a_link_named_proto_to_a_module_is_refused(folder):
    (folder / "layers.proto").symlink_to(folder / "evil.py")
    (folder / "linked.conf").write_text('name: "x"\nplugin: "layers.proto"\n')
    proc = run_cli("plan", "linked.conf", cwd=folder)
    assert proc.returncode == 2 and not (folder / "marker").exists()
    assert proc.stderr == ('linked.conf:2:9: plugin "layers.proto": a plugin is a Python module (.py) or a protobuf schema (.proto); '
                           f"this is a link to {folder / 'evil.py'}\n")


def test_a_proto_importing_an_unloaded_proto_is_refused_before_its_code_is_imported(tmp_path):
    # generated code imports `other_pb2` from sys.path: with `python -m`, the working directory
    (tmp_path / "other.proto").write_text("message Other { optional int32 x = 1; }\n")
    (tmp_path / "other_pb2.py").write_text('import pathlib\npathlib.Path("marker").write_text("other_pb2.py ran")\n')
    (tmp_path / "uses.proto").write_text('import "other.proto";\nmessage Uses { optional Other o = 1; }\n')
    (tmp_path / "job.conf").write_text('name: "x"\nplugin: "uses.proto"\n')
    proc = shoal_process("plan", "job.conf", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "marker").exists(), proc
    assert proc.stderr == (f'{tmp_path / "uses.proto"}: imports "other.proto", which no loaded plugin provides; '
                           "name that .proto as a plugin before this one\n")


def test_singas_rnnlm_job_is_planned_with_its_plugins_given():
    rnnlm = REPO / "examples" / "rnnlm"
    # the two commands side by side, each in a fresh process; the second without the plugins: the extension it cannot
    # read, and how to load it
    proc, unplugged = side_by_side(("plan", rnnlm / "job.conf", "--plugin", rnnlm / "rnnlm.proto", "--plugin", rnnlm / "rnnlm.py"),
                                   ("plan", rnnlm / "job.conf"))
    assert proc.returncode == 0, proc.stderr
    assert "data, embedding, hidden, loss" in proc.stdout and "113,325 param elements" in proc.stdout, proc.stdout
    assert unplugged.returncode == 2 and "[data_conf]" in unplugged.stderr and "--plugin" in unplugged.stderr, unplugged.stderr
