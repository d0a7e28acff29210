"""The committed stubs under epochmesh/v1 must be exactly what scripts/gen_proto.sh generates."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_committed_stubs_match_generated(tmp_path: Path) -> None:
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    subprocess.run(
        [str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT
    )
    generated = sorted(p.name for p in (tmp_path / "epochmesh" / "v1").glob("*_pb2*.py*"))
    committed = sorted(p.name for p in (ROOT / "epochmesh" / "v1").glob("*_pb2*.py*"))
    assert generated == committed, "stub files differ: run scripts/gen_proto.sh"
    for name in generated:
        new = (tmp_path / "epochmesh" / "v1" / name).read_text()
        old = (ROOT / "epochmesh" / "v1" / name).read_text()
        assert new == old, f"epochmesh/v1/{name} is stale: run scripts/gen_proto.sh"


def test_stubs_import_as_epochmesh_not_proto() -> None:
    from epochmesh.v1 import agent_pb2_grpc, job_pb2_grpc, peer_pb2_grpc, scheduler_pb2_grpc

    for mod in (agent_pb2_grpc, job_pb2_grpc, peer_pb2_grpc, scheduler_pb2_grpc):
        assert mod.__name__.startswith("epochmesh.v1.")
    assert "proto" not in sys.modules or not hasattr(sys.modules["proto"], "epochmesh")
