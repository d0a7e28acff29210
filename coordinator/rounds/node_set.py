"""One job's node set, as bookkeeping: the nodes the scheduler gave it, the ones benchmarking,
the members (in join order), each node's failures and exclusion, the nodes whose lease ended,
and the job-fault reports that may end the job. No I/O and no clock of its own: the runner
passes the time and turns what this says into events and store writes."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from coordinator.rounds.round_state import NodeStats, RoundState

# A node that fails this many tasks of a job in a row is left out of that job.
MAX_CONSECUTIVE_FAILURES = 3
# A job fails for its own fault (its program crashed, hung, hit a limit or computed non-finite
# values) once this many distinct nodes report such a fault since its last applied round (or
# every node it has, when it has fewer): one node alone cannot end another tenant's job.
JOB_FAULT_NODES = 2


class JobNodeSet:
    def __init__(self) -> None:
        self.members: list[str] = []  # the node set, in join order
        # Every node the scheduler gave the job and the job has not let go of yet (members,
        # nodes benchmarking, benchmarked ones waiting to join).
        self.held: set[str] = set()
        self._bench_pending: dict[str, tuple[str, float]] = {}  # node -> (task, asked at)
        self._bench_took: dict[str, float] = {}  # node -> seconds its job benchmark took
        self.stats: dict[str, NodeStats] = {}
        self._departed: dict[str, str] = {}  # node -> why its lease ended
        self.job_faults: dict[str, str] = {}  # node -> the job fault it reported
        self.job_fault_verdict = ""  # why the job fails for its own fault ("": it does not)

    # -- membership -----------------------------------------------------------------------------

    def excluded(self) -> list[str]:
        return [n for n, st in self.stats.items() if st.excluded]

    def is_excluded(self, node_id: str) -> bool:
        st = self.stats.get(node_id)
        return st is not None and st.excluded

    def choose(
        self, given: Iterable[str], max_nodes: int, reference_rate: Callable[[str], float]
    ) -> list[str]:
        """The nodes of the next round among those the scheduler ``given`` (now held): the
        members first, then the fastest by reference benchmark, at most ``max_nodes``."""
        given = list(given)
        self.held.update(given)
        current = [n for n in self.members if n in given]
        others = sorted((n for n in given if n not in current), key=lambda n: -reference_rate(n))
        return (current + others)[:max_nodes]

    def leaving(self, chosen: Iterable[str]) -> set[str]:
        """Nodes the job holds, benchmarks or counts as members that are not ``chosen``."""
        return {*self.members, *self._bench_pending, *self.held} - set(chosen)

    def join(self, node_id: str) -> None:
        self.stats.setdefault(node_id, NodeStats())
        self.members.append(node_id)

    def leave(self, node_id: str) -> bool:
        """The job lets the node go; returns whether it was a member."""
        member = node_id in self.members
        if member:
            self.members.remove(node_id)
        self._bench_pending.pop(node_id, None)
        self.held.discard(node_id)
        return member

    def release_all(self) -> list[str]:
        """Every node the job still has; the set is empty afterwards."""
        nodes = list(dict.fromkeys([*self.members, *self._bench_pending, *self.held]))
        self.members.clear()
        self.held.clear()
        self._bench_pending.clear()
        return nodes

    # -- job benchmarks -------------------------------------------------------------------------

    def benchmark_due(self, node_id: str, now: float, timeout_s: float) -> bool:
        """Whether to ask the node for a job benchmark (none asked, or unanswered too long)."""
        pending = self._bench_pending.get(node_id)
        return pending is None or now - pending[1] >= timeout_s

    def asked_benchmark(self, node_id: str, task_id: str, now: float) -> None:
        self._bench_pending[node_id] = (task_id, now)

    def benchmark_answered(self, node_id: str, now: float) -> None:
        asked = self._bench_pending.pop(node_id, None)
        if asked is not None:
            self._bench_took[node_id] = now - asked[1]

    def is_benchmark_task(self, node_id: str, task_id: str) -> bool:
        pending = self._bench_pending.get(node_id)
        return pending is not None and pending[0] == task_id

    def benchmark_failed(self, node_id: str, task_id: str) -> bool:
        """Forget the node's benchmark task if it is ``task_id``; returns whether it was."""
        if not self.is_benchmark_task(node_id, task_id):
            return False
        del self._bench_pending[node_id]
        return True

    def benchmarking(self) -> list[str]:
        return list(self._bench_pending)

    def benchmark_task_ids(self) -> set[str]:
        return {task for task, _ in self._bench_pending.values()}

    def bench_seconds(self, node_id: str, now: float) -> float:
        """How long the node's job benchmark took, or has taken so far (0: none asked)."""
        pending = self._bench_pending.get(node_id)
        if pending is not None:
            return now - pending[1]
        return self._bench_took.get(node_id, 0.0)

    # -- faults ---------------------------------------------------------------------------------

    def note_failure(self, node_id: str) -> int:
        """A task of the job failed on the node by the node's fault; returns the failures in a
        row when this one excludes the node from the job (else 0)."""
        st = self.stats.setdefault(node_id, NodeStats())
        st.failures_in_a_row += 1
        if st.failures_in_a_row >= MAX_CONSECUTIVE_FAILURES and not st.excluded:
            st.excluded = True
            return st.failures_in_a_row
        return 0

    def went_offline(self, node_id: str, reason: str) -> None:
        """The node's lease ended: its benchmark is not awaited any more, and (``reason`` not
        "") it leaves the job at the next round boundary."""
        self._bench_pending.pop(node_id, None)
        if reason:
            self._departed[node_id] = reason

    def take_departures(self) -> dict[str, str]:
        departed, self._departed = self._departed, {}
        return departed

    def job_fault(self, node_id: str, error: str) -> str:
        """The node says a task of the job failed by the job's own fault. Returns the verdict
        once enough distinct nodes said so (JOB_FAULT_NODES, or all the job's nodes when it has
        fewer) since the last applied round, else ""."""
        self.job_faults[node_id] = error[:300]
        holders = {*self.members, *self._bench_pending, *self.job_faults}
        needed = max(1, min(JOB_FAULT_NODES, len(holders)))
        if len(self.job_faults) < needed or self.job_fault_verdict:
            return ""
        nodes = ", ".join(sorted(self.job_faults))
        first = next(iter(self.job_faults.values()))
        self.job_fault_verdict = (
            f"the job's program failed on {len(self.job_faults)} node(s) ({nodes}): {first}"
        )
        return self.job_fault_verdict

    def observe(self, rs: RoundState) -> None:
        """A closed round's parts: an applied one resets its node's failures and adds its
        compute and communication time."""
        for p in rs.parts.values():
            st = self.stats.setdefault(p.node_id, NodeStats())
            if p.status == "applied":
                st.failures_in_a_row = 0
                st.compute_s += p.compute_s
                st.communicate_s += p.communicate_s()

    def round_applied(self) -> None:
        """The program works: faults reported before were transient."""
        self.job_faults.clear()
