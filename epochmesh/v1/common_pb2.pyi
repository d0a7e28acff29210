from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ONLINE: _ClassVar[NodeState]
    NODE_STATE_BUSY: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_CORDONED: _ClassVar[NodeState]
    NODE_STATE_OFFLINE: _ClassVar[NodeState]
    NODE_STATE_QUARANTINED: _ClassVar[NodeState]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_PAUSED: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ONLINE: NodeState
NODE_STATE_BUSY: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_CORDONED: NodeState
NODE_STATE_OFFLINE: NodeState
NODE_STATE_QUARANTINED: NodeState
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_PAUSED: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class Device(_message.Message):
    __slots__ = ("kind", "index", "name", "total_memory_bytes", "compute_capability", "driver", "cores")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    index: int
    name: str
    total_memory_bytes: int
    compute_capability: str
    driver: str
    cores: int
    def __init__(self, kind: _Optional[str] = ..., index: _Optional[int] = ..., name: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., compute_capability: _Optional[str] = ..., driver: _Optional[str] = ..., cores: _Optional[int] = ...) -> None: ...

class BlobRef(_message.Message):
    __slots__ = ("sha256", "size")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SampleRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorBundle(_message.Message):
    __slots__ = ("tensors", "total_bytes", "sha256")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    sha256: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class BenchmarkPoint(_message.Message):
    __slots__ = ("batch_size", "samples_per_second", "peak_memory_bytes", "out_of_memory")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_MEMORY_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    samples_per_second: float
    peak_memory_bytes: int
    out_of_memory: bool
    def __init__(self, batch_size: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., out_of_memory: _Optional[bool] = ...) -> None: ...

class BenchmarkResult(_message.Message):
    __slots__ = ("job_id", "device", "points", "max_batch_size", "samples_per_second", "rtt_ms", "bandwidth_bytes_per_second", "measured_at_ms", "slowdown")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    device: Device
    points: _containers.RepeatedCompositeFieldContainer[BenchmarkPoint]
    max_batch_size: int
    samples_per_second: float
    rtt_ms: float
    bandwidth_bytes_per_second: float
    measured_at_ms: int
    slowdown: float
    def __init__(self, job_id: _Optional[str] = ..., device: _Optional[_Union[Device, _Mapping]] = ..., points: _Optional[_Iterable[_Union[BenchmarkPoint, _Mapping]]] = ..., max_batch_size: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., rtt_ms: _Optional[float] = ..., bandwidth_bytes_per_second: _Optional[float] = ..., measured_at_ms: _Optional[int] = ..., slowdown: _Optional[float] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "name", "state", "devices", "peer_address", "registered_at_ms", "last_heartbeat_ms", "lease_expires_ms", "benchmark", "current_job_id", "strikes", "agent_version", "labels", "observed_samples_per_second", "return_state", "price_micro_per_hour", "online_since_ms", "parts_applied", "parts_failed", "job_samples_per_second", "reputation", "revoked", "ring_seal_digests", "ring_features")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class JobSamplesPerSecondEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    BENCHMARK_FIELD_NUMBER: _ClassVar[int]
    CURRENT_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STRIKES_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RETURN_STATE_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICRO_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    ONLINE_SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    PARTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PARTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    JOB_SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    REPUTATION_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    RING_SEAL_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    RING_FEATURES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    state: NodeState
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    peer_address: str
    registered_at_ms: int
    last_heartbeat_ms: int
    lease_expires_ms: int
    benchmark: BenchmarkResult
    current_job_id: str
    strikes: int
    agent_version: str
    labels: _containers.ScalarMap[str, str]
    observed_samples_per_second: float
    return_state: NodeState
    price_micro_per_hour: int
    online_since_ms: int
    parts_applied: int
    parts_failed: int
    job_samples_per_second: _containers.ScalarMap[str, float]
    reputation: Reputation
    revoked: bool
    ring_seal_digests: _containers.RepeatedScalarFieldContainer[str]
    ring_features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., peer_address: _Optional[str] = ..., registered_at_ms: _Optional[int] = ..., last_heartbeat_ms: _Optional[int] = ..., lease_expires_ms: _Optional[int] = ..., benchmark: _Optional[_Union[BenchmarkResult, _Mapping]] = ..., current_job_id: _Optional[str] = ..., strikes: _Optional[int] = ..., agent_version: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., observed_samples_per_second: _Optional[float] = ..., return_state: _Optional[_Union[NodeState, str]] = ..., price_micro_per_hour: _Optional[int] = ..., online_since_ms: _Optional[int] = ..., parts_applied: _Optional[int] = ..., parts_failed: _Optional[int] = ..., job_samples_per_second: _Optional[_Mapping[str, float]] = ..., reputation: _Optional[_Union[Reputation, _Mapping]] = ..., revoked: _Optional[bool] = ..., ring_seal_digests: _Optional[_Iterable[str]] = ..., ring_features: _Optional[_Iterable[str]] = ...) -> None: ...

