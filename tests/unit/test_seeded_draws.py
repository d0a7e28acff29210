"""A program's random draws are a function of (job, round, node, samples) (node_agent.sandbox
.seeding), so that a checker recomputing a worker's chunk draws the worker's dropout masks,
noise and permutations; uninitialised `empty` buffers are zero-filled at load
(epochmesh.program.zero_fill). The job's program runs in process here (the agent's compute
functions take either kind of program; the confined child's side:
tests/integration/test_seeded_draws.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epochmesh.dataset import ShardedDataset
from epochmesh.export_cache import ExportCache
from epochmesh.optim import build_optimizer
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram
from epochmesh.spec import load_spec
from epochmesh.verification import chunk_bounds, local_sgd_grid
from node_agent.core.slowdown import SlowdownController
from node_agent.sandbox.seeding import SeedScope, compute_seed, micro_seed, valid_seed
from node_agent.training.compute import (
    accumulated_loss_and_grads,
    chunk_seeds,
    compute_chunks,
    grouped_local_chunks,
    local_sgd_steps,
    recompute_local_chunk,
)
from tests.fixtures import make_classification, write_job
from tests.random_models import RANDOM_MLP_MODEL

pytestmark = pytest.mark.timeout(120)

N = 64
JOB = "j-random"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    doc = {
        "name": "random-draws",
        "model": {"file": "model.py", "loss": "cross_entropy"},
        "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
        "train": {
            "epochs": 1,
            "global_batch": 16,
            "micro_batch": 2,
            "optimizer": "sgd",
            "lr": 0.1,
            "momentum": 0.9,
            "seed": 1,
        },
        "cluster": {"aggregation": "ps", "min_nodes": 1, "max_nodes": 2},
    }
    job_dir = tmp_path_factory.mktemp("random")
    path = write_job(job_dir, RANDOM_MLP_MODEL, make_classification(N), doc)
    return build_job(load_spec(path), cache=ExportCache.default())


def program_of(packed: PackedJob) -> TrainableProgram:
    return TrainableProgram.from_bytes(packed.program, packed.initial_state)


def dataset_of(packed: PackedJob) -> ShardedDataset:
    return ShardedDataset(packed.shards, inputs=["x"], targets=["y"])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def relative_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    flat_a = torch.cat([a[k].reshape(-1).double() for k in sorted(a)])
    flat_b = torch.cat([b[k].reshape(-1).double() for k in sorted(b)])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def test_seeds_depend_on_job_round_node_and_samples_only() -> None:
    base = compute_seed("j", 3, "n-a", [4, 5, 6])
    assert valid_seed(base) and base == compute_seed("j", 3, "n-a", [4, 5, 6])
    others = {
        compute_seed("k", 3, "n-a", [4, 5, 6]),
        compute_seed("j", 4, "n-a", [4, 5, 6]),
        compute_seed("j", 3, "n-b", [4, 5, 6]),
        compute_seed("j", 3, "n-a", [4, 5, 7]),
        compute_seed("j", 3, "n-a", [5, 4, 6]),
        compute_seed("j", 3, "n-a", [4, 5]),
        # no ambiguity between the fields' boundaries
        compute_seed("j3", 3, "n-a", [4, 5, 6]),
    }
    assert base not in others and len(others) == 7
    assert micro_seed(base, 0) != micro_seed(base, 1) and valid_seed(micro_seed(base, 9))
    assert SeedScope("j", 3, "n-a").seed([4, 5, 6]) == base
    assert not valid_seed(-1) and not valid_seed(1 << 63) and not valid_seed(True)


def test_uninitialised_buffers_are_zero_filled_at_load(packed: PackedJob) -> None:
    program = program_of(packed)
    graphs = [m for m in program._module.modules() if isinstance(m, torch.fx.GraphModule)]
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "aten.zeros.default" in targets
    assert not {t for t in targets if "empty" in t}, targets


def test_a_checker_draws_what_the_worker_drew(packed: PackedJob) -> None:
    worker, checker = program_of(packed), program_of(packed)
    dataset = dataset_of(packed)
    indices = list(range(8, 48))
    batch = dataset.get_batch(indices)
    scope = SeedScope(JOB, 7, "n-worker")
    chunks, _ = compute_chunks(
        worker, batch, SlowdownController(), 4, 4, seeds=chunk_seeds(scope, indices, 4)
    )
    # The program is random: unseeded, the same chunk twice gives two gradients.
    a, b = chunk_bounds(len(indices), 4)[1]
    x, y = dataset.get_batch(indices[a:b])
    _, g1 = accumulated_loss_and_grads(checker, x, y, 4)
    _, g2 = accumulated_loss_and_grads(checker, x, y, 4)
    assert not same(g1, g2)
    # Seeded as the worker (its node id, the chunk's samples), each chunk recomputed on its
    # own by another program gives the worker's numbers bit for bit.
    for i, (a, b) in enumerate(chunk_bounds(len(indices), 4)):
        x, y = dataset.get_batch(indices[a:b])
        loss, grads = accumulated_loss_and_grads(checker, x, y, 4, scope.seed(indices[a:b]))
        assert loss == chunks.losses[i]
        assert same({k: g.to(torch.float32) for k, g in grads.items()}, chunks.grads[i])
    # The checker's own node id would draw other masks.
    a, b = chunk_bounds(len(indices), 4)[0]
    x, y = dataset.get_batch(indices[a:b])
    mine = SeedScope(JOB, 7, "n-checker").seed(indices[a:b])
    _, other = accumulated_loss_and_grads(checker, x, y, 4, mine)
    assert not same(other, chunks.grads[0])


def test_a_local_sgd_chunk_recomputed_from_its_start_state_matches(
    packed: PackedJob, tmp_path: Path
) -> None:
    spec = packed.spec
    worker = program_of(packed)
    dataset = dataset_of(packed)
    slices = [list(range(i, i + 4)) for i in range(0, 32, 4)]  # 8 inner steps of 4 samples
    scope = SeedScope(JOB, 2, "n-worker")
    optimizer = build_optimizer(spec, worker.parameters())
    update = local_sgd_steps(
        worker,
        optimizer,
        slices,
        dataset.get_batch,
        SlowdownController(),
        micro_batch=spec.micro_batch,
        chunk_steps=local_sgd_grid(len(slices), 2),
        scope=scope,
    )
    assert update.chunks is not None
    chunks = grouped_local_chunks(update.chunks, 2)
    assert len(chunks.grads) == 2
    steps_before = len(slices) // 2
    checker = program_of(packed)
    for i, start in enumerate(chunks.starts):
        todo = slices[i * steps_before : (i + 1) * steps_before]
        again = recompute_local_chunk(
            checker, spec, start, todo, dataset.get_batch, SlowdownController(), scope
        )
        # (the chunk's parameter difference is taken between two start states, the
        # recomputation's between its start and end: equal up to float rounding)
        assert relative_gap(again.tensors, chunks.grads[i]) <= 1e-6, i
    # Without the worker's scope the steps draw other masks.
    other = recompute_local_chunk(
        checker,
        spec,
        chunks.starts[0],
        slices[:steps_before],
        dataset.get_batch,
        SlowdownController(),
        SeedScope(JOB, 2, "n-checker"),
    )
    assert relative_gap(other.tensors, chunks.grads[0]) > 1e-2
