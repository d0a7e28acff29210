"""The agent's Prometheus metrics (``epochmesh-agent --metrics-listen HOST:PORT``): tasks by
kind and outcome, training steps and samples, bytes to and from the coordinator by method
(client interceptors on its channel), and, read at scrape time, the blob cache's size and the
memory of the agent with its program children and of its device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import psutil
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epochmesh.v1 import agent_pb2

log = logging.getLogger(__name__)

TASK_KINDS = {v: k.removeprefix("TASK_KIND_").lower() for k, v in agent_pb2.TaskKind.items()}


def task_samples(task: agent_pb2.Task) -> int:
    return sum(max(0, r.stop - r.start) for r in task.ranges)


def task_steps(task: agent_pb2.Task) -> int:
    """Optimizer steps a finished TRAIN task took (local SGD: its inner steps; else one)."""
    return max(1, task.inner_steps) if task.kind == agent_pb2.TASK_KIND_TRAIN else 0


def directory_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def process_tree_rss(pid: int) -> int:
    """Resident memory of a process and its descendants (the program children)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


class _StateCollector(Collector):
    def __init__(self, cache_dir: Path, device: Callable[[], tuple[str, int, int]]) -> None:
        self._cache_dir = cache_dir
        self._device = device

    def collect(self) -> Iterable[Any]:
        cache = GaugeMetricFamily(
            "epochmesh_agent_cache_bytes", "Bytes in the agent's verified blob cache"
        )
        cache.add_metric([], directory_bytes(self._cache_dir))
        rss = GaugeMetricFamily(
            "epochmesh_agent_memory_rss_bytes",
            "Resident memory of the agent and its program children",
        )
        rss.add_metric([], process_tree_rss(os.getpid()))
        name, used, total = self._device()
        device_used = GaugeMetricFamily(
            "epochmesh_agent_device_memory_used_bytes",
            "Memory in use on the training device (a CPU: the agent's resident memory)",
            labels=["device"],
        )
        device_total = GaugeMetricFamily(
            "epochmesh_agent_device_memory_total_bytes",
            "Memory of the training device",
            labels=["device"],
        )
        if name:
            device_used.add_metric([name], used)
            device_total.add_metric([name], total)
        return [cache, rss, device_used, device_total]


class AgentMetrics:
    """Counters the agent feeds, and the registry its metrics port serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tasks = Counter(
            "epochmesh_agent_tasks",
            "Tasks finished, by kind and outcome (ok, failed, cancelled)",
            ("kind", "outcome"),
            registry=self.registry,
        )
        self.steps = Counter(
            "epochmesh_agent_steps",
            "Optimizer steps of finished TRAIN tasks",
            registry=self.registry,
        )
        self.samples = Counter(
            "epochmesh_agent_samples",
            "Samples handed to this node in TRAIN tasks that finished without failure",
            registry=self.registry,
        )
        self.sent = Counter(
            "epochmesh_agent_sent_bytes",
            "Bytes of messages sent to the coordinator, by method",
            ("method",),
            registry=self.registry,
        )
        self.received = Counter(
            "epochmesh_agent_received_bytes",
            "Bytes of messages received from the coordinator, by method",
            ("method",),
            registry=self.registry,
        )

    def watch(self, cache_dir: Path, device: Callable[[], tuple[str, int, int]]) -> None:
        """Adds the gauges read at scrape time; ``device()`` -> (name, used, total bytes)."""
        self.registry.register(_StateCollector(cache_dir, device))

    def task_finished(self, task: agent_pb2.Task, failed: bool, cancelled: bool) -> None:
        outcome = "cancelled" if cancelled else "failed" if failed else "ok"
        self.tasks.labels(TASK_KINDS.get(task.kind, str(task.kind)), outcome).inc()
        if outcome == "ok" and task.kind == agent_pb2.TASK_KIND_TRAIN:
            self.steps.inc(task_steps(task))
            self.samples.inc(task_samples(task))

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [
            _UnaryUnaryBytes(self),
            _UnaryStreamBytes(self),
            _StreamUnaryBytes(self),
            _StreamStreamBytes(self),
        ]

    def serve(self, listen: str) -> str:
        """Starts the metrics port (a thread of prometheus_client); its HOST:PORT."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        server, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        bound = server.server_address[1]
        return f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"


def _size(message: Any) -> int:
    try:
        return int(message.ByteSize())
    except AttributeError:
        return 0


def _method(details: grpc.aio.ClientCallDetails) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


class _Bytes:
    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def out(self, details: grpc.aio.ClientCallDetails, message: Any) -> None:
        self._metrics.sent.labels(_method(details)).inc(_size(message))

    def into(self, details: grpc.aio.ClientCallDetails, message: Any) -> None:
        self._metrics.received.labels(_method(details)).inc(_size(message))

    async def _count_requests(
        self, details: grpc.aio.ClientCallDetails, requests: Any
    ) -> AsyncIterator[Any]:
        if hasattr(requests, "__aiter__"):
            async for message in requests:
                self.out(details, message)
                yield message
        else:
            for message in requests:
                self.out(details, message)
                yield message

    async def _count_responses(
        self, details: grpc.aio.ClientCallDetails, call: Any
    ) -> AsyncIterator[Any]:
        async for message in call:
            self.into(details, message)
            yield message


# grpc.aio files an interceptor under the first of the four kinds it implements: one per kind.
class _UnaryUnaryBytes(_Bytes, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.out(details, request)
        call = await continuation(details, request)
        try:
            response = await call
        except grpc.RpcError:
            return call  # the caller awaits it and gets the error itself
        self.into(details, response)
        return call


class _UnaryStreamBytes(_Bytes, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self.out(details, request)
        call = await continuation(details, request)
        return self._count_responses(details, call)


class _StreamUnaryBytes(_Bytes, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(details, self._count_requests(details, requests))


class _StreamStreamBytes(_Bytes, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        call = await continuation(details, self._count_requests(details, requests))
        return self._count_responses(details, call)
