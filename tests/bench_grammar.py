"""Micro-benchmark: the grammar's cost per token in the orchestrator's per-step work, on a real vocabulary.

    python tests/bench_grammar.py [tokenizer.json] [temperature top_p]

(defaults: SmolLM2-135M-Instruct's tokenizer from the model cache; temperature 0.7, top_p 0.95; 0: greedy)

Per step and session the orchestrator runs the LM head (hidden 576 x vocab 49,152 for SmolLM2) and the
session's :class:`~swarm.engine.sampling.TokenChooser` (bias, penalties, temperature/top-p sampling). With a
grammar it also computes every constrained session's token mask (all sessions at once: llguidance's thread
pool) and applies it. Reported, per token: unconstrained, constrained with the masks computed in the step
(serial), and the masks alone — in the batched path the masks are computed while the step's messages
travel through the chain, so only applying them is on the critical path. Best of 5 runs; every session
follows a valid JSON text of a pydantic-like schema (the sampler is steered to it), so the mask work is the
real one. Needs torch, numpy and llguidance only (no transformers).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.engine.grammar import Grammar, GrammarMatcher, fill_masks, json_schema_grammar  # noqa: E402
from swarm.engine.sampling import SamplingParams, TokenChooser  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "country": {"type": "string"},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["name", "country", "population", "landmarks"], "additionalProperties": False}
TEXTS = [{"name": "Paris", "country": "France", "population": 2102650,
          "landmarks": ["Eiffel Tower", "Louvre", "Notre-Dame"]},
         {"name": "Tokyo", "country": "Japan", "population": 13960000, "landmarks": ["Senso-ji", "Tokyo Tower"]}]
HIDDEN = 576


def main(path: str, temperature: float = 0.7, top_p: float = 0.95) -> None:
    import llguidance

    tokenizer = llguidance.LLTokenizer(Path(path).read_text())
    vocab = tokenizer.vocab_size
    source = json_schema_grammar(SCHEMA)
    error = llguidance.LLMatcher.validate_grammar(source, tokenizer)
    assert not error, error
    grammar = Grammar(source, tokenizer)
    texts = [tokenizer.tokenize_str(json.dumps(t)) + [tokenizer.eos_token] for t in TEXTS]
    head = torch.randn(vocab, HIDDEN) / 24
    print(f"temperature {temperature}, top_p {top_p}; vocab {vocab}, torch threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}, {sum(map(len, texts))} tokens per run")
    for sessions in (1, 16):
        best: dict = {}
        for _ in range(5):
            for mode in ("free", "constrained", "masks only"):
                took, count = 0.0, 0
                for ids in texts:
                    choosers = [TokenChooser(SamplingParams(200, temperature=temperature, top_p=top_p, seed=i,
                                                            grammar=grammar if mode == "constrained" else None),
                                             vocab) for i in range(sessions)]
                    matchers = [GrammarMatcher(grammar) for _ in range(sessions)] if mode == "masks only" else []
                    hidden = torch.randn(sessions, HIDDEN)
                    for token in ids:
                        started = time.perf_counter()
                        if mode == "masks only":
                            fill_masks(matchers)
                            for m in matchers:
                                m.allowed(vocab)
                                m.consume(token)
                        else:
                            if mode == "constrained":
                                TokenChooser.prepare(choosers)
                            logits = hidden @ head.T
                            logits[:, token] += 50.0  # steer the sampler to the text's token
                            for row, chooser in enumerate(choosers):
                                chooser(torch.tensor([[0]]), logits[row: row + 1])
                        took += time.perf_counter() - started
                        count += sessions
                best[mode] = min(best.get(mode, float("inf")), took / count * 1e3)
        free, bound = best["free"], best["constrained"]
        print(f"{sessions:2d} sessions: unconstrained {free:.3f} ms/token, constrained {bound:.3f} ms/token "
              f"(+{(bound / free - 1) * 100:.1f}%), masks alone {best['masks only']:.3f} ms/token "
              f"(+{best['masks only'] / free * 100:.1f}% if not overlapped with the step)")


if __name__ == "__main__":
    default = Path.home() / ".cache/chainswarm/models/smollm2-135m-instruct-float32/tokenizer.json"
    main(sys.argv[1] if len(sys.argv) > 1 else str(default), *map(float, sys.argv[2:4]))
