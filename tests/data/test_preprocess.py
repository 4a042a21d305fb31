"""`llmjp-ds preprocess`: what it writes (against SentencePiece directly), determinism, and every bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from llmjp_ds.data.indexed import IndexedDataset
from llmjp_ds.data.preprocess import preprocess
from llmjp_ds.errors import UserError

from .data_helpers import TRICKY, write_jsonl


def _docs(corpus_texts, n=300):
    return [{"text": t, "id": i} for i, t in enumerate(TRICKY + corpus_texts[:n])]


def _expected(model, texts):
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [[1, *ids, 2] for ids in sp.encode(texts)]


def test_llmjp_v3_documents_are_bos_pieces_eos(tmp_path, llmjp_model, corpus_texts):
    """Each document is exactly [1] + sp.encode(text) + [2] with the real LLM-jp v3 model (int32: vocab 99,574)."""
    records = _docs(corpus_texts)
    src = write_jsonl(tmp_path / "in.jsonl", records)
    stats = preprocess([src], llmjp_model, tmp_path / "out")
    ds = IndexedDataset(stats["prefix"])
    assert stats["prefix"] == str(tmp_path / "out_text_document")
    assert ds.dtype == np.int32 and stats["documents"] == len(records) == len(ds)
    expected = _expected(llmjp_model, [r["text"] for r in records])
    for i, want in enumerate(expected):
        assert ds[i].tolist() == want
    assert ds[TRICKY.index("")].tolist() == [1, 2]  # an empty text still makes [bos, eos], as Megatron does
    assert stats["tokens"] == sum(map(len, expected))


@pytest.mark.parametrize("compress", ["gz", "zst"])
def test_compressed_inputs_give_identical_output(tmp_path, trained_tokenizer, corpus_texts, compress):
    records = _docs(corpus_texts, 100)
    plain = preprocess([write_jsonl(tmp_path / "a.jsonl", records)], trained_tokenizer, tmp_path / "plain")
    packed = preprocess([write_jsonl(tmp_path / f"a.jsonl.{compress}", records, compress)], trained_tokenizer,
                        tmp_path / "packed")
    for suffix in (".bin", ".idx"):
        assert open(plain["prefix"] + suffix, "rb").read() == open(packed["prefix"] + suffix, "rb").read()
    assert IndexedDataset(plain["prefix"]).dtype == np.uint16  # vocab 2,000 fits


def test_two_workers_equal_one_byte_for_byte(tmp_path, trained_tokenizer, corpus_texts):
    records = _docs(corpus_texts, 600)
    files = [write_jsonl(tmp_path / "a.jsonl", records[:400]),
             write_jsonl(tmp_path / "b.jsonl.gz", records[400:], "gz")]
    one = preprocess(files, trained_tokenizer, tmp_path / "w1", workers=1, chunk_bytes=4096)
    two = preprocess(files, trained_tokenizer, tmp_path / "w2", workers=2, chunk_bytes=4096)
    for suffix in (".bin", ".idx"):
        assert open(one["prefix"] + suffix, "rb").read() == open(two["prefix"] + suffix, "rb").read()
    ds = IndexedDataset(two["prefix"])
    expected = _expected(trained_tokenizer / "tokenizer.model", [r["text"] for r in records])
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def _final_files(tmp_path) -> list[str]:
    return sorted(p for p in os.listdir(tmp_path) if p.endswith((".bin", ".idx")) or p.startswith("."))


BAD_LINES = [
    ({"txt": "wrong key"}, "in.jsonl:3: no 'text' key (keys: txt); pick the key with --text-key"),
    ({"text": ["a", "list"]}, "in.jsonl:3: 'text' is a JSON list, not a string"),
    ({"text": None}, "in.jsonl:3: 'text' is a JSON NoneType, not a string"),
    ('{"text": "unterminated', "in.jsonl:3: invalid JSON (Unterminated string"),
    ('["not", "an", "object"]', "in.jsonl:3: line is a JSON list, not an object"),
    (b'{"text": "\xff\xfe"}', "in.jsonl:3: invalid UTF-8 at byte 10"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES, ids=[m.split(": ", 1)[1][:18] for _, m in BAD_LINES])
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_is_one_line_error_and_leaves_nothing(tmp_path, trained_tokenizer, bad, message, workers):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "good"}, {"text": "also good"}, bad, {"text": "fine"}])
    with pytest.raises(UserError) as info:
        preprocess([src], trained_tokenizer, tmp_path / "out", workers=workers)
    text = str(info.value)
    assert message in text and "--skip-bad" in text and "\n" not in text
    assert _final_files(tmp_path) == []  # no output, no temp files


def test_skip_bad_counts_and_keeps_the_rest(tmp_path, trained_tokenizer):
    records = [{"text": "one"}, {"txt": "x"}, '{"text": 1}', "{broken", "", {"text": "two"}]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    stats = preprocess([src], trained_tokenizer, tmp_path / "out", skip_bad=True)
    assert stats["documents"] == 2 and stats["skipped"] == 3  # the blank line is not a document, nor an error
    assert stats["skipped_by_kind"] == {"no 'text' key": 1, "non-string 'text'": 1, "invalid JSON": 1}
    assert stats["first_skipped"].startswith(f"{src}:2: no 'text' key")
    ds = IndexedDataset(stats["prefix"])
    assert [ds[i].tolist() for i in range(2)] == _expected(trained_tokenizer / "tokenizer.model", ["one", "two"])


def test_text_key(tmp_path, trained_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [{"content": "abc"}])
    stats = preprocess([src], trained_tokenizer, tmp_path / "out", text_key="content")
    assert IndexedDataset(stats["prefix"])[0].tolist() == _expected(trained_tokenizer / "tokenizer.model", ["abc"])[0]


def test_empty_corpus(tmp_path, trained_tokenizer):
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(UserError, match="no documents in .*empty.jsonl: nothing to write"):
        preprocess([empty], trained_tokenizer, tmp_path / "out")
    skipped = write_jsonl(tmp_path / "s.jsonl", [{"a": 1}])
    with pytest.raises(UserError, match=r"1 bad lines skipped, e.g. .*s.jsonl:1"):
        preprocess([skipped], trained_tokenizer, tmp_path / "out", skip_bad=True)
    assert _final_files(tmp_path) == []


def test_existing_output_needs_force(tmp_path, trained_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    first = preprocess([src], trained_tokenizer, tmp_path / "out")
    before = open(first["prefix"] + ".bin", "rb").read()
    src2 = write_jsonl(tmp_path / "in2.jsonl", [{"text": "something else entirely"}])
    with pytest.raises(UserError, match="out_text_document.bin already exists: .*--force"):
        preprocess([src2], trained_tokenizer, tmp_path / "out")
    assert open(first["prefix"] + ".bin", "rb").read() == before
    preprocess([src2], trained_tokenizer, tmp_path / "out", force=True)
    assert open(first["prefix"] + ".bin", "rb").read() != before
    assert len(IndexedDataset(first["prefix"])) == 1


def test_token_outside_vocab_is_refused(tmp_path, trained_tokenizer, monkeypatch):
    from llmjp_ds.data.tokenizer import Tokenizer

    monkeypatch.setattr(Tokenizer, "encode_batch", lambda self, texts, num_threads=1: [[5, 2000]] * len(texts))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    with pytest.raises(UserError, match="token id 2000 is outside the vocabulary \\(size 2000\\)"):
        preprocess([src], trained_tokenizer, tmp_path / "out")
    assert _final_files(tmp_path) == []


def test_missing_inputs(tmp_path, trained_tokenizer):
    with pytest.raises(UserError, match="input .*nope.jsonl not found"):
        preprocess([tmp_path / "nope.jsonl"], trained_tokenizer, tmp_path / "out")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    with pytest.raises(UserError, match="tokenizer .*nope.model not found"):
        preprocess([src], tmp_path / "nope.model", tmp_path / "out")
    (tmp_path / "trunc.jsonl.gz").write_bytes(open(write_jsonl(tmp_path / "t.gz", [{"text": "x" * 5000}] * 50, "gz"),
                                                   "rb").read()[:200])
    with pytest.raises(UserError, match=r"trunc.jsonl.gz:\d+: cannot decompress .*truncated or corrupt"):
        preprocess([tmp_path / "trunc.jsonl.gz"], trained_tokenizer, tmp_path / "out")


def test_cli_prints_one_line_and_exits_non_zero(tmp_path, trained_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ok"}, "{nope"])
    cmd = [sys.executable, "-m", "llmjp_ds.cli", "preprocess", "--input", str(src), "--tokenizer",
           str(trained_tokenizer), "--output-prefix", str(tmp_path / "out"), "--workers", "1"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: {src}:2: invalid JSON (Expecting property name enclosed in double quotes, column 2); fix or "
        f"remove the line, or pass --skip-bad to skip such lines"]
    good = subprocess.run(cmd + ["--skip-bad"], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stderr
    assert "wrote" in good.stderr and "skipped 1 bad lines (1 invalid JSON)" in good.stderr
