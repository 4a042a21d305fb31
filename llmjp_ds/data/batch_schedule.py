"""The global batch of each step, as Megatron-LM's microbatch calculator gives it: constant, ramped up
(``--rampup-batch-size``), or changed at given steps. Pure arithmetic on step and sample counts; the samples each
rank reads of a step are :mod:`llmjp_ds.data.batching`'s.

Steps here are indices from 0 (step ``s`` starts after ``s`` steps); the config, the progress line and the records
number them from 1, as Megatron-LM's log does: the config's ``start_step: S`` is index ``S - 1``
(:func:`step_index`)."""

from __future__ import annotations

from dataclasses import dataclass

from llmjp_ds.errors import fail


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch of every step, as Megatron-LM's microbatch calculator gives it.

    ``global_batch``: ``train.global_batch_size`` (Megatron's ``--global-batch-size``), the batch after the ramp
    and before any change. ``rampup``: ``(start, increment, samples)``, Megatron's ``--rampup-batch-size``
    (megatron-core's ``RampupBatchsizeNumMicroBatchesCalculator``): while at most ``samples`` samples are consumed
    the batch is ``start + int(consumed / (samples / increments)) * increment``, then ``global_batch``.
    ``changes``: ``((first, batch), ...)``, increasing step indices: from index ``first`` on the batch is ``batch``
    (a run restarted after ``first`` iterations with another ``--global-batch-size``, or Megatron-Core 0.19's
    ``--step-batch-size-schedule`` with a threshold at the samples consumed before that step); a change at index 0
    replaces the start.
    """

    global_batch: int
    rampup: tuple[int, int, int] | None = None
    changes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, train_cfg) -> "BatchSchedule":
        ramp = train_cfg.batch_rampup
        return cls(train_cfg.global_batch_size, tuple(int(x) for x in ramp) if ramp else None,
                   tuple((step_index(c.start_step), c.global_batch_size) for c in train_cfg.batch_changes))

    @property
    def constant(self) -> bool:
        return self.rampup is None and not self.changes

    def _ramped(self, consumed: int) -> int:
        start, increment, samples = self.rampup
        if consumed > samples:
            return self.global_batch
        per_increment = samples / ((self.global_batch - start) // increment)
        return start + int(consumed / per_increment) * increment

    def batch(self, step: int, consumed: int) -> int:
        """The global batch of step ``step`` (counted from 0), which starts after ``consumed`` samples."""
        for start_step, batch in reversed(self.changes):
            if step >= start_step:
                return batch
        return self._ramped(consumed) if self.rampup else self.global_batch

    def sizes(self) -> list[int]:
        """Every global batch the schedule can give (each must divide into micro-batch x data parallel)."""
        out = [self.global_batch, *(b for _, b in self.changes)]
        if self.rampup:
            start, increment, _ = self.rampup
            out += range(start, self.global_batch, increment)
        return sorted(set(out))

    def _on_ramp(self, step: int, consumed: int) -> bool:
        return self.rampup is not None and consumed <= self.rampup[2] and not any(c <= step for c, _ in self.changes)

    def _runs(self, until_step: int):
        """``(first, end, batch)``: steps ``first .. end - 1`` of ``0 .. until_step - 1`` read ``batch`` samples
        each; a step at a time while the ramp is on, else up to the next change."""
        consumed, s = 0, 0
        while s < until_step:
            batch = self.batch(s, consumed)
            end = s + 1 if self._on_ramp(s, consumed) else min([c for c, _ in self.changes if c > s] + [until_step])
            yield s, end, batch
            consumed, s = consumed + batch * (end - s), end

    def consumed_at(self, step: int) -> int:
        """The samples consumed before step ``step`` (the sum of the batches of steps ``0 .. step - 1``)."""
        return sum(batch * (end - first) for first, end, batch in self._runs(step))

    def pieces(self, until_step: int) -> list[tuple[int, int]]:
        """``(first step, batch)`` of each run of equal batches among steps ``0 .. until_step - 1``: two schedules
        with the same pieces gave those steps the same batches."""
        out: list[tuple[int, int]] = []
        for first, _, batch in self._runs(until_step):
            if not out or out[-1][1] != batch:
                out.append((first, batch))
        return out

    def step_of_sample(self, sample: int) -> int:
        """The step that reads global sample ``sample``."""
        return self.step_at(sample + 1) - 1

    def step_at(self, consumed: int) -> int:
        """The step that starts after ``consumed`` samples (``consumed`` must fall on a step boundary)."""
        lo, hi = 0, 1
        while self.consumed_at(hi) < consumed:
            lo, hi = hi, hi * 2
        while lo < hi:  # the first step whose start is at or after consumed
            mid = (lo + hi) // 2
            if self.consumed_at(mid) < consumed:
                lo = mid + 1
            else:
                hi = mid
        return lo


def step_index(step: int) -> int:
    """The index from 0 of step ``step`` as the config, the progress line and the records number it (from 1)."""
    return step - 1


def check_batches(train_cfg, data_parallel: int) -> BatchSchedule:
    """``train``'s batch schedule, refused in one line where Megatron's calculator would assert or a batch would
    not split into micro-batches over ``data_parallel`` ranks."""
    t = train_cfg
    ramp = t.batch_rampup
    if ramp is not None:
        if len(ramp) != 3:
            fail(f"train.batch_rampup must be [start, increment, samples] (Megatron's --rampup-batch-size), got {ramp}")
        start, increment, _ = ramp
        if start >= t.global_batch_size or (t.global_batch_size - start) % increment:
            fail(f"train.batch_rampup {ramp} must ramp from a start below train.global_batch_size "
                 f"{t.global_batch_size} in whole increments: make global_batch_size - start a positive multiple of "
                 f"{increment}")
    starts = [c.start_step for c in t.batch_changes]
    if starts != sorted(set(starts)):
        fail(f"train.batch_changes start at steps {starts}: list each step once, in increasing order")
    if starts and starts[-1] > t.steps:
        fail(f"train.batch_changes changes the batch at step {starts[-1]}, but the run ends with step train.steps="
             f"{t.steps}: start it earlier or lengthen the run")
    schedule = BatchSchedule.of(t)
    unit = t.micro_batch_size * data_parallel
    for size in schedule.sizes():
        if size % unit:
            where = "train.global_batch_size" if size == t.global_batch_size else \
                ("train.batch_rampup" if ramp and size not in [c.global_batch_size for c in t.batch_changes]
                 else "train.batch_changes")
            fail(f"{where} gives a global batch of {size}, not divisible by micro_batch_size x data parallel = "
                 f"{t.micro_batch_size} x {data_parallel}: every batch of the schedule must be a multiple of {unit}")
    return schedule


def megatron_step_schedule(text: str, seq_length: int | None) -> list[tuple[int, int]]:
    """Megatron-Core 0.19's ``--step-batch-size-schedule`` ("THRESHOLD:BATCH ...", suffixes K, M, B, T) as
    ``[(threshold in samples, batch)]``, sorted: thresholds are tokens when Megatron-LM passes the sequence length
    (it always does), samples otherwise."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}

    def number(value: str) -> int:
        value = value.strip().upper()
        if value[-1:] in scale:
            return int(float(value[:-1]) * scale[value[-1]])
        return int(float(value))

    out = []
    for entry in text.strip().replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        if not sep:
            fail(f"step batch-size schedule entry {entry!r} is not THRESHOLD:BATCH (Megatron's "
                 "--step-batch-size-schedule)")
        out.append((number(threshold) // seq_length if seq_length else number(threshold), number(batch)))
    return sorted(out)


def changes_at_thresholds(entries: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``train.batch_changes`` (``(start_step, batch)``, steps from 1) of a schedule given by consumed-sample
    thresholds: each batch from the first step whose consumed samples reach its threshold, as megatron-core's step
    schedule picks it."""
    if not entries or entries[0][0] != 0:
        fail(f"a step batch-size schedule starts at threshold 0 (megatron-core asserts it), got {entries}")
    (_, batch), out = entries[0], [(1, entries[0][1])]
    step = consumed = 0
    for threshold, nxt in entries[1:]:
        steps = -(-(threshold - consumed) // batch)  # ceil: the first step starting at or after the threshold
        step, consumed, batch = step + steps, consumed + steps * batch, nxt
        out.append((step + 1, nxt))
    return tuple(out)
