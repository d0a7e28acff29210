# ruff: noqa: F811
"""Two coordinator processes on one PostgreSQL database (tests/pg.py) and one blob directory
(``serve --blob-dir``): the second stands by (health NOT_SERVING, every other call UNAVAILABLE
naming the active one in the ``epochmesh-active`` trailing metadata). Three agents asking
different prices, given both addresses, train a job with a budget: kill -9 of the active in the
middle of an epoch makes the standby active and the agents follow it; the first, started again
(the job waiting meanwhile, its nodes cordoned), stands by; kill -9 of the second in the middle
of an epoch gives the job back to the first, which finishes it. Every epoch covers every sample exactly once, the downloaded result is the
plain PyTorch replay of the recorded rounds (<= 1e-5), and the job's statement is the billing
rule applied to each applied part of every recorded round, rolled back ones too: each part paid
once, the submitter paying each sample of an epoch once, the platform the re-runs. And stepping
down: an active whose lease connection is ended stops serving, stands by, takes the lease back
and finishes the job it had accepted, in the same process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.accounting.billing import earned_micro
from epochmesh.identity import coordinator_channel_options, identity_credentials
from epochmesh.money import parse_credits
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from tests.fixtures import write_job
from tests.pg import PgServer, pg_server, pg_url  # noqa: F401 (fixtures)
from tests.procs import (
    STEADY_LEASES,
    CoordinatorProc,
    _remember,
    _Trust,
    console_script,
    free_port,
    health_status,
    identity_for,
    start_coordinator,
    token_for,
    wait_until,
)
from tests.system.test_agent import AgentProc, list_nodes
from tests.system.test_cli_support import Cli
from tests.system.test_fault_tolerance import (
    HEARTBEAT_S,
    JOB_SEED,
    MODEL,
    Cluster,
    applied,
    check_exactly_once,
    check_replay,
    job_doc,
    make_dataset,
    part_indices,
)
from tests.unit.test_ha_lease import terminate_lease_holder_sql

log = logging.getLogger(__name__)
JS = common_pb2.JobState
JOB_SERVICE = "epochmesh.v1.JobService"
READ_TIMEOUT_S = 30.0


# Node leases of the fault-tolerance tests (a heartbeat every 0.5 s): a lapse is seen fast.
QUICK_LEASES = ("--heartbeat-interval", str(HEARTBEAT_S))


def serve_args(
    address: str, url: str, blob_dir: Path, leases: tuple[str, ...] = QUICK_LEASES
) -> list[str]:
    return [
        "--listen",
        address,
        "--store",
        url,
        "--blob-dir",
        str(blob_dir),
        *leases,
        "--http-listen",
        "",
    ]


class SharedCluster(Cluster):
    """The fault-tolerance tests' cluster, its coordinator on the PostgreSQL database ``url``
    with its blobs in ``root/blobs`` (``leases``: its node lease options). Its reads wait
    longer for an answer than the fault-tolerance tests' (a coordinator restoring a job on a
    busy host)."""

    def __init__(self, root: Path, url: str, leases: tuple[str, ...] = QUICK_LEASES) -> None:
        self.root = root
        self.address = f"127.0.0.1:{free_port()}"
        self.coord = start_coordinator(
            root / "coord", *serve_args(self.address, url, root / "blobs", leases)
        )
        self.agents = {}
        self.slowdowns = {}
        self._channel = None
        self._stub = None

    def job(self, job_id: str) -> common_pb2.Job:
        job: common_pb2.Job = self._jobs().GetJob(
            job_pb2.GetJobRequest(job_id=job_id), timeout=READ_TIMEOUT_S, wait_for_ready=True
        )
        return job

    def rounds(self, job_id: str, rolled_back: bool = False) -> list[common_pb2.RoundRecord]:
        req = job_pb2.GetRoundsRequest(job_id=job_id, include_rolled_back=rolled_back)
        reply = self._jobs().GetRounds(req, timeout=READ_TIMEOUT_S, wait_for_ready=True)
        return list(reply.rounds)

    def point_at(self, address: str) -> None:
        """The test's own calls go to ``address`` from now on."""
        if self._channel is not None:
            self._channel.close()
        self.address = address
        self._channel = None
        self._stub = None


