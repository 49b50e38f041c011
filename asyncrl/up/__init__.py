"""``asyncrl up``: the whole loop on one machine (see :mod:`asyncrl.up.main`)."""
