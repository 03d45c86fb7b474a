"""swarm.engine.sampling: token choice on real logits (bias, penalties, seeded sampling, top-p, logprobs) and stop
strings matched across token boundaries."""
import math

import pytest
import torch

from swarm.engine.sampling import SamplingParams, StopMatcher, TokenChooser


def step(chooser, logits):
    scores = torch.tensor([logits], dtype=torch.float32)
    forced = chooser(torch.zeros(1, 1, dtype=torch.long), scores)
    choice = int(torch.argmax(forced))
    assert forced[0, choice] == 0 and torch.isinf(forced).sum() == len(logits) - 1  # all mass on one token
    return choice


def test_temperature_zero_is_argmax_and_logprobs_are_the_models_own():
    chooser = TokenChooser(SamplingParams(4, temperature=0, logprobs=2), vocab_size=4)
    logits = [1.0, 3.0, 2.0, -1.0]
    assert step(chooser, logits) == 1
    expected = torch.log_softmax(torch.tensor(logits), -1)
    record = chooser.logprobs[0]
    assert record.token_id == 1 and math.isclose(record.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in record.top] == [1, 2] and math.isclose(record.top[1][1], float(expected[2]), rel_tol=1e-6)


def test_a_vanishing_temperature_is_greedy_not_nan():
    chooser = TokenChooser(SamplingParams(4, temperature=2.2e-313, seed=0), vocab_size=4)  # found by schemathesis
    assert step(chooser, [1.0, 3.0, 2.0, -1.0]) == 1


def test_logit_bias_and_penalties_change_the_choice():
    biased = TokenChooser(SamplingParams(4, temperature=0, logit_bias=((3, 10.0),)), vocab_size=4)
    assert step(biased, [1.0, 3.0, 2.0, -1.0]) == 3
    penalised = TokenChooser(SamplingParams(4, temperature=0, frequency_penalty=0.6), vocab_size=4)
    logits = [1.0, 3.0, 2.5, -1.0]
    # frequency: each use costs 0.6 again (3 - 0.6 < 2.5; 2.5 - 0.6 < 2.4; 3 - 1.2 < 1.9)
    assert [step(penalised, logits) for _ in range(4)] == [1, 2, 1, 2]
    present = TokenChooser(SamplingParams(4, temperature=0, presence_penalty=1.0), vocab_size=4)
    # presence: a used token costs 1.0 once, however often it was used (3 - 1 = 2 > 2.5 - 1 at the 4th step)
    assert [step(present, logits) for _ in range(4)] == [1, 2, 1, 1]


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)).tolist()

    def sample(seed):
        chooser = TokenChooser(SamplingParams(32, temperature=1.5, seed=seed), vocab_size=64)
        return [step(chooser, logits) for _ in range(32)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_top_p_keeps_only_the_nucleus():
    logits = [5.0, 4.9, 0.0, 0.0, 0.0, 0.0]  # the first two hold ~97% of the mass
    chooser = TokenChooser(SamplingParams(200, temperature=1.0, top_p=0.9, seed=1), vocab_size=6)
    assert {step(chooser, logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("pieces, stops, sent, stopped", [
    (["Hello", " wor", "ld", "!"], ("world",), "Hello ", True),  # across token boundaries, never in the text
    (["a", "b", "END", "c"], ("END", "b"), "a", True),  # the earliest stop string wins
    (["The answer", " is 4", "2."], ("\n\n",), "The answer is 42.", False),
])
def test_stop_strings(pieces, stops, sent, stopped):
    matcher, text, out, done = StopMatcher(stops), "", "", False
    for piece in pieces:
        text += piece
        safe, done = matcher.check(text)
        assert safe.startswith(out) and not any(s in safe for s in stops)
        out = safe
        if done:
            break
    assert (out, done) == (sent, stopped)


def test_a_possible_stop_prefix_is_held_back_until_it_is_decided():
    matcher = StopMatcher(("###",))
    assert matcher.check("result #") == ("result ", False)
    assert matcher.check("result ##") == ("result ", False)
    assert matcher.check("result ##x") == ("result ##x", False)
