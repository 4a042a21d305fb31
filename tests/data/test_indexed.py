"""The Megatron .bin/.idx format: round trips, byte equality with megatron-core both ways, and every corruption."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from llmjp_ds.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from llmjp_ds.errors import UserError

from .data_helpers import random_documents, write_corpus

DTYPES = [(np.uint16, 65_000), (np.int32, 2_000_000_000)]


def _files(prefix) -> list[str]:
    d = os.path.dirname(prefix)
    return sorted(os.listdir(d))


@pytest.mark.parametrize("dtype,high", DTYPES)
def test_round_trip(tmp_path, dtype, high):
    rng = np.random.default_rng(0)
    docs = random_documents(rng, 300, high) + [np.zeros(0, dtype=np.int64)]  # an empty document too
    prefix = write_corpus(tmp_path / "c", docs, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) == ds.num_documents
    assert ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    np.testing.assert_array_equal(ds.sequence_lengths, [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        assert ds[i].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(ds.document(i), d)
    assert ds.max_token_id() == max(int(d.max()) for d in docs if len(d))
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx"]  # no temp files left


def test_best_dtype():
    assert best_dtype(8000) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(99574) == np.int32


@pytest.mark.parametrize("dtype,high", DTYPES)
def test_bytes_equal_megatron_builder(tmp_path, megatron_indexed, dtype, high):
    """Ours and megatron-core's IndexedDatasetBuilder write identical bytes, and each reads the other's."""
    rng = np.random.default_rng(1)
    docs = random_documents(rng, 200, high)
    ours = write_corpus(tmp_path / "ours", docs, dtype)
    theirs = str(tmp_path / "theirs")
    builder = megatron_indexed.IndexedDatasetBuilder(theirs + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(d.astype(np.int64), [len(d)])  # numpy: what its add_document converts to
    builder.finalize(theirs + ".idx")
    for suffix in (".bin", ".idx"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read(), suffix

    megatron_reads_ours = megatron_indexed.IndexedDataset(ours, mmap=True)
    we_read_theirs = IndexedDataset(theirs)
    assert len(megatron_reads_ours) == len(we_read_theirs) == len(docs)
    np.testing.assert_array_equal(megatron_reads_ours.document_indices, we_read_theirs.document_indices)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(megatron_reads_ours[i], d)
        np.testing.assert_array_equal(we_read_theirs[i], d)


def test_reads_megatron_multi_sequence_documents(tmp_path, megatron_indexed):
    """Megatron --split-sentences corpora have several sequences per document; documents stay contiguous."""
    prefix = str(tmp_path / "sent")
    builder = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    docs = [[np.arange(3), np.arange(5) + 10], [np.arange(2) + 20],
            [np.arange(4) + 30, np.arange(1) + 40, np.arange(2)]]
    for sentences in docs:
        builder.add_document(np.concatenate(sentences), [len(s) for s in sentences])
    builder.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert len(ds) == 6 and ds.num_documents == 3
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3, 6])
    for d, sentences in enumerate(docs):
        np.testing.assert_array_equal(ds.document(d), np.concatenate(sentences))
    starts, lengths = ds.document_token_spans()
    np.testing.assert_array_equal(lengths, [8, 2, 7])
    np.testing.assert_array_equal(starts, [0, 8, 10])


def _corpus(tmp_path) -> str:
    return write_corpus(tmp_path / "c", random_documents(np.random.default_rng(2), 50, 1000), np.uint16)


def _error(prefix) -> str:
    with pytest.raises(UserError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_bin(tmp_path):
    prefix = _corpus(tmp_path)
    size = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", size - 2)
    message = _error(prefix)
    assert f"is {size - 2} bytes but its .idx needs {size}" in message and "truncated" in message
    assert "llmjp-ds preprocess" in message


def test_bin_longer_than_idx(tmp_path):
    prefix = _corpus(tmp_path)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    assert "different runs" in _error(prefix)


def test_unknown_dtype_code(tmp_path):
    prefix = _corpus(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(17)
        f.write(bytes([9]))
    assert "unknown dtype code 9" in _error(prefix)


def test_bad_magic_version_and_truncated_idx(tmp_path):
    prefix = _corpus(tmp_path)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(b"NOTANIDX!" + data[9:])
    assert "not a Megatron MMIDIDX index" in _error(prefix)
    open(prefix + ".idx", "wb").write(data[:9] + struct.pack("<Q", 2) + data[17:])
    assert "format version 2" in _error(prefix)
    open(prefix + ".idx", "wb").write(data[:-8])
    assert "truncated" in _error(prefix)
    open(prefix + ".idx", "wb").write(data[:20])
    assert "shorter than its 34-byte header" in _error(prefix)


def test_corrupt_pointers(tmp_path):
    prefix = _corpus(tmp_path)
    data = bytearray(open(prefix + ".idx", "rb").read())
    data[34 + 50 * 4 + 8] ^= 0xFF  # second sequence pointer
    open(prefix + ".idx", "wb").write(bytes(data))
    assert "sequence pointers" in _error(prefix)


def test_missing_files(tmp_path):
    assert "neither" in _error(tmp_path / "nothing")
    prefix = _corpus(tmp_path)
    os.remove(prefix + ".bin")
    assert ".bin is missing" in _error(prefix)
    assert IndexedDataset.__name__  # a prefix given as the .idx path is accepted:
    prefix = write_corpus(tmp_path / "d", [np.arange(3)])
    assert len(IndexedDataset(prefix + ".idx")) == 1


def test_writer_is_atomic(tmp_path):
    """An exception mid-write leaves nothing under the final names and no temp files."""
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "c", np.uint16) as w:
            w.add_document(np.arange(10))
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []


def test_writer_refuses_existing_output_unless_force(tmp_path):
    prefix = write_corpus(tmp_path / "c", [np.arange(5)])
    with pytest.raises(UserError, match="already exists.*--force"):
        write_corpus(tmp_path / "c", [np.arange(7)])
    np.testing.assert_array_equal(IndexedDataset(prefix)[0], np.arange(5))  # untouched
    with IndexedDatasetWriter(prefix, np.uint16, force=True) as w:
        w.add_document(np.arange(7))
    np.testing.assert_array_equal(IndexedDataset(prefix)[0], np.arange(7))
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx"]


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(UserError, match="token id 70000 does not fit the corpus dtype uint16"):
        with IndexedDatasetWriter(tmp_path / "c", np.uint16) as w:
            w.add_document(np.array([1, 70000, 2]))
    assert os.listdir(tmp_path) == []


def test_pickles_as_prefix(tmp_path):
    import pickle

    prefix = write_corpus(tmp_path / "c", [np.arange(1000)])
    blob = pickle.dumps(IndexedDataset(prefix))
    assert len(blob) < 500
    np.testing.assert_array_equal(pickle.loads(blob)[0], np.arange(1000))
