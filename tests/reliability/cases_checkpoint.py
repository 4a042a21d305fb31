"""Bad inputs of the catalogue, checkpoints: resume, export, import, run directories."""

from __future__ import annotations

from tests.reliability.cases import Case, L, T  # noqa: F401

CASES: list[Case] = []


def prepare(ctx) -> None:
    """Write this topic's inputs under ``ctx.tmp``."""
