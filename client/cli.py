"""``chainswarm generate``: generate text through an orchestrator from the command line."""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--orchestrator", default=os.environ.get("CHAINSWARM_URL", "http://127.0.0.1:8000"),
                        help="orchestrator URL (default $CHAINSWARM_URL or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=os.environ.get("CHAINSWARM_API_KEY"))
    parser.add_argument("--client-id", default=None, help="client name when the orchestrator uses no API keys")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument("--reconnect-s", type=float, default=10.0,
                        help="keep retrying a refused connection this long (an orchestrator restarting; default 10)")


def run(args: argparse.Namespace) -> int:
    import httpx

    from client.http import SwarmClient, SwarmError

    try:
        with SwarmClient(args.orchestrator, args.api_key, client_id=args.client_id,
                         reconnect_s=max(0.0, args.reconnect_s)) as client:
            if args.stream:
                for piece in client.stream(args.prompt, args.max_new_tokens, temperature=args.temperature,
                                           top_p=args.top_p):
                    print(piece, end="", flush=True)
                print()
            else:
                result = client.generate(args.prompt, args.max_new_tokens, temperature=args.temperature,
                                         top_p=args.top_p)
                print(result.text)
                print(f"[{result.completion_tokens} tokens on chain {result.chain_id}; waited "
                      f"{result.waiting_s:.2f} s, served in {result.service_s:.2f} s]", file=sys.stderr)
    except SwarmError as exc:
        print(f"chainswarm generate: error: {exc}", file=sys.stderr)
        return 2 if 400 <= exc.status < 500 else 1
    except httpx.HTTPError as exc:
        print(f"chainswarm generate: cannot reach {args.orchestrator}: {exc}", file=sys.stderr)
        return 1
    return 0
