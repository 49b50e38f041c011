"""The pinned SGLang sources, fetched once per test session (see sglang_source.py)."""

from __future__ import annotations

import pytest

from tests.contract import sglang_source as kit
from tests.rollout.conftest import warm_engine, warm_model  # noqa: F401 - fixtures of test_rollout_traffic.py


@pytest.fixture(scope="session")
def releases() -> tuple[str, ...]:
    """Every supported release, each one's source in the cache (a failed download fails the test
    with the kit's message)."""
    for release in kit.SUPPORTED_RELEASES:
        try:
            kit.source_dir(release)
        except kit.SGLangSourceError as exc:
            pytest.fail(str(exc), pytrace=False)
    return kit.SUPPORTED_RELEASES


@pytest.fixture(scope="session", params=kit.PINNED)
def sglang_version(request: pytest.FixtureRequest) -> str:
    """A pinned SGLang version whose source is in the cache. A failed download fails every test
    that uses it with the kit's message (pytest caches the failure: one attempt per version)."""
    try:
        kit.source_dir(request.param)
    except kit.SGLangSourceError as exc:
        error = str(exc)
    else:
        return request.param
    pytest.fail(error, pytrace=False)
