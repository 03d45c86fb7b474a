"""The acceptance rule of speculative decoding (swarm.engine.speculative): greedy equality and, for sampled
requests, the emitted tokens' distribution (a chi-square test over many seeds) and a seeded request's tokens,
which no draft changes."""
import dataclasses
from concurrent.futures import Future

import torch
from scipy.stats import chisquare

from swarm.engine.batching import Decoding, emit_verified
from swarm.engine.sampling import SamplingParams, TokenChooser


def verify(rows, draft, chooser=None, produced=(7,)):
    """One verification step through emit_verified (the path requests take): (emitted tokens, rollback)."""
    seq = Decoding("s0", [1, 2], 10, None, None, chooser, None, Future(), produced=list(produced))
    seq.draft = list(draft)
    emit_verified(seq, rows)
    return seq.produced[len(produced):], seq.rollback


def test_greedy_accepts_while_the_draft_is_the_argmax_and_continues_with_the_models_token():
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.0, 0.2, 0.7], [0.3, 0.3, 0.4]])
    for chooser in (None, TokenChooser(SamplingParams(10, temperature=0.0), 3)):
        assert verify(scores, [1, 0, 2], chooser) == ([1, 0, 2, 2], 0)  # all accepted; the bonus from the last row
        assert verify(scores, [1, 2, 2], chooser) == ([1, 0], 2)  # rejected at position 1: the model's token
        assert verify(scores[:1], [], chooser) == ([1], 0)  # no draft: one ordinary step


def test_sampled_tokens_keep_the_models_distribution():
    """Draft a token the model finds unlikely and one it finds likely: either way the first emitted token is
    distributed as p_0, and the second (when the first was accepted) as p_1 — over requests of different seeds."""
    p0 = torch.tensor([0.1, 0.5, 0.15, 0.25])
    p1 = torch.tensor([0.4, 0.1, 0.3, 0.2])
    rows = torch.stack([p0, p1, p1]).log()
    draws = 8_000
    for draft in ([0, 2], [1, 0]):
        first, second = torch.zeros(4), torch.zeros(4)
        for seed in range(draws):
            emitted, _ = verify(rows, draft, TokenChooser(SamplingParams(10, temperature=1.0, seed=seed), 4))
            first[emitted[0]] += 1
            if emitted[0] == draft[0]:
                second[emitted[1]] += 1
        assert chisquare(first.numpy(), (p0 * draws).numpy()).pvalue > 1e-3, (draft, first)
        assert chisquare(second.numpy(), (p1 * second.sum()).numpy()).pvalue > 1e-3, (draft, second)


def test_sampled_acceptance_is_reproducible_from_the_requests_seed():
    rows = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    runs = [verify(rows, [3, 7, 9], TokenChooser(SamplingParams(10, temperature=1.0, seed=42), 50)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_a_seeded_request_emits_the_same_tokens_whatever_was_drafted():
    """The tokens of a seeded sampled request chosen one per step, and the same request's verification steps with
    drafts that are right, wrong at some position, or out of the vocabulary: every step emits a prefix of the
    same tokens (the drafts change how many come per step, never which)."""
    vocab = 40
    rows = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 0.5  # flat: most drafts fail
    params = SamplingParams(10, temperature=1.0, top_p=0.95, seed=2024)
    alone = TokenChooser(params, vocab)
    expected = [alone.choose(torch.tensor([[0]]), rows[i:i + 1])[0] for i in range(5)]
    drafts = [expected[:4], expected[:2] + [(expected[2] + 1) % vocab, expected[3]], [(expected[0] + 1) % vocab],
              [vocab + 5, 1], [], expected[:1]]
    for draft in drafts:
        emitted, rollback = verify(rows[:len(draft) + 1], draft, TokenChooser(params, vocab), produced=())
        assert emitted == expected[:len(emitted)], (draft, emitted, expected)
        kept = next((i for i, (d, e) in enumerate(zip(draft, expected)) if d != e), len(draft))
        assert len(emitted) == kept + 1 and rollback == len(draft) - kept


def test_a_request_choosers_draft_rule_keeps_its_sampling_distribution_with_top_k_and_penalties():
    """TokenChooser.choose with a drafted token (what the engine's verification step calls per position): with
    temperature, top_k and a presence penalty, the emitted token is distributed as the chooser's own distribution
    whichever token was drafted — also a token top_k cut (never accepted) — over requests of different seeds."""
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.5, -1.0]])
    params = SamplingParams(1, temperature=0.8, top_k=4, presence_penalty=0.7, seed=7)
    reference = TokenChooser(params, 5)
    reference.generated = [3]
    expected = reference._probs(reference._adjusted(torch.tensor([[0]]), logits[0])[0])
    expected = expected / expected.sum()
    assert expected[4] == 0  # cut by top_k
    draws = 6000
    for draft in (1, 2, 4):
        counts, accepted = torch.zeros(5), 0
        for seed in range(draws):
            chooser = TokenChooser(dataclasses.replace(params, seed=seed), 5)
            chooser.generated = [3]  # the same context every draw
            token, ok = chooser.choose(torch.tensor([[0]]), logits, draft)
            counts[token] += 1
            accepted += ok
        assert counts[4] == 0
        keep = expected > 0
        assert chisquare(counts[keep].numpy(), (expected[keep] * draws).numpy()).pvalue > 1e-3, (draft, counts)
        assert abs(accepted / draws - float(expected[draft])) < 0.03


