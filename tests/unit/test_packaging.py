"""build_job on the submitter's side, and the shards it makes as an agent's ShardedDataset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epochmesh.dataset import ShardedDataset, ranges_to_indices
from epochmesh.errors import CodecError, ExportError, SpecError
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import DEFAULT_SHARD_BYTES, PackedJob, build_job, describe
from epochmesh.spec import load_spec
from epochmesh.v1 import common_pb2
from epochmesh.wire.tensors import from_safetensors, safetensors_metadata, to_safetensors
from tests.fixtures import (
    MLP_DIR,
    make_classification,
    write_dataset,
    write_job,
    write_mlp_job,
)

pytestmark = pytest.mark.timeout(120)

DOC = {
    "name": "t",
    "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
    "train": {"seed": 3},
}
LINEAR = """\
from torch import nn


def make_model():
    return nn.Linear(16, 4)
"""


def mlp_reference(seed: int = 0) -> torch.nn.Module:
    ns: dict = {}
    exec((MLP_DIR / "model.py").read_text(), ns)  # the fixture's own make_model
    torch.manual_seed(seed)
    return ns["make_model"]()


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"), num_samples=250)
    return build_job(load_spec(job), shard_samples=64, cache=ExportCache.default())


def test_packed_job_contents(packed: PackedJob) -> None:
    assert packed.spec.name == "tiny-mlp" and packed.spec.loss == "cross_entropy"
    assert packed.num_samples == 250
    assert [(s, c) for s, c, _ in packed.shards] == [(0, 64), (64, 64), (128, 64), (192, 58)]
    data = make_classification(250)
    for start, count, blob in packed.shards:
        shard = from_safetensors(blob)
        assert list(shard) == ["x", "y"]
        assert torch.equal(shard["x"], data["x"][start : start + count])
        assert torch.equal(shard["y"], data["y"][start : start + count])
        assert safetensors_metadata(blob)["start"] == str(start)
    assert 'name = "tiny-mlp"' in packed.spec_toml
    assert describe(packed)["shards"] == 4


def test_initial_state_is_the_seeded_state_dict(packed: PackedJob) -> None:
    ref = mlp_reference(seed=0).state_dict()
    state = from_safetensors(packed.initial_state)
    assert list(state) == list(ref) == packed.state_names
    for k in ref:
        assert torch.equal(state[k], ref[k]), k
    assert packed.num_parameters == sum(v.numel() for v in ref.values())


def test_build_is_reproducible_and_seeded(tmp_path: Path) -> None:
    a = build_job(load_spec(write_mlp_job(tmp_path / "a", 40)), verify=False)
    b = build_job(load_spec(write_mlp_job(tmp_path / "b", 40)), verify=False)
    c = build_job(
        load_spec(write_mlp_job(tmp_path / "c", 40, overrides={"train": {"seed": 1}})),
        verify=False,
    )
    # Compare contents, not bytes: safetensors writes its metadata map in hash order.
    sa, sb, sc = (from_safetensors(j.initial_state) for j in (a, b, c))
    assert safetensors_metadata(a.initial_state) == safetensors_metadata(b.initial_state)
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert torch.rand(1).numel() == 1  # the global RNG is usable (packaging forks it)


def test_default_shard_size(tmp_path: Path) -> None:
    job = write_mlp_job(tmp_path, 500)
    loaded = load_spec(job)
    per_sample = 16 * 4 + 8  # x float32[16] + y int64
    # The second build is the first one's program from the cache: only the shards differ.
    cache = ExportCache.default()
    packed = build_job(loaded, verify=False, cache=cache)
    assert len(packed.shards) == 1 and DEFAULT_SHARD_BYTES // per_sample > 500
    small = build_job(loaded, shard_bytes=per_sample * 100, verify=False, cache=cache)
    assert [c for _, c, _ in small.shards] == [100] * 5
    with pytest.raises(SpecError, match="shard_samples must be >= 1"):
        build_job(loaded, shard_samples=0)


def test_custom_loss_two_inputs_and_any_batch_size(tmp_path: Path) -> None:
    src = """\
import torch
from torch import nn


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, x, z):
        return self.a(x) + self.b(z)


def make_model():
    return Two()