def start_standby(
    data_dir: Path, address: str, url: str, blob_dir: Path, leases: tuple[str, ...] = QUICK_LEASES
) -> subprocess.Popen[bytes]:
    """A coordinator on ``url`` at ``address``; returns once it listens (health answers)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "coordinator-stderr.log", "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(
        [
            str(console_script("epochmesh-coordinator")),
            "--data-dir",
            str(data_dir),
            *serve_args(address, url, blob_dir, leases),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    log.close()
    _remember(address, _Trust(data_dir, False))

    def listening() -> bool:
        assert proc.poll() is None, (data_dir / "coordinator-stderr.log").read_text()[-3000:]
        return (data_dir / "ca.pem").exists() and health_status(address) is not None

    wait_until(listening, timeout=90, interval=0.2, message="the standby never listened")
    return proc


def refusal_of(address: str, via: str) -> grpc.RpcError:
    """The error a JobService call to ``address`` gets, as an operator of ``via``'s CA."""
    ident = identity_for(via, "operator")
    assert ident is not None
    channel = grpc.secure_channel(
        address, identity_credentials(ident), options=coordinator_channel_options()
    )
    with channel:
        stub = job_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ListJobs(job_pb2.ListJobsRequest(), timeout=10)
    return caught.value


def check_standby(address: str, active: str) -> None:
    assert health_status(address) == "NOT_SERVING"
    assert health_status(address, JOB_SERVICE) == "NOT_SERVING"
    # Until its first look at the lease row a standby knows no active one to name.
    err = wait_until(
        lambda: (e := refusal_of(address, active)).details().endswith(active) and e,
        timeout=30,
        interval=0.2,
        message=f"the standby at {address} never named {active}",
    )
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == f"standby coordinator; the active coordinator is at {active}"
    assert dict(err.trailing_metadata() or ())["epochmesh-active"] == active


def charges_by_the_rule(pg_server: PgServer, database: str, cluster: Cluster, job_id: str) -> None:
    """Every donor's pay for the job is the billing rule applied to its applied parts (rolled
    back rounds included: a re-run is the platform's), and nothing is paid twice."""
    rows = pg_server.sql(
        "SELECT reason, round, node_id, from_account, to_account FROM ledger_entries "
        f"WHERE job_id = '{job_id}' AND round >= 0",
        database,
    ).splitlines()
    assert [row for row, n in Counter(rows).items() if n > 1] == []
    paid: dict[tuple[int, str], int] = defaultdict(int)
    for row in pg_server.sql(
        "SELECT round, node_id, amount FROM ledger_entries "
        f"WHERE job_id = '{job_id}' AND to_account LIKE 'donor:%'",
        database,
    ).splitlines():
        rnd, node, amount = row.split("|")
        paid[(int(rnd), node)] += int(amount)
    expected: dict[tuple[int, str], int] = {}
    for r in cluster.rounds(job_id, rolled_back=True):
        for p in applied(r):
            earned = earned_micro(p.price_micro_per_hour, len(part_indices(p)), p.billed_rate)
            if earned:
                expected[(r.round, p.node_id)] = expected.get((r.round, p.node_id), 0) + earned
    assert dict(paid) == expected


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def start_active_and_standby(
    tmp_path: Path, url: str
) -> tuple[CoordinatorProc, str, subprocess.Popen[bytes]]:
    """An active coordinator (data dir tmp_path/a) and a standby (tmp_path/b) on ``url``,
    sharing the blob dir tmp_path/blobs, the standby checked to name the active one: (the
    active one, the standby's address, the standby's process)."""
    blobs = tmp_path / "blobs"
    first = start_coordinator(
        tmp_path / "a", *serve_args(f"127.0.0.1:{free_port()}", url, blobs, STEADY_LEASES)
    )
    second = f"127.0.0.1:{free_port()}"
    standby = start_standby(tmp_path / "b", second, url, blobs, STEADY_LEASES)
    try:
        check_standby(second, first.address)
    except BaseException:
        first.kill9()
        stop(standby)
        raise
    return first, second, standby