class Reputation(_message.Message):
    __slots__ = ("verified_in_a_row", "verified_total", "failed_total", "last_verified_round", "last_failure_round", "last_failure_ms", "last_failure_evidence", "check_probability", "check_reason")
    VERIFIED_IN_A_ROW_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_VERIFIED_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    CHECK_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    CHECK_REASON_FIELD_NUMBER: _ClassVar[int]
    verified_in_a_row: int
    verified_total: int
    failed_total: int
    last_verified_round: int
    last_failure_round: int
    last_failure_ms: int
    last_failure_evidence: str
    check_probability: float
    check_reason: str
    def __init__(self, verified_in_a_row: _Optional[int] = ..., verified_total: _Optional[int] = ..., failed_total: _Optional[int] = ..., last_verified_round: _Optional[int] = ..., last_failure_round: _Optional[int] = ..., last_failure_ms: _Optional[int] = ..., last_failure_evidence: _Optional[str] = ..., check_probability: _Optional[float] = ..., check_reason: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "time_ms", "kind", "node_id", "job_id", "message", "attrs")
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    id: int
    time_ms: int
    kind: str
    node_id: str
    job_id: str
    message: str
    attrs: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., time_ms: _Optional[int] = ..., kind: _Optional[str] = ..., node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., message: _Optional[str] = ..., attrs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "loss", "inputs", "targets", "epochs", "global_batch", "optimizer", "lr", "momentum", "weight_decay", "seed", "beta1", "beta2", "eps", "nesterov", "dampening", "sync", "inner_steps", "inner_optimizer", "outer_optimizer", "outer_lr", "outer_momentum", "compression", "topk_ratio", "micro_batch", "aggregation", "min_nodes", "max_nodes", "checkpoint_every", "priority", "max_price_micro_per_hour", "budget_micro", "deadline_seconds", "aggregation_rule")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    INNER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    TOPK_RATIO_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_PRICE_MICRO_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MICRO_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_RULE_FIELD_NUMBER: _ClassVar[int]
    name: str
    loss: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    targets: _containers.RepeatedScalarFieldContainer[str]
    epochs: int
    global_batch: int
    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    seed: int
    beta1: float
    beta2: float
    eps: float
    nesterov: bool
    dampening: float
    sync: str
    inner_steps: int
    inner_optimizer: str
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    compression: str
    topk_ratio: float
    micro_batch: int
    aggregation: str
    min_nodes: int
    max_nodes: int
    checkpoint_every: int
    priority: str
    max_price_micro_per_hour: int
    budget_micro: int
    deadline_seconds: float
    aggregation_rule: str
    def __init__(self, name: _Optional[str] = ..., loss: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., targets: _Optional[_Iterable[str]] = ..., epochs: _Optional[int] = ..., global_batch: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., seed: _Optional[int] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., nesterov: _Optional[bool] = ..., dampening: _Optional[float] = ..., sync: _Optional[str] = ..., inner_steps: _Optional[int] = ..., inner_optimizer: _Optional[str] = ..., outer_optimizer: _Optional[str] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., compression: _Optional[str] = ..., topk_ratio: _Optional[float] = ..., micro_batch: _Optional[int] = ..., aggregation: _Optional[str] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., priority: _Optional[str] = ..., max_price_micro_per_hour: _Optional[int] = ..., budget_micro: _Optional[int] = ..., deadline_seconds: _Optional[float] = ..., aggregation_rule: _Optional[str] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("blob", "start", "count")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    blob: BlobRef
    start: int
    count: int
    def __init__(self, blob: _Optional[_Union[BlobRef, _Mapping]] = ..., start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "name", "owner", "state", "spec", "program", "initial_state", "shards", "num_samples", "created_ms", "updated_ms", "epoch", "round", "samples_done", "samples_total", "last_loss", "message", "result", "params_version", "eta_seconds", "spent_micro", "escrow_micro")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DONE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ETA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPENT_MICRO_FIELD_NUMBER: _ClassVar[int]
    ESCROW_MICRO_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    owner: str
    state: JobState
    spec: JobSpec
    program: BlobRef
    initial_state: BlobRef
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    num_samples: int
    created_ms: int
    updated_ms: int
    epoch: int
    round: int
    samples_done: int
    samples_total: int
    last_loss: float
    message: str
    result: BlobRef
    params_version: int
    eta_seconds: float
    spent_micro: int
    escrow_micro: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., program: _Optional[_Union[BlobRef, _Mapping]] = ..., initial_state: _Optional[_Union[BlobRef, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ..., num_samples: _Optional[int] = ..., created_ms: _Optional[int] = ..., updated_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., samples_done: _Optional[int] = ..., samples_total: _Optional[int] = ..., last_loss: _Optional[float] = ..., message: _Optional[str] = ..., result: _Optional[_Union[BlobRef, _Mapping]] = ..., params_version: _Optional[int] = ..., eta_seconds: _Optional[float] = ..., spent_micro: _Optional[int] = ..., escrow_micro: _Optional[int] = ...) -> None: ...

class RoundPart(_message.Message):
    __slots__ = ("node_id", "local_batch", "ranges", "mean_loss", "seconds", "status", "inner_steps", "communicate_seconds", "price_micro_per_hour", "billed_rate")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICRO_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    BILLED_RATE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    local_batch: int
    ranges: _containers.RepeatedCompositeFieldContainer[SampleRange]
    mean_loss: float
    seconds: float
    status: str
    inner_steps: int
    communicate_seconds: float
    price_micro_per_hour: int
    billed_rate: float
    def __init__(self, node_id: _Optional[str] = ..., local_batch: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[SampleRange, _Mapping]]] = ..., mean_loss: _Optional[float] = ..., seconds: _Optional[float] = ..., status: _Optional[str] = ..., inner_steps: _Optional[int] = ..., communicate_seconds: _Optional[float] = ..., price_micro_per_hour: _Optional[int] = ..., billed_rate: _Optional[float] = ...) -> None: ...

