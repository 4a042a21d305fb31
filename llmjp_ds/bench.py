"""``llmjp-ds bench``: training throughput of the product's full step against transformers + DeepSpeed.

Every variant runs in its own process (a clean GPU) through the same DeepSpeed configuration: ZeRO-1, BF16
with FP32 gradient accumulation, fused AdamW, gradient accumulation 8 (as real pretraining uses), micro-batches
of random token ids already on the GPU. One step = ``gas`` forward/backward passes + the optimizer step.

Variants: ``ours-bf16``, ``ours-fp8-delayed`` (DelayedScaling, HYBRID), ``ours-fp8-current``
(Float8CurrentScaling), ``ours-fp8-block`` (Float8BlockScaling), ``peer-bf16`` (transformers'
``LlamaForCausalLM``, sdpa attention).
TFLOP/s are model FLOPs (:func:`llmjp_ds.model.flops.model_flops_per_token`: Megatron-LM's formula with GQA,
SwiGLU, the logits layer and the causal attention term halved; no recompute counted) per GPU; MFU is against
989 TFLOP/s (H100/H200 dense BF16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    # name: (model preset, overrides, micro batch)
    "172b-slice": ("llmjp3-172b", {"num_layers": 2}, 1),
    "llmjp3-1.8b": ("llmjp3-1.8b", {}, 2),
    "llmjp3-3.7b": ("llmjp3-3.7b", {}, 1),
}
VARIANTS = ("ours-bf16", "peer-bf16", "ours-fp8-delayed", "ours-fp8-current", "ours-fp8-block")
PEAK_TFLOPS = 989.0


def ds_config(micro: int, gas: int) -> dict:
    return {"train_batch_size": micro * gas, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
            "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def run_one(shape: str, variant: str, steps: int, warmup: int, gas: int) -> dict:
    import torch

    from llmjp_ds.engine import init_distributed
    from llmjp_ds.metrics import Throughput
    from llmjp_ds.model.flops import flops_per_token_for
    from llmjp_ds.model.presets import model_config

    preset, overrides, micro = SHAPES[shape]
    config = model_config(preset, **overrides)
    seq = config.max_position_embeddings
    init_distributed()
    import deepspeed

    torch.manual_seed(0)
    if variant.startswith("peer"):
        import transformers

        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config).cuda()
    else:
        from llmjp_ds.model import LlamaForCausalLM

        model = LlamaForCausalLM(config, backend="te")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(micro, gas))
    ids = torch.randint(0, config.vocab_size, (gas, micro, seq + 1), device="cuda")
    context = _precision_context(variant)

    def step():
        for m in range(gas):
            with context():
                if variant.startswith("peer"):
                    out = engine(input_ids=ids[m, :, :-1], labels=ids[m, :, :-1])
                else:
                    out = engine(input_ids=ids[m, :, :-1], shift_labels=ids[m, :, 1:])
            engine.backward(out.loss)
            engine.step()

    times = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    rates = Throughput(flops_per_token_for(config, seq), gas * micro * seq, peak_flops=PEAK_TFLOPS * 1e12)
    return {"shape": shape, "variant": variant, "micro_batch": micro, "gas": gas, "seq_len": seq,
            "step_s": step_s, **rates.update(step_s), "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "steps": steps, "device": torch.cuda.get_device_name()}


def _precision_context(variant: str):
    import contextlib

    if "fp8" not in variant:
        return contextlib.nullcontext
    import transformer_engine.pytorch as te

    from llmjp_ds.precision import Phase, te_recipe

    recipe = te_recipe(Phase(0, "fp8", 0, recipe=variant.rsplit("-", 1)[1], fp8_format="hybrid"))
    return lambda: te.autocast(enabled=True, recipe=recipe)


def table(results: list[dict]) -> str:
    head = "| shape | variant | tokens/s | TFLOP/s per GPU | MFU | peak mem GiB | vs peer | vs ours-bf16 |"
    lines = [head, "|" + "---|" * 8]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['variant']} | failed: {r['error']} | | | | | |")
            continue
        same = {x["variant"]: x for x in results if x["shape"] == r["shape"] and "error" not in x}
        peer = same.get("peer-bf16")
        base = same.get("ours-bf16")
        vs_peer = f"{r['tflops_per_gpu'] / peer['tflops_per_gpu']:.2f}x" if peer and r is not peer else ""
        vs_base = (f"{r['tflops_per_gpu'] / base['tflops_per_gpu']:.2f}x"
                   if base and r is not base and r["variant"].startswith("ours") else "")
        lines.append(f"| {r['shape']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.0f} | "
                     f"{100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {vs_peer} | {vs_base} |")
    return "\n".join(lines)


def cli_main(argv: list[str], verb: str = "bench") -> int:
    from llmjp_ds.errors import fail

    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="172b-slice,llmjp3-1.8b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gas", type=int, default=8, help="gradient accumulation steps")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--one", nargs=2, metavar=("SHAPE", "VARIANT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(run_one(*a.one, a.steps, a.warmup, a.gas)), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        fail("llmjp-ds bench measures GPU training throughput: run it on a CUDA machine with Transformer Engine")
    shapes, variants = a.shapes.split(","), a.variants.split(",")
    for s in shapes:
        if s not in SHAPES:
            fail(f"unknown shape {s!r}: choose from {', '.join(SHAPES)}")
    for v in variants:
        if v not in VARIANTS:
            fail(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
    results = []
    for shape in shapes:
        for variant in variants:
            cmd = [sys.executable, "-m", "llmjp_ds.bench", "--one", shape, variant, "--steps", str(a.steps),
                   "--warmup", str(a.warmup), "--gas", str(a.gas)]
            env = dict(os.environ, MASTER_PORT=str(29500 + len(results)))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not found:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
                results.append({"shape": shape, "variant": variant, "error": tail})
            else:
                results.append(json.loads(found[0]))
            print(json.dumps(results[-1]), flush=True)
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    from llmjp_ds.errors import run_main

    run_main(lambda argv: cli_main(argv))
