"""Record stores (SINGA's kvfile and textfile), records, in-memory datasets and normalisation."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from shoal.config import job_pb2
from shoal.data.dataset import Dataset, load_mean, normalise, open_store
from shoal.data.errors import StoreError
from shoal.data.kvfile import KVFileWriter, read_kvfile, scan_kvfile
from shoal.data.records import RecordDecodeError, decode, encode_floats, encode_pixels
from shoal.data.textfile import (
    read_textfile,
    read_textfile_lines,
    split_fields,
    write_textfile,
)


def store_conf(path, **fields) -> job_pb2.StoreProto:
    return job_pb2.StoreProto(path=str(path), **fields)


# -- kvfile -------------------------------------------------------------------------
def test_kvfile_round_trip_in_singas_byte_layout(tmp_path):
    path = tmp_path / "s.bin"
    with KVFileWriter(path) as writer:
        writer.write("00000", b"abc")
        writer.write(b"k1", b"")
        assert writer.count == 2 and not path.exists()  # only PATH.tmp until closed
    raw = path.read_bytes()
    assert raw == struct.pack("<Q", 5) + b"00000" + struct.pack("<Q", 3) + b"abc" + struct.pack("<Q", 2) + b"k1" + struct.pack("<Q", 0)
    assert list(read_kvfile(path)) == [(b"00000", b"abc"), (b"k1", b"")]
    assert [offset for offset, _, _ in scan_kvfile(path)] == [0, 24]
    assert not (tmp_path / "s.bin.tmp").exists()


def test_failed_write_leaves_no_store(tmp_path):
    with pytest.raises(RuntimeError), KVFileWriter(tmp_path / "s.bin") as writer:
        writer.write("a", b"1")
        raise RuntimeError("boom")
    assert not list(tmp_path.iterdir())


def test_appending_writer_and_singas_folder_layout(tmp_path):
    shard = tmp_path / "shard"
    shard.mkdir()
    for key in ("a", "b"):
        with KVFileWriter.appending(shard / "shard.dat") as writer:
            writer.write(key, b"v" + key.encode())
    assert list(read_kvfile(shard)) == [(b"a", b"va"), (b"b", b"vb")]  # a folder means FOLDER/shard.dat


@pytest.fixture
def store(tmp_path):
    """Ten 2x3 pixel records with labels i % 3; each record is 35 bytes (a 14-byte value)."""
    path = tmp_path / "train.bin"
    with KVFileWriter(path) as writer:
        for i in range(10):
            writer.write(f"{i:05d}", encode_pixels(np.full((2, 3), i, np.uint8), i % 3))
    return path


def test_every_truncation_names_file_and_the_cut_records_offset(store):
    data = store.read_bytes()
    starts = [offset for offset, _, _ in scan_kvfile(store)]
    for cut in range(1, len(data)):
        if cut in starts:
            continue  # a cut between records leaves a shorter, valid store
        store.write_bytes(data[:cut])
        with pytest.raises(StoreError) as err:
            list(read_kvfile(store))
        message = str(err.value)
        start = max(s for s in starts if s < cut)
        assert "\n" not in message and message.startswith(f"{store}: byte {start}: truncated record {starts.index(start)} (")


def test_truncated_value_message(store):
    data = store.read_bytes()
    store.write_bytes(data[: 35 + 8 + 5 + 8 + 10])  # record 1 cut 10 bytes into its value
    with pytest.raises(StoreError, match=re.escape(f"{store}: byte 35: truncated record 1 (value length 14, 10 bytes left)")):
        list(read_kvfile(store))


def test_absurd_length_is_reported_as_corrupt(store):
    data = bytearray(store.read_bytes())
    data[35:43] = struct.pack("<Q", 2**40)
    store.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"byte 35: corrupt record 1 \(key length 1099511627776, 307 bytes left\)"):
        list(read_kvfile(store))


def test_missing_store(tmp_path):
    with pytest.raises(StoreError, match=r"nope.bin: no such store \(prepare it with `shoal prepare \.\.\.`\)"):
        list(read_kvfile(tmp_path / "nope.bin"))


# -- records ------------------------------------------------------------------------
def test_records_round_trip():
    x, y, shape = decode(encode_pixels(np.arange(6, dtype=np.uint8).reshape(2, 3), 4))
    assert x.dtype == np.float32 and x.tolist() == list(range(6)) and y == 4 and shape == (2, 3)
    x, y, shape = decode(encode_floats(np.array([0.5, -1.5], np.float32)))
    assert x.tolist() == [0.5, -1.5] and y is None and shape == (2,)


def test_float_data_wins_over_pixels_as_in_singa():
    both = job_pb2.RecordProto(shape=[2], pixel=b"\x01\x02", data=[7.0, 8.0]).SerializeToString()
    assert decode(both)[0].tolist() == [7.0, 8.0]


def test_unreadable_records():
    with pytest.raises(RecordDecodeError, match="encoded image"):
        decode(job_pb2.RecordProto(image=b"\xff\xd8jpeg").SerializeToString())
    with pytest.raises(RecordDecodeError, match="neither"):
        decode(job_pb2.RecordProto(label=1).SerializeToString())
    with pytest.raises(ValueError, match="uint8"):
        encode_pixels(np.array([300]), 1)  # would wrap silently


# -- open_store ---------------------------------------------------------------------
def test_open_store_reads_into_memory_once(store):
    ds = open_store(store_conf(store, shape=[6]))
    assert ds.data.shape == (10, 6) and ds.data.dtype == np.float32 and len(ds) == 10
    assert ds.data[:, 0].tolist() == list(range(10)) and ds.labels.tolist() == [i % 3 for i in range(10)]
    assert open_store(store_conf(store, shape=[6])) is ds
    other = open_store(store_conf(store, shape=[2, 3], batchsize=[5]))
    assert other.data.shape == (10, 2, 3) and np.shares_memory(other.data, ds.data)
    assert not ds.data.flags.writeable  # shared by every layer that opens the store
    assert open_store(store_conf(store)).data.shape == (10, 2, 3)  # no shape: the records' own


def test_open_store_rereads_a_changed_file(store):
    first = open_store(store_conf(store, shape=[6]))
    with KVFileWriter(store) as writer:
        writer.write("0", encode_pixels(np.full(6, 9, np.uint8), 1))
    again = open_store(store_conf(store, shape=[6]))
    assert len(first) == 10 and len(again) == 1 and again.data[0, 0] == 9


def test_open_store_resolves_relative_paths(store):
    ds = open_store(job_pb2.StoreProto(backend="kvfile", path=store.name, shape=[6]), base_dir=store.parent)
    assert len(ds) == 10 and ds.path == str(store)


def test_open_store_errors_name_file_and_place(store, tmp_path):
    with pytest.raises(StoreError, match=re.escape(f"{store}: byte 0: record 0 has 6 values, store_conf.shape [5] needs 5")):
        open_store(store_conf(store, shape=[5]))
    with pytest.raises(StoreError, match="no such store"):
        open_store(store_conf(tmp_path / "missing.bin", shape=[6]))
    with pytest.raises(StoreError, match="backend 'lmdb' is not supported"):
        open_store(store_conf(store, backend="lmdb"))
    mixed = tmp_path / "mixed.bin"
    with KVFileWriter(mixed) as writer:
        for i, size in enumerate([6, 6, 6, 5]):
            writer.write(f"{i:05d}", encode_pixels(np.zeros(size, np.uint8), 0))
    with pytest.raises(StoreError, match=r"mixed.bin: byte 99: record 3 has 5 values, record 0 has 6"):
        open_store(store_conf(mixed, shape=[6]))
    bad = tmp_path / "bad.bin"
    with KVFileWriter(bad) as writer:
        writer.write("0", encode_pixels(np.zeros(4, np.uint8), 1))
        writer.write("1", b"\xff\xff\xff")
    with pytest.raises(StoreError, match=r"bad.bin: byte 27: record 1 is not a RecordProto"):
        open_store(store_conf(bad, shape=[4]))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(StoreError, match="holds no records"):
        open_store(store_conf(empty))


def test_unlabelled_records_give_no_labels(tmp_path):
    path = tmp_path / "features.bin"
    with KVFileWriter(path) as writer:
        for i in range(3):
            writer.write(str(i), encode_floats(np.full(2, i, np.float32)))
    ds = open_store(store_conf(path, shape=[2]))
    assert ds.labels is None and ds.data.tolist() == [[0, 0], [1, 1], [2, 2]]


def test_rows_wrap_around_like_singas_readers():
    ds = Dataset(np.arange(5, dtype=np.float32).reshape(5, 1), np.arange(5), "mem")
    data, labels = ds.rows(3, 4)
    assert data.ravel().tolist() == [3, 4, 0, 1] and labels.tolist() == [3, 4, 0, 1]
    assert ds.rows(6, 2)[0].ravel().tolist() == [1, 2]
    assert ds.rows(4, 12)[1].tolist() == [4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]
    data, labels = ds.rows(1, 2)
    data[:] = -1  # callers get copies: the shared store is untouched
    assert ds.data[1, 0] == 1 and data.flags.c_contiguous


# -- textfile -----------------------------------------------------------------------
def test_textfile_round_trip_with_and_without_labels(tmp_path):
    path = tmp_path / "t.csv"
    write_textfile(path, np.array([[1.5, 2.0], [3.0, -4.25]]), np.array([7, 8]))
    assert path.read_text() == "7,1.5,2\n8,3,-4.25\n"
    data, labels = read_textfile(path)
    assert data.tolist() == [[1.5, 2.0], [3.0, -4.25]] and labels.tolist() == [7, 8]
    no_label, none = read_textfile(path, has_label=False)
    assert no_label.tolist() == [[7, 1.5, 2], [8, 3, -4.25]] and none is None
    write_textfile(path, np.array([[0.1, 2.0]], np.float32), separator="\t")
    assert path.read_text() == "0.100000001\t2\n" and read_textfile(path, False, "\t")[0].tolist() == [[np.float32(0.1), 2.0]]
    assert list(read_textfile_lines(path)) == [(b"0", "0.100000001\t2")]  # key = line number


def test_textfile_separator_is_a_set_of_characters(tmp_path):
    assert split_fields("1;2,3", ",;") == ["1", "2", "3"] and split_fields("1,2,", ",") == ["1", "2"]
    path = tmp_path / "t.csv"
    path.write_text("1;2,3\n\n0;4,5,\n")  # mixed separators, a blank line, a trailing separator
    data, labels = read_textfile(path, separator=",;")
    assert data.tolist() == [[2, 3], [4, 5]] and labels.tolist() == [1, 0]


def test_textfile_errors_name_the_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("1,2\nx,3\n")
    with pytest.raises(StoreError, match=r"t.csv:2: could not convert"):
        read_textfile(path)
    path.write_text("1,2,3\n1,2\n")
    with pytest.raises(StoreError, match=r"t.csv:2: 1 values, line 1 has 2"):
        read_textfile(path)
    path.write_text("1.5,2\n")
    with pytest.raises(StoreError, match=r"t.csv:1: the first field must be an integer label"):
        read_textfile(path)


def test_open_store_textfile(tmp_path):
    path = tmp_path / "t.csv"
    write_textfile(path, np.arange(12).reshape(3, 4), np.array([0, 1, 2]))
    ds = open_store(store_conf(path, backend="textfile", shape=[2, 2]))
    assert ds.data.shape == (3, 2, 2) and ds.labels.tolist() == [0, 1, 2]
    unlabelled = open_store(store_conf(path, backend="textfile", shape=[5], has_label=False))
    assert unlabelled.labels is None and unlabelled.data[2].tolist() == [2, 8, 9, 10, 11]
    with pytest.raises(StoreError, match=re.escape("t.csv: record 0 has 4 values, store_conf.shape [3] needs 3")):
        open_store(store_conf(path, backend="textfile", shape=[3]))


# -- mean files and normalisation ---------------------------------------------------
def test_load_mean_kvfile_and_textfile(tmp_path):
    mean = np.arange(12, dtype=np.float32).reshape(3, 2, 2) / 7
    with KVFileWriter(tmp_path / "mean.bin") as writer:
        writer.write("mean", encode_floats(mean))
    assert np.array_equal(load_mean(tmp_path / "mean.bin"), mean)
    (tmp_path / "mean.csv").write_text("1,2,3\n")
    assert load_mean(tmp_path / "mean.csv", backend="textfile").tolist() == [1, 2, 3]
    with pytest.raises(StoreError, match="no such mean file"):
        load_mean(tmp_path / "none.bin")


def test_normalise_follows_singas_presence_rules():
    batch = np.array([[0.0, 127.5, 255.0, 51.0]], np.float32)
    out = normalise(batch, job_pb2.StoreProto(mean_value=127.5, std_value=127.5))
    np.testing.assert_allclose(out, [[-1.0, 0.0, 1.0, -0.6]], rtol=1e-6)
    unset = normalise(batch, job_pb2.StoreProto())
    assert np.array_equal(unset, batch) and unset is not batch
    assert np.array_equal(normalise(batch, job_pb2.StoreProto(mean_value=0)), batch)  # explicit 0 = unset
    with pytest.raises(StoreError, match="std_value is 0"):
        normalise(batch, job_pb2.StoreProto(std_value=0))  # explicit 0 is not "unset"
    mean, std = np.array([1.0, 2.0, 3.0, 4.0]), np.full(4, 2.0)
    conf = job_pb2.StoreProto(mean_file="m.bin", mean_value=100, std_value=10)
    np.testing.assert_allclose(normalise(batch, conf, mean), (batch - mean) / 10)  # the mean image wins
    np.testing.assert_allclose(normalise(batch, job_pb2.StoreProto(std_file="s.bin"), std=std), batch / 2)
    with pytest.raises(ValueError, match="mean_file"):
        normalise(batch, conf)
    with pytest.raises(StoreError, match="holds 3 values, a sample has 4"):
        normalise(batch, job_pb2.StoreProto(), mean=np.zeros(3))
    images = np.ones((2, 3, 2, 2), np.float32)
    assert normalise(images, job_pb2.StoreProto(), mean=np.ones(12)).shape == (2, 3, 2, 2)
