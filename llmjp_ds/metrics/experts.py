"""What an MoE model's routers did in a step, as the record keeps it: pure arithmetic on the tokens each expert got.

Per step (``metrics.jsonl``, one list entry per MoE layer): ``moe_aux_loss`` and ``moe_z_loss`` (coefficient-free,
the mean over the MoE layers, as Megatron-LM logs ``load_balancing_loss`` and ``z_loss``), ``moe_dropped_tokens``,
``moe_imbalance`` (the largest of the layers' ``max / mean`` load, 1 when every expert gets its even share) with
each layer's in ``moe_layer_imbalance``, ``moe_min_load`` (each layer's least-loaded expert's tokens) and
``moe_least_loaded`` (which expert that is). Every ``logging.expert_load_interval`` steps, and at a run's last step,
the whole ``moe_expert_load`` matrix ``[MoE layer][expert]`` too (what ``llmjp-ds plot`` draws as a heat map).
wandb gets the scalars, and the per-layer lists as ``<key>/<layer>`` (Megatron's ``--moe-per-layer-logging``).
"""

from __future__ import annotations


def routing_metrics(routing, with_loads: bool) -> dict:
    """The record's fields of a step's :class:`~llmjp_ds.parallel.runners.Routing` (``with_loads``: the whole
    matrix too)."""
    loads = routing.expert_load
    imbalance = [max(layer) / (sum(layer) / len(layer)) if sum(layer) else 0.0 for layer in loads]
    out = {"moe_aux_loss": routing.aux_loss, "moe_z_loss": routing.z_loss, "moe_dropped_tokens": routing.dropped,
           "moe_imbalance": max(imbalance), "moe_layer_imbalance": imbalance,
           "moe_min_load": [min(layer) for layer in loads],
           "moe_least_loaded": [min(range(len(layer)), key=layer.__getitem__) for layer in loads]}
    if with_loads:
        out["moe_expert_load"] = loads
    return out


def starved_experts(loads: list) -> list[tuple[int, int]]:
    """``(MoE layer, expert)`` of every expert that got no token in a step's ``loads``."""
    return [(i, e) for i, layer in enumerate(loads) for e, n in enumerate(layer) if n == 0]
