"""The /generate bodies the rollout service's own request builders make, checked against every
SGLang release asyncrl supports (issue 35: the kit took its sampling parameters from the test).

A recording proxy sits in front of a local engine while the real service runs: its own agent
plays a sample (the runner's turn builder, the configured sampling), and the official openai
client drives the OpenAI path (a chat completion with tools, ``stop``, ``seed``, ``top_p``,
log-probs; a text completion with ``stop`` and ``seed``). Every recorded /generate body must be
one each release's request classes accept and, from 0.5.22, its contract gate too (the
generated schema decoder, run from the wheel: ``sglang_source.generate_contract``).
"""

from __future__ import annotations

from openai import AsyncOpenAI

from asyncrl.engine_client.sampling_mask import SAMPLING_MASK_SINCE
from tests.contract import sglang_source as kit
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import running_service
from tests.rollout.test_openai_api import CALC, QUESTION, idle_cfg, new_session


async def test_every_generate_body_the_service_builds_is_one_every_release_accepts(tmp_path, nats_server, warm_engine,
                                                                                  releases):
    proxy = await RecordingProxy(warm_engine).start()
    try:
        cfg = idle_cfg(tmp_path, nats_server.url, proxy.url, "rollout.sampling.top_p=0.95", "rollout.sampling.top_k=40",
                       "rollout.sampling.max_new_tokens=12")
        async with running_service(cfg) as (svc, url):
            await wait_for(lambda: svc.runner.counters.trajectories_finished >= 1, 120, "the service's own sample")
            sess = await new_session(url)
            client = AsyncOpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120, max_retries=0)
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": QUESTION}], tools=CALC,
                                                 stop=["\n\n", "###"], seed=7, temperature=0.7, top_p=0.9, max_tokens=8,
                                                 logprobs=True, top_logprobs=2)
            text = await new_session(url, data_source="external/text", group_size=1)
            plain = AsyncOpenAI(base_url=text["base_url"], api_key=text["token"], timeout=120, max_retries=0)
            await plain.completions.create(model="policy", prompt=[5, 6, 7, 8], max_tokens=4, stop=["x"], seed=3, temperature=1.0)
    finally:
        await proxy.stop()
    bodies = [body for method, path, _, body in proxy.requests if (method, path) == ("POST", "/generate")]
    params = [b["sampling_params"] for b in bodies]
    # the recording covers what it claims: the runner's sampling and the OpenAI path's extras
    assert any(p.get("top_k") == 40 for p in params), params
    assert any(p.get("sampling_seed") == 7 and p.get("stop") for p in params), params
    assert any(p.get("sampling_seed") == 3 for p in params), params
    # the runner's top-k sampling asks the engine (0.5.23 here) for sampling masks; such a body
    # goes only to engines of a release that has them (asks_sampling_mask), the rest to every one
    masked = [b for b in bodies if "return_sampling_mask" in b]
    assert masked and all(b["return_sampling_mask"] is True and b["sampling_params"]["top_k"] == 40 for b in masked)
    problems = [f"sglang {release}: {problem} in {body!r:.300}" for release in releases for body in bodies
                if body not in masked or tuple(map(int, release.split("."))) >= SAMPLING_MASK_SINCE
                for problem in kit.check_request(release, "POST", "/generate", body)]
    assert not problems, "\n".join(problems)


WRONG_TYPES = {"max_new_tokens": [16.0, "16", True], "min_new_tokens": [1.0], "temperature": ["0.5", False], "top_p": ["1"],
               "top_k": [20.0, True], "min_p": ["0"], "stop": [5, [1]], "stop_token_ids": [[1.0], ["2"], 3],
               "ignore_eos": [1, "true"], "skip_special_tokens": [0], "no_stop_trim": ["no"], "sampling_seed": [7.0, "7"],
               "n": [1.0]}


async def test_local_engine_refuses_every_sampling_value_the_contract_gate_refuses(warm_engine, releases):
    """local_engine is at least as strict as the newest release's gate on the sampling values
    asyncrl sends: each wrong-typed value the gate refuses is a 400 from local_engine too."""
    import httpx

    gate = kit.generate_contract(releases[-1])
    assert gate is not None
    checked = 0
    async with httpx.AsyncClient(timeout=60) as http:
        for key, values in WRONG_TYPES.items():
            for value in values:
                body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, key: value}}
                if gate(body) is None:
                    continue  # the gate takes it: nothing to match
                checked += 1
                r = await http.post(f"{warm_engine}/generate", json=body)
                assert r.status_code == 400, (key, value, r.status_code, r.text[:300])
    assert checked >= 20, checked


async def test_the_routing_replay_bodies_are_ones_every_release_accepts(tmp_path, releases):
    """Issue 66 N11: the /generate bodies of the rollout's R3 path (``return_routed_experts`` and a
    ``routed_experts_start_len`` from the rows held: ``rollout_service.agent.routes``), recorded in
    front of a local engine serving a MoE model with routes, against every release."""
    from transformers import AutoConfig

    from asyncrl.engine_client import EngineClient
    from asyncrl.models import load_model
    from rollout_service.agent.routes import RouteShape, extend_routes, route_request
    from rollout_service.agent.state import AgentState
    from tests.helpers.processes import start_engine

    load_model("builtin:tiny-moe").config.save_pretrained(tmp_path / "config")
    shape = RouteShape.of(AutoConfig.from_pretrained(tmp_path / "config"))
    state = AgentState(id="r3", run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                       token_ids=[5, 6, 7, 8], prompt_length=4)
    with start_engine(tmp_path, "--enable-return-routed-experts", model="builtin:tiny-moe", name="moe") as engine:
        proxy = await RecordingProxy(engine.url).start()
        try:
            async with EngineClient(proxy.url) as client:
                for budget in (4, 3):  # a turn, then the next one asking from the rows held
                    res = await client.generate(state.token_ids, {"max_new_tokens": budget, "temperature": 0.0},
                                                extra=route_request(state))
                    extend_routes(state, res, shape)
                    state.token_ids += res.output_ids + [9]  # a tool's token: computed first by the next call
        finally:
            await proxy.stop()
    bodies = [body for method, path, _, body in proxy.requests if (method, path) == ("POST", "/generate")]
    assert [b["routed_experts_start_len"] for b in bodies] == [0, 4 + 4 - 1] and all(b["return_routed_experts"] for b in bodies)
    problems = [f"sglang {release}: {problem} in {body!r:.300}" for release in releases for body in bodies
                for problem in kit.check_request(release, "POST", "/generate", body)]
    assert not problems, "\n".join(problems)
