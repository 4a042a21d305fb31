"""Hugging Face in and out: ``export`` (a training checkpoint -> a plain ``model_type: llama`` directory, reloaded
and checked) and ``import-hf`` (an HF Llama checkpoint -> a new run directory for continued pretraining).

An export carries ``llmjp_ds_export.json`` (what it was made from). ``--force`` replaces only such a directory:
never a run, a checkpoint, a directory holding either, or the directory the export reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import yaml

from llmjp_ds.checkpoint.branch import read_origin
from llmjp_ds.checkpoint.lock import LOCK, refuse_if_held
from llmjp_ds.checkpoint.readers import read_model_state
from llmjp_ds.checkpoint.resume_checks import verify_tag
from llmjp_ds.checkpoint.store import checkpoint_dir, complete_tags, latest_tag, read_marker, vet_tag
from llmjp_ds.config import RUN_PRESETS, merge, preset_dict
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import atomic_file
from llmjp_ds.model import LlamaForCausalLM
from llmjp_ds.model.hf_io import check_hf_shapes, read_hf_config, save_hf_checkpoint
from llmjp_ds.model.shapes import check_supported, is_moe_layer, resolve_shape, rope_theta

EXPORT_MARKER = "llmjp_ds_export.json"


def check_export_output(run_dir: Path, output: Path, force: bool) -> None:
    """Refuse an ``output`` that would replace what the export reads or anything but an earlier export."""
    run, out = run_dir.resolve(), output.resolve()
    if out == run or run.is_relative_to(out) or out.is_relative_to(checkpoint_dir(run).resolve()):
        fail(f"--output {output} {'is' if out == run else 'holds' if run.is_relative_to(out) else 'lies inside'} "
             f"the run {run_dir} that the export reads: choose an --output outside its checkpoints, e.g. "
             f"{run_dir / 'hf'}")
    if not output.exists() and not output.is_symlink():
        return
    if output.is_dir() and not any(output.iterdir()):
        return
    if not force:
        fail(f"{output} already exists: choose another --output or pass --force to replace it")
    holds_run = output.is_dir() and any((output / name).exists() for name in (LOCK, "checkpoints", "config.yaml"))
    if not output.is_dir() or holds_run or not (output / EXPORT_MARKER).is_file():
        fail(f"{output} is not an earlier export of llmjp-ds (no {EXPORT_MARKER}"
             f"{', and it holds a run' if holds_run else ''}): --force replaces only earlier exports; choose "
             "another --output, or move that directory away yourself")


def _check_tokenizer(tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(tokenizer))
    except Exception as exc:  # noqa: BLE001 -- transformers raises many kinds for a damaged file
        fail(f"the run's tokenizer {tokenizer} cannot be loaded ({type(exc).__name__}: "
             f"{(str(exc).strip().splitlines() or [''])[0][:160]}): restore it from the tokenizer the run was "
             "trained with (data.tokenizer), then export again")


def export(run_dir, output, tag: str | None = None, dtype: str = "bf16", force: bool = False) -> dict:
    """Write an HF checkpoint (+ tokenizer) from a training checkpoint and verify it against the trained model:
    ``AutoModelForCausalLM`` reloads the export and its logits on a probe batch must match ours."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        fail(f"run directory {run_dir} does not exist: pass --run the run_dir of a training run")
    output = Path(output)
    tag = tag or latest_tag(run_dir)
    if tag is None:
        fail(f"{run_dir} has no checkpoint yet: train first, or pass --tag")
    marker = read_marker(run_dir, tag)
    check_export_output(run_dir, output, force)
    damage = verify_tag(vet_tag(run_dir, tag), marker) if marker.files is not None else None
    if damage:
        fail(f"checkpoint {tag} of {run_dir} is damaged ({damage}): export another tag, e.g. --tag "
             f"{next((t for _, t in reversed(complete_tags(run_dir)) if t != tag), 'of an intact copy')}")
    tokenizer = run_dir / "tokenizer"
    has_tokenizer = (tokenizer / "tokenizer_config.json").is_file()
    if has_tokenizer:
        _check_tokenizer(tokenizer)
    # transformers' modeling code loads only now (it takes seconds): the checks above answer a mistake at once
    from transformers import AutoModelForCausalLM, LlamaConfig


    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    config = LlamaConfig.from_dict(marker.model_config)
    origin = read_origin(run_dir)
    if origin is not None:  # a branch: where it came from, in config.json (transformers keeps unknown fields)
        config.llmjp_ds_branch = origin
    state = {k: v for k, v in read_model_state(run_dir, tag, marker).items() if not k.endswith("_extra_state")}
    model = LlamaForCausalLM(config, backend="torch", params_dtype=torch_dtype).eval()
    model.load_state_dict({k: v.to(torch_dtype) for k, v in state.items()}, strict=False)
    made_from = {"run_dir": str(run_dir.resolve()), "tag": tag, "step": marker.step, "dtype": dtype,
                 **({"branch": origin} if origin else {})}
    save_hf_checkpoint(model, output, dtype=torch_dtype, force=True, tokenizer_dir=tokenizer if has_tokenizer else None,
                       extra_files={EXPORT_MARKER: json.dumps(made_from, indent=1).encode()})
    # parity: the export, loaded by transformers alone, must compute what the trained weights compute
    probe = torch.randint(0, config.vocab_size, (2, min(64, config.max_position_embeddings)),
                          generator=torch.Generator().manual_seed(0))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    reloaded = AutoModelForCausalLM.from_pretrained(str(output), dtype=torch_dtype).eval()
    with torch.no_grad():
        ours = model(probe).logits.float()
        theirs = reloaded(probe).logits.float()
    err = (ours - theirs).abs().max().item()
    tolerance = 1e-4 if torch_dtype == torch.float32 else 2e-2 * max(1.0, ours.abs().max().item())
    if not err <= tolerance:
        shutil.rmtree(output, ignore_errors=True)  # our own export, just written
        fail(f"export check failed: logits of the exported model differ from the trained model's by {err:.3g} "
             f"(tolerance {tolerance:.3g}); the export was removed")
    return {"tag": tag, "step": marker.step, "output": str(output), "max_logit_diff": err, "dtype": dtype}


