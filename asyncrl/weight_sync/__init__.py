"""Weight sync between one sender (trainer rank 0) and inference engines: the tensors (torch).

- :mod:`~asyncrl.weight_sync.buckets`: byte buckets (``plan_buckets``, ``pack_bucket``,
  ``unpack_bucket``) in SGLang's ``flattened_bucket`` format.
- :mod:`~asyncrl.weight_sync.group`: hosting (trainer) and joining (local_engine) the
  weight-update group; broadcasts with timeouts and cancellation.
- :mod:`~asyncrl.weight_sync.checksum`: a checksum of weights both sides compute alike.

The control side (pause policy, engine layouts, the engine-update sequence,
:class:`~asyncrl.sync_control.errors.WeightSyncError`), torch-free, is :mod:`asyncrl.sync_control`;
the messages between trainer and sync agent are in :mod:`asyncrl.wire.sync`.
"""

from asyncrl.weight_sync.buckets import (
    Bucket,
    byte_layout,
    dtype_name,
    pack_bucket,
    parse_dtype,
    plan_buckets,
    unpack_bucket,
)
from asyncrl.weight_sync.group import (
    DEFAULT_GROUP_TIMEOUT_S,
    WeightGroup,
    host_group,
    host_group_async,
    in_daemon_thread,
    is_loopback,
    join_group,
    reserve_listen_socket,
)

__all__ = [
    "DEFAULT_GROUP_TIMEOUT_S",
    "Bucket",
    "WeightGroup",
    "byte_layout",
    "dtype_name",
    "host_group",
    "host_group_async",
    "in_daemon_thread",
    "is_loopback",
    "join_group",
    "pack_bucket",
    "parse_dtype",
    "plan_buckets",
    "reserve_listen_socket",
    "unpack_bucket",
]
