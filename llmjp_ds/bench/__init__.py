"""``llmjp-ds bench``: training throughput on a GPU, ours beside the peers, measured in one run.

* :mod:`.run`: the verb: shapes and variants, the timed steps of the Trainer's own StepEngine, the table;
* :mod:`.peers`: what ours is measured against: Megatron-Core's GPTModel at its best single-GPU settings,
  transformers + DeepSpeed, plain TE layers;
* :mod:`.profile`: where a step's time goes: kernels by category, host time, synchronisations, idle gaps, clocks.
"""
