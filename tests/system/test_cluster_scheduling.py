"""Several tenants' jobs on one cluster (issue 18), with real processes and TLS: a coordinator,
four agents, two submitters logged in with their own tokens (two tenants).

Tenant A's long job takes the four nodes; tenant B's job, submitted later, gets about half of
them within a few rounds; then a high-priority job (min_nodes 3) preempts them, and the
coordinator is killed with -9 during that preemption and restarted. All three jobs finish;
every epoch of each covers every sample exactly once, and each downloaded result equals the
plain PyTorch replay of its own recorded rounds. With the holds the coordinator derives (a
slow job benchmark to pay back), a second tenant's first job still runs within a minute of
its submission while the first tenant's long job runs on, both exactly once.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import write_job
from tests.procs import (
    STEADY_LEASES,
    CoordinatorProc,
    free_port,
    start_coordinator,
    sync_channel_for,
    wait_until,
)
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_fault_tolerance import (
    FAST_RECONNECT,
    MODEL,
    applied,
    check_exactly_once,
    cli,
    job_doc,
    make_dataset,
    replay,
)

log = logging.getLogger(__name__)
JS = common_pb2.JobState
pytestmark = pytest.mark.timeout(480)

SEED = 5
HOLD_S = 2.0  # the coordinator's --scheduler-hold: B gets its half within a few rounds
SLOWDOWN = 10  # the two-tenant scenario's agents, at their start
DERIVED_SLOWDOWNS = (4, 4, 8, 8)  # speeds 1, 1, 1/2, 1/2
WAIT_SLOWDOWNS = tuple(3 * s for s in DERIVED_SLOWDOWNS)  # the same speeds, 3 times slower


class Jobs:
    """Operator reads of jobs, rounds and events over one channel (kept across restarts)."""

    def __init__(self, address: str) -> None:
        self.channel = sync_channel_for(address, options=FAST_RECONNECT)
        self.stub = job_pb2_grpc.JobServiceStub(self.channel)

    def job(self, job_id: str) -> common_pb2.Job:
        return self.stub.GetJob(
            job_pb2.GetJobRequest(job_id=job_id), timeout=5, wait_for_ready=True
        )

    def rounds(self, job_id: str, rolled_back: bool = False) -> list[common_pb2.RoundRecord]:
        """The job's rounds; with ``rolled_back``, also those a coordinator restart undid."""
        req = job_pb2.GetRoundsRequest(job_id=job_id, include_rolled_back=rolled_back)
        return list(self.stub.GetRounds(req, timeout=5, wait_for_ready=True).rounds)

    def events(self, job_id: str) -> list[common_pb2.Event]:
        req = job_pb2.GetJobEventsRequest(job_id=job_id)
        return list(self.stub.GetJobEvents(req, timeout=5, wait_for_ready=True).events)

    def wait_state(self, job_id: str, state: int, timeout: float) -> None:
        def reached() -> bool:
            job = self.job(job_id)
            assert job.state not in (JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED), job.message
            return job.state == state

        wait_until(reached, timeout=timeout, interval=0.2, message=f"{job_id} never {state}")


def _cluster_of(
    tmp_path: Path, slowdowns: tuple[int, ...], *coordinator_args: str
) -> Iterator[tuple[CoordinatorProc, list[AgentProc]]]:
    """A coordinator (STEADY_LEASES, plus ``coordinator_args``) and one agent per
    slowdown, named n0, n1, ...; yields once every agent has its benchmark, kills all after."""
    address = f"127.0.0.1:{free_port()}"
    coord = start_coordinator(
        tmp_path / "coord", "--listen", address, *STEADY_LEASES, *coordinator_args
    )
    agents: list[AgentProc] = []
    try:
        for i, slowdown in enumerate(slowdowns):
            agents.append(
                AgentProc(
                    address, tmp_path / f"agent-{i}", "--name", f"n{i}", "--slowdown", str(slowdown)
                )
            )
        wait_until(
            lambda: (
                sum(n.benchmark.samples_per_second > 0 for n in list_nodes(address))
                == len(slowdowns)
            ),
            timeout=180,
            interval=0.2,
            message=f"{len(slowdowns)} agents ready",
        )
        yield coord, agents
    finally:
        for a in agents:
            a.kill9()
        coord.kill9()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[CoordinatorProc, list[AgentProc]]]:
    # slowed down (rounds of ~0.1 s), so that the jobs outlast the submissions
    yield from _cluster_of(tmp_path, (SLOWDOWN,) * 4, "--scheduler-hold", str(HOLD_S))


