"""The coordinator side of local SGD and compression in parameter-server mode, with the real
engine over real gRPC + TLS; the agents are played by the test (tests/integration/fake_agent.py)
so that what they push is known exactly.

- Planning: every node gets local_batch = b_i and, but in an epoch's last round, a time box and
  ranges for more steps than the box is sized for. The agents here train the first H steps of
  a boxed task (their box ran out): the coordinator records and commits that prefix and hands
  the rest out again; an epoch's last round is not boxed (all of its ranges are trained, no
  tail is left); every epoch covers every sample exactly once.
- Aggregation: the job's result equals the outer Nesterov optimizer applied, round by round,
  to the sample-weighted mean of the pseudo-gradients the agents pushed (int8-decoded).
- Hostile input: a float tensor not encoded with the job's codec, a "gradient" in a local
  SGD job, or a sample count that is not a whole number of steps, is INVALID_ARGUMENT with a
  strike; the round goes on without that part.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from coordinator.engine.engine import Engine
from epochmesh import identity as idm
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import build_job
from epochmesh.spec import load_spec
from epochmesh.v1 import agent_pb2, common_pb2, job_pb2, job_pb2_grpc
from epochmesh.wire.compression import ErrorFeedback
from epochmesh.wire.tensors import decode_bundle, encode_bundle
from tests.fixtures import make_classification, write_mlp_job
from tests.integration.fake_agent import FakeAgent, submit_packed, task_indices
from tests.procs import async_wait_until, in_process_coordinator

pytestmark = pytest.mark.timeout(90)

H = 3
GLOBAL_BATCH = 16
NUM_SAMPLES = 160
INNER_LR = 0.1
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class LocalSgdWorker:
    """An honest local SGD agent (plain PyTorch): H inner SGD steps of b_i samples from the
    round's parameters, pseudo-gradient start - end, int8 with error feedback."""

    def __init__(self, data: dict[str, torch.Tensor], pushed: dict) -> None:
        self.data = data
        self.pushed = pushed  # (round, node) -> (samples, decoded pseudo-gradient)
        self.model = _model()
        self.inner = torch.optim.SGD(self.model.parameters(), lr=INNER_LR, momentum=0.9)
        self.ef = ErrorFeedback("int8")
        # What to do wrong next: "fp32" | "gradient" | "ragged".
        self.misbehave: list[str] = []

    def _inner_steps(
        self, params: dict[str, torch.Tensor], idx: list[int], b: int
    ) -> tuple[dict[str, torch.Tensor], float]:
        names = list(params)
        with torch.no_grad():
            for p, n in zip(self.model.parameters(), names, strict=True):
                p.copy_(params[n])
        losses = []
        for k in range(0, len(idx), b):
            sel = torch.tensor(idx[k : k + b])
            self.inner.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                self.model(self.data["x"][sel]), self.data["y"][sel]
            )
            loss.backward()
            self.inner.step()
            losses.append(loss.item() * len(sel))
        delta = {
            n: (params[n] - p.detach()).clone()
            for n, p in zip(names, self.model.parameters(), strict=True)
        }
        return delta, sum(losses) / len(idx)

    async def __call__(self, agent: FakeAgent, task: agent_pb2.Task) -> None:
        steps = math.ceil(len(task_indices(task)) / task.local_batch)
        assert task.inner_steps == max(H, steps)
        version, params = await agent.pull(task.job_id, task.params_version)
        assert version == task.params_version
        # A small model's parameters also travel inline with the task: the same ones.
        assert task.HasField("params_bundle"), "small parameters were not sent with the task"
        inline = decode_bundle(task.params_bundle, task.params_data)
        assert list(inline) == list(params)
        assert all(torch.equal(inline[k], v) for k, v in params.items())
        # A boxed task: the box ran out after H steps, the update covers their samples (a
        # prefix). Unboxed (an epoch's last round): all of them.
        idx = task_indices(task)
        if task.compute_budget_seconds > 0:
            idx = idx[: H * task.local_batch]
        delta, mean_loss = await asyncio.to_thread(self._inner_steps, params, idx, task.local_batch)
        # As long as the agent says it took: compute, not communication, sets the rounds' pace
        # (rounds that are mostly communication are not time-boxed).
        await asyncio.sleep(len(idx) / agent.rate)
        fields = dict(num_samples=len(idx), mean_loss=mean_loss)
        if self.misbehave:
            what = self.misbehave.pop(0)
            if what == "ragged" and len(idx) > 1:  # a prefix of whole steps only
                fields["num_samples"] = len(idx) - 1
                await agent.push(task, delta, kind="pseudo_gradient", codec="int8", **fields)
            elif what == "fp32":  # float tensors must use the job's codec
                await agent.push(task, delta, kind="pseudo_gradient", codec="none", **fields)
            else:  # a gradient is not what a local SGD job takes
                await agent.push(task, delta, kind="gradient", codec="int8", **fields)
            return
        bundle = encode_bundle(delta, "int8", error_feedback=self.ef)
        reply = await agent.push(
            task,
            delta,
            kind="pseudo_gradient",
            bundle=bundle,
            compute_seconds=len(idx) / agent.rate,
            **fields,
        )
        if reply.accepted:
            self.pushed[(task.round, agent.node_id)] = (len(idx), decode_bundle(*bundle))


