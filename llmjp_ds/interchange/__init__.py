"""Checkpoints of other systems in and out: a run's checkpoint exported for Hugging Face, and Hugging Face and
Megatron-LM checkpoints made into runs of ours. The run's own checkpoints are :mod:`llmjp_ds.checkpoint`'s; the
model's own names and layouts (HF's Llama names, TP shards, pipeline layers) are
:mod:`llmjp_ds.model.hf_adapter`'s, which the parallel wiring uses too.

* :mod:`.hf`: ``llmjp-ds export`` (a checkpoint -> a plain ``model_type: llama`` directory, reloaded and checked)
  and ``llmjp-ds import-hf`` (an HF Llama checkpoint -> a new run directory);
* :mod:`.megatron`: ``llmjp-ds import-megatron``, a Megatron-LM run at iteration N -> a run of ours at step N;
* :mod:`.megatron_reader`: a Megatron-LM checkpoint directory of either format and any TP/PP/DP/EP layout, read
  whole;
* :mod:`.megatron_adapter`: Megatron-LM's weight names and layouts <-> ours (experts included), pure functions;
* :mod:`.megatron_moe`: a Megatron-Core MoE run's arguments: what is continued, where the experts live, what the
  run config must say;
* :mod:`.megatron_optim`: where Megatron's optimizers keep each parameter's master weight and Adam moments;
* :mod:`.megatron_dist_optim`: the optimizer state of a ``torch_dist`` checkpoint, per parameter and whole;
* :mod:`.dcp_reader`: a torch.distributed.checkpoint directory read without DCP's unpickling loader.
"""
