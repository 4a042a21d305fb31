"""The mixture-of-experts block of a Qwen3-MoE decoder layer (LLM-jp-4's MoE models), as Megatron-Core computes it.

Read top to bottom: the router's pure functions (:func:`route`, :func:`load_balancing_loss`,
:func:`router_z_loss`, :func:`drop_over_capacity`), the permutation of tokens to their experts (:func:`permute`,
:func:`unpermute`), then :class:`MoEBlock`: RMSNorm -> router -> experts -> the weighted sum of each token's
experts. Per token (``x [T, h]``):

* logits ``x W_r^T`` in fp32 (``--moe-router-dtype fp32``), ``[T, E]``;
* the top ``k`` of them and a softmax over those ``k`` (megatron-core's ``topk_routing_with_score_function``
  without pre-softmax; the same as transformers' ``softmax -> top-k -> renormalise``, ``norm_topk_prob``);
* each chosen expert's SwiGLU MLP, its activation scaled by the token's weight for it before the down projection
  (Megatron's weighted SwiGLU), and the ``k`` outputs summed.

Dropless by default; ``capacity_factor`` caps each expert at ``ceil(T k / E x factor)`` tokens, keeping those of
highest weight (``probs``) or the earliest (``position``), as Megatron's ``--moe-expert-capacity-factor`` and
``--moe-token-drop-policy``. The router's losses are Megatron's, per layer and micro-batch, coefficient-free
here (the model adds ``coeff x loss`` to the training loss): ``aux_loss`` ``E sum_e f_e P_e`` over the micro-batch's
tokens, ``seq_aux_loss`` the mean of it over each sequence, and the z-loss ``mean_t logsumexp(logits_t)^2``.

The experts are the backend's ``GroupedLinear`` (TE's on a GPU: one grouped GEMM per projection; its torch twin
elsewhere) holding this rank's experts: with expert parallelism (``ep``) tokens travel to the rank that holds
their expert and back (:mod:`llmjp_ds.model.expert_parallel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmjp_ds.model.expert_parallel import mark_experts


# --- the router, pure functions -----------------------------------------------------------------------------

def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [T, E], routing_map [T, E] bool)`` of fp32 router logits: the top ``top_k`` experts of each
    token, their weights a softmax over those logits (zero elsewhere)."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    probs = torch.zeros_like(logits, dtype=torch.float32).scatter(1, experts, weights)
    return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)


def load_balancing_loss(logits: torch.Tensor, top_k: int, sequences: int = 1) -> torch.Tensor:
    """Megatron's switch load-balancing loss of ``logits [T, E]`` (coefficient-free): ``E sum_e f_e P_e`` with
    ``P_e`` the mean full-softmax score of expert ``e`` and ``f_e`` the share of the ``T k`` choices (top-k of that
    softmax) that went to it; 1 when perfectly balanced. ``sequences > 1``: the rows are ``sequences`` sequences of
    equal length one after the other, and the loss is the mean of each one's (``seq_aux_loss``)."""
    num_experts = logits.shape[-1]
    scores = torch.softmax(logits.float(), dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, torch.topk(scores, top_k, dim=-1).indices, 1.0)
    scores, chosen = scores.view(sequences, -1, num_experts), chosen.view(sequences, -1, num_experts)
    tokens = scores.shape[1]
    per_sequence = (scores.sum(1) * chosen.sum(1)).sum(-1) * num_experts / (top_k * tokens * tokens)
    return per_sequence.mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The router's z-loss (coefficient-free): ``mean_t logsumexp(logits_t)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, top_k: int, capacity_factor: float,
                       policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps at most ``ceil(T top_k / E x capacity_factor)`` of the tokens routed to it: those of the
    highest weight (``probs``) or the earliest (``position``); the others lose that expert."""
    tokens, experts = routing_map.shape
    capacity = math.ceil(tokens * top_k / experts * capacity_factor)
    if capacity >= tokens:
        return probs, routing_map
    rank_by = probs if policy == "probs" else routing_map.float() * (tokens - torch.arange(
        tokens, device=probs.device, dtype=torch.float32)).unsqueeze(1)
    keep = torch.zeros_like(routing_map).scatter(0, torch.topk(rank_by, capacity, dim=0).indices, True)
    keep &= routing_map
    return probs * keep, keep


# --- tokens to their experts and back -----------------------------------------------------------------------

def permute(x: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [N, h], token_ids [N], tokens_per_expert [E])``: each (token, expert) choice of ``routing_map``
    as a row, expert-major and in token order within an expert (Megatron's ``permute``)."""
    experts_tokens = routing_map.t().nonzero()  # (expert, token), row-major: expert-major, tokens ascending
    return x[experts_tokens[:, 1]], experts_tokens[:, 1], routing_map.sum(0)


