"""Shared pieces of the live-swarm experiments (``chainswarm experiment ...``).

* the experiment model (a random Llama, 8 blocks of hidden 128: LLaMA-2-7B's 32 blocks scaled by 1/4),
* trace scaling: the Azure code trace (``experiments.sim.simulator.load_trace``) compressed in time and in
  lengths so that the CPU swarm replays it in minutes,
* prompts of an exact token length, request drivers (orchestrator HTTP; vanilla petals client) that record
  submission / start / completion of every request, and the §11.4 statistics.

Definitions (chain-composition spec §11.4): response = completion − submission; waiting = start on a
chain − submission; service = completion − start. For the orchestrated methods "start" is the moment the
orchestrator grants the chain (``chainswarm.waiting_s`` of the response) and service its ``service_s``;
for PETALS it is the last route choice of the session's first step, i.e. after any cache-allocation
retries and back-offs (petals opens its server sessions right after that choice).
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from experiments.report.common import fmt  # noqa: F401  (lc.fmt: the live sections' number format)

# ---------------------------------------------------------------------------------------------- model

MODEL_LAYERS = 8
MODEL_HIDDEN = 128
MODEL_HEADS = 4
SESSION_TOKENS = 256  # max_length of a session (LLaMA-2 experiment: 2048) -> one KV slot holds this many tokens


def experiment_model(root: str | Path) -> str:
    """The experiments' checkpoint (written once under ``root``)."""
    from swarm.model.checkpoint import TinyModelSpec, make_random_model

    path = Path(root) / f"llama-{MODEL_LAYERS}x{MODEL_HIDDEN}"
    if not (path / "config.json").is_file():
        make_random_model(path, TinyModelSpec(layers=MODEL_LAYERS, hidden=MODEL_HIDDEN, heads=MODEL_HEADS,
                                              max_length=1024, seed=7))
    return str(path)


def model_sizes(model_dir: str) -> dict[str, int]:
    """Bytes of one block and of one token of KV cache on one block (what the nodes will measure)."""
    from server import profiling
    from swarm.model.compat import petals

    config = petals.AutoDistributedConfig.from_pretrained(model_dir)
    return {"block_bytes": profiling.block_bytes(config, "float32", "none"),
            "cache_bytes_per_token": profiling.cache_bytes_per_token(config, "float32"),
            "num_blocks": config.num_hidden_layers}


