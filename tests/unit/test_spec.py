"""job.toml parsing, defaults, error messages, and JobSpec validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochmesh.errors import SpecError
from epochmesh.spec import (
    load_spec,
    parse_spec,
    spec_to_dict,
    validate_job_spec,
)
from epochmesh.v1 import common_pb2
from tests.fixtures import MLP_DIR, dump_toml, write_mlp_job

pytestmark = pytest.mark.timeout(60)

EXAMPLE = """\
name = "digits-mlp"
[model]
file = "model.py"           # defines make_model()
loss = "cross_entropy"
[data]
train = "train.safetensors"
inputs = ["x"]
targets = ["y"]
[train]
epochs = 8
global_batch = 128
optimizer = "sgd"
lr = 0.1
momentum = 0.0
weight_decay = 0.0
seed = 0
[cluster]
aggregation = "ps"
min_nodes = 1
max_nodes = 8
checkpoint_every = 20
"""


def parse(text: str) -> common_pb2.JobSpec:
    return parse_spec(text, "/nonexistent", check_files=False).spec


def with_train(extra: str, base: str = EXAMPLE) -> str:
    return base.replace("[cluster]", extra + "\n[cluster]")


def error(text: str) -> str:
    with pytest.raises(SpecError) as e:
        parse(text)
    return str(e.value)


def test_example_parses_with_every_field() -> None:
    spec = parse(EXAMPLE)
    assert spec.name == "digits-mlp"
    assert spec.loss == "cross_entropy"
    assert list(spec.inputs) == ["x"] and list(spec.targets) == ["y"]
    assert (spec.epochs, spec.global_batch, spec.optimizer) == (8, 128, "sgd")
    assert spec.lr == 0.1 and spec.momentum == 0.0 and spec.weight_decay == 0.0
    assert (spec.aggregation, spec.min_nodes, spec.max_nodes) == ("ps", 1, 8)
    assert spec.checkpoint_every == 20
    assert spec.sync == "sync" and spec.inner_steps == 1 and spec.compression == "none"
    validate_job_spec(spec)


def test_defaults_follow_torch_optim() -> None:
    minimal = 'name = "m"\n[data]\ntrain = "d.safetensors"\ninputs = ["x"]\ntargets = ["y"]\n'
    spec = parse(minimal)
    assert spec.optimizer == "sgd" and spec.lr == pytest.approx(1e-3)
    assert spec.weight_decay == 0.0 and spec.momentum == 0.0 and not spec.nesterov
    assert spec.epochs == 1 and spec.global_batch == 32 and spec.seed == 0
    assert spec.loss == "cross_entropy"
    adamw = parse(minimal + '[train]\noptimizer = "adamw"\n')
    assert (adamw.beta1, adamw.beta2) == (0.9, 0.999)
    assert adamw.eps == pytest.approx(1e-8)
    assert adamw.weight_decay == pytest.approx(0.01)
    explicit = parse(minimal + '[train]\noptimizer = "adamw"\nweight_decay = 0.0\n')
    assert explicit.weight_decay == 0.0


def test_unknown_key_names_line_and_closest_key() -> None:
    msg = error(EXAMPLE.replace("global_batch", "global_bach"))
    assert "unknown key [train].global_bach; did you mean global_batch?" in msg
    assert "line 11" in msg


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    msg = error(EXAMPLE.replace("[cluster]", "[cluster]\nzzz = 1"))
    assert "unknown key [cluster].zzz" in msg and "aggregation" in msg


def test_unknown_section_and_top_level_key() -> None:
    assert "did you mean [train]?" in error(EXAMPLE + "[trian]\nx = 1\n")
    assert "unknown key nmae; did you mean name?" in error("nmae = 1\n" + EXAMPLE)


def test_not_toml_names_the_line() -> None:
    msg = error(EXAMPLE.replace("epochs = 8", "epochs = "))
    assert "line 10" in msg and "not valid TOML" in msg


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ('epochs = "8"', "[train].epochs must be an integer (got '8')"),
        ("epochs = true", "[train].epochs must be an integer"),
        ("epochs = 0", "[train].epochs must be >= 1"),
        ("global_batch = 0", "[train].global_batch must be >= 1"),
        ("lr = 0", "[train].lr must be > 0"),
        ("lr = -0.5", "[train].lr must be > 0"),
        ("lr = nan", "[train].lr must be a finite number"),
        ("seed = -1", "[train].seed must be >= 0"),
        ("weight_decay = -1.0", "[train].weight_decay must be >= 0"),
        ('optimizer = "adam"', "did you mean 'adamw'?"),
        ('compression = "int4"', "compression must be one of none, fp16, bf16, int8, topk"),
        ("topk_ratio = 0.1", "topk_ratio applies only with compression = 'topk'"),
        ("inner_steps = 4", "inner_steps applies only with sync = 'local_sgd'"),
        ("outer_lr = 0.5", "outer_lr applies only with sync = 'local_sgd'"),
        ("betas = [0.9, 0.99]", "betas applies only with optimizer = 'adamw'"),
        ("nesterov = true", "nesterov = true needs momentum > 0 and dampening = 0"),
        ("dampening = 2.0", "[train].dampening must be <= 1"),
        ("micro_batch = -1", "[train].micro_batch must be >= 0"),
        ("micro_batch = 1.5", "[train].micro_batch must be an integer"),
        ("micro_bach = 16", "unknown key [train].micro_bach; did you mean micro_batch?"),
    ],
)
def test_bad_train_values(extra: str, needle: str) -> None:
    key = extra.split("=")[0].strip()
    drop = {key, "momentum", "optimizer"}
    base = "".join(
        line
        for line in EXAMPLE.splitlines(keepends=True)
        if not (line.split("=")[0].strip() in drop and "[train]" not in line)
    )
    msg = error(with_train(extra, base))
    assert needle in msg
    assert "job.toml line" in msg


def test_adamw_fields_and_sgd_only_fields() -> None:
    text = EXAMPLE.replace('optimizer = "sgd"', 'optimizer = "adamw"')
    assert "momentum applies only with optimizer = 'sgd'" in error(text)
    spec = parse(
        with_train("betas = [0.8, 0.95]\neps = 1e-6", text.replace("momentum = 0.0\n", ""))
    )
    assert (spec.beta1, spec.beta2, spec.eps) == (0.8, 0.95, 1e-6)
    assert "betas must be a list of two numbers" in error(
        with_train("betas = [0.9]", text.replace("momentum = 0.0\n", ""))
    )
    assert "betas[1] must be < 1" in error(
        with_train("betas = [0.9, 1.0]", text.replace("momentum = 0.0\n", ""))
    )


def test_nesterov_with_momentum() -> None:
    spec = parse(EXAMPLE.replace("momentum = 0.0", "momentum = 0.9\nnesterov = true"))
    assert spec.nesterov and spec.momentum == 0.9


def test_local_sgd_fields() -> None:
    text = with_train('sync = "local_sgd"\ninner_steps = 4\nouter_lr = 0.5')
    spec = parse(text)
    assert spec.sync == "local_sgd" and spec.inner_steps == 4
    assert spec.inner_optimizer == "sgd" and spec.outer_optimizer == "nesterov"
    assert spec.outer_lr == 0.5 and spec.outer_momentum == 0.9
    defaults = parse(with_train('sync = "local_sgd"'))
    assert defaults.inner_steps == 10 and defaults.outer_lr == 0.7
    conflict = with_train('sync = "local_sgd"\ninner_optimizer = "adamw"')
    assert "contradicts [train].optimizer" in error(conflict)
    alias = with_train(
        'sync = "local_sgd"\ninner_optimizer = "adamw"',
        EXAMPLE.replace('optimizer = "sgd"\n', "").replace("momentum = 0.0\n", ""),
    )
    assert parse(alias).optimizer == "adamw"


def test_topk_ratio() -> None:
    spec = parse(with_train('compression = "topk"\ntopk_ratio = 0.05'))
    assert spec.compression == "topk" and spec.topk_ratio == pytest.approx(0.05)
    assert parse(with_train('compression = "topk"')).topk_ratio == pytest.approx(0.01)
    assert "topk_ratio must be <= 1" in error(with_train('compression = "topk"\ntopk_ratio = 2.0'))


def test_cluster_ranges() -> None:
    assert "min_nodes (4) must be <= max_nodes (2)" in error(
        EXAMPLE.replace("min_nodes = 1", "min_nodes = 4").replace("max_nodes = 8", "max_nodes = 2")
    )
    assert "aggregation must be one of ps, ring" in error(
        EXAMPLE.replace('aggregation = "ps"', 'aggregation = "allreduce"')
    )
    with_priority = EXAMPLE.replace('aggregation = "ps"', 'aggregation = "ps"\npriority = "{}"')
    assert "[cluster].priority must be one of high, normal, low (got 'urgent')" in error(
        with_priority.format("urgent")
    )
    assert "did you mean 'high'?" in error(with_priority.format("hgh"))
    assert parse(with_priority.format("high")).priority == "high"
    assert parse(EXAMPLE).priority == "normal"
    assert "checkpoint_every must be >= 1" in error(
        EXAMPLE.replace("checkpoint_every = 20", "checkpoint_every = 0")
    )


def test_data_section_rules() -> None:
    assert "takes exactly one target tensor" in error(EXAMPLE.replace('["y"]', '["y", "z"]'))
    assert "takes exactly one target tensor" in error(EXAMPLE.replace('targets = ["y"]\n', ""))
    assert "names 'x' twice" in error(EXAMPLE.replace('inputs = ["x"]', 'inputs = ["x", "x"]'))
    assert "must name at least one tensor" in error(EXAMPLE.replace('["x"]', "[]"))
    assert "missing required key [data].train" in error(
        EXAMPLE.replace('train = "train.safetensors"\n', "")
    )
    custom = parse(EXAMPLE.replace('"cross_entropy"', '"custom"').replace('["y"]', "[]"))
    assert custom.loss == "custom" and list(custom.targets) == []


def test_section_must_be_a_table() -> None:
    assert "train must be a table" in error('name = "x"\ntrain = 3\n')


def test_files_are_checked(tmp_path: Path) -> None:
    (tmp_path / "job.toml").write_text(EXAMPLE)
    with pytest.raises(SpecError, match="model file not found: .*model.py"):
        load_spec(tmp_path / "job.toml")
    (tmp_path / "model.py").write_text("")
    with pytest.raises(SpecError, match="dataset file not found: .*train.safetensors"):
        load_spec(tmp_path / "job.toml")
    loaded = load_spec(tmp_path / "job.toml", check_files=False)
    assert loaded.model_path == tmp_path / "model.py"
    assert loaded.data_path == tmp_path / "train.safetensors"
    assert loaded.toml_text == EXAMPLE
    with pytest.raises(SpecError, match="job file not found"):
        load_spec(tmp_path / "missing.toml")


def test_fixture_job_loads(tmp_path: Path) -> None:
    loaded = load_spec(write_mlp_job(tmp_path, 16, overrides={"train": {"lr": 0.05}}))
    assert loaded.spec.name == "tiny-mlp" and loaded.spec.lr == 0.05
    assert loaded.base_dir == tmp_path.resolve()
    assert (MLP_DIR / "job.toml").is_file()


def test_micro_batch_is_optional_and_reads_back() -> None:
    assert parse(EXAMPLE).micro_batch == 0
    assert "micro_batch" not in spec_to_dict(parse(EXAMPLE))["train"]
    spec = parse(with_train("micro_batch = 32"))
    assert spec.micro_batch == 32
    validate_job_spec(spec)
    assert spec_to_dict(spec)["train"]["micro_batch"] == 32
    # Larger than the global batch is allowed: every local batch is then one pass.
    assert parse(with_train("micro_batch = 4096")).micro_batch == 4096


def test_spec_to_dict_lists_what_applies() -> None:
    d = spec_to_dict(parse(EXAMPLE))
    assert d["train"]["momentum"] == 0.0 and "betas" not in d["train"]
    assert d["cluster"] == {
        "aggregation": "ps",
        "min_nodes": 1,
        "max_nodes": 8,
        "checkpoint_every": 20,
        "priority": "normal",
    }
    adamw = parse(
        EXAMPLE.replace('optimizer = "sgd"', 'optimizer = "adamw"').replace("momentum = 0.0\n", "")
    )
    assert spec_to_dict(adamw)["train"]["betas"] == [0.9, 0.999]
    # The dict reads back as the same spec.
    back = dump_toml(
        {
            "name": d["name"],
            "model": d["model"],
            "data": {**d["data"], "train": "t.safetensors"},
            "train": d["train"],
            "cluster": d["cluster"],
        }
    )
    assert parse(back) == parse(EXAMPLE)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("lr", float("nan"), "lr must be finite"),
        ("lr", 0.0, "lr must be > 0"),
        ("epochs", 0, "epochs must be >= 1"),
        ("optimizer", "rmsprop", "optimizer must be one of"),
        ("compression", "zip", "compression must be one of"),
        ("aggregation", "", "aggregation must be one of"),
        ("min_nodes", 9, "min_nodes (9) must be <= max_nodes (8)"),
        ("loss", "hinge", "loss must be one of"),
        ("name", "", "name must not be empty"),
        ("sync", "async", "sync must be one of"),
        ("inner_steps", 5, "inner_steps must be 1"),
        ("micro_batch", -3, "micro_batch must be >= 0"),
        ("priority", "urgent", "priority must be one of high, normal, low"),
    ],
)
def test_validate_job_spec_rejects(field: str, value: object, needle: str) -> None:
    spec = parse(EXAMPLE)
    setattr(spec, field, value)
    with pytest.raises(SpecError, match=None) as e:
        validate_job_spec(spec)
    assert needle in str(e.value)


_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=8),
    st.lists(st.floats(allow_nan=False, width=32), max_size=3),
    st.lists(st.text(max_size=3), max_size=3),
)
_TRAIN_KEYS = [
    "epochs", "global_batch", "optimizer", "lr", "momentum", "dampening", "nesterov",
    "weight_decay", "betas", "eps", "seed", "compression", "topk_ratio", "sync", "inner_steps",
    "inner_optimizer", "outer_optimizer", "outer_lr", "outer_momentum", "micro_batch", "bogus",
]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(_TRAIN_KEYS), _VALUES, max_size=5))
def test_any_train_table_gives_a_spec_or_a_spec_error(train: dict) -> None:
    doc = {
        "name": "h",
        "data": {"train": "d.safetensors", "inputs": ["x"], "targets": ["y"]},
        "train": train,
    }
    try:
        text = dump_toml(doc)
    except TypeError:
        return
    try:
        spec = parse(text)
    except SpecError as e:
        assert str(e)
        return
    validate_job_spec(spec)  # whatever parses is also valid on the wire


def test_market_section_reads_credits_exactly_and_durations() -> None:
    spec = parse(EXAMPLE + '[market]\nmax_price = 2.5\nbudget = "100.000001"\ndeadline = "2h"\n')
    assert spec.max_price_micro_per_hour == 2_500_000
    assert spec.budget_micro == 100_000_001
    assert spec.deadline_seconds == 7200.0
    assert spec_to_dict(spec)["market"] == {
        "max_price": "2.5",
        "budget": "100.000001",
        "deadline": 7200.0,
    }
    validate_job_spec(spec)
    plain = parse(EXAMPLE)
    for name in ("max_price_micro_per_hour", "budget_micro", "deadline_seconds"):
        assert not plain.HasField(name)
    assert "market" not in spec_to_dict(plain)
    assert parse(EXAMPLE + "[market]\nmax_price = 0\ndeadline = 90\n").HasField(
        "max_price_micro_per_hour"
    )
    assert parse(EXAMPLE + '[market]\ndeadline = "1.5d"\n').deadline_seconds == 129600.0


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("max_price = -1", "[market].max_price must not be negative"),
        ("budget = nan", "[market].budget must be a finite number"),
        ('budget = "abc"', "[market].budget must be a number"),
        ("budget = 1.0000001", "more than 6 decimals"),
        ("budget = 1e12", "at most 1000000000 credits"),
        ("budget = true", "[market].budget must be an amount of credits"),
        ('deadline = "2x"', "[market].deadline must be a duration"),
        ("deadline = 0", "[market].deadline must be a duration"),
        ("colour = 1", "unknown key [market].colour"),
    ],
)
def test_bad_market_values(line: str, needle: str) -> None:
    message = error(EXAMPLE + "[market]\n" + line + "\n")
    assert needle in message and "line" in message, message


def test_market_fields_are_validated_on_the_wire() -> None:
    spec = parse(EXAMPLE)
    spec.budget_micro = -1
    with pytest.raises(SpecError, match="budget_micro must be within"):
        validate_job_spec(spec)
    spec = parse(EXAMPLE)
    spec.deadline_seconds = float("nan")
    with pytest.raises(SpecError, match="deadline_seconds"):
        validate_job_spec(spec)


def test_aggregation_rule_is_optional_checked_and_reads_back() -> None:
    assert parse(EXAMPLE).aggregation_rule == ""  # mean: the plain-replay default
    assert "aggregation_rule" not in spec_to_dict(parse(EXAMPLE))["train"]
    for rule in ("trimmed_mean", "centered_clip"):
        spec = parse(with_train(f'aggregation_rule = "{rule}"'))
        assert spec.aggregation_rule == rule
        validate_job_spec(spec)
        assert spec_to_dict(spec)["train"]["aggregation_rule"] == rule
    assert parse(with_train('aggregation_rule = "mean"')).aggregation_rule == ""
    assert "aggregation_rule must be one of" in error(with_train('aggregation_rule = "median"'))
    spec = parse(with_train('aggregation_rule = "trimmed_mean"'))
    spec.aggregation = "ring"
    with pytest.raises(SpecError, match="parameter server"):
        validate_job_spec(spec)
