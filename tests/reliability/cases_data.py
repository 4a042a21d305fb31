"""Bad inputs of the catalogue, data: corpora, preprocess, train-tokenizer, plot and hostfiles."""

from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

from tests.reliability.cases import SMALL, Case, L, T, sub  # noqa: F401


def _pp(src, out="out_x", *more):
    """``llmjp-ds preprocess`` of ``src`` into a fresh prefix under {tmp}/data (a failing case leaves nothing there)."""
    return L("preprocess", "--input", src, "--tokenizer", "{tok}", "--output-prefix", f"{{tmp}}/data/{out}",
             "--workers", "1", *more)


def _without_megatron(*sets):
    """``python -m llmjp_ds.train`` (T's arguments) in an interpreter where megatron-core cannot be imported."""
    def argv(c):
        args = T(*sets)(c)[2:]
        code = ("import runpy, sys; sys.modules['megatron'] = None; "
                f"sys.argv = ['llmjp_ds.train', *{args!r}]; runpy.run_module('llmjp_ds.train', run_name='__main__')")
        return ["-c", code]
    return argv


MEGATRON_CACHE = ("data.order=megatron", "data.blend=[{tmp}/good_text_document]",
                  "data.cache_dir={tmp}/data/megatron_cache")
TRUNCATED = "ends before its compressed stream does (truncated"
REFETCH = "an interrupted download or copy?): re-fetch it"

