"""The reload cost of one block, measured: the churn experiment's price per moved block (issue 20, item 5).

Times what a Chainswarm/petals server does per block when it (re)loads a range — petals'
``load_pretrained_block`` from the local checkpoint plus ``convert_block`` — for SmolLM2-135M-Instruct
(float32, from the model cache), and divides by the block's parameter bytes. The churn simulation then
charges a BLOOM-176B block (s_m = 1.32 GB) ``s_m / throughput`` seconds: the same loading path at the
bandwidth measured here (page cache warm after the first pass, so this is a lower estimate: a server
that fetches blocks over the network or from a cold disk takes longer).

    python -m experiments.bench.churn_load [--blocks 8] [--repeats 3]   # writes experiments/results/churn_load.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from experiments.paths import RESULTS



def measure(blocks: int = 8, repeats: int = 3) -> dict:
    import torch

    from swarm.model.compat import petals  # noqa: F401  (patches petals before it is imported below)
    from petals.server.from_pretrained import load_pretrained_block
    from petals.utils.convert_block import QuantType, convert_block
    from swarm.model.store import ensure_model

    model_dir = ensure_model("smollm2-135m-instruct", "float32")
    config = petals.AutoDistributedConfig.from_pretrained(str(model_dir))
    cpu = torch.device("cpu")
    times, sizes = [], []
    for r in range(repeats + 1):  # the first pass warms the page cache and is left out
        for i in range(blocks):
            t0 = time.perf_counter()
            block = load_pretrained_block(str(model_dir), i, config=config, torch_dtype=torch.float32)
            block = convert_block(block, i, config, [cpu], cpu, QuantType.NONE)
            dt = time.perf_counter() - t0
            if r > 0:
                times.append(dt)
                sizes.append(sum(p.numel() * p.element_size() for p in block.parameters()))
            del block
    per_block = sum(times) / len(times)
    block_bytes = sum(sizes) / len(sizes)
    return {"model": "SmolLM2-135M-Instruct float32", "blocks": blocks, "repeats": repeats,
            "seconds_per_block": per_block, "bytes_per_block": block_bytes,
            "bytes_per_second": block_bytes / per_block, "load_average": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "churn_load.json")
    args = parser.parse_args(argv)
    data = measure(args.blocks, args.repeats)
    args.out.write_text(json.dumps(data, indent=1))
    print(f"{data['seconds_per_block'] * 1e3:.1f} ms per block of {data['bytes_per_block'] / 1e6:.1f} MB: "
          f"{data['bytes_per_second'] / 1e6:.0f} MB/s (load average {data['load_average'][0]:.1f}) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
