"""`Store` in memory: plain dictionaries, the semantics of `SqliteStore` without a file.

For tests and short-lived coordinators: nothing survives `close()`. Every method keeps the
contract of the `Store` docstrings and does what the SQLite backend does (the same errors,
orders, defaults and ids), checked by tests/unit/test_store_contract.py against both.

- Records are kept as immutable values (frozen dataclasses, bytes, serialized protos), so a
  returned record is always a fresh object: mutating it never changes the store, and a
  caller's later change to a record it handed in is not seen either.
- Writes are serialized by an asyncio lock, as on SQLite. A write outside a transaction runs
  without awaiting once it holds the lock, so no other task sees it half done, and it checks
  everything it can refuse before it changes anything (a refused write leaves nothing).
- A transaction (``async with store.transaction():``) writes into copies of the tables, made
  at its first write; the commit swaps them in, a failure drops them. Other tasks read the
  committed tables meanwhile, and their writes wait for the lock. Id counters live in the
  tables too, so a rolled-back transaction gives its ids back (as SQLite's AUTOINCREMENT
  counter, which is rolled back with it).
- Appended events are announced to the listeners after the commit, in id order.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.accounting.credit_book import Entry
from coordinator.core.errors import AlreadyExistsError, NotFoundError, StoreError
from coordinator.store.base import (
    BlobRecord,
    BlobStats,
    EventListener,
    HeartbeatUpdate,
    NodeRecord,
    Store,
    TokenRecord,
    kind_matches,
    new_event,
    new_job_record,
)
from coordinator.store.migrations import LATEST_SCHEMA_VERSION
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

log = logging.getLogger(__name__)


# -- rows: immutable, so that a shallow copy of a table is a snapshot of it ----------------------


@dataclass(frozen=True)
class _Node:
    lease_id: str
    state: int
    registered_ms: int
    # Heartbeat times are written in batches to these only: they override those in ``info``.
    last_heartbeat_ms: int
    lease_expires_ms: int
    info: bytes


@dataclass(frozen=True)
class _Event:
    time_ms: int
    kind: str
    node_id: str
    job_id: str
    data: bytes  # the Event without its id


@dataclass(frozen=True)
class _Job:
    owner: str
    state: int
    created_ms: int
    data: bytes


@dataclass(frozen=True)
class _Round:
    row_id: int  # insertion order, across jobs
    round: int
    rolled_back: bool
    data: bytes


@dataclass(frozen=True)
class _Revocation:
    role: str
    revoked_ms: int
    reason: str


@dataclass
class _Tables:
    """Every table and id counter; a dict's insertion order is SQLite's rowid order."""

    nodes: dict[str, _Node] = field(default_factory=dict)
    events: dict[int, _Event] = field(default_factory=dict)
    blobs: dict[str, BlobRecord] = field(default_factory=dict)
    blob_owners: dict[tuple[str, str], int] = field(default_factory=dict)  # (sha, owner) -> ms
    job_blobs: dict[tuple[str, str], None] = field(default_factory=dict)  # (job, sha)
    jobs: dict[str, _Job] = field(default_factory=dict)
    rounds: dict[str, tuple[_Round, ...]] = field(default_factory=dict)  # by job
    checkpoints: dict[tuple[str, int], bytes] = field(default_factory=dict)
    job_state: dict[tuple[str, str], bytes] = field(default_factory=dict)
    tokens: dict[str, TokenRecord] = field(default_factory=dict)
    node_donors: dict[str, str] = field(default_factory=dict)
    revocations: dict[str, _Revocation] = field(default_factory=dict)
    tenant_weights: dict[str, float] = field(default_factory=dict)
    ledger: dict[int, Entry] = field(default_factory=dict)
    scheduler_state: dict[str, bytes] = field(default_factory=dict)
    # The last id handed out (never lowered by deletions; rolled back with a transaction).
    event_seq: int = 0
    round_seq: int = 0
    ledger_seq: int = 0

    def copy(self) -> _Tables:
        """A snapshot: new dictionaries holding the same immutable rows."""
        snapshot = copy.copy(self)
        for f in dataclasses.fields(self):
            table = getattr(self, f.name)
            if isinstance(table, dict):
                setattr(snapshot, f.name, dict(table))
        return snapshot


@dataclass
class _Txn:
    task: asyncio.Task[object] | None
    tables: _Tables | None = None  # the copies, made at the first write
    events: list[common_pb2.Event] = field(default_factory=list)


class MemoryStore(Store):
    """Create with ``MemoryStore()``; close with ``await store.close()`` (its data is gone)."""

    def __init__(self) -> None:
        self._data = _Tables()
        self._lock = asyncio.Lock()
        self._txn: _Txn | None = None
        self._pending_events: list[common_pb2.Event] = []
        self._listeners: list[EventListener] = []
        self._closed = False

    @property
    def schema_version(self) -> int:
        """The latest: this backend keeps what the newest SQLite schema keeps."""
        return LATEST_SCHEMA_VERSION

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            self._data = _Tables()

    # -- transactions ---------------------------------------------------------------------------

    def _in_txn(self) -> bool:
        return self._txn is not None and self._txn.task is asyncio.current_task()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        if self._in_txn():
            yield  # join the enclosing transaction
            return
        async with self._lock:
            self._check_open()
            txn = self._txn = _Txn(asyncio.current_task())
            try:
                yield
            finally:
                self._txn = None
            # Only reached when the block did not raise: commit.
            if txn.tables is not None:
                self._data = txn.tables
            self._announce(txn.events)

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[_Tables]:
        """The tables to change: the transaction's copies inside the caller's transaction, else
        the committed ones, under the lock (the caller changes them without awaiting)."""
        if self._in_txn():
            assert self._txn is not None
            if self._txn.tables is None:
                self._txn.tables = self._data.copy()
            yield self._txn.tables
            return
        async with self._lock:
            self._check_open()
            self._pending_events = []
            try:
                yield self._data
            except BaseException:
                self._pending_events = []
                raise
            events, self._pending_events = self._pending_events, []
            self._announce(events)

    def _queue_event(self, event: common_pb2.Event) -> None:
        if self._in_txn():
            assert self._txn is not None
            self._txn.events.append(event)
        else:
            self._pending_events.append(event)

    def _announce(self, events: list[common_pb2.Event]) -> None:
        for event in events:
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("event listener failed on event %d", event.id)

    def _read(self) -> _Tables:
        """What this task may read: its transaction's writes, else the committed tables."""
        self._check_open()
        if self._in_txn() and self._txn is not None and self._txn.tables is not None:
            return self._txn.tables
        return self._data

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def add_event_listener(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    # -- nodes ----------------------------------------------------------------------------------

    async def upsert_node(self, record: NodeRecord) -> None:
        info = record.info
        row = _Node(
            lease_id=record.lease_id,
            state=int(info.state),
            registered_ms=info.registered_at_ms,
            last_heartbeat_ms=info.last_heartbeat_ms,
            lease_expires_ms=info.lease_expires_ms,
            info=info.SerializeToString(),
        )
        async with self._write() as t:
            t.nodes[info.node_id] = row

    async def update_heartbeats(self, updates: Sequence[HeartbeatUpdate]) -> None:
        if not updates:
            return
        async with self._write() as t:
            for u in updates:
                row = t.nodes.get(u.node_id)
                if row is not None:
                    t.nodes[u.node_id] = dataclasses.replace(
                        row,
                        last_heartbeat_ms=u.last_heartbeat_ms,
                        lease_expires_ms=u.lease_expires_ms,
                    )

    @staticmethod
    def _node_record(row: _Node) -> NodeRecord:
        info = common_pb2.NodeInfo.FromString(row.info)
        info.last_heartbeat_ms = row.last_heartbeat_ms
        info.lease_expires_ms = row.lease_expires_ms
        return NodeRecord(info=info, lease_id=row.lease_id)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        row = self._read().nodes.get(node_id)
        return None if row is None else self._node_record(row)

    async def list_nodes(self, states: Collection[int] = ()) -> list[NodeRecord]:
        wanted = {int(s) for s in states}
        rows = sorted(
            (
                (row.registered_ms, node_id, row)
                for node_id, row in self._read().nodes.items()
                if not wanted or row.state in wanted
            ),
            key=lambda item: (item[0], item[1]),
        )
        return [self._node_record(row) for _, _, row in rows]

    # -- events ---------------------------------------------------------------------------------

    async def append_event(
        self,
        kind: str,
        *,
        node_id: str = "",
        job_id: str = "",
        message: str = "",
        attrs: Mapping[str, str] | None = None,
        time_ms: int | None = None,
    ) -> common_pb2.Event:
        event = new_event(
            kind, node_id=node_id, job_id=job_id, message=message, attrs=attrs, time_ms=time_ms
        )
        row = _Event(event.time_ms, kind, node_id, job_id, event.SerializeToString())
        async with self._write() as t:
            t.event_seq += 1
            event.id = t.event_seq
            t.events[event.id] = row
            self._queue_event(event)
        out = common_pb2.Event()
        out.CopyFrom(event)
        return out

    async def list_events(
        self,
        since_id: int = 0,
        *,
        node_id: str = "",
        job_id: str = "",
        kinds: Collection[str] = (),
        limit: int = 1000,
    ) -> list[common_pb2.Event]:
        out: list[common_pb2.Event] = []
        for event_id, row in self._read().events.items():  # in id order
            if event_id <= since_id:
                continue
            if node_id and row.node_id != node_id or job_id and row.job_id != job_id:
                continue
            if not kind_matches(row.kind, kinds):
                continue
            event = common_pb2.Event.FromString(row.data)
            event.id = event_id
            out.append(event)
            if 0 < limit <= len(out):
                break
        return out

    async def last_event_id(self) -> int:
        return self._read().event_seq

    async def count_events(self) -> int:
        return len(self._read().events)

    async def prune_events(
        self, before_ms: int, *, keep_job_states: Collection[int] = (), limit: int = 10_000
    ) -> int:
        keep = {int(s) for s in keep_job_states}
        async with self._write() as t:
            kept_jobs = {job_id for job_id, job in t.jobs.items() if job.state in keep}
            old = [
                (row.time_ms, event_id)
                for event_id, row in t.events.items()
                if row.time_ms < before_ms and (not row.job_id or row.job_id not in kept_jobs)
            ]
            if limit > 0:
                old = sorted(old)[:limit]  # oldest first, as SQLite's time index finds them
            for _, event_id in old:
                del t.events[event_id]
        return len(old)

    # -- blobs ----------------------------------------------------------------------------------

    async def add_blob(self, sha256: str, size: int) -> BlobRecord:
        created = now_ms()
        async with self._write() as t:
            record = t.blobs.setdefault(sha256, BlobRecord(sha256, size, created))
        return record

    async def get_blob(self, sha256: str) -> BlobRecord | None:
        return self._read().blobs.get(sha256)

    async def list_blobs(self, after: str = "", limit: int = 0) -> list[BlobRecord]:
        blobs = sorted(
            (b for sha, b in self._read().blobs.items() if sha > after), key=lambda b: b.sha256
        )
        return blobs[:limit] if limit > 0 else blobs

    async def remove_blob(self, sha256: str) -> bool:
        async with self._write() as t:
            return t.blobs.pop(sha256, None) is not None

    async def touch_blob(self, sha256: str) -> bool:
        async with self._write() as t:
            record = t.blobs.get(sha256)
            if record is None:
                return False
            t.blobs[sha256] = dataclasses.replace(record, created_ms=now_ms())
        return True

    async def blob_stats(self) -> BlobStats:
        blobs = self._read().blobs
        return BlobStats(count=len(blobs), total_bytes=sum(b.size for b in blobs.values()))

    # -- blob ownership -------------------------------------------------------------------------

    async def add_blob_owner(self, sha256: str, owner: str) -> None:
        created = now_ms()
        async with self._write() as t:
            t.blob_owners.setdefault((sha256, owner), created)

    async def blob_visible_to(self, sha256: str, owner: str) -> bool:
        t = self._read()
        if sha256 not in t.blobs:
            return False
        if (sha256, owner) in t.blob_owners:
            return True
        for job_id, sha in t.job_blobs:
            job = t.jobs.get(job_id)
            if sha == sha256 and job is not None and job.owner == owner:
                return True
        return False

    async def blob_owners(self, sha256: str) -> set[str]:
        return {owner for sha, owner in self._read().blob_owners if sha == sha256}

    async def remove_blob_owners(self, sha256: str, owners: Collection[str]) -> int:
        async with self._write() as t:
            removed = 0
            for owner in dict.fromkeys(owners):
                if t.blob_owners.pop((sha256, owner), None) is not None:
                    removed += 1
        return removed

    async def owned_blob_bytes(self, owner: str) -> int:
        t = self._read()
        return sum(
            t.blobs[sha].size for sha, who in t.blob_owners if who == owner and sha in t.blobs
        )

    async def add_job_blobs(self, job_id: str, sha256s: Collection[str]) -> None:
        async with self._write() as t:
            for sha in sha256s:
                t.job_blobs.setdefault((job_id, sha), None)

    async def job_blobs(self, job_id: str) -> set[str]:
        return {sha for job, sha in self._read().job_blobs if job == job_id}

    # -- jobs -----------------------------------------------------------------------------------

    async def create_job(self, job: common_pb2.Job, owner: str) -> common_pb2.Job:
        stored = new_job_record(job, owner)
        row = _Job(owner, int(stored.state), stored.created_ms, stored.SerializeToString())
        async with self._write() as t:
            if stored.job_id in t.jobs:
                raise AlreadyExistsError(f"job {stored.job_id} already exists")
            t.jobs[stored.job_id] = row
        return stored

    async def get_job(self, job_id: str) -> common_pb2.Job | None:
        row = self._read().jobs.get(job_id)
        return None if row is None else common_pb2.Job.FromString(row.data)

    async def list_jobs(
        self, states: Collection[int] = (), owner: str | None = None, limit: int = 0
    ) -> list[common_pb2.Job]:
        wanted = {int(s) for s in states}
        rows = sorted(
            (
                (row.created_ms, job_id, row.data)
                for job_id, row in self._read().jobs.items()
                if (not wanted or row.state in wanted) and (owner is None or row.owner == owner)
            ),
            reverse=True,
        )
        if limit > 0:
            rows = rows[:limit]
        return [common_pb2.Job.FromString(data) for _, _, data in rows]

    async def update_job(self, job: common_pb2.Job) -> None:
        row = _Job(job.owner, int(job.state), job.created_ms, job.SerializeToString())
        async with self._write() as t:
            if job.job_id not in t.jobs:
                raise NotFoundError(f"job {job.job_id!r} not found")
            t.jobs[job.job_id] = row

    async def count_jobs_by_state(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for row in self._read().jobs.values():
            counts[row.state] = counts.get(row.state, 0) + 1
        return counts

    # -- rounds ---------------------------------------------------------------------------------

    async def add_round(self, record: common_pb2.RoundRecord) -> None:
        data = record.SerializeToString()
        async with self._write() as t:
            if record.job_id not in t.jobs:
                raise NotFoundError(f"job {record.job_id!r} not found")
            rows = t.rounds.get(record.job_id, ())
            if any(r.round == record.round and not r.rolled_back for r in rows):
                raise AlreadyExistsError(f"job {record.job_id} already has round {record.round}")
            t.round_seq += 1
            t.rounds[record.job_id] = (*rows, _Round(t.round_seq, record.round, False, data))

    async def list_rounds(
        self,
        job_id: str,
        since_round: int = 0,
        limit: int = 0,
        include_rolled_back: bool = False,
    ) -> list[common_pb2.RoundRecord]:
        rows = sorted(
            (
                r
                for r in self._read().rounds.get(job_id, ())
                if r.round > since_round and (include_rolled_back or not r.rolled_back)
            ),
            key=lambda r: (r.round, r.row_id),
        )
        if limit > 0:
            rows = rows[:limit]
        out = []
        for row in rows:
            record = common_pb2.RoundRecord.FromString(row.data)
            record.rolled_back = row.rolled_back
            out.append(record)
        return out

    async def rollback_rounds(self, job_id: str, after_round: int) -> int:
        async with self._write() as t:
            rows = t.rounds.get(job_id, ())
            hit = [r.round > after_round and not r.rolled_back for r in rows]
            if any(hit):
                t.rounds[job_id] = tuple(
                    dataclasses.replace(r, rolled_back=True) if h else r
                    for r, h in zip(rows, hit, strict=True)
                )
        return sum(hit)

    # -- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(self, job_id: str, round: int, manifest: bytes) -> None:
        async with self._write() as t:
            t.checkpoints[(job_id, round)] = bytes(manifest)

    def _checkpoints_of(self, job_id: str) -> list[tuple[int, bytes]]:
        return sorted((r, m) for (j, r), m in self._read().checkpoints.items() if j == job_id)

    async def latest_checkpoint(self, job_id: str) -> tuple[int, bytes] | None:
        checkpoints = self._checkpoints_of(job_id)
        return checkpoints[-1] if checkpoints else None

    async def checkpoint_before(self, job_id: str, round: int) -> tuple[int, bytes] | None:
        before = [c for c in self._checkpoints_of(job_id) if c[0] < round]
        return before[-1] if before else None

    async def drop_checkpoints_after(self, job_id: str, round: int) -> int:
        async with self._write() as t:
            later = [key for key in t.checkpoints if key[0] == job_id and key[1] > round]
            for key in later:
                del t.checkpoints[key]
        return len(later)

    async def list_checkpoints(self, job_id: str = "") -> list[tuple[str, int, bytes]]:
        return sorted(
            (j, r, m) for (j, r), m in self._read().checkpoints.items() if not job_id or j == job_id
        )

    async def drop_checkpoints(self, job_id: str, rounds: Collection[int]) -> list[bytes]:
        dropped: list[bytes] = []
        if not rounds:
            return dropped
        async with self._write() as t:
            for r in sorted({int(r) for r in rounds}):
                manifest = t.checkpoints.pop((job_id, r), None)
                if manifest is not None:
                    dropped.append(manifest)
        return dropped

    # -- per-job engine state -------------------------------------------------------------------

    async def put_job_state(self, job_id: str, key: str, value: bytes) -> None:
        async with self._write() as t:
            t.job_state[(job_id, key)] = bytes(value)

    async def get_job_state(self, job_id: str, key: str) -> bytes | None:
        return self._read().job_state.get((job_id, key))

    async def delete_job_state(self, job_id: str, key: str) -> bool:
        async with self._write() as t:
            return t.job_state.pop((job_id, key), None) is not None

    # -- trust ----------------------------------------------------------------------------------

    async def add_token(self, record: TokenRecord) -> None:
        stored = TokenRecord(
            record.token_hash,
            record.role,
            record.created_ms,
            record.expires_ms,
            bool(record.reusable),
            record.uses,
            record.donor,
            record.max_uses,
            record.cert_ttl_ms,
        )
        async with self._write() as t:
            if stored.token_hash in t.tokens:
                raise AlreadyExistsError("token already exists")
            t.tokens[stored.token_hash] = stored

    async def redeem_token(self, token_hash: str, now_ms: int) -> TokenRecord | None:
        async with self._write() as t:
            token = t.tokens.get(token_hash)
            if (
                token is None
                or token.expires_ms <= now_ms
                or not (token.reusable or token.uses == 0)
                or not (token.max_uses == 0 or token.uses < token.max_uses)
            ):
                return None
            used = t.tokens[token_hash] = dataclasses.replace(token, uses=token.uses + 1)
        return used

    async def get_token(self, token_hash: str) -> TokenRecord | None:
        return self._read().tokens.get(token_hash)

    async def quarantined_nodes_of_donor(self, donor: str) -> list[str]:
        t = self._read()
        quarantined = int(common_pb2.NODE_STATE_QUARANTINED)
        return sorted(
            node_id
            for node_id, who in t.node_donors.items()
            if who == donor and node_id in t.nodes and t.nodes[node_id].state == quarantined
        )

    async def set_node_donor(self, node_id: str, donor: str) -> None:
        async with self._write() as t:
            t.node_donors[node_id] = donor

    async def get_node_donor(self, node_id: str) -> str:
        return self._read().node_donors.get(node_id, "")

    async def list_node_donors(self) -> dict[str, str]:
        return dict(self._read().node_donors)

    async def add_revocation(self, principal: str, role: str, reason: str) -> bool:
        revoked = _Revocation(role, now_ms(), reason)
        async with self._write() as t:
            if principal in t.revocations:
                return False
            t.revocations[principal] = revoked
        return True

    async def list_revocations(self) -> list[str]:
        return sorted(self._read().revocations)

    # -- cluster scheduler ----------------------------------------------------------------------

    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        async with self._write() as t:
            t.tenant_weights[tenant] = float(weight)

    async def list_tenant_weights(self) -> dict[str, float]:
        return dict(self._read().tenant_weights)

    async def put_scheduler_state(self, key: str, value: bytes) -> None:
        async with self._write() as t:
            t.scheduler_state[key] = bytes(value)

    async def get_scheduler_state(self, key: str) -> bytes | None:
        return self._read().scheduler_state.get(key)

    # -- credit ledger --------------------------------------------------------------------------

    async def add_ledger_entries(self, entries: Sequence[Entry]) -> list[int]:
        rows = [
            Entry(
                int(e.at_ms),
                e.from_account,
                e.to_account,
                int(e.amount),
                e.reason,
                e.job_id,
                int(e.round),
                e.node_id,
                int(e.samples),
            )
            for e in entries
        ]
        for row in rows:
            # SQLite's CHECK (amount > 0), refused before anything is written.
            if row.amount <= 0:
                raise ValueError(f"a ledger entry moves a positive amount, not {row.amount}")
        ids: list[int] = []
        async with self._write() as t:
            for row in rows:
                t.ledger_seq += 1
                t.ledger[t.ledger_seq] = row
                ids.append(t.ledger_seq)
        return ids

    async def list_ledger_entries(
        self, account: str = "", job_id: str = "", after_id: int = 0, limit: int = 0
    ) -> list[tuple[int, Entry]]:
        out: list[tuple[int, Entry]] = []
        for entry_id, e in self._read().ledger.items():  # in id order
            if entry_id <= after_id:
                continue
            if account and account not in (e.from_account, e.to_account):
                continue
            if job_id and e.job_id != job_id:
                continue
            out.append((entry_id, e))
            if 0 < limit <= len(out):
                break
        return out

    async def ledger_balances(self) -> dict[str, int]:
        balances: dict[str, int] = {}
        for e in self._read().ledger.values():
            balances[e.to_account] = balances.get(e.to_account, 0) + e.amount
            balances[e.from_account] = balances.get(e.from_account, 0) - e.amount
        return dict(sorted(balances.items()))
