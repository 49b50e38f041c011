"""SGLang's LoRA routes as every supported release declares them (issue 36's contract record,
read from each wheel's ``managers/io_struct.py`` by the contract kit; docs/local_engine.md,
"LoRA routes in SGLang"). The adapter-only weight sync will be built on these:

- ``POST /load_lora_adapter`` ``LoadLoRAAdapterReqInput`` and ``POST /unload_lora_adapter``
  ``UnloadLoRAAdapterReqInput``: the same fields in 0.5.15-0.5.23;
- ``POST /load_lora_adapter_from_tensors``: its tensor field changed twice —
  ``serialized_tensors: str`` in 0.5.15, ``expected_checksums`` added in 0.5.16, one
  ``serialized_named_tensors`` entry per TP rank from 0.5.17;
- every answer is ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``);
- ``/generate``'s ``lora_path`` (an adapter's *name*, one per prompt in a batch) has one type.
"""

from __future__ import annotations

import pytest

from tests.contract import sglang_source as kit

IO = "sglang/srt/managers/io_struct.py"
LOAD = {"lora_name": "str", "lora_path": "str", "pinned": "bool", "lora_id": "Optional[str]"}
UNLOAD = {"lora_name": "str", "lora_id": "Optional[str]"}
OUTPUT = {"success": "bool", "error_message": "Optional[str]", "loaded_adapters": "Optional[Dict[str, Union[str, LoRARef]]]"}
FROM_TENSORS_COMMON = {"lora_name": "str", "config_dict": "Dict[str, Any]", "pinned": "bool", "lora_id": "Optional[str]",
                       "load_format": "Optional[str]"}


def from_tensors(release: str) -> dict[str, str]:
    """``LoadLoRAAdapterFromTensorsReqInput``'s fields in ``release`` (module docstring)."""
    minor = int(release.split(".")[2])
    fields = {**FROM_TENSORS_COMMON, "added_tokens_config": "Optional[Dict[str, Any]]" if minor == 15 else "Optional[Dict[str, int]]"}
    fields |= {"serialized_tensors": "str"} if minor < 17 else {"serialized_named_tensors": "Annotated[List[bytes], Base64Bytes()]"}
    if minor >= 16:
        fields["expected_checksums"] = "Optional[Dict[str, str]]"
    return fields


@pytest.mark.parametrize("release", kit.SUPPORTED_RELEASES)
def test_the_lora_request_classes_of_each_release(releases, release):
    assert kit.model_fields(release, IO, "LoadLoRAAdapterReqInput") == LOAD
    assert kit.model_fields(release, IO, "UnloadLoRAAdapterReqInput") == UNLOAD
    assert kit.model_fields(release, IO, "LoadLoRAAdapterFromTensorsReqInput") == from_tensors(release)
    assert kit.model_fields(release, IO, "LoRAUpdateOutput") == OUTPUT
    assert kit.model_fields(release, IO, "GenerateReqInput")["lora_path"] == "Optional[Union[List[Optional[str]], str]]"


@pytest.mark.parametrize("release", kit.SUPPORTED_RELEASES)
def test_each_release_serves_the_lora_routes(releases, release):
    server = (kit.source_dir(release) / "sglang/srt/entrypoints/http_server.py").read_text()
    for route in ("/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter"):
        assert f'@app.api_route("{route}", methods=["POST"])' in server, (release, route)


def test_local_engines_lora_bodies_have_the_fields_of_the_releases(releases):
    """local_engine's bodies carry every field some supported release has, and no other."""
    from local_engine import routes_lora as L

    assert set(L.LoadLoraBody.model_fields) == set(LOAD)
    assert set(L.UnloadLoraBody.model_fields) == set(UNLOAD)
    assert set(L.LoadLoraTensorsBody.model_fields) == set().union(*(from_tensors(r) for r in kit.SUPPORTED_RELEASES))
