"""``chainswarm generate``: generate text through an orchestrator from the command line."""
from __future__ import annotations

import argparse
import os
import sys


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every client command shares: where the orchestrator is and who the client is."""
    parser.add_argument("--orchestrator", "--url", default=os.environ.get("CHAINSWARM_URL", "http://127.0.0.1:8000"),
                        help="orchestrator URL (default $CHAINSWARM_URL or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=os.environ.get("CHAINSWARM_API_KEY"))
    parser.add_argument("--client-id", default=None, help="client name when the orchestrator uses no API keys")


def failure(command: str, orchestrator: str, exc: Exception) -> int:
    """Say why a client command failed (on stderr) and return its exit code: 2 for a request the orchestrator
    refused as bad (4xx), 1 otherwise."""
    from client.http import SwarmError

    if isinstance(exc, SwarmError):
        print(f"chainswarm {command}: error: {exc}", file=sys.stderr)
        return 2 if 400 <= exc.status < 500 else 1
    print(f"chainswarm {command}: cannot reach {orchestrator}: {exc}", file=sys.stderr)
    return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text (with --chat: the user's message); - reads it from stdin")
    add_connection_arguments(parser)
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template "
                        "(/v1/chat/completions) and print the assistant's answer")
    parser.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")
    parser.add_argument("--max-new-tokens", "--max-tokens", type=int, default=32,
                        help="at most this many tokens (the API's max_tokens; default 32)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="sample reproducibly: same seed and prompt, same text")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="end the text before this string (repeat for up to 4)")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    parser.add_argument("--reconnect-s", type=float, default=10.0,
                        help="keep retrying a refused connection this long (an orchestrator restarting; default 10)")


def run(args: argparse.Namespace) -> int:
    import httpx

    from client.http import SwarmClient, SwarmError

    if args.system is not None and not args.chat:
        print("chainswarm generate: error: --system needs --chat", file=sys.stderr)
        return 2
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop)
    messages = [*([{"role": "system", "content": args.system}] if args.system is not None else []),
                {"role": "user", "content": args.prompt}]
    try:
        with SwarmClient(args.orchestrator, args.api_key, client_id=args.client_id,
                         reconnect_s=max(0.0, args.reconnect_s)) as client:
            if args.stream:
                pieces = (client.chat_stream(messages, args.max_new_tokens, **sampling) if args.chat
                          else client.stream(args.prompt, args.max_new_tokens, **sampling))
                for piece in pieces:
                    print(piece, end="", flush=True)
                print()
            else:
                result = (client.chat(messages, args.max_new_tokens, **sampling) if args.chat
                          else client.generate(args.prompt, args.max_new_tokens, **sampling))
                print(result.text)
                timing = (f"; waited {result.waiting_s:.2f} s, served in {result.service_s:.2f} s"
                          if result.waiting_s is not None and result.service_s is not None else "")
                print(f"[{result.completion_tokens} tokens on chain {result.chain_id}{timing}]", file=sys.stderr)
    except (SwarmError, httpx.HTTPError) as exc:
        return failure("generate", args.orchestrator, exc)
    return 0
