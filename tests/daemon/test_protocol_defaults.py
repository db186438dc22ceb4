"""Request bodies: a model's own sampling defaults fill only the fields a request leaves out; text that is not
Unicode is refused naming its field."""

from __future__ import annotations

from minibatch.daemon.protocol import ChatRequest

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_omitted_fields_take_the_models_defaults():
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    p = body.sampling_params(100, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert body.sampling_params(100).temperature == 1.0  # no model defaults: the API's


def test_fields_the_request_gives_win_even_when_equal_to_the_api_default():
    body = ChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_k": -1}
    )
    p = body.sampling_params(100, DEFAULTS)
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 0.9)


def test_lone_surrogates_are_refused_naming_the_field_and_pairs_are_text():
    import pytest

    from minibatch.daemon.protocol import ApiError, CompletionRequest, parse_body

    with pytest.raises(ApiError) as err:
        parse_body(b'{"prompt": "x\\ud800y"}', CompletionRequest)
    assert err.value.status == 400 and err.value.param == "prompt" and "surrogate" in err.value.message
    with pytest.raises(ApiError) as err:
        parse_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', ChatRequest)
    assert err.value.param == "messages.0.content.0.text"
    ok = parse_body(b'{"prompt": "smile \\ud83d\\ude00"}', CompletionRequest)  # a proper pair is one character
    assert ok.prompt == "smile \U0001f600"