def petals_num_blocks(memory_bytes: float, block_bytes: int, cache_bytes_per_token: int, attn_cache_tokens: int,
                      num_blocks: int) -> int:
    """petals' ``Server._choose_num_blocks`` applied to a memory budget (spec §12.1): as many blocks as fit
    with their fixed ``attn_cache_tokens`` cache each. (petals measures GPU memory; on CPU we apply its
    formula to the budget. The autograd reserve is left out: it scales with hidden size and is ~0 here.)"""
    per_block = block_bytes + attn_cache_tokens * cache_bytes_per_token
    return max(1, min(int(memory_bytes // per_block), num_blocks))


# ------------------------------------------------------------------------------------- emulated GPUs

# The paper's two accelerators (chain-composition spec §10.1): a high-performance GPU (120 TFLOPS, 1.02 GB/ms,
# ≈ A100 MIG 3g.40gb) and a low-performance one (80 TFLOPS, 0.51 GB/ms, ≈ MIG 2g.20gb), running BLOOM-176B
# blocks (F = 5 GFLOPs per block per token, s_m = 1.32 GB per block in NF4). Per block and token, prefill is
# compute-bound (F / FLOPS) and decode memory-bound (s_m / bandwidth); footnote 11 of the spec.
PAPER_GPUS = {"high": {"tflops": 120.0, "gb_per_ms": 1.02}, "low": {"tflops": 80.0, "gb_per_ms": 0.51}}
PAPER_BLOCK_GFLOPS = 5.0
PAPER_BLOCK_GB = 1.32
PAPER_LAYERS = 70  # BLOOM-176B


def emulated_gpus(num_blocks: int = MODEL_LAYERS, input_scale: float = 16.0) -> dict[str, Any]:
    """``{"high": EmulatedCompute, "low": EmulatedCompute}`` for the experiment model.

    The 70 BLOOM-176B blocks are folded into the model's ``num_blocks``: one experiment block stands for
    70/num_blocks paper blocks, so a whole-model pass costs what it costs the paper's GPU. A prompt token
    stands for ``input_scale`` trace tokens (:class:`Scaling`), so prefill per prompt token is scaled by it
    too, keeping the paper's prefill : decode ratio per job (about 83 : 25 ms per block on the high GPU).
    """
    from server.emulation import EmulatedCompute

    fold = PAPER_LAYERS / num_blocks
    out = {}
    for name, gpu in PAPER_GPUS.items():
        prefill_ms = PAPER_BLOCK_GFLOPS / gpu["tflops"] * fold * input_scale  # GFLOP / TFLOPS = ms
        decode_ms = PAPER_BLOCK_GB / gpu["gb_per_ms"] * fold
        out[name] = EmulatedCompute(prefill_s=prefill_ms / 1e3, decode_s=decode_ms / 1e3)
    return out


# -------------------------------------------------------------------------------------- orchestrated nodes

# Compute profile measured once, on a node started alone (no other node profiling or serving), then declared
# for every node of every orchestrated run: nodes that profile together on 2 shared cores measure each other's
# load (the quick model validation saw 3.7x errors). RTTs are not declared: each node measures its own through
# the WAN emulator. With emulated GPUs the stored figure is the CPU part (the node's profile minus its emulation).
MEASURED_COMPUTE: dict[str, float] = {}


def start_nodes(swarm, hosts: Sequence[str], memory_gb: dict[str, float], gpus: dict | None, log=None,
                **node_kw: Any) -> list:
    """Start one orchestrated node per WAN host and wait until all have published their profiles.

    The first run's first node starts alone and is measured (:data:`MEASURED_COMPUTE`); every other node
    declares that measurement. ``gpus`` maps hosts to :class:`server.emulation.EmulatedCompute`."""
    gpus = gpus or {}

    def emulation(host: str) -> dict:
        return {"emulated_compute": gpus[host].to_dict()} if host in gpus else {}

    hosts = list(hosts)
    peers = []
    if not MEASURED_COMPUTE:
        first = swarm.add_node(node_id=hosts[0], wan_host=hosts[0], memory_gb=memory_gb[hosts[0]], wait=True,
                               timeout=180, **node_kw, **emulation(hosts[0]))
        emulated = emulation(hosts[0]).get("emulated_compute", {})
        MEASURED_COMPUTE.update({k: float(first.info["profile"][k]) - emulated.get(k, 0.0)
                                 for k in ("prefill_s", "decode_s")})
        steps = first.info["profile"].get("batch_step_s")
        if steps:  # the measured batch curve too, so that every node is planned with the same one
            MEASURED_COMPUTE["batch_step_s"] = [t - emulated.get("decode_s", 0.0) for t in steps]
        if log is not None:
            log(f"  measured compute (quiet node): prefill {MEASURED_COMPUTE['prefill_s'] * 1e3:.3f} ms, decode "
                f"{MEASURED_COMPUTE['decode_s'] * 1e3:.3f} ms per block per token")
        peers.append(first)
        hosts = hosts[1:]
    peers += [swarm.add_node(node_id=h, wan_host=h, memory_gb=memory_gb[h], wait=False,
                             declared_profile=dict(MEASURED_COMPUTE), **node_kw, **emulation(h)) for h in hosts]
    for peer in peers:
        swarm.wait_profiled(peer, timeout=180)
    return peers


# ---------------------------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class Scaling:
    """How the Azure trace is shrunk for the CPU swarm."""

    time_scale: float = 2.0  # arrivals at (t_i − t_0)/time_scale: 2 = twice the trace's rate
    input_scale: float = 16.0  # prompt tokens = ceil(ContextTokens / input_scale)
    max_input: int = 192  # ... clipped (the session holds SESSION_TOKENS = prompt + output)
    max_output: int = 64  # GeneratedTokens clipped (the trace's P95 is 90, max 1899)
    offset: int = 0  # first trace row used
    num_requests: int = 300


def scaled_trace(scaling: Scaling) -> dict[str, np.ndarray]:
    from experiments.sim.simulator import load_trace

    trace = load_trace()
    lo, hi = scaling.offset, scaling.offset + scaling.num_requests
    arrivals = (trace.offsets[lo:hi] - trace.offsets[lo]) / scaling.time_scale
    inputs = np.minimum(np.ceil(trace.input_tokens[lo:hi] / scaling.input_scale), scaling.max_input).astype(int)
    outputs = np.minimum(trace.output_tokens[lo:hi], scaling.max_output).astype(int)
    return {"arrivals": arrivals, "input_tokens": np.maximum(inputs, 1), "output_tokens": np.maximum(outputs, 1)}


class Prompts:
    """Prompt texts of an exact token length for the experiment tokenizer (deterministic)."""

    def __init__(self, model_dir: str, seed: int = 0):
        from swarm.model.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        rng = np.random.default_rng(seed)
        ids = rng.integers(300, self.tokenizer.vocab_size - 1, size=4096).tolist()
        self.base = self.tokenizer.decode(ids, skip_special_tokens=True)
        self._cache: dict[int, str] = {}

    def length(self, text: str) -> int:
        return len(self.tokenizer(text).input_ids)

    def text(self, tokens: int) -> str:
        """A prompt of ``tokens`` tokens (bos included), or the closest shorter one."""
        if tokens in self._cache:
            return self._cache[tokens]
        lo, hi = 1, len(self.base)
        while lo < hi:  # longest prefix (in characters) with at most ``tokens`` tokens
            mid = (lo + hi + 1) // 2
            if self.length(self.base[:mid]) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        text = self.base[:lo]
        self._cache[tokens] = text
        return text


class SharedPrefixPrompts(Prompts):
    """Prompts that start with their client's own ``prefix_tokens``-token prefix (a per-client system prompt),
    followed by request-specific text; every prompt has exactly its record's ``input_tokens`` tokens (or the
    closest shorter length). The prefix ends at a word boundary, so the client's prompts share its tokens
    and the orchestrator's prefix pages match."""

    def __init__(self, model_dir: str, prefix_tokens: int, seed: int = 0):
        super().__init__(model_dir, seed)
        self.prefix_tokens = int(prefix_tokens)
        self._prefixes: dict[str, str] = {}
        self._bodies: dict[int, str] = {}

    def _base(self, seed: int) -> str:
        rng = np.random.default_rng(seed)
        ids = rng.integers(300, self.tokenizer.vocab_size - 1, size=2048).tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _fit(self, head: str, body: str, tokens: int) -> str:
        lo, hi = 0, len(body)
        while lo < hi:  # longest body prefix (characters) with head + body at most ``tokens`` tokens
            mid = (lo + hi + 1) // 2
            if self.length(head + body[:mid]) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        return head + body[:lo]

    def prefix(self, client: str) -> str:
        if client not in self._prefixes:
            seed = int.from_bytes(client.encode()[:8].ljust(8, b"\0"), "little") % 2**31
            text = self._fit("", self._base(seed), self.prefix_tokens)
            cut = text.rfind(" ")
            self._prefixes[client] = text[:cut] if cut > 0 else text
        return self._prefixes[client]

    def prompt_for(self, record: "Record") -> str:
        prefix = self.prefix(record.client)
        if record.index not in self._bodies:
            self._bodies[record.index] = " " + self._base(10_000 + record.index).lstrip()
        return self._fit(prefix, self._bodies[record.index], record.input_tokens)


# -------------------------------------------------------------------------------------------- records


@dataclass
class Record:
    index: int
    client: str
    arrival: float  # scheduled submission, s after the run's start
    input_tokens: int
    output_tokens: int
    submitted: float = math.nan
    started: float = math.nan
    completed: float = math.nan
    generated: int = 0
    chain: str | None = None
    servers: list | None = None  # the servers of the chain (or WS-RR path) that served it
    error: str | None = None
    failed_at: float = math.nan  # when a failed request gave up (s after t0)

    @property
    def response(self) -> float:
        return self.completed - self.submitted

    @property
    def waiting(self) -> float:
        return self.started - self.submitted

    @property
    def service(self) -> float:
        return self.completed - self.started


def summary(values: Sequence[float]) -> dict[str, float]:
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=float)
    if v.size == 0:
        return {k: math.nan for k in ("mean", "median", "p95", "p99", "min", "max")}
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p95": float(np.percentile(v, 95)),
            "p99": float(np.percentile(v, 99)), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def table_stats(records: Sequence[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    return {"response": summary([r.response for r in ok]), "waiting": summary([r.waiting for r in ok]),
            "service": summary([r.service for r in ok]), "completed": len(ok), "failed": len(records) - len(ok)}


# -------------------------------------------------------------------------------------------- drivers


def replay(records: Sequence[Record], submit: Callable[[Record, float], None], *, max_workers: int = 256,
           deadline_s: float = 1800.0) -> float:
    """Submit every record at its ``arrival`` (s after now) on its own thread; return the run's t0.

    ``submit(record, t0)`` must block until the request completes and fill in the record's times
    (``time.monotonic() - t0``)."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="replay") as pool:
        def one(record: Record) -> None:
            delay = record.arrival - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)
            record.submitted = time.monotonic() - t0
            try:
                submit(record, t0)
            except Exception as exc:  # noqa: BLE001 — recorded, counted as failed
                record.error = f"{type(exc).__name__}: {exc}"[:300]
                record.failed_at = time.monotonic() - t0

        futures = [pool.submit(one, r) for r in records]
        end = t0 + deadline_s
        for f in futures:
            f.result(timeout=max(1.0, end - time.monotonic()))
    return t0


class OrchestratorDriver:
    """Sends records to ``POST /v1/completions`` (greedy, exact prompt lengths)."""

    def __init__(self, url: str, prompts: Prompts, *, api_keys: dict[str, str] | None = None,
                 timeout_s: float = 900.0, cutoff_s: float | None = None):
        """``cutoff_s``: no request waits past this many seconds after the run's t0; one still unanswered
        then fails with ``"unfinished at cutoff"`` (bounded run length under overload)."""
        import httpx

        self.cutoff_s = cutoff_s

        self.http = httpx.Client(base_url=url, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))
        self.prompts = prompts
        self.keys = {client: key for key, client in (api_keys or {}).items()}

    def __call__(self, record: Record, t0: float) -> None:
        prompt_for = getattr(self.prompts, "prompt_for", None)
        prompt = prompt_for(record) if prompt_for is not None else self.prompts.text(record.input_tokens)
        body = {"prompt": prompt, "max_tokens": record.output_tokens,
                "temperature": 0}
        headers = {}
        if record.client in self.keys:
            headers["Authorization"] = f"Bearer {self.keys[record.client]}"
        else:
            body["user"] = record.client
        if self.cutoff_s is None:
            response = self.http.post("/v1/completions", json=body, headers=headers)
        else:
            import httpx

            left = self.cutoff_s - (time.monotonic() - t0)
            try:
                response = self.http.post("/v1/completions", json=body, headers=headers,
                                          timeout=httpx.Timeout(max(1.0, left), connect=10.0))
            except httpx.TimeoutException:
                raise RuntimeError("unfinished at cutoff") from None
        done = time.monotonic() - t0
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        doc = response.json()
        timing = doc["chainswarm"]
        record.completed = done
        record.started = done - timing["service_s"]
        record.generated = doc["usage"]["completion_tokens"]
        record.chain = timing["chain_id"]
        record.servers = timing.get("servers")

    def close(self) -> None:
        self.http.close()


_route_times = threading.local()


def _install_petals_start_probe() -> None:
    """Record, per thread, the time of the last route choice made during a session's first step."""
    from petals.client.inference_session import InferenceSession

    if getattr(InferenceSession, "_chainswarm_probe", False):
        return
    original = InferenceSession._update_sequence

    def _update_sequence(self, server_idx, block_idx, attempt_no):
        result = original(self, server_idx, block_idx, attempt_no)
        if self._position == 0:
            _route_times.last = time.monotonic()
        return result

    InferenceSession._update_sequence = _update_sequence
    InferenceSession._chainswarm_probe = True


class PetalsDriver:
    """The PETALS baseline's client: petals' own routing (min-latency Dijkstra, retries with back-off),
    one concurrent session per request, as a petals application would run them."""

    def __init__(self, model_dir: str, initial_peers: list[str], dht_prefix: str, prompts: Prompts, *,
                 use_server_to_server: bool, max_retries: int | None = None):
        import torch

        from swarm.model.compat import petals

        _install_petals_start_probe()
        self.model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=list(initial_peers), dht_prefix=dht_prefix, show_route=False,
            torch_dtype=torch.float32, use_server_to_server=use_server_to_server, max_retries=max_retries,
        )
        self.model.eval()
        self.prompts = prompts
        self.eos = prompts.tokenizer.eos_token_id
        self.routes: list[list] = []

    @property
    def sequence_manager(self):
        return self.model.transformer.h.sequence_manager

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until petals' routing table covers every block and the client has pinged the servers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.sequence_manager.make_sequence(mode="min_latency")  # starts petals' updater thread
                self.sequence_manager.update(wait=True)
                return
            except Exception:  # noqa: BLE001 — not every block is served yet
                time.sleep(1.0)
        raise TimeoutError("petals' client never saw every block served")

    def __call__(self, record: Record, t0: float) -> None:
        import torch

        ids = self.prompts.tokenizer(self.prompts.text(record.input_tokens), return_tensors="pt").input_ids
        _route_times.last = math.nan
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=record.output_tokens,
                                      do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos)
        record.completed = time.monotonic() - t0
        record.started = _route_times.last - t0
        record.generated = int(out.shape[1] - ids.shape[1])

    def close(self) -> None:
        from swarm.engine.petals_client import close_distributed_model

        close_distributed_model(self.model)


def records_to_json(records: Sequence[Record]) -> list[dict]:
    out = []
    for r in records:
        d = asdict(r)
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None
            elif isinstance(v, float):
                d[k] = round(v, 5)
        out.append(d)
    return out


def machine_note() -> str:
    import os

    return f"{os.cpu_count()} CPU cores"

