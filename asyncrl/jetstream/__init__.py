"""NATS JetStream: the embedded server and the run's stream and KV buckets."""

from asyncrl.jetstream.embedded import (
    EmbeddedNats,
    find_nats_server,
    resolve_nats_url,
    write_endpoint,
)
from asyncrl.jetstream.kv_listing import KvListingError, kv_entries
from asyncrl.jetstream.setup import (
    StreamMismatch,
    StreamSettings,
    StreamStorageShort,
    connect,
    ensure_kv,
    ensure_stream,
    kv_forget,
    store_sizes,
    stream_config,
)

__all__ = ["EmbeddedNats", "resolve_nats_url", "write_endpoint", "StreamMismatch", "StreamStorageShort", "StreamSettings", "connect", "ensure_kv", "ensure_stream", "kv_forget", "kv_entries", "KvListingError", "store_sizes", "find_nats_server", "stream_config"]
