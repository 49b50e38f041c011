"""``null`` in a request body: local_engine refuses it exactly where SGLang does (issue 35).

SGLang's request classes type some fields ``Optional`` (``null`` means the default) and others
not (``flush_cache: bool``, ``group_name: str``, ``mode: Literal[...]``: ``null`` is a 400).
local_engine used to take ``null`` as the default everywhere, so a client bug that sends
``"flush_cache": null`` passed here and failed on SGLang. For every body local_engine models,
every field set to ``null`` is judged by each supported release's own classes (the contract
kit) and by local_engine's model: the verdicts must agree. A field a release does not have
(or a route it lacks) says nothing about ``null`` and is skipped.
"""

from __future__ import annotations

import pydantic

from local_engine import protocol as P
from local_engine import routes_lora as L
from tests.contract import sglang_source as kit

GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "group_name": "g",
         "backend": "gloo"}
BUCKET = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g", "weight_version": "1", "flush_cache": False}
BODIES = {  # route: (local_engine's model, a body both accept)
    "/abort_request": (P.AbortBody, {"rid": "x"}),
    "/pause_generation": (P.PauseBody, {"mode": "abort"}),
    "/continue_generation": (P.ContinueBody, {}),
    "/begin_weight_update": (P.SessionBody, {}),
    "/end_weight_update": (P.SessionBody, {}),
    "/init_weights_update_group": (P.InitGroupBody, GROUP),
    "/destroy_weights_update_group": (P.DestroyGroupBody, {"group_name": "g"}),
    "/update_weights_from_distributed": (P.UpdateDistributedBody, BUCKET),
    "/update_weights_from_disk": (P.UpdateDiskBody, {"model_path": "/m", "weight_version": "1"}),
    "/update_weight_version": (P.UpdateVersionBody, {"new_version": "1"}),
    "/generate": (P.GenerateBody, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
    "/weights_checker": (P.CheckWeightsBody, {"action": "checksum"}),
    "/load_lora_adapter": (L.LoadLoraBody, {"lora_name": "a", "lora_path": "/adapters/a"}),
    "/unload_lora_adapter": (L.UnloadLoraBody, {"lora_name": "a"}),
}
CASES = [*BODIES.items(),  # the tensor route's two layouts (0.5.15-0.5.16, then 0.5.17+), each judged by its releases
         ("/load_lora_adapter_from_tensors", (L.LoadLoraTensorsBody, {"lora_name": "a", "config_dict": {"r": 4},
                                                                      "serialized_tensors": "AAAA"})),
         ("/load_lora_adapter_from_tensors", (L.LoadLoraTensorsBody, {"lora_name": "a", "config_dict": {"r": 4},
                                                                      "serialized_named_tensors": ["AAAA"]}))]
SAYS_NOTHING = ("no route", "is not a field of", "is not an argument of")


def local_refuses(model: type[pydantic.BaseModel], body: dict) -> bool:
    try:
        model.model_validate(body)
    except pydantic.ValidationError:
        return True
    return False


def sglang_refuses(release: str, route: str, body: dict) -> bool | None:
    """True/False: the release's verdict; None: the release has no such route or field."""
    problems = kit.check_request(release, "POST", route, body)
    if any(s in p for p in problems for s in SAYS_NOTHING):
        return None
    return bool(problems)


def test_null_is_refused_exactly_where_a_supported_release_refuses_it(releases):
    """local_engine is as strict as the strictest release (a field typed ``bool`` in one release
    and ``Optional[bool]`` in a later one refuses ``null``): what passes here passes everywhere."""
    disagree, judged = [], 0
    for route, (model, base) in CASES:
        assert not local_refuses(model, base), route
        assert all(sglang_refuses(r, route, base) in (False, None) for r in releases), route
        cases = [(f, {**base, f: None}) for f in model.model_fields if f not in ("input_ids", "text")]
        if route == "/generate":
            cases += [(f"sampling_params.{f}", {**base, "sampling_params": {"max_new_tokens": 2, f: None}})
                      for f in P.SamplingParams.model_fields]
        for field, body in cases:
            verdicts = {r: sglang_refuses(r, route, body) for r in releases}
            refusing = [r for r, v in verdicts.items() if v]
            if all(v is None for v in verdicts.values()):
                continue
            judged += 1
            if bool(refusing) != local_refuses(model, body):
                disagree.append(f"{route} {field}=null: refused by sglang {refusing or 'no release'}, "
                                f"local_engine {'accepts' if refusing else 'refuses'} it")
    assert judged >= 40, judged
    assert not disagree, "\n".join(disagree)
