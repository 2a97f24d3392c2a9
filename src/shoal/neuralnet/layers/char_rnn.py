"""The char-rnn example's layers: kCharRNN, kRNNLabel, kRNNDummy, kCharRNNOutput.

kCharRNN emits, per sample, unroll_len + 1 consecutive character ids; the
i-th unrolled copy of kOneHot reads id i (its input at step i) and the i-th
copy of kRNNLabel reads id i + 1 (the character to predict).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, flat, numel, uniform
from shoal.neuralnet.layers.input import fed_batch
from shoal.neuralnet.layers.registry import register


def read_vocab(path: str | Path) -> str:
    """The vocabulary file: its characters, in id order (the file holds no separators)."""
    return Path(path).read_text(encoding="utf-8")


def encode_text(text: str, vocab: str) -> np.ndarray:
    """int64 ids of the characters of `text` (KeyError naming an unknown character)."""
    index = {}
    for i, ch in enumerate(vocab):
        index.setdefault(ch, i)
    try:
        return np.fromiter((index[ch] for ch in text), dtype=np.int64, count=len(text))
    except KeyError as err:
        raise KeyError(f"character {err.args[0]!r} is not in the vocabulary") from None


def char_windows(ids: np.ndarray, batchsize: int, unroll_len: int, step: int) -> np.ndarray:
    """The (batchsize, unroll_len + 1) ids kCharRNN emits at training step `step` (0-based).

    As SINGA's CharRNNInputLayer: the text is cut into batchsize segments of
    ⌊len / batchsize⌋ characters; row i reads unroll_len + 1 characters from the
    start of segment i plus an offset that grows by unroll_len per step and goes
    back to 0 once it reaches the segment length. A read running past the end of
    the text wraps to its start (SINGA read past its buffer there).
    """
    segment = len(ids) // batchsize
    if segment <= unroll_len:
        raise ValueError(f"a text of {len(ids)} characters is too short for {batchsize} rows of {unroll_len} steps")
    windows = -(-segment // unroll_len)  # offsets 0, U, 2U, ... below the segment length
    offset = (step % windows) * unroll_len
    starts = np.arange(batchsize) * segment + offset
    return np.asarray(ids)[(starts[:, None] + np.arange(unroll_len + 1)) % len(ids)]


@register("kCharRNN")
class CharRNN(Layer):
    """Per sample, unroll_len + 1 character ids (as floats), fed by the runtime (see `char_windows`).

    char_rnn_conf {path, vocab_path, batchsize, unroll_len}.
    Feed: ctx.feeds[name] = (ids (B, unroll_len + 1), None).
    """

    category = "input"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.char_rnn_conf
        if not c.path or not c.vocab_path:
            raise config_error(conf, "char_rnn_conf.path and char_rnn_conf.vocab_path are required")
        if c.unroll_len <= 0 or c.batchsize <= 0:
            raise config_error(conf, "char_rnn_conf.unroll_len and batchsize must be > 0")
        self.shape = (c.unroll_len + 1,)

    def forward(self, xs, params, labels, ctx):
        ids, _ = fed_batch(self, ctx)
        return ids.reshape((ids.shape[0],) + self.shape).to(torch.float32), None


@register("kRNNLabel")
class RNNLabel(Layer):
    """The labels of unrolled copy i: id i + 1 of each sample of its kCharRNN source (the next character).

    Output: those ids as floats (B,); aux: the same ids as int64 labels, read by the loss.
    """

    category = "input"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer (the kCharRNN layer), got {len(self.src_shapes)}")
        steps = numel(self.src_shapes[0])
        if conf.unroll_index + 1 >= steps:
            raise config_error(conf, f"unroll_index {conf.unroll_index} needs id {conf.unroll_index + 1}, its source has {steps} per sample")
        self.shape = ()

    def forward(self, xs, params, labels, ctx):
        ids = flat(xs[0])[:, self.conf.unroll_index + 1]
        return ids, ids.long()


@register("kRNNDummy")
class RNNDummy(Layer):
    """Placeholder input of a sampling net: rnn_dummy_conf {dynamic_srclayer, shape, integer, low, high}.

    Without data it draws U[low, high) values of `shape` (batch first, as SINGA's
    blob), floored when `integer`. At sampling time the runtime gives it the
    output of `dynamic_srclayer` from the previous pass (ctx.carry; its first
    column when it has several, e.g. kArgSort's best id), or data in
    ctx.feeds[name] = (data, None); it then passes that on.
    """

    category = "input"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        c = conf.rnn_dummy_conf
        if self.src_shapes:
            self.batch, self.shape = None, self.src_shapes[0]
            return
        if not c.shape or min(c.shape) <= 0:
            raise config_error(conf, "rnn_dummy_conf.shape is required without srclayers (batch size first)")
        if not c.low < c.high:
            raise config_error(conf, f"rnn_dummy_conf.low ({c.low}) must be below high ({c.high})")
        self.batch, self.shape = c.shape[0], tuple(c.shape[1:])

    def forward(self, xs, params, labels, ctx):
        if xs:
            return xs[0]
        dynamic = self.conf.rnn_dummy_conf.dynamic_srclayer
        if dynamic and ctx.carry and dynamic in ctx.carry:  # sampling: the previous pass's choice
            return flat(ctx.carry[dynamic])[:, 0].reshape((-1,) + self.shape)
        if self.name in ctx.feeds:
            return fed_batch(self, ctx)[0]
        c = self.conf.rnn_dummy_conf
        values = c.low + (c.high - c.low) * uniform((self.batch,) + self.shape, ctx, ctx.device)
        return values.floor() if c.integer else values


@register("kCharRNNOutput")
class CharRNNOutput(Layer):
    """Writes the character of each sample's first id (e.g. kArgSort's best) to `self.stream` (stdout), as SINGA.

    char_rnn_conf.vocab_path names the vocabulary; the runtime may set `self.vocab`
    (read lazily from the path otherwise). Passes its input on.
    """

    category = "output"

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1:
            raise config_error(conf, f"needs exactly one srclayer, got {len(self.src_shapes)}")
        if not conf.char_rnn_conf.vocab_path:
            raise config_error(conf, "char_rnn_conf.vocab_path is required")
        self.vocab: str | None = None
        self.stream: TextIO = sys.stdout

    def forward(self, xs, params, labels, ctx):
        if self.vocab is None:
            self.vocab = read_vocab(self.conf.char_rnn_conf.vocab_path)
        ids = flat(xs[0])[:, 0].long().tolist()
        # an id past the vocabulary (a net with room for more characters) prints as U+FFFD
        self.stream.write("".join(self.vocab[i] if i < len(self.vocab) else "\ufffd" for i in ids))
        self.stream.flush()
        return xs[0]
