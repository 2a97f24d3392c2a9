"""Security notes kept true (issue 15): nothing deserialised with pickle, YAML only through safe loading.

The rendezvous store binds to loopback on one host: tests/test_jobs.py checks it with `ss -ltnp`.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"

# what would run code while reading bytes from a file or a socket
UNSAFE = {
    "pickle": re.compile(r"\b(c?[pP]ickle|dill|cloudpickle|joblib)\.(load|loads|Unpickler)\b"),
    "marshal / shelve": re.compile(r"\bmarshal\.loads?\b|\bshelve\.open\b"),
    "torch.load without weights_only=True": re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"),
    "numpy with allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
    "YAML beyond safe loading": re.compile(r"\byaml\.(load|load_all|full_load|unsafe_load|unsafe_load_all)\(|"
                                           r"Loader\s*=\s*yaml\.(Loader|FullLoader|UnsafeLoader)\b"),
}


def unsafe_calls(paths) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            found += [f"{path}:{number}: {what}" for what, pattern in UNSAFE.items() if pattern.search(code)]
    return found


def test_no_source_file_deserialises_pickle_or_unsafe_yaml():
    assert unsafe_calls(sorted(SRC.rglob("*.py"))) == []


def test_the_check_sees_each_unsafe_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("pickle.loads(b)\ntorch.load(f)\nnp.load(f, allow_pickle=True)\nyaml.load(t, Loader=yaml.Loader)\n"
                   "marshal.load(f)\ntorch.load(f, weights_only=True)\nyaml.safe_load(t)\n")
    assert [line.split(": ", 1)[1] for line in unsafe_calls([bad])] == [
        "pickle", "torch.load without weights_only=True", "numpy with allow_pickle", "YAML beyond safe loading", "marshal / shelve"]


def test_a_yaml_job_with_a_python_tag_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    job = tmp_path / "job.yaml"
    job.write_text(f'name: !!python/object/apply:os.system ["touch {marker}"]\ntrain_steps: 2\n')
    proc = subprocess.run([sys.executable, "-m", "shoal", "run", str(job), "--workspace", str(tmp_path / "ws")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{job}:1:7: could not determine a constructor for the tag " \
                                  "'tag:yaml.org,2002:python/object/apply:os.system'"
    assert not marker.exists() and not (tmp_path / "ws").exists()
