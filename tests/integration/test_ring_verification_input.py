"""Bad verification input from ring members (issue 20), with the real engine over real gRPC +
TLS and members played by the test (tests/integration/test_ring_coordinator.py's FakeMember:
a zero gradient, honest chunk commitments and sketches of it, the round's start parameters
uploaded when drawn).

- A report whose chunk commitments do not fit it (a chunk short; in local SGD also no start
  digests) is INVALID_ARGUMENT with a strike, and the member's part is out of the round; the
  job goes on with the others.
- An update sketch of the wrong length is INVALID_ARGUMENT with a strike.
- Start parameters that are not the ones the ring agreed on (in local SGD: uploaded with the
  start state of the chunk drawn) quarantine the member with check
  "snapshot" and both checksums as evidence; its unverified rounds are undone and the job
  finishes on the others, every sample of every epoch once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.engine.engine import Engine
from epochmesh.v1 import common_pb2
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_ring_coordinator import (
    FakeMember,
    check_exactly_once,
    new_world,
    ring_job,
    run_job,
)
from tests.procs import in_process_coordinator

pytestmark = pytest.mark.timeout(90)


LOCAL_SGD = {"sync": "local_sgd", "inner_steps": 2}


async def run_with(tmp_path: Path, wrong: str, sync: str = "sync", external: bool = False) -> tuple:
    """A ring job (``sync`` "local_sgd": of local SGD) on three members, the third getting
    ``wrong`` wrong (``external``: the third an external node, no peer address): (the job, its
    rounds, its events, the third's agent, the coordinator's view of it, the fakes' world)."""
    train = LOCAL_SGD if sync == "local_sgd" else None
    packed = ring_job(tmp_path, train, min_nodes=2, max_nodes=3)
    world = new_world(packed)
    async with in_process_coordinator(
        tmp_path / "coord", engine_factory=Engine, heartbeat_interval_s=0.5
    ) as coord:
        bad = FakeMember(world)
        bad.wrong = wrong
        agents = [
            await FakeAgent(
                coord, f"m{i}", 200.0, FakeMember(world), peer_address=f"127.0.0.1:{i}"
            ).start()
            for i in (1, 2)
        ]
        address = "" if external else "127.0.0.1:3"
        agents.append(await FakeAgent(coord, "bad", 200.0, bad, peer_address=address).start())
        try:
            final, rounds, events = await run_job(coord, packed)
            info = coord.registry.get(agents[2].node_id)
        finally:
            for a in agents:
                await a.stop()
    assert final.state == common_pb2.JOB_STATE_SUCCEEDED, final.message
    check_exactly_once(rounds)
    return final, rounds, events, agents[2], info, world


def struck(events: list, node_id: str) -> list[str]:
    return [e.message for e in events if e.kind == "node.strike" and e.node_id == node_id]


@pytest.mark.parametrize(
    ("wrong", "sync"),
    [("commitments", "sync"), ("commitments", "local_sgd"), ("digests", "local_sgd")],
)
async def test_commitments_that_do_not_fit_the_report_are_refused_with_a_strike(
    tmp_path: Path, wrong: str, sync: str
) -> None:
    _, rounds, events, bad, info, _ = await run_with(tmp_path, wrong, sync)
    assert "INVALID_ARGUMENT" in bad.errors, bad.errors
    assert info is not None and info.strikes >= 1
    strikes = struck(events, bad.node_id)
    assert strikes and all("chunk commitments" in m for m in strikes), strikes
    applied = {p.node_id for r in rounds for p in r.parts if p.status == "applied"}
    assert bad.node_id not in applied


async def test_an_update_sketch_of_the_wrong_length_is_refused_with_a_strike(
    tmp_path: Path,
) -> None:
    _, _, events, bad, info, _ = await run_with(tmp_path, "update_sketch")
    assert "INVALID_ARGUMENT" in bad.errors, bad.errors
    assert info is not None and info.strikes >= 1
    strikes = struck(events, bad.node_id)
    assert any("update sketch" in m for m in strikes), strikes


@pytest.mark.parametrize("sync", ["sync", "local_sgd"])
async def test_start_parameters_the_ring_did_not_agree_on_quarantine_the_member(
    tmp_path: Path, sync: str
) -> None:
    _, rounds, events, bad, info, world = await run_with(tmp_path, "start", sync)
    assert info is not None and info.state == common_pb2.NODE_STATE_QUARANTINED
    caught = [e for e in events if e.kind == "node.quarantined" and e.node_id == bad.node_id]
    assert len(caught) == 1, [e.message for e in events if e.kind == "node.quarantined"]
    evidence = dict(caught[0].attrs)
    assert evidence["check"] == "snapshot", evidence
    assert evidence["agreed_checksum"] != evidence["uploaded_checksum"]
    assert "ring agreed on" in caught[0].message
    # Its rounds until then were undone: none of it is applied in the live rounds.
    applied = {p.node_id for r in rounds for p in r.parts if p.status == "applied"}
    assert bad.node_id not in applied
    rolled = [e for e in events if e.kind == "job.rolled_back"]
    assert rolled
    # Tasks after it name the version the state was restored at (a local SGD member's inner
    # optimizer starts afresh), those before none.
    restored = {int(e.attrs["params_version"]) for e in rolled}
    assert world["tasks"][0].restored_version == 0
    assert world["tasks"][-1].restored_version == max(restored)
    # The honest members were checked too, and nobody else was accused.
    checked = {n for n, _, wanted in world["checked"] if wanted}
    assert len(checked) >= 2
    assert not [e for e in events if e.kind == "node.quarantined" and e.node_id != bad.node_id]


async def test_an_honest_external_of_a_ring_job_passes_its_start_checks(
    tmp_path: Path,
) -> None:
    """A ring job's external node (no peer address: its updates go through the coordinator)
    uploads the parameters its checked part started from: they are taken (the ring agreed on
    them), nobody is accused, and its parts count."""
    _, rounds, events, ext, _, _ = await run_with(tmp_path, "", external=True)
    assert not [e for e in events if e.kind in ("node.quarantined", "node.strike")]
    assert any(p.node_id == ext.node_id and p.status == "applied" for r in rounds for p in r.parts)
    assert ext.snapshots_taken >= 1, "the external was never asked for its start parameters"
