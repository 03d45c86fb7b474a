"""The chain's ends on the servers (server.ends, swarm.engine.multi_wire's ids/sample/choose, swarm.engine.sampling's
choose_step and wire specs): the same arithmetic and the same choices as the orchestrator's own head."""
import pytest
import torch

from swarm.engine import multi_wire
from swarm.engine.sampling import (SamplingParams, TokenChooser, choose_step, logprob_from_wire, logprob_to_wire,
                                   sampling_from_wire, sampling_to_wire)

VOCAB = 97


def _scores(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("params", [
    SamplingParams(8, temperature=0.0),
    SamplingParams(8, temperature=0.8, seed=11, top_k=20, top_p=0.9, min_p=0.01),
    SamplingParams(8, temperature=1.2, seed=-5, presence_penalty=0.7, frequency_penalty=0.3,
                   logit_bias=((3, 5.0), (7, -100.0)), repetition_penalty=1.3, logprobs=3, min_tokens=2,
                   eos_token_ids=(1,)),
], ids=["greedy", "seeded", "penalties"])
def test_a_chooser_sent_over_the_wire_chooses_what_the_original_chooses(params):
    """A request's chooser, and one built on the last server from its wire spec after the first three tokens
    (the history replayed), choose the same tokens and logprobs, drafts or not."""
    prompt = [5, 9, 9, 40]
    here = TokenChooser(params, VOCAB)
    steps = [(_scores(1, i), []) for i in range(3)] + [(_scores(3, 10 + i), [4, 8]) for i in range(4)]
    produced = []
    for scores, draft in steps[:3]:
        produced += list(choose_step(here, prompt + produced, scores, draft, 100, None))
    spec = sampling_to_wire(params, params.seed if params.seed is not None else 123, here.generated, prompt, eos=1)
    there, context, eos = sampling_from_wire(spec, VOCAB)
    assert context == (prompt if params.repetition_penalty != 1.0 else []) and eos == 1
    for scores, draft in steps[3:]:
        mine = list(choose_step(here, prompt + produced, scores, draft, 100, None))
        before = len(there.logprobs)
        theirs = list(choose_step(there, context, scores, draft, 100, None))
        assert theirs == mine
        if params.logprobs is not None:
            sent = [logprob_from_wire(logprob_to_wire(e), VOCAB) for e in there.logprobs[before:]]
            assert [(e.token_id, e.logprob, e.top) for e in sent] == \
                [(e.token_id, e.logprob, e.top) for e in here.logprobs[-len(mine):]]
        produced += mine
    assert there.generated == here.generated


def test_choose_step_accepts_drafts_while_they_are_the_choice_and_stops_at_eos_and_left():
    scores = torch.full((4, VOCAB), -10.0)
    for row, token in enumerate([4, 8, 6, 2]):
        scores[row, token] = 10.0
    assert list(choose_step(None, [], scores, [4, 8, 9], 100, None)) == [4, 8, 6]  # the third draft is not the argmax
    assert list(choose_step(None, [], scores, [4, 8, 6], 100, None)) == [4, 8, 6, 2]  # all kept, and the next one
    assert list(choose_step(None, [], scores, [4, 8, 6], 2, None)) == [4, 8]  # two tokens left
    assert list(choose_step(None, [], scores, [4, 8, 6], 100, 8)) == [4, 8]  # the end-of-sequence token


def test_greedy_specs_and_malformed_specs():
    assert sampling_from_wire({"greedy": True, "eos": 2}, VOCAB) == (None, [], 2)
    good = sampling_to_wire(SamplingParams(4, temperature=0.5, seed=1), 1)
    for key, value, field in [("seed", "x", "seed"), ("temperature", -1, "temperature"), ("top_p", 2, "top_p"),
                              ("bias", [[VOCAB, 1.0]], "bias"), ("generated", [VOCAB], "generated"),
                              ("logprobs", 99, "logprobs"), ("top_k", -3, "top_k"), ("eos", "a", "eos")]:
        with pytest.raises(ValueError, match=field):
            sampling_from_wire({**good, key: value}, VOCAB)
    with pytest.raises(ValueError, match="no tokenizer"):
        sampling_from_wire({**good, "grammar": "{}"}, VOCAB)


def test_a_grammar_travels_as_its_source_and_constrains_the_same_tokens(tiny_model):
    """A constrained request's chooser rebuilt on the last server from the grammar's source (compiled for its own
    copy of the tokenizer) allows and chooses exactly what the original does, after a replayed history too."""
    from swarm.engine.grammar import compile_grammar, json_schema_grammar
    from swarm.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    vocab = len(tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = compile_grammar(json_schema_grammar(schema), tokenizer)
    params = SamplingParams(16, temperature=0.7, seed=3, grammar=grammar)
    here = TokenChooser(params, vocab)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        list(choose_step(here, [], torch.randn(1, vocab, generator=generator), [], 100, None))
    spec = sampling_to_wire(params, 3, here.generated)
    assert spec["grammar"] == grammar.source
    there, _, _ = sampling_from_wire(spec, vocab, lambda: load_tokenizer(tiny_model))
    for _ in range(6):
        scores = torch.randn(1, vocab, generator=generator)
        assert list(choose_step(there, [], scores, [], 100, None)) == list(choose_step(here, [], scores, [], 100, None))
    assert there.generated == here.generated
    text = tokenizer.decode(here.generated)
    assert text.startswith('{"n": ') or text.startswith("{"), text  # inside the grammar


def test_the_wire_carries_ids_samples_and_chooses_and_refuses_what_does_not_fit():
    meta = multi_wire.encode([multi_wire.Open("a", 64)], [("a", 5, 0), ("b", 3, 0)], ids=["a", "b"],
                             samples={"a": {"greedy": True, "eos": None}}, chooses={"a": ([], 4), "b": ([7, 8], 2)},
                             keeps=["b"])
    request = multi_wire.decode(meta, 2)
    assert request.keeps == {"b"}  # its hidden states come back with its tokens (a spot check records them)
    assert request.ids == {"a", "b"} and request.samples == {"a": {"greedy": True, "eos": None}}
    assert request.chooses == {"a": ((), 4), "b": ((7, 8), 2)}
    plain = multi_wire.encode([], [("a", 1, 0)])
    assert "ids" not in plain and "choose" not in plain  # what servers before these keys understood
    for bad, why in [({"ids": ["zz"]}, "does not step"), ({"choose": {"b": [[1, 2, 3], 1]}}, "a draft of 3"),
                     ({"choose": {"b": [[1], 0]}}, "left >= 1"), ({"choose": {"b": [[-1], 1]}}, "left >= 1"),
                     ({"sample": {"b": 3}}, "sampling spec"), ({"keep": ["b"]}, "'keep' lists")]:
        with pytest.raises(multi_wire.MultiWireError, match=why):
            multi_wire.decode({**plain, "step": [["b", 3]], **bad}, 1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_servers_ends_compute_the_local_references_embeddings_and_head(family, tmp_path):
    """server.ends.ChainEnds against Chainswarm's whole-model reference (swarm.model.local_model, which the family
    goldens check; Gemma 3: the scaled embedding, the (1 + w) norm and the tied head), bit for bit in float32. (The
    orchestrator's own head against the servers': the swarm test in test_chain_ends_swarm.py.)"""
    from server.ends import ChainEnds, ends_bytes
    from swarm.model.checkpoint import TinyModelSpec, make_random_model
    from swarm.model.local_model import LocalModel, read_config

    model_dir = make_random_model(tmp_path / family, TinyModelSpec(seed=3, family=family))
    reference = LocalModel.from_pretrained(model_dir)
    both = ChainEnds(model_dir, first=True, last=True, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 33]])
    with torch.inference_mode():
        assert torch.equal(both.embed(ids), reference.embed(ids))
        hidden = torch.randn(6, both.hidden_size)
        assert torch.equal(both.logits(hidden), reference.logits(hidden).float())
    cfg = read_config(model_dir)
    assert both.nbytes == ends_bytes(cfg, True, True, 4)
    last = ChainEnds(model_dir, first=False, last=True, dtype=torch.float32)
    assert last.embedding is None and last.nbytes == ends_bytes(cfg, False, True, 4)
    with pytest.raises(ValueError, match="block 0"):
        last.embed(ids)
    with pytest.raises(ValueError, match=r"\[0, "):
        both.embed(torch.tensor([[both.vocab_size]]))
    assert ends_bytes(cfg, True, False, 4) == both.vocab_size * both.hidden_size * 4
    assert both.spec.tie_word_embeddings == (family == "gemma3")
