"""Real SGLang on this CPU for the real-SGLang test tier: the venv per release (``install``), the
server (``server``) and the two stand-ins SGLang needs without its CUDA kernel library
(``stand_ins/``). Test infrastructure only: nothing in the product imports it."""
