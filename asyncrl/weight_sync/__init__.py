"""Weight sync between one sender (trainer rank 0) and inference engines.

- :mod:`~asyncrl.weight_sync.group`: form a gloo group (sender hosts the store, loopback
  when the address is), broadcast with timeouts.
- :mod:`~asyncrl.weight_sync.buckets`: ``plan_buckets``, ``flatten_bucket``, ``unflatten_bucket``.
- :mod:`~asyncrl.weight_sync.transfer`: ``broadcast_bucket`` (sender), ``receive_bucket`` (engine).
- :mod:`~asyncrl.weight_sync.engines`: the HTTP-side protocol with engines
  (``form_group_with_engines``, ``push_bucket``, ``push_weights``).
"""

from asyncrl.weight_sync.buckets import (
    Bucket,
    dtype_name,
    flatten_bucket,
    parse_dtype,
    plan_buckets,
    unflatten_bucket,
)
from asyncrl.weight_sync.group import (
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    WeightGroup,
    WeightSyncError,
    init_weight_group,
    is_loopback,
    reserve_listen_socket,
)
from asyncrl.weight_sync.transfer import broadcast_bucket, receive_bucket

__all__ = [
    "DEFAULT_GROUP_NAME",
    "DEFAULT_GROUP_TIMEOUT_S",
    "Bucket",
    "WeightGroup",
    "WeightSyncError",
    "broadcast_bucket",
    "dtype_name",
    "flatten_bucket",
    "init_weight_group",
    "is_loopback",
    "parse_dtype",
    "plan_buckets",
    "receive_bucket",
    "reserve_listen_socket",
    "unflatten_bucket",
]
