"""Wire contracts shared by producers and consumers: the Trajectory schema and NATS names."""

from asyncrl.wire.end_of_data import END_OF_DATA_HEADER, end_of_data_message, is_end_of_data
from asyncrl.wire.names import NatsNames
from asyncrl.wire.routed_experts import RoutedExperts
from asyncrl.wire.trajectory import (
    REWARD_BOUND,
    SCHEMA_TAG,
    SamplingSpan,
    Trajectory,
    WireDecodeError,
    decode_trajectory,
    encode_trajectory,
)

__all__ = ["END_OF_DATA_HEADER", "REWARD_BOUND", "SCHEMA_TAG", "NatsNames", "RoutedExperts", "end_of_data_message", "is_end_of_data", "SamplingSpan", "Trajectory", "WireDecodeError", "decode_trajectory", "encode_trajectory"]
