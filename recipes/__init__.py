"""Recipes: a task with what it takes to train on it, above the services.

- :mod:`recipes.demo`: ``asyncrl up``'s built-in demo (an arithmetic task, its SFT data, the
  warm-up that makes ``builtin:tiny-arith``).

A recipe may use the shared package (:mod:`asyncrl`), the tools and, lazily, a service's
library code (the warm-up trains with the trainer's SFT); services import only a recipe's
data modules (the rollout service's default prompts are the demo task), never its builders
(``tests/test_lint.py``).
"""
