"""Drafting policies replayed offline: how many chain steps a policy needs for the benchmark's greedy answers, and
what is left to win (``python -m experiments.bench.drafting``, JSON + PNG).

A greedy answer does not depend on speculation, so the chain's work for a drafting policy follows from the answer
alone: at each step after the prompt's prefill (which carries no draft, as in the engine) the policy proposes up to
``k`` tokens, the chain accepts the longest prefix equal to the answer and adds its own next token. This replays the orchestrator's own classes (:class:`planner.drafting.Drafter`'s
prompt lookup and :class:`planner.drafting.AdaptiveK`) on the local reference's greedy answers (the demo's: local
transformers, or the block code for a family 4.34 cannot run) to ``experiments.bench.speculative``'s prompts, and counts steps, drafted and accepted tokens; the live benchmark's
1-session counts are reproduced (checked in the JSON, ``live``).

Cost model, per token against one token per step: ``(steps·t_step + drafted·t_draft) / (tokens·t_step)``, with
``t_step`` the benchmark's per-token latency without speculation and ``t_draft`` what one drafted position added
to a step in its speculative runs (least squares over its 1-session points); ``free`` is the same with
``t_draft = 0`` — verification that costs no compute, the limit of a GPU server whose step time is flat in its
positions. Policies: the product's (``ngram``), single-token matches (``ngram-min1``), a single token only where it
occurred exactly once before (``ngram-unique1``), suffixes of up to 8 tokens (``ngram-n8``), other ``k_max``, a session
whose drafts stopped probing every 16 steps instead of 4 (``ngram-probe16``, the default before 2026-11-28), one
that halves ``k`` unless at least half of a draft was accepted (``ngram-keep-half``, the default before the
partial-acceptance rule of the same day: now only a wholly rejected draft halves it), and a
**ceiling**: an oracle that drafts the longest next stretch of the answer found anywhere in the text so far — the
best any drafter copying from the prompt and output could do.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from experiments.bench.cli import model_dir
from experiments.paths import RESULTS
from planner.drafting import AdaptiveK, lookup_own

Propose = Callable[[Sequence[int], int], list]


@dataclass(frozen=True)
class NgramPolicy:
    """Prompt lookup as the orchestrator drafts: the longest suffix of ``max_n ≥ n ≥ min_n`` tokens that occurred
    before, ``k`` adapted by :class:`AdaptiveK` from ``k_max``."""

    name: str
    min_n: int = 2
    max_n: int = 4
    k_max: int = 8
    probe_every: int = AdaptiveK.probe_every  # at k = 0, one token drafted every this many steps
    keep_fraction: float = AdaptiveK.keep_fraction  # k is kept when at least this share of a draft is accepted
    unique_single: bool = False  # no n-gram match: the last token, where it occurred exactly once before, drafts

    def start(self, answer: Sequence[int], prompt_len: int) -> tuple[Propose, AdaptiveK]:
        def propose(tokens: Sequence[int], k: int) -> list:
            draft = lookup_own(tokens, k, self.max_n, self.min_n)
            if draft or not self.unique_single or k <= 0:
                return draft
            earlier = [i for i in range(len(tokens) - 1) if tokens[i] == tokens[-1]]
            return list(tokens[earlier[0] + 1:earlier[0] + 1 + k]) if len(earlier) == 1 else []
        return propose, AdaptiveK(self.k_max, self.k_max, probe_every=self.probe_every,
                                  keep_fraction=self.keep_fraction)


@dataclass(frozen=True)
class CeilingPolicy:
    """The oracle: the longest prefix of the answer's next ``k`` tokens that occurs anywhere in the text so far."""

    name: str = "ceiling"
    k_max: int = 8

    def start(self, answer: Sequence[int], prompt_len: int) -> tuple[Propose, AdaptiveK]:
        def propose(tokens: Sequence[int], k: int) -> list:
            want, text = list(answer[len(tokens) - prompt_len:][:k]), list(tokens)
            for length in range(len(want), 0, -1):
                if any(text[i:i + length] == want[:length] for i in range(len(text) - length + 1)):
                    return want[:length]
            return []
        return propose, AdaptiveK(self.k_max, self.k_max)


POLICIES = (NgramPolicy("ngram"), NgramPolicy("ngram-min1", min_n=1),
            NgramPolicy("ngram-unique1", unique_single=True), NgramPolicy("ngram-n8", max_n=8),
            NgramPolicy("ngram-k4", k_max=4),
            NgramPolicy("ngram-k16", k_max=16), NgramPolicy("ngram-probe16", probe_every=16),
            NgramPolicy("ngram-keep-half", keep_fraction=0.5), CeilingPolicy())


def replay(prompt: Sequence[int], answer: Sequence[int], policy, tokens: int) -> dict:
    """Chain steps, drafted and accepted tokens for ``answer`` (its first ``tokens``) under ``policy``."""
    tokens = min(tokens, len(answer))
    propose, adaptive = policy.start(answer, len(prompt))
    produced: list = []
    steps = drafted = accepted = 0
    while len(produced) < tokens:
        room = tokens - len(produced) - 1
        # the first step is the prompt's prefill, which carries no draft (as in the engine's both paths)
        draft = propose(list(prompt) + produced, min(adaptive.next_k(), room)) if room > 0 and produced else []
        truth = answer[len(produced):tokens]
        n = 0
        while n < len(draft) and n < len(truth) - 1 and draft[n] == truth[n]:
            n += 1
        produced += truth[:n + 1]
        steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + n
        if draft:
            adaptive.update(len(draft), n)
    return {"tokens": tokens, "steps": steps, "drafted": drafted, "accepted": accepted}


