"""Scenarios of the model-driven simulations (spec chain-composition.md §10.1–10.2, §13.3).

A :class:`Scenario` is one Monte Carlo draw of the paper's BLOOM-176B use case: an orchestrator and ``J``
servers at RIPE Atlas EU anchors (drawn with a seed), a fraction η of them high-performance GPUs, and the
planner's :class:`~planner.model.Server` list with

* τp_j from the GPU type (footnote 11: ``t_o + (F/f_j)·l̄_I + (s_m/b_j)·(l̄_O − 1)``),
* τc_j from the orchestrator–server RTT (§10.2; default ``l̄_O·(RTT + 18 ms)``, configurable).

The RTTs come from :meth:`wan.WanConfig.from_ripe_atlas` (the same derivation and the same seeded
choice of anchors that the live WAN emulation uses, §13.3): ``RTT(i, j) = 0.3·base_i + 0.3·base_j +
0.01 ms/km·haversine(i, j)``. Everything here is pure except that one file read, which is cached.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from planner.model import Chain, ModelSpec, Server

# ------------------------------------------------------------------------------------------------
# §10.1 parameters (BLOOM-176B, NF4)
# ------------------------------------------------------------------------------------------------

BLOOM_176B = ModelSpec(num_blocks=70, block_size_gb=1.32, cache_slot_gb=0.11)
"""L = 70 blocks of s_m = 1.32 GB, s_c = 0.11 GB of KV cache per block per job (2048 tokens)."""

MEAN_INPUT_TOKENS = 2000.0
"""l̄_I (the Azure traces of Splitwise, rounded as in the paper)."""
MEAN_OUTPUT_TOKENS = 20.0
"""l̄_O."""
FLOPS_PER_BLOCK_TOKEN_G = 5.0
"""F, GFLOPs per block per token."""
BLOCK_OVERHEAD_MS = 1.0
"""t_o, per-block overhead per job."""
SERIALIZATION_MS = 18.0
"""PETALS' per-hop, per-step serialization overhead added to every RTT (§10.2)."""

DEFAULT_NUM_SERVERS = 20
DEFAULT_ETA = 0.2
DEFAULT_ARRIVAL_RATE = 0.2
DEFAULT_TARGET_LOAD = 0.7


@dataclass(frozen=True)
class GpuType:
    """A GPU class of §10.1."""

    name: str
    memory_gb: float
    tflops: float
    bandwidth_gb_per_ms: float

    def compute_time_ms(self, mean_input: float = MEAN_INPUT_TOKENS, mean_output: float = MEAN_OUTPUT_TOKENS,
                        *, block_size_gb: float = BLOOM_176B.block_size_gb) -> float:
        """τp (ms) = t_o + (F/f)·l̄_I + (s_m/b)·(l̄_O − 1): prefill compute-bound, decode memory-bound."""
        return (BLOCK_OVERHEAD_MS + FLOPS_PER_BLOCK_TOKEN_G / self.tflops * mean_input
                + block_size_gb / self.bandwidth_gb_per_ms * (mean_output - 1.0))

    def per_token_ms(self, *, block_size_gb: float = BLOOM_176B.block_size_gb) -> tuple[float, float]:
        """(prefill ms per input token, decode ms per output token) for one block."""
        return FLOPS_PER_BLOCK_TOKEN_G / self.tflops, block_size_gb / self.bandwidth_gb_per_ms


HIGH_GPU = GpuType("high (A100 MIG 3g.40gb)", 40.0, 120.0, 1.02)
"""τp = 108.92 ms."""
LOW_GPU = GpuType("low (A100 MIG 2g.20gb)", 20.0, 80.0, 0.51)
"""τp = 175.18 ms."""

# ------------------------------------------------------------------------------------------------
# §10.2 communication time
# ------------------------------------------------------------------------------------------------

COMM_MODELS = ("per-token", "literal", "authors")


