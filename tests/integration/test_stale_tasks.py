"""Tasks handed out by another coordinator process (before a restart, or before a standby took
over) are abandoned at the node's next heartbeat: nothing waits for them, and a ring member
stuck in one would hold its next ring for its whole join timeout. A task this coordinator
handed out and has since forgotten (a check, a part of a closed round) is left to report."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from coordinator.core.ids import TASK_TAG, from_another_process, new_task_id
from coordinator.engine.engine import Engine
from epochmesh.v1 import agent_pb2, agent_pb2_grpc
from tests.procs import aio_channel_for, in_process_coordinator

pytestmark = pytest.mark.timeout(60)


def other_tag() -> str:
    while (tag := secrets.token_hex(len(TASK_TAG) // 2)) == TASK_TAG:
        pass
    return tag


def test_task_ids_carry_the_process_tag() -> None:
    ids = {new_task_id("t-") for _ in range(1000)} | {new_task_id("c-") for _ in range(1000)}
    assert len(ids) == 2000
    for task_id in ids:
        assert task_id[:2] in ("t-", "c-") and task_id[2 : 2 + len(TASK_TAG)] == TASK_TAG
        assert not from_another_process(task_id)
    mine = new_task_id("t-")
    assert from_another_process(mine[:2] + other_tag() + mine[2 + len(TASK_TAG) :])
    assert from_another_process("t-" + secrets.token_hex(6))  # an older coordinator's id
    assert from_another_process("") and from_another_process("nonsense")


async def test_a_heartbeat_with_another_processs_task_is_told_to_abandon_it(
    tmp_path: Path,
) -> None:
    async with in_process_coordinator(tmp_path / "coord", engine_factory=Engine) as coord:
        async with aio_channel_for(coord.address) as channel:
            agent = agent_pb2_grpc.AgentServiceStub(channel)
            req = agent_pb2.RegisterRequest(name="n", agent_version="test")
            req.devices.add(kind="cpu", index=0, name="test cpu", cores=2)
            reg = await agent.Register(req)

            async def cancelled(task_id: str) -> bool:
                hb = await agent.Heartbeat(
                    agent_pb2.HeartbeatRequest(
                        node_id=reg.node_id, lease_id=reg.lease_id, task_id=task_id
                    )
                )
                return bool(hb.cancel_task)

            ours = new_task_id("t-")  # handed out here, then forgotten (a closed round's)
            assert not await cancelled(ours)
            assert not await cancelled(new_task_id("c-"))
            theirs = ours[:2] + other_tag() + ours[2 + len(TASK_TAG) :]
            assert await cancelled(theirs)  # from before a restart or a takeover
            assert await cancelled("t-" + secrets.token_hex(6))  # an older coordinator's
            assert not await cancelled("")  # no task: nothing to abandon