def unpermute(rows: torch.Tensor, token_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The sum of each token's rows (its experts' outputs), ``[tokens, h]``, in the rows' dtype."""
    out = torch.zeros(tokens, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    return out.index_add(0, token_ids, rows)


@dataclass
class Rows:
    """The rows of a block's tokens in expert order: ``tokens [N, h]``, each row's routing ``weights [N, 1]``
    (fp32), the rows of each expert ``tokens_per_expert [E]``, and what the backend needs to bring them back
    (``back``: the token of each row, or TE's row map, and the tokens' count)."""

    tokens: torch.Tensor
    weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    back: tuple


@dataclass
class Routed:
    """What a block's last forward routed, from this rank's micro-batch: its losses (coefficient-free), what they
    add to the training loss (``loss``: each times its coefficient; graph-connected), the tokens each of the ``E``
    experts was chosen by, and the choices dropped over capacity."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor


class MoEBlock(nn.Module):
    """RMSNorm, router and experts of one MoE decoder layer (its residual is the layer's). Parameters::

        norm.weight                                    [h]
        router.weight                                  [E, h]
        experts.linear_fc1.weight{i}                   [2 F, h]  = [gate; up] of this rank's expert i
        experts.linear_fc2.weight{i}                   [h, F]

    ``L``: the layers backend; ``moe``: the router's settings (:class:`~llmjp_ds.model.options.ModelOptions`);
    ``ep``: the expert-parallel group (``model/expert_parallel.ExpertParallel``), or None for every expert here.
    The tokens ``x`` are ``[b, s, h]``. After a forward, :attr:`routed` holds what it routed."""

    def __init__(self, config, L, options, params_dtype=None, ep=None, device=None):
        super().__init__()
        h, self.num_experts, self.top_k = config.hidden_size, config.num_experts, config.num_experts_per_tok
        self.aux_loss_type, self.capacity_factor = options.moe_aux_loss, options.moe_capacity_factor
        self.drop_policy, self.ep, self._L = options.moe_drop_policy, ep, L
        self.coeffs = (options.moe_aux_loss_coeff, options.moe_z_loss_coeff)
        local = self.num_experts if ep is None else ep.local(self.num_experts)
        std, ffn = config.initializer_range, config.moe_intermediate_size
        self.norm = L.RMSNorm(h, eps=config.rms_norm_eps, params_dtype=params_dtype)
        self.router = Router(self.num_experts, h, std, params_dtype, device)
        self.experts = L.GroupedMLP(local, h, ffn, init_std=std,
                                    output_std=std / math.sqrt(2.0 * config.num_hidden_layers),
                                    params_dtype=params_dtype)
        if ep is not None:
            mark_experts(self.experts, ep)
        self.routed: Routed | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden = self.norm(x).reshape(-1, shape[-1])
        logits = self.router(hidden)
        probs, routing_map = self._L.route(logits, self.top_k)
        chosen = routing_map.sum(0)
        if self.capacity_factor is not None:
            probs, routing_map = drop_over_capacity(probs, routing_map, self.top_k, self.capacity_factor,
                                                    self.drop_policy)
        sequences = shape[0] if self.aux_loss_type == "seq_aux_loss" else 1
        aux = (self._L.load_balancing_loss(logits, self.top_k, sequences) if self.aux_loss_type != "none"
               else logits.new_zeros(()))
        z = router_z_loss(logits)
        self.routed = Routed(aux.detach(), z.detach(), self.coeffs[0] * aux + self.coeffs[1] * z, chosen.detach(),
                             (chosen - routing_map.sum(0)).sum().detach())
        dropless = self.capacity_factor is None
        rows = self._L.permute_tokens(hidden, probs, routing_map, hidden.shape[0] * self.top_k if dropless else None)
        if self.ep is None:
            out = self.experts(rows.tokens, rows.tokens_per_expert, rows.weights)
        else:
            out = self.ep.run_experts(self.experts, rows.tokens, rows.tokens_per_expert, rows.weights)
        return self._L.unpermute_tokens(out, rows).view(shape)


class _RouterLossGrad(torch.autograd.Function):
    """``hidden`` unchanged; its backward also gives ``loss`` the gradient ``scale`` (Megatron-Core's
    ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, hidden, loss, scale: float):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return hidden

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def with_router_loss(hidden: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``hidden``, carrying the router ``loss`` of the block that made it into the backward: the gradient the loss
    gets is ``scale``, what it would get as a term of the training loss (its scale in a fault drill over the
    micro-batches of the step). A pipeline stage's MoE layers train their routers so, where their losses cannot be
    added to the last stage's loss."""
    return _RouterLossGrad.apply(hidden, loss, scale)


class Router(nn.Module):
    """``weight [E, h]``; the logits ``[T, E]`` in fp32 whatever the weights' dtype (``--moe-router-dtype fp32``).
    Replicated on every rank (a dense parameter)."""

    def __init__(self, num_experts: int, hidden_size: int, init_std: float, params_dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype, device=device))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())
