"""After an update: do all engines hold the same weights? (SGLang's ``/weights_checker``)

Every member that loaded the whole update is asked for its checksum
(:meth:`asyncrl.engine_client.EngineClient.check_weights`, ``{"action": "checksum"}``) while
it is still paused, between ``end`` and ``flush`` of the sequence
(:mod:`asyncrl.sync_control.sequence`). The trainer cannot compute SGLang's checksum itself
(each engine hashes its own runners' tensors: fused, sharded by tensor parallelism, in its own
dtype), so the test is agreement: engines of the same SGLang release that answer with the same
number of ranks (the same layout) must give the same ``per_engine_checksum``. Engines of
different releases are never compared: the releases hash different sets of tensors (the
name patterns of the buffers they skip changed in 0.5.18, 0.5.19 and 0.5.20, and a release may
hash its own fused or sharded runners differently), so identical weights on 0.5.20 and 0.5.21
need not agree, and a fleet being upgraded must not quarantine its odd release.

:func:`disagreeing` decides, per layout: the checksum most of them give is right; every member
with another one holds weights the others do not. With no strict majority (two engines, two
checksums; or a tie) nothing says which is right, and every member of that layout is
disagreeing. A member that is alone in its (release, layout) group cannot be checked (nothing
to compare with: "not judged", logged),
nor can one without the route (404: a server that is not SGLang 0.5.15+ or local_engine) or
one whose check failed (logged): neither counts as disagreeing.

A disagreeing member's outcome is ``mixed``, as one that failed a bucket: the sync agent
quarantines it until a reload or a full push rewrites it. A *minority* does not fail the
update: the majority holds the trainer's weights and serves the new version (one misconfigured
engine among several must not stop every sync). An *undecided* layout (no strict majority)
fails it: nothing says which engines are right (docs/sync_agent.md, "After the update: the
weights checker").
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from asyncrl.engine_client import WeightsCheck


@dataclass(frozen=True)
class Verdict:
    """:func:`disagreeing`'s answer: member id → why, for the members outvoted by a strict
    majority of their layout (``minority``) and for every member of a layout without one
    (``undecided``)."""

    minority: dict[str, str] = field(default_factory=dict)
    undecided: dict[str, str] = field(default_factory=dict)
    not_judged: dict[str, str] = field(default_factory=dict)
    """Members alone in their (release, layout) group: nothing to compare them with."""

    @property
    def all(self) -> dict[str, str]:
        return {**self.minority, **self.undecided}


def disagreeing(checks: Mapping[str, WeightsCheck], kinds: Mapping[str, str | None] | None = None) -> Verdict:
    """Which members hold weights the other members of their (kind, layout) group do not
    (module docstring); the others agree or cannot be compared (``not_judged``). ``kinds``:
    member id → what its checksum is comparable with (``EngineLayout.weights_kind``: the
    release, and expert parallelism, dtype, quantization, a draft model where set; None when
    unknown, a group of its own)."""
    layouts: dict[tuple[str | None, int], dict[str, str]] = defaultdict(dict)
    for member, check in checks.items():
        layouts[((kinds or {}).get(member), check.ranks)][member] = check.checksum
    out = Verdict()
    for (kind, ranks), sums in layouts.items():
        release = str(kind).removeprefix("sglang ")  # "0.5.23" or "0.5.23, dtype bfloat16"
        if len(sums) < 2:
            out.not_judged.update({m: f"the only engine of sglang {release} with {ranks} rank(s)" for m in sums})
            continue
        counts = Counter(sums.values()).most_common()
        top, n = counts[0]
        if len(counts) == 1:
            continue
        if n > counts[1][1]:
            for member, checksum in sums.items():
                if checksum != top:
                    out.minority[member] = (f"its weights differ from {n} of the {len(sums)} engines of sglang {release} with "
                                            f"{ranks} rank(s) after the update (checksum {checksum[:12]}, theirs {top[:12]})")
        else:
            seen = ", ".join(f"{c[:12]} x{k}" for c, k in counts)
            for member in sums:
                out.undecided[member] = (f"the {len(sums)} engines of sglang {release} with {ranks} rank(s) disagree on "
                                         f"their weights after the update ({seen})")
    return out
