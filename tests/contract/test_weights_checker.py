"""local_engine's ``/weights_checker`` answer has the shape of every supported release's
(issue 35): SGLang's answer models (``ChecksumInfo``, ``ParallelismInfo`` in
``sglang/srt/utils/weight_checker.py``, ``extra="forbid"``), read from each wheel's source, and
local_engine's answer built for that release (``--sglang-compat``) name the same fields; the
request body asyncrl sends is one every release accepts."""

from __future__ import annotations

from types import SimpleNamespace

from local_engine.routes_admin import checksum_answer, parallelism_infos
from tests.contract import sglang_source as kit

SETTINGS = SimpleNamespace(tp_size=2, pp_size=1, dp_size=1)


def test_the_answer_names_each_releases_fields(releases):
    for release in releases:
        info_fields = kit.model_fields(release, kit.WEIGHT_CHECKER, "ParallelismInfo")
        rank_fields = kit.model_fields(release, kit.WEIGHT_CHECKER, "ChecksumInfo")
        assert info_fields and rank_fields, f"{release}: no answer models in {kit.WEIGHT_CHECKER}"
        answer = checksum_answer({"w": "0" * 16}, parallelism_infos(SETTINGS, release))
        assert len(answer["ranks"]) == 2, release
        for rank in answer["ranks"]:
            assert set(rank) == set(rank_fields), (release, sorted(rank), sorted(rank_fields))
            assert set(rank["parallelism_info"]) == set(info_fields), (release, sorted(rank["parallelism_info"]))


def test_asyncrls_request_is_accepted_by_every_release(releases):
    for release in releases:
        assert kit.check_request(release, "POST", "/weights_checker", {"action": "checksum"}) == [], release
