"""Fixtures shared by the integration tests: stubs on a channel to the module's `coord`
fixture (each module defines `coord`, an in-process Coordinator configured for its tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from coordinator.app import Coordinator
from epochmesh.v1 import agent_pb2_grpc, job_pb2_grpc, scheduler_pb2_grpc
from tests.procs import aio_channel_for


@pytest.fixture
async def channel(coord: Coordinator) -> AsyncIterator[grpc.aio.Channel]:
    async with aio_channel_for(coord.address) as ch:
        yield ch


@pytest.fixture
def agent(channel: grpc.aio.Channel) -> agent_pb2_grpc.AgentServiceStub:
    return agent_pb2_grpc.AgentServiceStub(channel)


@pytest.fixture
def sched(channel: grpc.aio.Channel) -> scheduler_pb2_grpc.SchedulerServiceStub:
    return scheduler_pb2_grpc.SchedulerServiceStub(channel)


@pytest.fixture
def jobs(channel: grpc.aio.Channel) -> job_pb2_grpc.JobServiceStub:
    return job_pb2_grpc.JobServiceStub(channel)
