"""A run config from its sources: a preset (:mod:`.presets`), a YAML or JSON file, ``--set key=value`` overrides,
merged in that order and built into :class:`~llmjp_ds.config.schema.RunConfig` by pydantic. Every mistake is one
line naming the key and the fix: an unknown key (with the nearest name), a renamed one, a wrong type, a file that
does not parse, a key given twice. :func:`add_config_args` is the one definition of ``--config/--preset/--set``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from llmjp_ds.config.presets import RUN_PRESETS, preset_dict
from llmjp_ds.config.schema import RunConfig
from llmjp_ds.errors import UserError, did_you_mean, fail

# keys of earlier releases -> their names now
RENAMED = {"model.preset": "model.shape", "train.inject_nan_steps": None, "train.inject_only_fp8": None,
           "model.activation_checkpointing": "model.recompute"}


def _type_name(annotation) -> str:
    """``int``, ``float or null``, ``list[float or str]``, ``PhaseConfig``: an annotation as a message says it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _members(annotation) -> tuple:
    """The types a value of ``annotation`` may be (a union's members; ``Annotated`` unwrapped)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(m for a in typing.get_args(annotation) for m in _members(a))
    return (annotation,)


def _walk(loc: tuple) -> list[tuple[str, Any]]:
    """``(where, annotation)`` of each step of pydantic's error location through :class:`RunConfig`, ``where``
    spelled as a key (``precision.phases[0].candidates``); a union member's tag ends the walk."""
    steps, where, annotation = [("", RunConfig)], "", RunConfig
    for part in loc:
        members = _members(annotation)
        if isinstance(part, int):
            lists = [m for m in members if typing.get_origin(m) is list]
            if not lists:
                break
            where, annotation = f"{where}[{part}]", typing.get_args(lists[0])[0]
        else:
            classes = [m for m in members if dataclasses.is_dataclass(m)]
            if not classes:
                break  # a union member's tag (``str``, ``list[any]``): the error is the union's
            where = f"{where}.{part}" if where else part
            annotation = typing.get_type_hints(classes[0]).get(part)
        steps.append((where, annotation))
    return steps


def _fields(annotation) -> list[str]:
    return [f.name for m in _members(annotation) if dataclasses.is_dataclass(m) for f in dataclasses.fields(m)]


def _one_line(error: dict) -> str:
    """pydantic's error as our one line."""
    kind, value = error["type"], error.get("input")
    steps = _walk(error["loc"])
    if kind == "unexpected_keyword_argument":
        (parent, parent_type), (where, _) = steps[-2], steps[-1]
        _renamed(where)
        key = where.rsplit(".", 1)[-1]
        return f"unknown config key {where!r}{did_you_mean(key, _fields(parent_type))}"
    where, annotation = steps[-1]
    if kind in ("missing_argument", "missing"):
        parent = where.rpartition(".")[0] or "<root>"
        name = where.rpartition(".")[2]
        return f"config section {parent} lacks {name}: set {name}: <value> there"
    if kind in ("dataclass_type", "dataclass_args_type"):
        return f"config section {where or '<root>'} must be a mapping, got {type(value).__name__}"
    if kind == "too_short":
        return f"{where} must be a non-empty list of {_type_name(typing.get_args(_members(annotation)[0])[0])} " \
               "mappings"
    if len(steps) > 1 and where.endswith("]"):
        parent, parent_type = steps[-2]
        return f"config key {where!r} must be {_type_name(annotation)} (an item of {parent}, a " \
               f"{_type_name(parent_type)}), got {value!r}"
    return f"config key {where!r} must be {_type_name(annotation)}, got {value!r}"


def _renamed(where: str) -> None:
    if where in RENAMED:
        now = RENAMED[where]
        if where == "model.activation_checkpointing":
            fail("config key 'model.activation_checkpointing' was replaced by 'model.recompute': use "
                 "model.recompute=full (was true), none (was false) or selective (the attention core only)")
        fail(f"config key {where!r} was renamed {now!r}: use {now}" if now else
             f"config key {where!r} was removed (fault drills are set by LLMJP_DS_DRILL_*, see docs/errors.md)")