def test_greedy_choosers_accept_exactly_the_argmax_and_record_each_token_once():
    chooser = TokenChooser(SamplingParams(4, temperature=0.0, logprobs=1), 3)
    scores = torch.tensor([[0.1, 0.9, 0.0]])
    assert chooser.choose(torch.tensor([[0]]), scores, 1) == (1, True)
    assert chooser.choose(torch.tensor([[0]]), scores, 2) == (1, False)
    assert chooser.generated == [1, 1] and [lp.token_id for lp in chooser.logprobs] == [1, 1]


def test_a_verification_step_emits_the_accepted_drafts_and_leaves_the_rejected_positions_to_roll_back():
    """ChainGenerator's choice over a step's k + 1 rows (greedy): the accepted prefix, then the model's own token;
    the positions to take back are the rejected drafts' — also when the sequence ends inside the draft (its
    end-of-sequence token drafted and accepted), so that a spot check's recording holds exactly its positions."""
    from swarm.engine.recording import SpanRecorder

    def sequence(draft, eos=None, max_new=10):
        seq = Decoding("s0", [1, 2], max_new, eos, None, None, None, Future(), produced=[7])
        seq.draft = list(draft)
        return seq

    rows = torch.full((4, 10), -1.0)
    for i, best in enumerate([3, 4, 9, 5]):  # the model's argmax after 0, 1, 2, 3 drafts
        rows[i, best] = 1.0
    seq = sequence([3, 4, 6])  # the third draft is wrong: 3, 4 kept, then the model's 9
    assert emit_verified(seq, rows) is False
    assert seq.produced == [7, 3, 4, 9] and seq.rollback == 1
    seq = sequence([3, 4, 9])  # all kept, plus the bonus token from the last row
    assert emit_verified(seq, rows) is False and seq.produced == [7, 3, 4, 9, 5] and seq.rollback == 0
    seq = sequence([3, 4, 9], eos=4)  # ends at the accepted draft 4: positions of 4 and 9 are not its own
    assert emit_verified(seq, rows) is True and seq.produced == [7, 3, 4] and seq.rollback == 2
    recorder = SpanRecorder([("p", 0, 2)], [("p", 0, 2)])
    recorder.add(("p", 0, 2), torch.randn(1, 2, 4), torch.randn(1, 2, 4))  # the prompt's positions (1, 2) ...
    recorder.add(("p", 0, 2), torch.randn(1, 4, 4), torch.randn(1, 4, 4))  # ... and the step's: 7 and drafts 3, 4, 9
    recorder.rollback(seq.rollback)
    assert recorder.complete(len([1, 2] + seq.produced) - 1)  # every token but the last has a position
