"""asyncrl's hook for the Python processes of an SGLang server: a bounded timeout on the
weight-update group (issue 66 N7).

SGLang creates the group of ``/init_weights_update_group`` with
``sglang.srt.utils.common.init_custom_process_group`` and passes no timeout (0.5.15-0.5.23), so
the group gets torch's default, 30 minutes. Over NCCL a receiver is not woken when the sender
destroys the group: an engine downstream of a stalled rank stays in its broadcast, paused, for
that long. With ``ASYNCRL_WEIGHT_GROUP_TIMEOUT_S=<seconds>`` in the environment, this hook makes
``init_custom_process_group`` use that timeout whenever its caller passes none (the weight-update
group, and SGLang's other weight-transfer groups, which are created the same way); nothing else
is changed, SGLang's own tensor-parallel groups included. Unset or empty: the hook does nothing.

It is loaded through ``PYTHONPATH`` (this directory first) by every Python process of the server,
the scheduler processes SGLang spawns included: ``docker/sglang/engine.sh``, ``asyncrl slurm``'s
engine steps, and by hand as docs/deployment.md shows. It then loads the next ``sitecustomize``
on the path, so a site's own hook still runs. It imports nothing heavy: the wrap happens when
SGLang's module is imported. Contract: tests/sglang/test_weight_group_timeout.py.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from datetime import timedelta

TIMEOUT_ENV = "ASYNCRL_WEIGHT_GROUP_TIMEOUT_S"
TARGETS = ("sglang.srt.utils.common", "sglang.srt.utils")  # where releases define the function
_MARK = "__asyncrl_bounded__"


def _limit() -> timedelta | None:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    seconds = float(raw)
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return timedelta(seconds=seconds)


def _bound(module, limit: timedelta) -> None:
    fn = getattr(module, "init_custom_process_group", None)
    if fn is None or getattr(fn, _MARK, False):
        return

    @functools.wraps(fn)
    def with_timeout(*args, **kwargs):
        if len(args) < 3 and kwargs.get("timeout") is None:  # timeout is the third parameter
            kwargs["timeout"] = limit
        return fn(*args, **kwargs)

    setattr(with_timeout, _MARK, True)
    module.init_custom_process_group = with_timeout


class _WrapAfterExec(importlib.abc.Loader):
    def __init__(self, inner, limit: timedelta) -> None:
        self.inner, self.limit = inner, limit

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _bound(module, self.limit)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, limit: timedelta) -> None:
        self.limit = limit

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrapAfterExec(spec.loader, self.limit)
        return spec


def _load_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    me = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me
    finally:
        sys.path[:] = saved


_LIMIT = _limit()
if _LIMIT is not None:
    sys.meta_path.insert(0, _Finder(_LIMIT))
    for _name in TARGETS:
        if _name in sys.modules:  # imported before this hook (not the case when loaded by site)
            _bound(sys.modules[_name], _LIMIT)
_load_next_sitecustomize()
