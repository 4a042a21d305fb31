"""One initialisation for both stacks: ``python -m benchmarks.parity.init --hf DIR --megatron DIR [--shape S]
[--seed N]``.

Builds ``llmjp3-1.8b`` or another shape (ours, seeded), rounds it to bf16 (what both stacks hold as model weights)
and writes it twice from the same tensors: an HF directory (``model.init_from_hf`` of ``llmjp-ds train``) and a
Megatron-LM release checkpoint in the legacy ``torch`` layout (``release/mp_rank_00/model_optim_rng.pt``), which
``pretrain_gpt.py --load DIR --finetune`` reads as its iteration-0 weights. The Megatron names are
``interchange/megatron_adapter.to_megatron_state_dict``'s (Megatron-Core's TE layer spec), an MoE model's included.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# Megatron-Core's TE layer spec: the modules of a decoder layer that keep TE's extra state (FP8 metadata; none in
# an initial checkpoint); the final norm (TE's RMSNorm, see below), and the output layer, whose extra state Megatron
# keeps for TE's state-dict layout
_EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
                        "mlp.linear_fc1", "mlp.linear_fc2")
# an MoE layer of Megatron-Core 0.19's TE spec (get_gpt_layer_with_transformer_engine_submodules with experts): no
# fused LayerNormMLP but TE's RMSNorm as pre_mlp_layernorm, the router (a plain module: no extra state) and the
# experts' two grouped GEMMs (TEGroupedMLP's TEColumnParallelGroupedLinear and TERowParallelGroupedLinear); TE 2.x's
# RMSNorm is a fusible operation that keeps extra state too, as the qk-norms (q_layernorm, k_layernorm) are
_MOE_EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
                            "pre_mlp_layernorm", "mlp.experts.linear_fc1", "mlp.experts.linear_fc2")
_QK_NORM_EXTRA_STATE_MODULES = ("self_attention.q_layernorm", "self_attention.k_layernorm")


def extra_state_modules(config, layer: int) -> tuple[str, ...]:
    """The modules of decoder layer ``layer`` of a model of ``config`` whose ``_extra_state`` Megatron-Core's TE
    spec keeps: a dense layer's or an MoE layer's, and the qk-norms of a qwen3 or qwen3_moe model."""
    from llmjp_ds.model.shapes import has_qk_norm, is_moe_layer

    modules = _MOE_EXTRA_STATE_MODULES if is_moe_layer(config, layer) else _EXTRA_STATE_MODULES
    return modules + (_QK_NORM_EXTRA_STATE_MODULES if has_qk_norm(config) else ())


def write_megatron_release(state: dict[str, torch.Tensor], config, directory: Path) -> Path:
    """``state`` (Megatron-Core names) of a model of ``config`` as a legacy release checkpoint: the weights only, no
    args, no optimizer. Megatron-LM loads it strictly first and, when a name differs (an entry of extra state
    included or left out), again non-strictly, printing ``load_return`` (benchmarks/parity/__main__.py's FATAL)."""
    model = dict(state)
    for i in range(config.num_hidden_layers):
        for module in extra_state_modules(config, i):
            model[f"decoder.layers.{i}.{module}._extra_state"] = None
    model["decoder.final_layernorm._extra_state"] = model["output_layer._extra_state"] = None
    path = directory / "release" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "checkpoint_version": 3.0, "iteration": 0}, path)
    (directory / "latest_checkpointed_iteration.txt").write_text("release")
    return path


def main(argv=None) -> None:
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.interchange.megatron_adapter import to_megatron_state_dict
    from llmjp_ds.model.shapes import model_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, type=Path)
    p.add_argument("--megatron", required=True, type=Path)
    p.add_argument("--shape", default="llmjp3-1.8b")
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args(argv)
    config = model_config(a.shape)
    torch.manual_seed(a.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config, backend="torch").to(torch.bfloat16)
    model.save_pretrained(a.hf, dtype=torch.bfloat16)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    path = write_megatron_release(to_megatron_state_dict(state, config), config, a.megatron)
    print(f"initial weights: {a.hf} (HF) and {path} (Megatron-LM), {sum(v.numel() for v in state.values())} "
          f"parameters", flush=True)


if __name__ == "__main__":
    main()
