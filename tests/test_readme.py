"""README.md's commands, in the order a newcomer types them, work as written.

The fast test reads the README: every command is one the CLI takes, naming files that exist, and
the demo hands over to the README's tour. The slow test (`-m slow`, about a minute) runs every
command in a copy of the working tree (tracked and new files, as a fresh clone of it would hold),
with the MNIST MLP narrowed so that the steps take milliseconds: only the widths change, so the
commands, step counts, workspaces and files are the README's own.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import MNIST_IDX, REPO

README = REPO / "README.md"
# ./scripts/test.sh runs this suite: the walk would run itself
NOT_WALKED = {"./scripts/test.sh"}
# the Ciresan MLP's widths, narrowed for the walk (the README's steps on the full width take ~20 min)
NARROW = {"num_output: 2500": "num_output: 64", "num_output: 2000": "num_output: 48", "num_output: 1500": "num_output: 32",
          "num_output: 1000": "num_output: 32", "num_output: 500": "num_output: 16"}
NARROW_SCRIPT = {"(2500, 2000, 1500, 1000, 500)": "(64, 48, 32, 32, 16)"}


def blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced code block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def runnable() -> list[tuple[str, str]]:
    """What the walk runs, in order: ("bash", one command) or ("python", a self-contained snippet)."""
    steps = []
    for language, text in blocks():
        if language == "bash":
            for line in text.splitlines():
                command = line.split("  #")[0].strip()
                if command and command not in NOT_WALKED:
                    steps.append(("bash", command))
        elif language == "python" and text.startswith("import "):  # the fit sketch uses the reader's own data
            steps.append(("python", text))
    return steps


def test_readme_commands_are_ones_the_cli_takes():
    from shoal.frontend.cli import build_parser

    commands = [c for kind, c in runnable() if kind == "bash"]
    assert commands[:2] == ["./scripts/demo.sh", "source .venv/bin/activate"]
    for command in commands[2:]:
        words = shlex.split(command)
        assert words[0] == "shoal", command
        args, extra = build_parser().parse_known_args(words[1:])
        assert not extra or (args.command == "run" and args.job.suffix == ".py"), command  # a script's own flags
        for word in words[1:]:
            if re.fullmatch(r"examples/\S+\.(conf|py|yaml)", word):
                assert (REPO / word).exists(), command


def test_the_demo_hands_over_to_the_readme_tour():
    """The demo trains into the job's own workspace and prints the README's next commands."""
    demo = (REPO / "scripts" / "demo.sh").read_text()
    job = (REPO / "examples" / "mnist" / "job.conf").read_text()
    workspace = re.search(r'workspace: "([^"]+)"', job).group(1)
    assert f"workspace={workspace}\n" in demo
    assert "shoal run examples/mnist/job.conf --set train_steps=300" in demo
    message = demo.split("<<NEXT\n")[1].split("\nNEXT")[0]
    printed = [line.split("  #")[0].strip() for line in message.splitlines() if line.startswith("  ")]
    commands = [c for kind, c in runnable() if kind == "bash"]
    assert printed == [c for c in commands if c in printed] == commands[1:4]


def copy_of_working_tree(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    for shared in (".venv", ".data"):  # what scripts/setup.sh made: a clone's set-up would download it again
        (dest / shared).symlink_to(REPO / shared)
    for name, narrowing in (("examples/mnist/job.conf", NARROW), ("examples/mnist/mlp.py", NARROW_SCRIPT)):
        text = (dest / name).read_text()
        for wide, narrow in narrowing.items():
            assert text.count(wide) == 1, (name, wide)
            text = text.replace(wide, narrow)
        (dest / name).write_text(text)
    return dest


def setup_is_current() -> bool:
    """The shared venv was set up from these dependency files (else the copy's set-up would reinstall into it)."""
    wanted = hashlib.sha256((REPO / "requirements-dev.txt").read_bytes() + (REPO / "pyproject.toml").read_bytes()).hexdigest()
    stamp = REPO / ".venv" / ".shoal-setup"
    return stamp.exists() and stamp.read_text().strip() == wanted


@pytest.mark.slow
def test_following_the_readme_in_order(tmp_path):
    if not (MNIST_IDX / "t10k-labels-idx1-ubyte").exists():
        pytest.skip("MNIST IDX files not installed (scripts/setup.sh installs them with npm)")
    if not setup_is_current():
        pytest.fail("run ./scripts/setup.sh first: the venv predates requirements-dev.txt or pyproject.toml")
    repo = copy_of_working_tree(tmp_path / "shoal")
    steps = runnable()
    script = ["set -euo pipefail"]
    for i, (kind, text) in enumerate(steps):
        script.append(f"echo '::: step {i}'")
        script.append(text if kind == "bash" else f"python - <<'PYTHON'\n{text}PYTHON")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"  # as a new shell: `shoal` only once the venv is activated
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    parts = re.split(r"^::: step (\d+)\n", proc.stdout, flags=re.M)
    out = {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}
    last = max(out, default=-1)
    assert proc.returncode == 0, f"README step {last} failed: {steps[last][1]!r}\n{proc.stderr[-3000:]}"
    assert last == len(steps) - 1

    def output_of(prefix: str) -> str:
        return next(out[i] for i, (_, text) in enumerate(steps) if text.startswith(prefix))

    ws = repo / "workspace"
    assert "Trained 300 steps" in output_of("./scripts/demo.sh") and "Next (README.md goes on from here)" in output_of("./scripts/demo.sh")
    tested = output_of("shoal run examples/mnist/job.conf --test")
    test_line = next(line for line in tested.splitlines() if line.startswith("Test @ step 300"))
    assert test_line in output_of("./scripts/demo.sh").splitlines()  # the demo's own final test, figure for figure
    assert "on 1000 test samples (test_steps 10 × batch 100): the same samples as the run's own test at step 300" in tested
    assert "Trained 700 steps (300 → 1000)" in output_of("shoal run examples/mnist/job.conf --resume")
    assert (ws / "mnist-mlp" / "checkpoint" / "step1000-worker0.safetensors").exists()
    assert json.loads((ws / "mlp-allreduce" / "summary.json").read_text())["label"] == "AllReduce, 2 workers, 2 processes"
    assert (ws / "mlp-py" / "checkpoint" / "step100-worker0.safetensors").exists()
    assert "process" in output_of("shoal plan")
    assert (repo / "net.png").stat().st_size > 0 and (repo / "runs.png").stat().st_size > 0
    assert output_of("shoal jobs list").count("mlp") >= 4
    assert "accuracy" in output_of("import shoal") and (ws / "mlp-python" / "summary.json").exists()
    compared = output_of("shoal compare")
    assert "single worker" in compared and "AllReduce" in compared
