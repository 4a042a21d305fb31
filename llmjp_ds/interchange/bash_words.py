"""The words of a bash script's variables, read without running anything.

LLM-jp's Megatron-LM scripts build their arguments as bash arrays (``ALL_PARAMS+=(--lr 3e-4 ...)``) from variables
another script sets (``TRAIN_DATA_PATH=(...)``). :func:`read_variables` reads such a script as bash would assign
its variables, top to bottom: scalar and array assignments (``NAME=v``, ``NAME=(...)``, ``NAME+=(...)``, with
``export``/``declare``/``local``/``readonly``), comments, line continuations, quotes, ``$NAME``, ``${NAME}``,
``${NAME[@]}``, ``${NAME[i]}`` and ``${NAME:-default}``, and field splitting of unquoted expansions. Nothing of the
file runs: a command substitution (``$(...)``, backticks) or arithmetic (``$((...))``) is kept as a word that
*would* run code, a variable the files do not set as a word that names it, and an assignment inside a condition, a
loop or a function as a variable whose value the file decides when it runs. Each :class:`Word` says where it was
written and why it may not be taken as it reads (:attr:`Word.problem`); the caller decides what that means.
Commands other than assignments (``echo``, ``python - << EOF`` ... ``EOF``, ``source``) are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from llmjp_ds.errors import fail

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
DECLARE = ("export", "declare", "local", "readonly", "typeset")
# compound commands and their ends: an assignment between them depends on what the script finds when it runs
OPENERS = {"if": "fi", "for": "done", "while": "done", "until": "done", "select": "done", "case": "esac"}
SEPARATORS = (";", "&&", "||", "|", "&")


@dataclass(frozen=True)
class Word:
    """One word of a variable's value as bash would see it; ``problem``: why it cannot be taken as written (it would
    run code, names a variable the files do not set, or was assigned under a condition), else empty."""

    text: str
    where: str  # path:line
    problem: str = ""


@dataclass
class _Token:
    kind: str  # word | op | newline
    text: str  # an operator's text; a word's raw text (quotes kept)
    line: int
    parts: list = field(default_factory=list)  # a word's segments: (kind lit|var|code, text, quoted)


def _fail_syntax(path, line: int, what: str) -> None:
    fail(f"{path}:{line}: {what}: from-megatron reads bash without running it and cannot tell what this means; fix "
         "the file (bash -n checks its syntax)")


def _dollar(text: str, i: int, path, line: int) -> tuple[tuple, int]:
    """The segment a ``$`` at ``text[i]`` starts (a variable, code, or a lone ``$``) and where it ends."""
    if text.startswith("$((", i) or text.startswith("$(", i):
        depth, j = 0, i + 1
        while j < len(text):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                return ("code", text[i:j + 1]), j + 1
            j += 1
        _fail_syntax(path, line, f"an unclosed {text[i:i + 2]}")
    if text.startswith("${", i):
        end = text.find("}", i)
        if end < 0:
            _fail_syntax(path, line, "an unclosed ${")
        return ("var", text[i + 2:end]), end + 1
    m = NAME.match(text, i + 1)
    if m:
        return ("var", m.group()), m.end()
    if i + 1 < len(text) and text[i + 1] in "@*#?$!0123456789-":
        return ("var", text[i + 1]), i + 2
    return ("lit", "$"), i + 1


def _lex(text: str, path) -> list[_Token]:
    """bash's words and operators, with their lines; comments, line continuations and here-documents left out."""
    tokens: list[_Token] = []
    i, line, heredocs = 0, 1, []
    while i < len(text):
        c = text[i]
        if c == "\\" and text.startswith("\\\n", i):
            i, line = i + 2, line + 1
        elif c in " \t":
            i += 1
        elif c == "\n":
            tokens.append(_Token("newline", "\n", line))
            i, line = i + 1, line + 1
            for delimiter, strip in heredocs:  # here-documents start on the next line: skipped to their delimiter
                while i < len(text):
                    end = text.find("\n", i)
                    end = len(text) if end < 0 else end
                    body_line, i, line = text[i:end], end + 1, line + 1
                    if (body_line.lstrip("\t") if strip else body_line) == delimiter:
                        break
            heredocs = []
        elif c == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif text.startswith(("&&", "||", ";;"), i):
            tokens.append(_Token("op", text[i:i + 2], line))
            i += 2
        elif text.startswith("<<", i) and not text.startswith("<<<", i):
            strip = text.startswith("<<-", i)
            i += 3 if strip else 2
            while i < len(text) and text[i] in " \t":
                i += 1
            word, i, line = _word(text, i, path, line)
            heredocs.append(("".join(p[1] for p in word.parts), strip))
        elif c in ";|&()<>{}" and (c not in "{}" or _alone(text, i)):
            tokens.append(_Token("op", c, line))
            i += 1
        else:
            word, i, line = _word(text, i, path, line)
            tokens.append(word)
    return tokens


