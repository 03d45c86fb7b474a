"""Soak: Poisson load at 0.5×, 1× and 2× the planned capacity plus two bursts of 20×, on the real model.

One swarm (an orchestrator and 3 server nodes serving SmolLM2-135M-Instruct in float32) takes, in one run:

    phase        duration   load
    low          --phase-s  Poisson at 0.5 × ν (ν = the plan's total service rate, requests/s)
    burst-1      instant    20 × C requests at once (C = the plan's total chain capacity, sessions)
    nominal      --phase-s  Poisson at 1 × ν
    overload     --phase-s  Poisson at 2 × ν
    burst-2      instant    20 × C requests at once
    drain        --phase-s  Poisson at 0.5 × ν, then wait for every outstanding request

Every request is accounted for: answered (200), refused (429/503 with a message), failed (another HTTP
error) or lost (no response at all before the client timeout — must be 0). Sampled every second from
``/v1/swarm``: slots in use, capacity and queue length. Writes ``experiments/results/bench_soak.json`` (every
request, the samples, per-phase P50/P99) and ``bench_soak.png``.

    python -m experiments.bench.soak [--phase-s 120] [--model DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from experiments.bench.cli import add_common, model_dir as checkpoint, replotted
from experiments.paths import RESULTS

DTYPE = "float32"
CLIENTS = ("alice", "bob", "carol")
TOPICS = ("the weather", "a short poem about rivers", "the history of tea", "how bicycles work", "volcanoes",
          "the moon", "bread baking", "chess openings")


def percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


class Soak:
    def __init__(self, url: str, *, client_timeout: float, seed: int):
        self.url, self.client_timeout = url, client_timeout
        self.rng = random.Random(seed)
        self.requests: list[dict] = []
        self.samples: list[dict] = []
        self.phases: list[dict] = []
        self.t0 = time.monotonic()
        self._tasks: set[asyncio.Task] = set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, http, phase: str) -> None:
        i = len(self.requests)
        record = {"i": i, "phase": phase, "client": CLIENTS[i % len(CLIENTS)], "start": self.now()}
        self.requests.append(record)
        body = {"prompt": f"Tell me about {self.rng.choice(TOPICS)}.", "max_tokens": self.rng.choice((8, 16, 24)),
                "temperature": 0, "user": record["client"]}
        try:
            response = await http.post("/v1/completions", json=body)
            record["status"] = response.status_code
            if response.status_code != 200:
                record["error"] = response.json().get("error", {}).get("message", response.text)[:200]
                record["retry_after"] = response.headers.get("retry-after")
        except Exception as exc:  # no response at all
            record["status"] = None
            record["error"] = repr(exc)[:200]
        record["end"] = self.now()

    def spawn(self, http, phase: str) -> None:
        task = asyncio.ensure_future(self.one(http, phase))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def poisson(self, http, phase: str, rate: float, seconds: float) -> None:
        end = self.now() + seconds
        while True:
            await asyncio.sleep(self.rng.expovariate(rate))
            if self.now() >= end:
                return
            self.spawn(http, phase)

    async def burst(self, http, phase: str, count: int) -> None:
        for _ in range(count):
            self.spawn(http, phase)

    async def sample(self, monitor) -> None:
        while True:
            try:
                status = (await monitor.get("/v1/swarm")).json()
                self.samples.append({"t": self.now(), "active": sum(c["active"] for c in status["chains"]),
                                     "capacity": sum(c["capacity"] for c in status["chains"]),
                                     "queue": sum(status["queue"].values())})
            except Exception as exc:
                self.samples.append({"t": self.now(), "error": repr(exc)[:100]})
            await asyncio.sleep(1.0)

    async def drive(self, phases, progress) -> None:
        import httpx

        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.client_timeout, limits=limits) as http, \
                httpx.AsyncClient(base_url=self.url, timeout=10) as monitor:
            sampler = asyncio.ensure_future(self.sample(monitor))
            for name, kind, value, seconds in phases:
                self.phases.append({"name": name, "kind": kind, "value": value, "start": self.now()})
                if kind == "burst":
                    await self.burst(http, name, value)
                else:
                    await self.poisson(http, name, value, seconds)
                progress.update()
            while self._tasks:
                await asyncio.wait(set(self._tasks), timeout=5)
            await asyncio.sleep(2)
            sampler.cancel()


def summarize(requests: list[dict]) -> dict:
    out = {}
    for phase in dict.fromkeys(r["phase"] for r in requests):
        rs = [r for r in requests if r["phase"] == phase]
        ok = [r["end"] - r["start"] for r in rs if r["status"] == 200]
        out[phase] = {
            "requests": len(rs), "answered": len(ok),
            "refused": sum(1 for r in rs if r["status"] in (429, 503)),
            "failed": sum(1 for r in rs if r["status"] not in (None, 200, 429, 503)),
            "lost": sum(1 for r in rs if r["status"] is None),
            "p50_s": percentile(ok, 50), "p99_s": percentile(ok, 99),
        }
    total = {k: sum(v[k] for v in out.values()) for k in ("requests", "answered", "refused", "failed", "lost")}
    ok = [r["end"] - r["start"] for r in requests if r["status"] == 200]
    total.update(p50_s=percentile(ok, 50), p99_s=percentile(ok, 99))
    out["total"] = total
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    samples = [s for s in report["samples"] if "active" in s]
    t = [s["t"] for s in samples]
    top.plot(t, [s["active"] for s in samples], label="slots in use")
    top.plot(t, [s["capacity"] for s in samples], "--", label="capacity")
    top.plot(t, [s["queue"] for s in samples], label="queue length")
    top.set_ylabel("sessions / requests")
    top.set_yscale("symlog")
    top.legend(loc="center right")
    colours = {200: "tab:green", 429: "tab:orange", 503: "tab:red", None: "black"}
    for status, colour in colours.items():
        rs = [r for r in report["requests"] if r["status"] == status]
        if rs:
            bottom.scatter([r["start"] for r in rs], [r["end"] - r["start"] for r in rs], s=4, c=colour,
                           label={200: "answered", 429: "refused 429", 503: "refused 503", None: "lost"}[status])
    bottom.set_ylabel("response time (s)")
    bottom.set_xlabel("time since start (s)")
    bottom.legend(loc="upper right")
    for i, phase in enumerate(report["phases"]):
        for ax in (top, bottom):
            ax.axvline(phase["start"], color="grey", lw=0.5)
        top.annotate(f" {phase['name']}", (phase["start"], 0.97 - 0.08 * (i % 2)), xycoords=("data", "axes fraction"),
                     fontsize=8, va="top")
    fig.suptitle(f"Soak on {report['model']}: ν = {report['planned_rate']:.2f} req/s, capacity "
                 f"{report['capacity']} sessions; lost {report['summary']['total']['lost']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(parser, RESULTS / "bench_soak.json")
    parser.add_argument("--phase-s", type=float, default=120.0, help="seconds per Poisson phase (default 120)")
    parser.add_argument("--memory-gb", type=float, default=0.2, help="memory budget per server (default 0.2)")
    parser.add_argument("--client-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if replotted(args, plot):
        return 0
    import httpx
    from tqdm import tqdm

    from server.local_swarm import LocalSwarm

    model_dir = checkpoint(args, DTYPE)
    with LocalSwarm(model_dir) as swarm:
        url = swarm.add_orchestrator(policy="dlpm", expected_rate=1.0, max_length=512, expected_input_tokens=24,
                                     expected_output_tokens=16, refresh_s=0.5, torch_dtype=DTYPE).info["url"]
        nodes = [swarm.add_node(node_id=f"n{i}", memory_gb=args.memory_gb, wait=False, torch_dtype=DTYPE)
                 for i in range(3)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=180)
        status = swarm.wait_chains_ready(timeout=300)
        rate, capacity = status["plan"]["total_rate"], status["plan"]["total_capacity"]
        phases = [("low", "poisson", 0.5 * rate, args.phase_s), ("burst-1", "burst", 20 * capacity, 0),
                  ("nominal", "poisson", rate, args.phase_s), ("overload", "poisson", 2 * rate, args.phase_s),
                  ("burst-2", "burst", 20 * capacity, 0), ("drain", "poisson", 0.5 * rate, args.phase_s)]
        soak = Soak(url, client_timeout=args.client_timeout, seed=args.seed)
        progress = tqdm(total=len(phases), desc="soak phases")
        wall = time.monotonic()
        asyncio.run(soak.drive(phases, progress))
        progress.close()
        after = httpx.get(f"{url}/v1/swarm", timeout=30).json()
    report = {
        "model": Path(model_dir).name, "dtype": DTYPE, "servers": 3, "memory_gb": args.memory_gb,
        "planned_rate": rate, "capacity": capacity, "chains": [c["servers"] for c in status["chains"]],
        "phase_s": args.phase_s, "wall_s": time.monotonic() - wall, "phases": soak.phases,
        "summary": summarize(soak.requests),
        "after": {"active": sum(c["active"] for c in after["chains"]), "queue": sum(after["queue"].values())},
        "requests": soak.requests, "samples": soak.samples,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(json.dumps({"planned_rate": rate, "capacity": capacity, "summary": report["summary"],
                      "after": report["after"]}, indent=1))
    return 0 if report["summary"]["total"]["lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
