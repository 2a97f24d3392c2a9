"""`shoal prepare text FILE... --out DIR`: a text corpus for kCharRNN.

Writes, in DIR:
  train.txt   the corpus (files concatenated in sorted path order) less its tail
  test.txt    the last `test_fraction` of the corpus, held out
  vocab.txt   every character of the corpus once, sorted by code point: the
              vocabulary file of char_rnn_conf.vocab_path (id = position)

A folder among the sources is searched recursively for files matching
`pattern` (e.g. "*.py" for Python's standard library). Files that are not
UTF-8 are skipped and counted. As `shoal prepare` does for images, the three
files appear together at the end, and existing ones are replaced only with
overwrite=True.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from shoal.data.errors import StoreError
from shoal.data.prepare import _publish_together, _refuse_overwrite

PathLike = str | Path


def corpus_files(sources: list[PathLike], pattern: str = "*") -> list[Path]:
    """The files named by `sources` (folders searched recursively for `pattern`), sorted, without repeats."""
    files: set[Path] = set()
    for source in map(Path, sources):
        if source.is_dir():
            files.update(p for p in source.rglob(pattern) if p.is_file())
        elif source.is_file():
            files.add(source)
        else:
            raise StoreError(f"{source}: no such file or folder")
    return sorted(files)


def unigram_entropy_bits(text: str) -> float:
    """H = −Σ p(c) log₂ p(c) over the characters of `text`: the bits/char of the best context-free model."""
    counts = Counter(text)
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def prepare_text(
    sources: list[PathLike],
    out_dir: PathLike,
    pattern: str = "*",
    max_chars: int = 0,
    test_fraction: float = 0.05,
    overwrite: bool = False,
) -> dict:
    """Build train.txt, test.txt and vocab.txt in `out_dir`; return a summary (sizes, vocab, unigram entropy)."""
    if not 0 <= test_fraction < 1:
        raise StoreError(f"test fraction must be in [0, 1), got {test_fraction}")
    files = corpus_files(sources, pattern)
    parts, skipped, total = [], 0, 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        parts.append(text)
        total += len(text)
        if max_chars and total >= max_chars:
            break
    corpus = "".join(parts)[: max_chars or None]
    if len(corpus) < 2:
        raise StoreError(f"{', '.join(map(str, sources))}: no text found (pattern {pattern!r})")
    split = len(corpus) - int(len(corpus) * test_fraction)
    out = Path(out_dir)
    targets = {name: out / f"{name}.txt" for name in ("train", "test", "vocab")}
    _refuse_overwrite(list(targets.values()), overwrite)
    out.mkdir(parents=True, exist_ok=True)
    vocab = "".join(sorted(set(corpus)))
    with _publish_together(list(targets.values())) as staged:
        staged[targets["train"]].write_text(corpus[:split], encoding="utf-8", newline="")
        staged[targets["test"]].write_text(corpus[split:], encoding="utf-8", newline="")
        staged[targets["vocab"]].write_text(vocab, encoding="utf-8", newline="")
    return {
        "files": len(parts),
        "skipped_not_utf8": skipped,
        "train_chars": split,
        "test_chars": len(corpus) - split,
        "vocab_size": len(vocab),
        "unigram_entropy_bits": round(unigram_entropy_bits(corpus), 4),
        "out": str(out),
    }
