"""`--set` values: YAML scalars, and the float spellings YAML 1.1 leaves as strings; what a config makes the
run read."""

from llmjp_ds.config import load_config, parse_value


def test_exponent_floats_without_a_dot_are_floats():
    assert parse_value("1e-4") == 1e-4 and isinstance(parse_value("1e-4"), float)
    assert parse_value("-2E+5") == -2e5
    assert load_config(None, ["optim.lr=1e-4"]).optim.lr == 1e-4


def test_other_values_keep_their_yaml_type():
    assert parse_value("1.5e-3") == 1.5e-3
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("true") is True
    assert parse_value("run1e5x") == "run1e5x"
    assert parse_value("inf") == "inf"  # a name, not a number
    assert load_config(None, ["logging.run_name=e5"]).logging.run_name == "e5"


def test_a_run_without_validation_reads_no_valid_samples():
    from llmjp_ds.config import sample_counts

    base = ["train.steps=10", "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_batches=3"]
    assert sample_counts(load_config(None, base + ["train.eval_interval=0"])) == (80, 0)
    assert sample_counts(load_config(None, base + ["train.eval_interval=5"])) == (80, 24)
    assert sample_counts(load_config(None, base + ["train.eval_interval=5", "train.eval_batches=0"])) == (80, 8)


