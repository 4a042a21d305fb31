"""How a run ends early with one line: a health verdict whose action is stop, one rollback more than the limit,
non-finite steps in a row. Each leaves a ``stop`` event in the record
first (where the record can still be written), so ``llmjp-ds health`` shows that the run stopped and why, and a
resume keeps it."""

from __future__ import annotations

from typing import NoReturn

from llmjp_ds.errors import fail
from llmjp_ds.health.monitor import Verdict


def stop(logger, step: int, line: str, latest: str | None) -> NoReturn:
    """End the run with ``line``, after a ``stop`` event at ``step`` that records it and the latest checkpoint."""
    logger.event(step, "stop", reason=line, latest=latest)
    fail(line)


def verdict_line(verdict: Verdict, latest: str | None) -> str:
    """The line of a verdict whose configured action is stop."""
    key = f"health.{verdict.kind}{'.action' if verdict.kind != 'nonfinite' else ''}"
    return (f"{verdict.describe()}; {key} is stop: the run ends here, and {latest or 'no checkpoint'} is its latest "
            "checkpoint; look at the data around it, or choose another action")


def rollback_limit_line(verdict: Verdict, health) -> str:
    """The line of a spike that would be one rollback more than ``health.max_rollbacks`` allows."""
    return (f"{verdict.describe()}, one rollback more than health.max_rollbacks={health.max_rollbacks} within "
            f"health.rollback_window={health.rollback_window} steps: the run stops rather than loop; look at the "
            "data or lower optim.lr, then resume (or raise health.max_rollbacks)")


def nonfinite_line(in_a_row: int, step: int) -> str:
    return (f"{in_a_row} consecutive steps had non-finite loss or gradients (last: step {step}); a checkpoint was "
            "saved. Lower optim.lr or check the data, then resume")