def wait_serving(address: str, what: str) -> float:
    """Until ``address`` serves; how long that took."""
    began = time.monotonic()
    wait_until(lambda: health_status(address) == "SERVING", timeout=60, interval=0.1, message=what)
    return time.monotonic() - began


# The takeover test's cluster and job: three agents asking different prices (every applied part
# is charged), slowed so that the job outlasts two takeovers, and cordoned while the first
# coordinator restarts (the job waits meanwhile, however long that takes).
PRICES = {"a": "40", "b": "100", "c": "200"}  # credits per node-hour
SLOWDOWNS = {"a": 20.0, "b": 30.0, "c": 40.0}  # rounds of a few tenths of a second
N, EPOCHS, EVERY, BATCH = 240, 5, 4, 24  # 10 rounds an epoch, a checkpoint every 4 rounds


def epoch_coverage(rounds: list[common_pb2.RoundRecord], epoch: int) -> int:
    """Samples the applied parts of ``rounds`` cover in ``epoch``."""
    return sum(len(part_indices(p)) for r in rounds if r.epoch == epoch for p in applied(r))


def wait_mid_epoch(
    cluster: Cluster,
    job_id: str,
    since_ms: int,
    what: str,
    min_applied: int = 0,
    mid_epoch: bool = True,
) -> None:
    """Until a round finished after ``since_ms`` is applied (the job goes on), ``min_applied``
    rounds or more are, and (``mid_epoch``) the current epoch, not the last one, has two
    rounds applied and three or more left: a kill now lands mid-epoch, with the job far from
    done."""

    def ready() -> bool:
        state = cluster.job(job_id).state
        ended = (JS.JOB_STATE_SUCCEEDED, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED)
        assert state not in ended, f"{what}: the job is {JS.Name(state)} first"
        done = [r for r in cluster.rounds(job_id) if applied(r)]
        if len(done) < max(1, min_applied) or done[-1].finished_ms <= since_ms:
            return False
        if not mid_epoch:
            return True
        epoch = done[-1].epoch
        assert epoch < EPOCHS - 1, f"{what}: the job reached its last epoch first"
        in_epoch = [r for r in done if r.epoch == epoch]
        return len(in_epoch) >= 2 and epoch_coverage(in_epoch, epoch) <= N - 3 * BATCH

    wait_until(ready, timeout=300, interval=0.05, message=what)


def wait_followed(cluster: Cluster, nodes: set[str], since_ms: int, what: str) -> None:
    """Until the active coordinator (``cluster.address``) has heartbeats of every one of
    ``nodes`` after ``since_ms``: the agents follow it."""

    def followed() -> bool:
        beats = {n.node_id: n.last_heartbeat_ms for n in list_nodes(cluster.address)}
        return all(beats.get(node, 0) > since_ms for node in nodes)

    wait_until(followed, timeout=120, interval=0.2, message=what)


def check_killed_mid_epoch(
    rounds: list[common_pb2.RoundRecord], after_ms: int, killed_ms: int
) -> list[common_pb2.RoundRecord]:
    """The kill at ``killed_ms`` came mid-epoch: the rounds live then (``rounds`` lists rolled
    back ones too; those finished before ``after_ms``, the previous kill, were undone by its
    takeover) end in an epoch with two or more rounds applied that they cover only in part.
    The rounds the killed coordinator recorded (finished after ``after_ms``)."""
    live = [
        r
        for r in rounds
        if r.finished_ms <= killed_ms
        and applied(r)
        and not (r.rolled_back and r.finished_ms <= after_ms)
    ]
    recorded = [r for r in live if r.finished_ms > after_ms]
    assert recorded, "the killed coordinator recorded no round"
    epoch = recorded[-1].epoch
    covered = epoch_coverage(live, epoch)
    assert sum(r.epoch == epoch for r in live) >= 2 and 0 < covered < N, (epoch, covered)
    return recorded


