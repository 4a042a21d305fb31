"""The optimizer's room: AdamW as LLM-jp and Megatron-LM set it up, and the schedules it steps with.

* :mod:`.adamw`: AdamW's parameter groups (no weight decay on norms and biases), the LR and weight decay of a step
  put into them, and the skip of a non-finite step where DeepSpeed steps the optimizer itself;
* :mod:`.lr_schedule`: megatron-core's LR and weight-decay schedule as values and pure functions, its counts in the
  samples of the run's batch schedule, a resume's reconciliation, and the plan a person checks.

Import the modules themselves (``llmjp_ds.optim.lr_schedule`` needs no torch: the config check uses it).
"""
