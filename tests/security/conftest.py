"""Adversarial tests (issue 30): what an outsider can send must not reach what it should not.
The rollout fixtures (a warm tiny model, a local engine) are shared with tests/rollout."""

from tests.rollout.conftest import warm_engine, warm_model  # noqa: F401 - fixtures
from tests.tools.conftest import work_root  # noqa: F401 - fixture
from tests.trainer.conftest import module_nats  # noqa: F401 - fixture
