"""char-rnn: `shoal prepare text`, GRU training by kBPTT over unrolled copies, and sampling.

The corpus is Python's own standard library (real text, on every machine with Python);
the jobs are examples/char-rnn/{job,sample}.conf with a narrower GRU and fewer steps.
"""
from __future__ import annotations

import math
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import torch
from cli_in_process import run_cli
from conftest import REPO

import shoal
from layouts import LAYOUTS, assert_ran
from shoal.neuralnet import checkpoint as ckpt_io
from shoal.data.prepare_text import unigram_entropy_bits

EXAMPLES = REPO / "examples" / "char-rnn"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
QUIET = {"log": lambda *a: None}
GROUPS = {  # synchronous 2-worker groups: threads of one process, or two processes (rows of tests/layouts.py)
    "2 threads": "in-memory Sandblaster, 2 threads",
    "2 processes": "AllReduce, 2 processes",
}


def shoal_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600, check=False)


@pytest.fixture(scope="session")  # not rebuilt when xdist interleaves another module's tests (loadgroup keeps its tests on one worker)
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    result = shoal_cli("prepare", "text", STDLIB, "--pattern", "*.py", "--max-chars", 400_000, "--out", out)
    assert result.returncode == 0, result.stderr
    return out


def vocab_sized(corpus) -> list[str]:
    """The net's ids sized to this corpus (the example's 101 leave ids no character has, which sampling may pick:
    how many depends on the Python whose stdlib is the corpus)."""
    size = len((corpus / "vocab.txt").read_text(encoding="utf-8"))
    return [f"neuralnet.layer[name=onehot].onehot_conf.vocab_size={size}",
            f"neuralnet.layer[name=ip1].innerproduct_conf.num_output={size}"]


def char_rnn_job(corpus, workspace, steps=150, hidden=64, unroll=20, extra=()):
    sets = [
        f"neuralnet.layer[0].char_rnn_conf.path={corpus / 'train.txt'}",
        f"neuralnet.layer[1].char_rnn_conf.path={corpus / 'test.txt'}",
        *(f"neuralnet.layer[{i}].char_rnn_conf.vocab_path={corpus / 'vocab.txt'}" for i in (0, 1)),
        *(f"neuralnet.layer[{i}].char_rnn_conf.unroll_len={unroll}" for i in (0, 1)),
        f"neuralnet.unroll_len={unroll}",
        f"neuralnet.layer[name=gru1].gru_conf.dim_hidden={hidden}",
        *vocab_sized(corpus),
        "updater.learning_rate.base_lr=0.01",
        f"train_steps={steps}",
        "test_freq=50",
        "test_steps=4",
        "disp_freq=10",
        f"cluster.workspace={workspace}",
        # small per-step ops: one intra-op thread per worker is faster, and far faster on a busy machine
        "num_openblas_threads=1",
    ]
    return shoal.load_job(EXAMPLES / "job.conf", sets + list(extra))


@pytest.fixture(scope="session")  # not rebuilt when xdist interleaves another module's tests (loadgroup keeps its tests on one worker)
def trained(corpus, tmp_path_factory):
    workspace = tmp_path_factory.mktemp("char-rnn") / "ws"
    history = shoal.train(char_rnn_job(corpus, workspace), **QUIET)
    return workspace, history


# -- prepare text ------------------------------------------------------------------------
def test_prepare_text_writes_the_corpus_split_and_its_vocabulary(corpus):
    train, test, vocab = ((corpus / f"{n}.txt").read_text(encoding="utf-8") for n in ("train", "test", "vocab"))
    assert len(train) + len(test) == 400_000 and len(test) == 20_000
    assert vocab == "".join(sorted(set(train + test)))  # every character once, in code-point order
    assert train.startswith(min(STDLIB.rglob("*.py")).read_text(encoding="utf-8")[:1000])


def test_prepare_text_refuses_to_overwrite_and_names_missing_sources(corpus, tmp_path):
    before = (corpus / "train.txt").stat().st_mtime_ns
    result = shoal_cli("prepare", "text", STDLIB / "os.py", "--out", corpus)
    assert result.returncode == 2 and "already exists" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert (corpus / "train.txt").stat().st_mtime_ns == before
    result = shoal_cli("prepare", "text", tmp_path / "nope.txt", "--out", tmp_path / "out")
    assert result.returncode == 2 and "nope.txt: no such file" in result.stderr


@pytest.mark.parametrize("text", ["aaaa", "abab", "aabc", "the quick brown fox"])
def test_unigram_entropy(text):
    counts = Counter(text)
    assert unigram_entropy_bits(text) == pytest.approx(-sum(c / len(text) * math.log2(c / len(text)) for c in counts.values()))


