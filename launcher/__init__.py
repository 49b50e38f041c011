"""The ``asyncrl`` command line and the launchers above the services: ``asyncrl up`` (the
whole loop as local processes), ``asyncrl demo-stack``, ``asyncrl config``, ``asyncrl nats``,
and the dispatch to each service's entry point (:mod:`launcher.cli`).

The top floor: it imports the services (lazily, per subcommand); nothing below imports it
(``tests/test_lint.py``). ``python -m launcher`` is the ``asyncrl`` command.
"""