def _alone(text: str, i: int) -> bool:
    """A brace that bash reads as a reserved word: a word of its own."""
    before = text[i - 1] if i else " "
    after = text[i + 1] if i + 1 < len(text) else " "
    return before in " \t\n;" and after in " \t\n;"


def _word(text: str, i: int, path, line: int) -> tuple[_Token, int, int]:
    """The word starting at ``text[i]`` as segments (quotes resolved, ``$`` expansions kept as segments)."""
    token, start = _Token("word", "", line), i
    while i < len(text) and text[i] not in " \t\n;|&()<>":
        c = text[i]
        if c == "\\":
            if text.startswith("\\\n", i):
                i, line = i + 2, line + 1
                continue
            token.parts.append(("lit", text[i + 1:i + 2], True))
            i += 2
        elif c == "'":
            end = text.find("'", i + 1)
            if end < 0:
                _fail_syntax(path, line, "an unclosed single quote")
            token.parts.append(("lit", text[i + 1:end], True))
            line += text.count("\n", i, end)
            i = end + 1
        elif c == '"':
            i, line = _double_quoted(text, i + 1, token, path, line)
        elif c == "`":
            end = text.find("`", i + 1)
            if end < 0:
                _fail_syntax(path, line, "an unclosed backquote")
            token.parts.append(("code", text[i:end + 1], False))
            i = end + 1
        elif c == "$":
            (kind, value), end = _dollar(text, i, path, line)
            token.parts.append((kind, value, False))
            line += text.count("\n", i, end)
            i = end
        else:
            token.parts.append(("lit", c, False))
            i += 1
    token.text = text[start:i]
    return token, i, line


def _double_quoted(text: str, i: int, token: _Token, path, line: int) -> tuple[int, int]:
    """The segments of a double-quoted string from ``text[i]`` (after its quote); returns where it ends."""
    while i < len(text) and text[i] != '"':
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in '"\\$`\n':
            token.parts.append(("lit", "" if text[i + 1] == "\n" else text[i + 1], True))
            i += 2
        elif c == "$":
            (kind, value), i = _dollar(text, i, path, line)
            token.parts.append((kind, value, True))
        elif c == "`":
            end = text.find("`", i + 1)
            if end < 0:
                _fail_syntax(path, line, "an unclosed backquote")
            token.parts.append(("code", text[i:end + 1], True))
            i = end + 1
        else:
            line += c == "\n"
            token.parts.append(("lit", c, True))
            i += 1
    if i >= len(text):
        _fail_syntax(path, line, "an unclosed double quote")
    return i + 1, line