def _names_only(data, where: str = "") -> None:
    """Every key of ``data`` is a name (a ``--set`` value of YAML flow style may hold ``{1: 2}``)."""
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(key, str):
                fail(f"config key {key!r} {'in ' + where if where else 'at the top level'} is not a name (it is "
                     f"{type(key).__name__}): config keys are names such as optim or lr")
            _names_only(value, f"{where}.{key}" if where else key)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            _names_only(item, f"{where}[{i}]")


@functools.cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(RunConfig)


def build_config(data: dict) -> RunConfig:
    """:class:`RunConfig` from a nested dict, by its annotations: an unknown key, a wrong type or a section that is
    not a mapping is one line. Validated in pydantic's JSON mode, where strict types still take a mapping for a
    section: a bool is not an int, a string is not a number, an int is a float."""
    if not isinstance(data, dict):
        fail(f"config section <root> must be a mapping, got {type(data).__name__}")
    _names_only(data)
    try:
        return _adapter().validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as exc:
        fail(_one_line(exc.errors()[0]))


def merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_value(text: str) -> Any:
    if not text.strip():
        return text  # `key=` sets an empty string (YAML would read null); `key=null` unsets
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        return float(value)  # YAML 1.1 reads 1e-4 (no dot in the mantissa) as a string
    return value


def apply_set(data: dict, assignment: str) -> dict:
    """``a.b.c=value`` -> nested dict update (value parsed as YAML: numbers, bools, lists, null)."""
    if "=" not in assignment:
        fail(f"--set {assignment!r} must look like key=value, e.g. optim.lr=1e-4")
    key, _, raw = assignment.partition("=")
    parts = [part.strip() for part in key.split(".")]
    if not all(parts):
        fail(f"--set {assignment!r}: the key {key.strip()!r} has an empty name between its dots: write it as "
             "section.name=value, e.g. optim.lr=1e-4")
    update: dict = {}
    node = update
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = parse_value(raw)
    return merge(data, update)


def load_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        fail(f"config file {path} does not exist: pass the path of a YAML or JSON run config (or use --preset)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read config file {path} ({exc}): pass a UTF-8 YAML or JSON file")
    if text.startswith("\ufeff"):
        fail(f"config file {path} starts with a byte-order mark (BOM): save it as UTF-8 without a BOM")
    try:
        if path.suffix == ".json":
            data = json.loads(text) if text.strip() else None
            if data is not None:
                _check_json_keys(text, path)
        else:
            data = _load_yaml(text, path)
    except UserError:
        raise
    except Exception as exc:  # yaml / json syntax errors
        mark = getattr(exc, "problem_mark", None)  # yaml: where; json: msg + lineno/colno
        tag = re.search(r"constructor for the tag '([^']*)'", str(getattr(exc, "problem", "")))
        if tag and mark is not None:
            fail(f"config file {path}: the YAML tag {tag[1].replace('tag:yaml.org,2002:', '!!')} at line "
                 f"{mark.line + 1} is not allowed: a run config holds plain values (numbers, strings, lists, "
                 "mappings); remove the tag")
        if mark is not None:
            where = f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]} at line {mark.line + 1}, column " \
                    f"{mark.column + 1}"
        elif isinstance(exc, json.JSONDecodeError):
            where = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        else:
            where = str(exc).splitlines()[0]
        fail(f"cannot parse config file {path}: {where}; fix the syntax there")
    if data is None:
        fail(f"config file {path} is empty (no settings, only blank lines or comments): put the run's settings in "
             "it (see the presets in llmjp_ds/config/presets.py), or leave out --config")
    if not isinstance(data, dict):
        fail(f"config file {path} holds a {type(data).__name__}, not a mapping of sections (run_dir, model, data, "
             "optim, train, ...): see the presets in llmjp_ds/config/presets.py")
    return data


def _duplicate_key(path: Path, where: str, first: int, second: int) -> None:
    fail(f"config file {path}: key {where!r} is given twice, at lines {first} and {second} (the last would "
         "silently win): keep one")


