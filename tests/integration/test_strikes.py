"""Hostile gradient updates over real gRPC + TLS: refused with INVALID_ARGUMENT, a strike per
refused update, quarantine (and its event) at the limit.

The engine here is a small real one: it decodes the streamed bundle with the shared codec
(`epochmesh.wire.tensors.BundleAssembler`) against the expected parameter shapes, as the training
engine does; the strike bookkeeping under test is the coordinator's (AgentService +
NodeRegistry), whatever engine refuses the update.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from coordinator.core.errors import InvalidArgumentError
from coordinator.engine.api import CoordinatorContext, NullEngine
from coordinator.nodes.registry import DEFAULT_STRIKE_LIMIT
from coordinator.trust.tokens import create_token
from epochmesh import identity as idm
from epochmesh.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from epochmesh.wire.tensors import BundleAssembler, encode_bundle, iter_chunks
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(60)

EXPECTED = {"w": (torch.float32, (4, 3)), "b": (torch.float32, (3,))}


class _GradientEngine(NullEngine):
    """Accepts one gradient bundle per push, shaped like EXPECTED."""

    def __init__(self, context: CoordinatorContext) -> None:
        super().__init__(context)
        self.accepted = 0

    async def push_update(
        self, request_iterator: AsyncIterator[agent_pb2.PushUpdateRequest], ctx: object
    ) -> agent_pb2.PushUpdateResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgumentError("PushUpdate must start with a header message")
        assembler = BundleAssembler(first.header.bundle, expected=EXPECTED)
        async for msg in messages:
            assembler.add(msg.chunk)
        assembler.finish()
        self.accepted += 1
        return agent_pb2.PushUpdateResponse(accepted=True)


def _push(node_id: str, lease_id: str, tensors: dict[str, torch.Tensor]) -> list:
    bundle, payload = encode_bundle(tensors)
    header = agent_pb2.UpdateHeader(node_id=node_id, lease_id=lease_id, bundle=bundle)
    return [
        agent_pb2.PushUpdateRequest(header=header),
        *(agent_pb2.PushUpdateRequest(chunk=c) for c in iter_chunks(payload)),
    ]


async def test_bad_updates_strike_and_quarantine(tmp_path: Path) -> None:
    good = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
    bad_updates = {
        "wrong shape": {"w": torch.ones(3, 4), "b": torch.zeros(3)},
        "wrong dtype": {"w": torch.ones(4, 3, dtype=torch.float64), "b": torch.zeros(3)},
        "NaN": {"w": torch.full((4, 3), float("nan")), "b": torch.zeros(3)},
        "Inf": {"w": torch.ones(4, 3), "b": torch.tensor([1.0, float("inf"), 0.0])},
        "missing tensor": {"w": torch.ones(4, 3)},
    }
    async with in_process_coordinator(
        tmp_path / "d", engine_factory=_GradientEngine, lease_ttl_s=60.0
    ) as coord:
        node = coord.issue_identity("node")
        async with (
            idm.secure_aio_channel(coord.address, node) as ch,
            idm.secure_aio_channel(coord.address, coord.issue_identity("operator")) as op,
        ):
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            sched = scheduler_pb2_grpc.SchedulerServiceStub(op)
            reg = await agent.Register(agent_pb2.RegisterRequest(name="shady"), timeout=10)
            ok = await agent.PushUpdate(iter(_push(reg.node_id, reg.lease_id, good)), timeout=10)
            assert ok.accepted
            assert coord.registry.find(reg.node_id).strikes == 0

            for i, (what, tensors) in enumerate(bad_updates.items(), start=1):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await agent.PushUpdate(
                        iter(_push(reg.node_id, reg.lease_id, tensors)), timeout=10
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
                info = coord.registry.find(reg.node_id)
                assert info.strikes == i, what
                quarantined = i >= DEFAULT_STRIKE_LIMIT
                assert (info.state == common_pb2.NODE_STATE_QUARANTINED) == quarantined, what

            # The server kept serving; the events tell the story.
            events = [
                e
                async for e in sched.WatchEvents(
                    scheduler_pb2.WatchEventsRequest(
                        node_id=reg.node_id, kinds=["node.strike", "node.quarantined"]
                    ),
                    timeout=10,
                )
            ]
            kinds = [e.kind for e in events]
            assert kinds.count("node.strike") == len(bad_updates)
            assert kinds.count("node.quarantined") == 1
            quarantine = next(e for e in events if e.kind == "node.quarantined")
            assert quarantine.attrs["strikes"] == str(DEFAULT_STRIKE_LIMIT)
            # Quarantine survives re-registration.
            again = await agent.Register(agent_pb2.RegisterRequest(name="shady"), timeout=10)
            assert again.node_id == reg.node_id
            state = coord.registry.find(reg.node_id).state
            assert state == common_pb2.NODE_STATE_QUARANTINED


async def test_a_forged_header_earns_no_strike(tmp_path: Path) -> None:
    """An update whose header carries a wrong lease is refused without a strike (the lease is
    what ties the update to the node's session)."""
    async with in_process_coordinator(tmp_path / "d", engine_factory=_GradientEngine) as coord:
        node = coord.issue_identity("node")
        async with idm.secure_aio_channel(coord.address, node) as ch:
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            reg = await agent.Register(agent_pb2.RegisterRequest(name="n"), timeout=10)
            bad = {"w": torch.ones(1), "b": torch.zeros(3)}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent.PushUpdate(iter(_push(reg.node_id, "wrong", bad)), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert coord.registry.find(reg.node_id).strikes == 0


async def test_strikes_follow_the_donor_across_fresh_certificates(tmp_path: Path) -> None:
    """A donor whose node earned strikes cannot wipe them by enrolling a fresh node with its
    token: the strikes count over the donor's nodes, the node struck at the limit is
    quarantined, and the donor enrolls no more nodes; another donor's node is untouched."""
    wrong = {"w": torch.ones(3, 4), "b": torch.zeros(3)}
    async with in_process_coordinator(
        tmp_path / "d", engine_factory=_GradientEngine, lease_ttl_s=60.0
    ) as coord:
        assert coord.ca is not None
        shady = await create_token(coord.store, coord.ca, "node", 3600, True, donor="shady")
        honest = await create_token(coord.store, coord.ca, "node", 3600, True, donor="honest")

        async def enrolled(
            token: str, name: str
        ) -> tuple[agent_pb2_grpc.AgentServiceStub, str, str, idm.Identity]:
            ident = await asyncio.to_thread(idm.enroll_with_token, coord.address, token)
            ch = await stack.enter_async_context(idm.secure_aio_channel(coord.address, ident))
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            reg = await agent.Register(agent_pb2.RegisterRequest(name=name), timeout=10)
            return agent, reg.node_id, reg.lease_id, ident

        async def strike(agent: agent_pb2_grpc.AgentServiceStub, node_id: str, lease: str) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent.PushUpdate(iter(_push(node_id, lease, wrong)), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        async with contextlib.AsyncExitStack() as stack:
            first, first_id, first_lease, _ = await enrolled(shady, "shady-1")
            other, other_id, other_lease, _ = await enrolled(honest, "honest-1")
            for _ in range(DEFAULT_STRIKE_LIMIT - 1):
                await strike(first, first_id, first_lease)
            await strike(other, other_id, other_lease)
            # A fresh certificate with the same donor's token: one more strike is its donor's
            # last.
            fresh, fresh_id, fresh_lease, _ = await enrolled(shady, "shady-2")
            assert fresh_id != first_id
            assert coord.registry.find(fresh_id).state != common_pb2.NODE_STATE_QUARANTINED
            await strike(fresh, fresh_id, fresh_lease)
            info = coord.registry.find(fresh_id)
            assert info.strikes == 1 and info.state == common_pb2.NODE_STATE_QUARANTINED
            assert coord.registry.donor_strikes("shady") == DEFAULT_STRIKE_LIMIT
            # The honest donor's node, struck once, works on.
            assert coord.registry.find(other_id).state == common_pb2.NODE_STATE_ONLINE
            # And the quarantined donor enrolls no further node.
            with pytest.raises(grpc.RpcError) as refused:
                await asyncio.to_thread(idm.enroll_with_token, coord.address, shady)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
            assert "quarantined" in str(refused.value.details())  # type: ignore[attr-defined]