class Variables:
    """Variables as a script leaves them: name -> its words (a scalar has one). ``given``: values from the command
    line (``--var NAME=VALUE``), taken where the files do not set the name."""

    def __init__(self, given: dict[str, str] | None = None):
        self.values: dict[str, list[Word]] = {k: [Word(v, "--var")] for k, v in (given or {}).items()}

    def expand(self, token: _Token, where: str, split: bool = True) -> list[Word]:
        """The words ``token`` becomes: its expansions substituted, and (``split``: not in a scalar assignment) an
        unquoted expansion split at blanks, an array's ``[@]`` one word per element."""
        fields: list[list] = [[]]  # each field: (text, problem) pieces; a split starts a new field
        for kind, value, quoted in token.parts:
            if kind == "lit":
                fields[-1].append((value, ""))
            elif kind == "code":
                shown = " ".join(value.split())
                fields[-1].append((value, f"{shown if shown.startswith('`') else f'`{shown}`'} at {where} runs code"))
            else:
                for n, w in enumerate(self._lookup(value, where)):
                    pieces = w.text.split() if split and not quoted else [w.text]
                    for m, piece in enumerate(pieces or [""]):
                        if n or m:
                            if split:
                                fields.append([])
                            else:
                                fields[-1].append((" ", ""))
                        fields[-1].append((piece, w.problem))
        out = []
        for f in fields:
            text, problem = "".join(t for t, _ in f), next((p for _, p in f if p), "")
            if text or problem or any(q for *_, q in token.parts) or not split:
                out.append(Word(text, where, problem))
        return out

    def _lookup(self, expression: str, where: str) -> list[Word]:
        """The words of ``$expression`` (the inside of ``${...}``, or a name)."""
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[(@|\*|\d+)\])?(?:(:?-)(.*))?", expression, re.S)
        if not m:
            what = "is the script's argument, given when it runs" if expression in "@*#?$!-" or \
                expression.isdigit() else "is an expansion from-megatron does not evaluate"
            return [Word("", where, f"${{{expression}}} (at {where}) {what}")]
        name, index, default_op, default = m.groups()
        words = self.values.get(name)
        if words is None or (default_op == ":-" and not any(w.text for w in words)):
            if default_op:
                return [Word(default, where)]
            return [Word("", where, f"${name} (at {where}) is not set in these files (pass --var {name}=VALUE)")]
        if index in ("@", "*"):
            return list(words)
        return [words[int(index or 0)]] if int(index or 0) < len(words) else []


