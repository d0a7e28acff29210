from epochmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_NONE: _ClassVar[TaskKind]
    TASK_KIND_BENCHMARK: _ClassVar[TaskKind]
    TASK_KIND_TRAIN: _ClassVar[TaskKind]
    TASK_KIND_CHECK: _ClassVar[TaskKind]

class RingFault(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RING_FAULT_UNSPECIFIED: _ClassVar[RingFault]
    RING_FAULT_NON_FINITE: _ClassVar[RingFault]
    RING_FAULT_TAMPERED: _ClassVar[RingFault]
TASK_KIND_NONE: TaskKind
TASK_KIND_BENCHMARK: TaskKind
TASK_KIND_TRAIN: TaskKind
TASK_KIND_CHECK: TaskKind
RING_FAULT_UNSPECIFIED: RingFault
RING_FAULT_NON_FINITE: RingFault
RING_FAULT_TAMPERED: RingFault

class RegisterRequest(_message.Message):
    __slots__ = ("name", "devices", "peer_address", "agent_version", "node_id", "labels", "price_micro_per_hour", "ring_seal_digests", "ring_features")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICRO_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    RING_SEAL_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    RING_FEATURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.Device]
    peer_address: str
    agent_version: str
    node_id: str
    labels: _containers.ScalarMap[str, str]
    price_micro_per_hour: int
    ring_seal_digests: _containers.RepeatedScalarFieldContainer[str]
    ring_features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.Device, _Mapping]]] = ..., peer_address: _Optional[str] = ..., agent_version: _Optional[str] = ..., node_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., price_micro_per_hour: _Optional[int] = ..., ring_seal_digests: _Optional[_Iterable[str]] = ..., ring_features: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("node_id", "lease_id", "lease_ttl_ms", "heartbeat_interval_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "task_id", "draining", "price_micro_per_hour")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICRO_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    task_id: str
    draining: bool
    price_micro_per_hour: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., task_id: _Optional[str] = ..., draining: _Optional[bool] = ..., price_micro_per_hour: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "heartbeat_interval_ms", "state", "cancel_task", "leave")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_TASK_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    state: _common_pb2.NodeState
    cancel_task: bool
    leave: bool
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.NodeState, str]] = ..., cancel_task: _Optional[bool] = ..., leave: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportBenchmarkRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "task_id", "result")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    task_id: str
    result: _common_pb2.BenchmarkResult
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., task_id: _Optional[str] = ..., result: _Optional[_Union[_common_pb2.BenchmarkResult, _Mapping]] = ...) -> None: ...

class ReportBenchmarkResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NextTaskRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "wait_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    wait_ms: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "kind", "job_id", "spec", "program", "shards", "epoch", "round", "ranges", "local_batch", "params_version", "deadline_seconds", "benchmark_batch_sizes", "ring", "inner_steps", "initial_state", "ring_total_samples", "state_source_node_id", "push_state", "state_source_address", "ring_gateway", "params_bundle", "params_data", "compute_budget_seconds", "verify_chunks", "check", "revoked_node_ids", "state_params_checksum", "state_optim_checksum", "restored_version", "checked_node_id", "ring_weighted")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BENCHMARK_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    RING_TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RING_GATEWAY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DATA_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BUDGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    REVOKED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STATE_OPTIM_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RING_WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    kind: TaskKind
    job_id: str
    spec: _common_pb2.JobSpec
    program: _common_pb2.BlobRef
    shards: _containers.RepeatedCompositeFieldContainer[_common_pb2.Shard]
    epoch: int
    round: int
    ranges: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampleRange]
    local_batch: int
    params_version: int
    deadline_seconds: float
    benchmark_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    ring: _common_pb2.RingAssignment
    inner_steps: int
    initial_state: _common_pb2.BlobRef
    ring_total_samples: int
    state_source_node_id: str
    push_state: bool
    state_source_address: str
    ring_gateway: bool
    params_bundle: _common_pb2.TensorBundle
    params_data: bytes
    compute_budget_seconds: float
    verify_chunks: int
    check: CheckSpec
    revoked_node_ids: _containers.RepeatedScalarFieldContainer[str]
    state_params_checksum: str
    state_optim_checksum: str
    restored_version: int
    checked_node_id: str
    ring_weighted: bool
    def __init__(self, task_id: _Optional[str] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., job_id: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., program: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[_common_pb2.Shard, _Mapping]]] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[_common_pb2.SampleRange, _Mapping]]] = ..., local_batch: _Optional[int] = ..., params_version: _Optional[int] = ..., deadline_seconds: _Optional[float] = ..., benchmark_batch_sizes: _Optional[_Iterable[int]] = ..., ring: _Optional[_Union[_common_pb2.RingAssignment, _Mapping]] = ..., inner_steps: _Optional[int] = ..., initial_state: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ..., ring_total_samples: _Optional[int] = ..., state_source_node_id: _Optional[str] = ..., push_state: _Optional[bool] = ..., state_source_address: _Optional[str] = ..., ring_gateway: _Optional[bool] = ..., params_bundle: _Optional[_Union[_common_pb2.TensorBundle, _Mapping]] = ..., params_data: _Optional[bytes] = ..., compute_budget_seconds: _Optional[float] = ..., verify_chunks: _Optional[int] = ..., check: _Optional[_Union[CheckSpec, _Mapping]] = ..., revoked_node_ids: _Optional[_Iterable[str]] = ..., state_params_checksum: _Optional[str] = ..., state_optim_checksum: _Optional[str] = ..., restored_version: _Optional[int] = ..., checked_node_id: _Optional[str] = ..., ring_weighted: _Optional[bool] = ...) -> None: ...

