"""The error every step of a weight sync raises when it fails or times out.

Torch-free (:mod:`asyncrl.sync_control`): the rollout service and the sync agent catch it
without loading torch; the tensor side (:mod:`asyncrl.weight_sync`) raises it too.
"""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """Forming the group, a broadcast, or an engine's side of an update failed or timed out."""
