"""``llmjp-ds <verb>``: each verb lives in the module that owns it and is imported only when used."""

from __future__ import annotations

import importlib
import sys

from llmjp_ds.errors import did_you_mean, run_main

# verb -> (module with ``cli_main(argv)``, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("llmjp_ds.demo", "train the tiny model (--moe: tiny-moe) on the bundled corpus end to end and export it"),
    "train": ("llmjp_ds.train", "pretrain (or resume) a run; same as `deepspeed llmjp_ds/train.py`"),
    "train-tokenizer": ("llmjp_ds.data.tokenizer", "train a SentencePiece unigram tokenizer in LLM-jp v3 layout"),
    "preprocess": ("llmjp_ds.data.preprocess", "jsonl, parquet or Arrow datasets -> Megatron-LM .bin/.idx corpus"),
    "samples": ("llmjp_ds.samples", "write the token windows a run would read (global samples K..K+N-1) to .npy"),
    "export": ("llmjp_ds.interchange.hf", "export a training checkpoint as a Hugging Face Llama model"),
    "import-hf": ("llmjp_ds.interchange.hf", "start a run from a Hugging Face Llama checkpoint"),
    "branch": ("llmjp_ds.checkpoint.branch", "start a new run from a checkpoint of another with its own schedule "
               "(a decay branch), blend or batch; the source run is left as it is"),
    "from-megatron": ("llmjp_ds.interchange.from_megatron", "write the run config of LLM-jp's Megatron-LM "
                      "scripts (params.sh, train_data.sh), read without running them"),
    "import-megatron": ("llmjp_ds.interchange.megatron", "continue a Megatron-LM run (weights, optimizer, LR schedule, "
                        "data position) as a new run"),
    "preflight": ("llmjp_ds.preflight", "check a DeepSpeed hostfile and a run config for it, starting nothing"),
    "plot": ("llmjp_ds.metrics.plot", "draw loss and throughput of a run to PNG (an MoE run's expert load too)"),
    "health": ("llmjp_ds.health.report", "a run's spikes, skips, rollbacks, FP8 fallbacks and phases as a table "
               "(--plot: marked on the loss curve)"),
    "bench": ("llmjp_ds.bench.run", "training TFLOP/s, ours (BF16, FP8) beside Megatron-Core and transformers + "
              "DeepSpeed"),
}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: llmjp-ds <verb> [options]   (add --debug for tracebacks)", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {help_}" for verb, (_, help_) in VERBS.items()]
    return "\n".join(lines)


def dispatch(argv: list[str] | None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"error: unknown verb `{verb}`{did_you_mean(verb, VERBS)}; run `llmjp-ds --help` for the list",
              file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    return module.cli_main(rest, verb=verb) or 0


def main() -> None:
    run_main(dispatch)


if __name__ == "__main__":
    main()
