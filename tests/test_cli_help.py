"""Every verb's ``--help`` says what the verb does in whole sentences: its description ends where a sentence ends
(a description cut from a docstring's first line stopped mid-sentence)."""

from __future__ import annotations

import importlib
import re

import pytest

from llmjp_ds.cli import VERBS

def description(verb: str, capsys) -> str:
    module = importlib.import_module(VERBS[verb][0])
    with pytest.raises(SystemExit) as done:
        module.cli_main(["--help"], verb=verb)
    assert done.value.code == 0
    text = capsys.readouterr().out
    body = re.split(r"\n(?:positional arguments|options):\n", text)[0]
    return " ".join(body.split("\n\n", 1)[1].split())  # the paragraph after the usage lines


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verbs_help_is_whole(verb, capsys):
    text = description(verb, capsys)
    assert text and text[-1] in ".)", text


def test_branch_says_what_it_leaves_as_it_is(capsys):
    assert description("branch", capsys).endswith("leaving the source run and its checkpoints as they are.")