async def test_local_sgd_int8_rounds_match_the_outer_optimizer(tmp_path: Path) -> None:
    job_toml = write_mlp_job(
        tmp_path / "job",
        NUM_SAMPLES,
        overrides={
            "train": {
                "epochs": 2,
                "global_batch": GLOBAL_BATCH,
                "lr": INNER_LR,
                "momentum": 0.9,
                "sync": "local_sgd",
                "inner_steps": H,
                "outer_lr": OUTER_LR,
                "outer_momentum": OUTER_MOMENTUM,
                "compression": "int8",
            },
            "cluster": {"min_nodes": 2, "max_nodes": 2, "checkpoint_every": 2},
        },
    )
    packed = build_job(load_spec(job_toml), cache=ExportCache.default())
    data = make_classification(NUM_SAMPLES)
    pushed: dict = {}
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=1.0
    ) as coord:
        shady = LocalSgdWorker(data, pushed)
        shady.misbehave = ["fp32", "gradient"]
        ragged = LocalSgdWorker(data, pushed)
        ragged.misbehave = ["ragged"]
        agents = [
            await FakeAgent(coord, "fast", 300.0, ragged).start(),
            await FakeAgent(coord, "slow", 100.0, shady).start(),
        ]
        try:
            job = await submit_packed(coord, packed)
            async with idm.secure_aio_channel(
                coord.address, coord.issue_identity("operator")
            ) as ch:
                jobs = job_pb2_grpc.JobServiceStub(ch)

                async def finished() -> common_pb2.Job | None:
                    j = await jobs.GetJob(job_pb2.GetJobRequest(job_id=job.job_id))
                    assert j.state != common_pb2.JOB_STATE_FAILED, j.message
                    return j if j.state == common_pb2.JOB_STATE_SUCCEEDED else None

                await async_wait_until(finished, timeout=60, message="job did not finish")
                rounds = list(
                    (await jobs.GetRounds(job_pb2.GetRoundsRequest(job_id=job.job_id))).rounds
                )
                result = b"".join(
                    [
                        m.chunk.data
                        async for m in jobs.DownloadResult(
                            job_pb2.DownloadResultRequest(job_id=job.job_id)
                        )
                    ]
                )
            shady_id = agents[1].node_id
            strikes = coord.registry.find(shady_id).strikes
            ragged_strikes = coord.registry.find(agents[0].node_id).strikes
        finally:
            for a in agents:
                await a.stop()

    # The three refused pushes: INVALID_ARGUMENT, one strike each.
    codes = [e for a in agents for e in a.errors]
    assert codes.count("INVALID_ARGUMENT") == 3, codes
    assert set(codes) <= {"INVALID_ARGUMENT", "FAILED_PRECONDITION"}, codes  # late pulls only
    assert (strikes, ragged_strikes) == (2, 1)

    # Planning: b_i per step; boxed tasks may hold more steps than their box is sized for.
    tasks = [t for a in agents for t in a.tasks]
    boxed = [t for t in tasks if t.compute_budget_seconds > 0]
    assert len(boxed) >= len(tasks) // 2
    assert sum(len(task_indices(t)) > H * t.local_batch for t in boxed) >= len(boxed) // 2
    assert all(len(task_indices(t)) <= 2 * H * t.local_batch for t in tasks)

    # Records: exactly once per epoch over applied parts; inner steps and times filled in.
    by_epoch: dict[int, list[int]] = defaultdict(list)
    statuses = defaultdict(int)
    for rnd in rounds:
        for part in rnd.parts:
            statuses[part.status] += 1
            if part.status == "applied":
                by_epoch[rnd.epoch].extend(i for r in part.ranges for i in range(r.start, r.stop))
                samples = sum(r.stop - r.start for r in part.ranges)
                assert part.inner_steps == math.ceil(samples / part.local_batch)
                assert part.communicate_seconds >= 0
    assert statuses["rejected"] == 3, dict(statuses)
    # The applied parts of boxed rounds cover the prefixes the agents trained (H steps); the
    # last round of each epoch is not boxed and has no tail after it.
    last = {rnd.epoch: rnd.round for rnd in rounds if any(p.status == "applied" for p in rnd.parts)}
    prefixes = [
        p.inner_steps
        for rnd in rounds
        for p in rnd.parts
        if p.status == "applied" and rnd.round != last[rnd.epoch]
    ]
    assert all(k <= H for k in prefixes) and prefixes.count(H) >= len(prefixes) // 2, prefixes
    assert sorted(by_epoch) == [0, 1]
    for epoch, seen in by_epoch.items():
        assert sorted(seen) == list(range(NUM_SAMPLES)), f"epoch {epoch} not covered once"

    # Replay: the outer optimizer over the sample-weighted pseudo-gradients that were pushed.
    torch.manual_seed(0)
    model = _model()
    initial = st_load(packed.initial_state)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(initial[n])
    names = [n for n, _ in model.named_parameters()]
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for rnd in rounds:
        applied = sorted((p for p in rnd.parts if p.status == "applied"), key=lambda p: p.node_id)
        if not applied:
            continue
        contributions = [pushed[(rnd.round, p.node_id)] for p in applied]
        total = sum(s for s, _ in contributions)
        for n, p in zip(names, model.parameters(), strict=True):
            acc = torch.zeros_like(p)
            for s, delta in contributions:
                acc.add_(delta[n], alpha=s / total)
            p.grad = acc
        outer.step()
    trained = st_load(result)
    diff = max((trained[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert diff <= 1e-6, f"max abs difference {diff}"
