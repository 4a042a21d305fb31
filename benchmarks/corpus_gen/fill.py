"""A tiny template filler: ``{slot}`` draws from a word list, ``{slot.N}`` a form of a word with several forms.

A document binds some slots once (its protagonist, its city) so that its sentences talk about the same things;
every other slot is drawn afresh at each use. Deterministic for a given ``random.Random``.
"""

from __future__ import annotations

import random
import re
import string

_FIELD = re.compile(r"\{([a-z_0-9]+)(?:\.(\d))?\}")


class Filler:
    def __init__(self, vocab: dict, rng: random.Random, bound: dict | None = None):
        self.vocab, self.rng, self.bound = vocab, rng, dict(bound or {})

    def draw(self, slot: str):
        if slot in self.bound:
            return self.bound[slot]
        choices = self.vocab[slot]
        return choices(self.rng) if callable(choices) else self.rng.choice(choices)

    def bind(self, *slots: str) -> None:
        for slot in slots:
            self.bound[slot] = self.draw(slot)

    def __call__(self, template: str) -> str:
        def one(match: re.Match) -> str:
            value = self.draw(match.group(1))
            if isinstance(value, tuple):
                return value[int(match.group(2) or 0)]
            return str(value)

        return _FIELD.sub(one, template)

    def pick(self, templates: list[str], k: int, ordered: bool = False) -> list[str]:
        """``k`` distinct templates, filled; ``ordered`` keeps their list order (steps of a recipe)."""
        chosen = self.rng.sample(range(len(templates)), min(k, len(templates)))
        return [self(templates[i]) for i in (sorted(chosen) if ordered else chosen)]


def capitalize_first(text: str) -> str:
    for i, ch in enumerate(text):
        if ch in string.ascii_letters:
            return text[:i] + ch.upper() + text[i + 1:]
        if not ch.isspace() and ch not in "\"'(":
            return text
    return text
