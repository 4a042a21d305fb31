"""Measurements of the data layer quoted in docs/data.md.

    python benchmarks/data_bench.py preprocess --tokenizer MODEL [--repeat 2] [--workers 1 2]
    python benchmarks/data_bench.py formats --tokenizer MODEL [--megabytes 250] [--workers 14] [--work-dir DIR]
    python benchmarks/data_bench.py access --prefix PREFIX [--seq-len 4096] [--samples 20000]
    python benchmarks/data_bench.py index [--tokens 1e9] [--seq-len 4096] [--mean-doc 600]
    python benchmarks/data_bench.py blend [--samples 1e7]
    python benchmarks/data_bench.py megatron [--megabytes 400] [--seq-len 4096] [--epochs 1]
    python benchmarks/data_bench.py corpus-loss --tokenizer DIR [--steps 300]

``formats`` writes the real-text corpus of ``benchmarks/real_text_corpus.py`` (the Python sources on this machine)
as jsonl.gz, as parquet (row groups of ~8 MB of text) and as a ``datasets.save_to_disk``-style Arrow directory,
preprocesses each with the same workers, checks the three corpora are byte-identical and prints one table.

``index`` synthesises a corpus: a real ``.idx`` with random (log-normal) document lengths and a sparse ``.bin``
(``truncate``, no 2 GB written), then times ``build_datasets`` in a fresh process and reports its peak RSS.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MB. Not ru_maxrss: Linux carries that over exec from
    the parent, so a child of a big parent would report the parent's peak."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mb() -> float:
    return _status_mb("VmHWM")


def bench_preprocess(args) -> None:
    from llmjp_ds.data import bundled_corpus_files
    from llmjp_ds.data.preprocess import preprocess

    work = Path(tempfile.mkdtemp(prefix="bench-pre-"))
    try:
        src = work / "corpus.jsonl"
        with open(src, "wb") as out:
            for _ in range(args.repeat):
                for f in bundled_corpus_files():
                    with gzip.open(f, "rb") as g:
                        shutil.copyfileobj(g, out)
        print(f"input: bundled corpus x{args.repeat} = {src.stat().st_size / 1e6:.1f} MB of jsonl, "
              f"tokenizer {args.tokenizer}")
        for workers in args.workers:
            stats = preprocess([src], args.tokenizer, work / f"w{workers}", workers=workers, progress=False)
            print(f"workers={workers}: {stats['documents']} documents, {stats['tokens']} tokens in "
                  f"{stats['seconds']:.2f} s = {stats['tokens_per_second']:,.0f} tokens/s "
                  f"({src.stat().st_size / 1e6 / stats['seconds']:.1f} MB/s of jsonl)")
    finally:
        shutil.rmtree(work)


def _formats_inputs(work: Path, megabytes: float) -> dict[str, Path]:
    """The real-text corpus as jsonl.gz, parquet and a save_to_disk-style Arrow directory (same documents)."""
    import json

    import pyarrow as pa

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from real_text_corpus import write_jsonl, write_parquet_copy

    plain = work / "sources.jsonl"
    docs, size = write_jsonl(plain, int(megabytes * 2**20))
    with open(plain, "rb") as src, gzip.open(work / "sources.jsonl.gz", "wb", compresslevel=6) as out:
        shutil.copyfileobj(src, out, 1 << 20)
    groups = write_parquet_copy(plain, work / "sources.parquet")
    table = pa.parquet.read_table(work / "sources.parquet")
    saved = work / "saved"
    saved.mkdir()
    shards, n = 4, table.num_rows
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):  # datasets' ArrowWriter: IPC stream, batches of 1000 rows
        part = table.slice(n * i // shards, n * (i + 1) // shards - n * i // shards)
        with pa.OSFile(str(saved / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as writer:
            for batch in part.to_batches(max_chunksize=1000):
                writer.write_batch(batch)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": x} for x in names]}))
    (saved / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string",
                                                                               "_type": "Value"}}}))
    plain.unlink()
    print(f"input: {docs:,} documents, {size / 1e6:.1f} MB of text (Python sources on this machine); parquet in "
          f"{groups} row groups, Arrow in {shards} shards", flush=True)
    return {"jsonl.gz": work / "sources.jsonl.gz", "parquet": work / "sources.parquet", "arrow": saved}


def bench_formats(args) -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        print("data_bench formats: pyarrow is not installed; pip install pyarrow (a core dependency of llmjp-ds)")
        sys.exit(2)
    from llmjp_ds.data.preprocess import preprocess

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-formats-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        inputs = _formats_inputs(work, args.megabytes)
        rows, reference = [], None
        for name, src in inputs.items():
            for rep in range(args.repeat):
                stats = preprocess([src], args.tokenizer, work / f"out_{name}", workers=args.workers, force=True,
                                   progress=False)
                data = [open(stats["prefix"] + s, "rb").read() for s in (".bin", ".idx")]
                reference = reference or data
                size = sum(f.stat().st_size for f in ([src] if src.is_file() else src.iterdir()))
                rows.append((name, rep + 1, size / 1e6, stats["documents"], stats["tokens"], stats["seconds"],
                             stats["tokens_per_second"], "yes" if data == reference else "NO"))
        print(f"\npreprocess with --workers {args.workers} ({os.cpu_count()} CPUs), tokenizer {args.tokenizer}")
        print(f"{'format':<9} {'run':>3} {'input MB':>9} {'documents':>10} {'tokens':>12} {'seconds':>8} "
              f"{'tokens/s':>12} {'same bytes':>10}")
        for name, rep, mb, docs, tokens, seconds, rate, same in rows:
            print(f"{name:<9} {rep:>3} {mb:>9.1f} {docs:>10,} {tokens:>12,} {seconds:>8.2f} {rate:>12,.0f} {same:>10}")
    finally:
        if not args.work_dir:
            shutil.rmtree(work)


def bench_access(args) -> None:
    from llmjp_ds.data.dataset import build_datasets

    cache = tempfile.mkdtemp(prefix="bench-acc-")
    try:
        t = time.perf_counter()
        train, _ = build_datasets([args.prefix], args.seq_len, seed=1, train_samples=args.samples, valid_samples=0,
                                  cache_dir=cache)
        build = time.perf_counter() - t
        rng = np.random.default_rng(0)
        idx = rng.integers(0, len(train), size=args.reads)
        for i in idx[:100]:  # warm the page cache a little
            train[int(i)]
        t = time.perf_counter()
        total = 0
        for i in idx:
            total += train[int(i)].size
        secs = time.perf_counter() - t
        print(f"corpus {args.prefix}: seq_len {args.seq_len}, {len(train)} samples (index built in {build:.2f} s)")
        print(f"{args.reads} random reads in {secs:.3f} s = {args.reads / secs:,.0f} samples/s = "
              f"{total / secs / 1e6:,.1f} M tokens/s (one process)")
    finally:
        shutil.rmtree(cache)


def _synth_corpus(directory: Path, tokens: int, mean_doc: float, seed: int = 0, name: str = "synth",
                  dense: bool = False) -> tuple[str, int]:
    """A valid .idx with log-normal document lengths summing to ``tokens``, and a sparse uint16 .bin (``dense``: an
    int32 .bin of random ids below 99,574, LLM-jp v3's vocabulary, written out)."""
    from llmjp_ds.data.indexed import CODE_OF_DTYPE, INDEX_MAGIC

    rng = np.random.default_rng(seed)
    sigma = 1.0
    n = int(tokens / mean_doc * 1.1) + 16
    lengths = np.maximum(rng.lognormal(np.log(mean_doc) - sigma ** 2 / 2, sigma, size=n).astype(np.int64), 2)
    cum = np.cumsum(lengths)
    n = int(np.searchsorted(cum, tokens)) + 1
    lengths = lengths[:n]
    lengths[-1] -= int(cum[n - 1] - tokens)
    assert lengths.sum() == tokens and lengths[-1] > 0
    prefix = str(directory / f"{name}_text_document")
    dtype = np.dtype(np.int32 if dense else np.uint16)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]) * dtype.itemsize
    import struct

    with open(prefix + ".idx", "wb") as f:
        f.write(INDEX_MAGIC + struct.pack("<QBQQ", 1, CODE_OF_DTYPE[dtype], n, n + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        if not dense:
            f.truncate(tokens * dtype.itemsize)
        for start in range(0, tokens if dense else 0, 1 << 24):
            f.write(rng.integers(0, 99574, size=min(1 << 24, tokens - start), dtype=np.int32).tobytes())
    return prefix, n


def bench_index(args) -> None:
    tokens = int(float(args.tokens))
    work = Path(tempfile.mkdtemp(prefix="bench-idx-"))
    try:
        t = time.perf_counter()
        prefix, docs = _synth_corpus(work, tokens, args.mean_doc)
        print(f"synthetic corpus: {tokens:,} tokens in {docs:,} documents (mean {tokens / docs:.0f}), "
              f".idx {os.path.getsize(prefix + '.idx') / 1e6:.1f} MB, sparse .bin "
              f"{os.path.getsize(prefix + '.bin') / 1e9:.1f} GB (made in {time.perf_counter() - t:.1f} s)")
        per_epoch = (int(tokens * 0.99) - 1) // args.seq_len
        for label, samples in (("1 epoch", per_epoch), ("3 epochs", 3 * per_epoch)):
            cmd = [sys.executable, __file__, "_build", prefix, str(args.seq_len), str(samples), str(work / label)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
            print(f"build_datasets seq_len={args.seq_len}, train_samples={samples:,} ({label}), "
                  f"valid_samples=1000: {out}")
    finally:
        shutil.rmtree(work)


def _child_build(prefix: str, seq_len: str, samples: str, cache: str) -> None:
    import llmjp_ds.data.dataset as dataset  # imports first, so the baseline RSS includes numpy

    base = _status_mb("VmRSS")
    t = time.perf_counter()
    train, valid = dataset.build_datasets([prefix], int(seq_len), seed=1, train_samples=int(samples),
                                          valid_samples=1000, cache_dir=cache)
    build = time.perf_counter() - t
    peak = _rss_mb()
    t = time.perf_counter()
    dataset.build_datasets([prefix], int(seq_len), seed=1, train_samples=int(samples), valid_samples=1000,
                           cache_dir=cache)
    cached = time.perf_counter() - t
    size = sum(f.stat().st_size for f in Path(cache).rglob("*.npy"))
    print(f"built in {build:.2f} s, peak RSS {peak:.0f} MB (baseline after imports {base:.0f} MB, so "
          f"+{peak - base:.0f} MB), cache {size / 1e6:.1f} MB on disk, reopened from the cache in {cached:.3f} s")


def bench_megatron(args) -> None:
    """``data.order: megatron`` against megatron-core's builder called directly, on a weighted blend of three
    synthetic corpora (int32, written out): each build in a fresh process with its own empty cache directory."""
    total = int(args.megabytes * 1e6 / 4)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-megatron-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        blend = []
        for i, (name, share) in enumerate((("ja", 0.5), ("en", 0.35), ("code", 0.15))):
            prefix, docs = _synth_corpus(work, int(total * share), args.mean_doc, seed=i, name=name,
                                         dense=not args.sparse)
            blend += [str(share), prefix]
        gb = sum(os.path.getsize(p + ".bin") for p in blend[1::2]) / 1e9
        print(f"3 corpora, {total:,} tokens, {gb:.2f} GB of {'sparse ' if args.sparse else ''}.bin (made in "
              f"{time.perf_counter() - t:.1f} s)")
        train = int(total * 0.98 / args.seq_len * args.epochs)
        for run, who in enumerate(args.order):
            cmd = [sys.executable, __file__, "_megatron", who, str(args.seq_len), str(train),
                   str(work / f"cache-{run}-{who}"), "sparse" if args.sparse else "dense", *blend]
            print(f"{who}: {subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()}")
    finally:
        if not args.work_dir:
            shutil.rmtree(work)


def _cold_scan(prefixes) -> tuple[float, float, int]:
    """(seconds, GB, largest id) of IndexedDataset.max_token_id over the corpora, their .bin pages evicted first."""
    from llmjp_ds.data.indexed import IndexedDataset

    for p in prefixes:
        fd = os.open(p + ".bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    t = time.perf_counter()
    top = max(IndexedDataset(p).max_token_id() for p in prefixes)
    return time.perf_counter() - t, sum(os.path.getsize(p + ".bin") for p in prefixes) / 1e9, top


def _child_megatron(who: str, seq_len: str, train: str, cache: str, bins: str, *blend: str) -> None:
    import warnings

    import torch.distributed as dist

    sizes = [int(train), int(train) // 100, int(train) // 1000]
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import blended_megatron_dataset_builder as builder, gpt_dataset, utils
    imported = time.perf_counter() - t
    if who == "megatron-core":
        class Tok:
            eod, pad, vocab_size, unique_identifiers = 2, -1, 99574, {"class": "bench"}

        t = time.perf_counter()
        config = gpt_dataset.GPTDatasetConfig(
            random_seed=1234, sequence_length=int(seq_len), blend=utils.get_blend_from_list(list(blend)),
            split="98,1,1", path_to_cache=cache, tokenizer=Tok(), reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        builder.BlendedMegatronDatasetBuilder(gpt_dataset.GPTDataset, sizes, lambda: True, config).build()
        print(f"BlendedMegatronDatasetBuilder.build {time.perf_counter() - t:.2f} s (import of megatron.core "
              f"{imported:.1f} s)")
        return
    from llmjp_ds.data.plan import resolve_data

    scan = ""
    if bins == "dense":
        secs, gb, top = _cold_scan(blend[1::2])
        scan = f"; the largest-id scan alone, pages evicted first: {secs:.2f} s for {gb:.2f} GB = {secs / gb:.2f} s/GB"
    resolved = []
    for _ in range(2):  # the second with every corpus's largest id cached, as every later run of these corpora
        t = time.perf_counter()
        plan = resolve_data(list(blend), None, 99584, [98, 1, 1], 1234, cache, "megatron", sizes[2])
        resolved.append(time.perf_counter() - t)
    t = time.perf_counter()
    plan.build(int(seq_len), sizes[0], sizes[1])
    print(f"DataPlan.build {time.perf_counter() - t:.2f} s, resolve_data before it {resolved[0]:.2f} s "
          f"({resolved[1]:.2f} s with the largest ids cached; import of megatron.core {imported:.1f} s{scan})")


def bench_blend(args) -> None:
    from llmjp_ds.data.dataset import blend_assignment

    weights = [609, 182, 83, 63, 5.5, 3.9, 4.7, 763, 237, 2.7, 2.6, 1.8, 114.0, 0.8, 0.3]  # LLM-jp exp2, B tokens
    n = int(float(args.samples))
    base = _status_mb("VmRSS")
    t = time.perf_counter()
    corpus, index = blend_assignment(weights, n)
    secs = time.perf_counter() - t
    print(f"blend of {len(weights)} corpora (LLM-jp exp2 token weights), {n:,} samples: {secs:.2f} s, "
          f"peak RSS +{_rss_mb() - base:.0f} MB, index {(corpus.nbytes + index.nbytes) / 1e6:.0f} MB")


def bench_corpus_loss(args) -> None:
    """Is the bundled corpus learnable? A ~4M-parameter transformers Llama, AdamW, a few hundred CPU steps."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmjp_ds.data import bundled_corpus_files
    from llmjp_ds.data.dataset import build_datasets, parse_blend
    from llmjp_ds.data.preprocess import preprocess
    from llmjp_ds.data.tokenizer import load_tokenizer

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.tokenizer)
    work = Path(tempfile.mkdtemp(prefix="bench-loss-"))
    try:
        prefixes = []
        for f in bundled_corpus_files():
            name = f.name.split(".")[0]
            prefixes.append(preprocess([f], args.tokenizer, work / name, progress=False)["prefix"])
        blend = parse_blend(prefixes)  # weights = token counts
        train, valid = build_datasets(blend, args.seq_len, seed=1, train_samples=args.steps * args.batch,
                                      valid_samples=64, cache_dir=work / "cache")
        config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=160, intermediate_size=432, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.seq_len,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))

        def batch(ds, start):
            x = torch.from_numpy(np.stack([ds[start + i] for i in range(args.batch)]))
            return x[:, :-1], x[:, 1:]

        def valid_loss():
            model.eval()
            with torch.no_grad():
                losses = [model(input_ids=x, labels=None).logits.flatten(0, 1).float().log_softmax(-1)
                          .gather(1, y.reshape(-1, 1)).neg().mean().item()
                          for x, y in (batch(valid, s) for s in range(0, 64, args.batch))]
            model.train()
            return sum(losses) / len(losses)

        print(f"model: {params / 1e6:.2f} M parameters, vocab {tok.vocab_size}, seq {args.seq_len}, "
              f"batch {args.batch}, corpora {[(round(w), Path(p).name) for w, p in blend]}")
        print(f"step 0: valid loss {valid_loss():.3f} (ln vocab = {np.log(tok.vocab_size):.3f})")
        t = time.perf_counter()
        for step in range(1, args.steps + 1):
            x, y = batch(train, (step - 1) * args.batch)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % max(1, args.steps // 6) == 0 or step == args.steps:
                print(f"step {step}: train loss {loss.item():.3f}, valid loss {valid_loss():.3f} "
                      f"({time.perf_counter() - t:.0f} s)")
        model.eval()
        for prompt in ["今日は", "The weather", "def "]:
            ids = torch.tensor([[tok.bos_id, *tok.encode(prompt)]])
            out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_id)
            print(f"greedy from {prompt!r}: {tok.decode(out[0, 1:].tolist())!r}")
    finally:
        shutil.rmtree(work)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        _child_build(*sys.argv[2:6])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_megatron":
        _child_megatron(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("preprocess")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p = sub.add_parser("formats")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--megabytes", type=float, default=250.0)
    p.add_argument("--workers", type=int, default=max(1, min(14, os.cpu_count() or 1)))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--work-dir", default=None, help="keep the inputs and outputs here (default: a temp dir)")
    p = sub.add_parser("access")
    p.add_argument("--prefix", required=True)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--reads", type=int, default=20000)
    p = sub.add_parser("index")
    p.add_argument("--tokens", default="1e9")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--mean-doc", type=float, default=600)
    p = sub.add_parser("megatron")
    p.add_argument("--megabytes", type=float, default=400.0, help="of int32 .bin in all")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--mean-doc", type=float, default=600)
    p.add_argument("--epochs", type=float, default=1.0, help="train samples, in epochs of the blend")
    p.add_argument("--order", nargs="+", default=["megatron-core", "llmjp-ds", "megatron-core", "llmjp-ds"])
    p.add_argument("--sparse", action="store_true", help="sparse .bin files (no largest-id scan): index scaling")
    p.add_argument("--work-dir", default=None)
    p = sub.add_parser("blend")
    p.add_argument("--samples", default="1e7")
    p = sub.add_parser("corpus-loss")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    {"preprocess": bench_preprocess, "formats": bench_formats, "access": bench_access, "index": bench_index,
     "blend": bench_blend, "corpus-loss": bench_corpus_loss, "megatron": bench_megatron}[args.what](args)


if __name__ == "__main__":
    main()
