"""Seeded random draws in the confined program child (node_agent.sandbox.child): a program with
dropout, `rand_like` noise, a `randperm` order and an `empty` buffer, loaded as an agent loads
it. A worker's batched chunk request (one seed per chunk) and a checker's request of one chunk
(the same seed, another child) give the same loss and gradient bit for bit; without seeds the
same chunk gives other numbers each time; a malformed seed is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from epochmesh.dataset import ShardedDataset
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.spec import load_spec
from epochmesh.verification import chunk_bounds
from node_agent.sandbox.host import ConfinedProgram, ProgramHosts
from node_agent.sandbox.seeding import SeedScope
from node_agent.training.compute import accumulated_loss_and_grads, chunk_losses_and_grads
from tests.fixtures import make_classification, write_job
from tests.random_models import RANDOM_MLP_MODEL

pytestmark = pytest.mark.timeout(180)

N = 48


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    doc = {
        "name": "random-child",
        "model": {"file": "model.py", "loss": "cross_entropy"},
        "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
        "train": {"epochs": 1, "global_batch": 16, "optimizer": "sgd", "lr": 0.1, "seed": 1},
        "cluster": {"aggregation": "ps", "min_nodes": 1, "max_nodes": 2},
    }
    path = write_job(
        tmp_path_factory.mktemp("random"), RANDOM_MLP_MODEL, make_classification(N), doc
    )
    return build_job(load_spec(path), cache=ExportCache.default())


@pytest.fixture(scope="module")
def children(packed: PackedJob) -> Iterator[tuple[ConfinedProgram, ConfinedProgram]]:
    """A worker's and a checker's confined child of the job's program."""
    programs = ProgramHosts("cpu", 1, 512 << 20)
    try:
        yield (
            programs.load(packed.program, packed.initial_state, job_id="worker"),
            programs.load(packed.program, packed.initial_state, job_id="checker"),
        )
    finally:
        programs.close_all()


def test_a_checker_child_draws_what_the_worker_child_drew(
    packed: PackedJob, children: tuple[ConfinedProgram, ConfinedProgram]
) -> None:
    worker, checker = children
    dataset = ShardedDataset(packed.shards, inputs=["x"], targets=["y"])
    indices = list(range(4, 40))
    x, y = dataset.get_batch(indices)
    bounds = chunk_bounds(len(indices), 3)
    scope = SeedScope("j-random", 5, "n-worker")
    seeds = [scope.seed(indices[a:b]) for a, b in bounds]
    chunks = chunk_losses_and_grads(worker, x, y, bounds, 4, seeds)
    for (a, b), seed, (loss, grads) in zip(bounds, seeds, chunks, strict=True):
        cx, cy = dataset.get_batch(indices[a:b])
        again, regrads = accumulated_loss_and_grads(checker, cx, cy, 4, seed)
        assert again == loss
        assert all(torch.equal(regrads[k], grads[k]) for k in grads)
    a, b = bounds[0]
    cx, cy = dataset.get_batch(indices[a:b])
    first = checker.loss_and_grads(cx, cy)[1]
    second = checker.loss_and_grads(cx, cy)[1]
    assert not all(torch.equal(first[k], second[k]) for k in first)


def test_a_malformed_seed_is_refused(
    packed: PackedJob, children: tuple[ConfinedProgram, ConfinedProgram]
) -> None:
    worker, _ = children
    dataset = ShardedDataset(packed.shards, inputs=["x"], targets=["y"])
    x, y = dataset.get_batch(list(range(8)))
    with pytest.raises(ValueError, match="seeds for"):
        worker.chunked_loss_and_grads(x, y, [(0, 4), (4, 8)], 0, [1])
    with pytest.raises(Exception, match="seed"):
        worker.loss_and_grads(x, y, seed=-5)
    # The child is still serving.
    loss, _ = worker.loss_and_grads(x, y, seed=7)
    assert loss == worker.loss_and_grads(x, y, seed=7)[0]
