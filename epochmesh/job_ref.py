"""What names a job, for every program that takes one from a user: the CLI's commands
(`epochmesh status REF`, `watch REF`, ...) and the dashboard's job page (/jobs/REF).

A reference is a job's full id (``j-`` and 10 hex), a prefix of ids, or a job's name as the
spec gives it (1-100 printable characters, epochmesh/spec.py). It names the jobs whose id
starts with it or whose name equals it; a program accepts it when exactly one job matches.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from epochmesh.spec import MAX_NAME_CHARS


class _Job(Protocol):
    @property
    def job_id(self) -> str: ...

    @property
    def name(self) -> str: ...


J = TypeVar("J", bound=_Job)

# A reference longer than any name or id cannot name a job.
MAX_REF_CHARS = MAX_NAME_CHARS


def check_job_ref(ref: str) -> str:
    """The reference without surrounding blanks; ValueError (with a message for the user) when
    it cannot name any job: empty, longer than a job name may be, or not printable."""
    ref = ref.strip()
    if not ref:
        raise ValueError("empty job reference: give a job id, an id prefix or a job name")
    if len(ref) > MAX_REF_CHARS:
        raise ValueError(
            f"a job reference has at most {MAX_REF_CHARS} characters (got {len(ref)}): "
            "give a job id, an id prefix or a job name"
        )
    if not ref.isprintable():
        raise ValueError("a job reference has printable characters only")
    return ref


def match_jobs(ref: str, jobs: Iterable[J]) -> list[J]:
    """The jobs `ref` names (see the module doc); the exact id alone when a job has it."""
    listed = list(jobs)
    exact = [j for j in listed if j.job_id == ref]
    if exact:
        return exact
    return [j for j in listed if j.job_id.startswith(ref) or j.name == ref]
