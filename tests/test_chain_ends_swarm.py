"""The chain's ends on a live two-hop swarm of the tiny model: token ids to the first server, token ids back from the
last (server/ends.py, server/multi_session.py, swarm/engine/batching.py).

The same route is driven by two ChainGenerators, one that runs the embeddings, head and choice itself (the
orchestrator's earlier design, ``--token-choice orchestrator``) and one that lets the servers do it: greedy,
seeded sampling with penalties, bias and logprobs, a JSON schema's grammar (compiled on the last server from its
source) and verified drafts give the same tokens, and logprobs within
1e-4 (both sides run the same arithmetic; a step's batch mates move the last bits of a block's output). A server asked for an end it does not hold
fails that session alone, with the reason.
"""
import pytest
import torch

from helpers import client_model, server_info, two_hop_tiny_swarm

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def swarm(tiny_model, tmp_path_factory):
    with two_hop_tiny_swarm(tiny_model, str(tmp_path_factory.mktemp("profiles"))) as local:
        yield local


@pytest.fixture(scope="module")
def model(swarm, tiny_model):
    with client_model(swarm, tiny_model) as m:
        yield m


class _Drafts:
    """Drafts that repeat the sequence's last tokens (some accepted, some not), the same for both generators."""

    def __init__(self):
        self.kept = []

    def propose(self, ids, k):
        return list(ids[-k:]) if k > 0 else []

    def update(self, drafted, accepted):
        self.kept.append((drafted, accepted))


PROMPTS = [[1, 17, 33, 50, 9], [4, 4, 4, 4, 4, 4, 4, 8], [90, 3]]


def _generate(model, route, ends: bool, make_processor, drafts: bool):
    from swarm.engine.batching import ChainGenerator

    with ChainGenerator(model, route, max_sessions=4, ends=ends, step_positions=8) as generator:
        runs = []
        for i, prompt in enumerate(PROMPTS):
            processor = make_processor(i)
            runs.append((generator.submit(prompt, 12, processor=processor, eos_token_id=None,
                                          drafts=_Drafts() if drafts else None), processor))
        tokens = [future.result(timeout=120) for future, _ in runs]
        logprobs = [[(e.token_id, e.logprob, e.top) for e in p.logprobs] if p is not None else None
                    for _, p in runs]
        return tokens, logprobs, generator.chosen_steps


def _sampled(i):
    from swarm.engine.sampling import SamplingParams, TokenChooser

    return TokenChooser(SamplingParams(12, temperature=0.9, seed=100 + i, top_k=40, top_p=0.95, min_p=0.02,
                                       presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.2,
                                       logit_bias=((7, 2.0),), logprobs=3), 256)


_GRAMMARS: dict = {}


def _constrained(i):
    """Seeded sampling inside a JSON schema's grammar (compiled for the tiny model's tokenizer)."""
    from swarm.engine.sampling import SamplingParams, TokenChooser

    grammar = _GRAMMARS["grammar"]
    return TokenChooser(SamplingParams(12, temperature=0.8, seed=7 + i, grammar=grammar, logprobs=1), 1024)


@pytest.fixture(scope="module", autouse=True)
def _grammar(tiny_model):
    from swarm.engine.grammar import compile_grammar, json_schema_grammar
    from swarm.model.tokenizer import load_tokenizer

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    _GRAMMARS["grammar"] = compile_grammar(json_schema_grammar(schema), load_tokenizer(tiny_model))


@pytest.mark.parametrize("make_processor, drafts", [
    (lambda i: None, False), (lambda i: None, True), (_sampled, False), (_sampled, True), (_constrained, False),
], ids=["greedy", "greedy-drafts", "sampled", "sampled-drafts", "constrained"])
def test_tokens_chosen_by_the_servers_equal_the_orchestrators_own(swarm, model, make_processor, drafts):
    here = _generate(model, swarm.route, False, make_processor, drafts)
    there = _generate(model, swarm.route, True, make_processor, drafts)
    assert here[2] == 0 and there[2] > 0  # the second really let the last server choose
    assert there[0] == here[0] and all(0 < len(t) <= 12 for t in there[0])
    for mine, theirs in zip(here[1], there[1]):  # a step's batch mates move the last float bits of a block's output
        if mine is None:
            assert theirs is None
            continue
        assert [(t, [i for i, _ in top]) for t, _, top in theirs] == [(t, [i for i, _ in top]) for t, _, top in mine]
        for (_, lp, top), (_, lp_mine, top_mine) in zip(theirs, mine):
            assert lp == pytest.approx(lp_mine, abs=1e-4)
            assert [v for _, v in top] == pytest.approx([v for _, v in top_mine], abs=1e-4)


def test_the_servers_count_what_they_embedded_and_chose(swarm, model):
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker  # noqa: F401

    p2p = model.transformer.h.sequence_manager.state.p2p
    uids = model.transformer.h.sequence_manager.block_uids
    counts = [server_info(p2p, peer, uids[start])["chainswarm_multi"] for peer, start, _ in swarm.route]
    _generate(model, swarm.route, True, lambda i: None, False)
    after = [server_info(p2p, peer, uids[start])["chainswarm_multi"] for peer, start, _ in swarm.route]
    assert after[0]["embedded"] - counts[0]["embedded"] >= 3 * 12  # every step's ids, on the first server
    assert after[1]["chosen"] - counts[1]["chosen"] >= 3 * 12  # every step's tokens, on the last
    assert after[0]["chosen"] == counts[0]["chosen"] and after[1]["embedded"] == counts[1]["embedded"]


def test_a_server_asked_for_an_end_it_does_not_hold_fails_that_session_alone(swarm, model):
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    from swarm.engine import multi_wire
    from swarm.engine.multi_client import _Stream

    manager = model.transformer.h.sequence_manager
    hidden = model.config.hidden_size

    def exchange(span, metadata, tensors):
        peer, start, end = span
        stream = _Stream(manager.state.p2p, peer, manager.block_uids[start:end], span)
        return RemoteExpertWorker.run_coroutine(stream.exchange(metadata, tensors, 20.0))

    first, last = swarm.route
    opens = [multi_wire.Open("a", 16), multi_wire.Open("b", 16)]
    # the first server holds no head: "a" asks it to choose, "b" is a plain step
    outputs, failed = exchange(first, multi_wire.encode(opens, [("a", 2), ("b", 2)], ids=["a", "b"],
                                                        chooses={"a": ([], 3)}),
                               [torch.tensor([[1, 2]]), torch.tensor([[3, 4]])])
    assert set(failed) == {"a"} and "last block" in failed["a"] and [o.shape for o in outputs] == [(1, 2, hidden)]
    # the last server embeds nothing: "a" sends it ids; a malformed sampling spec fails "b" alone
    outputs, failed = exchange(last, multi_wire.encode(opens, [("a", 2), ("b", 1)], ids=["a"],
                                                       samples={"b": {"seed": "x"}}, chooses={"b": ([], 2)}),
                               [torch.tensor([[1, 2]]), torch.randn(1, 1, hidden)])
    assert set(failed) == {"a", "b"} and "block 0" in failed["a"] and "seed" in failed["b"]
    assert outputs == []
