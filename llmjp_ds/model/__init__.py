"""The model: an HF-compatible Llama built from Transformer Engine layers (or their pure-PyTorch twins).

* :mod:`.shapes`: model shapes as data (LLM-jp-3, LLM-jp-4, tiny) and their overrides;
* :mod:`.llama`: ``LlamaForCausalLM``, a transformers ``PreTrainedModel`` made of the layers below;
* :mod:`.moe`: the mixture-of-experts block: router, its losses, tokens to their experts and back;
* :mod:`.options`: the fused kernels and recompute a model is built with (``ModelOptions``);
* :mod:`.attach`: what other rooms hand a built model (FP8 state, fp32 gradient buffers), in one place;
* :mod:`.backend`: Transformer Engine on a CUDA GPU, else the pure-PyTorch twin;
* :mod:`.te_layers`: the building blocks as TE modules (CUDA only);
* :mod:`.torch_layers`: their pure-PyTorch twins: TE's parameter names, layout and math;
* :mod:`.loss`: the causal-LM loss with the optional z-loss, reported apart;
* :mod:`.main_grad`: the embedding and LM head with weight gradients accumulated into an fp32 ``main_grad``;
* :mod:`.residual_grad`: the residual stream's gradient added inside the next norm's backward;
* :mod:`.weight_reuse`: the protocol between TE's GEMMs and the FP8 weight cache, from the model's side;
* :mod:`.tensor_parallel`: tensor and sequence parallelism: the group and the four communication operators;
* :mod:`.expert_parallel`: expert parallelism: the group an MoE layer's experts are split over, and the
  all-to-all dispatch of rows to the ranks that hold their experts and back;
* :mod:`.pipeline_layers`: the pipeline split (embedding | decoder layers | final norm + head) as stage layers;
* :mod:`.hf_adapter`: the model's weight names: Hugging Face Llama <-> ours (TE names) <-> pipeline layers, TP
  shards, the experts of an expert-parallel rank; pure functions;
* :mod:`.hf_io`: Hugging Face Llama checkpoint directories (safetensors) read and written;
* :mod:`.flops`: model FLOPs per token and parameter counts, pure arithmetic;
* ``kernels/``: the fused kernels (RoPE, cross-entropy, AdamW) in torch and Triton.

The names below load on first use (PEP 562), so that config validation, which needs only ``shapes`` and
``backend``, does not pay for importing transformers' modeling code (seconds) before it can report a mistake.
"""

import importlib

_LAZY = {
    "LlamaForCausalLM": "llama", "DecoderLayer": "llama", "Embedding": "llama", "FinalNormHead": "llama",
    "MODEL_SHAPES": "shapes", "ModelShape": "shapes", "model_config": "shapes", "pad_vocab_size": "shapes",
}

__all__ = ["LlamaForCausalLM", "DecoderLayer", "Embedding", "FinalNormHead", "MODEL_SHAPES", "ModelShape",
           "model_config", "pad_vocab_size"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"llmjp_ds.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'llmjp_ds.model' has no attribute {name!r}")
