"""A test that starts while a build it needs is unfinished gets time for the build.

The suite's long builds start in the background at collection (tests/helpers/shipped_rebuild.py,
tests/sglang_cpu/background.py) or in a fixture (an older SGLang release's venv, built by the
first test of tests/sglang/ that runs on it), and a test that needs one waits for it on its
build lock (``asyncrl.models.cache.build_once``). pytest-timeout's limit (300 s, fixture set-up
included) is there to stop a hung test; it must not also bound a build. It did: with an empty
cache on two busy cores the warm model took 5.7 minutes (1.5 alone), and the tests of a worker
waiting for it failed their set-up at 300 s.

So, just before such a test starts (``pytest_runtest_protocol``, ahead of pytest-timeout's
own hook, which reads the limit then), its limit is raised by the build's bound when the build
is not finished; a test starting after the build finished keeps the plain limit, and a session
with timeouts off (``--timeout=0``, ``-p no:timeout``) is left alone. A build that takes longer
than its bound still fails the test, with pytest-timeout's stack of the wait.
"""

from __future__ import annotations

import pytest

WARM_MODEL_BOUND_S = 900.0  # the warm model: ~1.5 min alone; 5.7 min seen on two busy cores with an empty cache
SGLANG_VENV_BOUND_S = 1200.0  # an SGLang venv: 3-5 min alone (pip, ~7 GB), 7.3 min seen beside the suite


def sglang_releases(item: pytest.Item) -> set[str]:
    """The SGLang releases whose venvs ``item`` needs: the default one for any test of the tier,
    and the release of its ``sglang_release`` parameter."""
    from tests.sglang_cpu import background

    if not item.nodeid.startswith(background.TIER_DIR):
        return set()
    releases = {background.DEFAULT_RELEASE}
    callspec = getattr(item, "callspec", None)
    if callspec is not None and isinstance(callspec.params.get("sglang_release"), str):
        releases.add(callspec.params["sglang_release"])
    return releases


def unfinished_builds_bound(item: pytest.Item) -> float:
    """The seconds the unfinished builds ``item`` needs may take (0 when it needs none)."""
    from tests.helpers.shipped_rebuild import WARM_FIXTURE
    from tests.helpers.warm_model import warm_model_built
    from tests.sglang_cpu import background

    bound = 0.0
    if WARM_FIXTURE in getattr(item, "fixturenames", ()) and not warm_model_built():
        bound += WARM_MODEL_BOUND_S
    bound += SGLANG_VENV_BOUND_S * sum(not background.venv_built(r) for r in sglang_releases(item))
    return bound


def base_timeout(item: pytest.Item) -> float:
    """The limit pytest-timeout gives ``item`` (its marker, else ``--timeout``, ``PYTEST_TIMEOUT``
    or the ini's, as the plugin resolves them); 0 when the plugin is not loaded."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return 0.0
    import pytest_timeout

    return float(pytest_timeout._get_item_settings(item).timeout or 0)  # the plugin's own resolution (dev.lock pins it)


def allow_for_unfinished_builds(item: pytest.Item) -> float:
    """Raise ``item``'s timeout by :func:`unfinished_builds_bound` (no change where timeouts are
    off); returns the limit it now has."""
    base = base_timeout(item)
    extra = unfinished_builds_bound(item) if base > 0 else 0.0
    if extra:
        marker = item.get_closest_marker("timeout")
        args = marker.args[1:] if marker is not None else ()
        kwargs = {k: v for k, v in marker.kwargs.items() if k != "timeout"} if marker is not None else {}
        item.add_marker(pytest.mark.timeout(base + extra, *args, **kwargs), append=False)  # first: the closest
    return base + extra
