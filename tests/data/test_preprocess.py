"""`llmjp-ds preprocess`: what it writes (against SentencePiece directly), determinism, and every bad input."""

from __future__ import annotations

import bz2
import errno
import gzip
import lzma
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
    return sorted(p for p in os.listdir(tmp_path) if p.endswith((".bin", ".idx", "_text_document.json")) or
                  p.startswith("."))


BAD_LINES = [
    ({"txt": "wrong key"}, "in.jsonl:3: no 'text' key (keys: txt); pick the key with --text-key"),
    ({"text": ["a", "list"]}, "in.jsonl:3: 'text' is a JSON array, not a string"),
    ({"text": None}, "in.jsonl:3: 'text' is a JSON null, not a string"),
    ({"text": 5}, "in.jsonl:3: 'text' is a JSON number, not a string"),
    ({"text": False}, "in.jsonl:3: 'text' is a JSON boolean, not a string"),
    ({"text": {"nested": "text"}}, "in.jsonl:3: 'text' is a JSON object, not a string"),
    ('{"text": "abc \\ud800 def"}', "in.jsonl:3: 'text' holds a lone surrogate escape \\ud800 at character 4"),
    ('{"text": "\\udfff"}', "in.jsonl:3: 'text' holds a lone surrogate escape \\udfff at character 0"),
    ("[" * 100_000, "in.jsonl:3: invalid JSON (nested too deeply to parse)"),
    ("5", "in.jsonl:3: line is a JSON number, not an object"),
    ('{"text": "unterminated', "in.jsonl:3: invalid JSON (Unterminated string"),
    ('["not", "an", "object"]', "in.jsonl:3: line is a JSON array, not an object"),
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
    with pytest.raises(UserError, match=r"trunc.jsonl.gz ends before its compressed stream does \(truncated"):
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


def test_skip_bad_counts_surrogates_and_keeps_real_pairs(tmp_path, trained_tokenizer):
    records = [{"text": "one"}, '{"text": "abc \\ud800 def"}', '{"text": "pair \\ud83d\\ude00 ok"}', {"text": 1.5}]
    stats = preprocess([write_jsonl(tmp_path / "in.jsonl", records)], trained_tokenizer, tmp_path / "out",
                       skip_bad=True)
    assert stats["skipped_by_kind"] == {"lone surrogate": 1, "non-string 'text'": 1}
    ds = IndexedDataset(stats["prefix"])
    assert [ds[i].tolist() for i in range(len(ds))] == _expected(trained_tokenizer / "tokenizer.model",
                                                                 ["one", "pair \U0001F600 ok"])


def test_a_text_the_tokenizer_rejects_is_a_bad_line(tmp_path, trained_tokenizer, monkeypatch):
    from llmjp_ds.data.tokenizer import Tokenizer

    real = Tokenizer.encode_batch

    def picky(self, texts, num_threads=1):
        if any("BOOM" in t for t in texts):
            raise TypeError("List elements must be str or bytes")
        return real(self, texts, num_threads)

    monkeypatch.setattr(Tokenizer, "encode_batch", picky)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, {"text": "BOOM"}, {"text": "also fine"}])
    with pytest.raises(UserError) as info:
        preprocess([src], trained_tokenizer, tmp_path / "out")
    assert str(info.value) == (f"{src}:2: the tokenizer cannot encode 'text' (TypeError: List elements must be str "
                               f"or bytes); fix or remove the line, or pass --skip-bad to skip such lines")
    stats = preprocess([src], trained_tokenizer, tmp_path / "out", skip_bad=True)
    assert stats["documents"] == 2 and stats["skipped_by_kind"] == {"unencodable text": 1}


def test_utf8_bom_at_the_start_is_not_text(tmp_path, trained_tokenizer):
    plain = preprocess([write_jsonl(tmp_path / "a.jsonl", [{"text": "abc"}, {"text": "def"}])], trained_tokenizer,
                       tmp_path / "plain")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "a.jsonl").read_bytes())
    with_bom = preprocess([bom], trained_tokenizer, tmp_path / "bom")
    for suffix in (".bin", ".idx"):
        assert open(plain["prefix"] + suffix, "rb").read() == open(with_bom["prefix"] + suffix, "rb").read()


