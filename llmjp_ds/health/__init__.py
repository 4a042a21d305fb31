"""Training health: what is judged, how it is rehearsed, and what a person reads afterwards.

* :mod:`.monitor`: loss and grad-norm spikes, non-finite steps and validation jumps, judged against their history
  (pure: the trainer hands values in and acts on the verdict);
* :mod:`.drills`: fault drills from the environment (NaN steps, planted spikes, an FP8 penalty) wrapping a step
  runner;
* :mod:`.report`: ``llmjp-ds health RUN``: a run's spikes, skips, rollbacks, precision and data changes as a table,
  and on its loss curve.

Which steps a rollback skips is the data room's (:mod:`llmjp_ds.data.batching`): a window of samples read and not
trained on.
"""
