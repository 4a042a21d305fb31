"""Parquet, Arrow (datasets.save_to_disk) and jsonl holding the same documents give the same corpus, byte for byte;
directories and globs; the summary beside the corpus; bad columns and rows; cut and corrupt files; memory."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm

from llmjp_ds.data.indexed import IndexedDataset
from llmjp_ds.data.inputs import iter_documents
from llmjp_ds.data.preprocess import preprocess
from llmjp_ds.errors import UserError

from .data_helpers import TRICKY, write_arrow_stream, write_jsonl, write_parquet, write_saved_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(corpus_texts, n=400):
    return [{"text": t} for t in TRICKY + corpus_texts[:n]]


def _bytes(prefix: str) -> tuple[bytes, bytes]:
    return tuple(open(prefix + s, "rb").read() for s in (".bin", ".idx"))


def _outputs(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.rglob("*") if p.name.endswith((".bin", ".idx", "_text_document.json"))
                  or p.name.startswith(".out"))


@pytest.fixture
def same_documents(tmp_path, corpus_texts):
    """One list of documents as jsonl, jsonl.gz, parquet (snappy, several row groups), parquet (zstd,
    large_string), a save_to_disk directory (2 shards of 50-row batches) and an Arrow IPC file."""
    records = _records(corpus_texts)
    table = pa.table({"id": list(range(len(records))), "text": [r["text"] for r in records]})
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=70)
    return records, {
        "jsonl": write_jsonl(tmp_path / "a.jsonl", records),
        "jsonl.gz": write_jsonl(tmp_path / "a.jsonl.gz", records, "gz"),
        "parquet": write_parquet(tmp_path / "a.parquet", records, row_group_size=37),
        "parquet-zstd-large": write_parquet(tmp_path / "b.parquet", records, row_group_size=1000, compression="zstd",
                                            large=True),
        "saved-dataset": write_saved_dataset(tmp_path / "saved", records, shards=2, batch_rows=50),
        "arrow-file": tmp_path / "file.arrow",
    }


@pytest.mark.parametrize("workers", [1, 2])
def test_every_format_gives_the_same_bytes(tmp_path, trained_tokenizer, same_documents, workers):
    records, inputs = same_documents
    out = {name: preprocess([src], trained_tokenizer, tmp_path / f"out_{name}", workers=workers, chunk_bytes=8192)
           for name, src in inputs.items()}
    reference = _bytes(out["jsonl"]["prefix"])
    for name, stats in out.items():
        assert _bytes(stats["prefix"]) == reference, name
        assert stats["documents"] == len(records)
    sp = spm.SentencePieceProcessor(model_file=str(trained_tokenizer / "tokenizer.model"))
    ds = IndexedDataset(out["saved-dataset"]["prefix"])
    expected = [[1, *ids, 2] for ids in sp.encode([r["text"] for r in records])]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds[TRICKY.index("")].tolist() == [1, 2]  # an empty string is a document, as {"text": ""} is


def test_megatron_reads_a_corpus_made_from_parquet(tmp_path, trained_tokenizer, same_documents, megatron_indexed):
    records, inputs = same_documents
    stats = preprocess([inputs["parquet"]], trained_tokenizer, tmp_path / "out", chunk_bytes=8192)
    theirs = megatron_indexed.IndexedDataset(stats["prefix"], mmap=True)
    ours = IndexedDataset(stats["prefix"])
    assert len(theirs) == len(records)
    for i in range(len(records)):
        assert theirs[i].tolist() == ours[i].tolist()


def test_a_directory_is_its_shards_in_sorted_order(tmp_path, trained_tokenizer, corpus_texts):
    records = _records(corpus_texts, 300)
    d = tmp_path / "shards"
    (d / "b").mkdir(parents=True)
    # sorted by relative path: a-0, a-1, b/saved (its shards in state.json order), b/x
    files = [write_parquet(d / "a-0.parquet", records[:80], 30), write_jsonl(d / "a-1.jsonl.gz", records[80:150], "gz"),
             write_saved_dataset(d / "b" / "saved", records[150:220], shards=3, batch_rows=20),
             write_parquet(d / "b" / "x.parquet", records[220:], 30)]
    (d / "README.md").write_text("not a shard")
    (d / ".hidden.parquet").write_bytes(b"not read")
    by_dir = preprocess([d], trained_tokenizer, tmp_path / "dir", workers=2, chunk_bytes=4096)
    by_hand = preprocess(files, trained_tokenizer, tmp_path / "hand", chunk_bytes=4096)
    by_glob = preprocess([str(d / "a-*"), str(d / "b" / "**" / "*.arrow"), str(d / "b" / "*.parquet")],
                         trained_tokenizer, tmp_path / "glob", chunk_bytes=4096)
    one = preprocess([write_jsonl(tmp_path / "all.jsonl", records)], trained_tokenizer, tmp_path / "one")
    assert _bytes(by_dir["prefix"]) == _bytes(by_hand["prefix"]) == _bytes(by_glob["prefix"]) == _bytes(one["prefix"])
    order = [e["path"] for e in json.loads(open(by_dir["prefix"] + ".json").read())["inputs"]]
    shards = [str(d / "b" / "saved" / f"data-0000{i}-of-00003.arrow") for i in range(3)]
    assert order == [str(d / "a-0.parquet"), str(d / "a-1.jsonl.gz"), *shards, str(d / "b" / "x.parquet")]


def test_the_summary_beside_the_corpus(tmp_path, trained_tokenizer, corpus_texts):
    texts = corpus_texts[:60]
    rows = [None if i % 7 == 3 else t for i, t in enumerate(texts)]  # nulls: skipped and counted with --skip-bad
    pq_file = write_parquet(tmp_path / "a.parquet", rows, row_group_size=16)
    lines = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in rows])  # {"text": null}: the same kind
    stats = preprocess([pq_file, lines], trained_tokenizer, tmp_path / "out", skip_bad=True, workers=2,
                       chunk_bytes=2048)
    summary = json.loads(open(stats["prefix"] + ".json").read())
    sp = spm.SentencePieceProcessor(model_file=str(trained_tokenizer / "tokenizer.model"))
    kept = [t for t in rows if t is not None]
    tokens = sum(len(ids) + 2 for ids in sp.encode(kept))
    nulls = rows.count(None)
    for entry, path, fmt in zip(summary["inputs"], (pq_file, lines), ("parquet", "jsonl")):
        assert entry == {"path": str(path), "format": fmt, "bytes": path.stat().st_size, "documents": len(kept),
                         "tokens": tokens, "skipped": {"non-string 'text'": nulls}}
    model = (trained_tokenizer / "tokenizer.model").read_bytes()
    assert summary["tokenizer"]["sha256"] == hashlib.sha256(model).hexdigest()
    assert summary["documents"] == 2 * len(kept) == len(IndexedDataset(stats["prefix"]))
    assert summary["tokens"] == 2 * tokens and summary["skipped"] == {"non-string 'text'": 2 * nulls}


def test_bad_columns_and_rows(tmp_path, trained_tokenizer):
    good = write_parquet(tmp_path / "good.parquet", [f"document {i}" for i in range(30)], 10)
    nulls = write_parquet(tmp_path / "nulls.parquet", ["a", "b", None, "c"], 2)
    other_key = write_parquet(tmp_path / "body.parquet", ["x"] * 25, 10, text_key="body")
    numbers = tmp_path / "numbers.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": list(range(12))}), numbers)
    cases = [(nulls, r"nulls.parquet: row 2: 'text' is null, not a string; .*or pass --skip-bad to skip such rows"),
             (other_key, r"body.parquet: no 'text' column \(columns: body, id\); pick the column with --text-key, "
                         r"or pass --skip-bad"),
             (numbers, r"numbers.parquet: column 'text' holds int64, not strings")]
    for src, message in cases:
        with pytest.raises(UserError, match=message):
            preprocess([good, src], trained_tokenizer, tmp_path / "out", workers=2)
        assert _outputs(tmp_path) == []
    stats = preprocess([good, nulls, other_key, numbers], trained_tokenizer, tmp_path / "out", skip_bad=True)
    assert stats["documents"] == 30 + 3
    assert stats["skipped_by_kind"] == {"non-string 'text'": 1 + 12, "no 'text' key": 25}
    assert preprocess([other_key], trained_tokenizer, tmp_path / "body", text_key="body")["documents"] == 25
    assert [t for _, _, t in iter_documents([nulls], skip_bad=True)] == ["a", "b", "c"]


def _cut_and_corrupt(tmp_path, records):
    """Broken copies of good files: what a cut download or a bad disk leaves."""
    pq_bytes = write_parquet(tmp_path / "ok.parquet", records, 20).read_bytes()
    stream = write_arrow_stream(tmp_path / "ok.arrow", pa.table({"text": [r["text"] for r in records]}), 25)
    raw = stream.read_bytes()
    broken = {"cut-footer.parquet": pq_bytes[:-10], "half.parquet": pq_bytes[:len(pq_bytes) // 2],
              "cut-mid-batch.arrow": raw[:len(raw) // 2], "no-eos.arrow": raw[:-8],
              "empty.parquet": b""}
    corrupt = bytearray(raw)
    corrupt[len(raw) // 3:len(raw) // 3 + 40] = b"\xff" * 40
    broken["corrupt.arrow"] = bytes(corrupt)
    corrupt = bytearray(pq_bytes)
    corrupt[len(pq_bytes) // 3:len(pq_bytes) // 3 + 40] = b"\x07" * 40
    broken["corrupt.parquet"] = bytes(corrupt)
    for name, data in broken.items():
        (tmp_path / name).write_bytes(data)
    return list(broken)


def test_cut_or_corrupt_columnar_files_are_one_line_and_leave_nothing(tmp_path, trained_tokenizer, corpus_texts):
    records = _records(corpus_texts, 200)
    first = write_jsonl(tmp_path / "first.jsonl", records)
    for name in _cut_and_corrupt(tmp_path, records):
        for workers in (1, 2):
            with pytest.raises(UserError) as info:
                preprocess([first, tmp_path / name], trained_tokenizer, tmp_path / "out", workers=workers,
                           chunk_bytes=4096)
            message = str(info.value)
            assert str(tmp_path / name) in message and "\n" not in message, message
            assert "re-fetch it" in message or "rename it" in message, message
            assert _outputs(tmp_path) == [], name
    # the good originals still read: the failures above are the damage, not the reader
    ok = preprocess([tmp_path / "ok.parquet", tmp_path / "ok.arrow"], trained_tokenizer, tmp_path / "ok")
    assert ok["documents"] == 2 * len(records)


def test_inputs_that_name_nothing(tmp_path, trained_tokenizer):
    (tmp_path / "empty").mkdir()
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    for inputs, message in (([tmp_path / "empty"], "directory .*empty holds no input files"),
                            ([str(tmp_path / "*.parquet")], r"--input '.*\*.parquet' matches no file"),
                            ([src, tmp_path], "a.jsonl is given twice"),
                            ([tmp_path / "nope.parquet"], "input .*nope.parquet not found")):
        with pytest.raises(UserError, match=message):
            preprocess(inputs, trained_tokenizer, tmp_path / "out")
    d = write_saved_dataset(tmp_path / "dd" / "train", [{"text": "x"}] * 4)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(UserError, match="is a datasets DatasetDict .*splits: train.*pass one split's directory"):
        preprocess([tmp_path / "dd"], trained_tokenizer, tmp_path / "out")
    (d / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(UserError, match="state.json lists data-00001-of-00002.arrow, which is missing"):
        preprocess([d], trained_tokenizer, tmp_path / "out")


MEMORY_CHILD = textwrap.dedent("""
    import json, sys
    import pyarrow.parquet
    from llmjp_ds.data.preprocess import preprocess
    from llmjp_ds.data.tokenizer import load_tokenizer

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    src, tok, out = sys.argv[1:4]
    load_tokenizer(tok).encode_documents(["warm up " * 100])
    before = status("VmRSS:")
    stats = preprocess([src], tok, out, workers=1, progress=False)
    print(json.dumps({"growth": status("VmHWM:") - before, "tokens": stats["tokens"]}))
