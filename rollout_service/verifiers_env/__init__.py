"""verifiers environments as a source of trajectories (``data.source = "verifiers:<env id>"``).

A child process of the rollout service (:mod:`.driver`, supervised by :mod:`.supervisor`)
loads the environment and plays its episodes through asyncrl sessions over HTTP; the
rollout service records them token-exactly and publishes them like any session.
docs/verifiers.md has the whole story.
"""