CASES: list[Case] = [
    # --- preprocess: compressed inputs read to their true end ---------------------------------------------
    Case("preprocess-zst-truncated-at-block", _pp("{tmp}/data/cut.jsonl.zst"),
         ("data/cut.jsonl.zst " + TRUNCATED, REFETCH)),
    Case("preprocess-gz-truncated", _pp("{tmp}/data/cut.jsonl.gz"), ("data/cut.jsonl.gz " + TRUNCATED, REFETCH)),
    Case("preprocess-xz-truncated", _pp("{tmp}/data/cut.jsonl.xz", "out_x", "--workers", "2"),
         ("data/cut.jsonl.xz " + TRUNCATED, REFETCH)),
    Case("preprocess-compressed-corrupt", _pp("{tmp}/data/corrupt.jsonl.gz"),
         ("data/corrupt.jsonl.gz: the gzip data is corrupt (", "re-fetch it, or re-compress it from the source")),
    Case("preprocess-compressed-misnamed", _pp("{tmp}/data/plain.jsonl.zst"),
         ("plain.jsonl.zst is named as zstd but does not start with a zstd header",)),
    # --- preprocess: lines and inputs ---------------------------------------------------------------------
    Case("preprocess-lone-surrogate", _pp("{tmp}/data/surrogate.jsonl"),
         ("surrogate.jsonl:2: 'text' holds a lone surrogate escape \\ud800 at character 4",
          "or pass --skip-bad to skip such lines")),
    Case("preprocess-text-null", _pp("{tmp}/data/null.jsonl"),
         ("null.jsonl:1: 'text' is a JSON null, not a string", "or pass --skip-bad")),
    Case("preprocess-text-key-missing", _pp("{tmp}/docs.jsonl", "out_x", "--text-key", "body"),
         ("docs.jsonl:1: no 'body' key (keys: text); pick the key with --text-key",)),
    Case("preprocess-empty-input", _pp("{tmp}/data/empty.jsonl"),
         ("no documents in", "empty.jsonl: nothing to write; check the files and --text-key 'text'")),
    Case("preprocess-input-dir-empty", _pp("{tmp}/data/empty_dir"),
         ("directory", "data/empty_dir holds no input files (jsonl (plain, .gz, .zst, .bz2, .xz), parquet, Arrow",)),
    Case("preprocess-glob-matches-nothing", _pp("{tmp}/data/*.nomatch"),
         ("--input '", "data/*.nomatch' matches no file: check the pattern")),
    Case("preprocess-input-twice", L("preprocess", "--input", "{tmp}/data/shards", "{tmp}/data/shards/a.parquet",
                                     "--tokenizer", "{tok}", "--output-prefix", "{tmp}/data/out_x"),
         ("data/shards/a.parquet is given twice (by --input '", "data/shards' and '", "list each file once")),
    Case("preprocess-input-unreadable", _pp("/proc/self/mem"),
         ("cannot read input /proc/self/mem (Input/output error)",)),
    Case("preprocess-workers-zero", _pp("{tmp}/docs.jsonl", "out_x", "--workers", "0"),
         ("--workers 0: need at least 1",)),
    Case("preprocess-output-dir-is-a-file", _pp("{tmp}/docs.jsonl", "a_file/out"),
         ("data/a_file is a file, not a directory; choose another --output-prefix",)),
    # --- preprocess: parquet and Arrow ---------------------------------------------------------------------
    Case("preprocess-parquet-cut-footer", _pp("{tmp}/data/cut.parquet"),
         ("data/cut.parquet is not a readable parquet file (Parquet magic bytes not found in footer",
          "the file is truncated or corrupt", "re-fetch it")),
    Case("preprocess-parquet-misnamed", _pp("{tmp}/data/lines.parquet"),
         ("data/lines.parquet is named .parquet but does not start with PAR1", "re-fetch it, or rename it")),
    Case("preprocess-arrow-shard-corrupt", _pp("{tmp}/data/ds_bad", "out_x", "--workers", "2"),
         ("data/ds_bad/data-00001-of-00002.arrow: record batches", "cannot be read (Invalid UTF8 sequence",
          "the file is corrupt; re-fetch it")),
    Case("preprocess-arrow-shard-truncated", _pp("{tmp}/data/ds_cut"),
         ("data/ds_cut/data-00000-of-00002.arrow ends without the Arrow stream's end-of-stream marker (truncated "
          "after", "re-fetch it, or save the dataset again")),
    Case("preprocess-arrow-state-lists-missing-shard", _pp("{tmp}/data/ds_missing"),
         ("ds_missing/state.json lists data-00001-of-00002.arrow, which is missing: the dataset is incomplete",)),
    Case("preprocess-arrow-dataset-dict", _pp("{tmp}/data/ds_dict"),
         ("data/ds_dict is a datasets DatasetDict (splits: train): pass one split's directory",)),
    Case("preprocess-column-missing", _pp("{tmp}/data/shards", "out_x", "--text-key", "body"),
         ("data/shards/a.parquet: no 'body' column (columns: text, id); pick the column with --text-key",
          "or pass --skip-bad to skip such rows")),
    Case("preprocess-column-not-string", _pp("{tmp}/data/numbers.parquet"),
         ("data/numbers.parquet: column 'text' holds int64, not strings", "or pass --skip-bad")),
    Case("preprocess-column-null", _pp("{tmp}/data/nulls.parquet", "out_x", "--workers", "2"),
         ("data/nulls.parquet: row 2: 'text' is null, not a string", "or pass --skip-bad to skip such rows")),
    # --- Megatron's sample order, and the samples verb -----------------------------------------------------
    Case("megatron-core-missing", _without_megatron(SMALL, "data.order=megatron"),
         ("data.order=megatron reads Megatron's samples through megatron-core's dataset builder, but megatron-core "
          "is not importable", "pip install 'llmjp-ds[megatron]', or set data.order=llmjp"), trains=True),
    Case("megatron-blend-weight-zero", T(SMALL, "data.order=megatron",
                                         "data.blend=[0, {tmp}/good_text_document, 1, {tmp}/good_text_document]"),
         ("data.blend has a weight of 0: Megatron's builder needs every weight > 0",), trains=True),
    Case("megatron-split-without-tokens", T(SMALL, "data.order=megatron", "data.blend=[{tmp}/good_text_document]",
                                            "data.split=[999, 1]"),
         ("the valid split of corpus", "good_text_document (sequences 200..200 of 200) holds no tokens, and "
          "Megatron's builder would loop forever on it",), trains=True),
    Case("megatron-blend-too-small", T(SMALL, "data.order=megatron",
                                       "data.blend=[{tmp}/good_text_document, {tmp}/good_text_document]",
                                       run="{tmp}/data/run_megatron_small"),
         ("Megatron's train split of this blend holds", "the run reads: prefixes without weights are each taken "
          "once; give data.blend weights (Megatron then repeats corpora), or lower train.steps"), after_start=True),
    # the default run_dir, run-new, must stay absent: the refusal removes what the start made there
    Case("corpus-too-small-for-one-sample", T(SMALL, "data.blend=[{tmp}/data/tiny_text_document]",
                                                  "data.split=[1, 0]", "train.eval_interval=0"),
         ("the train split of corpus", "tiny_text_document (1 documents) has", "fewer than one sample of seq_len + 1",
          "give it more data"), after_start=True),
    Case("megatron-cache-damaged", T(SMALL, *MEGATRON_CACHE, run="{tmp}/data/run_megatron_cache"),
         ("cannot read or write Megatron's sample index cache in", "data/megatron_cache (", "a file there is damaged "
          "(a build that was killed) or not megatron-core's: delete it, it is rebuilt"), after_start=True),
    Case("samples-beyond-the-run", L("samples", "--start", "1599", "--count", "2", "--output", "{tmp}/data/w.npy"),
         ("--start 1599 --count 2 reads up to train sample 1600, but the run reads 1600 train samples",)),
    Case("samples-unknown-split", L("samples", "--split", "vaild", "--start", "0", "--count", "1", "--output",
                                    "{tmp}/data/w.npy"),
         ("--split 'vaild' is not a split a run reads (did you mean 'valid'?): use train or valid",)),
    Case("samples-output-exists", L("samples", "--start", "0", "--count", "1", "--output", "{tmp}/data/a_file"),
         ("data/a_file already exists: choose another --output, or pass --force to replace it",)),
    # --- train-tokenizer ----------------------------------------------------------------------------------
    Case("train-tokenizer-parquet-cut-footer",
         L("train-tokenizer", "--input", "{tmp}/data/cut.parquet", "--output-dir", "{tmp}/data/tok_x"),
         ("data/cut.parquet is not a readable parquet file", "re-fetch it")),
    Case("train-tokenizer-max-sentences-negative",
         L("train-tokenizer", "--input", "{tmp}/docs.jsonl", "--output-dir", "{tmp}/data/tok_x", "--max-sentences",
           "-5"), ("--max-sentences -5 is out of range: pass a count of text chunks from 1",)),
    Case("train-tokenizer-vocab-size-zero",
         L("train-tokenizer", "--input", "{tmp}/docs.jsonl", "--output-dir", "{tmp}/data/tok_x", "--vocab-size", "0"),
         ("--vocab-size 0 is out of range", "pass 265 to 2147483647")),
    # --- plot ---------------------------------------------------------------------------------------------
    Case("plot-metrics-unreadable", L("plot", "{tmp}/data/run_garbled", "-o", "{tmp}/data/plot_x.png"),
         ("run_garbled/metrics.jsonl holds no step metrics (3 unreadable lines skipped", "nothing to plot")),
    Case("plot-no-loss-records", L("plot", "{tmp}/data/run_no_loss", "-o", "{tmp}/data/plot_x.png"),
         ("run_no_loss/metrics.jsonl holds no loss, lr or throughput to plot",)),
    Case("plot-output-is-a-directory", L("plot", "{tmp}/data/run_ok", "-o", "{tmp}/data"),
         ("data: it is a directory; pass a file name with --output",)),
    # --- hostfiles ----------------------------------------------------------------------------------------
    Case("hostfile-utf8-bom", L("preflight", "--hostfile", "{tmp}/data/hosts_bom"),
         ("hosts_bom starts with a UTF-8 byte-order mark, which the deepspeed launcher would keep",
          "save it as plain UTF-8 (ASCII) text without a BOM")),
    Case("hostfile-utf16", L("preflight", "--hostfile", "{tmp}/data/hosts_utf16"),
         ("hosts_utf16 is UTF-16 text",)),
    Case("hostfile-not-utf8", L("preflight", "--hostfile", "{tmp}/data/hosts_latin1"),
         ("hosts_latin1:2: byte 0xe9 is not UTF-8",)),
    Case("hostfile-invisible-character", L("preflight", "--hostfile", "{tmp}/data/hosts_nul"),
         ("hosts_nul:2: the line holds an invisible character U+0000", "delete it")),
]