def set_cordoned(op: Cli, address: str, cordoned: bool) -> None:
    """Cordon (or uncordon) every agent's node on the active coordinator at ``address``: a job
    of cordoned nodes only waits, its rounds and their estimates left as they were."""
    action = "cordon" if cordoned else "uncordon"
    runs = [op.popen("--coordinator", address, action, name) for name in PRICES]
    for run in runs:  # at once: the job goes on with the nodes not cordoned yet
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err


def check_statement(
    entries: list[dict[str, Any]],
    rounds: list[common_pb2.RoundRecord],
    job_id: str,
    names: dict[str, str],
) -> tuple[int, int]:
    """The job's statement lines against the billing rule, recomputed from every recorded
    round, rolled back ones too (the donor did that work; its re-run is the platform's): each
    applied part (round, node) earns its donor earned_micro(price, samples, rate), paid once;
    the job's escrow pays for the samples of the epoch the submitter had not paid for yet, the
    platform for the others; no line names anything else, and no line is there twice. The
    donors' total and the platform's."""
    escrow, held = f"escrow:{job_id}", f"held:{job_id}"
    lines = Counter(
        tuple(v for k, v in sorted(e.items()) if k not in ("id", "time_ms")) for e in entries
    )
    assert [line for line, k in lines.items() if k > 1] == []
    paid: dict[tuple[int, str], int] = defaultdict(int)  # to the donor
    by_submitter: dict[tuple[int, str], int] = defaultdict(int)  # into the part's pay
    by_platform: dict[tuple[int, str], int] = defaultdict(int)
    for e in entries:
        key, amount = (e["round"], e["node"]), e["amount_micro"]
        assert e["job"] == job_id and amount > 0, e
        if e["from"].startswith("tenant:") and e["to"] == escrow:
            continue  # the budget
        if e["from"] == escrow and e["to"].startswith("tenant:"):
            assert e["reason"] == "refund", e
            continue
        if e["to"].startswith("donor:"):
            paid[key] += amount
            if e["from"] == held:
                continue
        assert e["to"] in (held,) or e["to"].startswith("donor:"), e
        if e["from"] == escrow:
            by_submitter[key] += amount
        else:
            assert e["from"] == "platform", e
            by_platform[key] += amount
    earned: dict[tuple[int, str], int] = {}
    submitter: dict[tuple[int, str], int] = {}
    paid_for: dict[int, set[int]] = defaultdict(set)  # epoch -> samples the submitter paid
    for r in sorted(rounds, key=lambda r: r.round):
        for p in applied(r):
            assert p.price_micro_per_hour == parse_credits(PRICES[names[p.node_id]]), p
            samples = part_indices(p)
            new = [i for i in samples if i not in paid_for[r.epoch]]
            paid_for[r.epoch].update(samples)
            key = (r.round, p.node_id)
            earned[key] = earned_micro(p.price_micro_per_hour, len(samples), p.billed_rate)
            submitter[key] = earned_micro(p.price_micro_per_hour, len(new), p.billed_rate)
    rerun = {k: earned[k] - submitter[k] for k in earned}
    assert sum(earned.values()) > 0
    assert dict(paid) == {k: v for k, v in earned.items() if v}  # a zero makes no line
    assert dict(by_submitter) == {k: v for k, v in submitter.items() if v}
    assert dict(by_platform) == {k: v for k, v in rerun.items() if v}
    return sum(earned.values()), sum(rerun.values())


