"""``chainswarm score``: a text's log-likelihood and perplexity under the served model, token by token."""
from __future__ import annotations

import argparse
import json
import sys

from client.cli import add_connection_arguments, failure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text to score; - reads it from stdin")
    add_connection_arguments(parser)
    parser.add_argument("--top", type=int, default=0, choices=range(6), metavar="N",
                        help="also list the N (at most 5) most likely tokens at each position")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def run(args: argparse.Namespace) -> int:
    import httpx

    from client.http import SwarmClient, SwarmError

    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        with SwarmClient(args.orchestrator, args.api_key, client_id=args.client_id) as client:
            score = client.score(text, top=args.top)
    except (SwarmError, httpx.HTTPError) as exc:
        return failure("score", args.orchestrator, exc)
    scored = sum(lp is not None for lp in score.logprobs)
    if args.json:
        print(json.dumps({"tokens": score.tokens, "logprobs": score.logprobs, "top": score.top,
                          "log_likelihood": score.log_likelihood, "scored_tokens": scored,
                          "perplexity": score.perplexity}))
        return 0
    for token, logprob, top in zip(score.tokens, score.logprobs, score.top):
        others = "  ".join(f"{t!r} {lp:.3f}" for t, lp in (top or {}).items())
        print(f"{token!r:>20} {'' if logprob is None else f'{logprob:9.4f}':>9}  {others}".rstrip())
    print(f"{scored} tokens scored: log-likelihood {score.log_likelihood:.4f}, perplexity {score.perplexity:.4f}")
    return 0