def _moe_shape(hf) -> dict:
    """The model shape (``ModelShape``'s fields) of an HF ``qwen3_moe`` config, but its sequence length (a
    context, not the run's: ``data.seq_len`` says that) and, in a model of MoE layers only, the dense FFN width
    its config carries and no layer uses."""
    dense = [i for i in range(hf.num_hidden_layers) if not is_moe_layer(hf, i)]
    return {"num_experts": hf.num_experts, "experts_per_token": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size, "dense_layers": dense,
            "hidden_size": hf.hidden_size, "num_layers": hf.num_hidden_layers,
            "num_attention_heads": hf.num_attention_heads, "num_key_value_heads": hf.num_key_value_heads,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            "vocab_size": hf.vocab_size, "rope_theta": rope_theta(hf), "rms_norm_eps": float(hf.rms_norm_eps),
            "qk_norm": True, **({"ffn_hidden_size": hf.intermediate_size} if dense else {})}


def _preset_shape(data: dict) -> dict:
    """The model shape of a run preset (``preset_dict``'s): ``model.shape`` with the overrides it sets, as the
    fields :func:`_moe_shape` gives."""
    model = data["model"]
    shape = resolve_shape(model["shape"], {k: v for k, v in (model.get("overrides") or {}).items() if v is not None})
    fields = dict(vars(shape))
    fields["head_dim"] = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    fields["rope_theta"], fields["rms_norm_eps"] = float(shape.rope_theta), float(shape.rms_norm_eps)
    fields["dense_layers"] = list(shape.dense_layers)
    return fields


