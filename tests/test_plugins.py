"""Layer plugins: a user's layer module and its .proto extending LayerProto, as SINGA's users wrote them."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_in_process import run_cli
from conftest import REPO

from shoal.config import JobError, job_pb2, load_job
from shoal.config.loader import job_from_text, job_from_yaml
from shoal.config.plugins import PluginError, decode_job, load_plugins

# SINGA's spelling: no package, `import "job.proto"`, `extend singa.LayerProto` from 1001
GATE_PROTO = """\
import "job.proto";

message GateProto {
  required float factor = 1;
  optional float bias = 2 [default = 0];
}

extend singa.LayerProto {
  optional GateProto gate_conf = 1050;  // rnnlm.proto takes 1001-1003
}
"""

GATE_LAYERS = """\
import torch

import gate_pb2
import shoal
from shoal.neuralnet.layers import Layer, LayerConfigError


@shoal.register_layer("kGate")
class Gate(Layer):
    \"\"\"y = factor * x * sigmoid(g + bias): a learnt gate per feature, configured by [gate_conf].\"\"\"

    feature_local = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if not conf.HasExtension(gate_pb2.gate_conf):
            raise LayerConfigError(f'layer "{conf.name}" needs [gate_conf] {{ factor: ... }}')
        self.gate = conf.Extensions[gate_pb2.gate_conf]

    def param_shapes(self):
        return [self.shape]

    def forward(self, xs, params, labels, ctx):
        ctx.report("gate_factor", self.gate.factor, xs[0].shape[0])  # shows what each worker read
        return self.gate.factor * xs[0] * torch.sigmoid(params[0] + self.gate.bias)
"""


def gate_job(data_dir: Path, plugins=('plugin: "gate.proto"',), gate="[gate_conf] { factor: 0.5 bias: 1 }") -> str:
    return "\n".join(plugins) + f"""
