"""The OpenAI path on real SGLang (issue 45 item 6): tests/rollout's acceptance tests of the
OpenAI-compatible API, driven by the official ``openai`` client (sessions, a tool round trip,
streamed turns, text completions, stateless routes, per-turn sampling parameters), run unchanged
against a real SGLang 0.5.23 server serving the warm model (``warm_engine`` from
tests/sglang/conftest.py); each checks the published trajectory token for token against what
the engine returned (the recording proxy's exchanges)."""

from tests.rollout.test_openai_api import (  # noqa: F401 - collected here with this directory's fixtures
    test_a_session_text_completion_streams_and_records_its_tokens,
    test_async_client_streaming_and_divergent_history,
    test_each_turns_sampling_parameters_reach_the_trajectory,
    test_stateless_routes_and_completions,
    test_sync_client_tool_round_trip_and_streamed_final_turn,
)