def _lines(n: int) -> bytes:
    return b"".join(json.dumps({"text": f"document {i}: " + " ".join(f"w{(i * 7919 + k) % 10007}" for k in range(60))})
                    .encode() + b"\n" for i in range(n))


def prepare(ctx) -> None:
    """Write this topic's inputs under ``ctx.tmp / "data"``."""
    import zstandard

    from llmjp_ds.data.preprocess import preprocess

    d = ctx.tmp / "data"
    d.mkdir()
    (d / "tiny.jsonl").write_text(json.dumps({"text": "短い文書。"}) + "\n")  # a few tokens: not one sample
    preprocess([d / "tiny.jsonl"], ctx.tok, d / "tiny", workers=1, progress=False)
    data = _lines(3000)  # ~1.5 MB: a zstd frame of many 128 KiB blocks
    frame = zstandard.ZstdCompressor(level=1).compress(data)
    # the end of the second block, exactly: what a download cut at a block boundary leaves
    fhd = frame[4]  # RFC 8878 frame header: magic, descriptor, window byte unless single-segment, dict id, size
    single = fhd >> 5 & 1
    pos = 5 + (1 - single) + (0, 1, 2, 4)[fhd & 3] + {0: single, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    for _ in range(2):  # 3-byte block headers: bits 1-2 the type (1: RLE, one byte), bits 3-23 the size
        header = int.from_bytes(frame[pos:pos + 3], "little")
        pos += 3 + (1 if header >> 1 & 3 == 1 else header >> 3)
    (d / "cut.jsonl.zst").write_bytes(frame[:pos])
    packed = gzip.compress(data, mtime=0)
    (d / "cut.jsonl.gz").write_bytes(packed[:len(packed) // 2])
    xz = lzma.compress(data[:200_000])
    (d / "cut.jsonl.xz").write_bytes(xz[:-3])
    corrupt = bytearray(packed)
    corrupt[len(corrupt) // 2:len(corrupt) // 2 + 64] = bytes(range(64))
    (d / "corrupt.jsonl.gz").write_bytes(bytes(corrupt))
    (d / "plain.jsonl.zst").write_bytes(data[:1000])
    (d / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "abc \\ud800 def"}\n')
    (d / "null.jsonl").write_text('{"text": null}\n')
    (d / "empty.jsonl").write_bytes(b"")
    (d / "a_file").write_text("not a directory")
    for name, text in (("run_garbled", b'{"step": 1, "lo\xff\xfe\n\x00\x00\x00\n\xc3\x28garbage\n'),
                       ("run_no_loss", b'{"step": 1, "note": "x"}\n{"event": "resume", "step": 1}\n'),
                       ("run_ok", b'{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n')):
        (d / name).mkdir()
        (d / name / "metrics.jsonl").write_bytes(text)
    _columnar(d, data)
    (d / "hosts_bom").write_bytes(b"\xef\xbb\xbfnode-a slots=8\nnode-b slots=8\n")
    (d / "hosts_utf16").write_bytes("node-a slots=8\n".encode("utf-16"))
    (d / "hosts_latin1").write_bytes("node-a slots=8\nnodé-b slots=8\n".encode("latin-1"))
    (d / "hosts_nul").write_bytes(b"node-a slots=8\nnode\x00-b slots=8\n")
    _megatron_cache(ctx)


def good_corpus(tmp: Path, tok: Path) -> Path:
    """The catalogue's good corpus, ``{tmp}/good_text_document``: 200 documents of Japanese and English."""
    from llmjp_ds.data.preprocess import preprocess

    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": f"文書 {i}: the quick brown fox. " * 30}) + "\n"
                                            for i in range(200)))
    preprocess([tmp / "docs.jsonl"], tok, tmp / "good", workers=1, progress=False)
    return tmp / "good_text_document"


def _megatron_cache(ctx) -> None:
    """megatron-core's index cache of the run MEGATRON_CACHE configures, one file cut in half (a killed build)."""
    from llmjp_ds.config import load_config, model_config_of, sample_counts, seq_len_of
    from llmjp_ds.trainer import data_plan

    cfg = load_config(None, [sub(s, ctx) for s in (SMALL, *MEGATRON_CACHE)])
    model_config = model_config_of(cfg)
    data_plan(cfg, model_config).build(seq_len_of(cfg, model_config), *sample_counts(cfg))
    (cut,) = (ctx.tmp / "data" / "megatron_cache").glob("*-GPTDataset-train-shuffle_index.npy")
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])


