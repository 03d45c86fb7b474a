"""Prefix reuse on a loopback swarm: time to first token and prefill compute with vs without reuse.

Three measurements in one run (issue 7), on a random Llama (8 blocks, hidden 512, 2,048 positions):

1. **Shared 1,024-token prefix**: requests = the same 1,024-token document + a different 24-token question.
   Each question runs twice on the same chain, interleaved: without reuse (no page hashes) and with reuse.
2. **Multi-turn chat**: 6 turns; each prompt is the whole history + a new user message. Two conversations,
   one with reuse and one without (same messages, so the same prompts: greedy answers are identical).
3. **Multi-client fairness** through the HTTP API (``swarm`` policy = DLPM deficits + locality): a heavy
   client floods requests over its own shared prefix while a light client sends a few of its own (Q^u = 64,
   about two requests with reuse, so deficits bind); reported:
   each client's share of service, their latencies and the prefix hit rate.

Prefill compute is counted in token·blocks (prompt positions computed × blocks they pass through); TTFT is
the wall time from the call to the first generated token (the reuse path includes the probe round trip).
Run: ``.venv/bin/python -m experiments.bench.prefix [--quick]``; writes experiments/results/prefix_reuse.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from experiments import paths

RESULTS = paths.RESULTS / "prefix_reuse.json"
BLOCKS = 8
ADMIN = {"Authorization": "Bearer key-admin"}  # operator detail of /v1/swarm (per-client service)


def _timed_generate(engine, route, ids, hashes, max_new_tokens):
    from swarm.engine.sampling import SamplingParams
    from swarm.engine.routing import Lease

    first = {}
    started = time.perf_counter()

    def on_token(_):
        first.setdefault("t", time.perf_counter() - started)

    lease = Lease(os.urandom(4).hex(), "bench", tuple(route), 2048)
    result = engine.generate(lease, None, ids, SamplingParams(max_new_tokens, temperature=0), on_token,
                             page_hashes=hashes)
    return result, first["t"], time.perf_counter() - started


def _words(n, seed):
    import random

    rng = random.Random(seed)
    vocab = "harbour storm fire lighthouse keeper diary ship town wall gate river bridge market bell".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def _prompt_of(tokenizer, n_tokens, seed):
    ids = tokenizer(_words(n_tokens * 2, seed)).input_ids[:n_tokens]
    return ids


def shared_prefix(engine, route, root, repeats):
    from swarm.trust import prefix as protocol

    tok = engine.tokenizer
    doc = _prompt_of(tok, 1024, 1)
    rows = []
    _timed_generate(engine, route, doc + _prompt_of(tok, 24, 99)[1:], protocol.prompt_hashes(doc, root), 1)  # warm
    for i in range(repeats):
        ids = doc + _prompt_of(tok, 24, 100 + i)[1:]
        cold, cold_ttft, _ = _timed_generate(engine, route, ids, None, 8)
        warm, warm_ttft, _ = _timed_generate(engine, route, ids, protocol.prompt_hashes(ids, root), 8)
        assert cold.token_ids == warm.token_ids, "reuse changed an answer"
        rows.append({"prompt_tokens": len(ids), "ttft_no_reuse_s": cold_ttft, "ttft_reuse_s": warm_ttft,
                     "prefill_no_reuse": cold.prefill_tokens * BLOCKS, "prefill_reuse": warm.prefill_tokens * BLOCKS,
                     "reused_tokens": warm.reused_tokens})
    return _summary(rows)


def multi_turn(engine, route, root, turns):
    from swarm.trust import prefix as protocol

    tok = engine.tokenizer
    out = {}
    for mode in ("no_reuse", "reuse"):
        history = _prompt_of(tok, 200, 7)  # system prompt
        rows = []
        for t in range(turns):
            history = history + _prompt_of(tok, 60, 1000 + t)[1:]
            hashes = protocol.prompt_hashes(history, root) if mode == "reuse" else None
            result, ttft, _ = _timed_generate(engine, route, history, hashes, 24)
            rows.append({"prompt_tokens": len(history), "ttft_s": ttft, "prefill": result.prefill_tokens * BLOCKS,
                         "reused_tokens": result.reused_tokens, "answer": result.token_ids})
            history = history + result.token_ids
        out[mode] = rows
    for a, b in zip(out["reuse"], out["no_reuse"]):
        assert a["answer"] == b["answer"], "reuse changed an answer"
    turns_rows = [{"turn": i + 1, "prompt_tokens": a["prompt_tokens"], "ttft_no_reuse_s": b["ttft_s"],
                   "ttft_reuse_s": a["ttft_s"], "prefill_no_reuse": b["prefill"], "prefill_reuse": a["prefill"],
                   "reused_tokens": a["reused_tokens"]} for i, (a, b) in enumerate(zip(out["reuse"], out["no_reuse"]))]
    return _summary(turns_rows[1:], all_rows=turns_rows)  # turn 1 has nothing to reuse in either mode


def _summary(rows, all_rows=None):
    ttft_a = statistics.median(r["ttft_reuse_s"] for r in rows)
    ttft_b = statistics.median(r["ttft_no_reuse_s"] for r in rows)
    pre_a = sum(r["prefill_reuse"] for r in (all_rows or rows))
    pre_b = sum(r["prefill_no_reuse"] for r in (all_rows or rows))
    return {"ttft_reuse_median_s": ttft_a, "ttft_no_reuse_median_s": ttft_b, "ttft_ratio": ttft_a / ttft_b,
            "prefill_token_blocks_reuse": pre_a, "prefill_token_blocks_no_reuse": pre_b,
            "prefill_ratio": pre_a / pre_b, "rows": all_rows or rows}


def fairness(url, heavy_n, light_n, tokenizer):
    import httpx

    heavy_doc = tokenizer.decode(_prompt_of(tokenizer, 320, 11))
    light_doc = tokenizer.decode(_prompt_of(tokenizer, 320, 12))
    lat = {"heavy": [], "light": []}

    def call(who, i):
        doc = heavy_doc if who == "heavy" else light_doc
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer key-{who}"}, timeout=600) as http:
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={"prompt": f"{doc} question {i}?", "max_tokens": 16,
                                                   "temperature": 0})
            assert r.status_code == 200, r.text
            lat[who].append(time.perf_counter() - t0)

    with httpx.Client(base_url=url, timeout=600) as http:  # warm both prefixes
        for who, doc in (("heavy", heavy_doc), ("light", light_doc)):
            http.post("/v1/completions", headers={"Authorization": f"Bearer key-{who}"},
                      json={"prompt": doc + " warm?", "max_tokens": 1, "temperature": 0})
        before = http.get("/v1/swarm", headers=ADMIN).json()
    with cf.ThreadPoolExecutor(heavy_n + light_n) as pool:
        futures = [pool.submit(call, "heavy", i) for i in range(heavy_n)]
        time.sleep(1.0)  # the flood is queued first
        light = []
        for i in range(light_n):
            light.append(pool.submit(call, "light", i))
            time.sleep(0.3)
        for f in futures + light:
            f.result()
    after = httpx.get(f"{url}/v1/swarm", headers=ADMIN).json()
    service = {c: after["clients"][c]["service"] - before["clients"].get(c, {}).get("service", 0.0)
               for c in ("heavy", "light")}
    p_after, p_before = after["prefix"], before["prefix"]
    requests = p_after["requests"] - p_before["requests"]
    return {"heavy_requests": heavy_n, "light_requests": light_n,
            "heavy_latency_median_s": statistics.median(lat["heavy"]),
            "light_latency_median_s": statistics.median(lat["light"]),
            "light_latency_max_s": max(lat["light"]),
            "service_cost_units": service,
            "light_service_per_request": service["light"] / light_n,
            "heavy_service_per_request": service["heavy"] / heavy_n,
            "prefix_hit_rate": (p_after["hits"] - p_before["hits"]) / requests if requests else 0.0,
            "token_hit_rate": (p_after["reused_tokens"] - p_before["reused_tokens"])
            / max(1, p_after["prompt_tokens"] - p_before["prompt_tokens"]),
            "chains": [{k: c[k] for k in ("id", "servers", "capacity", "cached_prefix_tokens")}
                       for c in after["chains"]]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    import httpx

    from server.local_swarm import LocalSwarm
    from swarm.trust import prefix as protocol
    from swarm.model.checkpoint import TinyModelSpec, make_random_model
    from swarm.engine.generation import GenerationEngine

    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    model = str(make_random_model(tmp / "model", TinyModelSpec(layers=BLOCKS, hidden=512, heads=8, max_length=2048,
                                                               seed=3)))
    keys = {"key-heavy": "heavy", "key-light": "light", "key-admin": "admin"}
    with LocalSwarm(model) as local:
        local.add_orchestrator(policy="swarm", quantum=64.0, expected_rate=2.0, max_length=2048,
                               expected_input_tokens=1024, expected_output_tokens=16, refresh_s=0.5,
                               api_keys=keys, prefix_cache_tokens=2048, request_timeout_s=60.0)
        nodes = [local.add_node(node_id=f"n{i}", memory_gb=0.25, wait=False, profile_cache_dir=str(tmp / "prof"))
                 for i in range(2)]
        for peer in nodes:
            local.wait_profiled(peer)
        url = local.orchestrator.info["url"]
        status = local.wait_chains_ready(timeout=180)
        route = [tuple(r) for r in status["chains"][0]["route"]]
        engine = GenerationEngine(model, initial_peers=local.initial_peers, dht_prefix=local.dht_prefix,
                                  request_timeout=60.0)
        try:
            root = protocol.namespace_root(b"bench", local.dht_prefix)
            results = {
                "model": {"blocks": BLOCKS, "hidden": 512, "max_length": 2048, "device": "cpu"},
                "plan_chains": [{k: c[k] for k in ("servers", "spans", "capacity")} for c in status["chains"]],
                "route": route,
                "shared_prefix_1024": shared_prefix(engine, route, root, 3 if args.quick else 6),
                "multi_turn_chat": multi_turn(engine, route, root, 4 if args.quick else 6),
            }
        finally:
            engine.close()
        results["fairness"] = fairness(url, 12 if args.quick else 24, 3 if args.quick else 5,
                                       engine.tokenizer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    for name in ("shared_prefix_1024", "multi_turn_chat"):
        r = results[name]
        print(f"{name}: TTFT {r['ttft_reuse_median_s']*1e3:.1f} ms with reuse vs {r['ttft_no_reuse_median_s']*1e3:.1f} ms "
              f"without (ratio {r['ttft_ratio']:.2f}); prefill token·blocks {r['prefill_token_blocks_reuse']} vs "
              f"{r['prefill_token_blocks_no_reuse']} (ratio {r['prefill_ratio']:.2f})")
    f = results["fairness"]
    print(f"fairness: light median latency {f['light_latency_median_s']:.2f} s vs heavy {f['heavy_latency_median_s']:.2f} s; "
          f"service per request light {f['light_service_per_request']:.0f} / heavy {f['heavy_service_per_request']:.0f} "
          f"cost units; prefix hit rate {f['prefix_hit_rate']:.2f} (tokens {f['token_hit_rate']:.2f})")
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
