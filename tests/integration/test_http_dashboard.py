"""The coordinator's HTTP port against an in-process coordinator (real gRPC, real SQLite, real
HTTP on loopback): /metrics with the gRPC interceptor's and the cluster's families, the JSON
API, bad input answered without disturbing the coordinator, the login with join tokens and
its roles, and metrics that stay bounded however many jobs have come and gone.

HTTP calls run in a thread (``asyncio.to_thread``): the server answers by running reads on the
coordinator's loop, which is this test's loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from coordinator.app import Coordinator
from coordinator.trust.tokens import create_token
from epochmesh.identity import (
    AUTH_MAX_SKEW_MS,
    LOGIN_CODE_PREFIX,
    enroll_with_token,
    make_login_code,
)
from epochmesh.timeutil import now_ms
from epochmesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.procs import (
    aio_channel_for,
    async_wait_until,
    health_status,
    in_process_coordinator,
)

pytestmark = pytest.mark.timeout(60)


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> object:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def _request(
    url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
) -> Reply:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return Reply(resp.status, resp.read(), dict(resp.headers))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read(), dict(exc.headers))


async def fetch(
    coord: Coordinator,
    path: str,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    url = f"http://{coord.http_address}{path}"
    if body is not None:  # the login takes JSON only (urllib would say a form)
        headers = {"Content-Type": "application/json", **(headers or {})}
    return await asyncio.to_thread(_request, url, method, body, headers)


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of the Prometheus text ``text`` (None: absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if line.startswith(name + " ") and not labels:
            return float(line.rsplit(" ", 1)[1])
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def scrape_until(coord: Coordinator, pred: Callable[[str], object]) -> str:
    """/metrics once ``pred`` holds of it (the cluster read is shared for half a second)."""
    texts: list[str] = []

    async def holds() -> bool:
        texts.append((await fetch(coord, "/metrics")).text)
        return bool(pred(texts[-1]))

    await async_wait_until(holds, timeout=10, interval=0.1)
    return texts[-1]


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with in_process_coordinator(tmp_path / "c", http_listen="127.0.0.1:0") as c:
        yield c


async def _register(coord: Coordinator, name: str) -> agent_pb2.RegisterResponse:
    async with aio_channel_for(coord.address, "node") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        return await stub.Register(
            agent_pb2.RegisterRequest(
                name=name,
                devices=[common_pb2.Device(kind="cpu", name="cpu", cores=2)],
            )
        )


async def test_metrics_and_overview_read_the_cluster(coord: Coordinator) -> None:
    assert (coord.config.data_dir / "http.addr").read_text().strip() == coord.http_address
    await _register(coord, "alpha")
    async with aio_channel_for(coord.address) as ch:
        jobs = job_pb2_grpc.JobServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await jobs.GetJob(job_pb2.GetJobRequest(job_id="j-" + "0" * 10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        await sched.ClusterStats(scheduler_pb2.ClusterStatsRequest())

    reply = await fetch(coord, "/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    text = reply.text
    assert sample(text, "epochmesh_nodes", state="ONLINE") == 1
    assert sample(text, "epochmesh_nodes", state="QUARANTINED") == 0
    assert sample(text, "epochmesh_jobs", state="RUNNING") == 0
    register = "/epochmesh.v1.AgentService/Register"
    assert sample(text, "epochmesh_grpc_calls_total", method=register, code="OK") == 1
    get_job = "/epochmesh.v1.JobService/GetJob"
    assert sample(text, "epochmesh_grpc_calls_total", method=get_job, code="NOT_FOUND") == 1
    assert sample(text, "epochmesh_grpc_call_seconds_count", method=register) == 1
    assert (sample(text, "epochmesh_grpc_received_bytes_total", method=register) or 0) > 0
    assert (sample(text, "epochmesh_grpc_sent_bytes_total", method=register) or 0) > 0
    assert sample(text, "epochmesh_events_total", kind="node.registered") == 1
    assert sample(text, "epochmesh_quarantines_total") == 0
    assert "# TYPE epochmesh_round_duration_seconds histogram" in text
    assert "# TYPE epochmesh_ledger_balance_micro gauge" in text

    overview = (await fetch(coord, "/api/overview")).json()
    assert isinstance(overview, dict)
    assert [n["name"] for n in overview["nodes"]] == ["alpha"]
    assert overview["nodes"][0]["state"] == "ONLINE"
    assert overview["nodes"][0]["device"] == "cpu"
    assert overview["viewer"] == {"role": "operator", "principal": ""}
    events = (await fetch(coord, "/api/events?since=0&limit=10")).json()
    assert isinstance(events, dict)
    assert "node.registered" in [e["kind"] for e in events["events"]]
    page = await fetch(coord, "/")
    assert page.status == 200 and b"/static/app.js" in page.body
    script = await fetch(coord, "/static/app.js")
    assert script.status == 200 and script.headers["Content-Type"].startswith("text/javascript")


async def test_bad_input_is_answered_and_the_coordinator_goes_on(coord: Coordinator) -> None:
    unknown = "j-" + "ab" * 5
    cases = [
        ("GET", f"/api/jobs/{unknown}", None, 404),
        ("GET", f"/jobs/{unknown}", None, 404),
        ("GET", "/api/jobs/not-a-job", None, 404),  # a name no job has (as in the CLI)
        ("GET", "/api/jobs/" + "x" * 101, None, 400),  # longer than any name or id
        ("GET", "/jobs/%00%ff", None, 400),
        ("GET", "/api/jobs/j-0123456789?since_round=-1", None, 400),
        ("GET", "/api/events?since=abc", None, 400),
        ("GET", "/api/events?limit=" + "9" * 40, None, 400),
        ("GET", "/nowhere", None, 404),
        ("GET", "/static/../server.py", None, 404),
        ("GET", "/static/.hidden.js", None, 404),
        ("DELETE", "/api/overview", None, 405),
        ("POST", "/api/overview", b"{}", 405),
        ("POST", "/api/login", b"x" * 10_000, 413),
        ("POST", "/api/login", b"not json", 400),
        ("POST", "/api/login", b'{"token": 5}', 400),
        ("POST", "/api/login", b'{"token": "emt1.bogus"}', 401),
    ]
    for method, path, body, status in cases:
        reply = await fetch(coord, path, method, body)
        assert reply.status == status, (method, path, reply.status, reply.body[:200])
        if path.startswith("/api/"):
            assert isinstance(reply.json(), dict)
    page = await fetch(coord, f"/jobs/{unknown}")
    assert b"404" in page.body and page.headers["Content-Type"].startswith("text/html")
    # Garbage on the socket, then a normal request.
    reader, writer = await asyncio.open_connection(*coord.http_address.rsplit(":", 1))
    writer.write(b"\x16\x03\x01 garbage\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    assert await asyncio.to_thread(health_status, coord.address) == "SERVING"
    assert (await fetch(coord, "/metrics")).status == 200
    assert (await fetch(coord, "/api/overview")).status == 200


async def test_login_roles_and_revocation(tmp_path: Path) -> None:
    async with in_process_coordinator(
        tmp_path / "c", http_listen="127.0.0.1:0", http_login=True
    ) as coord:
        assert coord.ca is not None
        for path in ("/api/overview", "/metrics", f"/api/jobs/j-{'0' * 10}", "/api/whoami"):
            assert (await fetch(coord, path)).status == 401, path
        page = await fetch(coord, "/")
        assert page.status == 401 and b"login-form" in page.body
        static = await fetch(coord, "/static/style.css")
        assert static.status == 200

        node_token = await create_token(coord.store, coord.ca, "node", 3600)
        refused = await fetch(
            coord, "/api/login", "POST", json.dumps({"token": node_token}).encode()
        )
        assert refused.status == 403
        # The node token was not spent: it still enrolls a node.
        node = await asyncio.to_thread(enroll_with_token, coord.address, node_token)
        assert node.principal.role == "node"

        submitter = await create_token(coord.store, coord.ca, "submitter", 3600)
        login = await fetch(coord, "/api/login", "POST", json.dumps({"token": submitter}).encode())
        assert login.status == 200
        body = login.json()
        assert isinstance(body, dict) and body["role"] == "submitter"
        cookie = login.headers["Set-Cookie"].split(";", 1)[0]
        assert "HttpOnly" in login.headers["Set-Cookie"]
        who = (await fetch(coord, "/api/whoami", headers={"Cookie": cookie})).json()
        assert isinstance(who, dict) and who["principal"] == body["principal"]
        assert (await fetch(coord, "/metrics", headers={"Cookie": cookie})).status == 403
        assert (await fetch(coord, "/api/overview", headers={"Cookie": cookie})).status == 200
        # A single-use token opens one session.
        again = await fetch(coord, "/api/login", "POST", json.dumps({"token": submitter}).encode())
        assert again.status == 401

        operator = await create_token(coord.store, coord.ca, "operator", 3600)
        op = await fetch(coord, "/api/login", "POST", json.dumps({"token": operator}).encode())
        op_body = op.json()
        assert isinstance(op_body, dict)
        bearer = {"Authorization": f"Bearer {op_body['session']}"}
        assert (await fetch(coord, "/metrics", headers=bearer)).status == 200

        # Revoking the submitter's principal ends its session.
        async with aio_channel_for(coord.address) as ch:
            sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            await sched.Revoke(scheduler_pb2.RevokeRequest(principal=str(body["principal"])))
        assert (await fetch(coord, "/api/overview", headers={"Cookie": cookie})).status == 401
        out = await fetch(coord, "/api/logout", "POST", b"", headers=bearer)
        assert out.status == 200
        assert (await fetch(coord, "/metrics", headers=bearer)).status == 401


async def test_metrics_count_the_node_events_dropped_for_their_rate_limit(
    coord: Coordinator,
) -> None:
    """A node that causes more events than its burst (reference benchmarks here, each one an
    event) has the excess dropped; /metrics counts them as the event log does."""
    text = (await fetch(coord, "/metrics")).text
    assert sample(text, "epochmesh_node_events_dropped_total") == 0
    reg = await _register(coord, "chatty")
    async with aio_channel_for(coord.address, "node") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        for i in range(200):
            await stub.ReportBenchmark(
                agent_pb2.ReportBenchmarkRequest(
                    node_id=reg.node_id,
                    lease_id=reg.lease_id,
                    result=common_pb2.BenchmarkResult(samples_per_second=100.0 + i),
                ),
                timeout=10,
            )
    dropped = coord.events.dropped_total
    assert dropped > 0
    await scrape_until(coord, lambda t: sample(t, "epochmesh_node_events_dropped_total") == dropped)
    text = (await fetch(coord, "/metrics")).text
    assert "# TYPE epochmesh_node_events_dropped_total counter" in text


async def test_metrics_stay_bounded_as_jobs_come_and_go(tmp_path: Path) -> None:
    async with in_process_coordinator(
        tmp_path / "c", http_listen="127.0.0.1:0", metrics_retention_s=0.0
    ) as coord:
        sizes = []
        for batch in range(3):
            for i in range(40):
                job = await coord.store.create_job(
                    common_pb2.Job(name=f"job-{batch}-{i}", state=common_pb2.JOB_STATE_RUNNING),
                    owner="u-test",
                )
                for r in (1, 2):
                    await coord.store.add_round(
                        common_pb2.RoundRecord(
                            job_id=job.job_id,
                            round=r,
                            started_ms=1000 * r,
                            finished_ms=1000 * r + 250,
                            loss=1.0 / r,
                            parts=[
                                common_pb2.RoundPart(
                                    node_id=f"n-{batch}-{i}",
                                    status="applied",
                                    ranges=[common_pb2.SampleRange(start=0, stop=8)],
                                    seconds=0.2,
                                    communicate_seconds=0.05,
                                )
                            ],
                        )
                    )
                job.state = common_pb2.JOB_STATE_SUCCEEDED
                job.updated_ms = 1  # ended long ago
                await coord.store.update_job(job)
            ended = 40 * (batch + 1)
            text = await scrape_until(
                coord, lambda t, n=ended: sample(t, "epochmesh_jobs", state="SUCCEEDED") == n
            )
            sizes.append(len(text))
            assert "epochmesh_round_duration_seconds_bucket{job=" not in text
            assert "epochmesh_job_rounds_total{" not in text
        assert max(sizes) - min(sizes) < 200, sizes

        live = await coord.store.create_job(
            common_pb2.Job(name="live", state=common_pb2.JOB_STATE_RUNNING), owner="u-test"
        )
        await coord.store.add_round(
            common_pb2.RoundRecord(job_id=live.job_id, round=1, started_ms=0, finished_ms=300)
        )
        text = await scrape_until(
            coord, lambda t: sample(t, "epochmesh_round_duration_seconds_count", job=live.job_id)
        )
        assert sample(text, "epochmesh_round_duration_seconds_count", job=live.job_id) == 1
        assert (
            sample(text, "epochmesh_round_duration_seconds_bucket", job=live.job_id, le="0.5") == 1
        )


async def test_a_cli_user_opens_the_dashboard_as_itself(tmp_path: Path) -> None:
    """`epochmesh dashboard`'s login code: the session is the CLI identity's own principal
    (its jobs, its role), the code opens one session, and a stale, forged, node's or revoked
    one opens none."""
    async with in_process_coordinator(
        tmp_path / "c", http_listen="127.0.0.1:0", http_login=True
    ) as coord:
        assert coord.ca is not None

        async def log_in(code: str) -> Reply:
            return await fetch(coord, "/api/login", "POST", json.dumps({"token": code}).encode())

        token = await create_token(coord.store, coord.ca, "submitter", 3600)
        alice = await asyncio.to_thread(enroll_with_token, coord.address, token)
        mine = await coord.store.create_job(common_pb2.Job(name="mine"), owner=alice.principal.id)
        theirs = await coord.store.create_job(common_pb2.Job(name="theirs"), owner="u-other")

        code = make_login_code(alice)
        login = await log_in(code)
        assert login.status == 200, login.text
        body = login.json()
        assert isinstance(body, dict)
        assert (body["principal"], body["role"]) == (alice.principal.id, "submitter")
        cookie = {"Cookie": login.headers["Set-Cookie"].split(";", 1)[0]}
        assert (await fetch(coord, f"/api/jobs/{mine.job_id}", headers=cookie)).status == 200
        assert (await fetch(coord, f"/api/jobs/{theirs.job_id}", headers=cookie)).status == 404

        replay = await log_in(code)
        assert replay.status == 401 and "used already" in replay.text
        stale = make_login_code(alice, now_ms=now_ms() - AUTH_MAX_SKEW_MS - 60_000)
        assert (await log_in(stale)).status == 401
        forged = code[: -len(code.rsplit(".", 1)[1])] + "AAAA"
        assert (await log_in(forged)).status == 401
        for malformed in (LOGIN_CODE_PREFIX, LOGIN_CODE_PREFIX + "a.b.c", LOGIN_CODE_PREFIX * 900):
            assert (await log_in(malformed)).status in (400, 401, 413), malformed
        # Another coordinator's user is nobody here.
        async with in_process_coordinator(tmp_path / "other") as other:
            assert other.ca is not None
            foreign_token = await create_token(other.store, other.ca, "submitter", 3600)
            foreign = await asyncio.to_thread(enroll_with_token, other.address, foreign_token)
        assert (await log_in(make_login_code(foreign))).status == 401
        # A node's certificate does not open the dashboard.
        node_token = await create_token(coord.store, coord.ca, "node", 3600)
        node = await asyncio.to_thread(enroll_with_token, coord.address, node_token)
        assert (await log_in(make_login_code(node))).status == 403
        # A revoked user's codes open nothing.
        async with aio_channel_for(coord.address) as ch:
            sched = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            await sched.Revoke(scheduler_pb2.RevokeRequest(principal=alice.principal.id))
        assert (await log_in(make_login_code(alice))).status == 401
        assert (await fetch(coord, "/api/overview", headers=cookie)).status == 401