def _columnar(d, data: bytes) -> None:
    """Parquet files and save_to_disk directories, good and broken."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.data.data_helpers import write_parquet, write_saved_dataset

    records = [json.loads(line) for line in data.splitlines()[:400]]
    (d / "empty_dir").mkdir()
    (d / "shards").mkdir()
    write_parquet(d / "shards" / "a.parquet", records[:200], row_group_size=50)
    write_parquet(d / "shards" / "b.parquet", records[200:], row_group_size=50)
    whole = (d / "shards" / "a.parquet").read_bytes()
    (d / "cut.parquet").write_bytes(whole[:-100])  # a download cut before the footer
    (d / "lines.parquet").write_bytes(data[:1000])
    pq.write_table(pa.table({"text": list(range(20))}), d / "numbers.parquet")
    write_parquet(d / "nulls.parquet", ["a", "b", None, "c"], row_group_size=2)
    for name in ("ds_bad", "ds_cut", "ds_missing"):
        write_saved_dataset(d / name, records, shards=2, batch_rows=50)
    shard = d / "ds_bad" / "data-00001-of-00002.arrow"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3:len(raw) // 3 + 64] = b"\xff" * 64
    shard.write_bytes(bytes(raw))
    shard = d / "ds_cut" / "data-00000-of-00002.arrow"
    shard.write_bytes(shard.read_bytes()[:-8])  # cut at a batch boundary: only the end-of-stream marker is gone
    (d / "ds_missing" / "data-00001-of-00002.arrow").unlink()
    write_saved_dataset(d / "ds_dict" / "train", records[:10], shards=1)
    (d / "ds_dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
