"""A model's own sampling defaults fill only the fields a request leaves out."""

from __future__ import annotations

from minibatch.daemon.protocol import ChatRequest

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_omitted_fields_take_the_models_defaults():
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    p = body.sampling_params(100, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert body.sampling_params(100).temperature == 1.0  # no model defaults: the API's


def test_fields_the_request_gives_win_even_when_equal_to_the_api_default():
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_k": -1})
    p = body.sampling_params(100, DEFAULTS)
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 0.9)
