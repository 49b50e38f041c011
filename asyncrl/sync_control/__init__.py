"""The control side of a weight sync, torch-free: what the rollout service and the sync agent
need without loading torch (checked by ``tests/test_lint.py``).

- :mod:`~asyncrl.sync_control.pause_policy`: which pause an update needs on which release.
- :mod:`~asyncrl.sync_control.layout`: what an engine's ``/server_info`` says about its ranks,
  and whether SGLang can update it over a group.
- :mod:`~asyncrl.sync_control.engine_update`: the engine side of one update (pause → session →
  group → buckets → session end → resume), used by the sync agent and the direct publisher.
- :mod:`~asyncrl.sync_control.errors`: :class:`WeightSyncError`.

The tensors (buckets, the group, checksums) are in :mod:`asyncrl.weight_sync`; the messages
between trainer and sync agent in :mod:`asyncrl.wire.sync`.
"""
