"""Nothing of the working folder runs (issue 37): a job run in a folder that came with it, holding packages named as
the ones shoal imports, imports none of them.

Python puts the working folder first on the import path of `python -m` and `python -c`: the .proto compiler (once
`python -m grpc_tools.protoc`), `python -m shoal` itself, and multiprocessing's forkserver (`python -c ...`), which the
ranks fork from. Each planted package's __init__.py leaves a mark when it is imported.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mlp_job_text

PLANTED = ("grpc_tools", "google", "google/protobuf", "torch")
MARK = "import pathlib\n(pathlib.Path(__file__).resolve().parents[{depth}] / 'ran-{name}').write_text('imported')\n"
NOTE_PROTO = 'import "job.proto";\nextend singa.LayerProto {\n  optional int32 note_conf = 1090;\n}\n'
SHOAL = {  # how a user starts shoal: the console script pip installed, or the package as a module
    "shoal": [str(Path(sys.executable).with_name("shoal"))],
    "python -m shoal": [sys.executable, "-m", "shoal"],
}


@pytest.fixture
def folder(tmp_path, blobs_dir) -> Path:
    """A working folder as a job could come in: its job file, its .proto plugin, and packages shoal must not import."""
    work = tmp_path / "downloaded"
    for name in PLANTED:
        package = work / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(MARK.format(depth=name.count("/") + 1, name=name.replace("/", ".")))
    (work / "note.proto").write_text(NOTE_PROTO)
    (work / "job.conf").write_text('plugin: "note.proto"\n' + mlp_job_text(blobs_dir, train_steps=4, layout="AllReduce, 2 processes"))
    return work


def shoal(how: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*SHOAL[how], *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=240)


def marks(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("ran-*"))


@pytest.mark.parametrize("how", SHOAL)
def test_plan_compiles_the_jobs_proto_without_importing_the_working_folder(folder, how):
    if not Path(SHOAL[how][0]).exists():
        pytest.skip("the shoal console script is not installed beside this interpreter")
    proc = shoal(how, "plan", "job.conf", cwd=folder)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "AllReduce" in proc.stdout, proc.stdout
    assert marks(folder) == []


def test_a_run_over_processes_imports_nothing_from_the_working_folder(folder):
    # the launcher, its forkserver and both ranks (each compiles note.proto again as it decodes the job)
    proc = shoal("python -m shoal", "run", "job.conf", "--workspace", "ws", cwd=folder)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (folder / "ws" / "logs" / "rank1.log").exists()
    assert marks(folder) == []


@pytest.mark.slow  # a fresh calibration: two processes forked from a forkserver probe the link (~10 s)
def test_the_calibrations_probes_import_nothing_from_the_working_folder(folder):
    proc = shoal("shoal", "plan", "job.conf", "--estimate", cwd=folder)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert marks(folder) == []
