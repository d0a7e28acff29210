"""Wire limits shared by every epochmesh program."""

# Large payloads stream in chunks of at most this many bytes.
MAX_CHUNK_BYTES = 1 << 20
# Every gRPC message (send and receive) is bounded: one chunk plus generous header room.
MAX_MESSAGE_BYTES = 4 << 20
# Default cap of one blob held by the coordinator (configurable with --max-blob-bytes).
DEFAULT_MAX_BLOB_BYTES = 2 << 30
