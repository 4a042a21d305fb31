"""Reading and writing Hugging Face checkpoint directories (safetensors, sharded or not) of the model types this
package builds: ``llama``, ``qwen3`` (qk-norm) and ``qwen3_moe`` (experts)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmjp_ds.errors import fail
from llmjp_ds.io_utils import atomic_directory
from llmjp_ds.model.hf_adapter import from_hf_state_dict, to_hf_state_dict
from llmjp_ds.model.shapes import has_qk_norm, is_moe_layer

SAFE_INDEX = "model.safetensors.index.json"
# the Hugging Face model type of each kind of model this package builds, and its architecture
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def read_hf_config(path: Path):
    if not (path / "config.json").is_file():
        fail(f"{path} is not a Hugging Face model directory (no config.json): pass the directory that "
             "save_pretrained wrote")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        fail(f"{path / 'config.json'} is not valid JSON ({exc}): the download is incomplete or the file was edited")
    if not isinstance(raw, dict):
        fail(f"{path / 'config.json'} is not a JSON object: the download is incomplete or the file was edited")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or [ARCHITECTURES.get(model_type, "?")]
    if model_type not in ARCHITECTURES or ARCHITECTURES[model_type] not in archs:
        fail(f"{path} holds a {model_type!r} model ({', '.join(archs)}), not one of "
             f"{', '.join(f'{t} ({a})' for t, a in ARCHITECTURES.items())}: llmjp-ds imports those only")
    from transformers import AutoConfig  # after the checks: transformers takes seconds to import

    return AutoConfig.from_pretrained(str(path))


def expected_hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of an HF Llama checkpoint of ``config`` (a pure function of the config)."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if has_qk_norm(config):
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if is_moe_layer(config, n):
            e, f = config.num_experts, config.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (e, h)
            for x in range(e):
                expert = f"{p}mlp.experts.{x}."
                out.update({expert + "gate_proj.weight": (f, h), expert + "up_proj.weight": (f, h),
                            expert + "down_proj.weight": (h, f)})
            out.update({p + "mlp.experts.gate_up_proj": (e, 2 * f, h), p + "mlp.experts.down_proj": (e, h, f)})
        else:
            out.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                        p + "mlp.down_proj.weight": (h, i)})
    return out


def check_hf_shapes(path: Path, config) -> None:
    """Every safetensors tensor of the HF checkpoint in ``path`` has the shape its ``config.json`` implies (read
    from the files' headers: no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    expected = expected_hf_shapes(config)
    files = sorted(set(json.loads((path / SAFE_INDEX).read_text())["weight_map"].values())) if (
        path / SAFE_INDEX).is_file() else ["model.safetensors"] if (path / "model.safetensors").is_file() else []
    for name in files:
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    shape = tuple(f.get_slice(key).get_shape())
                    if key in expected and shape != expected[key]:
                        fail(f"{path / name}: {key} has shape {list(shape)}, but config.json implies "
                             f"{list(expected[key])}: the checkpoint does not belong to this config.json")
        except (SafetensorError, OSError) as exc:
            fail(f"{path / name} is not a readable safetensors file ({str(exc).splitlines()[0][:160]}): the download "
                 "is incomplete or the file is damaged")


def read_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / SAFE_INDEX).is_file():
        weight_map = json.loads((path / SAFE_INDEX).read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                fail(f"{path / shard} is listed in {SAFE_INDEX} but missing: the download is incomplete")
            tensors.update(load_file(path / shard))
        return tensors
    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    fail(f"{path} has no model.safetensors, {SAFE_INDEX} or pytorch_model.bin")


def load_hf_checkpoint(cls, path: Path, backend=None, dtype=None, **model_kwargs):
    if not path.is_dir():
        fail(f"model directory {path} does not exist")
    config = read_hf_config(path)
    check_hf_shapes(path, config)
    ours = from_hf_state_dict(read_hf_tensors(path), config)
    dtype = dtype or ours["model.embed_tokens.weight"].dtype
    model = cls(config, backend=backend, params_dtype=dtype, **model_kwargs)
    result = model.load_state_dict(ours, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        fail(f"{path} does not match its config.json (missing {missing[:3]}, unexpected "
             f"{result.unexpected_keys[:3]}): the checkpoint is incomplete or its config is wrong")
    return model


def hf_config_for_export(config, dtype: torch.dtype):
    """A plain config of its model type (``llama``, ``qwen3``, ``qwen3_moe``): no auto_map, transformers' own
    architecture name, the saved dtype."""
    config = config.__class__.from_dict(config.to_dict())
    config.architectures = [ARCHITECTURES[config.model_type]]
    for attr in ("auto_map", "_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    config.dtype = dtype
    return config


def save_hf_checkpoint(model, path: Path, dtype=None, max_shard_size: int = 5 * 2**30, force: bool = True,
                       tokenizer_dir: Path | None = None, extra_files: dict[str, bytes] | None = None) -> None:
    """Write ``model`` as an HF checkpoint; the directory appears complete or not at all."""
    state = to_hf_state_dict({k: v.detach() for k, v in model.state_dict().items()}, model.config)
    write_hf_checkpoint(state, model.config, path, dtype=dtype, max_shard_size=max_shard_size, force=force,
                        tokenizer_dir=tokenizer_dir, extra_files=extra_files)


def write_hf_checkpoint(hf_state: dict[str, torch.Tensor], config, path: Path, dtype=None,
                        max_shard_size: int = 5 * 2**30, force: bool = True, tokenizer_dir: Path | None = None,
                        extra_files: dict[str, bytes] | None = None):
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    dtype = dtype or hf_state["model.embed_tokens.weight"].dtype
    hf_state = {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in hf_state.items()}
    split = split_torch_state_dict_into_shards(hf_state, max_shard_size=max_shard_size)
    with atomic_directory(Path(path), force=force) as tmp:
        for filename, names in split.filename_to_tensors.items():
            save_file({n: hf_state[n] for n in names}, tmp / filename, metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf_state.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2))
        hf_config_for_export(config, dtype).save_pretrained(str(tmp))
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(
            str(tmp))
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(tmp))
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
