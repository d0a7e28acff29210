"""The export cache (epochmesh/export_cache.py) and build_job's use of it: a hit reuses the
program, a changed model file, shape or seed misses, a corrupt entry is ignored, concurrent
writers leave a whole entry."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from epochmesh.export_cache import (
    ENV_CACHE_DIR,
    MAX_SOURCE_ENTRIES,
    ExportCache,
    cache_key,
    default_root,
    model_sources,
    safetensors_digest,
)
from epochmesh.packaging import PackedJob, _cache_key, build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import common_pb2
from epochmesh.wire.tensors import to_safetensors
from tests.fixtures import make_classification, write_job, write_mlp_job

pytestmark = pytest.mark.timeout(120)

KEY_A = hashlib.sha256(b"a").hexdigest()
KEY_B = hashlib.sha256(b"b").hexdigest()

FLAT = """\
from torch import nn


class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x.flatten(1).float())


def make_model():
    return Flat()
"""
DOC = {
    "name": "flat",
    "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
    "train": {"seed": 3},
}


# -- the store ----------------------------------------------------------------------------------


def test_put_then_get_and_a_missing_key(tmp_path: Path) -> None:
    cache = ExportCache(tmp_path / "c")
    assert cache.get(KEY_A) is None
    assert cache.put(KEY_A, b"program bytes")
    assert cache.get(KEY_A) == b"program bytes"
    assert cache.get(KEY_B) is None
    assert cache.stats().entries == 1
    with pytest.raises(ValueError):
        cache.path("../../etc/passwd")


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-1],  # truncated
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),  # a flipped bit
        lambda b: b.replace(b"epochmesh-export-cache", b"something-else-entirely"),
        lambda b: b"",
        lambda b: b"x" * 1000,  # no header line at all
        lambda b: b + b"more",
    ],
)
def test_a_corrupt_entry_is_ignored_and_removed(
    tmp_path: Path, damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ExportCache(tmp_path)
    cache.put(KEY_A, b"\x00\x01program" * 100)
    path = cache.path(KEY_A)
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with caplog.at_level(logging.WARNING):
        assert cache.get(KEY_A) is None
    assert "corrupt" in caplog.text
    assert not path.exists()
    assert cache.put(KEY_A, b"again") and cache.get(KEY_A) == b"again"


def test_concurrent_writers_leave_a_whole_entry(tmp_path: Path) -> None:
    cache = ExportCache(tmp_path)
    blobs = [bytes([i]) * (256 << 10) for i in range(8)]
    stop = threading.Event()
    bad: list[bytes] = []

    def reader() -> None:
        while not stop.is_set():
            got = cache.get(KEY_A)
            if got is not None and got not in blobs:
                bad.append(got)

    def writer(blob: bytes) -> None:
        for _ in range(20):
            assert cache.put(KEY_A, blob)

    threads = [threading.Thread(target=reader)]
    threads += [threading.Thread(target=writer, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not bad
    assert cache.get(KEY_A) in blobs
    assert [p.name for p in cache.path(KEY_A).parent.iterdir()] == [KEY_A]  # no temp files


def test_least_recently_used_entries_go_past_the_limit(tmp_path: Path) -> None:
    cache = ExportCache(tmp_path, max_bytes=3000)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4)]
    for i, key in enumerate(keys[:2]):
        cache.put(key, b"x" * 1000)
        os.utime(cache.path(key), (1000.0 + i, 1000.0 + i))
    assert cache.get(keys[0]) is not None  # used now: newer than keys[1]
    cache.put(keys[2], b"y" * 1000)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None
    assert cache.get(keys[2]) is not None
    assert not cache.put(keys[3], b"z" * 4000)  # over the limit on its own: not stored
    assert cache.get(keys[3]) is None


def test_an_unwritable_cache_is_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    cache = ExportCache(tmp_path / "file")
    assert not cache.put(KEY_A, b"p")
    assert cache.get(KEY_A) is None


def test_a_refresh_skips_the_entry_and_replaces_it(tmp_path: Path) -> None:
    ExportCache(tmp_path).put(KEY_A, b"old")
    refresh = ExportCache(tmp_path, reuse=False)  # `epochmesh submit --no-cache`
    assert refresh.get(KEY_A) is None
    assert refresh.put(KEY_A, b"fresh")
    assert ExportCache(tmp_path).get(KEY_A) == b"fresh"


def test_submit_takes_no_cache() -> None:
    from client.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["submit", "job.toml", "--no-cache"]).no_cache is True
    assert parser.parse_args(["submit", "job.toml"]).no_cache is False


def test_default_root() -> None:
    assert default_root({ENV_CACHE_DIR: "/x/y"}) == Path("/x/y")
    assert default_root({"XDG_CACHE_HOME": "/cache"}) == Path("/cache/epochmesh")
    home = Path.home() / ".cache" / "epochmesh"
    assert default_root({"XDG_CACHE_HOME": "relative"}) == home
    assert default_root({}) == home


# -- keys ---------------------------------------------------------------------------------------


def test_keys_follow_every_part() -> None:
    base = {"sources": {"model.py": "1"}, "example": "e", "loss": "mse"}
    assert cache_key(base) == cache_key(dict(reversed(base.items())))
    assert len({cache_key(base), cache_key({**base, "loss": "cross_entropy"})}) == 2
    assert cache_key(base) != cache_key({**base, "sources": {"model.py": "2"}})


def test_model_sources(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "lib").mkdir(parents=True)
    (job / "__pycache__").mkdir()
    (job / ".git").mkdir()
    (job / "model.py").write_text("import lib.blocks\n")
    (job / "lib" / "blocks.py").write_text("X = 1\n")
    (job / "vocab.json").write_text("{}")
    (job / "train.safetensors").write_bytes(b"data")
    (job / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"pyc")
    (job / ".git" / "HEAD").write_text("ref")
    first = model_sources(job, exclude=[job / "train.safetensors"])
    assert first is not None
    assert sorted(first) == ["lib/blocks.py", "model.py", "vocab.json"]
    (job / "lib" / "blocks.py").write_text("X = 2\n")  # a sibling module changed
    assert model_sources(job, exclude=[job / "train.safetensors"]) != first
    (job / "lib" / "blocks.py").write_text("X = 1\n")
    assert model_sources(job, exclude=[job / "train.safetensors"]) == first

    # A module model.py imported from outside its folder and the installed packages counts.
    outside = tmp_path / "mylib.py"
    outside.write_text("Y = 1\n")
    module = type(os)("mylib")
    module.__file__ = str(outside)
    with_module = model_sources(job, exclude=[job / "train.safetensors"], modules=[module])
    assert with_module is not None and len(with_module) == 4
    assert model_sources(job, modules=[torch, os]) is not None  # installed: by version only

    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for i in range(MAX_SOURCE_ENTRIES + 1):
        (crowded / f"{i}.txt").touch()
    assert model_sources(crowded) is None


# -- build_job ----------------------------------------------------------------------------------


def _build(job: Path, cache: ExportCache, *, verify: bool = True) -> PackedJob:
    return build_job(load_spec(job), cache=cache, verify=verify)


def test_build_job_reuses_the_program_and_misses_on_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ExportCache(tmp_path / "cache")
    first = _build(write_mlp_job(tmp_path / "a", 64), cache)
    assert not first.program_from_cache and cache.stats().entries == 1

    # Another folder, another name, epochs and dataset size: the same model, the same example.
    other = write_mlp_job(tmp_path / "b", 96, overrides={"name": "other", "train": {"epochs": 3}})
    again = _build(other, cache)
    assert again.program_from_cache and again.program == first.program
    # (the same tensors and metadata; safetensors orders the metadata differently per call)
    assert safetensors_digest(again.initial_state) == safetensors_digest(first.initial_state)
    assert again.spec.name == "other"
    assert again.num_samples == 96 and again.shards != first.shards

    # A changed model file misses (a comment is enough). Without the load-back check (a key of
    # its own) to keep the test short.
    changed = write_mlp_job(tmp_path / "c", 64)
    with open(changed.parent / "model.py", "a") as f:
        f.write("# tuned\n")
    assert not _build(changed, cache, verify=False).program_from_cache
    assert _build(changed, cache, verify=False).program_from_cache
    assert cache.stats().entries == 2

    # A corrupt entry is detected, ignored and replaced by a fresh export.
    for path in cache.dir.glob("*/*"):
        path.write_bytes(path.read_bytes()[:-5])
    with caplog.at_level(logging.WARNING):
        rebuilt = _build(changed, cache, verify=False)
    assert not rebuilt.program_from_cache and "corrupt" in caplog.text
    assert _build(changed, cache, verify=False).program_from_cache


def test_keys_follow_shapes_dtypes_values_seed_and_loss(tmp_path: Path) -> None:
    """build_job's key (the part it adds to the environment's): what the export traced and the
    checks ran; the shards, name, epochs and learning rate are not in it."""
    data = make_classification(32)
    loaded = load_spec(write_job(tmp_path / "job", FLAT, data, DOC))
    spec = loaded.spec
    state = to_safetensors({"w": torch.ones(4, 16)})
    example = (data["x"][:4], data["y"][:4])

    def key(**change: object) -> str:
        args: dict[str, object] = {
            "loaded": loaded,
            "spec": spec,
            "initial_state": state,
            "example": example,
            "num_samples": 32,
            "imported": [],
            "verify": True,
        }
        return _cache_key(**{**args, **change})  # type: ignore[arg-type]

    base = key()
    assert key() == base and key(num_samples=1000) == base  # a bigger dataset: same trial
    x, y = example
    variants = [
        key(example=(x.reshape(4, 1, 16), y)),  # another shape
        key(example=(x.double(), y)),  # another dtype
        key(example=(x.to(torch.bfloat16), y.int())),
        key(example=(x + 1, y)),  # other values: the checks ran on other data
        key(example=(x[:2], y[:2])),  # a smaller example batch
        key(num_samples=3),  # trial batches of 1 and 2 out of 3 samples
        key(initial_state=to_safetensors({"w": torch.zeros(4, 16)})),  # another seed
        key(spec=common_pb2.JobSpec(loss="mse", inputs=["x"], targets=["y"])),
        key(verify=False),
    ]
    assert len({base, *variants}) == len(variants) + 1
    (loaded.model_path.parent / "model.py").write_text(FLAT + "\n# changed\n")
    assert key() not in {base, *variants}


def test_no_cache_when_the_inspection_fault_hook_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook makes the load-back check misbehave on purpose: a hit must not skip it."""
    cache = ExportCache(tmp_path / "cache")
    monkeypatch.setenv("EPOCHMESH_TEST_INSPECTION_FAULT", "segv")
    packed = _build(write_mlp_job(tmp_path / "a", 16), cache, verify=False)
    assert not packed.program_from_cache and cache.stats().entries == 0