def read_variables(path, variables: Variables | None = None) -> Variables:
    """The variables of the bash script ``path`` after it ran (``variables``: those set before it), by its
    assignments alone; nothing of it runs."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {path} ({exc}): pass a bash script (UTF-8 text)")
    variables = variables or Variables()
    _Reader(path, variables).run(_lex(text, path))
    return variables


class _Reader:
    """The statements of a token stream, their assignments applied in order."""

    def __init__(self, path: Path, variables: Variables):
        self.path, self.vars = path, variables
        self.blocks: list[tuple[str, int]] = []  # open compound commands and function bodies: (its end, line)

    def run(self, tokens: list[_Token]) -> None:
        i = 0
        while i < len(tokens):
            i = self._statement(tokens, i)

    def _statement(self, tokens: list[_Token], i: int) -> int:
        """Apply the statement at ``tokens[i]``; returns where the next one starts."""
        t = tokens[i]
        if t.kind != "word":
            if t.text == "}" and self.blocks and self.blocks[-1][0] == "}":
                self.blocks.pop()
            return i + 1
        first = "".join(p[1] for p in t.parts if p[0] == "lit") if all(p[0] == "lit" for p in t.parts) else None
        if first in OPENERS:
            self.blocks.append((OPENERS[first], t.line))
            return self._skip_words(tokens, i + 1) if first in ("for", "select", "case") else i + 1
        if self.blocks and first == self.blocks[-1][0]:
            self.blocks.pop()
            return i + 1
        if first in ("then", "else", "elif", "do", "in"):
            return i + 1
        if first == "function" or (NAME.fullmatch(t.text) and i + 2 < len(tokens) and tokens[i + 1].text == "(" and
                                   tokens[i + 2].text == ")"):
            return self._function(tokens, i)
        j = i + 1 if first in DECLARE else i
        while j < len(tokens) and tokens[j].kind == "word" and tokens[j].text.startswith("-"):
            j += 1  # declare -a, export -n ...
        assigned = False
        while j < len(tokens) and tokens[j].kind == "word" and ASSIGNMENT.match(tokens[j].text):
            j, assigned = self._assign(tokens, j), True
        if assigned and (j >= len(tokens) or tokens[j].kind != "word"):
            return j
        return self._skip_words(tokens, i)  # a command (or assignments that only prefix one): nothing to apply

    def _skip_words(self, tokens: list[_Token], i: int) -> int:
        while i < len(tokens) and tokens[i].kind == "word":
            i += 1
        return i

    def _function(self, tokens: list[_Token], i: int) -> int:
        """A function definition: its body runs only when called, so its assignments are a condition's."""
        j = i + 1
        while j < len(tokens) and tokens[j].text != "{":
            j += 1
        self.blocks.append(("}", tokens[i].line))
        return j + 1

    def _assign(self, tokens: list[_Token], j: int) -> int:
        """``NAME=...``, ``NAME+=...``, ``NAME=(...)`` at ``tokens[j]``; returns the index after it."""
        t = tokens[j]
        m = ASSIGNMENT.match(t.text)
        name, append = m.group(1), bool(m.group(2))
        where = f"{self.path}:{t.line}"
        rest = _Token("word", t.text[m.end():], t.line, _strip_prefix(t.parts, m.end()))
        if not rest.text and j + 1 < len(tokens) and tokens[j + 1].text == "(":
            words, j = self._array(tokens, j + 2)
        else:
            words, j = self.vars.expand(rest, where, split=False)[:1] or [Word("", where)], j + 1
        words = [Word(w.text, w.where, f"{w.problem} to make the words of {name}") if w.problem.endswith("runs code")
                 else w for w in words]
        if self.blocks:
            end, line = self.blocks[-1]
            why = "a function body" if end == "}" else f"a block ({_OPENED[end]}) at line {line}"
            words = [Word(w.text, w.where, w.problem or f"{name} is set inside {why} of {self.path}, which decides its "
                                                        "value only when the script runs") for w in words] or \
                [Word("", where, f"{name} is set inside {why} of {self.path}")]
        self.vars.values[name] = (self.vars.values.get(name, []) if append else []) + words
        return j

    def _array(self, tokens: list[_Token], j: int) -> tuple[list[Word], int]:
        """The words of an array's ``( ... )`` from ``tokens[j]``; returns them and the index after ``)``."""
        words = []
        while j < len(tokens) and tokens[j].text != ")":
            t = tokens[j]
            if t.kind == "word":
                index = re.match(r"\[\d+\]=", t.text)  # declare -p's ([0]="..." [1]="...")
                if index:
                    t = _Token("word", t.text[index.end():], t.line, _strip_prefix(t.parts, index.end()))
                words += self.vars.expand(t, f"{self.path}:{t.line}")
            elif tokens[j].kind == "op":
                _fail_syntax(self.path, tokens[j].line, f"{tokens[j].text!r} inside an array's ( )")
            j += 1
        if j >= len(tokens):
            _fail_syntax(self.path, tokens[-1].line if tokens else 1, "an array's ( is never closed")
        return words, j + 1


_OPENED = {"fi": "if ... fi", "done": "a loop", "esac": "case ... esac"}


def _strip_prefix(parts: list, chars: int) -> list:
    """``parts`` less the first ``chars`` literal characters (an assignment's ``NAME=``)."""
    out, left = [], chars
    for kind, value, quoted in parts:
        if left and kind == "lit":
            take = min(left, len(value))
            value, left = value[take:], left - take
            if not value:
                continue
        out.append((kind, value, quoted))
    return out