class CheckSpec(_message.Message):
    __slots__ = ("seed", "buckets")
    SEED_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    seed: int
    buckets: int
    def __init__(self, seed: _Optional[int] = ..., buckets: _Optional[int] = ...) -> None: ...

class FetchBlobRequest(_message.Message):
    __slots__ = ("sha256", "offset")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    offset: int
    def __init__(self, sha256: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FetchBlobResponse(_message.Message):
    __slots__ = ("total_size", "chunk")
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    total_size: int
    chunk: _common_pb2.DataChunk
    def __init__(self, total_size: _Optional[int] = ..., chunk: _Optional[_Union[_common_pb2.DataChunk, _Mapping]] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("node_id", "lease_id", "task_id", "job_id", "round", "num_samples", "mean_loss", "compute_seconds", "bundle", "kind", "params_version", "params_checksum", "chunks", "snapshot_chunk")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    task_id: str
    job_id: str
    round: int
    num_samples: int
    mean_loss: float
    compute_seconds: float
    bundle: _common_pb2.TensorBundle
    kind: str
    params_version: int
    params_checksum: str
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkCommitment]
    snapshot_chunk: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., task_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., num_samples: _Optional[int] = ..., mean_loss: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., bundle: _Optional[_Union[_common_pb2.TensorBundle, _Mapping]] = ..., kind: _Optional[str] = ..., params_version: _Optional[int] = ..., params_checksum: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[ChunkCommitment, _Mapping]]] = ..., snapshot_chunk: _Optional[int] = ...) -> None: ...

class ChunkCommitment(_message.Message):
    __slots__ = ("samples", "loss", "start_digest")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    START_DIGEST_FIELD_NUMBER: _ClassVar[int]
    samples: int
    loss: float
    start_digest: bytes
    def __init__(self, samples: _Optional[int] = ..., loss: _Optional[float] = ..., start_digest: _Optional[bytes] = ...) -> None: ...

class PushUpdateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    chunk: _common_pb2.DataChunk
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.DataChunk, _Mapping]] = ...) -> None: ...

class PushUpdateResponse(_message.Message):
    __slots__ = ("accepted", "reason", "sketch")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    sketch: CheckSpec
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., sketch: _Optional[_Union[CheckSpec, _Mapping]] = ...) -> None: ...

class CommitSketchesRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "job_id", "task_id", "seed", "sketches", "update_sketch", "ring")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SKETCHES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SKETCH_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    job_id: str
    task_id: str
    seed: int
    sketches: _containers.RepeatedScalarFieldContainer[float]
    update_sketch: _containers.RepeatedScalarFieldContainer[float]
    ring: RingEvidence
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., job_id: _Optional[str] = ..., task_id: _Optional[str] = ..., seed: _Optional[int] = ..., sketches: _Optional[_Iterable[float]] = ..., update_sketch: _Optional[_Iterable[float]] = ..., ring: _Optional[_Union[RingEvidence, _Mapping]] = ...) -> None: ...

class RingEvidence(_message.Message):
    __slots__ = ("seed", "buckets", "sent", "received", "own", "result")
    SEED_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    seed: int
    buckets: int
    sent: _containers.RepeatedScalarFieldContainer[float]
    received: _containers.RepeatedScalarFieldContainer[float]
    own: _containers.RepeatedScalarFieldContainer[float]
    result: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seed: _Optional[int] = ..., buckets: _Optional[int] = ..., sent: _Optional[_Iterable[float]] = ..., received: _Optional[_Iterable[float]] = ..., own: _Optional[_Iterable[float]] = ..., result: _Optional[_Iterable[float]] = ...) -> None: ...

