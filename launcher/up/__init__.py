"""``asyncrl up``: the whole loop on one machine (see :mod:`launcher.up.main`)."""
