"""What a volunteer server measures about itself before the orchestrator plans with it.

The profile has three parts (chain-composition spec §2.3, §2.7; petals-integration spec §6.1.3-6.1.4):

* **memory** — the budget for blocks plus KV cache: ``--memory-gb`` if given, else the free GPU memory or
  the available host memory minus a safety margin; together with the bytes of one block (petals'
  ``get_block_size`` for the dtype and quantisation) and the KV bytes of one token on one block;
* **compute** — per block and per token: the decode time (one token with a growing KV cache) and the
  prefill time (a forward over many tokens), timed on one randomly initialised block of the real
  architecture with a timed forward and decode of a block built as petals builds it. The result is cached in a JSON file keyed by the model
  config's fingerprint, the device, dtype and quantisation, so a restarted server skips the measurement;
* **batching** — the per-block time of one decode step of b sessions, b ∈ {1, 2, 4, 8, 16}
  (:func:`batch_step_times`): measured once on a random block with the server's batched step
  (:mod:`server.batch_profile`) and cached next to the compute times; a server whose pool runs one session at a
  time (``--max-batch 1``) publishes b × its one-session step without measuring;
* **communication** — the round-trip time to the orchestrator's peer, pinged over the swarm (:mod:`server.rtt`).

The orchestrator turns the per-token times into the planner's per-job times with :func:`job_compute_time`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

GIB = 1024**3
CACHE_FILE = "compute_profile_v1.json"
# Keys of a model config that do not change the architecture (paths, versions, bookkeeping).
_NON_ARCHITECTURE_KEYS = {"transformers_version", "dht_prefix", "architectures", "torch_dtype"}


# -- memory ----------------------------------------------------------------------------------------------


def usable_memory_bytes(
    device: Any = "cpu",
    memory_gb: Optional[float] = None,
    *,
    margin_fraction: float = 0.1,
    margin_bytes: int = 256 * 1024**2,
) -> int:
    """Bytes this server may spend on blocks and KV cache.

    An explicit ``memory_gb`` budget wins. Otherwise: free memory of the CUDA device
    (``torch.cuda.mem_get_info``) or available host memory (``psutil``), minus ``margin_fraction`` of it and
    ``margin_bytes`` for activations, allocator slack and the process itself.
    """
    if memory_gb is not None:
        if not (memory_gb > 0 and math.isfinite(memory_gb)):
            raise ValueError(f"memory budget must be a positive number of GiB, got {memory_gb}")
        return int(memory_gb * GIB)
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return max(0, int(free * (1.0 - margin_fraction)) - int(margin_bytes))


def block_bytes(config, torch_dtype, quant_type, *, cache_dir: Optional[str | os.PathLike] = None) -> int:
    """Weights of one transformer block as this server will hold them (dtype and quantisation included),
    by petals' ``get_block_size``. With ``cache_dir`` the result is cached next to the compute times (the
    first call in a process builds a block on the meta device, which takes about a second)."""
    from swarm.model.compat import petals  # noqa: F401
    from petals.server.block_utils import get_block_size

    path = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
    key = "|".join(("block_bytes", config_fingerprint(config), _dtype_name(torch_dtype), _quant(quant_type).name.lower()))
    if path is not None:
        cached = _read_cache(path).get(key)
        if isinstance(cached, int) and cached > 0:
            return cached
    size = int(get_block_size(config, "memory", dtype=_dtype(torch_dtype), quant_type=_quant(quant_type)))
    if path is not None:
        _update_cache(path, key, size)
    return size


def cache_bytes_per_token(config, torch_dtype) -> int:
    """KV cache bytes of one token on one block: keys + values of the KV heads, at the real ``head_dim``."""
    from petals.utils.misc import get_size_in_bytes

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(2 * kv_heads * head_dim * get_size_in_bytes(_dtype(torch_dtype)))


# -- compute ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeTimes:
    """Per block, per token: prefill (forward over a long input) and decode (one token with a KV cache)."""

    prefill_s: float
    decode_s: float
    measured_s: float = 0.0  # how long the measurement itself took
    cached: bool = False  # read from the cache file instead of measured


def config_fingerprint(config) -> str:
    """A short hash of the architecture-relevant part of a model config (not its path or version)."""
    doc = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    doc = {k: v for k, v in doc.items() if not k.startswith("_") and k not in _NON_ARCHITECTURE_KEYS}
    blob = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$CHAINSWARM_CACHE_DIR``, else ``~/.cache/chainswarm``."""
    return Path(os.environ.get("CHAINSWARM_CACHE_DIR") or Path.home() / ".cache" / "chainswarm")


