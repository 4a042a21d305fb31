"""A Megatron-Core MoE run's arguments: which of them llmjp-ds continues, where its experts live, and what each
must equal in the run config.

Megatron-LM trains LLM-jp's MoE models as Qwen3-MoE decoders (``--num-experts``, ``--moe-router-topk``,
``--moe-ffn-hidden-size``, ``--qk-layernorm``, ``--moe-router-load-balancing-type aux_loss``, ``--moe-aux-loss-coeff``,
``--moe-z-loss-coeff``, ``--moe-router-dtype fp32``, ...). Ours is that decoder (:mod:`llmjp_ds.model.moe`): a
softmax over the top-k router logits, dropless or with a capacity factor, no shared experts, no expert bias. A run
whose router or experts compute something else is refused by :func:`unsupported` (its weights alone would import and
compute another model); the rest are compared with the run config by :func:`config_pairs`, each mismatch one line
naming both values:

=====================================  ==============================================================
Megatron-LM                            run config
=====================================  ==============================================================
``--num-experts``                      ``model.overrides.num_experts`` (``model.shape``'s)
``--moe-router-topk``                  ``model.overrides.experts_per_token``
``--moe-ffn-hidden-size``              ``model.overrides.moe_ffn_hidden_size`` (default ``--ffn-hidden-size``)
``--moe-layer-freq``                   ``model.overrides.dense_layers`` (the layers it makes dense)
``--qk-layernorm``                     ``model.overrides.qk_norm``
``--moe-router-load-balancing-type``   ``model.moe_aux_loss`` (aux_loss, seq_aux_loss, none)
``--moe-aux-loss-coeff``               ``model.moe_aux_loss_coeff``
``--moe-z-loss-coeff``                 ``model.moe_z_loss_coeff`` (unset: 0)
``--moe-expert-capacity-factor``       ``model.moe_capacity_factor`` (unset: dropless, null)
``--moe-token-drop-policy``            ``model.moe_drop_policy`` (with a capacity factor)
=====================================  ==============================================================

Arguments that change only how Megatron computes it (``--moe-grouped-gemm``, ``--moe-token-dispatcher-type``, the
permute and router fusions, ``--moe-per-layer-logging``, recompute) do not matter here, nor does ``--moe-router-dtype``
(None or fp32: ours computes the router's logits in fp32 always).
"""

from __future__ import annotations

from llmjp_ds.model.options import DROP_POLICIES, MOE_AUX_LOSSES

# arguments that change what an MoE layer computes, each with the value that means "not used" (also what a release
# that did not have it did): a softmax over the top-k logits, no scaling, no groups, no expert bias, no shared
# experts, no jitter, no padding to capacity, the probabilities on the experts' outputs, no latent projection
_OFF = (("moe_router_score_function", "softmax"), ("moe_router_pre_softmax", False),
        ("moe_router_topk_scaling_factor", None), ("moe_router_num_groups", None), ("moe_router_group_topk", None),
        ("moe_router_topk_limited_devices", None), ("moe_router_enable_expert_bias", False),
        ("moe_shared_expert_intermediate_size", None), ("moe_use_legacy_grouped_gemm", False),
        ("moe_input_jitter_eps", None), ("moe_pad_expert_input_to_capacity", False),
        ("moe_apply_probs_on_input", False), ("moe_latent_size", None), ("moe_router_force_load_balancing", False))
ROUTER_DTYPES = (None, "fp32")


def num_experts(args) -> int:
    return int(args.get("num_experts") or 0)


def _losses(args) -> tuple[list, list]:
    """The run's load-balancing losses and their coefficients as lists: Megatron-LM 0.16+ takes
    ``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff`` as lists (one per loss; a list of one is
    kept as its value), older releases as one value."""
    kind, coeff = args.get("moe_router_load_balancing_type", "aux_loss"), args.get("moe_aux_loss_coeff", 0.0)
    return (list(kind) if isinstance(kind, (list, tuple)) else [kind],
            list(coeff) if isinstance(coeff, (list, tuple)) else [coeff])


def balancing(args) -> tuple[str, float]:
    """(the load-balancing loss, its coefficient) of a run of one such loss."""
    kinds, coeffs = _losses(args)
    return (kinds[0] if kinds else None) or "aux_loss", float((coeffs[0] if coeffs else None) or 0.0)


