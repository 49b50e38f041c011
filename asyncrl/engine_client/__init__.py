"""The engine client: one async HTTP client for SGLang servers and local_engine.

    async with EngineClient("http://127.0.0.1:30000") as engine:
        result = await engine.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 0})
        result.output_ids, result.logprobs, result.finish_reason.type, result.weight_version
"""

from asyncrl.engine_client.client import (
    DEFAULT_CONTROL_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    EngineClient,
)
from asyncrl.engine_client.errors import (
    EngineError,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
    error_message,
)
from asyncrl.engine_client.types import (
    FinishReason,
    GenerateResult,
    WeightsCheck,
    WeightVersionSpan,
)

__all__ = [
    "DEFAULT_CONTROL_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "EngineClient",
    "EngineError",
    "EngineHTTPError",
    "EngineTimeout",
    "EngineUnavailable",
    "FinishReason",
    "GenerateResult",
    "WeightVersionSpan",
    "WeightsCheck",
    "error_message",
]
