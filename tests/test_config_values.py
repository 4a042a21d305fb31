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