def unsupported(args) -> list[str]:
    """``name=value`` of each MoE argument of the run that ours does not compute (empty for a dense run)."""
    if not num_experts(args):
        return []
    wrong = [f"{name}={args.get(name)!r}" for name, off in _OFF if args.get(name, off) not in (off, None)]
    kinds, coeffs = _losses(args)
    if len(kinds) > 1 or len(coeffs) > 1:  # several losses at once
        name, value = ("moe_router_load_balancing_type", kinds) if len(kinds) > 1 else ("moe_aux_loss_coeff", coeffs)
        wrong.append(f"{name}={value!r}")
    elif balancing(args)[0] not in MOE_AUX_LOSSES:
        wrong.append(f"moe_router_load_balancing_type={balancing(args)[0]!r}")
    if args.get("moe_router_dtype") not in ROUTER_DTYPES:
        wrong.append(f"moe_router_dtype={args.get('moe_router_dtype')!r}")
    if args.get("moe_token_drop_policy", "probs") not in DROP_POLICIES:
        wrong.append(f"moe_token_drop_policy={args.get('moe_token_drop_policy')!r}")
    return wrong


def layer_pattern(args) -> list[int]:
    """Megatron's ``moe_layer_pattern``: per decoder layer 1 (MoE) or 0 (dense), from ``--moe-layer-freq`` (an int
    N: every N-th layer from layer 0 is MoE; or the list itself)."""
    layers, freq = int(args.get("num_layers")), args.get("moe_layer_freq", 1)
    if not num_experts(args):
        return [0] * layers
    if isinstance(freq, (list, tuple)):
        return [int(x) for x in freq]
    return [1 if i % int(freq or 1) == 0 else 0 for i in range(layers)]


def dense_layers(args) -> list[int]:
    """The decoder layers of an MoE run that are dense (``model.overrides.dense_layers``)."""
    return [i for i, moe in enumerate(layer_pattern(args)) if not moe]


def expert_layout(args) -> tuple[int, int, int]:
    """(expert-parallel size, expert-tensor-parallel size, expert-data-parallel size) of the run: Megatron's
    experts are split over EP x ETP ranks of a pipeline stage, and replicated over the rest of it."""
    tp = int(args.get("tensor_model_parallel_size") or 1)
    ep = int(args.get("expert_model_parallel_size") or 1)
    etp = int(args.get("expert_tensor_parallel_size") or tp)
    dp, cp = int(args.get("data_parallel_size") or 1), int(args.get("context_parallel_size") or 1)
    return ep, etp, dp * tp * cp // (ep * etp)


def optimizer_counts(args) -> tuple[int, ...]:
    """How many optimizers megatron-core may have saved for the run: two (a ChainedOptimizer of the dense
    parameters' and the experts', each with DDP buffers of its own) where the experts are reduced over groups of
    their own, under expert parallelism (and, from megatron-core 0.19, an expert-tensor-parallel size other than
    the tensor-parallel one); else one, the experts ordinary data-parallel weights in the dense buffers, in
    registration order."""
    if not num_experts(args):
        return (1,)
    ep, etp, _ = expert_layout(args)
    if ep > 1:
        return (2,)
    return (1, 2) if etp != int(args.get("tensor_model_parallel_size") or 1) else (1,)


def config_pairs(args, cfg, model_config) -> list[tuple[str, object, str, object]]:
    """(Megatron argument, its value, config key, the config's value) of everything about the experts that must
    agree (nothing for a dense run and a dense config)."""
    experts = num_experts(args)
    ours = getattr(model_config, "num_experts", 0) or 0
    pairs = [("num_experts", experts, "model.overrides.num_experts", ours)]
    if not experts or not ours:
        return pairs
    m = cfg.model
    freq = args.get("moe_layer_freq", 1)
    kind, coeff = balancing(args)
    capacity = args.get("moe_expert_capacity_factor")
    pairs += [("moe_router_topk", int(args.get("moe_router_topk") or 2), "model.overrides.experts_per_token",
               model_config.num_experts_per_tok),
              ("moe_ffn_hidden_size", int(args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")),
               "model.overrides.moe_ffn_hidden_size", model_config.moe_intermediate_size),
              (f"moe_layer_freq={freq!r}, dense layers", dense_layers(args), "model.overrides.dense_layers",
               list(getattr(model_config, "mlp_only_layers", None) or [])),
              ("moe_router_load_balancing_type", kind, "model.moe_aux_loss", m.moe_aux_loss),
              ("moe_z_loss_coeff", float(args.get("moe_z_loss_coeff") or 0.0), "model.moe_z_loss_coeff",
               float(m.moe_z_loss_coeff)),
              ("moe_expert_capacity_factor", None if capacity is None else float(capacity), "model.moe_capacity_factor",
               None if m.moe_capacity_factor is None else float(m.moe_capacity_factor))]
    if kind != "none":
        pairs.append(("moe_aux_loss_coeff", coeff, "model.moe_aux_loss_coeff", float(m.moe_aux_loss_coeff)))
    if capacity is not None:
        pairs.append(("moe_token_drop_policy", args.get("moe_token_drop_policy", "probs"), "model.moe_drop_policy",
                      m.moe_drop_policy))
    return pairs