def cost_model(bench: dict) -> dict:
    """``t_step`` and ``t_draft`` (seconds) from a ``bench_speculative`` JSON's 1-session points."""
    ones = [p for p in bench["points"] if p["sessions"] == 1]
    t_step = sum(p["off"]["per_token_s"] for p in ones) / len(ones)
    pairs = [(p["on"]["drafted"], p["on"]["per_token_s"] * p["on"]["tokens"] - p["on"]["chain_steps"] * t_step)
             for p in ones if p["on"]["drafted"]]
    t_draft = max(0.0, sum(d * extra for d, extra in pairs) / sum(d * d for d, _ in pairs)) if pairs else 0.0
    return {"t_step_s": t_step, "t_draft_s": t_draft}


def ratio(counts: dict, model: dict, free: bool = False) -> float:
    t_draft = 0.0 if free else model["t_draft_s"]
    return (counts["steps"] * model["t_step_s"] + counts["drafted"] * t_draft) / (counts["tokens"] * model["t_step_s"])


def greedy_answers(path: str, workloads: Sequence[str], tokens: int, variants: int | None = None) -> dict:
    """{workload: [(prompt ids, answer ids)]}: float32 greedy answers to every prompt variant (the first
    ``variants``), ending at the
    tokenizer's end-of-sequence token as the orchestrator's do, from the demo's local reference (transformers where
    4.34 runs the family correctly, else Chainswarm's block code: :func:`experiments.live.demo.reference_generator`)."""
    from tqdm import tqdm

    from experiments.bench.speculative import prompts
    from experiments.live.demo import reference_generator
    from swarm.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    generate, _ = reference_generator(path)
    jobs = [(w, p) for w in workloads for p in prompts(w)[:variants]]
    out: dict = {w: [] for w in workloads}
    for workload, prompt in tqdm(jobs, desc="greedy answers", unit="prompt"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out[workload].append((ids[0].tolist(), generate(ids, tokens, tokenizer.eos_token_id)))
    return out


def run(answers: dict, bench: dict, tokens: int, policies=POLICIES) -> dict:
    model = cost_model(bench)
    live = {p["workload"]: p["on"] for p in bench["points"] if p["sessions"] == 1}
    rows = []
    for workload, items in answers.items():
        for policy in policies:
            counts = [replay(prompt, answer, policy, tokens) for prompt, answer in items]
            rows.append({"workload": workload, "policy": policy.name, "prompts": counts,
                         "ratio_first": ratio(counts[0], model), "ratio_mean": sum(ratio(c, model) for c in counts)
                         / len(counts), "free_first": ratio(counts[0], model, True),
                         "free_mean": sum(ratio(c, model, True) for c in counts) / len(counts)})
    check = {w: {"replayed": next(r["prompts"][0] for r in rows if r["workload"] == w and r["policy"] == "ngram"),
                 "live": {k: live[w][k] for k in ("chain_steps", "drafted", "accepted")}} for w in live if w in answers}
    return {"model": bench["model"], "tokens": tokens, "cost_model": model, "rows": rows, "live": check}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    policies = list(dict.fromkeys(r["policy"] for r in data["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "ratio_first", "this machine's cost model"),
                           (axes[1], "free_first", "verification free (flat step time)")):
        width = 0.8 / len(policies)
        for i, policy in enumerate(policies):
            values = [next(r[key] for r in data["rows"] if r["workload"] == w and r["policy"] == policy)
                      for w in workloads]
            ax.bar([x + i * width for x in range(len(workloads))], values, width, label=policy)
        ax.axhline(0.5, color="k", ls="--", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
        ax.set_title(title)
    axes[0].set_ylabel("per-token latency ÷ no speculation (1 session)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Drafting policies replayed on {data['model']}'s greedy answers ({data['tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from experiments.bench.speculative import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, cached)")
    parser.add_argument("--bench", type=Path, default=RESULTS / "bench_speculative.json",
                        help="the live benchmark whose cost model and counts to use (its prompts and model)")
    parser.add_argument("--tokens", type=int, default=None, help="greedy tokens per answer (default: the bench's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sim_drafting.json")
    args = parser.parse_args(argv)
    bench = json.loads(args.bench.read_text())
    tokens = args.tokens or bench["tokens"]
    if bench["dtype"] != "float32":
        parser.error(f"the replay decodes in float32; {args.bench} ran in {bench['dtype']}")
    data = run(greedy_answers(model_dir(args, "float32"), WORKLOADS, tokens), bench, tokens)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, args.out.with_suffix(".png"))
    for r in data["rows"]:
        print(f"{r['workload']:10s} {r['policy']:11s} {r['ratio_first']:.2f}× (free {r['free_first']:.2f}×), "
              f"all prompts {r['ratio_mean']:.2f}× (free {r['free_mean']:.2f}×)")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
