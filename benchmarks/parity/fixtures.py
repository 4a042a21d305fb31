"""Tiny Megatron-LM checkpoints for the import tests, written by Megatron-LM itself on a GPU:
``python -m benchmarks.parity.fixtures --megatron-lm DIR --out DIR``.

``pretrain_gpt.py`` trains a 2-layer model (hidden 64, 4 heads in 2 query groups, vocabulary 256, sequence 64) for
3 iterations on its mock data, with Megatron-Core's TE layer spec and the distributed optimizer, and saves it in
each format Megatron-LM writes: ``torch_dist`` and the legacy ``torch`` (``mp_rank_00`` + ``distrib_optim.pt``),
each in BF16 and in FP8 (delayed scaling: TE's extra state then holds scales and amax histories). The checkpoints
are a few hundred KB each; each directory gets the ``fixture.json`` tests/train/test_import_megatron.py reads, and
tests/fixtures/megatron/ keeps them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.parity.spec import megatron_env

TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
        "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--bf16", "--use-distributed-optimizer", "--transformer-impl", "transformer_engine",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "255", "--seed", "7", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--save-interval", "3"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
       "--fp8-amax-compute-algo", "max"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    procs = []
    for fmt in ("torch_dist", "torch"):
        for precision, extra in (("bf16", []), ("fp8", FP8)):
            name = f"te-{fmt.replace('_', '-')}-{precision}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   str(a.megatron_lm / "pretrain_gpt.py"), *TINY, *extra, "--ckpt-format", fmt,
                   "--save", str(a.out / name)]
            a.out.mkdir(parents=True, exist_ok=True)
            procs.append((name, fmt, subprocess.Popen(cmd, stdout=open(a.out / f"{name}.log", "w"),
                                                 stderr=subprocess.STDOUT, env=megatron_env())))
    for name, fmt, proc in procs:
        code = proc.wait()
        print(f"{name}: exit {code}", flush=True)
        if code == 0:
            describe(a.out / name, fmt)


def describe(directory: Path, fmt: str) -> None:
    """``fixture.json``: what the arguments above made (the padded vocabulary as Megatron-LM's log says)."""
    arg = lambda name: TINY[TINY.index(name) + 1]  # noqa: E731
    padded = re.search(r"new size: (\d+)", (directory.parent / f"{directory.name}.log").read_text())
    info = {"format": fmt, "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "virtual_pipeline": None,
            "optimizer": "distributed", "iteration": int(arg("--train-iters")),
            "global_batch_size": int(arg("--global-batch-size")), "seq_length": int(arg("--seq-length")),
            "vocab_size": int(padded.group(1)) if padded else None, "hidden_size": int(arg("--hidden-size")),
            "num_layers": int(arg("--num-layers")), "num_attention_heads": int(arg("--num-attention-heads")),
            "num_query_groups": int(arg("--num-query-groups")), "ffn_hidden_size": int(arg("--ffn-hidden-size")),
            "schedule": {"lr": float(arg("--lr")), "min_lr": float(arg("--min-lr")),
                         "warmup_iters": int(arg("--lr-warmup-iters")), "decay_iters": int(arg("--train-iters")),
                         "weight_decay": float(arg("--weight-decay"))},
            "made_by": "Megatron-LM core_v0.19 pretrain_gpt.py, megatron-core 0.19.2 + Transformer Engine 2.20 on an "
                       "H200 (benchmarks/parity/fixtures.py)"}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "save").mkdir(exist_ok=True)
    for item in directory.iterdir():  # Megatron-LM's --save directory becomes the fixture's save/
        if item.name not in ("save", "fixture.json"):
            item.rename(directory / "save" / item.name)
    (directory / "fixture.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
