"""``llmjp-ds bench``: training throughput of the product's full step against Megatron-Core and transformers.

Every variant runs in its own process (a clean GPU). The ``ours`` variants drive the trainer's own step: a
:class:`llmjp_ds.trainer.StepEngine` of the shape's run preset builds the model and the engine (the bundled
``ds_configs/zero1.json``: ZeRO-1, BF16 with FP32 gradient accumulation, the LLM-jp AdamW groups) and runs
``StepEngine.train_step`` (the LR, the precision schedule, the step runner) over gradient accumulation 8 (as real
pretraining uses), on micro-batches of random token ids already on the GPU. One step = ``gas`` forward/backward
passes + the optimizer step.

Variants: ``ours-bf16``, ``ours-fp8-delayed`` (DelayedScaling, HYBRID), ``ours-fp8-current``
(Float8CurrentScaling), ``ours-fp8-block`` (Float8BlockScaling); the peers of :mod:`llmjp_ds.bench.peers`:
``peer-mcore-bf16``, ``peer-mcore-fp8-delayed``, ``peer-mcore-fp8-param`` (Megatron-Core at its best settings),
``peer-bf16`` (transformers + DeepSpeed, as an HF user would write it), and at a decoder-only shape
(``172b-tp4-stage``: one GPU's share of a 172B TP4 x PP16 middle stage) ``ref-te-layer-*`` (plain
``te.TransformerLayer`` forward + backward). "vs peer" names the best peer of the row's precision at its shape
(BF16: ``peer-mcore-bf16`` or ``ref-te-layer-bf16``; FP8 delayed: the better of ``peer-mcore-fp8-delayed`` and
``-fp8-param``, or ``ref-te-layer-fp8-delayed``). ``--shape-variants SHAPE=VARIANT,...`` gives one shape its own
variants in the same call (``llmjp4-8b-slice`` in BF16 alone: LLM-jp-4 trains in BF16). The table's last column
is each variant's loss before its first update: every whole-model variant starts from a random init on the same
token ids, so all of them show about ln(vocab), the check that a peer computes the loss ours does. ``--set``
changes the run config of the ``ours`` variants (ablations: e.g. ``--set model.fused_loss=false``). With ``--set
parallel.tensor_parallel=N`` each ``ours`` variant runs as N processes on N GPUs (torchrun), one tensor-parallel
group: its TFLOP/s per GPU against one GPU running 1/N of the work is the TP efficiency (e.g. ``--set
"model.overrides={num_layers: 4}"`` at TP2 against the default 2-layer ``172b-slice`` at TP1).
TFLOP/s are model FLOPs (:func:`llmjp_ds.model.flops.model_flops_per_token`: Megatron-LM's formula with GQA,
SwiGLU, the logits layer and the causal attention term halved; no recompute counted) per GPU; MFU is against
the device's dense BF16 peak (:data:`llmjp_ds.metrics.logger.PEAK_TFLOPS`). ``--profile`` adds profiled steps per
variant: GPU time by kernel category (GEMM share) and the top kernels, then the host's time by Python function
(cProfile), which says where a step whose GPU idles (launch-bound) spends its time, and one step under CUDA's
sync debug mode: where the host waited for the GPU. The last column is the GPU's mean SM clock over the timed
steps and the share of them it spent at its power cap (``nvidia-smi``, every 100 ms): an H200 at its 700 W cap
runs well below its maximum clock, so rows of one call can differ in clock as well as in work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

import torch

from llmjp_ds.bench import peers
from llmjp_ds.bench.peers import MCORE_SWITCHES, MCORE_VARIANTS, TE_LAYER_VARIANTS
from llmjp_ds.bench.profile import clock_log, host_profiled_step, profile_table, profiled_step, synced_step, timed
from llmjp_ds.config import (add_config_args, apply_set, build_config, merge, model_config_of, parse_value, preset_dict,
                             sequence_parallel_of)
from llmjp_ds.errors import did_you_mean, fail
from llmjp_ds.health.monitor import HealthMonitor
from llmjp_ds.io_utils import write_bytes_atomic
from llmjp_ds.optim.lr_schedule import run_schedule
from llmjp_ds.metrics.logger import Throughput
from llmjp_ds.model.backend import resolve_backend
from llmjp_ds.model.flops import flops_per_token_for, layer_and_logits_flops_for
from llmjp_ds.parallel.context import ParallelContext
from llmjp_ds.validate import validate_run

SHAPES = {
    # name: (run preset, model overrides, micro batch)
    "172b-slice": ("llmjp3-172b", {"num_layers": 2}, 1),
    # one GPU's share of a middle stage of LLM-jp-3 172B at TP4 x PP16: 6 layers, 96 / 4 heads, 16 / 4 KV heads,
    # FFN 38464 / 4; decoder layers only (STAGE_SHAPES)
    "172b-tp4-stage": ("llmjp3-172b", {"num_layers": 6, "num_attention_heads": 24, "num_key_value_heads": 4,
                                       "ffn_hidden_size": 9616, "head_dim": 128}, 1),
    "llmjp3-1.8b": ("llmjp3-1.8b", {}, 2),
    "llmjp3-3.7b": ("llmjp3-3.7b", {}, 1),
    # 4 of the LLM-jp-4 8B's 32 layers with its whole 196,608-row embedding and head. The head is a tenth of the 8B's
    # FLOPs (4.8 of 49.9 GFLOP a token) and 46 % of this shape's: the row measures the head and loss at that
    # vocabulary as much as the layers, and 2.48B parameters fit one H200 where the whole 8B's optimizer state
    # (8.6B x 18 bytes) does not. Micro-batch 1, as the v4 recipe trains: ~47 GiB estimated for ours and Megatron-Core
    # (41.6 GiB of bf16 weights, fp32 grads, master weights and moments; 2 GiB of layer activations; 1.5 GiB of
    # bf16 logits, whose gradient both write in place). The llmjp4-8b recipe has no z-loss, as Megatron-Core's.
    "llmjp4-8b-slice": ("llmjp4-8b", {"num_layers": 4}, 1),
    # 4 of llm-jp-4-32b-a3b's 32 MoE layers (128 experts, 8 a token, qk-norm) with its whole 196,608-row head:
    # 4.9B parameters of which 1.4B active a token, ~90 GiB of weights, fp32 grads, master weights and moments
    "llmjp4-moe-slice": ("llmjp4-32b-a3b", {"num_layers": 4}, 1),
}
TEST_SHAPES = {"tiny": ("demo", {}, 2), "tiny-stage": ("demo", {"head_dim": 16}, 2)}  # CPU tests (test_bench.py)
STAGE_SHAPES = {"172b-tp4-stage", "tiny-stage"}  # no embedding, no head: FLOPs of the decoder layers only
VARIANTS = ("ours-bf16", "peer-mcore-bf16", "peer-bf16", "ours-fp8-delayed", "peer-mcore-fp8-delayed",
            "peer-mcore-fp8-param", "ours-fp8-current", "ours-fp8-block", *TE_LAYER_VARIANTS)
DEFAULT_VARIANTS = ("ours-bf16", "peer-mcore-bf16", "peer-bf16", "ours-fp8-delayed", "peer-mcore-fp8-delayed",
                    "peer-mcore-fp8-param")
STAGE_VARIANTS = ("ours-bf16", "ours-fp8-delayed", "ours-fp8-current", *TE_LAYER_VARIANTS)
# per precision, the peers "vs peer" compares a row with (the fastest of them present)
PEERS = {"bf16": ("peer-mcore-bf16", "ref-te-layer-bf16"),
         "fp8-delayed": ("peer-mcore-fp8-delayed", "peer-mcore-fp8-param", "ref-te-layer-fp8-delayed"),
         "fp8-current": ("ref-te-layer-fp8-current",)}


def bench_config(shape: str, variant: str, gas: int, sets: list[str] = ()):
    """The run config of one variant: the shape's preset on one device, no pipeline, no recompute."""
    preset, overrides, micro = {**SHAPES, **TEST_SHAPES}[shape]
    if variant.startswith("ours-fp8"):  # the peers set their precision themselves
        phases = [{"precision": "fp8", "start_step": 1, "recipe": variant.rsplit("-", 1)[1], "fp8_format": "hybrid"}]
    else:
        phases = [{"precision": "bf16"}]
    data = merge(preset_dict(preset), {
        "data": {"order": "llmjp"},  # the bench reads no corpus: no megatron-core needed for the llmjp presets
        "model": {"overrides": overrides, "recompute": "none"},
        "train": {"micro_batch_size": micro, "global_batch_size": micro * gas, "steps": 1 << 20},
        "parallel": {"zero_stage": 1, "pipeline_stages": 1, "tensor_parallel": 1},
        "precision": {"dtype": "bf16", "phases": phases},
        "logging": {"wandb": "disabled"}})
    for assignment in sets if variant.startswith("ours") else ():
        data = apply_set(data, assignment)
    return build_config(data)