def _load_yaml(text: str, path: Path):
    """``yaml.safe_load``, refusing a key given twice in one mapping and keys that are not strings."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_keys(node, path, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_yaml_keys(node, path: Path, where: str, visited: set) -> None:
    if id(node) in visited:  # an alias: checked where its anchor is
        return
    visited.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_yaml_keys(item, path, f"{where}[{i}]", visited)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys beside it override, as YAML means
                continue
            line = key.start_mark.line + 1
            if not (isinstance(key, yaml.ScalarNode) and key.tag == "tag:yaml.org,2002:str"):
                kind = key.tag.rsplit(":", 1)[-1]
                shown = key.value if isinstance(key, yaml.ScalarNode) else f"<a {kind}>"
                fail(f"config file {path}, line {line}: the key {shown} {'in ' + where if where else 'at the top'} "
                     f"is a YAML {kind}, not a name: config keys are names such as optim or lr")
            name = f"{where}.{key.value}" if where else key.value
            if key.value in lines:
                _duplicate_key(path, name, lines[key.value], line)
            lines[key.value] = line
            _check_yaml_keys(value, path, name, visited)


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+')


def _check_json_keys(text: str, path: Path) -> None:
    """A key given twice in one object of (valid) JSON, with both lines; ``json.loads`` would keep the last."""
    stack: list[dict] = []  # open objects and arrays: where they are and what they hold so far
    line, last = 1, 0
    for m in _JSON_TOKEN.finditer(text):
        line, last = line + text.count("\n", last, m.start()), m.start()
        tok, top = m.group(), stack[-1] if stack else None
        if tok in "{[":
            inner = "" if top is None else (f"{top['where']}[{top['index']}]" if top["kind"] == "[" else
                                            (f"{top['where']}.{top['key']}" if top["where"] else top["key"]))
            stack.append({"kind": tok, "where": inner, "index": 0, "seen": {}, "key": None, "expect_key": True})
        elif tok in "}]":
            stack.pop()
        elif tok == ":" and top:
            top["expect_key"] = False
        elif tok == "," and top:
            top["expect_key"], top["index"] = True, top["index"] + 1
        elif tok.startswith('"') and top and top["kind"] == "{" and top["expect_key"]:
            key = json.loads(tok)
            if key in top["seen"]:
                _duplicate_key(path, f"{top['where']}.{key}" if top["where"] else key, top["seen"][key], line)
            top["seen"][key], top["key"] = line, key


def load_config(path: str | Path | None = None, sets: list[str] = (), preset: str | None = None) -> RunConfig:
    """Preset (from ``preset``, the file's ``preset:`` key, or ``demo``) <- file <- ``--set`` overrides."""
    data = load_file(path) if path else {}
    named = data.pop("preset", None)
    if named is not None and not (isinstance(named, str) and named.strip()):
        fail(f"config file {path}: preset must name a run preset ({', '.join(RUN_PRESETS)}), got {named!r}")
    if preset and named and preset != named:
        fail(f"--preset {preset} and the preset: {named} of config file {path} disagree: keep one")
    data = merge(preset_dict(preset or named or "demo", "" if preset or not named else f" named in {path}"), data)
    for assignment in sets:
        data = apply_set(data, assignment)
    return build_config(data)


def add_config_args(p: argparse.ArgumentParser, config: str | None = "run config (YAML or JSON); may name a "
                    "preset with `preset:`", preset: bool = True, example: str = "optim.lr=1e-4") -> None:
    """``--config`` (``config`` its help; None: not taken), ``--preset`` and ``--set`` on ``p``, as every verb that
    takes a run config spells them."""
    if config:
        p.add_argument("--config", help=config)
    if preset:
        p.add_argument("--preset", help=f"run preset: {', '.join(RUN_PRESETS)}")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config value (repeatable), e.g. --set {example}")


def config_from_args(a: argparse.Namespace) -> RunConfig:
    """The run config :func:`add_config_args`'s flags name."""
    return load_config(getattr(a, "config", None), a.sets, getattr(a, "preset", None))