class CommitSketchesResponse(_message.Message):
    __slots__ = ("snapshot_wanted", "snapshot_chunk")
    SNAPSHOT_WANTED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    snapshot_wanted: bool
    snapshot_chunk: int
    def __init__(self, snapshot_wanted: _Optional[bool] = ..., snapshot_chunk: _Optional[int] = ...) -> None: ...

class ReportCheckRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "task_id", "failed", "error", "loss", "sketch", "compute_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    task_id: str
    failed: bool
    error: str
    loss: float
    sketch: _containers.RepeatedScalarFieldContainer[float]
    compute_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., task_id: _Optional[str] = ..., failed: _Optional[bool] = ..., error: _Optional[str] = ..., loss: _Optional[float] = ..., sketch: _Optional[_Iterable[float]] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class ReportCheckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullParametersRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "job_id", "version", "include_optimizer_state", "external_round")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_ROUND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    job_id: str
    version: int
    include_optimizer_state: bool
    external_round: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., job_id: _Optional[str] = ..., version: _Optional[int] = ..., include_optimizer_state: _Optional[bool] = ..., external_round: _Optional[int] = ...) -> None: ...

class PullParametersResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ParametersHeader
    chunk: _common_pb2.DataChunk
    def __init__(self, header: _Optional[_Union[ParametersHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.DataChunk, _Mapping]] = ...) -> None: ...

class ParametersHeader(_message.Message):
    __slots__ = ("job_id", "version", "bundle")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    bundle: _common_pb2.TensorBundle
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., bundle: _Optional[_Union[_common_pb2.TensorBundle, _Mapping]] = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "task_id", "failed", "error", "compute_seconds", "communicate_seconds", "samples_done", "mean_loss", "params_checksum", "failed_peer_node_id", "ring_attempt", "params_version", "peer_links", "job_fault", "ring_fault", "optim_checksum", "chunks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DONE_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FAILED_PEER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RING_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_LINKS_FIELD_NUMBER: _ClassVar[int]
    JOB_FAULT_FIELD_NUMBER: _ClassVar[int]
    RING_FAULT_FIELD_NUMBER: _ClassVar[int]
    OPTIM_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    task_id: str
    failed: bool
    error: str
    compute_seconds: float
    communicate_seconds: float
    samples_done: int
    mean_loss: float
    params_checksum: str
    failed_peer_node_id: str
    ring_attempt: int
    params_version: int
    peer_links: _containers.RepeatedCompositeFieldContainer[PeerLink]
    job_fault: bool
    ring_fault: RingFault
    optim_checksum: str
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkCommitment]
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., task_id: _Optional[str] = ..., failed: _Optional[bool] = ..., error: _Optional[str] = ..., compute_seconds: _Optional[float] = ..., communicate_seconds: _Optional[float] = ..., samples_done: _Optional[int] = ..., mean_loss: _Optional[float] = ..., params_checksum: _Optional[str] = ..., failed_peer_node_id: _Optional[str] = ..., ring_attempt: _Optional[int] = ..., params_version: _Optional[int] = ..., peer_links: _Optional[_Iterable[_Union[PeerLink, _Mapping]]] = ..., job_fault: _Optional[bool] = ..., ring_fault: _Optional[_Union[RingFault, str]] = ..., optim_checksum: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[ChunkCommitment, _Mapping]]] = ...) -> None: ...

class PeerLink(_message.Message):
    __slots__ = ("node_id", "rtt_ms", "bandwidth_bytes_per_second")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    rtt_ms: float
    bandwidth_bytes_per_second: float
    def __init__(self, node_id: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., bandwidth_bytes_per_second: _Optional[float] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("sketch", "ring_audit")
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    RING_AUDIT_FIELD_NUMBER: _ClassVar[int]
    sketch: CheckSpec
    ring_audit: CheckSpec
    def __init__(self, sketch: _Optional[_Union[CheckSpec, _Mapping]] = ..., ring_audit: _Optional[_Union[CheckSpec, _Mapping]] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("payload", "response_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    response_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., response_bytes: _Optional[int] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class AuthorizeStateTransferRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "job_id", "requester_node_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    job_id: str
    requester_node_id: str
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., job_id: _Optional[str] = ..., requester_node_id: _Optional[str] = ...) -> None: ...

class AuthorizeStateTransferResponse(_message.Message):
    __slots__ = ("allowed", "reason")
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    allowed: bool
    reason: str
    def __init__(self, allowed: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
