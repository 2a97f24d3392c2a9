"""Word records for the rnnlm example, as SINGA's create_data.cc writes them (kvfile of WordRecord).

    python examples/rnnlm/prepare.py /usr/share/common-licenses     # -> examples/rnnlm/data/

Every line of the corpus is a sentence (SINGA's reader turns a newline into </s>); words are the
lower-cased runs of letters, digits and apostrophes. The last `--valid-fraction` of the lines is
the validation text. The vocabulary is </s> (index 0), then the training text's words by falling
count, capped at `--vocab-size` entries with <unk> standing for the rest (SINGA's job.conf sizes
its layers for 3720 words). Classes split the vocabulary by cumulative frequency into `--classes`
ranges, as Mikolov's rnnlm toolkit (old_classes). Writes train_data.bin and valid_data.bin.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
END, UNKNOWN = "</s>", "<unk>"
WORD = re.compile(r"[a-z0-9']+")


def sentences(files: list[Path]) -> list[list[str]]:
    lines = []
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            words = WORD.findall(line.lower())
            if words:
                lines.append(words)
    return lines


def vocabulary(train: list[list[str]], size: int) -> list[str]:
    """</s> first, then words by falling count (ties: first seen), then <unk>: at most `size` entries."""
    counts = Counter(word for line in train for word in line)
    return [END] + [word for word, _ in counts.most_common(size - 2)] + [UNKNOWN]


def classes(vocab: list[str], counts: Counter, nclass: int) -> list[int]:
    """Each word's class: cumulative unigram frequency cut into nclass equal parts (rnnlm toolkit, old_classes)."""
    total = sum(counts[w] for w in vocab)
    out, cls, mass = [], 0, 0.0
    for word in vocab:
        mass = min(1.0, mass + counts[word] / total)
        out.append(cls)
        if mass > (cls + 1) / nclass and cls < nclass - 1:
            cls += 1
    return out


def write(path: Path, lines: list[list[str]], index: dict[str, int], word_class: list[int], ranges: dict[int, tuple[int, int]]) -> int:
    import rnnlm_pb2

    from shoal.data.kvfile import KVFileWriter

    n = 0
    with KVFileWriter(path) as out:
        for line in lines:
            for word in line + [END]:
                i = index.get(word, index.get(UNKNOWN))
                c = word_class[i]
                record = rnnlm_pb2.WordRecord(word=word, word_index=i, class_index=c, class_start=ranges[c][0], class_end=ranges[c][1])
                out.write(f"{n:05d}", record.SerializeToString())
                n += 1
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="text files, or folders of them")
    parser.add_argument("--out", type=Path, default=HERE / "data")
    parser.add_argument("--vocab-size", type=int, default=3720)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--valid-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)

    import shoal

    shoal.load_plugins([HERE / "rnnlm.proto"])  # WordRecord, SINGA's record of a word
    files = sorted({f.resolve() for s in args.sources for f in ([s] if s.is_file() else s.rglob("*")) if f.is_file()})  # links once
    if not files:
        print(f"prepare: no text files in {', '.join(map(str, args.sources))}", file=sys.stderr)
        return 2
    lines = sentences(files)
    cut = int(len(lines) * (1 - args.valid_fraction))
    train, valid = lines[:cut], lines[cut:]
    vocab = vocabulary(train, args.vocab_size)
    counts = Counter(word for line in train for word in line)
    counts[END] = len(train)
    known = set(vocab)
    counts[UNKNOWN] = sum(c for w, c in counts.items() if w not in known)
    word_class = classes(vocab, counts, args.classes)
    ranges: dict[int, tuple[int, int]] = {}
    for i, c in enumerate(word_class):
        start, end = ranges.get(c, (i, i + 1))
        ranges[c] = (min(start, i), max(end, i + 1))
    index = {word: i for i, word in enumerate(vocab)}
    args.out.mkdir(parents=True, exist_ok=True)
    ntrain = write(args.out / "train_data.bin", train, index, word_class, ranges)
    nvalid = write(args.out / "valid_data.bin", valid, index, word_class, ranges)
    print(f"{len(files)} files: {ntrain} training words ({len(train)} sentences), {nvalid} validation words "
          f"({len(valid)} sentences); vocabulary {len(vocab)} words in {len(ranges)} classes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