name: "gated-mlp"
train_steps: 40
disp_freq: 10
seed: 3
train_one_batch {{ alg: kBP }}
updater {{ type: kSGD momentum: 0.9 learning_rate {{ type: kFixed base_lr: 0.1 }} }}
neuralnet {{
  layer {{ name: "data" type: kRecordInput
    store_conf {{ backend: "kvfile" path: "{data_dir / 'train.bin'}" batchsize: 32 shape: 16 }} }}
  layer {{ name: "fc1" type: kInnerProduct srclayers: "data" innerproduct_conf {{ num_output: 32 }}
    param {{ name: "w1" init {{ type: kGaussian std: 0.1 }} }} param {{ name: "b1" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "relu" type: kReLU srclayers: "fc1" }}
  layer {{
    name: "gate"
    user_type: "kGate"
    srclayers: "relu"
    {gate}
    param {{ name: "g" init {{ type: kConstant value: 0 }} }}
  }}
  layer {{ name: "fc2" type: kInnerProduct srclayers: "gate" innerproduct_conf {{ num_output: 4 }}
    param {{ name: "w2" init {{ type: kUniform low: -0.1 high: 0.1 }} }} param {{ name: "b2" init {{ type: kConstant value: 0 }} }} }}
  layer {{ name: "loss" type: kSoftmaxLoss srclayers: "fc2" srclayers: "data" }}
}}
cluster {{ }}
"""


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """gate.proto and gate_layers.py; one folder per test process, since a process loads a schema file once."""
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "gate.proto").write_text(GATE_PROTO)
    (folder / "gate_layers.py").write_text(GATE_LAYERS)
    return folder


def shoal(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "shoal", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def train_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"Train @ step \d+ +Loss = ([\d.]+)", stdout)]


LAYOUTS = {
    "one worker": [],
    "threads": ["--set", "cluster.nworkers_per_group=2", "--set", "cluster.nworkers_per_procs=2"],
    "processes": ["--set", "cluster.nworkers_per_group=2"],
}


# the default suite's 5-minute budget: one worker in it; threads and processes under -m slow
@pytest.mark.parametrize("layout", [name if name == "one worker" else pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS])
def test_a_user_layer_with_its_own_proto_trains_through_the_cli(plugin_dir, blobs_dir, tmp_path, layout):
    job = plugin_dir / f"job-{layout.replace(' ', '-')}.conf"
    job.write_text(gate_job(blobs_dir))  # names the .proto; the .py (code) only the command line may give
    proc = shoal("run", job, "--plugin", plugin_dir / "gate_layers.py", "--workspace", tmp_path / "ws", *LAYOUTS[layout], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # every worker (in every process) read factor 0.5 from [gate_conf]: the mean it reports is 0.5
    assert re.search(r"Train @ step 30 .*gate_factor = 0\.5\b", proc.stdout), proc.stdout
    losses = train_losses(proc.stdout)
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    saved = (tmp_path / "ws" / ".shoal" / "job.conf").read_text()  # the workspace's copy names the plugins, resolved
    assert f'plugin: "{plugin_dir / "gate.proto"}"' in saved and f'plugin: "{plugin_dir / "gate_layers.py"}"' in saved
    assert "[gate_conf] {" in saved
    # the copy is a file like any other: it runs its .py plugin only when the user gives that file
    refused = shoal("plan", tmp_path / "ws" / ".shoal" / "job.conf")  # (a fresh process: this one may have loaded it)
    assert refused.returncode == 2 and f"--plugin {plugin_dir / 'gate_layers.py'}" in refused.stderr, refused.stderr
    planned = run_cli("plan", tmp_path / "ws" / ".shoal" / "job.conf", "--plugin", plugin_dir / "gate_layers.py")
    assert planned.returncode == 0 and "gate" in planned.stdout, planned.stderr


def test_plugins_given_on_the_command_line_leave_the_job_as_singa_wrote_it(plugin_dir, blobs_dir, tmp_path):
    """In the test process (one worker: it trains here, its lines captured); the user layer's test above runs the
    plugins through a real `python -m shoal run`."""
    job = tmp_path / "job.conf"
    job.write_text(gate_job(blobs_dir, plugins=()))
    proc = run_cli("run", job, "--plugin", plugin_dir / "gate.proto", "--plugin", plugin_dir / "gate_layers.py", "--workspace",
                   tmp_path / "ws", "--set", "train_steps=10", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gate_factor = 0.5" in proc.stdout


def test_a_spawned_process_decodes_the_extensions_after_loading_the_named_plugins(plugin_dir, blobs_dir):
    load_plugins([plugin_dir / "gate.proto", plugin_dir / "gate_layers.py"])
    job = load_job_text(gate_job(blobs_dir), plugin_dir)
    code = (
        "import sys; from shoal.config.plugins import decode_job; job = decode_job(sys.stdin.buffer.read()); "
        "layer = job.neuralnet.layer[3]; import gate_pb2; print(layer.Extensions[gate_pb2.gate_conf].factor)"
    )
    done = subprocess.run([sys.executable, "-c", code], input=job.SerializeToString(), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "0.5"
    assert decode_job(job.SerializeToString()) == job  # idempotent here: the plugins are loaded already


def load_job_text(text: str, folder: Path, name="job.conf"):
    (folder / name).write_text(text)
    return load_job(folder / name)


# -- errors: one line, the file and the position ---------------------------------------------
@pytest.mark.parametrize(
    "gate, where, message",
    [
        ("[gate_conf] { factr: 0.5 }", (18, 19), "GateProto has no field 'factr' (did you mean 'factor'?)"),
        ("[gate_conf] { bias: 1 }", (18, 5), "missing required field 'factor' of GateProto"),
        ("[gate_cnf] { factor: 0.5 }", (18, 6), "no loaded plugin declares the extension [gate_cnf] (did you mean 'gate_conf'?)"),
        ("[gate_conf] { factor: high }", (18, 27), "Couldn't parse float: high"),
    ],
    ids=["unknown field", "required field missing", "unknown extension", "bad value"],
)
def test_bad_extension_fields_are_positioned(plugin_dir, blobs_dir, gate, where, message):
    with pytest.raises(JobError) as err:
        load_job_text(gate_job(blobs_dir, gate=gate), plugin_dir, "bad.conf")
    assert str(err.value).startswith(f"{plugin_dir / 'bad.conf'}:{where[0]}:{where[1]}: "), str(err.value)
    assert message in str(err.value)


def test_extensions_in_yaml(plugin_dir, blobs_dir):
    text = f"""\
plugin: [gate.proto]
name: gated
train_steps: 1
train_one_batch: {{alg: kBP}}
updater: {{type: kSGD, learning_rate: {{type: kFixed, base_lr: 0.1}}}}
neuralnet:
  layer:
    - {{name: data, type: kRecordInput, store_conf: {{backend: kvfile, path: "{blobs_dir / 'train.bin'}", batchsize: 8, shape: [16]}}}}
    - name: gate
      user_type: kGate
      srclayers: data
      "[gate_conf]": {{factor: 0.25}}
      param: [{{name: g}}]
    - {{name: loss, type: kSoftmaxLoss, srclayers: [gate, data]}}
"""
    load_plugins([plugin_dir / "gate.proto"])  # whatever ran before in this process (test order is not ours)
    import gate_pb2

    job = job_from_yaml(text, "job.yaml", job_dir=plugin_dir)
    assert job.neuralnet.layer[1].Extensions[gate_pb2.gate_conf].factor == 0.25
    with pytest.raises(JobError, match=r"^job.yaml:12:23: neuralnet.layer\[1\].\[gate_conf\].factr: GateProto has no field 'factr'"):
        job_from_yaml(text.replace("{factor:", "{factr:"), "job.yaml", job_dir=plugin_dir)
    with pytest.raises(JobError, match=r"^job.yaml:12:7: .*LayerProto has no extension \[gate_cnf\]"):
        job_from_yaml(text.replace('"[gate_conf]"', '"[gate_cnf]"'), "job.yaml", job_dir=plugin_dir)


def test_set_overrides_reach_extension_fields(plugin_dir, blobs_dir):
    load_plugins([plugin_dir / "gate.proto"])
    import gate_pb2

    (plugin_dir / "set.conf").write_text(gate_job(blobs_dir))
    job = load_job(plugin_dir / "set.conf", ["neuralnet.layer[name=gate].[gate_conf].factor=0.75"])
    assert job.neuralnet.layer[3].Extensions[gate_pb2.gate_conf].factor == 0.75
    with pytest.raises(JobError, match=r"^--set .*: LayerProto has no extension \[gate_cnf\]"):
        load_job(plugin_dir / "set.conf", ["neuralnet.layer[name=gate].[gate_cnf].factor=1"])


def test_a_missing_plugin_is_an_error_at_the_job_field(tmp_path):
    with pytest.raises(JobError, match=r'^job.conf:2:9: plugin "nope.py": no such plugin file'):
        job_from_text('name: "x"\nplugin: "nope.py"\n', "job.conf", job_dir=tmp_path)


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("syntax.proto", 'import "job.proto";\nmessage A {\n  optional int32 x = 1\n}\n', r"syntax.proto:4:1: Expected \";\"\."),
        ("clash.proto", 'import "job.proto";\nmessage B { optional int32 x = 1; }\nextend singa.LayerProto {\n  optional B b_conf = 1000;\n}\n',
         r"clash.proto:4:23: \"singa.LayerProto\" does not declare 1000 as an extension number\."),
        ("taken.proto", 'import "job.proto";\nextend singa.LayerProto {\n  optional int32 other_conf = 1050;\n}\n',
         r"taken.proto:3:31: other_conf = 1050: singa.LayerProto extension number 1050 is taken by \[gate_conf\] \(from gate.proto\)"),
        ("broken_layers.py", "import torch\n\nraise RuntimeError('no GPU here')\n", r"broken_layers.py:3: cannot load plugin: RuntimeError: no GPU here"),
        ("typo_layers.py", "def f(:\n    pass\n", r"typo_layers.py:1:7: SyntaxError: "),
    ],
    ids=["proto syntax", "proto outside the extension range", "number taken", "module raises", "module syntax"],
)
def test_a_plugin_that_fails_is_one_line_naming_its_file_and_position(plugin_dir, tmp_path, name, text, expected):
    load_plugins([plugin_dir / "gate.proto"])
    (tmp_path / name).write_text(text)
    with pytest.raises(PluginError) as err:
        load_plugins([tmp_path / name])
    assert re.match(f"^{re.escape(str(tmp_path))}/{expected}", str(err.value)), str(err.value)
    assert "\n" not in str(err.value)


def test_the_cli_reports_a_broken_plugin_in_one_line(tmp_path):
    (tmp_path / "syntax.proto").write_text('import "job.proto";\nmessage A {\n  optional int32 x = 1\n}\n')
    (tmp_path / "job.conf").write_text('plugin: "syntax.proto"\nname: "x"\n')
    proc = run_cli("run", tmp_path / "job.conf", cwd=tmp_path)  # (the file's real-process cases: the user layer's runs)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f'{tmp_path / "syntax.proto"}:4:1: Expected ";".', proc.stderr


# -- SINGA's schema ----------------------------------------------------------------------------
SINGA_EXTENSION_RANGES = {  # SINGA 0.3's job.proto and common.proto (LayerProto: 0.1's range too)
    "JobProto": [(101, 201)],
    "AlgProto": [(101, 201)],
    "UpdaterProto": [(101, 201)],
    "LayerProto": [(101, 201), (1001, 1101)],
    "ParamProto": [(101, 201)],
    "LRGenProto": [(101, 201)],
    "ParamGenProto": [(101, 201)],
}


def test_singa_extension_ranges_and_package():
    from shoal.config import common_pb2

    declared = {name: list(desc.extension_ranges) for name, desc in job_pb2.DESCRIPTOR.message_types_by_name.items() if desc.extension_ranges}
    assert declared == SINGA_EXTENSION_RANGES
    assert list(common_pb2.Record.DESCRIPTOR.extension_ranges) == [(101, 201)]
    assert job_pb2.DESCRIPTOR.package == common_pb2.DESCRIPTOR.package == "singa"


def test_singa_rnnlm_proto_compiles_against_shoals_schema_and_its_job_loads():
    rnnlm_pb2 = load_plugins([REPO / "examples" / "rnnlm" / "rnnlm.proto"]) and sys.modules["rnnlm_pb2"]
    job = load_job(REPO / "tests" / "fixtures" / "rnnlm" / "job.conf")  # SINGA's, unmodified
    data, embedding, _, loss = job.neuralnet.layer[0], job.neuralnet.layer[2], job.neuralnet.layer[3], job.neuralnet.layer[4]
    assert (data.user_type, data.Extensions[rnnlm_pb2.data_conf].max_window) == ("kData", 10)
    assert embedding.Extensions[rnnlm_pb2.embedding_conf].vocab_size == 3720
    assert loss.Extensions[rnnlm_pb2.loss_conf].nclass == 100
    assert [field.number for field in (rnnlm_pb2.embedding_conf, rnnlm_pb2.loss_conf, rnnlm_pb2.data_conf)] == [1001, 1002, 1003]


# -- SINGA's char-rnn sample.conf: the vocabulary size from the net's vocabulary file ----------
def test_onehot_vocab_size_comes_from_the_vocabulary_file(tmp_path, monkeypatch, capsys):
    from shoal.frontend.api import load_job as load_with_shape_checks

    text = (REPO / "tests" / "fixtures" / "singa" / "char-rnn-sample.conf").read_text()
    assert "vocab_size" not in text
    for folder in ("with", "without", "cwd"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "sample.conf").write_text(text)
    (tmp_path / "with" / "examples" / "char-rnn").mkdir(parents=True)
    (tmp_path / "with" / "examples" / "char-rnn" / "vocab.txt").write_text("abcdefghij\n \t")
    monkeypatch.chdir(tmp_path / "cwd")  # the vocabulary resolves against the job file's folder, as data paths do
    job = load_with_shape_checks(tmp_path / "with" / "sample.conf")
    onehot = next(layer for layer in job.neuralnet.layer if layer.type == job_pb2.kOneHot)
    assert onehot.onehot_conf.vocab_size == 13
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r'.*/with/sample\.conf:\d+:\d+: info: onehot_conf\.vocab_size not given: 13, the characters of '
                        r'examples/char-rnn/vocab\.txt \(vocab_path of layer "sampling"\)', line), line
    # nothing supplies it: the error names the file the size would come from, at its vocab_path
    with pytest.raises(JobError) as err:
        load_with_shape_checks(tmp_path / "without" / "sample.conf")
    assert re.fullmatch(r'.*/without/sample\.conf:57:19: onehot_conf\.vocab_size of layer "onehot" is not given and comes from the '
                        r'vocabulary file examples/char-rnn/vocab\.txt \(vocab_path of layer "sampling"\), which is not there '
                        r"\(looked in .*/cwd/examples/char-rnn/vocab\.txt, .*/without/examples/char-rnn/vocab\.txt\); "
                        r"prepare it \(shoal prepare text\) or give onehot_conf\.vocab_size", str(err.value)), str(err.value)
    (tmp_path / "without" / "examples" / "char-rnn").mkdir(parents=True)
    (tmp_path / "without" / "examples" / "char-rnn" / "vocab.txt").write_text("")
    with pytest.raises(JobError, match=r"vocab\.txt \(vocab_path of layer \"sampling\"\), which is empty;"):
        load_with_shape_checks(tmp_path / "without" / "sample.conf")
    proc = run_cli("viz", tmp_path / "without" / "sample.conf", "-o", tmp_path / "net.png", cwd=tmp_path / "cwd")  # one line, exit 2
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "vocab_path" in proc.stderr, proc.stderr


# -- SINGA's rnnlm example (examples/rnnlm) ------------------------------------------------------
CORPUS = Path("/usr/share/common-licenses")  # Debian's base-files: license texts on every Debian machine
RNNLM = REPO / "examples" / "rnnlm"


def rnnlm_layers():
    load_plugins([RNNLM / "rnnlm.proto", RNNLM / "rnnlm.py"])
    return sys.modules["rnnlm"]


def test_rnnlm_windows_are_read_as_singas_data_layer():
    rnnlm = rnnlm_layers()
    # word ids; 0 ends a sentence. A window: the previous window's last word, then up to 3 words, ending at a 0
    words = np.array([[w, 0, 0, 1] for w in (5, 6, 0, 7, 8, 9, 4, 0)])
    got = [[int(r[0]) for r in window if r[0] >= 0] for window in rnnlm.windows(words, 3)]
    assert got == [[5, 6, 0], [0, 7, 8, 9], [9, 4, 0]]


@pytest.fixture(scope="module")
def rnnlm_data(tmp_path_factory):
    if not CORPUS.is_dir():
        pytest.skip(f"{CORPUS} (Debian's base-files) is not here")
    out = tmp_path_factory.mktemp("rnnlm") / "data"
    done = subprocess.run([sys.executable, RNNLM / "prepare.py", CORPUS, "--out", out], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def test_rnnlm_prepare_writes_singas_word_records(rnnlm_data):
    rnnlm = rnnlm_layers()
    words = rnnlm.read_words(rnnlm_data / "train_data.bin")
    assert len(words) > 30000 and words[:, 0].max() < 3720  # SINGA's job.conf sizes its layers for 3720 words
    index, cls, start, end = words.T
    assert ((start <= index) & (index < end)).all() and cls.max() == 99  # each word inside its class's range, 100 classes
    assert (words[index == 0][:, 1] == 0).all()  # </s> is word 0, in class 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one worker", "synchronous", "asynchronous"])
def test_rnnlm_perplexity_falls(rnnlm_data, tmp_path, layout):
    sets = {
        "one worker": [],
        "synchronous": ["cluster.nworkers_per_group=2", "cluster.nworkers_per_procs=2", "neuralnet.layer[name=data].store_conf.batchsize=2"],
        "asynchronous": ["cluster.nworker_groups=2", "cluster.nworkers_per_procs=2"],
    }[layout]
    job = tmp_path / "job.conf"
    job.write_text((RNNLM / "job.conf").read_text())
    (tmp_path / "data").symlink_to(rnnlm_data)
    base = ["train_steps=2001", "validate_freq=2000", "validate_steps=300", "disp_freq=500", "cluster.threads_per_worker=1"]
    overrides = [arg for s in [*base, *sets] for arg in ("--set", s)]
    proc = shoal("run", job, "--plugin", RNNLM / "rnnlm.proto", "--plugin", RNNLM / "rnnlm.py", "--workspace", tmp_path / "ws", *overrides)
    assert proc.returncode == 0, proc.stderr
    ppl = [math.exp(float(x)) for x in re.findall(r"Validate @ step \d+  Loss = ([\d.]+)", proc.stdout)]  # per word
    assert len(ppl) == 2 and ppl[1] < 0.85 * ppl[0], proc.stdout
