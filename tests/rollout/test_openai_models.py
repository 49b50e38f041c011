"""Which ``model`` a request may name: the served name and its aliases; anything else is
OpenAI's 404 ``model_not_found``, unless ``api.accept_any_model`` keeps the permissive behaviour."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from asyncrl.http.errors import ApiError
from rollout_service.openai.handlers import check_model, served_model_name, served_models


def svc(*overrides: str):
    """The part of an OpenAIContext model checks read: the api section, the served name, model.path."""
    cfg = load_config(overrides=["model.path=builtin:tiny", *overrides], environ={})
    return SimpleNamespace(api=cfg.api, model_path=cfg.model.path, model_name=served_model_name(cfg.api, cfg.model))


def test_served_name_and_aliases_only():
    s = svc("api.model_name=policy", 'api.model_aliases=["p", "policy"]')
    assert served_models(s) == ["policy", "p"]
    for ok in ("policy", "p", None):
        check_model(s, ok)
    with pytest.raises(ApiError) as err:
        check_model(s, "gpt-4o")
    assert err.value.status == 404 and err.value.extra == {"code": "model_not_found"} and err.value.param == "model"
    check_model(svc("api.accept_any_model=true"), "gpt-4o")
    check_model(svc(), "builtin:tiny")  # no api.model_name: a builtin spec is the served name


def test_the_served_name_never_shows_where_the_weights_lie():
    s = svc("model.path=/srv/models/Qwen2.5-1.5B-Instruct/")
    assert served_models(s) == ["Qwen2.5-1.5B-Instruct"] and s.model_name == "Qwen2.5-1.5B-Instruct"
    check_model(s, "/srv/models/Qwen2.5-1.5B-Instruct/")  # still served when a client names the path, but never listed
    assert served_models(svc("model.path=builtin:smollm2-135m")) == ["builtin:smollm2-135m"]


def test_a_template_failure_is_a_template_error_naming_the_reason():
    from asyncrl.chat import ChatTokenizer, TemplateError
    from asyncrl.models import load_tokenizer

    bad = [{"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object", "properties": "x"}}}]
    with pytest.raises(TemplateError, match="could not render the request: UndefinedError"):
        ChatTokenizer(load_tokenizer("builtin:tiny"), bad)  # the app answers it with a 400 (rollout_service/app.py)
