"""Throughput through the product's own path: the HTTP API with default options on a given server layout.

An orchestrator with every planning and admission option at its default and the nodes of a layout — ``user``
(two 0.3 GB nodes, the layout a new user starts with: SmolLM2 float32 splits 15 + 15 blocks) or ``demo`` (the
four budgets ``make demo`` starts: chains across three or four servers) — and N concurrent greedy
``POST /v1/completions``; aggregate tokens/s and the texts, compared with local greedy. Part of
:mod:`experiments.bench.batching` (``--http-layouts``, ``--only-http``).
"""
from __future__ import annotations

import threading
import time
import uuid

from experiments.bench.runtime import DTYPE

PROMPTS = [
    "The history of the bicycle begins in the early nineteenth century, when",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colours are",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the air pressure is lower, so",
    "A short list of fruits:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def together(sessions: int, one, barrier: threading.Barrier) -> tuple[float, float]:
    """Run ``one(i)`` for every session in its own thread, released together by ``barrier`` (``sessions + 1``
    parties, the last one ours); returns when the clock started and how long they all took."""
    threads = [threading.Thread(target=one, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return start, time.perf_counter() - start


HTTP_NODE_GB = 0.3  # the layout users start with: two 0.3 GB servers (SmolLM2 float32: 15 + 15 blocks)
HTTP_LAYOUTS = {"user": f"two nodes of {HTTP_NODE_GB} GB", "demo": "the demo's four nodes (`make demo`)"}


def layout_budgets(model_dir: str, layout: str) -> list[float]:
    """The nodes' memory budgets (GB) of an HTTP layout: ``user`` (two 0.3 GB nodes) or ``demo`` (the four
    budgets ``make demo`` starts, each 0.38 of the model with one 256-token session's KV: 3-4 server chains)."""
    if layout == "user":
        return [HTTP_NODE_GB, HTTP_NODE_GB]
    from experiments.live.demo import BUDGET_FACTORS, _budgets_gb

    return _budgets_gb(model_dir, 256, BUDGET_FACTORS["real"])


def run_http(url: str, sessions: int, tokens: int) -> dict:
    """``sessions`` concurrent ``POST /v1/completions`` (greedy, ``max_tokens=tokens``) through the orchestrator:
    aggregate tokens/s over the wall time, and the texts."""
    import httpx

    barrier = threading.Barrier(sessions + 1, timeout=600)  # bounded: a thread that never arrives breaks it
    texts: list = [None] * sessions
    counts = [0] * sessions
    errors: list = []

    run = uuid.uuid4().hex[:8]

    def one(i: int) -> None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0, "stop": None}
        # each session is an application with its HTTP client made before the clock starts (making one costs
        # ~30 ms of CPU for its TLS context: made inside the window, 8 of them took 0.23 CPU-s of a 4.7 s run)
        with httpx.Client(timeout=600) as http:
            barrier.wait()
            try:
                # a client id of its own per request and run: speculative decoding (on by default) drafts from a
                # client's own recent outputs, and the same prompts recur across the runs, so shared ids would let
                # a request copy its earlier answer (1 session at 4.5x) instead of measuring distinct users' traffic
                response = http.post(f"{url}/v1/completions", json=body, headers={"X-Client-Id": f"bench-{run}-{i}"})
                response.raise_for_status()
                doc = response.json()
                texts[i], counts[i] = doc["choices"][0]["text"], doc["usage"]["completion_tokens"]
            except Exception as exc:  # noqa: BLE001 - reported in the results
                errors.append(repr(exc))

    _, wall = together(sessions, one, barrier)
    return {"sessions": sessions, "tokens": sum(counts), "wall_s": wall, "tokens_per_s": sum(counts) / wall,
            "texts": texts, "errors": errors}


def bench_http(model_dir: str, counts, tokens: int, repeats: int, progress, layout: str = "user",
               lanes: int = 1) -> dict:
    """The product's path with default options: an orchestrator (``chainswarm orchestrator`` defaults: token KV
    admission, continuous batching; ``lanes`` > 1 sets ``--batch-lanes``, the one option changed) and the nodes of
    ``layout`` (:func:`layout_budgets`) with default options; ``counts`` concurrent ``/v1/completions``, best of
    ``repeats`` per point; answers compared with local greedy."""
    from swarm.model.tokenizer import load_tokenizer

    from experiments.live.demo import reference_generator
    from server.local_swarm import LocalSwarm

    tokenizer = load_tokenizer(model_dir)
    generate, _ = reference_generator(model_dir)
    expected = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected[prompt] = tokenizer.decode(generate(ids, tokens, tokenizer.eos_token_id), skip_special_tokens=True)
    with LocalSwarm(model_dir) as swarm:
        # every planning and admission option at its default (and --batch-lanes where asked)
        swarm.add_orchestrator(torch_dtype=DTYPE, **({"batch_lanes": lanes} if lanes > 1 else {}))
        budgets = layout_budgets(model_dir, layout)
        nodes = [swarm.add_node(node_id=f"h{i}", memory_gb=gb, wait=False, torch_dtype=DTYPE)
                 for i, gb in enumerate(budgets)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=300)
        status = swarm.wait_chains_ready(timeout=300)
        url = swarm.orchestrator.info["url"]
        run_http(url, 2, 4)  # warm-up
        rows = []
        for n in counts:
            progress.set_postfix_str(f"http {layout} × {n}")
            runs = [run_http(url, n, tokens) for _ in range(repeats)]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            best["same_text_as_local_greedy"] = all(t == expected[PROMPTS[i % len(PROMPTS)]]
                                                    for i, t in enumerate(best["texts"]))
            best["tokens_per_s_all"] = [r["tokens_per_s"] for r in runs]
            rows.append(best)
            progress.update()
    one = next((r["tokens_per_s"] for r in rows if r["sessions"] == 1), None)
    for row in rows:
        row["vs_one_session"] = row["tokens_per_s"] / one if one else None
    return {"layout": layout, "batch_lanes": lanes,
            "layout_text": HTTP_LAYOUTS[layout] + (f", `--batch-lanes {lanes}`" if lanes > 1 else ""),
            "node_memory_gb": HTTP_NODE_GB if layout == "user" else budgets, "chains": status["chains"], "plan": {
        k: status["plan"].get(k) for k in ("c", "tuning", "total_capacity")}, "rows": rows}


def store_http(report: dict, http: dict) -> None:
    """The user layout's rows with default options are ``report["http"]`` (the headline); other layouts, and runs
    with ``--batch-lanes``, go to ``http_layouts``."""
    lanes = http.get("batch_lanes", 1)
    if http["layout"] == "user" and lanes == 1:
        report["http"] = http
    else:
        key = http["layout"] + (f"-lanes{lanes}" if lanes > 1 else "")
        report.setdefault("http_layouts", {})[key] = http
