"""The dashboard takes a job as the CLI does (epochmesh/job_ref.py): a full id, a unique id
prefix or a job's name, on the job page and in its JSON API; several matches are a 400 that
lists them, none a 404."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

from epochmesh.v1 import common_pb2
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(60)

QUEUED = common_pb2.JOB_STATE_QUEUED


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def test_job_pages_take_names_and_prefixes(tmp_path: Path) -> None:
    async with in_process_coordinator(tmp_path / "c", http_listen="127.0.0.1:0") as coord:
        zen = await coord.store.create_job(
            common_pb2.Job(name="zen-of-python", state=QUEUED), owner="u-a"
        )
        spaced = await coord.store.create_job(
            common_pb2.Job(name="my job / v2", state=QUEUED), owner="u-a"
        )
        twins = [
            await coord.store.create_job(common_pb2.Job(name="twin", state=QUEUED), owner="u-a")
            for _ in "ab"
        ]

        async def get(path: str) -> tuple[int, bytes]:
            return await asyncio.to_thread(_get, f"http://{coord.http_address}{path}")

        others = [spaced.job_id, *(t.job_id for t in twins)]
        prefix = next(
            zen.job_id[:n]
            for n in range(3, 13)
            if not any(o.startswith(zen.job_id[:n]) for o in others)
        )
        for ref, job in (
            ("zen-of-python", zen),
            (zen.job_id, zen),
            (prefix, zen),
            (quote("my job / v2", safe=""), spaced),
        ):
            status, body = await get(f"/api/jobs/{ref}")
            assert status == 200, (ref, body[:300])
            assert json.loads(body)["job"]["job_id"] == job.job_id
            status, body = await get(f"/jobs/{ref}")
            assert status == 200 and b"/static/app.js" in body, (ref, status)

        status, body = await get("/api/jobs/twin")
        assert status == 400
        message = json.loads(body)["error"]
        assert "2 jobs" in message and all(t.job_id in message for t in twins), message
        assert (await get("/api/jobs/no-such-job"))[0] == 404
        assert (await get("/jobs/no-such-job"))[0] == 404
