"""``asyncrl up``'s built-in demo, in three modules:

- :mod:`~recipes.demo.task`: the arithmetic task (questions that want a calculator call, the
  answer check); the rollout service's prompts when a run names no data;
- :mod:`~recipes.demo.sft_data`: supervised examples of the task in the chat and tool-call
  format the rollout service produces (:mod:`asyncrl.chat`);
- :mod:`~recipes.demo.warmup`: the SFT warm-up that makes the demo's starting policy
  ``builtin:tiny-arith`` (``python -m recipes.demo.warmup``).
"""