def peer_switches(sets) -> dict:
    """``[KEY=VALUE, ...]`` of ``--peer-set`` as a dict (values read as YAML), each key one of
    :data:`~llmjp_ds.bench.peers.MCORE_SWITCHES`."""
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or key not in MCORE_SWITCHES:
            fail(f"--peer-set takes KEY=VALUE with KEY one of {', '.join(MCORE_SWITCHES)}, got {item!r}"
                 f"{did_you_mean(key, MCORE_SWITCHES)}")
        out[key] = parse_value(value)
    return out


def _engine_for(cfg, variant: str, shape: str, peer_sets=()):
    """(the step function ``step(i, batches) -> [lm_loss, z_loss, ...]``, the model config) of one variant: ours
    through the trainer's :class:`~llmjp_ds.trainer.StepEngine` (at a decoder-only shape on
    :func:`~llmjp_ds.bench.peers.stage_model`), a peer from :mod:`llmjp_ds.bench.peers`."""
    from llmjp_ds.trainer import StepEngine, precision_schedule

    layout = validate_run(cfg, cfg.parallel.tensor_parallel)
    if variant in MCORE_VARIANTS:
        return peers.mcore_peer(cfg, layout, variant, peer_switches(peer_sets))
    if variant in TE_LAYER_VARIANTS:
        return peers.te_layer_reference(cfg, variant)
    if not variant.startswith("ours"):
        return peers.hf_peer(cfg, layout)
    backend, config = resolve_backend(cfg.model.backend), model_config_of(cfg)
    precision = precision_schedule(cfg, backend)
    ctx = ParallelContext.start(layout, sequence_parallel_of(cfg), cfg.parallel)
    model = None
    if shape in STAGE_SHAPES:
        seq = cfg.data.seq_len or config.max_position_embeddings
        torch.manual_seed(cfg.train.seed)
        model = peers.stage_model(config, backend, cfg.train.micro_batch_size, seq, ctx.device)
    steps = StepEngine(cfg, layout, ctx, precision, model)
    schedule, gbs = run_schedule(cfg), cfg.train.global_batch_size
    # under health.loss.action=skip the step asks the health monitor before its update, as training does: the cost
    # of the check (a reduction of the loss and a wait for it) shows beside the same row without it
    health = HealthMonitor(cfg.health)

    def step(i, batches):  # after i steps: step i + 1, as training numbers it; its losses, not waited for
        return steps.train_step(i + 1, batches, schedule.lr(i, i * gbs), schedule.weight_decay(i, i * gbs),
                                health.gate_at(i + 1)).losses

    return step, config


