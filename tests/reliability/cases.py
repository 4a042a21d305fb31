"""The bad-input catalogue's vocabulary: a :class:`Case` and the helpers that spell its command line.

A case runs one command (a real CLI subprocess), and the harness (``test_bad_inputs.py``) asserts: a non-zero
exit, exactly one ``error: ...`` line on stderr containing the expected fragments, no traceback, and every file
that existed under the catalogue's directories byte-identical afterwards. Topic modules (``cases_data.py``,
``cases_config.py``, ``cases_checkpoint.py``, ``cases_cluster.py``) each hold ``CASES`` and a ``prepare(ctx)``
that writes their inputs under ``ctx.tmp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Case:
    id: str
    argv: object  # (ctx) -> list of arguments after the interpreter
    expect: tuple  # fragments the error line must contain
    env: dict = field(default_factory=dict)
    trains: bool = False  # a training start: must fail before DeepSpeed/process groups
    after_start: bool = False  # a training refused only once its process group exists (a checkpoint's content)
    cwd: str | None = None  # the working directory ({tmp} ...; default: the repository)


def sub(text, c) -> str:
    """``{tmp}``, ``{tok}``, ``{run}`` -> the catalogue's directories."""
    return str(text).replace("{tmp}", str(c.tmp)).replace("{tok}", str(c.tok)).replace("{run}", str(c.run))


def T(*sets, run="{tmp}/run-new"):
    """``python -m llmjp_ds.train`` with these --set values (by default a fresh run_dir that must stay absent)."""
    def argv(c):
        out = ["-m", "llmjp_ds.train", "--set", f"run_dir={sub(run, c)}"]
        for s in sets:
            out += ["--set", sub(s, c)]
        return out
    return argv


def L(*args):
    """``llmjp-ds <verb> ...`` (python -m llmjp_ds.cli, the console script's module)."""
    return lambda c: ["-m", "llmjp_ds.cli", *[sub(a, c) for a in args]]



FP8 = "precision.phases=[{precision: bf16}, {precision: fp8, start_step: 5}]"
SMALL = "model.overrides={hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, " \
        "ffn_hidden_size: 128}"