# --- compressed inputs: read to the true end --------------------------------------------------------------

def _text_records(n: int, seed: int = 0) -> list[dict]:
    """Documents of random words: little redundancy, so the compressed streams have many blocks."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(k))) for k in rng.integers(2, 9, 400)]
    return [{"text": " ".join(rng.choice(words, size=120)) + f" {i}"} for i in range(n)]


def _lines(records) -> bytes:
    import json

    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _compress(codec: str, data: bytes) -> bytes:
    if codec == "gz":
        return gzip.compress(data, mtime=0)
    if codec == "bz2":
        return bz2.compress(data)
    if codec == "xz":
        return lzma.compress(data)
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data)


def _zstd_frame_cuts(frame: bytes, offset: int) -> tuple[list[int], int]:
    """(every block boundary inside one zstd frame, plus the checksum's start, as offsets into the file; frame size).
    RFC 8878: a frame header, 3-byte block headers (bit 0 last, bits 1-2 type, bits 3-23 size), a 4-byte checksum."""
    assert frame[:4] == b"\x28\xb5\x2f\xfd"
    fhd = frame[4]
    single, checksum = fhd >> 5 & 1, fhd >> 2 & 1
    fcs = {0: single, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
    cuts = [pos]
    while True:
        header = int.from_bytes(frame[pos:pos + 3], "little")
        last, kind, size = header & 1, header >> 1 & 3, header >> 3
        pos += 3 + (1 if kind == 1 else size)
        cuts.append(pos)  # after the last block: where the checksum starts
        if last:
            break
    assert checksum
    return [offset + c for c in cuts], pos + 4


def test_zstd_cut_at_any_offset_is_refused(tmp_path, trained_tokenizer):
    """A multi-frame, multi-block .zst cut at each block boundary, inside block headers and blocks, in the
    checksum and in the second frame's header: always the truncation message, never a shorter corpus. Cut at the
    frame boundary the file is a complete shorter one (no format can tell), so that offset is the one left out."""
    records = _text_records(800)
    data = _lines(records)
    half = data.index(b"\n", len(data) // 2) + 1
    frames = [_compress("zst", data[:half]), _compress("zst", data[half:])]
    packed = frames[0] + frames[1]
    cuts, end = _zstd_frame_cuts(frames[0], 0)
    cuts2, _ = _zstd_frame_cuts(frames[1], end)
    assert len(cuts) >= 4 and len(cuts2) >= 4, "each frame must hold several blocks"
    offsets = sorted({*cuts[1:], *cuts2, cuts[1] + 1, cuts[2] + 2, (cuts[1] + cuts[2]) // 2, end - 1, end - 4,
                      end + 2, end + 7, len(packed) - 1, len(packed) - 3, 5, 2, 1} - {end, len(packed)})
    plain = preprocess([write_jsonl(tmp_path / "plain.jsonl", records)], trained_tokenizer, tmp_path / "plain")
    whole = tmp_path / "whole.jsonl.zst"
    whole.write_bytes(packed)
    stats = preprocess([whole], trained_tokenizer, tmp_path / "whole")
    assert stats["documents"] == len(records)
    for suffix in (".bin", ".idx"):
        assert open(plain["prefix"] + suffix, "rb").read() == open(stats["prefix"] + suffix, "rb").read()
    for cut in offsets:
        src = tmp_path / "cut.jsonl.zst"
        src.write_bytes(packed[:cut])
        with pytest.raises(UserError) as info:
            preprocess([src], trained_tokenizer, tmp_path / "cut")
        message = str(info.value)
        assert message.startswith(f"{src} ends before its compressed stream does (truncated"), (cut, message)
        assert message.endswith("an interrupted download or copy?): re-fetch it"), (cut, message)
        assert not list(tmp_path.glob("cut_text_document*")) and not list(tmp_path.glob(".cut*"))


@pytest.mark.parametrize("codec", ["gz", "zst", "bz2", "xz"])
def test_every_codec_reads_to_the_end_and_refuses_a_cut(tmp_path, trained_tokenizer, codec):
    """Two members (gzip members, zstd frames, bz2/xz streams, as pigz/pbzip2/pixz write): the whole file gives the
    plain file's corpus; cut anywhere but at the member boundary, it is refused as truncated (also train-tokenizer's
    reader)."""
    from llmjp_ds.data.inputs import iter_documents

    records = _text_records(150, seed=1)
    data = _lines(records)
    split = data.index(b"\n", len(data) // 3) + 1
    first = _compress(codec, data[:split])
    packed = first + _compress(codec, data[split:])
    plain = preprocess([write_jsonl(tmp_path / "plain.jsonl", records)], trained_tokenizer, tmp_path / "plain")
    whole = tmp_path / f"whole.jsonl.{codec}"
    whole.write_bytes(packed)
    stats = preprocess([whole], trained_tokenizer, tmp_path / "whole", workers=2, chunk_bytes=8192)
    for suffix in (".bin", ".idx"):
        assert open(plain["prefix"] + suffix, "rb").read() == open(stats["prefix"] + suffix, "rb").read()
    n = len(first)
    for cut in sorted({1, 3, n // 2, n - 1, n + 1, n + 5, (n + len(packed)) // 2, len(packed) - 1,
                       len(packed) - 4}):
        src = tmp_path / f"cut.jsonl.{codec}"
        src.write_bytes(packed[:cut])
        expect = f"{src} ends before its compressed stream does (truncated"
        with pytest.raises(UserError, match="^" + expect.replace(".", r"\.").replace("(", r"\(")):
            preprocess([src], trained_tokenizer, tmp_path / "cut", workers=2 if cut % 2 else 1, chunk_bytes=8192)
        with pytest.raises(UserError, match="^" + expect.replace(".", r"\.").replace("(", r"\(")):
            for _ in iter_documents([src]):
                pass
    assert not list(tmp_path.glob("cut_text_document*")) and not list(tmp_path.glob(".cut*"))


@pytest.mark.parametrize("codec,name", [("gz", "gzip"), ("zst", "zstd"), ("bz2", "bzip2"), ("xz", "xz")])
def test_corrupt_compressed_data_is_blamed_on_the_stream(tmp_path, trained_tokenizer, codec, name):
    """Bytes overwritten in the middle of the stream: one line naming the file and the codec, not a bad line made
    of the garbage (gzip's CRC comes at the end, after the garbage was decompressed), with or without --skip-bad."""
    packed = bytearray(_compress(codec, _lines(_text_records(100, seed=2))))
    mid = len(packed) // 2
    packed[mid:mid + 64] = bytes(range(64))
    src = tmp_path / f"bad.jsonl.{codec}"
    src.write_bytes(bytes(packed))
    for skip_bad in (False, True):
        with pytest.raises(UserError) as info:
            preprocess([src], trained_tokenizer, tmp_path / "out", skip_bad=skip_bad)
        message = str(info.value)
        assert message.startswith(f"{src}: the {name} data is corrupt ("), message
        assert message.endswith("re-fetch it, or re-compress it from the source") and "\n" not in message
    assert _final_files(tmp_path) == []


def test_compressed_names_and_contents_must_agree(tmp_path, trained_tokenizer):
    cases = {
        "plain.jsonl.zst": (b'{"text": "not compressed"}\n', "is named as zstd but does not start with a zstd header"),
        "empty.jsonl.gz": (b"", "ends before its compressed stream does (truncated: 0 bytes, not even a gzip header"),
        "short.jsonl.xz": (b"\xfd7z", "ends before its compressed stream does (truncated: 3 bytes"),
        "arch.jsonl": (b"PK\x03\x04rest of a zip", "is a zip archive, which preprocess does not read"),
    }
    for name, (data, fragment) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match=fragment.replace("(", r"\(")):
            preprocess([tmp_path / name], trained_tokenizer, tmp_path / "out")
    # content decides when it is a known codec: a gzip file without the suffix still reads
    (tmp_path / "noext").write_bytes(gzip.compress(b'{"text": "abc"}\n'))
    assert preprocess([tmp_path / "noext"], trained_tokenizer, tmp_path / "out")["documents"] == 1