def submit(tenant: Cli, directory: Path, doc: dict[str, Any], n: int) -> str:
    job_toml = write_job(directory, MODEL, make_dataset(n), doc)
    out = tenant.run("submit", str(job_toml), "--output", "json", timeout=120)
    assert out.code == 0, out.stderr
    return str(json.loads(out.stdout)["job_id"])


def set_slowdown(agents: list[AgentProc], factor: float) -> None:
    """Change the agents' slowdown at run time: the watch file, then SIGUSR1 to reload it."""
    for a in agents:
        (a.data_dir / "slowdown").write_text(f"{factor:g}\n")
        a.send(signal.SIGUSR1)


def nodes_of(rnd: common_pb2.RoundRecord) -> int:
    """The nodes a round handed a part to (a late best-effort part included)."""
    return len({p.node_id for p in rnd.parts})


def nodes_in_last_round(rounds: list[common_pb2.RoundRecord]) -> int:
    """Nodes with an applied part in the newest round that applied any."""
    done = [r for r in rounds if applied(r)]
    return len(applied(done[-1])) if done else 0


def test_two_tenants_share_a_high_priority_job_preempts_and_a_kill9_loses_nothing(
    cluster: tuple[CoordinatorProc, list[AgentProc]], tmp_path: Path
) -> None:
    coord, agents = cluster
    address = coord.address
    tenant_a = Cli(address, tmp_path / "tenant-a", role="submitter")
    tenant_b = Cli(address, tmp_path / "tenant-b", role="submitter")
    jobs = Jobs(address)
    # A outlasts B's submission and join and the urgent job's submission: 2-4 of its epochs
    # went by before the urgent preemption in runs on this host, idle or loaded, at slowdown
    # 10; from A's start on the four nodes the agents run twice as slow (sleeps: half the
    # rounds, and their CPU, for the same wait), so half of them: 10 epochs. B, on two nodes,
    # must outlast the urgent job's submission (seconds of export and checks, several times
    # longer on a host that runs another test beside this one): 10 epochs, and the agents
    # 12 times slower still (sleeps) while it is submitted.
    sizes = {"a": (576, 10), "b": (576, 10), "urgent": (240, 1)}

    def doc(name: str, **cluster_keys: Any) -> dict[str, Any]:
        n_epochs = sizes[name][1]
        return job_doc(name, epochs=n_epochs, seed=SEED, checkpoint_every=4, **cluster_keys)

    job_a = submit(tenant_a, tmp_path / "a", doc("a"), sizes["a"][0])
    wait_until(
        lambda: nodes_in_last_round(jobs.rounds(job_a)) == 4,
        timeout=180,  # the job benchmark of a cold sandbox, on a loaded host
        interval=0.1,
        message="tenant A's job on the four nodes",
    )
    set_slowdown(agents, 2 * SLOWDOWN)
    job_b = submit(tenant_b, tmp_path / "b", doc("b"), sizes["b"][0])
    owners = {jobs.job(job_a).owner, jobs.job(job_b).owner}
    assert len(owners) == 2 and "" not in owners, owners

    def preemptions() -> int:
        return sum(e.kind == "job.preempted" for j in (job_a, job_b) for e in jobs.events(j))

    # B takes its half (a node at A's next round boundary after the hold, the second once its
    # job benchmark there is in) while A keeps the other half; only then is the urgent job
    # packaged and submitted (seconds of export and checks), the agents slowed down further
    # meanwhile (sleeps, 12 times the compute) so that neither A nor B ends before its
    # preemption on a busy host. Once the urgent job is in, its preemption of A and B is under
    # way when the coordinator is killed.
    wait_until(
        lambda: (
            nodes_in_last_round(jobs.rounds(job_b)) == 2
            and nodes_in_last_round(jobs.rounds(job_a)) == 2
        ),
        timeout=120,
        interval=0.1,
        message="A and B on two nodes each",
    )
    set_slowdown(agents, 12 * SLOWDOWN)
    before = preemptions()
    urgent = submit(
        tenant_b, tmp_path / "urgent", doc("urgent", min_nodes=3, max_nodes=3, priority="high"), 240
    )
    wait_until(
        lambda: preemptions() > before, timeout=60, interval=0.05, message="the urgent preemption"
    )
    assert jobs.job(job_a).state != JS.JOB_STATE_SUCCEEDED
    assert jobs.job(job_b).state != JS.JOB_STATE_SUCCEEDED
    coord.kill9()
    coord.start()  # same data dir, same address; the agents reconnect by themselves
    # Every phase that needed the jobs to outlast a submission is behind: the rest of the
    # rounds at full speed (the slowdown only made room for the submissions).
    set_slowdown(agents, 1)

    jobs.wait_state(urgent, JS.JOB_STATE_SUCCEEDED, timeout=120)
    urgent_rounds = jobs.rounds(urgent)
    jobs.wait_state(job_b, JS.JOB_STATE_SUCCEEDED, timeout=120)
    jobs.wait_state(job_a, JS.JOB_STATE_SUCCEEDED, timeout=120)

    events = {j: [e.kind for e in jobs.events(j)] for j in (job_a, job_b, urgent)}
    assert "node.reassigned" in events[job_b] + events[urgent], events
    # The urgent job ran on its three nodes while the others waited or shrank: every round
    # handed a part to each of the three. (Not every part need be applied: a node late once on
    # a loaded host gets a best-effort scrap that does not hold the round, and may miss it.)
    log.info(
        "the urgent job's rounds (node, status): %s",
        [[(p.node_id, p.status) for p in r.parts] for r in urgent_rounds],
    )
    ran = [r for r in urgent_rounds if applied(r)]
    assert ran and all(nodes_of(r) == 3 for r in ran)
    # B had about half of the cluster (its second node joins once its job benchmark there
    # is in: a second or so at this slowdown) while A had the other half: a round of each on
    # two nodes at the same time. The rounds the restart rolled back count (they ran; their
    # samples were trained again after it): A's two-node rounds may all lie after its last
    # checkpoint before the kill.
    rounds_a, rounds_b = (jobs.rounds(j, rolled_back=True) for j in (job_a, job_b))
    b_half = [r for r in rounds_b if applied(r) and nodes_of(r) == 2]
    assert b_half, [nodes_of(r) for r in rounds_b]
    a_half = [r for r in rounds_a if applied(r) and nodes_of(r) == 2]
    for name, rounds in (("A", rounds_a), ("B", rounds_b)):
        log.info(
            "%s's rounds (nodes, applied parts, rolled back): %s",
            name,
            [(nodes_of(r), len(applied(r)), r.rolled_back) for r in rounds],
        )
    assert any(
        a.started_ms <= b.finished_ms and b.started_ms <= a.finished_ms
        for a in a_half
        for b in b_half
    ), ("A and B never ran side by side on two nodes each", [nodes_of(r) for r in rounds_a])
    for name, job_id in (("a", job_a), ("b", job_b), ("urgent", urgent)):
        n, epochs = sizes[name]
        rounds = jobs.rounds(job_id)
        check_exactly_once(rounds, n, epochs)
        out = cli(address, "download", job_id, "-o", str(tmp_path / f"result-{name}"))
        assert out.returncode == 0, out.stderr
        trained = load_file(str(tmp_path / f"result-{name}" / "model.safetensors"))
        expected = replay(tmp_path / name, rounds, make_dataset(n), SEED)
        diff = max((trained[k] - v).abs().max().item() for k, v in expected.items())
        log.info("job %s: %d rounds, replay max abs diff %.2e", name, len(rounds), diff)
        assert diff <= 1e-5, f"job {name}: the result is {diff} off the replay of its rounds"
    jobs.channel.close()


