"""Wire contracts shared by producers and consumers: the Trajectory schema and NATS names."""

from asyncrl.wire.names import NatsNames
from asyncrl.wire.trajectory import (
    SCHEMA_TAG,
    SamplingSpan,
    Trajectory,
    WireDecodeError,
    decode_trajectory,
    encode_trajectory,
)

__all__ = ["SCHEMA_TAG", "NatsNames", "SamplingSpan", "Trajectory", "WireDecodeError", "decode_trajectory", "encode_trajectory"]