def test_gzip_zero_padding_after_the_last_member_is_accepted(tmp_path, trained_tokenizer):
    src = tmp_path / "pad.jsonl.gz"
    src.write_bytes(gzip.compress(b'{"text": "abc"}\n') + b"\x00" * 512)  # tape/dd padding, as gzip(1) accepts
    assert preprocess([src], trained_tokenizer, tmp_path / "out")["documents"] == 1


# --- inputs and outputs that are not what they seem ---------------------------------------------------------

def test_unreadable_inputs_and_bad_worker_counts(tmp_path, trained_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    for workers in (0, -2):
        with pytest.raises(UserError, match=f"^--workers {workers}: need at least 1"):
            preprocess([src], trained_tokenizer, tmp_path / "out", workers=workers)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="directory .*empty holds no input files"):
        preprocess([tmp_path / "empty"], trained_tokenizer, tmp_path / "out")
    if os.path.exists("/proc/self/mem"):  # exists, and every read fails (EIO): unreadable even for root
        with pytest.raises(UserError, match=r"^cannot read input /proc/self/mem \(Input/output error\)"):
            preprocess(["/proc/self/mem"], trained_tokenizer, tmp_path / "out")
    assert _final_files(tmp_path) == []


def test_output_directory_problems(tmp_path, trained_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    with pytest.raises(UserError, match=f"^cannot write {tmp_path}/in.jsonl/x/out_text_document.bin: "
                                        f"{tmp_path}/in.jsonl is a file, not a directory"):
        preprocess([src], trained_tokenizer, tmp_path / "in.jsonl" / "x" / "out")
    # a directory that preprocess creates is removed again when it fails
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{nope"])
    with pytest.raises(UserError, match="invalid JSON"):
        preprocess([bad], trained_tokenizer, tmp_path / "new" / "deeper" / "out")
    assert not (tmp_path / "new").exists()
    stats = preprocess([src], trained_tokenizer, tmp_path / "new" / "deeper" / "out")
    assert IndexedDataset(stats["prefix"]).num_documents == 1


class _FailingFile:
    """A file whose writes (or only its final flush) fail with ``err``, as a full disk or a quota makes them."""

    def __init__(self, real, err: int, at: str):
        self.real, self.err, self.at = real, err, at

    def _boom(self):
        raise OSError(self.err, os.strerror(self.err))

    def write(self, data):
        if self.at == "write":
            self._boom()
        return self.real.write(data)

    def flush(self):
        if self.at == "flush":
            self._boom()
        return self.real.flush()

    def close(self):
        if not self.real.closed:
            self.real.close()
            if self.at in ("write", "flush"):
                self._boom()  # the buffered bytes fail again on close

    @property
    def closed(self):
        return self.real.closed

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EFBIG, errno.EIO, errno.EDQUOT])
@pytest.mark.parametrize("at", ["write", "flush"])
def test_write_error_is_one_line_and_leaves_nothing(tmp_path, trained_tokenizer, monkeypatch, err, at):
    """A full disk (ENOSPC), file-size limit (EFBIG), I/O error, quota (EDQUOT), in the middle of writing or at the
    final flush: one line naming the output, the reason and the free space; no temp file; an existing corpus that
    --force would have replaced is untouched."""
    import builtins

    import llmjp_ds.data.indexed as indexed

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"document {i} " * 50} for i in range(50)])
    old = preprocess([src], trained_tokenizer, tmp_path / "out")
    before = {s: open(old["prefix"] + s, "rb").read() for s in (".bin", ".idx", ".json")}
    real_open = builtins.open
    monkeypatch.setattr(indexed, "open", lambda path, mode="r", *a, **k: _FailingFile(
        real_open(path, mode, *a, **k), err, at) if "w" in mode and str(path).endswith(".tmp") else
        real_open(path, mode, *a, **k), raising=False)
    with pytest.raises(UserError) as info:
        preprocess([src], trained_tokenizer, tmp_path / "out", force=True, chunk_bytes=256)
    message = str(info.value)
    assert message.startswith(f"cannot write {old['prefix']}.bin/.idx: {os.strerror(err)} "
                              f"({errno.errorcode[err]}); "), message
    assert " free there: free space" in message and "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx",
                                            "out_text_document.json"]
    assert {s: open(old["prefix"] + s, "rb").read() for s in (".bin", ".idx", ".json")} == before