@pytest.fixture
def derived_holds(tmp_path: Path) -> Iterator[tuple[CoordinatorProc, list[AgentProc]]]:
    """A coordinator that derives its holds (no --scheduler-hold) and four agents at speeds
    1, 1, 1/2, 1/2 (slowed down so that rounds take ~0.1 s and a job outlasts a submission)."""
    yield from _cluster_of(tmp_path, DERIVED_SLOWDOWNS)


def test_a_new_tenant_runs_within_a_minute_while_the_first_tenants_long_job_runs(
    derived_holds: tuple[CoordinatorProc, list[AgentProc]], tmp_path: Path
) -> None:
    """Tenant A's long job holds the four nodes, each for as long as its (slow, cold-sandbox)
    job benchmark takes to pay back; tenant B's job, measured nowhere yet, still gets its
    fair share at A's next round boundary after a few of A's rounds, and is benchmarked on
    those nodes then: RUNNING within 60 s of its submission while A's job runs on."""
    coord, agents = derived_holds
    address = coord.address
    tenant_a = Cli(address, tmp_path / "tenant-a", role="submitter")
    tenant_b = Cli(address, tmp_path / "tenant-b", role="submitter")
    jobs = Jobs(address)
    # A outlasts B's submission and its wait for its share (up to a minute) because its rounds
    # are slowed down further meanwhile (sleeps: few rounds, little CPU, however long the wait
    # is), not by its length: after that A and B run at full speed, and B need only run. At
    # the wait's slowdown a round of A took 0.24-0.68 s here (24 rounds an epoch), so even the
    # whole minute would use ~10 of A's 16 epochs; B's first round came a second or two
    # after its submission here, with 15 of A's epochs still to go.
    sizes = {"a": (576, 16), "b": (576, 4)}

    def doc(name: str) -> dict[str, Any]:
        return job_doc(name, epochs=sizes[name][1], seed=SEED, checkpoint_every=4)

    job_a = submit(tenant_a, tmp_path / "a", doc("a"), sizes["a"][0])
    wait_until(
        lambda: nodes_in_last_round(jobs.rounds(job_a)) == 4,
        timeout=180,  # the job benchmark of a cold sandbox, on a loaded host
        interval=0.1,
        message="tenant A's job on the four nodes",
    )
    for agent, factor in zip(agents, WAIT_SLOWDOWNS, strict=True):
        set_slowdown([agent], factor)
    job_b = submit(tenant_b, tmp_path / "b", doc("b"), sizes["b"][0])
    submitted = time.monotonic()
    owners = {jobs.job(job_a).owner, jobs.job(job_b).owner}
    assert len(owners) == 2 and "" not in owners, owners
    wait_until(
        lambda: jobs.job(job_b).state == JS.JOB_STATE_RUNNING,
        timeout=60,
        interval=0.2,
        message="tenant B's job RUNNING within 60 s of its submission",
    )
    log.info("B running %.1f s after its submission", time.monotonic() - submitted)
    assert jobs.job(job_a).state == JS.JOB_STATE_RUNNING
    set_slowdown(agents, 1)  # the rest at full speed
    jobs.wait_state(job_b, JS.JOB_STATE_SUCCEEDED, timeout=180)
    jobs.wait_state(job_a, JS.JOB_STATE_SUCCEEDED, timeout=240)
    rounds_a, rounds_b = jobs.rounds(job_a), jobs.rounds(job_b)
    first_b = min(r.finished_ms for r in rounds_b if applied(r))
    assert any(applied(r) and r.finished_ms > first_b for r in rounds_a), (
        "B's job ran only after A's had ended"
    )
    for name, rounds in (("a", rounds_a), ("b", rounds_b)):
        n, epochs = sizes[name]
        check_exactly_once(rounds, n, epochs)
    jobs.channel.close()
