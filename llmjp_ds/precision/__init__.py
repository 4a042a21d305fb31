"""Precision: BF16 -> FP8 in the middle of a run, and everything that decides about it.

* :mod:`.recipes`: the phases a run is configured with, TE's recipes, their checks;
* :mod:`.schedule`: :class:`PrecisionSchedule`, what each micro-batch runs in (autocast,
  calibration, the emulator's region), recipe switches during the run, and the precision state it attaches to
  the model once (the FP8 weight cache, the emulator);
* :mod:`.guards`: what watches FP8 once it runs (divergence, FP8's loss penalty);
* :mod:`.controller`: :class:`PrecisionController`, every FP8 decision (flip, ``recipe:
  auto``, penalty fallback, rollback to BF16), called by the trainer at fixed points of its loop;
* :mod:`.emulation`: FP8 with torch's float8 dtypes where TE cannot run (CPU);
* :mod:`.weight_cache`: the generation counter behind TE's FP8 weight reuse (the protocol
  the TE modules read is :mod:`llmjp_ds.model.weight_reuse`: ``model/`` imports nothing from here).

Nothing here imports DeepSpeed; validation losses reach the controller as functions.
"""
