"""The worker side of :mod:`.math_pool`: a loop that answers math-verify requests.

Run as ``python -c "from rollout_service.rewards.verify_worker import main; main(mem_mb, soft_s)"``
by :class:`~.math_pool.VerifyPool`, never in the service process. Protocol: 4-byte
big-endian length + JSON object, requests on stdin, replies on a duplicate of the original
stdout (fd 1 is pointed at stderr so that stray prints cannot corrupt the channel).

Request ``{"id", "pred", "golds"}`` (LaTeX strings); reply ``{"id", "correct",
"pred_parsed", "gold_parsed", "soft_timeout"}`` or ``{"id", "error": <exception type>}``.
Only math-verify's LaTeX extraction is used (its expression mode would reach sympy's
``parse_expr``, which evaluates text). The worker exits on EOF or a broken pipe.
"""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import time
from typing import Any


def main(max_memory_mb: int, soft_timeout_s: int | None) -> None:
    """Worker process entry point: serve length-prefixed JSON frames on stdin/stdout."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_fd = os.dup(1)  # the protocol channel; stray prints of libraries go to stderr
    os.dup2(2, 1)
    if max_memory_mb > 0:
        limit = max_memory_mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    soft_timeouts = _SoftTimeoutFlag()
    mv_logger = logging.getLogger("math_verify")
    mv_logger.setLevel(logging.WARNING)
    mv_logger.propagate = False  # its warnings echo the input; keep them off stderr
    mv_logger.addHandler(soft_timeouts)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    parse("\\boxed{\\frac{1}{2}}", config, parsing_timeout=None)  # warm the LaTeX parser
    try:
        write_frame(out_fd, {"ready": True})
    except OSError:
        return
    while True:
        try:
            req = read_frame(0, None)
        except (EOFError, OSError, ValueError):
            return
        reply: dict[str, Any] = {"id": req.get("id")}
        soft_timeouts.hit = False
        try:
            pred = parse(req["pred"], config, parsing_timeout=soft_timeout_s)
            reply.update(pred_parsed=bool(pred), gold_parsed=False, correct=False)
            for gold_text in req["golds"]:
                gold = parse(gold_text, config, parsing_timeout=soft_timeout_s)
                if gold:
                    reply["gold_parsed"] = True
                    if pred and verify(gold, pred, timeout_seconds=soft_timeout_s):
                        reply["correct"] = True
                        break
            reply["soft_timeout"] = soft_timeouts.hit
        except BaseException as exc:  # MemoryError, RecursionError, anything: report, keep serving
            reply = {"id": req.get("id"), "error": type(exc).__name__}
        try:
            write_frame(out_fd, reply)
        except OSError:  # the parent gave up on us (timeout, close): exit quietly
            return


class _SoftTimeoutFlag(logging.Handler):
    """Notices math-verify's "Timeout during parsing/comparison" warnings (it reports its
    signal timeouts only by logging them and returning an empty/False result)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hit = False

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Timeout during"):
            self.hit = True


def write_frame(fd: int, obj: Any) -> None:
    """Write ``obj`` as one frame (blocking until written)."""
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    poller = select.poll()  # not select.select: that fails for fds >= 1024 in a busy service
    poller.register(fd, select.POLLIN)
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(max(1, int(remaining * 1000))):
                raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame(fd: int, deadline: float | None, max_bytes: int = 1 << 24) -> Any:
    """Read one frame. ``deadline`` (``time.monotonic()``): TimeoutError past it; EOFError
    when the writer closed; ValueError for a frame over ``max_bytes`` or invalid JSON."""
    (size,) = struct.unpack(">I", _read_exact(fd, 4, deadline))
    if size > max_bytes:
        raise ValueError(f"frame of {size} bytes")
    return json.loads(_read_exact(fd, size, deadline))