def comm_time_ms(rtt_ms: float, model: str = "per-token", mean_output: float = MEAN_OUTPUT_TOKENS,
                 overhead_ms: float = SERIALIZATION_MS) -> float:
    """τc_j (ms) from RTT(o, j) (§10.2, §15.1).

    * ``"per-token"`` (default, [R]): ``l̄_O·(RTT + 18 ms)``, one relayed round trip per generated token.
    * ``"literal"``: ``RTT + 18 ms`` (the paper's sentence read literally).
    * ``"authors"``: ``(RTT + 50 ms) + (l̄_O − 1)·RTT`` (the authors' MATLAB).
    """
    if model == "per-token":
        return mean_output * (rtt_ms + overhead_ms)
    if model == "literal":
        return rtt_ms + overhead_ms
    if model == "authors":
        return (rtt_ms + 50.0) + (mean_output - 1.0) * rtt_ms
    raise ValueError(f"comm model must be one of {', '.join(COMM_MODELS)}, got {model!r}")


# ------------------------------------------------------------------------------------------------
# Scenarios
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScenarioConfig:
    """Everything that defines a family of scenarios; one seed then draws one scenario."""

    num_servers: int = DEFAULT_NUM_SERVERS
    eta: float = DEFAULT_ETA
    arrival_rate: float = DEFAULT_ARRIVAL_RATE
    target_load: float = DEFAULT_TARGET_LOAD
    comm_model: str = "per-token"
    orchestrator: str = "random"
    """"random" (the paper) or "best" (the authors' MATLAB: lowest-latency anchor, high-performance
    servers closest to it)."""
    mean_input: float = MEAN_INPUT_TOKENS
    mean_output: float = MEAN_OUTPUT_TOKENS
    model: ModelSpec = BLOOM_176B
    high: GpuType = HIGH_GPU
    low: GpuType = LOW_GPU

    def with_(self, **changes) -> "ScenarioConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class Scenario:
    """One drawn swarm: servers (planner inputs) plus the geography behind them."""

    config: ScenarioConfig
    seed: int
    servers: tuple[Server, ...]
    high_performance: tuple[bool, ...]
    """Per server: is it a high-performance GPU."""
    rtt_ms: tuple[tuple[float, ...], ...]
    """(J+1)×(J+1) RTT matrix; index 0 is the orchestrator, index j+1 is ``servers[j]``."""
    anchors: tuple[int, ...] = field(default=())
    """RIPE Atlas anchor ids, orchestrator first."""

    @property
    def model(self) -> ModelSpec:
        return self.config.model

    @property
    def arrival_rate(self) -> float:
        return self.config.arrival_rate

    @property
    def target_load(self) -> float:
        return self.config.target_load

    def orchestrator_rtt_ms(self) -> np.ndarray:
        """RTT(o, j) for every server, ms."""
        return np.asarray(self.rtt_ms[0][1:], dtype=np.float64)

    def gpu(self, index: int) -> GpuType:
        return self.config.high if self.high_performance[index] else self.config.low


@functools.lru_cache(maxsize=4096)
def _ripe_draw(num_servers: int, seed: int, eta: float, orchestrator: str):
    from wan import WanConfig  # standard library only; no torch

    wan = WanConfig.from_ripe_atlas(num_servers=num_servers, seed=seed, eta=eta, orchestrator=orchestrator)
    names = wan.names  # client first, then s0..s{J-1}
    high = set(wan.meta.get("high_performance", ()))
    anchors = tuple(int(wan.meta["anchors"][n]["anchor_id"]) for n in names)
    return (tuple(tuple(row) for row in wan.rtt_ms), tuple(n in high for n in names[1:]), anchors)


