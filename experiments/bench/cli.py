"""What the real-model soak benchmarks' command lines share: the checkpoint, the seed, where the JSON goes and
``--replot`` (redraw the PNG from a committed JSON without running anything)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable


def add_common(parser: argparse.ArgumentParser, out: Path) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, cached)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON at --out; run nothing")


def replotted(args: argparse.Namespace, plot: Callable[[dict, Path], None]) -> bool:
    """With ``--replot``: redraw ``--out``'s PNG from its JSON and say so (the caller then returns)."""
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
    return args.replot


def model_dir(args: argparse.Namespace, dtype: str) -> str:
    """``--model``, or the default real model in ``dtype`` (fetched into the user cache once)."""
    from swarm.model.store import DEFAULT_MODEL, ensure_model

    return args.model or str(ensure_model(DEFAULT_MODEL, dtype))


def host_cpu() -> str:
    """The processor's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): the development machine's
    host changes between sessions, and CPU figures are only comparable on the same one."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
