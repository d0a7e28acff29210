"""The coordinator's garbage collector: old checkpoints, unreferenced blobs, old events.

A pass (at start, then every ``interval_s``) does, in this order:

1. drops the checkpoints `coordinator.store.retention.checkpoints_to_drop` names, one store
   transaction per job (the runner's rollback floor read inside it), and remembers when each
   dropped manifest's tensors blob was released;
2. marks and sweeps in one store transaction: every blob a job or a stored checkpoint names is
   marked, the unreferenced ones past their grace (`coordinator.store.retention.blobs_to_sweep`)
   lose their store record; nothing is swept if a manifest cannot be read;
3. only after that commit, deletes their files (a file whose inode changed since the mark, a
   blob stored again meanwhile, is left alone);
4. deletes events past the retention period in batches (never those of jobs not ended).

Coordinators sharing a database and a blob directory (coordinator/ha/) collect only while
active: ``may_collect`` (the lease held) is asked before a pass and again before any file is
deleted, so a coordinator that lost the lease deletes nothing (its store writes are fenced
besides); a standby runs no collector at all.

Kill -9 at any point leaves the store consistent: a checkpoint row and the record of a blob it
names are never removed in different orders (the record goes only in a transaction that saw
no reference to it), and a file whose record is gone but which is still on disk is recorded
again at the next start (coordinator/store/blobs.py reconciles) and collected by a later pass once
its grace has passed. A blob the coordinator stored and has not named yet (a checkpoint's
tensors before its row is written, a job's result before the job's record: `BlobStore.stored`)
is never collected, whatever the grace. Bytes stored again that equal an unreferenced old blob
(a checkpoint's tensors identical to a dropped one's, a re-upload) are not written twice but
make the blob new again (`Store.touch_blob`, in the same store lock the sweep holds): its grace
starts over, so a sweep between the store and the checkpoint naming it leaves it alone; a sweep
that took it just before finds it written anew (the file's inode changed: left alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.core.config import CoordinatorConfig
from coordinator.store.base import Store
from coordinator.store.blobs import BlobStore
from coordinator.store.retention import (
    ENDED_STATES,
    FLOOR_UNKNOWN,
    LIVE_STATES,
    ManifestError,
    RetentionPolicy,
    blobs_to_sweep,
    checkpoints_to_drop,
    job_references,
    keep_for,
    manifest_references,
)
from epochmesh.timeutil import now_ms

log = logging.getLogger(__name__)

EVENT_BATCH = 10_000
# Test hook (honoured only with EPOCHMESH_TEST_HOOKS=1): kill -9 this process at the named
# point of a pass: after_drop (checkpoints dropped, nothing swept), after_sweep (blob records
# gone, files not), mid_unlink (after the first file is deleted).
KILL_AT_ENV = "EPOCHMESH_TEST_GC_KILL_AT"


def _kill_point(name: str) -> None:
    if os.environ.get("EPOCHMESH_TEST_HOOKS") == "1" and os.environ.get(KILL_AT_ENV) == name:
        log.warning("test hook: kill -9 at %s", name)
        os.kill(os.getpid(), signal.SIGKILL)


RollbackFloor = Callable[[str], int | None]


def engine_rollback_floor(engine: object) -> RollbackFloor:
    """For the ids of live jobs: its runner's `rollback_floor()` where the engine has a runner
    for the job (coordinator/engine/engine.py keeps them in ``runners``), else FLOOR_UNKNOWN (the
    coordinator is starting: its runners have not restored what their checks need yet)."""

    def floor(job_id: str) -> int | None:
        runners = getattr(engine, "runners", None)
        runner = runners.get(job_id) if isinstance(runners, Mapping) else None
        if runner is None:
            return FLOOR_UNKNOWN
        hook = getattr(runner, "rollback_floor", None)
        if not callable(hook):
            return None
        value = hook()
        return value if isinstance(value, int) else None

    return floor


def retention_policy(config: CoordinatorConfig) -> RetentionPolicy:
    return RetentionPolicy(
        keep_checkpoints=config.keep_checkpoints,
        event_retention_ms=int(config.event_retention_s * 1000),
        blob_grace_ms=int(config.gc_blob_grace_s * 1000),
        released_grace_ms=int(config.gc_checkpoint_grace_s * 1000),
    )


@dataclass
class GcReport:
    checkpoints_dropped: int = 0
    blobs_deleted: int = 0
    bytes_freed: int = 0
    events_deleted: int = 0
    kept_for_rollback: dict[str, int] = field(default_factory=dict)  # job -> floor round


class GarbageCollector:
    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        policy: RetentionPolicy,
        *,
        interval_s: float,
        rollback_floor: RollbackFloor = lambda job_id: None,
        clock: Callable[[], int] = now_ms,
        may_collect: Callable[[], bool] = lambda: True,
    ) -> None:
        if not interval_s > 0:
            raise ValueError("the collection interval must be positive")
        self._store = store
        self._blobs = blobs
        self.policy = policy
        self.interval_s = interval_s
        self._rollback_floor = rollback_floor
        self._clock = clock
        self._may_collect = may_collect
        # sha256 -> when a dropped checkpoint released it (lost with the process: such blobs
        # then wait for the ordinary grace period).
        self._released: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.passes = 0
        self.last_report: GcReport | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """A pass now, then one every ``interval_s``, in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="garbage-collector")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("garbage collection pass failed (the next one retries)")
            await asyncio.sleep(self.interval_s)

    # -- a pass ---------------------------------------------------------------------------------

    async def run_once(self) -> GcReport:
        async with self._lock:
            report = GcReport()
            if not self._may_collect():
                log.info("garbage collection skipped: this coordinator is not the active one")
                return report
            await self._drop_checkpoints(report)
            _kill_point("after_drop")
            await self._sweep_blobs(report)
            await self._prune_events(report)
            self.passes += 1
            self.last_report = report
            if report.checkpoints_dropped or report.blobs_deleted or report.events_deleted:
                log.info(
                    "garbage collection: %d checkpoint(s) dropped, %d blob(s) deleted "
                    "(%d bytes), %d event(s) deleted",
                    report.checkpoints_dropped,
                    report.blobs_deleted,
                    report.bytes_freed,
                    report.events_deleted,
                )
            return report

    async def _drop_checkpoints(self, report: GcReport) -> None:
        store = self._store
        counts: dict[str, int] = {}
        for job_id, _, _ in await store.list_checkpoints():
            counts[job_id] = counts.get(job_id, 0) + 1
        for job_id, count in counts.items():
            job = await store.get_job(job_id)
            state = job.state if job is not None else ENDED_STATES[0]
            keep = keep_for(state, self.policy)
            if count <= keep:
                continue
            async with store.transaction():
                # In the transaction: no checkpoint of the job is written or dropped meanwhile.
                rounds = [r for _, r, _ in await store.list_checkpoints(job_id)]
                floor = None if state in ENDED_STATES else self._rollback_floor(job_id)
                drop = checkpoints_to_drop(rounds, keep=keep, rollback_floor=floor)
                manifests = await store.drop_checkpoints(job_id, drop)
            if floor is not None:
                report.kept_for_rollback[job_id] = floor
            report.checkpoints_dropped += len(manifests)
            released = self._clock()
            for manifest in manifests:
                try:
                    refs = manifest_references(manifest)
                except ManifestError as exc:
                    log.warning("job %s: a dropped checkpoint: %s", job_id, exc)
                    continue
                for sha in refs:
                    self._released.setdefault(sha, released)

    async def _sweep_blobs(self, report: GcReport) -> None:
        store = self._store
        async with store.transaction():
            referenced: set[str] = set()
            for job in await store.list_jobs():
                referenced |= job_references(job)
            try:
                for _, _, manifest in await store.list_checkpoints():
                    referenced |= manifest_references(manifest)
            except ManifestError as exc:
                log.error("garbage collection deletes no blob: %s", exc)
                return
            blobs = await store.list_blobs()
            # Stored by the coordinator and not named yet (a checkpoint's, a result): kept.
            referenced |= self._blobs.pinned()
            decisions = blobs_to_sweep(
                blobs, referenced, self._released, now_ms=self._clock(), policy=self.policy
            )
            inodes = await asyncio.to_thread(self._inodes, [d.blob.sha256 for d in decisions])
            for d in decisions:
                await store.remove_blob(d.blob.sha256)
        # Committed: the store names none of them; their files may go.
        _kill_point("after_sweep")
        present = {b.sha256 for b in blobs}
        for sha in [s for s in self._released if s not in present]:
            del self._released[sha]
        for d in decisions:
            self._released.pop(d.blob.sha256, None)
            log.debug("blob %s (%d bytes) collected: %s", d.blob.sha256, d.blob.size, d.reason)
        if not self._may_collect():
            log.warning("garbage collection deletes no file: this coordinator lost the lease")
            return
        deleted = await asyncio.to_thread(self._delete_files, inodes)
        report.blobs_deleted = len(decisions)
        report.bytes_freed = sum(d.blob.size for d in decisions if d.blob.sha256 in deleted)

    def _inodes(self, shas: list[str]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for sha in shas:
            try:
                out[sha] = os.stat(self._blobs.path(sha)).st_ino
            except FileNotFoundError:
                out[sha] = None
        return out

    def _delete_files(self, inodes: Mapping[str, int | None]) -> set[str]:
        deleted: set[str] = set()
        dirs: set[Path] = set()
        for sha, inode in inodes.items():
            path = self._blobs.path(sha)
            try:
                if inode is None or os.stat(path).st_ino != inode:
                    continue  # gone already, or stored again since the mark
                path.unlink()
            except FileNotFoundError:
                continue
            deleted.add(sha)
            dirs.add(path.parent)
            _kill_point("mid_unlink")
        for d in dirs:
            _fsync_dir(d)
        return deleted

    async def _prune_events(self, report: GcReport) -> None:
        retention = self.policy.event_retention_ms
        if retention <= 0:
            return
        before = self._clock() - retention
        while True:
            n = await self._store.prune_events(
                before, keep_job_states=LIVE_STATES, limit=EVENT_BATCH
            )
            report.events_deleted += n
            if n < EVENT_BATCH:
                return


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
