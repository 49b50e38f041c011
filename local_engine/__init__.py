"""local_engine: a CPU inference server speaking the SGLang HTTP subset asyncrl uses.

    asyncrl engine --model builtin:tiny --port 30000        # or: python -m local_engine ...

Modules: ``app`` (``create_app(settings)``), ``engine`` (validation, locks, pause, weight
updates), ``scheduler`` (continuous batching), ``runner`` (model compute behind
``ModelRunner``), ``sampler``, ``request``, ``weights``, ``protocol`` (request bodies),
``errors``, ``auth``, ``metrics``, ``routes_*``. See docs/local_engine.md.

Importing this package does not import torch.
"""

__version__ = "0.1.0"
