"""The error envelope's ``type`` takes OpenAI's values only: the four specific 4xx types,
``invalid_request_error`` for any other 4xx, ``server_error`` only (and always) for 5xx."""

from __future__ import annotations

from asyncrl.http.errors import error_body

OPENAI_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error", "rate_limit_error",
                "server_error"}


def test_every_status_maps_to_an_openai_type():
    for status in range(400, 600):
        err = error_body(status, "m")["error"]
        assert err["type"] in OPENAI_TYPES and err["code"] == status
        assert (err["type"] == "server_error") == (status >= 500), status
    assert [error_body(s, "m")["error"]["type"] for s in (401, 403, 404, 429, 409, 413, 415, 422)] == [
        "authentication_error", "permission_error", "not_found_error", "rate_limit_error",
        "invalid_request_error", "invalid_request_error", "invalid_request_error", "invalid_request_error"]