def loss_fn(out, y, w):
    return ((out - y) ** 2 * w[:, None]).mean()
"""
    g = torch.Generator().manual_seed(0)
    n = 11
    data = {
        "x": torch.randn(n, 16, generator=g),
        "z": torch.randn(n, 2, generator=g),
        "y": torch.randn(n, 3, generator=g),
        "w": torch.rand(n, generator=g),
    }
    doc = {
        "name": "two",
        "model": {"loss": "custom"},
        "data": {"train": "d.safetensors", "inputs": ["x", "z"], "targets": ["y", "w"]},
    }
    packed = build_job(load_spec(write_job(tmp_path, src, data, doc)), shard_samples=4)
    assert packed.spec.loss == "custom"
    assert list(from_safetensors(packed.shards[0][2])) == ["x", "z", "y", "w"]
    from epochmesh.program.archive import TrainableProgram

    prog = TrainableProgram.from_bytes(packed.program, packed.initial_state)
    for b in (1, 2, 3, 7, 11):
        loss = prog.loss([data["x"][:b], data["z"][:b]], [data["y"][:b], data["w"][:b]])
        assert loss > 0


def test_loss_fn_wins_over_builtin_loss(tmp_path: Path) -> None:
    src = (
        LINEAR + "\n\ndef loss_fn(out, y):\n    return (out.logsumexp(1) * 0 + out.mean()).mean()\n"
    )
    packed = build_job(load_spec(write_job(tmp_path, src, make_classification(8), DOC)))
    assert packed.spec.loss == "custom"


def test_mse_loss(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = {"x": torch.randn(9, 16, generator=g), "y": torch.randn(9, 4, generator=g)}
    doc = {**DOC, "model": {"loss": "mse"}}
    packed = build_job(load_spec(write_job(tmp_path, LINEAR, data, doc)))
    from epochmesh.program.archive import TrainableProgram

    prog = TrainableProgram.from_bytes(packed.program, packed.initial_state)
    torch.manual_seed(3)
    ref = torch.nn.Linear(16, 4)
    expected = torch.nn.functional.mse_loss(ref(data["x"]), data["y"])
    assert prog.loss([data["x"]], [data["y"]]) == pytest.approx(float(expected.detach()), rel=1e-6)


@pytest.mark.parametrize(
    ("src", "needle"),
    [
        (
            "x = 1\ny = 1 / 0\n",
            "model.py raised: ZeroDivisionError: division by zero (model.py line 2)",
        ),
        ("def make_model(:\n", "model.py raised: SyntaxError"),
        ("import no_such_module_xyz\n", "ModuleNotFoundError"),
        ("import torch\n", "model.py defines no make_model()"),
        ("def make_model():\n    return 3\n", "make_model() returned int, not a torch.nn.Module"),
        (
            "def make_model():\n    raise RuntimeError('boom')\n",
            "model.py raised: RuntimeError: boom (model.py line 2)",
        ),
        (
            LINEAR.replace("nn.Linear(16, 4)", "nn.Linear(15, 4)"),
            "running the model and loss on a batch of 4 samples raised RuntimeError",
        ),
        (LINEAR + "\nloss_fn = 3\n", "loss_fn must be a function"),
        (
            LINEAR + "\n\ndef loss_fn(out, y):\n    return out.sum(1)\n",
            "the loss must be a scalar",
        ),
    ],
)
def test_model_file_errors(tmp_path: Path, src: str, needle: str) -> None:
    job = write_job(tmp_path, src, make_classification(8), DOC)
    with pytest.raises(SpecError) as e:
        build_job(load_spec(job))
    assert needle in str(e.value)


def test_custom_loss_requires_loss_fn(tmp_path: Path) -> None:
    doc = {**DOC, "model": {"loss": "custom"}}
    with pytest.raises(SpecError, match="defines no loss_fn"):
        build_job(load_spec(write_job(tmp_path, LINEAR, make_classification(8), doc)))


@pytest.mark.parametrize(
    ("forward", "needle"),
    [
        (
            "return self.fc(x).view(4, -1)",
            "must work for any batch size",
        ),
        (
            "return self.fc(x) if x.sum() > 0 else -self.fc(x)",
            "Avoid Python control flow on tensor values",
        ),
    ],
)
def test_export_errors_say_why_and_what_to_change(
    tmp_path: Path, forward: str, needle: str
) -> None:
    src = f"""\