@pytest.mark.timeout(720)
def test_the_standby_takes_over_a_running_job_after_a_kill9_and_back_again(
    tmp_path: Path, pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)
    database = pg_url.rsplit("/", 1)[1]
    blobs = tmp_path / "blobs"
    cluster = SharedCluster(tmp_path, pg_url, STEADY_LEASES)
    first = cluster.address
    second = f"127.0.0.1:{free_port()}"
    standby = start_standby(tmp_path / "coord2", second, pg_url, blobs, STEADY_LEASES)
    restarted: subprocess.Popen[bytes] | None = None
    try:
        check_standby(second, first)
        assert (tmp_path / "coord2" / "ca.pem").read_bytes() == (
            tmp_path / "coord" / "ca.pem"
        ).read_bytes()
        assert not (tmp_path / "coord" / "blobs").exists()
        for name, price in PRICES.items():
            token = token_for(first, "node")
            assert token
            cluster.agents[name] = AgentProc(
                f"{first},{second}",
                tmp_path / f"agent-{name}",
                "--name",
                name,
                "--price",
                price,
                "--slowdown",
                f"{SLOWDOWNS[name]:g}",
                "--token",
                token,
            )
        cluster.wait_ready(list(PRICES), timeout=240)
        names = {cluster.node_id(name): name for name in PRICES}
        nodes = set(names)

        # A submitter with credits; a job with a budget (so that it may use priced nodes).
        op = Cli(first, tmp_path / "op")
        alice = Cli(first, tmp_path / "alice", role="submitter")
        whoami = alice.run("whoami", "--output", "json")
        assert whoami.code == 0, whoami.stderr
        assert op.run("credits", "grant", f"tenant:{whoami.json()['principal']}", "100").code == 0
        doc: dict[str, Any] = job_doc("failover", epochs=EPOCHS, checkpoint_every=EVERY)
        doc["train"]["global_batch"] = BATCH
        doc["market"] = {"budget": "50"}
        job_toml = write_job(tmp_path / "job", MODEL, make_dataset(N), doc)
        out = alice.run("submit", str(job_toml), "--output", "json", timeout=180)
        assert out.code == 0, out.stderr
        job_id = str(json.loads(out.stdout)["job_id"])

        # kill -9 of the first mid-epoch, past a checkpoint: the second takes over.
        wait_mid_epoch(cluster, job_id, 0, "rounds mid-epoch", min_applied=EVERY + 2)
        cluster.coord.kill9()
        killed1 = int(time.time() * 1000)
        took = wait_serving(second, "the standby never became active")
        log.info("takeover after kill -9: %.1fs", took)
        cluster.point_at(second)
        # The job goes on on the second; the agents follow it.
        wait_mid_epoch(cluster, job_id, killed1, "rounds on the second", mid_epoch=False)
        # The first comes back as a standby (the nodes cordoned meanwhile, so that the job is
        # still running when the second is killed); the second is killed mid-epoch.
        set_cordoned(op, second, True)
        wait_followed(cluster, nodes, killed1, "the agents never followed to the second")
        restarted = start_standby(tmp_path / "coord", first, pg_url, blobs, STEADY_LEASES)
        check_standby(first, second)
        set_cordoned(op, second, False)
        uncordoned = int(time.time() * 1000)
        wait_mid_epoch(cluster, job_id, uncordoned, "rounds mid-epoch after the uncordon")
        stop(standby)
        killed2 = int(time.time() * 1000)
        took = wait_serving(first, "the restarted coordinator never became active")
        log.info("takeover back after kill -9: %.1fs", took)
        cluster.point_at(first)
        wait_followed(cluster, nodes, killed2, "the agents never followed back to the first")
        cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=300)

        # Every epoch covers every sample exactly once; the result is the replay of the rounds.
        everything = cluster.rounds(job_id, rolled_back=True)
        numbers = [r.round for r in everything]
        assert numbers == sorted(set(numbers))  # a round number names one round only
        by_first = check_killed_mid_epoch(everything, 0, killed1)
        by_second = check_killed_mid_epoch(everything, killed1, killed2)
        rolled = [r for r in everything if r.rolled_back]
        rounds = cluster.rounds(job_id)
        check_exactly_once(rounds, N, EPOCHS)
        assert {p.node_id for r in rounds for p in applied(r)} == nodes
        diff = check_replay(cluster, job_id, tmp_path, rounds, N, JOB_SEED)

        # The job's charges: the billing rule applied to each applied part, each charged once.
        statement = alice.run("statement", "--job", job_id, "--output", "json")
        assert statement.code == 0, statement.stderr
        earned, reruns = check_statement(statement.json()["entries"], everything, job_id, names)
        charges_by_the_rule(pg_server, database, cluster, job_id)
        balances = op.run("balance", "--all", "--output", "json")
        assert balances.code == 0, balances.stderr
        by_account = {b["account"]: b["balance_micro"] for b in balances.json()["balances"]}
        assert sum(by_account.values()) == 0
        assert by_account.get(f"escrow:{job_id}", 0) == 0
        assert by_account.get(f"held:{job_id}", 0) == 0
        done = cluster.job(job_id)
        assert done.spent_micro == earned - reruns

        epoch = pg_server.sql("SELECT epoch FROM coordinator_lease", database).strip()
        assert epoch == "3"
        for agent in cluster.agents.values():
            assert second in agent.log_text() and first in agent.log_text()
        log.info(
            "%d rounds (%d by the first, %d by the second before their kills; %d rolled back), "
            "replay diff %.1e, donors earned %d micro-credits, re-runs %d",
            len(everything),
            len(by_first),
            len(by_second),
            len(rolled),
            diff,
            earned,
            reruns,
        )
    finally:
        cluster.stop()
        stop(standby)
        if restarted is not None:
            stop(restarted)