def device_name(device) -> str:
    """A device description that identifies the hardware (a GPU model, not just ``cuda:0``)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu:{os.cpu_count()}x{torch.get_num_threads()}t"
    return device.type


def compute_cache_key(config, device, torch_dtype, quant_type) -> str:
    return "|".join(
        (config_fingerprint(config), device_name(device), _dtype_name(torch_dtype), _quant(quant_type).name.lower())
    )


def measure_block_times(
    config,
    device="cpu",
    torch_dtype="float32",
    quant_type="none",
    *,
    decode_steps: int = 24,
    prefill_tokens: Optional[int] = None,
    prefill_steps: int = 3,
    warmup_steps: int = 2,
    tensor_parallel_devices=None,
) -> ComputeTimes:
    """Time one randomly initialised block of ``config``'s architecture on ``device``.

    The block is built and converted the way a petals server holds it (``convert_block``: tensor-parallel
    wrapper, quantisation). Decode = ``decode_steps`` one-token steps with a KV cache that grows from
    ``prefill_tokens``; prefill = ``prefill_steps`` forwards over ``prefill_tokens`` tokens (default 128 on a
    CPU, 1024 on a GPU, capped by the model's maximum length). Each step is timed separately and the
    lower quartile is kept: the device's speed, not the moments a neighbour process took the CPU.
    """
    import torch

    from swarm.model.compat import petals  # noqa: F401
    from petals.utils.convert_block import convert_block

    device = torch.device(device)
    dtype = _dtype(torch_dtype)
    if prefill_tokens is None:
        prefill_tokens = 128 if device.type == "cpu" else 1024
    max_positions = getattr(config, "max_position_embeddings", None) or prefill_tokens + decode_steps + 1
    prefill_tokens = max(1, min(prefill_tokens, max_positions - decode_steps - warmup_steps - 1))
    devices = tuple(torch.device(d) for d in (tensor_parallel_devices or (device,)))

    def timed(fn):
        _sync(device)
        began = time.perf_counter()
        result = fn()
        _sync(device)
        return time.perf_counter() - began, result

    started = time.perf_counter()
    with torch.inference_mode():
        block = config.block_class(config).to(dtype)
        block = convert_block(block, 0, config, devices, device, quant_type=_quant(quant_type), freeze=True)
        prompt = torch.randn(1, prefill_tokens, config.hidden_size, device=device, dtype=dtype)
        token = torch.randn(1, 1, config.hidden_size, device=device, dtype=dtype)

        prefill = []
        for step in range(warmup_steps + prefill_steps):
            elapsed, (_, cache) = timed(lambda: block.forward(prompt, use_cache=True))
            if step >= warmup_steps:
                prefill.append(elapsed / prefill_tokens)
        decode = []
        for step in range(warmup_steps + decode_steps):
            elapsed, (_, cache) = timed(lambda: block.forward(token, use_cache=True, layer_past=cache))
            if step >= warmup_steps:
                decode.append(elapsed)
    times = ComputeTimes(_lower_quartile(prefill), _lower_quartile(decode), measured_s=time.perf_counter() - started)
    logger.info("block compute on %s (%s, %s): prefill %.3g ms/token, decode %.3g ms/token, measured in %.2f s",
                device_name(device), _dtype_name(dtype), _quant(quant_type).name.lower(),
                times.prefill_s * 1e3, times.decode_s * 1e3, times.measured_s)
    return times


def _lower_quartile(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=4, method="inclusive")[0] if len(samples) > 1 else samples[0]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_times(
    config,
    device="cpu",
    torch_dtype="float32",
    quant_type="none",
    *,
    cache_dir: Optional[str | os.PathLike] = None,
    force: bool = False,
    **measure_options,
) -> ComputeTimes:
    """Per-block per-token compute times, from the cache file if this (model, device, dtype, quant) was
    measured before, else measured now and cached (``force`` re-measures)."""
    path = Path(cache_dir or default_cache_dir()) / CACHE_FILE
    key = compute_cache_key(config, device, torch_dtype, quant_type)
    if not force:
        entry = _read_cache(path).get(key)
        if entry is not None:
            try:
                times = ComputeTimes(float(entry["prefill_s"]), float(entry["decode_s"]), cached=True)
                if times.prefill_s > 0 and times.decode_s > 0:
                    return times
            except (KeyError, TypeError, ValueError):
                logger.warning("ignoring a malformed compute-profile cache entry for %s", key)
    times = measure_block_times(config, device, torch_dtype, quant_type, **measure_options)
    _update_cache(path, key, {**asdict(times), "cached": False, "measured_at": time.time()})
    return times


def batch_cache_key(config, device, torch_dtype, quant_type) -> str:
    return "batch|" + compute_cache_key(config, device, torch_dtype, quant_type)


def measure_batch_factors(config, device="cpu", torch_dtype="float32", quant_type="none", *, num_blocks: int = 4,
                          context: int = 32, repeats: int = 8, passes: int = 2) -> tuple[float, ...]:
    """g(b) = t(b)/t(1) at :data:`planner.service_model.BATCH_SIZES`: the batched decode step of b sessions
    (``context`` cached tokens each) over ``num_blocks`` randomly initialised blocks of ``config``'s
    architecture (one block fits in the CPU's caches and is unrepresentatively fast), relative to one session.
    Each time is the smallest of ``passes`` medians over ``repeats`` steps (the device's speed, not a
    neighbour's load); the factors are made nondecreasing (:meth:`~planner.service_model.BatchCurve.from_step_times`)
    and at most b (a noisy measurement must not model a batch slower than running its sessions in turn). On a
    CPU it runs with one torch thread: with several, contention on a shared machine made the ratios vary
    tenfold here; on a many-core CPU, where larger batches parallelise better, one thread overstates g
    (conservative)."""
    import torch

    from planner.service_model import BATCH_SIZES, BatchCurve
    from server.batch_profile import decode_step_times, random_backends

    device = torch.device(device)
    blocks = max(1, min(num_blocks, getattr(config, "num_hidden_layers", num_blocks) or num_blocks))
    best = [math.inf] * len(BATCH_SIZES)
    threads = torch.get_num_threads()
    try:
        if device.type == "cpu":
            torch.set_num_threads(1)  # stable on a shared CPU (see the docstring)
        with torch.inference_mode():
            backends = random_backends(config, device, _dtype(torch_dtype), _quant(quant_type), num_blocks=blocks)
            for _ in range(passes):
                times = decode_step_times(backends, BATCH_SIZES, context=context, repeats=repeats,
                                          modes=("batched",))
                best = [min(t, times[b]["batched"]) for t, b in zip(best, BATCH_SIZES)]
    finally:
        torch.set_num_threads(threads)
    factors = BatchCurve.from_step_times(best).factors
    return tuple(min(f, b) for f, b in zip(factors, BATCH_SIZES))  # never modelled slower than one at a time


def batch_step_times(config, device="cpu", torch_dtype="float32", quant_type="none", *, max_batch: int,
                     decode_s: float, cache_dir: Optional[str | os.PathLike] = None, force: bool = False,
                     **measure_options) -> tuple[float, ...]:
    """The per-block decode step time of b sessions at each batch size of the published curve, scaled so that
    one session takes ``decode_s`` (the compute profile's decode time): ``b·decode_s`` when the server's pool
    runs one session at a time (``max_batch`` 1, petals' own pool), else ``decode_s·g(b)`` with g measured by
    :func:`measure_batch_factors` once per (model, device, dtype, quantisation) and cached like the compute
    times (``force`` re-measures). The planner applies ``max_batch`` itself (rounds past the bound)."""
    from planner.service_model import BATCH_SIZES

    if max_batch <= 1:
        return tuple(b * decode_s for b in BATCH_SIZES)
    path = Path(cache_dir or default_cache_dir()) / CACHE_FILE
    key = batch_cache_key(config, device, torch_dtype, quant_type)
    factors = None if force else _read_cache(path).get(key)
    if not (isinstance(factors, list) and len(factors) == len(BATCH_SIZES)
            and all(isinstance(f, (int, float)) and f >= 1 for f in factors)):
        started = time.perf_counter()
        factors = list(measure_batch_factors(config, device, torch_dtype, quant_type, **measure_options))
        logger.info("batched decode step on %s: g(b) = %s for b = %s, measured in %.2f s", device_name(device),
                    [round(f, 3) for f in factors], BATCH_SIZES, time.perf_counter() - started)
        _update_cache(path, key, factors)
    return tuple(decode_s * float(f) for f in factors)


def published_batch_steps(declared: dict, config, device, torch_dtype, quant_type, *, max_batch: int,
                          decode_s: float, cache_dir: Optional[str | os.PathLike] = None) -> Optional[tuple]:
    """The batch curve a server publishes (``ServerProfile.batch_step_s``): the declared ``batch_step_s``; none
    when ``prefill_s`` and ``decode_s`` are declared without it (test and experiment profiles keep the planner's
    g ≡ 1); otherwise :func:`batch_step_times` (measured or cached, or b × decode_s for ``max_batch`` 1)."""
    from swarm.trust.records import check_batch_steps

    if "batch_step_s" in declared:
        return check_batch_steps(declared["batch_step_s"])
    if "prefill_s" in declared and "decode_s" in declared:
        return None
    return batch_step_times(config, device, torch_dtype, quant_type, max_batch=max_batch, decode_s=decode_s,
                            cache_dir=cache_dir)


def with_emulated_decode(steps: Optional[tuple], emulated_decode_s: float) -> Optional[tuple]:
    """The curve with an emulated accelerator's decode time added to every point: the emulation is a sleep
    per session (:mod:`server.emulation`), so it does not batch and does not grow with the batch."""
    return None if steps is None else tuple(t + emulated_decode_s for t in steps)


def job_compute_time(prefill_s: float, decode_s: float, mean_input: float, mean_output: float,
                     overhead_s: float = 1e-3) -> float:
    """τp of one block for a whole request (chain-composition spec §2.7, footnote 11):
    ``overhead + prefill_s·l̄_I + decode_s·(l̄_O − 1)``."""
    return overhead_s + prefill_s * mean_input + decode_s * max(0.0, mean_output - 1)


def _read_cache(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _update_cache(path: Path, key: str, entry: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            doc = _read_cache(path)
            doc[key] = entry
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not stop a server: it just re-measures next time
        logger.warning("could not write the compute-profile cache %s: %s", path, exc)


# -- helpers ---------------------------------------------------------------------------------------------


def _dtype(torch_dtype):
    import torch

    if isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    value = getattr(torch, str(torch_dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown torch dtype {torch_dtype!r}")
    return value


def _dtype_name(torch_dtype) -> str:
    return str(_dtype(torch_dtype)).replace("torch.", "")


def _quant(quant_type):
    from swarm.model.compat import petals  # noqa: F401
    from petals.utils.convert_block import QuantType

    if isinstance(quant_type, QuantType):
        return quant_type
    if quant_type is None:
        return QuantType.NONE
    try:
        return QuantType[str(quant_type).upper()]
    except KeyError:
        raise ValueError(f"unknown quantisation {quant_type!r} (choose none, int8 or nf4)") from None
