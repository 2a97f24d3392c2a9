"""Fields a SINGA job leaves out that the rest of the job determines; each inference prints one info line."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from shoal.config import job_pb2
from shoal.config.positions import SourceMap

# layers whose char_rnn_conf.vocab_path names the characters a kOneHot layer encodes
VOCAB_LAYERS = (job_pb2.kCharRNN, job_pb2.kCharRNNOutput)


def infer_vocab_sizes(job: job_pb2.JobProto, sources: SourceMap, base_dirs: Sequence[Path], say=None) -> None:
    """A kOneHot layer without onehot_conf.vocab_size takes the size of the net's vocabulary file.

    SINGA's char-rnn sample.conf gives none (SINGA read out of bounds there); its kCharRNNOutput
    layer names the vocabulary, as the training job's kCharRNN does. Without a readable
    vocabulary file the field stays unset and the layer reports it missing.
    """
    say = say or (lambda line: print(line, file=sys.stderr))
    layers = job.neuralnet.layer
    for i, layer in enumerate(layers):
        if layer.type != job_pb2.kOneHot or layer.onehot_conf.vocab_size > 0:
            continue
        named = sorted((l for l in layers if l.type in VOCAB_LAYERS and l.char_rnn_conf.vocab_path), key=lambda l: VOCAB_LAYERS.index(l.type))
        for source in named:
            path = _find(source.char_rnn_conf.vocab_path, base_dirs)
            if path is None:
                continue
            size = len(path.read_text(encoding="utf-8"))
            if size == 0:
                continue
            layer.onehot_conf.vocab_size = size
            note = (
                f"info: onehot_conf.vocab_size not given: {size}, the characters of {source.char_rnn_conf.vocab_path}"
                f' (vocab_path of layer "{source.name}")'
            )
            say(str(sources.error(f"neuralnet.layer[{i}]", note)))
            break


def _find(name: str, base_dirs: Sequence[Path]) -> Path | None:
    """A data path as the runtime resolves one: from the working directory, then the job file's folder."""
    path = Path(name)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path] + [Path(d) / path for d in base_dirs]
    return next((c for c in candidates if c.is_file()), None)
