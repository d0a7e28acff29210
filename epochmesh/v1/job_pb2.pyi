from epochmesh.v1 import common_pb2 as _common_pb2
from epochmesh.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UploadBlobHeader(_message.Message):
    __slots__ = ("sha256", "size", "offset")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    offset: int
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class UploadBlobRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadBlobHeader
    chunk: _common_pb2.DataChunk
    def __init__(self, header: _Optional[_Union[UploadBlobHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.DataChunk, _Mapping]] = ...) -> None: ...

class UploadBlobResponse(_message.Message):
    __slots__ = ("blob", "received_bytes")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    blob: _common_pb2.BlobRef
    received_bytes: int
    def __init__(self, blob: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class GetBlobStatusRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class GetBlobStatusResponse(_message.Message):
    __slots__ = ("complete", "received_bytes", "size")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    received_bytes: int
    size: int
    def __init__(self, complete: _Optional[bool] = ..., received_bytes: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class DeleteBlobRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class DeleteBlobResponse(_message.Message):
    __slots__ = ("released_bytes", "deleted")
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    deleted: bool
    def __init__(self, released_bytes: _Optional[int] = ..., deleted: _Optional[bool] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "program", "initial_state", "shards", "spec_toml")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOML_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.JobSpec
    program: _common_pb2.BlobRef
    initial_state: _common_pb2.BlobRef
    shards: _containers.RepeatedCompositeFieldContainer[_common_pb2.Shard]
    spec_toml: str
    def __init__(self, spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., program: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ..., initial_state: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[_common_pb2.Shard, _Mapping]]] = ..., spec_toml: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "limit")
    STATES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.JobState]
    limit: int
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.JobState, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[_common_pb2.Job, _Mapping]]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "since_round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_round: int
    def __init__(self, job_id: _Optional[str] = ..., since_round: _Optional[int] = ...) -> None: ...

class JobUpdate(_message.Message):
    __slots__ = ("job", "allocation", "rounds", "events")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.Job
    allocation: _common_pb2.Allocation
    rounds: _containers.RepeatedCompositeFieldContainer[_common_pb2.RoundRecord]
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.Event]
    def __init__(self, job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ..., allocation: _Optional[_Union[_common_pb2.Allocation, _Mapping]] = ..., rounds: _Optional[_Iterable[_Union[_common_pb2.RoundRecord, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[_common_pb2.Event, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DownloadResultRequest(_message.Message):
    __slots__ = ("job_id", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class DownloadResultResponse(_message.Message):
    __slots__ = ("total_size", "chunk", "sha256")
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    total_size: int
    chunk: _common_pb2.DataChunk
    sha256: str
    def __init__(self, total_size: _Optional[int] = ..., chunk: _Optional[_Union[_common_pb2.DataChunk, _Mapping]] = ..., sha256: _Optional[str] = ...) -> None: ...

class GetRoundsRequest(_message.Message):
    __slots__ = ("job_id", "since_round", "limit", "include_rolled_back")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_round: int
    limit: int
    include_rolled_back: bool
    def __init__(self, job_id: _Optional[str] = ..., since_round: _Optional[int] = ..., limit: _Optional[int] = ..., include_rolled_back: _Optional[bool] = ...) -> None: ...

class GetRoundsResponse(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[_common_pb2.RoundRecord]
    def __init__(self, rounds: _Optional[_Iterable[_Union[_common_pb2.RoundRecord, _Mapping]]] = ...) -> None: ...

class GetJobEventsRequest(_message.Message):
    __slots__ = ("job_id", "since_id", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_id: int
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., since_id: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class GetJobEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.Event]
    def __init__(self, events: _Optional[_Iterable[_Union[_common_pb2.Event, _Mapping]]] = ...) -> None: ...

class SetJobPriorityRequest(_message.Message):
    __slots__ = ("job_id", "priority")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    priority: str
    def __init__(self, job_id: _Optional[str] = ..., priority: _Optional[str] = ...) -> None: ...