def build_scenario(config: ScenarioConfig = ScenarioConfig(), seed: int = 0) -> Scenario:
    """Draw one scenario (§10.1, §13.3): orchestrator and servers among RIPE Atlas EU anchors, ⌊η·J⌋
    high-performance servers, τc from RTT by ``config.comm_model``, τp from the GPU type. Deterministic
    for ``(config, seed)``; the anchors and high-performance set match ``WanConfig.from_ripe_atlas`` for
    the same seed."""
    rtt, high, anchors = _ripe_draw(config.num_servers, int(seed), float(config.eta), config.orchestrator)
    servers = []
    for j in range(config.num_servers):
        gpu = config.high if high[j] else config.low
        tau_c = comm_time_ms(rtt[0][j + 1], config.comm_model, config.mean_output)
        tau_p = gpu.compute_time_ms(config.mean_input, config.mean_output, block_size_gb=config.model.block_size_gb)
        servers.append(Server(id=f"s{j:02d}", memory_gb=gpu.memory_gb, comm_time_s=tau_c / 1000.0,
                              compute_time_s=tau_p / 1000.0))
    return Scenario(config, int(seed), tuple(servers), high, rtt, anchors)


# ------------------------------------------------------------------------------------------------
# Per-job service times for trace replay
# ------------------------------------------------------------------------------------------------


def chain_time_coefficients(scenario: Scenario, chain: Chain) -> tuple[float, float, float]:
    """(A, B, C) with T_k(l_I, l_O) = A + B·l_I + C·l_O seconds for one job with l_I input and l_O output
    tokens on ``chain`` (eq. 2 with τc and τp evaluated for that job instead of the means).

    τc_j(l_O) = l_O·(RTT + 18 ms) for the per-token model (other models: their formula with l_O);
    τp_j(l_I, l_O) = t_o + tI_j·l_I + tO_j·(l_O − 1). At (l̄_I, l̄_O) this is exactly ``chain.service_time``.
    """
    index = {s.id: i for i, s in enumerate(scenario.servers)}
    cfg = scenario.config
    a = b = c = 0.0
    for sid, (start, end) in zip(chain.servers, chain.spans):
        j = index[sid]
        rtt = scenario.rtt_ms[0][j + 1]
        # τc is affine in l_O: evaluate at 0 and 1 output tokens
        c0 = comm_time_ms(rtt, cfg.comm_model, 0.0)
        c1 = comm_time_ms(rtt, cfg.comm_model, 1.0) - c0
        t_in, t_out = scenario.gpu(j).per_token_ms(block_size_gb=cfg.model.block_size_gb)
        m = end - start
        a += c0 + m * (BLOCK_OVERHEAD_MS - t_out)
        b += m * t_in
        c += c1 + m * t_out
    return a / 1000.0, b / 1000.0, c / 1000.0


def service_matrix(scenario: Scenario, chains: Sequence[Chain], input_tokens: np.ndarray,
                   output_tokens: np.ndarray) -> np.ndarray:
    """Service time (s) of every job on every chain, shape (jobs, chains)."""
    coef = np.array([chain_time_coefficients(scenario, ch) for ch in chains], dtype=np.float64)  # (K, 3)
    li = np.asarray(input_tokens, dtype=np.float64)[:, None]
    lo = np.asarray(output_tokens, dtype=np.float64)[:, None]
    return coef[None, :, 0] + li * coef[None, :, 1] + lo * coef[None, :, 2]


def describe(config: ScenarioConfig) -> str:
    """One line for figure captions."""
    return (f"BLOOM-176B (L={config.model.num_blocks}), J={config.num_servers}, η={config.eta}, "
            f"λ={config.arrival_rate:g} req/s, ρ̄={config.target_load}, τc={_comm_label(config.comm_model)}")


def _comm_label(model: str) -> str:
    return {"per-token": "l̄_O·(RTT+18 ms)", "literal": "RTT+18 ms", "authors": "(RTT+50)+(l̄_O−1)·RTT"}[model]


def high_count(num_servers: int, eta: float) -> int:
    """⌊η·J⌋ (with float noise removed)."""
    return math.floor(eta * num_servers + 1e-9)