# -- training ----------------------------------------------------------------------------
@pytest.mark.xdist_group("char_rnn_trained")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_loss_falls_well_below_the_unigram_entropy(corpus, trained):
    """A model that ignores context cannot beat the unigram entropy; the GRU must."""
    _, history = trained
    entropy = unigram_entropy_bits((corpus / "train.txt").read_text(encoding="utf-8"))
    bits = [r["loss"] / math.log(2) for r in history.phase("test")]
    assert bits[0] > entropy  # random init: worse than unigram
    assert bits[-1] < 0.8 * entropy, (bits, entropy)
    train_bits = [r["loss"] / math.log(2) for r in history.phase("train")]
    assert sum(train_bits[-3:]) / 3 < 0.8 * entropy


@pytest.mark.xdist_group("char_rnn_trained")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_unrolled_copies_share_one_set_of_params(trained):
    workspace, _ = trained
    params = ckpt_io.load(ckpt_io.latest(workspace)).params
    assert sorted(params) == sorted(["z_hx", "r_hx", "c_hx", "z_hh", "r_hh", "c_hh", "z_b", "r_b", "c_b", "w", "b"])


@pytest.mark.parametrize("layout", GROUPS)
def test_two_workers_train_the_same_char_rnn_as_one(corpus, tmp_path, layout):
    params = []
    for name, row in (("one", "single worker"), ("two", GROUPS[layout])):
        job = char_rnn_job(corpus, tmp_path / name, steps=6, hidden=32, unroll=8, extra=["test_steps=0"] + LAYOUTS[row].overrides())
        shoal.train(job, **QUIET)
        assert_ran(tmp_path / name, row)
        params.append(ckpt_io.load(ckpt_io.latest(tmp_path / name)).params)
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=1e-5, atol=1e-6)


# -- sampling ----------------------------------------------------------------------------
def sample(corpus, workspace, steps, argsort="sample: true"):
    conf = (EXAMPLES / "sample.conf").read_text().replace("sample: true", argsort)
    job = workspace.parent / "sample.conf"
    job.write_text(conf)
    result = run_cli(  # in this process: no interpreter and torch import per sampling (the corpus's are real processes)
        "run", job, "--test", "--workspace", workspace.parent / "sampling",
        "--set", f"checkpoint_path={workspace}",
        "--set", "neuralnet.layer[name=gru1].gru_conf.dim_hidden=64",
        "--set", f"neuralnet.layer[name=sampling].char_rnn_conf.vocab_path={corpus / 'vocab.txt'}",
        *(arg for setting in vocab_sized(corpus) for arg in ("--set", setting)),
        "--set", f"test_steps={steps}",
    )
    assert result.returncode == 0, result.stderr
    # the checkpoint line comes first; the generated text runs up to the closing "Test @ step" line
    out = result.stdout
    start = out.index("\n", out.index("Load from checkpoint")) + 1
    text = out[start : out.rindex("Test @ step")]
    assert text.endswith("\n")  # the sampler ends the line of text before its display line
    return text[:-1]


@pytest.mark.xdist_group("char_rnn_trained")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_sampling_produces_text_with_the_corpus_character_statistics(corpus, trained):
    workspace, _ = trained
    text = sample(corpus, workspace, 600)
    assert len(text) == 600
    vocab = (corpus / "vocab.txt").read_text(encoding="utf-8")
    assert set(text) <= set(vocab)
    corpus_counts = Counter((corpus / "train.txt").read_text(encoding="utf-8"))
    total = sum(corpus_counts.values())
    sampled = Counter(text)
    distance = 0.5 * sum(abs(sampled[c] / len(text) - corpus_counts[c] / total) for c in set(vocab))
    uniform = 0.5 * sum(abs(1 / len(vocab) - corpus_counts[c] / total) for c in set(vocab))
    assert distance < 0.25 < uniform, (distance, uniform)
    assert text.count(" ") > 0.1 * len(text) and text.count("\n") > 5  # code: indentation and lines


@pytest.mark.xdist_group("char_rnn_trained")  # one worker builds the module's fixture (scripts/test.sh: --dist loadgroup)
def test_greedy_sampling_is_singa_argsort(corpus, trained):
    """Without `sample: true` kArgSort keeps the best id, so two runs print the same text."""
    workspace, _ = trained
    first = sample(corpus, workspace, 80, argsort="topk: 1")
    assert first == sample(corpus, workspace, 80, argsort="topk: 1")