class RoundRecord(_message.Message):
    __slots__ = ("job_id", "epoch", "round", "started_ms", "finished_ms", "parts", "loss", "params_version", "attempts", "rolled_back")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_MS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    round: int
    started_ms: int
    finished_ms: int
    parts: _containers.RepeatedCompositeFieldContainer[RoundPart]
    loss: float
    params_version: int
    attempts: int
    rolled_back: bool
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., started_ms: _Optional[int] = ..., finished_ms: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[RoundPart, _Mapping]]] = ..., loss: _Optional[float] = ..., params_version: _Optional[int] = ..., attempts: _Optional[int] = ..., rolled_back: _Optional[bool] = ...) -> None: ...

class NodeAllocation(_message.Message):
    __slots__ = ("node_id", "name", "samples_per_second", "share", "local_batch", "max_batch", "segment", "remaining", "compute_seconds", "communicate_seconds", "rtt_ms", "bandwidth_bytes_per_second", "inner_steps")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    samples_per_second: float
    share: float
    local_batch: int
    max_batch: int
    segment: SampleRange
    remaining: int
    compute_seconds: float
    communicate_seconds: float
    rtt_ms: float
    bandwidth_bytes_per_second: float
    inner_steps: int
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., samples_per_second: _Optional[float] = ..., share: _Optional[float] = ..., local_batch: _Optional[int] = ..., max_batch: _Optional[int] = ..., segment: _Optional[_Union[SampleRange, _Mapping]] = ..., remaining: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., communicate_seconds: _Optional[float] = ..., rtt_ms: _Optional[float] = ..., bandwidth_bytes_per_second: _Optional[float] = ..., inner_steps: _Optional[int] = ...) -> None: ...

class Allocation(_message.Message):
    __slots__ = ("job_id", "epoch", "round", "nodes", "round_deadline_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    round: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeAllocation]
    round_deadline_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeAllocation, _Mapping]]] = ..., round_deadline_seconds: _Optional[float] = ...) -> None: ...

class RingAssignment(_message.Message):
    __slots__ = ("node_ids", "peer_addresses", "rank", "attempt", "deadline_seconds", "seal_digest")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEAL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    peer_addresses: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    attempt: int
    deadline_seconds: float
    seal_digest: str
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., peer_addresses: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ..., attempt: _Optional[int] = ..., deadline_seconds: _Optional[float] = ..., seal_digest: _Optional[str] = ...) -> None: ...