@pytest.mark.timeout(300)
def test_an_active_whose_lease_connection_dies_stands_by_and_serves_again(
    tmp_path: Path, pg_server: PgServer, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPOCHMESH_STORE", pg_url)
    database = pg_url.rsplit("/", 1)[1]
    cluster = SharedCluster(tmp_path, pg_url)
    address = cluster.address
    try:
        cluster.start_agent("a", 2.0)
        cluster.wait_ready(["a"], timeout=90)
        n, epochs = 96, 2
        job_id = cluster.submit(tmp_path / "job", job_doc("steps-down", epochs=epochs), n)
        cluster.wait_rounds(
            job_id, lambda rs: any(applied(r) for r in rs), timeout=120, what="a first round"
        )
        assert pg_server.sql(terminate_lease_holder_sql(database)).strip() == "t"
        # With no standby it takes the lease back within tens of milliseconds: the step-down
        # is read from its log, not caught in a health poll.
        wait_until(
            lambda: "stepping down" in cluster.coord.log_tail(50000),
            timeout=60,
            message="the active never stepped down",
        )
        wait_serving(address, "the coordinator never took the lease back")
        assert cluster.coord.running()
        cluster.wait_state(job_id, JS.JOB_STATE_SUCCEEDED, timeout=180)
        check_exactly_once(cluster.rounds(job_id), n, epochs)
        charges_by_the_rule(pg_server, database, cluster, job_id)
        log = cluster.coord.log_tail(50000)
        steps = [
            "stepping down: the lease's database connection",
            "standing by for the coordinator lease again",
            "acquired the coordinator lease (epoch 2)",
            "coordinator serving on",
        ]
        at = log.find("acquired the coordinator lease (epoch 1)")
        for step in steps:
            at = log.find(step, at)
            assert at >= 0, f"{step!r} missing or out of order in the coordinator's log"
        assert "stopping what this coordinator served failed" not in log
        lease = pg_server.sql("SELECT epoch, address FROM coordinator_lease", database)
        assert lease.strip().split("|") == ["2", address]
        started = pg_server.sql(
            "SELECT count(*) FROM events WHERE kind = 'coordinator.started'", database
        )
        assert started.strip() == "2"
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_a_blob_dir_of_another_database_is_refused_at_start(
    tmp_path: Path, pg_server: PgServer, pg_url: str
) -> None:
    blobs = tmp_path / "blobs"
    coord = start_coordinator(
        tmp_path / "a", *serve_args(f"127.0.0.1:{free_port()}", pg_url, blobs)
    )
    coord.terminate()
    other = pg_server.create_database()
    try:
        done = subprocess.run(
            [
                str(console_script("epochmesh-coordinator")),
                "--data-dir",
                str(tmp_path / "b"),
                *serve_args("127.0.0.1:0", pg_server.url(other), blobs),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    finally:
        pg_server.drop_database(other)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line or "Traceback" in line]
    assert len(errors) == 1, done.stderr
    assert f"blob dir {blobs} holds the blobs of another database" in errors[0]
    assert pg_url.rsplit("/", 1)[1] in errors[0] and "--blob-dir" in errors[0]
