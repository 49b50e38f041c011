"""Faults mid-sync on real SGLang (issue 45 item 4): the reliability matrix's sync faults, the
same tests as against local_engine (tests/sync), run unchanged against two real SGLang 0.5.23
servers (``engines`` and ``restart_engine`` from tests/sglang/conftest.py):

- an engine SIGKILLed mid-sync: the survivor, which holds part of the update, is quarantined
  before the rollout resumes (no mixed weights served), the next push brings it back, and the
  engine restarted with its initial weights stays out until a sync gives it the current ones
  (F8; log-probs equal the trainer's model's);
- the sync agent SIGKILLed while the engines load: the restarted agent rolls back, quarantines,
  reloads from ``sync.reload_path`` (``/update_weights_from_disk`` on SGLang) and the run goes on
  (F9), or, with nothing to reload from, asks the trainer for a push;
- an engine SIGSTOPped mid-sync: contained at once, the run goes on with the other engine, and
  the stopped one rejoins after SIGCONT (F16).
"""

from tests.sync.test_sync_agent import (  # noqa: F401 - collected here with this directory's fixtures
    test_engine_killed_mid_sync_is_quarantined_and_rejoins_at_the_right_version,
)
from tests.sync.test_sync_agent_restart import (  # noqa: F401
    test_agent_killed_while_loading_rolls_back_and_never_serves_mixed_weights,
    test_agent_killed_while_loading_with_nothing_to_reload_from_asks_for_a_push,
)
from tests.sync.test_sync_faults import (  # noqa: F401
    test_an_engine_hung_mid_sync_is_contained_and_the_run_goes_on,
)
