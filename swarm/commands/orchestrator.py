"""``chainswarm orchestrator``: plan the swarm, assign blocks, dispatch sessions, serve the HTTP API."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local checkpoint directory (the model the swarm serves)")
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                        help="join an existing DHT (default: start one; servers join with its address)")
    parser.add_argument("--host", default="127.0.0.1", help="address of the orchestrator's DHT peer")
    parser.add_argument("--dht-port", type=int, default=0, help="TCP port of the DHT peer (default: any free)")
    parser.add_argument("--http", default="127.0.0.1:8000", metavar="HOST:PORT", help="HTTP API address")
    parser.add_argument("--dht-prefix", default=None, help="DHT prefix (default: derived from the model dir name)")
    parser.add_argument("--policy", default="dlpm", choices=["dlpm", "vtc", "fcfs", "lpm", "swarm", "bfio", "lcf"],
                        help="fairness policy for the central queue (default dlpm)")
    parser.add_argument("--quantum", type=float, default=8192.0, help="DLPM quantum Q^u in cost units")
    parser.add_argument("--target-load", type=float, default=0.7, help="planner's target load rho (default 0.7)")
    parser.add_argument("--expected-rate", type=float, default=1.0, help="planning arrival rate, requests/s")
    parser.add_argument("--expected-input-tokens", type=float, default=None)
    parser.add_argument("--expected-output-tokens", type=float, default=None)
    parser.add_argument("--max-length", type=int, default=None, help="max tokens per session (KV slot size)")
    parser.add_argument("--placement", default="gbp-cr", choices=["gbp-cr", "petals", "bprr", "whole-model", "random"])
    parser.add_argument("--router", default="jffc", choices=["jffc", "ws-rr"],
                        help="jffc (default): GCA chains, the fairness queue and JFFC; ws-rr: BPRR's per-request "
                        "WS-RR paths over the placement (FCFS, no chains; pair with --placement bprr)")
    parser.add_argument("--tuning", default="lower-bound", choices=["lower-bound", "surrogate", "upper-bound"])
    parser.add_argument("--c", type=int, default=None, help="fix the cache reservation c instead of tuning it")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY=CLIENT",
                        help="accept this API key as this client (repeatable); without keys, clients are anonymous "
                        "or name themselves with X-Client-Id")
    parser.add_argument("--api-keys-file", default=None, help='JSON file {"key": "client", ...}')
    parser.add_argument("--request-timeout", type=float, default=30.0,
                        help="seconds a session step may take before its server counts as failed (default 30)")
    parser.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                        help="abort a session that makes no progress (no server step, no token) for S seconds, "
                        "return its slot and retry it if it produced nothing (default: 4x the planned time of the "
                        "step in progress, between 10 and 60 s)")
    parser.add_argument("--torch-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the swarm's serving dtype: the orchestrator's embeddings and LM head run in it and only "
                        "servers that compute in it are planned (default float32; mixing dtypes changes greedy "
                        "answers)")
    parser.add_argument("--prefix-cache-tokens", type=int, default=0,
                        help="prompt-prefix KV budget per served block, in tokens, reserved on every server "
                        "(default 0 = no prefix reuse); pair with --policy swarm for locality-aware chains")
    parser.add_argument("--chain-quantum", type=float, default=None,
                        help="swarm policy: per-client per-chain stickiness quantum Q^w (default 16384)")
    parser.add_argument("--no-proxy", action="store_true", help="leases only: do not serve /v1/completions")
    parser.add_argument("--log-level", default="INFO")


def _fail(message: str) -> int:
    print(f"chainswarm orchestrator: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from swarm.service import OrchestratorOptions, run as run_service

    if not (Path(args.model) / "config.json").is_file():
        return _fail(f"{args.model} is not a model directory (no config.json)")
    host, _, port = args.http.rpartition(":")
    if not host or not port.isdigit():
        return _fail(f"--http must be HOST:PORT, got {args.http!r}")
    keys: dict[str, str] = {}
    try:
        if args.api_keys_file:
            keys.update({str(k): str(v) for k, v in json.loads(Path(args.api_keys_file).read_text()).items()})
        for item in args.api_key:
            key, sep, client = item.partition("=")
            if not sep or not key or not client:
                return _fail(f"--api-key must be KEY=CLIENT, got {item!r}")
            keys[key] = client
    except (OSError, ValueError, AttributeError) as exc:
        return _fail(f"cannot read API keys: {exc}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = OrchestratorOptions(
        model_dir=args.model, initial_peers=args.initial_peers, dht_host=args.host, dht_port=args.dht_port,
        http_host=host, http_port=int(port), dht_prefix=args.dht_prefix, policy=args.policy, quantum=args.quantum,
        target_load=args.target_load, expected_rate=args.expected_rate,
        expected_input_tokens=args.expected_input_tokens, expected_output_tokens=args.expected_output_tokens,
        max_length=args.max_length, placement=args.placement, tuning=args.tuning, c=args.c, api_keys=keys,
        request_timeout_s=args.request_timeout, prefix_cache_tokens=args.prefix_cache_tokens,
        chain_quantum=args.chain_quantum, router=args.router, stall_timeout_s=args.stall_timeout,
        torch_dtype=args.torch_dtype, proxy=not args.no_proxy,
    )
    try:
        from swarm.service import build_config
        build_config(options)  # validate the planning settings before starting anything
    except ValueError as exc:
        return _fail(str(exc))
    run_service(options)
    return 0
