"""Request bodies: a model's own sampling defaults fill only the fields a request leaves out; text that is not
Unicode is refused naming its field."""

from __future__ import annotations

import pytest

from minibatch.daemon.api import anthropic, ollama, openai
from minibatch.daemon.api import responses as responses_api
from minibatch.daemon.api.openai_bodies import ChatRequest

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}


def sampling(gen, defaults=DEFAULTS):
    return gen.sampling_params(2048, 5, defaults)


def chat_body(**extra) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})


def test_omitted_fields_take_the_models_defaults():
    p = sampling(openai.chat_generation(chat_body()))
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    assert sampling(openai.chat_generation(chat_body()), {}).temperature == 1.0  # no model defaults: the API's


def test_fields_the_request_gives_win_even_when_equal_to_the_api_default():
    p = sampling(openai.chat_generation(chat_body(temperature=1.0, top_k=-1)))
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 0.9)


def each_face(**fields) -> dict:
    """The same request (`fields` in the OpenAI chat's names) as each face's parser reads it."""
    msgs = [{"role": "user", "content": "hi"}]
    ollama_opts = {
        {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}.get(k, k): v for k, v in fields.items()
    }
    anthropic_body = {"model": "m", "messages": msgs, "max_tokens": fields.get("max_tokens", 64)}
    anthropic_body |= {k: v for k, v in fields.items() if k in ("temperature", "top_p", "top_k")}
    responses_body = {"input": "hi", "max_output_tokens": fields.get("max_tokens", 64)}
    responses_body |= {k: v for k, v in fields.items() if k in ("temperature", "top_p")}
    return {
        "openai": openai.chat_generation(chat_body(**fields)),
        "ollama": ollama.generation(ollama.ChatBody.model_validate({"messages": msgs, "options": ollama_opts}), True),
        "anthropic": anthropic.generation(anthropic.MessagesRequest.model_validate(anthropic_body)),
        "responses": responses_api.generation(responses_api.ResponsesRequest.model_validate(responses_body), []),
    }


def test_the_models_defaults_apply_through_every_face():
    """A field the request leaves out takes the model's default whichever API it came through (the Anthropic
    and Responses faces once dropped the repetition penalty); what the request sets wins."""
    for face, gen in each_face(max_tokens=64).items():
        p = sampling(gen)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.05), face
        assert p.max_tokens == 64, face
    for face, gen in each_face(max_tokens=64, temperature=0.3, top_p=0.5).items():
        p = sampling(gen)
        assert (p.temperature, p.top_p, p.repetition_penalty) == (0.3, 0.5, 1.05), face


def test_a_bad_value_is_named_as_each_face_names_it():
    """SamplingParams checks every value once; the 400 names the field in the face's own terms."""
    from minibatch.daemon.protocol import ApiError

    names = {"openai": "stop", "ollama": "options.stop", "anthropic": "stop_sequences"}
    gens = {
        "openai": openai.chat_generation(chat_body(stop=["ok", ""])),
        "ollama": ollama.generation(
            ollama.ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "options": {"stop": [""]}}),
            True,
        ),
        "anthropic": anthropic.generation(
            anthropic.MessagesRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "stop_sequences": [""]}
            )
        ),
    }
    for face, gen in gens.items():
        with pytest.raises(ApiError) as err:
            sampling(gen)
        assert err.value.status == 400 and err.value.param == names[face], face
        assert err.value.message.startswith(names[face] + ": "), face


def test_lone_surrogates_are_refused_naming_the_field_and_pairs_are_text():
    from minibatch.daemon.api.openai_bodies import CompletionRequest
    from minibatch.daemon.protocol import ApiError, parse_body

    with pytest.raises(ApiError) as err:
        parse_body(b'{"prompt": "x\\ud800y"}', CompletionRequest)
    assert err.value.status == 400 and err.value.param == "prompt" and "surrogate" in err.value.message
    with pytest.raises(ApiError) as err:
        parse_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', ChatRequest)
    assert err.value.param == "messages.0.content.0.text"
    ok = parse_body(b'{"prompt": "smile \\ud83d\\ude00"}', CompletionRequest)  # a proper pair is one character
    assert ok.prompt == "smile \U0001f600"
