"""Issue 48 items 1 and 8: local_engine's adapter-tensor payload cannot re-program torch, and
every hostile payload or adapter config is a 400 naming the problem, never a 500 or a silent load.

The payloads are built by hand from pickle opcodes (what an engine-admin-key holder can send);
``decode_tensors`` is the route's decoder (its HTTP answers: tests/local_engine/test_lora_serving.py's
engine, one case here end to end)."""

from __future__ import annotations

import base64
import pickle
import struct
import warnings
from collections import OrderedDict

import pytest
import torch

from asyncrl.engine_client import EngineHTTPError
from asyncrl.weight_sync.adapter import encode_adapter
from local_engine.adapter_payload import decode_tensors


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def legit() -> dict[str, torch.Tensor]:
    return {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def reprogram_payload() -> bytes:
    """GLOBAL torch._utils._rebuild_tensor_v2, then BUILD {"__defaults__": ...} on it: the payload
    that once made every later tensor come out negated."""
    return (b"\x80\x04" + b"ctorch._utils\n_rebuild_tensor_v2\n" + b"}" + b"\x8c\x0c__defaults__" + b"N" + b"s"
            + b"b" + b".")


def test_a_payload_that_would_set_attributes_on_torch_is_refused_and_torch_is_unchanged():
    real = torch._utils._rebuild_tensor_v2
    defaults = real.__defaults__
    with pytest.raises(ValueError, match="BUILD"):
        decode_tensors(b64(reprogram_payload()), old_protocols=True)
    assert torch._utils._rebuild_tensor_v2 is real and real.__defaults__ == defaults
    got = decode_tensors(encode_adapter(legit()), old_protocols=True)["x"]  # a legitimate load after it
    assert torch.equal(got, legit()["x"])


@pytest.mark.parametrize("opcode", [b"\x81", b"\x92", b"o", b"i__main__\nX\n"], ids=["NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"])
def test_opcodes_that_build_objects_are_refused_before_unpickling(opcode):
    raw = b"\x80\x04" + b"(" + opcode + b"."
    with pytest.raises(ValueError):
        decode_tensors(b64(raw), old_protocols=True)


def test_a_declared_length_the_bytes_do_not_hold_is_a_value_error_not_a_memory_error():
    raw = b"\x80\x04" + b"\x8e" + struct.pack("<Q", 2**62) + b"xx."  # BINBYTES8 of 2^62 bytes
    with pytest.raises(ValueError):
        decode_tensors(b64(raw), old_protocols=True)


@pytest.mark.parametrize("case", ["stride-0", "offset-view", "nan", "inf", "int"])
def test_tensors_an_adapter_cannot_be_made_of_are_refused(case):
    base = torch.zeros(4, dtype=torch.float32)
    tensor = {
        "stride-0": torch.zeros(1).expand(1024),  # a 4-byte storage posing as 1024 values
        "offset-view": torch.zeros(64)[8:16],
        "nan": torch.tensor([1.0, float("nan")]),
        "inf": torch.tensor([float("inf")]),
        "int": torch.arange(4),
    }[case]
    payload = b64(pickle.dumps({"x": tensor}, protocol=4))
    with pytest.raises(ValueError):
        decode_tensors(payload, old_protocols=True)
    # a lazily negated or conjugated view (pickle materialises one, a stand-in might not)
    from local_engine.adapter_payload import tensor_problem

    assert tensor_problem("x", base._neg_view()) and tensor_problem("x", torch.zeros(2, dtype=torch.complex64).conj())
    assert tensor_problem("x", base) is None


def storage_declaring(declared: int, present: int = 6) -> bytes:
    """A one-tensor payload whose float32 storage (torch's legacy record, as a typed storage
    pickles itself) declares ``declared`` values and carries ``present``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; it is what tensors pickle through
        record = torch.zeros(present).storage().__reduce__()[1][0]
    head, tail = record.split(b"K" + bytes([present]) + b"N", 1)  # BININT1 numel, then view_metadata None
    forged = head + b"J" + struct.pack("<i", declared) + b"N" + tail

    class Storage:
        def __reduce__(self):
            return torch.storage._load_from_bytes, (forged,)

    class Tensor:
        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (Storage(), 0, (present,), (1,), False, OrderedDict())

    return pickle.dumps({"x": Tensor()}, protocol=4)


def test_a_storage_declaring_more_bytes_than_it_carries_is_refused_before_anything_is_allocated():
    """Issue 67 L1: a payload of under 1 kB declaring a 1 GiB storage made torch allocate it before
    finding the bytes missing; the declared size is now read first."""
    payload = storage_declaring(1 << 28)
    assert len(payload) < 1000
    with pytest.raises(ValueError, match=r"a storage declares 1073741824 bytes but carries 24"):
        decode_tensors(b64(payload), old_protocols=True)
    assert torch.equal(decode_tensors(b64(storage_declaring(6)), old_protocols=True)["x"], torch.zeros(6))


def test_storages_beyond_the_largest_adapter_the_engine_serves_are_refused():
    """Issue 67 L1: all storages together at most ``max_bytes`` (the engine's
    ``--max-lora-rank`` × fan of its served modules), counted before each is allocated."""
    two = {"a": torch.zeros(4), "b": torch.zeros(4)}  # 16 + 16 bytes
    assert set(decode_tensors(encode_adapter(two), old_protocols=True, max_bytes=32)) == {"a", "b"}
    with pytest.raises(ValueError, match=r"more bytes than an adapter of --max-lora-rank .* \(16 more, 0 left\)"):
        decode_tensors(encode_adapter({**two, "c": torch.zeros(4)}), old_protocols=True, max_bytes=32)


def test_the_unpickler_never_hands_out_torch_functions():
    """find_class answers stand-ins: even an attribute set on what it returned (were BUILD
    admitted) could not reach torch."""
    from local_engine.adapter_payload import _Budget, _unpickler

    up = _unpickler(b"", old_protocols=True, budget=_Budget(None))
    assert up.find_class("torch._utils", "_rebuild_tensor_v2") is not torch._utils._rebuild_tensor_v2
    assert up.find_class("torch.storage", "_load_from_bytes") is not torch.storage._load_from_bytes
    with pytest.raises(RuntimeError, match="Blocked"):
        up.find_class("os", "system")


async def test_hostile_payloads_and_configs_are_400s_over_http(tmp_path):
    """End to end on a LoRA engine: the re-programming payload, a huge declared length, NaN
    tensors, a 1e308 lora_alpha and non-string target_modules each answer 400; a legitimate
    adapter still loads after them."""
    from asyncrl.engine_client import EngineClient
    from tests.helpers.processes import start_engine

    good = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 128),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8)}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    with start_engine(tmp_path, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
                      "--max-loaded-loras", "8") as engine:
        async with EngineClient(engine.url) as client:
            async def post(name: str, payload: str, cfg: dict) -> tuple[int, dict]:
                try:
                    await client._call("POST", "/load_lora_adapter_from_tensors",
                                       {"lora_name": name, "config_dict": cfg, "serialized_named_tensors": [payload]},
                                       admin=True)
                    return 200, {}
                except EngineHTTPError as exc:
                    return exc.status, exc.body if isinstance(exc.body, dict) else {"text": exc.body}

            nan = {k: torch.full_like(v, float("nan")) for k, v in good.items()}
            cases = [("reprogram", b64(reprogram_payload()), config),
                     ("huge", b64(b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"xx."), config),
                     ("nan", encode_adapter(nan), config),
                     ("declared", b64(storage_declaring(1 << 28)), config),
                     # present, but beyond rank 8 × (128 + 128) × 8 bytes × 2 modules (issue 67 L1)
                     ("beyond-rank", encode_adapter({**good, "base_model.model.model.layers.0.self_attn.q_proj.lora_A."
                                                     "weight": torch.zeros(8, 128 * 64)}), config),
                     ("alpha", encode_adapter(good), {**config, "lora_alpha": 1e308}),
                     ("targets", encode_adapter(good), {**config, "target_modules": [1, 2]})]
            for name, payload, cfg in cases:
                status, body = await post(name, payload, cfg)
                assert status == 400, (name, status, body)
                if name in ("declared", "beyond-rank"):
                    assert ("declares 1073741824 bytes" if name == "declared" else "--max-lora-rank") in str(body), body
            assert (await post("good", encode_adapter(good), config))[0] == 200
