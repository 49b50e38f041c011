"""LoRA on real SGLang (issue 45 item 5): the adapter-sync tests of tests/sync run unchanged
against real SGLang 0.5.23 servers (``--enable-lora --lora-backend torch_native``;
``lora_and_plain`` and ``restart_lora_engine`` from tests/sglang/conftest.py): adapters load
where LoRA is served (the transport 0.5.23 takes: tensors), outputs follow the adapter version
(log-probs equal peft's forward of that adapter), older versions are unloaded, an engine without
LoRA is held out and repaired by a push once it serves LoRA, the agent refuses engines that
cannot serve the run's adapter, and an adapter sync the agent died in is rolled back; a sync
that meets a turn in flight (partial rollout) resumes it on the new adapter, each part's
log-probs peft's forward of its own adapter.
"""

import pytest

from asyncrl.engine_client import EngineHTTPError
from asyncrl.weight_sync.adapter import adapter_checksums, encode_adapter
from local_engine.lora import read_adapter_dir
from tests.helpers.lora import make_adapter
from tests.helpers.processes import start_engine
from tests.helpers.reference_model import load_reference_model, teacher_forced_logprobs
from tests.sglang.conftest import LORA_FLAGS
from tests.sglang_cpu.server import start_sglang
from tests.sync.conftest import ENGINE_ARGS
from tests.sync.test_adapter_resume import (  # noqa: F401
    test_a_sync_meets_a_turn_in_flight_and_the_turn_resumes_on_the_new_adapter,
)
from tests.sync.test_adapter_sync import (  # noqa: F401 - collected here with this directory's fixtures
    test_adapters_load_where_lora_is_served_and_the_rest_is_held_out,
    test_an_adapter_sync_the_agent_died_in_is_rolled_back_without_reloads,
    test_an_agent_refuses_to_start_when_its_engines_cannot_serve_the_adapter,
)

PROMPT = [5, 17, 42, 99, 7, 300, 12]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("kind", ["local", "sglang"])
async def test_a_request_naming_an_unloaded_adapter(tmp_path, sglang_release, tiny_dir, kind):
    """What SGLang really does (a probe saw LoRA output after an unload): a request naming an
    adapter that was loaded from a path and then unloaded loads it again from that path
    (implicitly) and answers with its output; one loaded from tensors cannot be reloaded and the
    request is refused (400). local_engine does the same; asyncrl never names an unloaded
    adapter (the sync agent unloads only versions older than the one the rollout serves, after a
    pause that aborted every call on them), and the loss of a tensor adapter is a refused call."""
    base = load_reference_model()
    model = make_adapter(base, tmp_path / "adapter", seed=3)
    config, tensors = read_adapter_dir(str(tmp_path / "adapter"))
    if kind == "local":
        engine = start_engine(tmp_path, *ENGINE_ARGS, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                              "q_proj", "v_proj", "--sglang-compat", sglang_release, name="lora-local")
    else:
        engine = start_sglang(tmp_path, tiny_dir, *LORA_FLAGS, name="lora-sglang", release=sglang_release)
    with engine:
        async with engine.client() as c:
            await c.load_lora_adapter("by-path", str(tmp_path / "adapter"))
            first = await c.generate(PROMPT, GREEDY, extra={"lora_path": "by-path"})
            assert first.logprobs == pytest.approx(teacher_forced_logprobs(model, PROMPT, first.output_ids), abs=1e-4)
            await c.unload_lora_adapter("by-path")
            assert "by-path" not in await c.lora_adapters()
            again = await c.generate(PROMPT, GREEDY, extra={"lora_path": "by-path"})  # reloaded from its path
            assert again.output_ids == first.output_ids and again.logprobs == pytest.approx(first.logprobs, abs=1e-5)
            assert "by-path" in await c.lora_adapters()
            await c.load_lora_adapter_from_tensors("by-tensors", config, encode_adapter(tensors), adapter_checksums(tensors),
                                                   named=sglang_release >= "0.5.17")
            await c.unload_lora_adapter("by-tensors")
            with pytest.raises(EngineHTTPError) as refused:
                await c.generate(PROMPT, GREEDY, extra={"lora_path": "by-tensors"})
            assert refused.value.status == 400