from torch import nn


class N(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        {forward}


def make_model():
    return N()
"""
    with pytest.raises(ExportError) as e:
        build_job(load_spec(write_job(tmp_path, src, make_classification(8), DOC)))
    msg = str(e.value)
    assert msg.startswith("torch.export could not export model.py: ")
    assert needle in msg


def test_dataset_errors(tmp_path: Path) -> None:
    job = write_job(tmp_path, LINEAR, make_classification(8), DOC)
    loaded = load_spec(job)
    write_dataset(loaded.data_path, {"x": torch.zeros(8, 16), "label": torch.zeros(8)})
    with pytest.raises(
        SpecError, match=r"no tensor 'y' named in \[data\].targets; it has: label, x"
    ):
        build_job(loaded)
    write_dataset(
        loaded.data_path, {"x": torch.zeros(8, 16), "y": torch.zeros(7, dtype=torch.long)}
    )
    with pytest.raises(SpecError, match=r"share their first dimension.*x: \[8, 16\], y: \[7\]"):
        build_job(loaded)
    loaded.data_path.write_bytes(b"not safetensors")
    with pytest.raises(SpecError, match="not a valid safetensors file"):
        build_job(loaded)


def test_single_sample_dataset(tmp_path: Path) -> None:
    packed = build_job(load_spec(write_mlp_job(tmp_path, 1)))
    assert packed.num_samples == 1 and [(s, c) for s, c, _ in packed.shards] == [(0, 1)]


# ---------------------------------------------------------------------------------------------
# ShardedDataset over the packed shards


def test_dataset_gathers_in_the_given_order(packed: PackedJob) -> None:
    data = make_classification(250)
    ds = ShardedDataset(packed.shards, inputs=["x"], targets=["y"])
    assert ds.ranges == [(0, 64), (64, 128), (128, 192), (192, 250)]
    idx = [249, 0, 63, 64, 130, 5, 5]
    (x,), (y,) = ds.get_batch(idx)
    assert torch.equal(x, data["x"][idx]) and torch.equal(y, data["y"][idx])
    ranges = [
        common_pb2.SampleRange(start=60, stop=70),
        common_pb2.SampleRange(start=200, stop=203),
    ]
    indices = ranges_to_indices(ranges)
    assert indices == [*range(60, 70), 200, 201, 202]
    (x,), _ = ds.get_batch(indices)
    assert torch.equal(x, data["x"][indices])
    (x,), _ = ds.get_batch(range(10, 20))  # one shard
    assert torch.equal(x, data["x"][10:20])


def test_dataset_partial_shards_and_errors(packed: PackedJob, tmp_path: Path) -> None:
    s0, s2 = packed.shards[0], packed.shards[2]
    path = tmp_path / "shard2.safetensors"
    path.write_bytes(s2[2])
    ds = ShardedDataset([s0], inputs=["x"], targets=["y"])
    ds.add_shard(s2[0], s2[1], path)
    ds.add_shard(*s0)  # already loaded: no-op
    assert ds.has_shard(128, 64) and ds.num_loaded == 128
    with pytest.raises(IndexError, match="sample 100 is not in any loaded shard"):
        ds.get_batch([1, 100])
    with pytest.raises(ValueError, match="overlaps"):
        ds.add_shard(10, 64, s0[2])
    with pytest.raises(CodecError, match="expected first dimension 10"):
        ds.add_shard(300, 10, s0[2])
    with pytest.raises(CodecError, match="has no tensor 'y'"):
        ds.add_shard(300, 2, to_safetensors({"x": torch.zeros(2, 16)}))
    with pytest.raises(CodecError, match="sample shape"):
        ds.add_shard(
            300, 2, to_safetensors({"x": torch.zeros(2, 15), "y": torch.zeros(2, dtype=torch.long)})
        )
    with pytest.raises(CodecError):
        ds.add_shard(300, 2, b"garbage")
    with pytest.raises(ValueError, match="invalid sample range"):
        ranges_to_indices([(5, 3)])
