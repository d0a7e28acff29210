"""An upload resumes across coordinators: two coordinator processes on one PostgreSQL database
(tests/pg.py) and one blob directory (``serve --blob-dir``); a real ``epochmesh submit`` given
both addresses uploads a job of tens of MB to the active one, through a loopback relay that
limits its bandwidth (epochmesh.testing.wan) so that the upload lasts seconds. Once the partial
file of a dataset shard in the shared blob directory holds a chunk, the active coordinator is
killed (kill -9) mid-blob; the standby takes over, and the same CLI process follows it, resumes
that blob from the bytes the directory holds (its log says where: the byte the dead coordinator
had written, not 0), uploads the rest and submits the job. The job exists on the new active
coordinator, every blob it names is in the directory with the sha256 and size named, and its
shards hold the dataset as written."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.testing.wan import WanLink, WanThread
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import write_job
from tests.pg import PgServer, pg_server, pg_url  # noqa: F401 (fixtures)
from tests.procs import (
    sync_channel_for,
    wait_until,
)
from tests.system.test_cli_support import Cli
from tests.system.test_coordinator_failover import (
    start_active_and_standby,
    stop,
    wait_serving,
)

log = logging.getLogger(__name__)

FEATURES, CLASSES = 256, 4
SAMPLES = 24_576  # 1 KiB of features a sample: ~24 MiB of data, in shards of ~4 MiB
# The relay's rate to the first coordinator: ~1 MB/s, so that a shard takes seconds to cross
# and the kill lands in the middle of one whatever the host's load.
BANDWIDTH_BPS = 8e6

MODEL = """
from torch import nn


def make_model() -> nn.Module:
    return nn.Linear(256, 4)
"""


def dataset() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return {"x": x, "y": (x[:, :CLASSES]).argmax(dim=1)}


def job_doc() -> dict[str, object]:
    return {
        "name": "upload-takeover",
        "model": {"file": "model.py", "loss": "cross_entropy"},
        "data": {"train": "train.safetensors", "inputs": ["x"], "targets": ["y"]},
        "train": {"epochs": 1, "global_batch": 64, "optimizer": "sgd", "lr": 0.1, "seed": 1},
        "cluster": {"aggregation": "ps", "min_nodes": 1, "max_nodes": 2},
    }


def partials(blobs: Path) -> dict[str, tuple[int, int]]:
    """The partial uploads in the blob directory: sha256 -> (bytes held, announced size)."""
    found: dict[str, tuple[int, int]] = {}
    for meta in (blobs / "partial").glob("*/*.size"):
        try:
            size = int(meta.read_text())
            held = meta.with_suffix("").stat().st_size
        except (OSError, ValueError):  # being written or published just now
            continue
        found[meta.stem] = (held, size)
    return found


def blob_file(blobs: Path, ref: common_pb2.BlobRef) -> bytes:
    """The stored bytes of ``ref``, checked against its sha256 and size."""
    data = (blobs / ref.sha256[:2] / ref.sha256).read_bytes()
    assert hashlib.sha256(data).hexdigest() == ref.sha256
    assert len(data) == ref.size
    return data


@pytest.fixture
def relay_to() -> Iterator[list[WanThread]]:
    """Relays the test starts, stopped after it."""
    started: list[WanThread] = []
    yield started
    for wan in started:
        wan.stop()


@pytest.mark.timeout(420)
def test_an_upload_cut_by_a_kill9_resumes_on_the_standby_that_takes_over(
    tmp_path: Path,
    pg_server: PgServer,  # noqa: F811
    pg_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    relay_to: list[WanThread],
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)  # for `token create` on the coordinators
    blobs = tmp_path / "blobs"
    first, second, standby = start_active_and_standby(tmp_path, pg_url)
    cli: subprocess.Popen[str] | None = None
    try:
        link = WanLink("127.0.0.1:0", first.address, BANDWIDTH_BPS, rtt_ms=0.0, handshake=False)
        relay_to.append(WanThread(link).start())
        relayed = link.address

        alice = Cli(first.address, tmp_path / "alice", role="submitter")
        data = dataset()
        job_toml = write_job(tmp_path / "job", MODEL, data, job_doc())
        env = alice.env(EPOCHMESH_CACHE_DIR=str(tmp_path / "cache"))
        cli = alice.popen(
            "--coordinator",
            f"{relayed},{second}",
            "submit",
            str(job_toml),
            "--output",
            "json",
            env=env,
        )
        running = cli

        def shard_half_way() -> tuple[str, int] | None:
            assert running.poll() is None, running.communicate()
            for sha, (held, size) in partials(blobs).items():
                if size > 2 * MAX_CHUNK_BYTES and held >= MAX_CHUNK_BYTES:
                    return sha, size
            return None

        found = wait_until(
            shard_half_way, timeout=240, interval=0.02, message="no shard upload reached 1 MiB"
        )
        assert isinstance(found, tuple)
        first.kill9()
        sha, size = found
        held, announced = partials(blobs)[sha]  # what the killed coordinator had written
        assert announced == size and MAX_CHUNK_BYTES <= held < size, (held, size)
        took = wait_serving(second, "the standby never became active")
        log.info("cut %s at %d of %d bytes; takeover in %.1fs", sha[:12], held, size, took)

        out, err = cli.communicate(timeout=240)
        assert cli.returncode == 0, err
        job_id = str(json.loads(out)["job_id"])
        # The CLI moved to the new active coordinator and resumed the blob where the killed
        # one had stopped, sending only the rest of it.
        assert f"following the active coordinator at {second} (was {relayed})" in err, err
        assert f"upload of {sha[:12]} resumes at byte {held} of {size} on {second}" in err, err
        assert sha not in partials(blobs)

        # The job is on the new active coordinator; its blobs are whole and the data is the
        # dataset written.
        with sync_channel_for(second) as channel:
            job: common_pb2.Job = job_pb2_grpc.JobServiceStub(channel).GetJob(
                job_pb2.GetJobRequest(job_id=job_id), timeout=30
            )
        assert job.job_id == job_id and job.num_samples == SAMPLES
        blob_file(blobs, job.program)
        blob_file(blobs, job.initial_state)
        assert sha in {s.blob.sha256 for s in job.shards}
        shards = sorted(job.shards, key=lambda s: s.start)
        assert len(shards) > 2
        parts = [load_safetensors(blob_file(blobs, s.blob)) for s in shards]
        assert [s.count for s in shards] == [len(p["x"]) for p in parts]
        for name, tensor in data.items():
            assert torch.equal(torch.cat([p[name] for p in parts]), tensor), name
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
            cli.communicate(timeout=30)
        first.kill9()
        stop(standby)
