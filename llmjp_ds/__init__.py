"""llmjp-ds: pretrain LLM-jp-style Llama models with DeepSpeed and Transformer Engine, BF16 -> FP8 mid-run."""

__version__ = "0.1.0"

__all__ = ["LlamaForCausalLM", "model_config", "MODEL_SHAPES"]


def __getattr__(name):  # keep `import llmjp_ds` light: torch and transformers load on first use
    if name in __all__:
        from llmjp_ds import model

        return getattr(model, name)
    raise AttributeError(name)
