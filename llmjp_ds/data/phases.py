"""The samples a run reads, phase by phase: ``data.blend`` from step 0, each of ``data.phases`` from its
``start_step`` on (a decay branch with another mix, a mid-training phase).

Global sample ``i`` is read by the step whose batch holds it (:class:`~llmjp_ds.data.batch_schedule.BatchSchedule`), and
that step's phase gives the window:

* ``count: run`` (and ``data.blend`` itself): sample ``i`` of the phase's blend, built for the whole run's train
  samples, as Megatron-LM restarted with another ``--data-path`` builds its datasets for ``train_iters * gbs`` and
  reads on at its consumed-samples count;
* ``count: phase``: sample ``i - first`` of the phase's blend, built for the phase's own samples (``first``: the
  samples consumed before the phase), as Megatron-LM's ``--phase-transition-iterations``.

Every phase's validation reads its own blend's valid split, as Megatron's does after the restart. A phase's
datasets are built when a step of it first needs them; on several ranks every rank reaches that step together.
From plain arguments (a plan per phase): the trainer makes them from the run config (``trainer.run_data``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmjp_ds.data.batch_schedule import BatchSchedule
from llmjp_ds.data.plan import DataPlan


@dataclass
class Phase:
    start_step: int
    plan: DataPlan
    count: str  # run | phase
    first: int = 0  # the samples consumed before the phase's first step
    size: int = 0  # the train samples its datasets are built for
    built: tuple | None = None  # (train, valid) once a step needed them


class PhaseSamples:
    """One phase's train samples by global sample index (``ds[i]``: global sample ``i``'s window)."""

    def __init__(self, dataset, offset: int):
        self.dataset, self.offset = dataset, offset

    def __getitem__(self, i: int):
        return self.dataset[int(i) - self.offset]

    def __len__(self) -> int:
        return self.offset + len(self.dataset)


class RunData:
    """The run's train and valid samples across its data phases, each a :class:`DataPlan` (its blend opened and
    checked); the datasets are built as steps need them (``barrier``: the process group's, for the llmjp order's
    build on rank 0 first)."""

    def __init__(self, phases: list[tuple[int, DataPlan, str]], batches: BatchSchedule, train_samples: int,
                 valid_samples: int, seq_len: int, barrier=None):
        """``phases``: ``(start_step, plan, count)`` of data.blend (step 0) and each data phase; ``train_samples``:
        the run's (the datasets of a ``run`` phase are built for them all)."""
        self.batches, self.valid_samples, self.seq_len, self.barrier = batches, valid_samples, seq_len, barrier
        self.phases = [Phase(start, plan, count) for start, plan, count in phases]
        for this, after in zip(self.phases, self.phases[1:] + [None]):
            this.first = batches.consumed_at(this.start_step)
            end = train_samples if after is None else batches.consumed_at(after.start_step)
            this.size = train_samples if this.count == "run" else end - this.first

    @property
    def tokenizer_plan(self) -> DataPlan:
        return self.phases[0].plan

    def install_tokenizer(self, run_dir: Path) -> None:
        self.tokenizer_plan.install_tokenizer(run_dir)

    def phase_at(self, step: int) -> Phase:
        return [p for p in self.phases if p.start_step <= step][-1]

    def _datasets(self, phase: Phase) -> tuple:
        if phase.built is None:
            phase.built = phase.plan.build(self.seq_len, phase.size, self.valid_samples, barrier=self.barrier)
        return phase.built

    def train_at(self, step: int) -> PhaseSamples:
        """The train samples of ``step``'s phase, by global sample index."""
        phase = self.phase_at(step)
        return PhaseSamples(self._datasets(phase)[0], phase.first if phase.count == "phase" else 0)

    def valid_at(self, step: int):
        """The valid split of ``step``'s phase."""
        return self._datasets(self.phase_at(step))[1]

    def train_sample(self, i: int):
        """Global train sample ``i``'s window, from the phase of the step that reads it."""
        return self.train_at(self.batches.step_of_sample(i))[i]