def check_moe_shape(model_dir: Path, hf, preset: str, base: dict) -> None:
    """An HF ``qwen3_moe`` model continues a run of its own shape: the preset's model (``model.shape`` with its
    overrides) must be the model's, field for field; a mismatch is one line naming both values and the presets
    whose model it is."""
    if not getattr(hf, "norm_topk_prob", False):
        fail(f"{model_dir} is a qwen3_moe model with norm_topk_prob=false (its top-k routing weights not "
             "renormalised): llmjp-ds's MoE block renormalises them, as Megatron-Core's router does; llmjp-ds "
             "imports qwen3_moe models with norm_topk_prob=true only")
    theirs = _moe_shape(hf)
    ours = _preset_shape(base)
    wrong = [k for k, v in theirs.items() if ours[k] != v]
    if not wrong:
        return
    fitting = [name for name in RUN_PRESETS if name != preset and all(
        _preset_shape(preset_dict(name))[k] == v for k, v in theirs.items())]
    key = wrong[0]
    fail(f"{model_dir} is a qwen3_moe model with {key}={theirs[key]}, but the preset {preset}'s model (shape "
         f"{base['model']['shape']}) has {key}={ours[key]}"
         + (f" ({len(wrong) - 1} more fields differ)" if len(wrong) > 1 else "") + ": pass the preset of its "
         + (f"shape, --preset {' or '.join(fitting)}" if fitting else "shape (--preset); no preset has it"))


def import_hf(model_dir, run_dir, preset: str = "llmjp3-1.8b", force: bool = False) -> Path:
    """Start a run directory for continued pretraining from an HF Llama checkpoint: writes its config.yaml. A
    ``qwen3_moe`` model keeps the preset's model shape, which must be its own (:func:`check_moe_shape`)."""
    model_dir, run_dir = Path(model_dir).resolve(), Path(run_dir)
    base = preset_dict(preset)
    if not model_dir.is_dir():
        fail(f"model directory {model_dir} does not exist: pass --model the directory save_pretrained wrote "
             "(config.json + safetensors)")
    hf = read_hf_config(model_dir)
    check_supported(hf)
    moe = getattr(hf, "model_type", "llama") == "qwen3_moe"
    if moe:
        check_moe_shape(model_dir, hf, preset, base)
    check_hf_shapes(model_dir, hf)
    refuse_if_held(run_dir)
    if complete_tags(run_dir) or (checkpoint_dir(run_dir) / "latest").exists():
        fail(f"{run_dir} holds a run with checkpoints: import-hf starts a new run; choose another --run")
    if (run_dir / "config.yaml").exists() and not force:
        fail(f"{run_dir} already holds a run: choose another --run or pass --force")
    overrides = {"hidden_size": hf.hidden_size, "num_layers": hf.num_hidden_layers,
                 "num_attention_heads": hf.num_attention_heads, "num_key_value_heads": hf.num_key_value_heads,
                 "ffn_hidden_size": hf.intermediate_size, "vocab_size": hf.vocab_size,
                 "seq_len": hf.max_position_embeddings, "rope_theta": rope_theta(hf), "rms_norm_eps": hf.rms_norm_eps}
    model = ({"init_from_hf": str(model_dir)} if moe else
             {"shape": "tiny", "overrides": overrides, "init_from_hf": str(model_dir)})
    data = merge(base, {"run_dir": str(run_dir), "model": model})
    if (model_dir / "tokenizer_config.json").is_file():
        data.setdefault("data", {})["tokenizer"] = str(model_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(run_dir / "config.yaml", "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return run_dir / "config.yaml"


def cli_main(argv: list[str], verb: str = "export") -> int:
    if verb == "import-hf":
        p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}",
                                    description="start a run from a Hugging Face Llama checkpoint")
        p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
        p.add_argument("--run", required=True, help="run directory to create")
        p.add_argument("--preset", default="llmjp3-1.8b",
                       help="run preset for optimizer/batch settings (a qwen3_moe model's shape too: it must match)")
        p.add_argument("--force", action="store_true", help="replace the config.yaml of a run with no checkpoint")
        a = p.parse_args(argv)
        path = import_hf(a.model, a.run, a.preset, a.force)
        print(f"wrote {path}; start training with: llmjp-ds train --config {path}")
        return 0
    p = argparse.ArgumentParser(prog=f"llmjp-ds {verb}", description="export a checkpoint as a HF Llama model")
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument("--output", required=True, help="output directory for the HF model")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--force", action="store_true", help="replace an earlier export")
    a = p.parse_args(argv)
    result = export(a.run, a.output, a.tag, a.dtype, a.force)
    print(f"exported {result['tag']} (step {result['step']}) to {result['output']} as {result['dtype']}; "
          f"AutoModelForCausalLM reload check passed (max |dlogit| {result['max_logit_diff']:.2e})")
    return 0
