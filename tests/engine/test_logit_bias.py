"""logit_bias: validated with the sampling parameters, checked against the vocabulary at admission, and added
in the sampler to the rows that carry it only."""

from __future__ import annotations

import pytest
import torch

from minibatch.engine.core.admission import RequestRejected, check_request
from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.request import Request
from minibatch.engine.core.sampling_params import InvalidParameterError, SamplingParams
from minibatch.engine.runner.sampler import Sampler


def test_bias_is_added_to_its_own_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(4, 500)
    plain = Request("plain", [1], SamplingParams(temperature=0))
    lifted = Request("lifted", [1], SamplingParams(temperature=0, logit_bias={7: 100.0}))
    banned_top = int(logits[2].argmax())
    banned = Request("banned", [1], SamplingParams(temperature=0, logit_bias={banned_top: -100.0}))
    drawn = Request("drawn", [1], SamplingParams(temperature=1.0, seed=5, logit_bias={321: 100.0}))
    before = logits.clone()
    got = Sampler()(logits, [plain, lifted, banned, drawn])
    second = before[2].clone()
    second[banned_top] -= 100
    assert got == [int(before[0].argmax()), 7, int(second.argmax()), 321]
    assert got[2] != banned_top


def test_bias_keeps_a_grammar_ban():
    class AllowOnly:
        def fill_mask(self, words):
            words[:] = 0
            words[0] = 1 << 3  # token 3 only

    req = Request("g", [1], SamplingParams(temperature=0, logit_bias={4: 100.0}, grammar=AllowOnly()))
    assert Sampler()(torch.zeros(1, 64), [req]) == [3]


@pytest.mark.parametrize(
    "bias, message",
    [
        ({5: 100.5}, r"logit_bias.5: must be in \[-100, 100\]"),
        ({5: float("nan")}, "logit_bias.5: must be a finite number"),
        ({-1: 1.0}, "keys must be token ids"),
        ({i: 1.0 for i in range(301)}, "at most 300"),
    ],
)
def test_bad_bias_names_the_entry(bias, message):
    with pytest.raises(InvalidParameterError, match=message):
        SamplingParams(logit_bias=bias)


def test_admission_checks_token_ids_against_the_vocabulary():
    config, blocks = SchedulerConfig(max_model_len=64, vocab_size=100), BlockManager(32, 4)
    check_request(Request("ok", [0, 99], SamplingParams(max_tokens=4, logit_bias={99: 1.0})), config, blocks)
    with pytest.raises(RequestRejected, match=r"token id 100 is out of range \[0, 100\)") as refused:
        check_request(Request("p", [5, 100], SamplingParams(max_tokens=4)), config, blocks)
    assert (refused.value.field, refused.value.code, refused.value.status) == ("prompt.1", "invalid_token", 400)
    with pytest.raises(RequestRejected, match=r"token id 100 is out of range") as refused:
        check_request(Request("b", [5], SamplingParams(max_tokens=4, logit_bias={100: 1.0})), config, blocks)
    assert refused.value.field == "logit_bias.100"
