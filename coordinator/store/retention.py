"""What the coordinator's garbage collector keeps: pure decisions, no I/O, no clock.

- Checkpoints: the newest ``keep_checkpoints`` of a job that is not over (one of an ended
  job: the state it ended in), plus the newest one from before the oldest round a
  verification rollback may still undo (`JobRunner.rollback_floor`).
- Blobs: a blob stays while a job (program, initial state, shards, result) or a stored
  checkpoint manifest names it. An unreferenced one goes once it is older than the grace
  period (an upload its SubmitJob has not named yet, a checkpoint's tensors written before
  their manifest), or once a checkpoint that named it was dropped ``released_grace_ms`` ago.
- Events: those older than the retention period go, except those of jobs not yet ended.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.store.base import BlobRecord
from epochmesh.v1 import common_pb2

JS = common_pb2.JobState
ENDED_STATES = (JS.JOB_STATE_SUCCEEDED, JS.JOB_STATE_FAILED, JS.JOB_STATE_CANCELLED)
# Jobs whose events are kept whatever their age: every state but the ended ones.
LIVE_STATES = tuple(s for s in JS.values() if s not in ENDED_STATES)


class ManifestError(ValueError):
    """A stored checkpoint manifest cannot be read: what it references is unknown."""


@dataclass(frozen=True)
class RetentionPolicy:
    keep_checkpoints: int = 3
    # 0: events are kept forever.
    event_retention_ms: int = 30 * 86_400_000
    blob_grace_ms: int = 86_400_000
    released_grace_ms: int = 10_000

    def __post_init__(self) -> None:
        if self.keep_checkpoints < 1:
            raise ValueError("at least one checkpoint per job must be kept")
        if min(self.event_retention_ms, self.blob_grace_ms, self.released_grace_ms) < 0:
            raise ValueError("retention periods must not be negative")


# A rollback floor not known yet (a live job whose runner has not restored its state since the
# coordinator started): no checkpoint of the job is dropped.
FLOOR_UNKNOWN = -1


def checkpoints_to_drop(
    rounds: Iterable[int], *, keep: int, rollback_floor: int | None = None
) -> list[int]:
    """The rounds of a job's checkpoints to drop: all but the newest ``keep`` and, when a
    rollback may still undo round ``rollback_floor``, the newest one before it (what
    `Store.checkpoint_before(job, rollback_floor)` returns); none at FLOOR_UNKNOWN."""
    if rollback_floor == FLOOR_UNKNOWN:
        return []
    ordered = sorted(set(rounds))
    kept = set(ordered[-keep:]) if keep > 0 else set()
    if rollback_floor is not None:
        before = [r for r in ordered if r < rollback_floor]
        if before:
            kept.add(before[-1])
    return [r for r in ordered if r not in kept]


def keep_for(job_state: int, policy: RetentionPolicy) -> int:
    """How many of its newest checkpoints a job in ``job_state`` keeps."""
    return 1 if job_state in ENDED_STATES else policy.keep_checkpoints


def job_references(job: common_pb2.Job) -> set[str]:
    """The blobs a job record names."""
    refs = {job.program.sha256, job.initial_state.sha256, job.result.sha256}
    refs.update(shard.blob.sha256 for shard in job.shards)
    refs.discard("")
    return refs


def manifest_references(manifest: bytes) -> set[str]:
    """The blobs a checkpoint manifest (coordinator/store/checkpoint.py) names. ManifestError when
    it is not one: the collector then deletes nothing rather than guess."""
    try:
        data = json.loads(bytes(manifest).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"a checkpoint manifest is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ManifestError("a checkpoint manifest is not a JSON object")
    sha = data.get("tensors_sha256", "")
    if not isinstance(sha, str):
        raise ManifestError("a checkpoint manifest's tensors_sha256 is not text")
    return {sha} if sha else set()


@dataclass(frozen=True)
class SweepDecision:
    blob: BlobRecord
    reason: str


def blobs_to_sweep(
    blobs: Sequence[BlobRecord],
    referenced: Collection[str],
    released_ms: Mapping[str, int],
    *,
    now_ms: int,
    policy: RetentionPolicy,
) -> list[SweepDecision]:
    """The unreferenced blobs old enough to delete, each with why."""
    out = []
    for blob in blobs:
        if blob.sha256 in referenced:
            continue
        released = released_ms.get(blob.sha256)
        # Stored or made new again since its checkpoint went (BlobStore.put_bytes): the
        # ordinary grace applies, counted from then.
        if released is not None and blob.created_ms > released:
            released = None
        if released is not None and now_ms - released >= policy.released_grace_ms:
            out.append(SweepDecision(blob, "its checkpoint was dropped"))
        elif now_ms - blob.created_ms >= policy.blob_grace_ms:
            out.append(SweepDecision(blob, "nothing has named it within the grace period"))
    return out