""")


def _peak_growth(tmp_path, trained_tokenizer, row_groups: int) -> tuple[int, int]:
    """(peak RSS growth of a fresh process preprocessing it, text bytes) for a parquet file of ``row_groups``
    row groups of ~4 MB of text each."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(row_groups)
    words = np.array(["the", "quick", "brown", "fox", "日本語", "の", "文章", "です", "code", "def", "x = 1", "\n"])
    docs = [" ".join(rng.choice(words, 400)) for _ in range(2_000 * row_groups)]
    src = tmp_path / f"big{row_groups}.parquet"
    pq.write_table(pa.table({"text": docs}), src, row_group_size=2_000, compression="snappy")
    assert pq.ParquetFile(src).metadata.num_row_groups == row_groups
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(src), str(trained_tokenizer),
                             str(tmp_path / f"out{row_groups}")], capture_output=True, text=True, env=env, timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["tokens"] > 0
    return measured["growth"], sum(len(d.encode()) for d in docs)


@pytest.mark.timeout(300)
def test_memory_stays_at_a_row_group_not_the_file(tmp_path, trained_tokenizer):
    """Peak RSS growth (VmHWM in a fresh process) for 2 and for 8 row groups of ~4 MB of text: the 24 MB more text
    of the larger file adds less than a quarter of itself (a reader that loads the file whole holds all of its
    text and then all its ids: more than the text itself). What both share is the row group in flight, its ids
    and the tokenizer's working memory (~50-60 MB here, whatever the file's size)."""
    small, small_text = _peak_growth(tmp_path, trained_tokenizer, 2)
    large, large_text = _peak_growth(tmp_path, trained_tokenizer, 8)
    assert large_text > 30e6
    assert large - small < 0.25 * (large_text - small_text), (small, large, small_text, large_text)


def test_train_tokenizer_reads_every_format_the_same(same_documents):
    """train-tokenizer's document iterator gives the same texts, in the same order, from every container."""
    records, inputs = same_documents
    want = [r["text"] for r in records]
    for name, src in inputs.items():
        assert [text for _, _, text in iter_documents([src])] == want, name
