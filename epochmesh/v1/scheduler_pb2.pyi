from epochmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListNodesRequest(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.NodeState]
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.NodeState, str]]] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_common_pb2.NodeInfo, _Mapping]]] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class ListAllJobsRequest(_message.Message):
    __slots__ = ("states", "limit")
    STATES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.JobState]
    limit: int
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.JobState, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListAllJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[_common_pb2.Job, _Mapping]]] = ...) -> None: ...

class GetAnyJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetAllocationRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class PreviewAllocationRequest(_message.Message):
    __slots__ = ("global_batch", "node_ids", "num_samples")
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    global_batch: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    num_samples: int
    def __init__(self, global_batch: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., num_samples: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("since_id", "follow", "node_id", "job_id", "kinds")
    SINCE_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    since_id: int
    follow: bool
    node_id: str
    job_id: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, since_id: _Optional[int] = ..., follow: _Optional[bool] = ..., node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeRequest(_message.Message):
    __slots__ = ("node_id", "stop")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    stop: bool
    def __init__(self, node_id: _Optional[str] = ..., stop: _Optional[bool] = ...) -> None: ...

class ClusterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatsResponse(_message.Message):
    __slots__ = ("nodes_by_state", "jobs_by_state", "total_samples_per_second", "blobs", "blob_bytes", "events", "heartbeats_total", "uptime_ms")
    class NodesByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class JobsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODES_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    JOBS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    nodes_by_state: _containers.ScalarMap[str, int]
    jobs_by_state: _containers.ScalarMap[str, int]
    total_samples_per_second: float
    blobs: int
    blob_bytes: int
    events: int
    heartbeats_total: int
    uptime_ms: int
    def __init__(self, nodes_by_state: _Optional[_Mapping[str, int]] = ..., jobs_by_state: _Optional[_Mapping[str, int]] = ..., total_samples_per_second: _Optional[float] = ..., blobs: _Optional[int] = ..., blob_bytes: _Optional[int] = ..., events: _Optional[int] = ..., heartbeats_total: _Optional[int] = ..., uptime_ms: _Optional[int] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("principal", "reason")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    principal: str
    reason: str
    def __init__(self, principal: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("principal", "already_revoked")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ALREADY_REVOKED_FIELD_NUMBER: _ClassVar[int]
    principal: str
    already_revoked: bool
    def __init__(self, principal: _Optional[str] = ..., already_revoked: _Optional[bool] = ...) -> None: ...

class GetQueueRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueEntry(_message.Message):
    __slots__ = ("job_id", "name", "tenant", "priority", "state", "fair_share", "value", "nodes_held", "node_ids", "nodes_wanted", "min_nodes", "waiting", "reason", "submitted_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NODES_HELD_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    NODES_WANTED_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    tenant: str
    priority: str
    state: _common_pb2.JobState
    fair_share: float
    value: float
    nodes_held: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    nodes_wanted: int
    min_nodes: int
    waiting: bool
    reason: str
    submitted_ms: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., tenant: _Optional[str] = ..., priority: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., fair_share: _Optional[float] = ..., value: _Optional[float] = ..., nodes_held: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., nodes_wanted: _Optional[int] = ..., min_nodes: _Optional[int] = ..., waiting: _Optional[bool] = ..., reason: _Optional[str] = ..., submitted_ms: _Optional[int] = ...) -> None: ...

class GetQueueResponse(_message.Message):
    __slots__ = ("jobs", "tenant_weights", "other_jobs")
    class TenantWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOBS_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OTHER_JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    tenant_weights: _containers.ScalarMap[str, float]
    other_jobs: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., tenant_weights: _Optional[_Mapping[str, float]] = ..., other_jobs: _Optional[int] = ...) -> None: ...

class SetTenantWeightRequest(_message.Message):
    __slots__ = ("tenant", "weight", "create")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    create: bool
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., create: _Optional[bool] = ...) -> None: ...

class SetTenantWeightResponse(_message.Message):
    __slots__ = ("tenant", "weight")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class QuoteJobRequest(_message.Message):
    __slots__ = ("spec", "num_samples", "flops_per_sample", "program_sha256", "state_bytes", "initial_state_sha256")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_SHA256_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_SHA256_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.JobSpec
    num_samples: int
    flops_per_sample: float
    program_sha256: str
    state_bytes: int
    initial_state_sha256: str
    def __init__(self, spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., num_samples: _Optional[int] = ..., flops_per_sample: _Optional[float] = ..., program_sha256: _Optional[str] = ..., state_bytes: _Optional[int] = ..., initial_state_sha256: _Optional[str] = ...) -> None: ...

class QuoteNode(_message.Message):
    __slots__ = ("node_id", "name", "price_micro_per_hour", "samples_per_second", "rate_source", "reference_samples_per_second", "local_batch", "chosen")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICRO_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    price_micro_per_hour: int
    samples_per_second: float
    rate_source: str
    reference_samples_per_second: float
    local_batch: int
    chosen: bool
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., price_micro_per_hour: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., rate_source: _Optional[str] = ..., reference_samples_per_second: _Optional[float] = ..., local_batch: _Optional[int] = ..., chosen: _Optional[bool] = ...) -> None: ...

class QuoteJobResponse(_message.Message):
    __slots__ = ("nodes", "fits", "reason", "rounds", "checkpoints", "start_seconds", "round_compute_seconds", "round_overhead_seconds", "checkpoint_seconds", "epoch_seconds", "total_seconds", "epoch_cost_micro", "total_cost_micro", "fee_micro", "overhead_source", "recorded_jobs", "reference_flops_per_sample", "flops_per_sample")
    NODES_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_OVERHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_COST_MICRO_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COST_MICRO_FIELD_NUMBER: _ClassVar[int]
    FEE_MICRO_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECORDED_JOBS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FLOPS_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    FLOPS_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[QuoteNode]
    fits: bool
    reason: str
    rounds: int
    checkpoints: int
    start_seconds: float
    round_compute_seconds: float
    round_overhead_seconds: float
    checkpoint_seconds: float
    epoch_seconds: float
    total_seconds: float
    epoch_cost_micro: int
    total_cost_micro: int
    fee_micro: int
    overhead_source: str
    recorded_jobs: int
    reference_flops_per_sample: float
    flops_per_sample: float
    def __init__(self, nodes: _Optional[_Iterable[_Union[QuoteNode, _Mapping]]] = ..., fits: _Optional[bool] = ..., reason: _Optional[str] = ..., rounds: _Optional[int] = ..., checkpoints: _Optional[int] = ..., start_seconds: _Optional[float] = ..., round_compute_seconds: _Optional[float] = ..., round_overhead_seconds: _Optional[float] = ..., checkpoint_seconds: _Optional[float] = ..., epoch_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., epoch_cost_micro: _Optional[int] = ..., total_cost_micro: _Optional[int] = ..., fee_micro: _Optional[int] = ..., overhead_source: _Optional[str] = ..., recorded_jobs: _Optional[int] = ..., reference_flops_per_sample: _Optional[float] = ..., flops_per_sample: _Optional[float] = ...) -> None: ...
