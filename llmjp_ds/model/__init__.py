"""The model: an HF-compatible Llama built from Transformer Engine layers (or their pure-PyTorch twins)."""

from llmjp_ds.model.llama import DecoderLayer, Embedding, FinalNormHead, LlamaForCausalLM
from llmjp_ds.model.presets import MODEL_PRESETS, ModelPreset, model_config, pad_vocab_size

__all__ = ["LlamaForCausalLM", "DecoderLayer", "Embedding", "FinalNormHead", "MODEL_PRESETS", "ModelPreset",
           "model_config", "pad_vocab_size"]
