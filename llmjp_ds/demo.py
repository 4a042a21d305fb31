"""``llmjp-ds demo``: the whole pipeline on the bundled corpus, on CPU, in a few minutes.

Trains a SentencePiece tokenizer on the bundled Japanese / English / code corpus, preprocesses the corpus to
Megatron ``.bin/.idx``, trains the ``tiny`` model through DeepSpeed, exports it as a plain Hugging Face Llama,
loads the export with ``AutoModelForCausalLM`` + ``AutoTokenizer`` and prints continuations. ``--moe``: the same
with the ``tiny-moe`` shape (Qwen3-MoE, LLM-jp-4's MoE design: 8 experts, 2 a token), exported as ``qwen3_moe``;
its records carry the routers' load (``llmjp-ds plot`` draws it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmjp_ds.config import add_config_args, load_config
from llmjp_ds.metrics.record import trail
from llmjp_ds.train import shutdown, train

PROMPTS = ["日本の首都は", "今日は天気が", "The history of", "def fibonacci(n):"]


def generate_samples(hf_dir: Path, prompts=PROMPTS, max_new_tokens: int = 32) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    torch.manual_seed(0)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.pad_token_id or 0)
        out.append(tokenizer.decode(gen[0], skip_special_tokens=True))
    return out


def cli_main(argv: list[str], verb: str = "demo") -> int:
    from llmjp_ds.interchange.hf import export

    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.splitlines()[0])
    p.add_argument("--output", help="directory for the run and the exported model (default demo_out, with --moe "
                                    "demo_moe_out)")
    p.add_argument("--moe", action="store_true", help="train the tiny-moe shape (8 experts, 2 a token) instead, "
                                                      "exported as a Hugging Face qwen3_moe model")
    add_config_args(p, config=None, preset=False, example="train.steps=50 (over the demo preset)")
    a = p.parse_args(argv)
    out = Path(a.output or ("demo_moe_out" if a.moe else "demo_out"))
    shape = ["model.shape=tiny-moe"] if a.moe else []
    cfg = load_config(None, [f"run_dir={out / 'run'}", "logging.wandb=offline", *shape, *a.sets], preset="demo")
    print(f"[demo] training the {cfg.model.shape} model ({cfg.train.steps} steps) in {cfg.run_dir}; the first run "
          "also trains the tokenizer and preprocesses the bundled corpus", flush=True)
    try:
        summary = train(cfg)
    finally:
        shutdown()
    losses = [r["loss"] for r in trail(cfg.run_dir)]
    result = export(cfg.run_dir, out / "hf", dtype="fp32", force=True)
    print(f"[demo] loss {losses[0]:.3f} -> {losses[-1]:.3f} over {summary['step']} steps; "
          f"exported to {result['output']} (reload check max |dlogit| {result['max_logit_diff']:.1e})")
    print("[demo] generating with AutoModelForCausalLM + AutoTokenizer:")
    for text in generate_samples(out / "hf"):
        print("  " + text.replace("\n", " ⏎ "))
    print(f"[demo] plot the run with: llmjp-ds plot {cfg.run_dir}")
    return 0
