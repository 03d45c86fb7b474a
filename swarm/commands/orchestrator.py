"""``chainswarm orchestrator``: plan the swarm, assign blocks, dispatch sessions, serve the HTTP API.

The arguments are generated from :class:`swarm.control.options.OrchestratorOptions` (each option's default and help
live on its field); ``--http``, ``--api-key``, ``--api-keys-file`` and ``--no-proxy`` are written here.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from swarm.control import options as orchestrator_options


API_KEYS_ENV = "CHAINSWARM_API_KEYS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = orchestrator_options.OrchestratorOptions
    orchestrator_options.add_arguments(parser)
    parser.add_argument("--http", default=f"{defaults.http_host}:{defaults.http_port}", metavar="HOST:PORT",
                        help="HTTP API address")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY=CLIENT",
                        help="accept this API key as this client (repeatable); without keys, clients are anonymous "
                        "or name themselves with X-Client-Id")
    parser.add_argument("--api-keys-file", default=None,
                        help='JSON file {"key": "client", ...}; keys also come from the environment variable '
                        f'{API_KEYS_ENV}="KEY=CLIENT,KEY=CLIENT" (neither shows in ps, unlike --api-key)')
    parser.add_argument("--no-proxy", action="store_true", help="leases only: do not serve /v1/completions")
    parser.add_argument("--ephemeral", action="store_true",
                        help="keep no state: a new signing key every start (servers that pinned the old key will "
                        "not obey this orchestrator until they restart)")


def _fail(message: str) -> int:
    print(f"chainswarm orchestrator: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not (Path(args.model_dir) / "config.json").is_file():
        return _fail(f"{args.model_dir} is not a model directory (no config.json)")
    host, _, port = args.http.rpartition(":")
    if not host or not port.isdigit():
        return _fail(f"--http must be HOST:PORT, got {args.http!r}")
    keys: dict[str, str] = {}
    try:
        if args.api_keys_file:
            keys.update({str(k): str(v) for k, v in json.loads(Path(args.api_keys_file).read_text()).items()})
        env = os.environ.get(API_KEYS_ENV, "")
        for item, where in [(i, API_KEYS_ENV) for i in env.split(",") if i.strip()] + \
                [(i, "--api-key") for i in args.api_key]:
            key, sep, client = item.strip().partition("=")
            if not sep or not key or not client:
                return _fail(f"{where} must be KEY=CLIENT, got {item!r}")
            keys[key] = client
    except (OSError, ValueError, AttributeError) as exc:
        return _fail(f"cannot read API keys: {exc}")
    options = orchestrator_options.from_arguments(args, http_host=host, http_port=int(port), api_keys=keys,
                                                  proxy=not args.no_proxy)
    for flag, number in (("--http", options.http_port), ("--dht-port", options.dht_port)):
        if not 0 <= number <= 65535:
            return _fail(f"{flag} must name a port between 0 and 65535, got {number}")
    if not 0 <= options.batch_sessions <= 1024:
        return _fail(f"--batch-sessions must be between 0 and 1024, got {options.batch_sessions}")
    if not 1 <= options.batch_lanes <= 16:
        return _fail(f"--batch-lanes must be between 1 and 16, got {options.batch_lanes}")
    if not 0 <= options.expect_servers <= 100_000:
        return _fail(f"--expect-servers must be between 0 and 100000, got {options.expect_servers}")
    if not 0 <= options.suspect_s <= 86400:
        return _fail(f"--failure-grace must be between 0 and 86400 seconds, got {options.suspect_s}")
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from swarm.service import build_config, run as run_service  # the whole stack: after the checks above (seconds)

    try:
        config = build_config(options)  # validate the planning settings before starting anything
    except ValueError as exc:
        return _fail(str(exc))
    from swarm.state.store import StateError

    if args.ephemeral and args.state_dir:
        return _fail("--ephemeral and --state-dir contradict each other")
    if not args.ephemeral and not options.state_dir:  # a plain restart keeps its key, so its servers obey it
        import dataclasses

        from swarm.state import ownership

        try:
            identity = ownership.ModelIdentity.of(options.model_dir, config.dht_prefix)
            state = ownership.default_dir(identity, config.num_blocks)
        except StateError as exc:
            return _fail(str(exc))
        options = dataclasses.replace(options, state_dir=str(state))
        logging.getLogger(__name__).info("state in %s (--state-dir to choose, --ephemeral for none)", state)
    from swarm.runtime.dht import StartupError

    try:
        run_service(options)
    except StateError as exc:  # a corrupt or unreadable state file: one line naming it, never a fresh start
        return _fail(str(exc))
    except StartupError as exc:  # a port in use, unreachable initial peers
        return _fail(str(exc))
    return 0