def test_the_megatron_order_asks_for_megatron_lm_sizes():
    """get_train_valid_test_num_samples: train_iters * gbs, (train_iters // eval_interval + 1) * eval_iters * gbs,
    eval_iters * gbs; the llmjp3 presets read Megatron's order, the demo its own."""
    from llmjp_ds.config import megatron_sample_counts, sample_counts

    base = ["data.order=megatron", "train.steps=10", "train.global_batch_size=8", "train.eval_batches=3"]
    cfg = load_config(None, base + ["train.eval_interval=4"])
    assert megatron_sample_counts(cfg) == (80, (10 // 4 + 1) * 3 * 8, 3 * 8)
    assert sample_counts(cfg) == (80, 72)
    assert megatron_sample_counts(load_config(None, base + ["train.eval_interval=0"])) == (80, 0, 0)
    assert load_config(None, preset="llmjp3-1.8b").data.order == "megatron"
    assert load_config(None, preset="demo").data.order == "llmjp"


# --- every field by its declared rule -------------------------------------------------------------------

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import typing  # noqa: E402

import pytest  # noqa: E402

from llmjp_ds.config import RunConfig, Valid, load_file  # noqa: E402
from llmjp_ds.errors import UserError  # noqa: E402
from llmjp_ds.validate import check_paths, check_values, fields_of, validate_run  # noqa: E402


def _leaf_types(annotation) -> set:
    args = typing.get_args(annotation)
    return set().union(*map(_leaf_types, args)) if args else {annotation}


def _declared(cls, where: str = "", inherited=None):
    """(key, leaf types, metadata) of every leaf field of the config *types*: a field added later is seen too."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, leaves = f"{where}.{f.name}" if where else f.name, _leaf_types(hints[f.name])
        nested = [t for t in leaves if dataclasses.is_dataclass(t)]
        if nested:
            yield from _declared(nested[0], key + ("[]" if typing.get_origin(hints[f.name]) is list else ""),
                                 f.metadata or None)
        else:
            yield key, leaves, f.metadata or inherited or {}


def test_every_numeric_field_declares_its_valid_range():
    missing = [key for key, leaves, meta in _declared(RunConfig)
               if leaves & {int, float} and not isinstance(meta.get("valid"), Valid)]
    assert not missing, f"numeric config fields without a declared rule (config.Valid): {missing}"
    keys = [key for key, *_ in _declared(RunConfig)]
    assert "precision.phases[].margin" in keys and "model.overrides.rope_theta" in keys  # the walk reaches them


def _outside(valid: Valid, leaves: set):
    """A value just outside ``valid`` (None where every value of the type is valid)."""
    if valid.choices:
        return max(valid.choices) + 1
    if valid.lo is not None:
        return valid.lo - (0 if valid.lo_open else (1 if float not in leaves else 1e-3))
    if valid.hi is not None:
        return valid.hi + (0 if valid.hi_open else 1)
    return None


def _set(cfg, key: str, value) -> None:
    *path, name = key.replace("[", ".[").split(".")
    node = cfg
    for part in path:
        node = node[int(part[1:-1])] if part.startswith("[") else getattr(node, part)
    setattr(node, name, [value] if isinstance(getattr(node, name), list) else value)


def _numeric_fields():
    cfg = load_config(None, ["precision.phases=[{precision: bf16}, {precision: fp8, start_step: 5}]"])
    return [(key, annotation, meta["valid"]) for key, _, meta, annotation, _ in fields_of(cfg)
            if _leaf_types(annotation) & {int, float}]


@pytest.mark.parametrize("key,annotation,valid", _numeric_fields(), ids=lambda x: x if isinstance(x, str) else "")
def test_each_numeric_field_refuses_values_outside_its_range_and_nan(key, annotation, valid):
    sets = ["precision.phases=[{precision: bf16}, {precision: fp8, start_step: 5}]"]
    leaves = _leaf_types(annotation)
    bad = [_outside(valid, leaves)] + ([math.nan, math.inf, -math.inf] if float in leaves else [])
    for value in [b for b in bad if b is not None]:
        cfg = load_config(None, sets)
        _set(cfg, key, value)
        with pytest.raises(UserError) as info:
            check_values(cfg)
        message = str(info.value)
        assert key.split(".")[-1].split("[")[0] in message and "\n" not in message, message
    check_values(load_config(None, sets))  # the defaults are valid


def test_messages_that_were_pinned_before_the_rules_are_kept():
    def message(*sets):
        with pytest.raises(UserError) as info:
            check_values(load_config(None, list(sets)))
        return str(info.value)

    assert message("optim.min_lr_ratio=2") == \
        "optim.lr must be > 0 and optim.min_lr_ratio in [0, 1], got lr=0.003, min_lr_ratio=2"
    assert message("train.steps=0") == "train.steps must be positive, got 0"
    assert message("parallel.zero_stage=4") == "parallel.zero_stage must be 0, 1, 2 or 3, got 4"
    assert message("model.overrides={num_layers: 0}") == "model.overrides.num_layers must be a positive int, got 0"
    assert message("checkpoint.grace_seconds=0") == \
        "checkpoint.grace_seconds must be > 0 (time allowed for the save after SIGTERM), got 0"
    assert message("precision.guard.penalty_patience=0") == \
        "precision.guard.max_penalty must be > 0 and penalty_patience >= 1, got 0.02 and 0"


# --- path fields and run_dir --------------------------------------------------------------------------

def _path_error(*sets) -> str:
    with pytest.raises(UserError) as info:
        check_paths(load_config(None, list(sets)))
    return str(info.value)


def test_run_dir_must_be_a_directory_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "work").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "home" / "work")
    assert _path_error("run_dir=").startswith("run_dir is empty ('')")
    assert _path_error("run_dir=  ").startswith("run_dir is empty")
    assert "is the filesystem root" in _path_error("run_dir=/")
    assert "is your home directory" in _path_error(f"run_dir={tmp_path / 'home'}")
    assert "is the current directory" in _path_error("run_dir=.")
    assert "is the current directory" in _path_error(f"run_dir={tmp_path}/home/work/../work")
    assert "holds your home directory" in _path_error(f"run_dir={tmp_path}")
    from llmjp_ds.config import REPO_ROOT

    assert "is the repository" in _path_error(f"run_dir={REPO_ROOT}")
    check_paths(load_config(None, ["run_dir=runs/x"]))  # a directory below the current one is fine
    check_paths(load_config(None, [f"run_dir={tmp_path / 'home' / 'runs' / 'x'}"]))


def test_path_fields_are_checked_whatever_else_is_set(tmp_path):
    assert _path_error(f"data.tokenizer={tmp_path}/nope") == \
        f"data.tokenizer {tmp_path}/nope does not exist: pass a SentencePiece .model or an HF tokenizer dir"
    assert _path_error(f"model.init_from_hf={tmp_path}/nope").startswith(f"model.init_from_hf {tmp_path}/nope does "
                                                                          "not exist")
    assert _path_error(f"model.init_from_hf={tmp_path}").startswith(f"model.init_from_hf {tmp_path} has no "
                                                                     "config.json")
    assert "does not exist: pass an existing file as parallel.ds_config" in \
        _path_error(f"parallel.ds_config={tmp_path}/nope.json")
    assert _path_error("parallel.ds_config=") == "parallel.ds_config is empty (''): set a path, or leave it unset " \
        "(null)"
    (tmp_path / "f").write_text("")
    assert _path_error(f"data.cache_dir={tmp_path}/f/cache").endswith("is a file, not a directory; choose another "
                                                                      "data.cache_dir")
    check_paths(load_config(None, [f"data.cache_dir={tmp_path}/new/cache", "model.init_from_hf=null"]))


def test_a_tokenizer_without_a_blend_is_refused(tmp_path):
    (tmp_path / "tok.model").write_text("")
    with pytest.raises(UserError, match="is set but data.blend is empty"):
        validate_run(load_config(None, [f"run_dir={tmp_path}/run", f"data.tokenizer={tmp_path}/tok.model"]), 1)


# --- config files and --set ---------------------------------------------------------------------------

def _file_error(tmp_path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path):
    assert _file_error(tmp_path, "a.yaml", "optim:\n  lr: 1\n  beta1: 0.9\n  lr: 2\n") == \
        f"config file {tmp_path}/a.yaml: key 'optim.lr' is given twice, at lines 2 and 4 (the last would silently " \
        "win): keep one"
    assert "key 'train' is given twice, at lines 1 and 3" in _file_error(tmp_path, "b.yaml",
                                                                          "train: {steps: 3}\nrun_dir: x\ntrain: {}\n")
    assert "key 'precision.phases[1].recipe' is given twice, at lines 4 and 4" in _file_error(
        tmp_path, "c.yaml", "precision:\n  phases:\n  - {}\n  - {precision: fp8, recipe: block, recipe: current}\n")
    assert "key 'optim.lr' is given twice, at lines 2 and 4" in _file_error(
        tmp_path, "d.json", '{"optim": {\n  "lr": 1,\n  "beta1": 0.9,\n  "lr": 2}}')
    assert "key 'precision.phases[1].recipe' is given twice, at lines 1 and 2" in _file_error(
        tmp_path, "e.json", '{"precision": {"phases": [{}, {"recipe": "block",\n "recipe": "current"}]}}')
    # the same key in two sections, a string that looks like a key, and YAML merge keys are fine
    (tmp_path / "f.json").write_text(json.dumps({"optim": {"lr": 1e-3}, "logging": {"run_name": "lr", "project":
                                                 '{"lr": 1, "lr": 2}'}, "train": {"seed": 1}}))
    assert load_config(tmp_path / "f.json").logging.project == '{"lr": 1, "lr": 2}'
    (tmp_path / "g.yaml").write_text("optim:\n  <<: {lr: 1.0e-3, beta1: 0.8}\n  lr: 2.0e-3\ntrain: {seed: 1}\n")
    assert load_config(tmp_path / "g.yaml").optim.lr == 2e-3 and load_config(tmp_path / "g.yaml").optim.beta1 == 0.8


def test_config_file_oddities_are_one_line(tmp_path):
    assert "is empty (no settings" in _file_error(tmp_path, "a.yaml", "")
    assert "is empty (no settings" in _file_error(tmp_path, "b.yaml", "# nothing yet\n")
    assert "is empty (no settings" in _file_error(tmp_path, "c.json", " \n")
    assert "starts with a byte-order mark (BOM)" in _file_error(tmp_path, "d.yaml", b"\xef\xbb\xbftrain: {}\n")
    assert "starts with a byte-order mark (BOM)" in _file_error(tmp_path, "e.json", b"\xef\xbb\xbf{}")
    assert "the YAML tag !!python/object:os.system at line 2 is not allowed" in _file_error(
        tmp_path, "f.yaml", "train:\n  steps: !!python/object:os.system {}\n")
    assert "the key 1 in train is a YAML int, not a name" in _file_error(tmp_path, "g.yaml", "train:\n  1: 3\n")
    assert "the key true at the top is a YAML bool" in _file_error(tmp_path, "h.yaml", "true: 3\n")
    assert "the key <a seq> in optim is a YAML seq" in _file_error(tmp_path, "i.yaml", "optim:\n  ? [a, b]\n  : 1\n")
    assert "unknown run preset 'llmjp3-7b' named in" in _file_error(tmp_path, "j.yaml", "preset: llmjp3-7b\n")
    assert "preset must name a run preset" in _file_error(tmp_path, "k.yaml", "preset: {a: 1}\n")
    assert "preset must name a run preset" in _file_error(tmp_path, "l.yaml", "preset: ''\n")
    (tmp_path / "m.yaml").write_text("preset: demo\n")
    with pytest.raises(UserError, match="--preset llmjp3-13b and the preset: demo of config file .* disagree"):
        load_config(tmp_path / "m.yaml", [], "llmjp3-13b")
    assert load_config(tmp_path / "m.yaml", [], "demo").train.steps == 200  # the same preset twice is fine
    assert load_file(tmp_path / "m.yaml") == {"preset": "demo"}


@pytest.mark.parametrize("assignment,message", [
    ("optim..lr=1", "the key 'optim..lr' has an empty name between its dots"),
    (".lr=1", "the key '.lr' has an empty name"),
    ("optim.=1", "the key 'optim.' has an empty name"),
    ("=1", "the key '' has an empty name"),
    ("data.split=[a, b]", "config key 'data.split[0]' must be float (an item of data.split, a list[float]), got 'a'"),
    ("data.blend=[[1]]", "config key 'data.blend[0]' must be float or str"),
    ("precision.phases=[{candidates: [delayed, 2]}]", "config key 'precision.phases[0].candidates[1]' must be str"),
    ("precision.phases=[3]", "config section precision.phases[0] must be a mapping, got int"),
    ("model.overrides={1: 2}", "config key 1 in model.overrides is not a name (it is int)"),
    ("data.split=3", "config key 'data.split' must be list[float], got 3"),
    ("precision.phases=[]", "precision.phases must be a non-empty list of PhaseConfig mappings"),
    ("train.skip_steps=[[1, a]]", "config key 'train.skip_steps[0][1]' must be int (an item of train.skip_steps[0], a "
                                  "list[int]), got 'a'"),
    ("checkpoint.keep=[{below: 3}]", "config section checkpoint.keep[0] lacks every: set every: <value> there"),
    ("optim.lr=true", "config key 'optim.lr' must be float, got True"),
])
def test_bad_set_assignments_are_one_line(assignment, message):
    with pytest.raises(UserError) as info:
        load_config(None, [assignment])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_empty_set_value_is_an_empty_string():
    assert parse_value("") == "" and parse_value("null") is None
    assert load_config(None, ["logging.run_name="]).logging.run_name == ""
    assert load_config(None, ["data.tokenizer=null"]).data.tokenizer is None


def test_the_run_config_written_to_a_run_loads_again(tmp_path):
    import yaml

    cfg = load_config(None, ["precision.phases=[{precision: bf16}, {precision: fp8, start_step: 5}]"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(tmp_path / "config.yaml").to_dict() == cfg.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    assert load_config(tmp_path / "config.json").to_dict() == cfg.to_dict()


def test_dropout_is_zero_or_refused():
    """The layers apply no dropout: 0 (LLM-jp's --attention-dropout 0.0 --hidden-dropout 0.0) is the one value."""
    for key in ("attention_dropout", "hidden_dropout"):
        assert getattr(load_config(None, []).model, key) == 0.0
        with pytest.raises(UserError) as info:
            check_values(load_config(None, [f"model.{key}=0.1"]))
        assert str(info.value) == (f"model.{key} must be 0 (llmjp-ds's layers apply no dropout; LLM-jp trains without "
                                   "it, Megatron's --attention-dropout 0.0 --hidden-dropout 0.0), got 0.1: set it to 0")


@pytest.mark.parametrize("name", sorted(__import__("llmjp_ds.config.presets", fromlist=["x"]).RUN_PRESETS))
def test_every_run_preset_loads_and_passes_the_value_checks(name):
    """Each preset a user can name is a valid config as it stands (a preset whose own settings contradict each
    other, such as an absolute and a relative minimum LR at once, fails here rather than at a user's start)."""
    cfg = load_config(preset=name)
    check_values(cfg)
    assert cfg.to_dict() == load_config(preset=name).to_dict()
