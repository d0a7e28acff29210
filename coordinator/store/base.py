"""The coordinator's store interface: everything persistent goes through `Store`.

`coordinator.store.sqlite.SqliteStore` implements it on SQLite, `coordinator.store.memory.
MemoryStore` in memory (for tests); a server database can replace them later without touching
the services, the scheduler or the engine. tests/unit/test_store_contract.py runs one suite of
what MUST hold against every backend.

Records that mirror a proto message are handed in and out as proto messages (copies: mutating
a returned message never changes the store, and neither does changing a message after handing
it in). Getters return None for a missing record; updates of a missing record raise
`NotFoundError`. Records of one table MUST NOT require a record of another unless a method says
so (a job's blobs, a node's donor, a checkpoint or job state of a job not stored are kept).

Domain errors: the store raises the `CoordinatorError` subclasses of coordinator/core/errors.py
(turned into gRPC status codes by the gRPC layer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from coordinator.accounting.credit_book import Entry
from coordinator.core.ids import new_job_id
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2

# -- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRecord:
    """A node as stored: its NodeInfo plus the current lease id (never shown to operators)."""

    info: common_pb2.NodeInfo
    lease_id: str


@dataclass(frozen=True)
class HeartbeatUpdate:
    node_id: str
    last_heartbeat_ms: int
    lease_expires_ms: int


@dataclass(frozen=True)
class BlobRecord:
    sha256: str
    size: int
    created_ms: int


@dataclass(frozen=True)
class BlobStats:
    count: int
    total_bytes: int


EventListener = Callable[[common_pb2.Event], None]


def kind_matches(kind: str, patterns: Collection[str]) -> bool:
    """An event kind matches when ``patterns`` is empty, equals one of them, or starts with the
    text before a trailing ``*`` ("node.*" matches "node.offline")."""
    if not patterns:
        return True
    for pattern in patterns:
        if pattern.endswith("*"):
            if kind.startswith(pattern[:-1]):
                return True
        elif kind == pattern:
            return True
    return False


def event_matches(
    event: common_pb2.Event, node_id: str = "", job_id: str = "", kinds: Collection[str] = ()
) -> bool:
    """The filter of `Store.list_events`, for events already in memory."""
    if node_id and event.node_id != node_id:
        return False
    if job_id and event.job_id != job_id:
        return False
    return kind_matches(event.kind, kinds)


def new_job_record(job: common_pb2.Job, owner: str) -> common_pb2.Job:
    """The job `Store.create_job` persists: a copy of ``job`` owned by ``owner``, with a new
    id where it has none and its creation and update times set (now) where unset."""
    stored = common_pb2.Job()
    stored.CopyFrom(job)
    if not stored.job_id:
        stored.job_id = new_job_id()
    stored.owner = owner
    now = now_ms()
    if stored.created_ms == 0:
        stored.created_ms = now
    if stored.updated_ms == 0:
        stored.updated_ms = now
    return stored


def new_event(
    kind: str,
    *,
    node_id: str = "",
    job_id: str = "",
    message: str = "",
    attrs: Mapping[str, str] | None = None,
    time_ms: int | None = None,
) -> common_pb2.Event:
    """The event `Store.append_event` persists, before it has an id (``time_ms`` None: now)."""
    event = common_pb2.Event(
        time_ms=now_ms() if time_ms is None else time_ms,
        kind=kind,
        node_id=node_id,
        job_id=job_id,
        message=message,
    )
    if attrs:
        event.attrs.update(attrs)
    return event


# -- the interface ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenRecord:
    """A join token as stored: only the SHA-256 of its secret, never the secret."""

    token_hash: str
    role: str
    created_ms: int
    expires_ms: int
    reusable: bool
    uses: int = 0
    # Role node: the donor whose account its nodes earn for ("": each node its own).
    donor: str = ""
    # A reusable token's limit on enrollments (0: none until it expires).
    max_uses: int = 0
    # Lifetime of the certificates it enrolls (0: the coordinator's default).
    cert_ttl_ms: int = 0

    def exhausted(self) -> bool:
        """Whether it may enroll nobody more."""
        if not self.reusable:
            return self.uses >= 1
        return 0 < self.max_uses <= self.uses


class Store(ABC):
    """Persistent state of the coordinator. All methods are coroutines except where noted.

    Transactions: every write method commits on its own, unless it runs inside
    ``async with store.transaction():`` in the same asyncio task, in which case everything
    done in the block commits together (or not at all, if the block raises). Writes of other
    tasks wait until the transaction ends; reads of other tasks see only committed data.
    Nested ``transaction()`` blocks join the outer one. Do not hand the transaction's work to
    other tasks (they would wait for it: deadlock).

    Once `close` has been called, every read, write and ``transaction()`` MUST raise StoreError
    ("the store is closed"); a write given nothing to write may return without looking.
    """

    # -- lifecycle and transactions -------------------------------------------------------------

    @property
    @abstractmethod
    def schema_version(self) -> int:
        """The schema version the data is kept in (a backend without migrations: the latest)."""

    @abstractmethod
    async def close(self) -> None:
        """Release the store; closing twice is harmless. It waits for an open transaction."""

    @abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[None]: ...

    @abstractmethod
    def add_event_listener(self, listener: EventListener) -> None:
        """``listener(event)`` is called (synchronously, in id order) for every appended event
        once it is committed; events of a rolled-back transaction are never announced. A
        listener's exception MUST be logged, not raised to the writer (the write is committed)."""

    # -- nodes ----------------------------------------------------------------------------------

    @abstractmethod
    async def upsert_node(self, record: NodeRecord) -> None:
        """Insert the node or replace its whole record (state, registration and heartbeat times
        included)."""

    @abstractmethod
    async def update_heartbeats(self, updates: Sequence[HeartbeatUpdate]) -> None:
        """Batch update of last_heartbeat_ms / lease_expires_ms; unknown ids are ignored. The
        nodes read back MUST carry the times written last, by this or by `upsert_node`."""

    @abstractmethod
    async def get_node(self, node_id: str) -> NodeRecord | None: ...

    @abstractmethod
    async def list_nodes(self, states: Collection[int] = ()) -> list[NodeRecord]:
        """Nodes in registration order (registered_at_ms, then node_id); ``states`` (NodeState
        values) filters, empty = all."""

    # -- events ---------------------------------------------------------------------------------

    @abstractmethod
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
        """Persist an event (``time_ms`` None: now); returns a copy with its id. Ids MUST be
        strictly increasing and never reused once committed (a rolled-back transaction's ids,
        never seen by anyone, may be handed out again)."""

    @abstractmethod
    async def list_events(
        self,
        since_id: int = 0,
        *,
        node_id: str = "",
        job_id: str = "",
        kinds: Collection[str] = (),
        limit: int = 1000,
    ) -> list[common_pb2.Event]:
        """Events with id > since_id matching the filters (see `event_matches`), oldest first,
        at most ``limit`` (0 = no limit)."""

    @abstractmethod
    async def last_event_id(self) -> int:
        """The highest id a committed append handed out (0: none), even when retention has
        deleted that event since."""

    @abstractmethod
    async def count_events(self) -> int:
        """How many events are stored."""

    @abstractmethod
    async def prune_events(
        self, before_ms: int, *, keep_job_states: Collection[int] = (), limit: int = 10_000
    ) -> int:
        """Delete up to ``limit`` (0: all) events older than ``before_ms``, except those of jobs
        whose state is in ``keep_job_states`` (events of jobs not stored are not kept); returns
        how many. With a limit, the oldest (by time, then id) go first. Event ids are never
        reused: `last_event_id` stays where it was."""

    # -- blobs ----------------------------------------------------------------------------------

    @abstractmethod
    async def add_blob(self, sha256: str, size: int) -> BlobRecord:
        """Record a verified blob, created now (idempotent: an existing record is returned
        unchanged, its size and time included)."""

    @abstractmethod
    async def get_blob(self, sha256: str) -> BlobRecord | None: ...

    @abstractmethod
    async def list_blobs(self, after: str = "", limit: int = 0) -> list[BlobRecord]:
        """Blobs ordered by sha256, those > ``after``; ``limit`` 0 = all."""

    @abstractmethod
    async def remove_blob(self, sha256: str) -> bool:
        """Forget the blob's record; whether it was stored. Its owners' holds and its jobs'
        records stay (they no longer make it visible or count)."""

    @abstractmethod
    async def touch_blob(self, sha256: str) -> bool:
        """Make a stored blob new again (its grace before collection starts over: it is about
        to be named); False when it is not stored (collected meanwhile)."""

    @abstractmethod
    async def blob_stats(self) -> BlobStats:
        """How many blobs are stored and their total size (0, 0 when none)."""

    # -- blob ownership: who uploaded a blob, which jobs use it ----------------------------------

    @abstractmethod
    async def add_blob_owner(self, sha256: str, owner: str) -> None:
        """Record that ``owner`` uploaded the blob (idempotent; the blob need not be stored)."""

    @abstractmethod
    async def blob_visible_to(self, sha256: str, owner: str) -> bool:
        """Whether the blob is stored and ``owner`` uploaded it or one of its jobs uses it."""

    @abstractmethod
    async def blob_owners(self, sha256: str) -> set[str]:
        """The identities that uploaded the blob and hold it still (whether or not the blob is
        stored)."""

    @abstractmethod
    async def remove_blob_owners(self, sha256: str, owners: Collection[str]) -> int:
        """Drop ``owners``' hold on the blob; returns how many holds went (an owner named twice
        counts once)."""

    @abstractmethod
    async def owned_blob_bytes(self, owner: str) -> int:
        """The total size of the stored blobs ``owner`` uploaded (its storage quota's use)."""

    @abstractmethod
    async def add_job_blobs(self, job_id: str, sha256s: Collection[str]) -> None:
        """Record the blobs a job uses (its program, initial state and shards); idempotent."""

    @abstractmethod
    async def job_blobs(self, job_id: str) -> set[str]:
        """The blobs recorded for the job, stored or not (empty: none)."""

    # -- jobs -----------------------------------------------------------------------------------

    @abstractmethod
    async def create_job(self, job: common_pb2.Job, owner: str) -> common_pb2.Job:
        """Store a new job. An empty job_id gets a fresh "j-..." id; owner is set from
        ``owner``; created_ms/updated_ms are set when 0 (to now). Returns a copy of the stored
        job; the caller's message is left as it was. AlreadyExistsError if the id is taken."""

    @abstractmethod
    async def get_job(self, job_id: str) -> common_pb2.Job | None: ...

    @abstractmethod
    async def list_jobs(
        self, states: Collection[int] = (), owner: str | None = None, limit: int = 0
    ) -> list[common_pb2.Job]:
        """Newest first (created_ms, then job_id, both descending); ``states`` (JobState values)
        filters, empty = all; ``owner`` None = any owner ("" is an owner); limit 0 = all."""

    @abstractmethod
    async def update_job(self, job: common_pb2.Job) -> None:
        """Replace the whole record (the proto is stored as given: its owner, state and
        created_ms included, so the filters and the order of `list_jobs` follow them).
        NotFoundError if absent."""

    @abstractmethod
    async def count_jobs_by_state(self) -> dict[int, int]:
        """JobState value -> how many jobs are in it (states without jobs are absent)."""

    # -- rounds ---------------------------------------------------------------------------------

    @abstractmethod
    async def add_round(self, record: common_pb2.RoundRecord) -> None:
        """Store a live round record. AlreadyExistsError if the job already has a live (not
        rolled back) round with that number; NotFoundError if the job does not exist (nothing
        is written either way). The record's own ``rolled_back`` field is ignored."""

    @abstractmethod
    async def list_rounds(
        self,
        job_id: str,
        since_round: int = 0,
        limit: int = 0,
        include_rolled_back: bool = False,
    ) -> list[common_pb2.RoundRecord]:
        """Rounds with round > since_round in ascending order (then in insertion order);
        limit 0 = all. Rolled-back rounds only with include_rolled_back; each record's
        ``rolled_back`` field says whether it was. An unknown job has none."""

    @abstractmethod
    async def rollback_rounds(self, job_id: str, after_round: int) -> int:
        """Mark live rounds with round > after_round as rolled back (kept, never deleted: their
        numbers may be recorded again); returns how many."""

    # -- checkpoints ----------------------------------------------------------------------------

    @abstractmethod
    async def save_checkpoint(self, job_id: str, round: int, manifest: bytes) -> None:
        """Record (or replace) the checkpoint of ``job_id`` at ``round``."""

    @abstractmethod
    async def latest_checkpoint(self, job_id: str) -> tuple[int, bytes] | None:
        """(round, manifest) of the checkpoint with the highest round, or None."""

    @abstractmethod
    async def checkpoint_before(self, job_id: str, round: int) -> tuple[int, bytes] | None:
        """(round, manifest) of the newest checkpoint taken before ``round`` (its round is
        lower), or None."""

    @abstractmethod
    async def drop_checkpoints_after(self, job_id: str, round: int) -> int:
        """Forget the checkpoints of ``job_id`` after ``round`` (a rollback to ``round`` made
        them history); returns how many."""

    @abstractmethod
    async def list_checkpoints(self, job_id: str = "") -> list[tuple[str, int, bytes]]:
        """(job_id, round, manifest) of the checkpoints of ``job_id`` (empty: of every job),
        ordered by job and round."""

    @abstractmethod
    async def drop_checkpoints(self, job_id: str, rounds: Collection[int]) -> list[bytes]:
        """Forget the checkpoints of ``job_id`` at ``rounds`` (retention); the manifests of
        those that were there, in ascending round order."""

    # -- per-job engine state -------------------------------------------------------------------

    @abstractmethod
    async def put_job_state(self, job_id: str, key: str, value: bytes) -> None:
        """Set (or replace) the value under (``job_id``, ``key``)."""

    @abstractmethod
    async def get_job_state(self, job_id: str, key: str) -> bytes | None: ...

    @abstractmethod
    async def delete_job_state(self, job_id: str, key: str) -> bool:
        """Forget the value; whether there was one."""

    # -- trust: join tokens and revocations -----------------------------------------------------

    @abstractmethod
    async def add_token(self, record: TokenRecord) -> None:
        """Store a new join token as given, its ``uses`` included (AlreadyExistsError if the
        hash is taken)."""

    @abstractmethod
    async def redeem_token(self, token_hash: str, now_ms: int) -> TokenRecord | None:
        """Atomically use a token: the record (uses counted) when it exists, has not expired
        (``expires_ms`` > ``now_ms``), is reusable or unused, and is within its ``max_uses``
        (0: no limit); else None and nothing changes."""

    @abstractmethod
    async def get_token(self, token_hash: str) -> TokenRecord | None:
        """The stored token, used or not (None: unknown)."""

    @abstractmethod
    async def quarantined_nodes_of_donor(self, donor: str) -> list[str]:
        """The ids of the stored QUARANTINED nodes enrolled for ``donor`` (node_donors),
        ordered by id."""

    @abstractmethod
    async def set_node_donor(self, node_id: str, donor: str) -> None:
        """Record the donor whose account ``node_id`` earns for (replaces the one before; the
        node need not be stored)."""

    @abstractmethod
    async def get_node_donor(self, node_id: str) -> str:
        """The donor recorded for ``node_id``; "" when none was."""

    @abstractmethod
    async def list_node_donors(self) -> dict[str, str]:
        """node id -> donor, for every node whose join token named one."""

    @abstractmethod
    async def add_revocation(self, principal: str, role: str, reason: str) -> bool:
        """Refuse ``principal`` from now on; False (and the first record kept) if it was already
        revoked."""

    @abstractmethod
    async def list_revocations(self) -> list[str]:
        """Every revoked principal id (no order is promised)."""

    # -- cluster scheduler ----------------------------------------------------------------------

    @abstractmethod
    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """An operator's weight for a tenant (replaces the one before)."""

    @abstractmethod
    async def list_tenant_weights(self) -> dict[str, float]:
        """tenant -> weight, for the tenants an operator gave one (others weigh 1)."""

    # -- credit ledger ---------------------------------------------------------------------------

    @abstractmethod
    async def add_ledger_entries(self, entries: Sequence[Entry]) -> list[int]:
        """Append entries (in the caller's transaction, if any); their ids, increasing and never
        reused once committed. Every amount MUST be positive: a batch with one that is not is
        refused (memory: ValueError; SQLite: sqlite3.IntegrityError of its CHECK) and, outside a
        transaction, nothing of it is written; inside one, let the transaction fail (SQLite
        keeps the batch's entries before the refused one in it)."""

    @abstractmethod
    async def list_ledger_entries(
        self, account: str = "", job_id: str = "", after_id: int = 0, limit: int = 0
    ) -> list[tuple[int, Entry]]:
        """(id, entry) oldest first: entries from or to ``account`` and/or of ``job_id``
        (both empty: all), with an id above ``after_id``, at most ``limit`` (0: all)."""

    @abstractmethod
    async def ledger_balances(self) -> dict[str, int]:
        """Every account's balance (what its entries sum to), for every account an entry names,
        those at zero included."""

    @abstractmethod
    async def put_scheduler_state(self, key: str, value: bytes) -> None:
        """Set (or replace) the scheduler's value under ``key``."""

    @abstractmethod
    async def get_scheduler_state(self, key: str) -> bytes | None: ...
