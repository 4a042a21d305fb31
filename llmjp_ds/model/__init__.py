"""The model: an HF-compatible Llama built from Transformer Engine layers (or their pure-PyTorch twins).

The names below load on first use (PEP 562), so that config validation, which needs only ``shapes`` and
``backend``, does not pay for importing transformers' modeling code (seconds) before it can report a mistake.
"""

_LAZY = {
    "LlamaForCausalLM": "llama", "DecoderLayer": "llama", "Embedding": "llama", "FinalNormHead": "llama",
    "MODEL_SHAPES": "shapes", "ModelShape": "shapes", "model_config": "shapes", "pad_vocab_size": "shapes",
}

__all__ = ["LlamaForCausalLM", "DecoderLayer", "Embedding", "FinalNormHead", "MODEL_SHAPES", "ModelShape",
           "model_config", "pad_vocab_size"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"llmjp_ds.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'llmjp_ds.model' has no attribute {name!r}")
