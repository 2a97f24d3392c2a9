"""Fields a SINGA job leaves out that the rest of the job determines; each inference prints one info line."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from shoal.config import job_pb2
from shoal.config.positions import SourceMap

# layers whose char_rnn_conf.vocab_path names the characters a kOneHot layer encodes
VOCAB_LAYERS = (job_pb2.kCharRNN, job_pb2.kCharRNNOutput)


def infer_vocab_sizes(job: job_pb2.JobProto, sources: SourceMap, base_dirs: Sequence[Path], say=None, required: bool = False) -> None:
    """A kOneHot layer without onehot_conf.vocab_size takes the size of the net's vocabulary file.

    SINGA's char-rnn sample.conf gives none (SINGA read out of bounds there); its kCharRNNOutput
    layer names the vocabulary, as the training job's kCharRNN does. Without a readable
    vocabulary file the field stays unset; when the size is `required` (the net will be built),
    that is an error at the vocab_path the size would come from, naming the file.
    """
    say = say or (lambda line: print(line, file=sys.stderr))
    layers = job.neuralnet.layer
    for i, layer in enumerate(layers):
        if layer.type != job_pb2.kOneHot or layer.onehot_conf.vocab_size > 0:
            continue
        named = sorted(((j, l) for j, l in enumerate(layers) if l.type in VOCAB_LAYERS and l.char_rnn_conf.vocab_path),
                       key=lambda jl: VOCAB_LAYERS.index(jl[1].type))
        missing = []  # (index, layer, why) of each vocabulary file that gave no size
        for j, source in named:
            path = _find(source.char_rnn_conf.vocab_path, base_dirs)
            size = _characters(path) if path is not None else "is not there"
            if isinstance(size, str) or size == 0:
                missing.append((j, source, "is empty" if size == 0 else size))
                continue
            layer.onehot_conf.vocab_size = size
            note = (
                f"info: onehot_conf.vocab_size not given: {size}, the characters of {source.char_rnn_conf.vocab_path}"
                f' (vocab_path of layer "{source.name}")'
            )
            say(str(sources.error(f"neuralnet.layer[{i}]", note)))
            break
        else:
            if required and missing:
                j, source, why = missing[0]
                looked = ", ".join(str(d) for d in _places(source.char_rnn_conf.vocab_path, base_dirs))
                raise sources.error(
                    f"neuralnet.layer[{j}].char_rnn_conf.vocab_path",
                    f'onehot_conf.vocab_size of layer "{layer.name}" is not given and comes from the vocabulary file '
                    f"{source.char_rnn_conf.vocab_path} (vocab_path of layer \"{source.name}\"), which {why}"
                    + (f" (looked in {looked})" if why == "is not there" else "")
                    + "; prepare it (shoal prepare text) or give onehot_conf.vocab_size",
                )


def _places(name: str, base_dirs: Sequence[Path]) -> list[Path]:
    """Where a data path is looked for, as the runtime resolves one: the working directory, then the job file's folder."""
    path = Path(name)
    return [path] if path.is_absolute() else list(dict.fromkeys([Path.cwd() / path] + [Path(d) / path for d in base_dirs]))


def _find(name: str, base_dirs: Sequence[Path]) -> Path | None:
    return next((c for c in _places(name, base_dirs) if c.is_file()), None)


def _characters(path: Path) -> int | str:
    """The number of characters of a vocabulary file, or why there is none."""
    try:
        return len(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        return f"cannot be read ({type(err).__name__}: {err})"
