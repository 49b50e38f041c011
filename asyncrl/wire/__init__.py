"""Wire contracts shared by producers and consumers: the Trajectory schema and NATS names."""

from asyncrl.wire.names import NatsNames
from asyncrl.wire.trajectory import (
    SCHEMA_TAG,
    Trajectory,
    WireDecodeError,
    decode_trajectory,
    encode_trajectory,
)

__all__ = ["SCHEMA_TAG", "NatsNames", "Trajectory", "WireDecodeError", "decode_trajectory", "encode_trajectory"]