def flops_per_token(shape: str, config, seq: int) -> float:
    """Model FLOPs per token of a shape: every layer and the logits, or the decoder layers only."""
    if shape in STAGE_SHAPES:
        return layer_and_logits_flops_for(config, seq)[0] * config.num_hidden_layers
    return flops_per_token_for(config, seq)


def run_one(shape: str, variant: str, steps: int, warmup: int, gas: int, sets: list[str] = (),
            profile: bool = False, peer_sets: list[str] = ()) -> dict:
    cfg = bench_config(shape, variant, gas, sets)
    train_step, config = _engine_for(cfg, variant, shape, peer_sets if variant in MCORE_VARIANTS else ())
    seq = cfg.data.seq_len or config.max_position_embeddings
    micro = cfg.train.micro_batch_size
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    # the same ids on every rank of a tensor-parallel group (drawn on the CPU from a fixed seed)
    ids = torch.randint(0, config.vocab_size, (gas, micro, seq + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    batches = [(ids[m, :, :-1], ids[m, :, 1:]) for m in range(gas)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(i: int):
        return train_step(i, batches)

    times, losses = [], []
    for i in range(warmup):
        losses.append(float(timed(lambda: step(i), sync)[0][0]))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # nvidia-smi names this process's GPU by its UUID, "GPU-..." (CUDA_VISIBLE_DEVICES renumbers the indices)
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None) if cuda else None
    gpu = None if uuid is None else "GPU-" + str(uuid).removeprefix("GPU-")
    with clock_log(gpu) as clocks:
        for i in range(warmup, warmup + steps):
            parts, took = timed(lambda: step(i), sync)
            times.append(took)
            losses.append(float(parts[0]))
    step_s = statistics.median(times)
    world = cfg.parallel.tensor_parallel
    rates = Throughput(flops_per_token(shape, config, seq), gas * micro * seq, world)
    stats = torch.cuda.memory_stats() if cuda else {}
    result = {"shape": shape, "variant": variant, "micro_batch": micro, "gas": gas, "seq_len": seq,
              "step_s": step_s, "step_times_s": times, **rates.update(step_s),
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
              "alloc_retries": stats.get("num_alloc_retries", 0), "losses": losses, "steps": steps,
              "gpu_clocks": clocks,
              "sets": list(sets) if variant.startswith("ours") else list(peer_sets) if variant in MCORE_VARIANTS
              else [], "gpus": world,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if profile:
        result["profile"] = profiled_step(lambda: step(warmup + steps), sync, cuda)
        result["host_profile"] = host_profiled_step(lambda: step(warmup + steps + 1), sync)
        if cuda:
            result["syncs"] = synced_step(lambda: step(warmup + steps + 2), sync)
    return result


def precision_of(variant: str) -> str:
    """``bf16``, ``fp8-delayed``, ... of a variant name (``peer-mcore-fp8-param`` is FP8 delayed)."""
    if variant == "peer-mcore-fp8-param":
        return "fp8-delayed"
    return "bf16" if variant.endswith("bf16") else "fp8-" + variant.rsplit("-", 1)[1]


def vs_peer(r: dict, same: list[dict]) -> str:
    """``1.05x peer-mcore-bf16``: an ``ours`` row against the fastest peer of its precision at its shape."""
    if not r["variant"].startswith("ours"):
        return ""
    peers = [x for x in same if x["variant"] in PEERS.get(precision_of(r["variant"]), ())]
    if not peers:
        return ""
    best = max(peers, key=lambda x: x["tflops_per_gpu"])
    return f"{r['tflops_per_gpu'] / best['tflops_per_gpu']:.2f}x {best['variant']}"


def table(results: list[dict]) -> str:
    head = ("| shape | variant | tokens/s | TFLOP/s per GPU | MFU | peak mem GiB | alloc retries | vs peer | "
            "vs transformers + DeepSpeed | vs ours-bf16 | first-step loss | SM MHz (power-capped) |")
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for r in results:
        label = r["variant"] + (f" ({', '.join(r['sets'])})" if r.get("sets") else "")
        if "error" in r:
            lines.append(f"| {r['shape']} | {label} | failed: {r['error']} |" + " |" * (columns - 3))
            continue
        # an ours row with --set is an ablation; a peer row with --peer-set is the peer at other settings, and
        # "vs peer" takes the fastest
        same = [x for x in results if x["shape"] == r["shape"] and "error" not in x
                and not (x.get("sets") and x["variant"].startswith("ours"))]
        hf = next((x for x in same if x["variant"] == "peer-bf16"), None)
        base = next((x for x in same if x["variant"] == "ours-bf16"), None)
        vs_hf = (f"{r['tflops_per_gpu'] / hf['tflops_per_gpu']:.2f}x"
                 if hf and r is not hf and r["variant"].startswith("ours") else "")
        vs_base = (f"{r['tflops_per_gpu'] / base['tflops_per_gpu']:.2f}x"
                   if base and r is not base and r["variant"].startswith("ours") else "")
        # every variant's loss before its first update: the same model at the same init computes about ln(vocab)
        first_loss = f"{r['losses'][0]:.4f}" if r.get("losses") else ""
        # the GPU's mean SM clock over the timed steps, and how much of them it spent at its power cap
        c = r.get("gpu_clocks") or {}
        clock = f"{c['sm_mhz']:,.0f} ({100 * c['power_capped']:.0f}%)" if c else ""
        lines.append(f"| {r['shape']} | {label} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.0f} | "
                     f"{100 * r.get('mfu', 0.0):.1f}% | {r['peak_mem_gib']:.1f} | {r['alloc_retries']} | "
                     f"{vs_peer(r, same)} | {vs_hf} | {vs_base} | {first_loss} | {clock} |")
    return "\n".join(lines)


def parser(verb: str = "bench") -> argparse.ArgumentParser:
    """The command line of ``llmjp-ds bench`` (tests read benchmarks/device/checks/bench.sh's call with it)."""
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="172b-slice,llmjp3-1.8b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default: {', '.join(DEFAULT_VARIANTS)}; "
                   f"at a decoder-only shape {', '.join(STAGE_VARIANTS)})")
    p.add_argument("--shape-variants", action="append", default=[], metavar="SHAPE=VARIANT,...",
                   help="the variants at one shape in place of --variants (e.g. llmjp4-8b-slice=ours-bf16,"
                   "peer-mcore-bf16); unused when --shapes leaves that shape out")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gas", type=int, default=8, help="gradient accumulation steps")
    add_config_args(p, config=None, preset=False,
                    example="model.fused_loss=false (the ours-* variants' ablations)")
    p.add_argument("--peer-set", dest="peer_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a Megatron-Core switch for the peer-mcore-* variants, e.g. "
                        "use_transformer_engine_op_fuser=true")
    p.add_argument("--profile", action="store_true", help="also profile one step per variant (kernel time table)")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--one", nargs=2, metavar=("SHAPE", "VARIANT"), help=argparse.SUPPRESS)
    return p


def cli_main(argv: list[str], verb: str = "bench") -> int:
    a = parser(verb).parse_args(argv)
    if a.one:
        result = run_one(*a.one, a.steps, a.warmup, a.gas, a.sets, a.profile, a.peer_sets)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    shapes = a.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            fail(f"unknown shape {s!r}: choose from {', '.join(SHAPES)}")
    runs = planned_runs(shapes, a.variants, a.shape_variants)
    if a.steps < 1 or a.warmup < 0 or a.gas < 1:
        fail("--steps and --gas must be at least 1 and --warmup at least 0")

    peer_switches(a.peer_sets)  # a bad --peer-set fails here too
    for shape in shapes:  # a bad --set fails here, not in every variant's process
        cfg = bench_config(shape, "ours-bf16", a.gas, a.sets)
        validate_run(cfg, cfg.parallel.tensor_parallel)
        peers = [v for s, v in runs if s == shape and not v.startswith("ours")]
        if cfg.parallel.tensor_parallel > 1 and peers:
            fail(f"the peers run on one GPU: drop {', '.join(peers)} from --variants with parallel.tensor_parallel "
                 "> 1 (their reference is the same bench at tensor_parallel=1 on 1/N of the work)")

    if not torch.cuda.is_available():
        fail("llmjp-ds bench measures GPU training throughput: run it on a CUDA machine with Transformer Engine")
    results = [measure(shape, variant, a) for shape, variant in runs]
    print(table(results))
    for r in results:
        if "profile" in r:
            print(profile_table(r))
    if a.json:
        write_bytes_atomic(a.json, json.dumps(results, indent=2).encode())
    return 0


def planned_runs(shapes: list[str], asked: str | None, per_shape: list[str] = ()) -> list[tuple[str, str]]:
    """(shape, variant) in the order they run: at a shape its ``--shape-variants`` entry (the last one for it),
    else ``--variants``. An entry for a shape not in ``shapes`` is unused, so that a later ``--shapes`` (ARGS of
    benchmarks/device/checks/bench.sh) narrows the list without failing."""
    own = {}
    for item in per_shape:
        shape, sep, variants = item.partition("=")
        if not sep or shape not in SHAPES:
            fail(f"--shape-variants takes SHAPE=VARIANT,... with SHAPE one of {', '.join(SHAPES)}, got {item!r}")
        own[shape] = variants
    return [(s, v) for s in shapes for v in variants_for(s, own.get(s, asked))]


def variants_for(shape: str, asked: str | None) -> list[str]:
    """The variants to run at ``shape``: those asked for (all valid there), else the shape's defaults. A
    decoder-only shape has no model for the whole-model peers; the TE-layer reference runs only there."""
    stage = shape in STAGE_SHAPES
    if asked is None:
        return list(STAGE_VARIANTS if stage else DEFAULT_VARIANTS)
    variants = asked.split(",")
    for v in variants:
        if v not in VARIANTS:
            fail(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
        if stage != (v.startswith("ours") or v in TE_LAYER_VARIANTS) and (stage or v in TE_LAYER_VARIANTS):
            where = "a decoder-only shape such as 172b-tp4-stage" if v in TE_LAYER_VARIANTS else "a whole-model shape"
            fail(f"variant {v!r} runs only at {where}, not at {shape!r}: choose from "
                 f"{', '.join(STAGE_VARIANTS if stage else (x for x in VARIANTS if x not in TE_LAYER_VARIANTS))}")
    return variants


_RAISED = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+(?:Error|Exception|Interrupt)|error)\b.*)")


def error_line(stderr: str) -> str:
    """The line of a failed child's stderr that says why: its last exception (``TypeError: ...``, rank prefix
    dropped) or ``error: ...`` line; else its last line (warnings printed at exit come after the reason)."""
    lines = stderr.strip().splitlines()
    raised = [m.group(1) for m in map(_RAISED.match, lines) if m]
    return (raised or lines or ["no output"])[-1]


def measure(shape: str, variant: str, a) -> dict:
    """One variant in a fresh process; a failure becomes a row with its last error line."""
    tp = bench_config(shape, variant, a.gas, a.sets).parallel.tensor_parallel
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}"] if tp > 1 else []
    cmd = [sys.executable, *launcher, "-m", "llmjp_ds.bench.run", "--one", shape, variant, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--gas", str(a.gas)] + [f"--set={s}" for s in a.sets] + \
        [f"--peer-set={s}" for s in a.peer_sets]
    if a.profile:
        cmd.append("--profile")
    env = dict(os.environ)
    env.pop("MASTER_PORT", None)  # each child picks a free port (parallel.context.init_distributed)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        print(f"[bench] {shape} {variant} failed (exit {proc.returncode}); its output ends:",
              *proc.stderr.strip().splitlines()[-40:], sep="\n  ", file=sys.stderr, flush=True)
        result = {"shape": shape, "variant": variant, "error": error_line(proc.stderr)[:160],
                  "sets": list(a.sets) if variant.startswith("ours") else list(a.peer_sets)}
    else:
        result = json.loads(found[0])
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
    return result


if __name__ == "__main__":
    from llmjp_ds.errors import run_main

    run_main(lambda argv: cli_main(argv))
