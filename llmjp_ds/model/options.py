"""The choices a model is built with besides its shape and backend: which fused kernels run, what is recomputed, and
how an MoE model's router is trained.
Their defaults are the run config's (``config/schema.py`` takes them from here), so a model built alone and one a
run builds agree; a built model is never changed from outside (what other rooms hand it later goes through
:mod:`llmjp_ds.model.attach`)."""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE_MODES = ("none", "selective", "full", "moe")  # model.recompute
MOE_AUX_LOSSES = ("aux_loss", "seq_aux_loss", "none")  # --moe-router-load-balancing-type (the ones we compute)
DROP_POLICIES = ("probs", "position")  # --moe-token-drop-policy
# the fields that choose a kernel, and what each may be
KERNEL_CHOICES = {"fused_qkv_rope": (True, False, "te", "triton"), "attention_core": ("te", "cudnn")}


@dataclass(frozen=True)
class ModelOptions:
    """``recompute``: none | selective (the attention core, as LLM-jp's 172B run) | full (every decoder layer) |
    moe (each MoE layer's MoE block, Megatron-LM's ``--recompute-modules moe`` as LLM-jp's MoE runs).
    ``fused_qkv_rope`` (TE backend): the QKV split and both RoPE rotations as one fused kernel: triton = ours
    (model/kernels/rope.py), true or te = TE's, false = none. ``attention_core`` (TE backend): te = TE's
    DotProductAttention, cudnn = torch's scaled_dot_product_attention on its cuDNN backend. ``fused_residual_norm``
    (TE backend, not under recompute: full): each residual's gradient added inside the backward of the norm that
    reads it (model/residual_grad.py)."""

    recompute: str = "none"
    fused_qkv_rope: bool | str = "triton"
    attention_core: str = "te"
    fused_residual_norm: bool = True
    # an MoE model's router (Megatron-LM's names): the load-balancing loss (--moe-router-load-balancing-type:
    # aux_loss per micro-batch, seq_aux_loss per sequence, none) and its coefficient, the router z-loss's, and
    # dropless routing (None) or each expert's capacity as a factor of its even share, and which tokens an expert
    # over capacity keeps (--moe-token-drop-policy: probs = the highest weights, position = the earliest)
    moe_aux_loss: str = "aux_loss"
    moe_aux_loss_coeff: float = 1e-2
    moe_z_loss_coeff: float = 1e-3
    moe_capacity_factor: float | None = None
    moe_drop_policy: str = "probs"

    @property
    def recompute_core(self) -> bool:
        return self.recompute == "selective"

    @property
    def recompute_layers(self) -> bool:
        return self.recompute == "full"

    @property
    def recompute_moe(self) -> bool:
        return self.recompute == "moe"

    def residual_in_norm(self, backend: str) -> bool:
        """Whether the residual's gradient is added inside the norm's backward on ``backend``."""
        return self.fused_residual_norm and backend == "te" and not self.recompute_layers
