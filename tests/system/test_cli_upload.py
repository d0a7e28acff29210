"""The submit path up to SubmitJob against a real coordinator subprocess: resumable,
deduplicated uploads, and ``epochmesh submit``'s plain (non-TTY) upload progress."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client.rpc import Coordinator
from client.upload import Uploader, blob_ref
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.procs import (
    CoordinatorProc,
    identity_for,
    start_coordinator,
    sync_channel_for,
    wait_until,
)
from tests.system.test_cli_support import Cli, engine_available

pytestmark = pytest.mark.timeout(120)

HAS_PACKAGING = importlib.util.find_spec("epochmesh.packaging") is not None
HAS_ENGINE = engine_available()


@pytest.fixture(name="coordinator", scope="module")
def coordinator_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProc]:
    proc = start_coordinator(tmp_path_factory.mktemp("upload") / "coordinator")
    try:
        yield proc
    finally:
        proc.kill9()


def _blob_status(address: str, sha: str) -> job_pb2.GetBlobStatusResponse:
    with sync_channel_for(address) as channel:
        stub = job_pb2_grpc.JobServiceStub(channel)
        return stub.GetBlobStatus(job_pb2.GetBlobStatusRequest(sha256=sha), timeout=5)


def _partial_status(address: str, sha: str) -> job_pb2.GetBlobStatusResponse:
    """The status of a cut-off upload, once the coordinator has seen the stream end (the
    client's abort reaches it after the client's call has returned: until then the blob is
    NOT_FOUND)."""

    def status() -> job_pb2.GetBlobStatusResponse | None:
        try:
            return _blob_status(address, sha)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return None

    return wait_until(status, timeout=20, message="the cut-off upload never showed")  # type: ignore[return-value]


def _cut_off_upload(address: str, data: bytes, chunks: int) -> None:
    """Streams the header and ``chunks`` chunks, then the client dies mid-call."""
    ref = blob_ref(data)

    def requests() -> Iterator[job_pb2.UploadBlobRequest]:
        yield job_pb2.UploadBlobRequest(
            header=job_pb2.UploadBlobHeader(sha256=ref.sha256, size=ref.size, offset=0)
        )
        for i in range(chunks):
            piece = data[i * MAX_CHUNK_BYTES : (i + 1) * MAX_CHUNK_BYTES]
            yield job_pb2.UploadBlobRequest(
                chunk=common_pb2.DataChunk(offset=i * MAX_CHUNK_BYTES, data=piece)
            )
        # Die only once the coordinator has begun the upload: a client that dies before its
        # header arrived leaves nothing to resume (the call is cancelled before it is sent).
        _partial_status(address, ref.sha256)
        raise ConnectionAbortedError("client died")

    with sync_channel_for(address) as channel:
        stub = job_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.UploadBlob(requests(), timeout=30)


def test_upload_resumes_and_dedups(coordinator: CoordinatorProc) -> None:
    data = os.urandom(3 * MAX_CHUNK_BYTES + 12345)
    ref = blob_ref(data)
    _cut_off_upload(coordinator.address, data, chunks=2)
    before = _partial_status(coordinator.address, ref.sha256)
    assert not before.complete
    assert before.received_bytes <= 2 * MAX_CHUNK_BYTES

    progress: list[tuple[int, int]] = []
    coord = Coordinator(coordinator.address, identity=identity_for(coordinator.address))
    try:
        uploader = Uploader(coord, lambda done, total: progress.append((done, total)))
        refs = uploader.upload_all([data, data])  # the same blob twice: sent once
        assert [r.sha256 for r in refs] == [ref.sha256, ref.sha256]
        stats = uploader.stats
        assert stats.blobs == 1 and stats.total_bytes == len(data)
        # The cut-off call's last chunk may land after `before` was read.
        assert before.received_bytes <= stats.resumed_bytes <= 2 * MAX_CHUNK_BYTES
        assert stats.sent_bytes == len(data) - stats.resumed_bytes
        assert progress[-1] == (len(data), len(data))
        assert [d for d, _ in progress] == sorted(d for d, _ in progress)
        assert _blob_status(coordinator.address, ref.sha256).complete

        again = Uploader(coord)
        again.upload_all([data])
        assert again.stats.skipped_blobs == 1 and again.stats.sent_bytes == 0
    finally:
        coord.close()


def _tiny_job(root: Path, samples: int = 4096) -> Path:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "model.py").write_text(
        "import torch\n\n"
        "def make_model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(),"
        " torch.nn.Linear(16, 4))\n"
    )
    gen = torch.Generator().manual_seed(0)
    save_file(
        {"x": torch.randn(samples, 32, generator=gen), "y": torch.randint(0, 4, (samples,))},
        str(root / "train.safetensors"),
    )
    spec = root / "job.toml"
    spec.write_text(
        'name = "upload-check"\n[model]\nfile = "model.py"\nloss = "cross_entropy"\n'
        '[data]\ntrain = "train.safetensors"\ninputs = ["x"]\ntargets = ["y"]\n'
        '[train]\nepochs = 1\nglobal_batch = 64\noptimizer = "sgd"\nlr = 0.1\n'
    )
    return spec


@pytest.mark.skipif(not HAS_PACKAGING, reason="epochmesh.packaging has not landed yet")
def test_submit_uploads_with_plain_progress(coordinator: CoordinatorProc, tmp_path: Path) -> None:
    spec = _tiny_job(tmp_path / "job")
    cli = Cli(coordinator.address, tmp_path / "cfg")
    result = cli.run("submit", str(spec), timeout=90)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    # Plain progress: lines, no carriage returns or escape sequences.
    assert "\r" not in result.stderr and "\x1b" not in result.stderr
    uploads = [line for line in lines if line.startswith("uploading ")]
    assert uploads and "(100%)" in uploads[-1], result.stderr
    assert any(line.startswith("uploaded ") for line in lines), result.stderr
    if HAS_ENGINE:
        assert result.code == 0, result.stderr
        assert result.stdout.strip().startswith("j-")
    else:
        # Everything was uploaded; the coordinator without an engine refuses SubmitJob cleanly.
        assert result.code == 1, result.stderr
        assert "does not support SubmitJob" in result.stderr
