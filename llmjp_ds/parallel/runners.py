"""Step runners: one interface over DeepSpeed's two engines, so the training loop never asks which it has.

A runner runs one optimizer step (forward and backward of every micro-batch, then DeepSpeed's optimizer step)
and one evaluation, each micro-batch's forward inside the precision schedule's ``micro_batch()`` context, and
returns the losses reduced over all ranks as device tensors (nothing here waits for the GPU):

* :class:`EngineRunner`: the ZeRO engine (no pipeline). The runner drives the micro-batches itself.
* :class:`PipelineRunner`: DeepSpeed's pipeline engine, which drives them in its 1F1B schedule; the pipeline
  module enters the precision context per micro-batch and the last stage's loss function keeps the parts.

A step is asked with ``gate`` (or None): when given, it is asked with the step's mean loss over every rank before
the last micro-batch's backward, and True skips the update (that backward is taken of a NaN loss, so DeepSpeed's
optimizer, which skips non-finite gradients, leaves the weights and its state as they are; the reported loss stays
the real one, no gradient norm is reported, and DeepSpeed's overflow notice for it is not printed). ``loss_scale``
multiplies the loss (1; NaN or a planted spike in a fault drill, :mod:`llmjp_ds.health.drills`), and ``grad_scale``
the loss only where it makes the gradients (a planted gradient spike). A step returns a :class:`StepResult`.
``beat(phase)`` is called as each phase of the step starts (the trainer hands its watchdog's,
:mod:`llmjp_ds.launch.failure`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from llmjp_ds.parallel.context import ParallelContext
from llmjp_ds.parallel.deepspeed_internals import local_layers, set_stage_forward_context


def _no_watchdog(phase: str) -> None:
    pass


@dataclass(frozen=True)
class Routing:
    """What an MoE model's routers did in a step: the load-balancing and router z-losses (coefficient-free, the
    mean over the MoE layers and every rank's micro-batches), the choices dropped over capacity, and the tokens
    that chose each expert (``expert_load [MoE layers][E]``, summed over every rank's micro-batches)."""

    aux_loss: float
    z_loss: float
    dropped: int
    expert_load: list


@dataclass(frozen=True)
class StepValues:
    """One step as the trainer reads it: the mean losses over every rank's micro-batches, whether the gate skipped
    the update, whether the optimizer applied it (not skipped, its gradients finite), the gradient norm (None
    where the gate skipped the update: there was none to measure), and an MoE model's :class:`Routing` (None for a
    dense model)."""

    lm_loss: float
    z_loss: float
    gated: bool
    applied: bool
    grad_norm: float | None
    routing: Routing | None = None


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step returns, nothing waited for: ``losses`` on the device (``[lm_loss, z_loss,
    gated]``), the engine whose optimizer :meth:`read` asks the rest of, an MoE model's routing (``[aux, z,
    dropped]`` and the expert loads, on the device), and DeepSpeed's overflow notices held while a gate could skip
    the update."""

    losses: torch.Tensor
    engine: object
    routing: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    held: tuple = ()

    def read(self) -> StepValues:
        """The step's values (this waits for the device); the overflow notices held are printed unless the gate
        skipped the update."""
        lm_loss, z_loss, gated = self.losses.tolist()
        if gated:
            return StepValues(lm_loss, z_loss, True, False, None, self._routing())
        release_notices(self.held)
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else float(norm.item() if hasattr(norm, "item") else norm)
        return StepValues(lm_loss, z_loss, False, self.engine.was_step_applied(), norm, self._routing())

    def _routing(self) -> Routing | None:
        if self.routing is None:
            return None
        aux, rz, dropped = self.routing.tolist()
        return Routing(aux, rz, int(dropped), self.expert_load.long().tolist())


class StepRunner:
    def __init__(self, engine, precision, ctx: ParallelContext, beat=_no_watchdog):
        self.engine, self.precision, self.ctx, self.beat = engine, precision, ctx, beat

    def train_step(self, batches, gate=None, loss_scale: float = 1.0, grad_scale: float = 1.0) -> StepResult:
        """Forward/backward over ``batches`` (this rank's micro-batches) and the optimizer step."""
        raise NotImplementedError

    def eval_loss(self, batches) -> torch.Tensor:
        """The mean lm_loss over ``batches`` of all data-parallel ranks, without gradients, as ``[1]``."""
        raise NotImplementedError


class EngineRunner(StepRunner):
    def train_step(self, batches, gate=None, loss_scale: float = 1.0, grad_scale: float = 1.0) -> StepResult:
        with _held_if(gate) as held:
            losses, routing, loads = self._train_step(batches, gate, loss_scale, grad_scale)
        return StepResult(losses, self.engine, routing, loads, tuple(held))

    def _train_step(self, batches, gate, loss_scale: float, grad_scale: float):
        parts, skipped, routing, loads = None, 0.0, None, None
        for m, (input_ids, targets) in enumerate(batches):
            self.beat("forward")
            with self.precision.micro_batch():
                out = self.engine(input_ids=input_ids, shift_labels=targets)
            micro = torch.stack([out.lm_loss.detach() * loss_scale, out.z_loss.detach()]).float()
            parts = micro if parts is None else parts + micro
            if getattr(out, "expert_load", None) is not None:
                routed = torch.stack([out.router_aux_loss, out.router_z_loss, out.dropped_tokens.float()]).float()
                routing = routed if routing is None else routing + routed
                loads = out.expert_load if loads is None else loads + out.expert_load
            scale = loss_scale * grad_scale
            last = m == len(batches) - 1
            if last and gate is not None and gate(self._mean(parts, len(batches))[0].item()):
                scale, skipped = float("nan"), 1.0
            self.beat("backward")
            self.engine.backward(out.loss * scale)
            if last:
                self.beat("optimizer")
            self.engine.step()
        mean = self._mean(parts, len(batches))
        if routing is not None:  # the losses' means, the drops' and loads' sums over every rank's micro-batches
            tensor = self.ctx.layout.tensor  # a TP group's ranks route the same tokens: counted once
            routing = self._mean(routing * routing.new_tensor([1.0, 1.0, len(batches) * self.ctx.dp_size]),
                                 len(batches))
            loads = self.ctx.all_reduce(loads.float() / tensor)
        return torch.cat([mean, mean.new_tensor([skipped])]), routing, loads

    def _mean(self, parts: torch.Tensor, count: int) -> torch.Tensor:
        """The mean over every rank's ``count`` micro-batches of the summed ``parts``."""
        return self.ctx.all_reduce(parts / count / self.ctx.loss_copies)

    def eval_loss(self, batches) -> torch.Tensor:
        self.engine.eval()
        total = torch.zeros((), device=self.ctx.device)
        with torch.no_grad():
            for input_ids, targets in batches:
                with self.precision.micro_batch():
                    total += self.engine(input_ids=input_ids, shift_labels=targets).lm_loss.float()
        self.engine.train()
        return self.ctx.all_reduce((total / (len(batches) * self.ctx.loss_copies)).reshape(1))


class PipelineRunner(StepRunner):
    """``moe``: an MoE model's ``(MoE layers, experts)``, or None. Each stage trains its MoE layers' routers through
    their outputs' backward (``model/pipeline_layers.DecoderLayerPipe``, each given the gradient its router losses
    would get as a term of the step's loss) and adds up what they routed after each forward of a micro-batch; the
    step's :class:`Routing` is the sum over the stages and data-parallel ranks."""

    def __init__(self, engine, precision, ctx: ParallelContext, loss, beat=_no_watchdog, moe=None):
        super().__init__(engine, precision, ctx, beat)
        self.loss, self.moe = loss, moe
        self.moe_layers = [layer for _, layer in local_layers(engine.module)
                           if getattr(layer, "moe_index", None) is not None]
        self.routed = None
        set_stage_forward_context(engine, self._micro_batch)

    def _micro_batch(self):
        """The stage's forward of one micro-batch; after it the stage's 1F1B schedule goes on to backward work."""
        self.beat("forward")
        return _BeatOnExit(self.precision.micro_batch(), self._after_forward)

    def _after_forward(self):
        if self.routed is not None and self.engine.module.training:
            for layer in self.moe_layers:  # [aux, z, dropped, the loads of every MoE layer ...]
                r = layer.moe.routed
                self.routed[:3] += torch.stack([r.aux_loss, r.z_loss, r.dropped.float()]).float()
                self.routed[3:].view(self.moe)[layer.moe_index] += r.tokens_per_expert.float()
        self.beat("backward")

    def train_step(self, batches, gate=None, loss_scale: float = 1.0, grad_scale: float = 1.0) -> StepResult:
        self.loss.reset(len(batches), gate, self.ctx, loss_scale, grad_scale)
        if self.moe is not None:
            self.routed = torch.zeros(3 + self.moe[0] * self.moe[1], device=self.ctx.device)
            for layer in self.moe_layers:  # DeepSpeed divides the last stage's loss by the micro-batches
                layer.router_loss_scale = loss_scale * grad_scale / len(batches)
        with _held_if(gate) as held:
            self.engine.train_batch(data_iter=iter(batches))
        parts = torch.zeros(3, device=self.ctx.device)
        if self.engine.is_last_stage():
            parts[:2] += torch.stack([torch.as_tensor(self.loss.lm_loss_sum, device=self.ctx.device),
                                      torch.as_tensor(self.loss.z_loss_sum, device=self.ctx.device)]).float()
            parts[:2] /= self.loss.micro_batches * self.ctx.loss_copies
            parts[2] = float(self.loss.skipped)  # the gate ran on the last stage: every rank learns its answer
        routing = loads = None
        if self.moe is not None:  # the losses' means over the MoE layers and every rank's micro-batches
            routed = self.ctx.all_reduce(self.routed)
            routing = routed[:3] / routed.new_tensor([self.moe[0] * len(batches) * self.ctx.dp_size] * 2 + [1])
            loads, self.routed = routed[3:].view(self.moe), None
        return StepResult(self.ctx.all_reduce(parts), self.engine, routing, loads, held=tuple(held))

    def eval_loss(self, batches) -> torch.Tensor:
        self.engine.eval()
        with torch.no_grad():
            self.loss.reset(len(batches))
            self.engine.eval_batch(data_iter=iter(batches), num_micro_batches=len(batches))
            value = torch.tensor([float(self.loss.lm_loss_sum) / max(1, self.loss.micro_batches) / self.ctx.loss_copies
                                  if self.engine.is_last_stage() else 0.0], device=self.ctx.device)
        self.engine.train()
        return self.ctx.all_reduce(value)


# DeepSpeed 0.19.8 runtime/fp16/loss_scaler.py logs this through deepspeed.utils.logger on a skipped step
OVERFLOW_NOTICE = "[deepspeed] OVERFLOW!"


class _HeldNotices(logging.Filter):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if OVERFLOW_NOTICE in record.getMessage():
            self.records.append(record)
            return False
        return True


@contextlib.contextmanager
def overflow_notices_held():
    """DeepSpeed's overflow notices logged inside are held back, in the list this yields: :func:`release_notices`
    prints them once the step is known to have overflowed (a skip the gate asked for is no overflow)."""
    from deepspeed.utils import logger

    held = _HeldNotices()
    logger.addFilter(held)
    try:
        yield held.records
    finally:
        logger.removeFilter(held)


def release_notices(records) -> None:
    """Print the notices :func:`overflow_notices_held` held, as DeepSpeed would have."""
    from deepspeed.utils import logger

    for record in records:
        logger.handle(record)


def _held_if(gate):
    """DeepSpeed's overflow notices held while ``gate`` may skip the update (nothing held without a gate)."""
    return overflow_notices_held() if gate is not None else contextlib.nullcontext([])


class _BeatOnExit:
    def __init__(self, inner, on_exit):
        self.inner, self.on_exit = inner, on_exit

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        result = self.inner.__exit__(*exc)
        self.on_exit()
        return result


def make_runner(engine, precision, ctx: ParallelContext, pipeline_loss=None, beat=_no_watchdog,
                moe=None) -> StepRunner:
    """``moe``: an MoE model's ``(MoE layers, experts)`` (the pipeline runner sums the stages' routing)."""
    if pipeline_loss is not None:
        return PipelineRunner(engine, precision, ctx, pipeline_loss, beat, moe)
    return EngineRunner(engine, precision, ctx, beat)
