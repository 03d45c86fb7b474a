"""What each GGUF architecture means in Hugging Face terms: tensor names, q/k row order, norm offsets, config.

llama.cpp's ``convert_hf_to_gguf.py`` writes each family its own way, and :mod:`swarm.model.gguf` undoes it
with the table here:

* ``llama`` (Llama 1/2/3.x and Mistral 7B, which llama.cpp writes as ``llama``): q/k rows are permuted per head
  (rotary halves interleaved) and must be un-permuted. Llama 3.1+'s rope scaling travels as the ``rope_freqs``
  tensor (one divisor per frequency) rather than as keys; :func:`llama3_rope_from_factors` recovers the
  ``llama3`` parameters from it and checks that they reproduce every factor. A ``llama.attention.sliding_window``
  key (Mistral v0.1's window) makes the checkpoint a ``mistral`` one.
* ``qwen2`` (q/k/v biases) and ``qwen3`` (per-head q/k RMSNorm): written in transformers' row order, no permutation.
* ``gemma3``: no permutation; every ``*norm.weight`` was stored as ``1 + w`` (Gemma computes ``(1 + w)·x̂``), so 1
  is subtracted; layers alternate local (sliding window, rope base ``rope.freq_base_swa`` or 10,000) and global
  attention, every 6th layer global unless ``attention.sliding_window_pattern`` says otherwise; the query scale
  is ``attention.scale`` when present, else ``1/sqrt(key_length)`` (``1/sqrt(hidden/heads)`` for the 62-layer
  27B, as llama.cpp does); ``final_logit_softcapping`` when present.

Anything else is refused with one line naming the supported architectures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

_COMMON_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_BLOCK = {**_COMMON_BLOCK, "ffn_norm.weight": "post_attention_layernorm.weight"}
_QWEN2_BLOCK = {**_LLAMA_BLOCK, "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                "attn_v.bias": "self_attn.v_proj.bias"}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_QWEN3_BLOCK = {**_LLAMA_BLOCK, **_QK_NORMS}
_GEMMA3_BLOCK = {
    **_COMMON_BLOCK, **_QK_NORMS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: per-frequency divisors, metadata rather than a weight


class GGUFFamilyError(ValueError):
    """The architecture or one of its hyper-parameters cannot be converted (one-line message)."""


@dataclass(frozen=True)
class ModelShape:
    """The hyper-parameters of a GGUF in transformers' terms (``config`` is the config.json to write)."""

    arch: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    config: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class GGUFFamily:
    """How one GGUF architecture maps onto transformers' checkpoint layout."""

    arch: str
    block: dict[str, str]
    permute_qk: bool  # llama.cpp interleaved the rotary halves of q/k rows
    norm_shift: float  # llama.cpp stored norm weights + this
    build: Callable[[Any, dict, int], tuple[str, dict]]  # (meta, common config, layers) -> (model_type, extra config)

    def hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in TOP_TENSORS:
            return TOP_TENSORS[gguf_name]
        prefix, _, rest = gguf_name.partition(".")
        block, _, suffix = rest.partition(".")
        if prefix == "blk" and block.isdigit() and suffix in self.block:
            return f"model.layers.{int(block)}.{self.block[suffix]}"
        return None

    def shifted(self, hf_name: str) -> bool:
        return bool(self.norm_shift) and hf_name.endswith("norm.weight")


def _key(meta, arch: str, name: str, default: Any = None, required: bool = False) -> Any:
    full = f"{arch}.{name}"
    if full in meta.values:
        return meta.values[full]
    if required:
        raise GGUFFamilyError(f"the GGUF lacks the required key {full!r}")
    return default


def _llama(meta, common: dict, layers: int) -> tuple[str, dict]:
    window = _key(meta, "llama", "attention.sliding_window")
    extra = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    if window:  # Mistral v0.1 style: every layer attends to the last `window` keys
        return "mistral", {**extra, "sliding_window": int(window), "architectures": ["MistralForCausalLM"]}
    return "llama", {**extra, "architectures": ["LlamaForCausalLM"]}


def _qwen(model_type: str, architecture: str) -> Callable:
    def build(meta, common: dict, layers: int) -> tuple[str, dict]:
        window = _key(meta, model_type, "attention.sliding_window")
        if window:
            raise GGUFFamilyError(f"unsupported {model_type}.attention.sliding_window={window} "
                                  f"(which layers slide is not recorded in the GGUF)")
        return model_type, {"hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
                            "max_window_layers": layers, "attention_bias": model_type == "qwen2",
                            "architectures": [architecture]}
    return build


def _gemma3(meta, common: dict, layers: int) -> tuple[str, dict]:
    window = _key(meta, "gemma3", "attention.sliding_window")
    pattern = _key(meta, "gemma3", "attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one bool per layer: True = sliding
        if len(pattern) != layers:
            raise GGUFFamilyError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        pattern = int(pattern)
        sliding = [pattern > 1 and (i + 1) % pattern != 0 for i in range(layers)]
    if not window:
        sliding = [False] * layers
    scale = _key(meta, "gemma3", "attention.scale")
    if scale:
        query_pre_attn_scalar = 1.0 / float(scale) ** 2
        if abs(query_pre_attn_scalar - round(query_pre_attn_scalar)) < 1e-3:
            query_pre_attn_scalar = int(round(query_pre_attn_scalar))
    elif layers == 62:  # Gemma 3 27B: llama.cpp scales by hidden/heads (168), not head_dim (128)
        query_pre_attn_scalar = common["hidden_size"] // common["num_attention_heads"]
    else:
        query_pre_attn_scalar = common["head_dim"]
    softcap = _key(meta, "gemma3", "final_logit_softcapping")
    return "gemma3_text", {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": int(window) if window else None,
        "sliding_window_pattern": pattern if isinstance(pattern, int) else None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": float(_key(meta, "gemma3", "rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": float(softcap) if softcap else None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", _LLAMA_BLOCK, True, 0.0, _llama),
    "qwen2": GGUFFamily("qwen2", _QWEN2_BLOCK, False, 0.0, _qwen("qwen2", "Qwen2ForCausalLM")),
    "qwen3": GGUFFamily("qwen3", _QWEN3_BLOCK, False, 0.0, _qwen("qwen3", "Qwen3ForCausalLM")),
    "gemma3": GGUFFamily("gemma3", _GEMMA3_BLOCK, False, 1.0, _gemma3),
}
SUPPORTED_ARCHS = "llama (Llama 1/2/3.x, Mistral), qwen2, qwen3, gemma3"


def family_for(arch: Any) -> GGUFFamily:
    if arch not in FAMILIES:
        raise GGUFFamilyError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHS}")
    return FAMILIES[arch]


# -- llama3 rope from rope_freqs ----------------------------------------------------------------------------


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: float) -> list[float]:
    """The divisors llama.cpp stores for these llama3 parameters (its converter's formula, in float64)."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_rope_from_factors(factors: list[float], theta: float, dim: int) -> dict:
    """The ``llama3`` rope scaling whose per-frequency divisors are ``factors`` (llama.cpp's ``rope_freqs``).

    The divisors only fix ``original_max / low_freq_factor`` and ``original_max / high_freq_factor``; Llama 3.x
    uses ``low_freq_factor=1``, ``high_freq_factor=4``, so those are tried first (``original_max`` from a
    smoothed frequency, or 8192 when none is smoothed), then a general fit. The result must reproduce every
    divisor to 1e-4 relative, else the GGUF is refused."""
    if len(factors) != dim // 2:
        raise GGUFFamilyError(f"rope_freqs has {len(factors)} entries, expected {dim // 2}")
    factor = max(factors)
    if factor <= 1.0 + 1e-6:
        return {}
    wavelens = [2 * math.pi * theta ** (i / dim) for i in range(0, dim, 2)]
    medium = [(w, (1 / f - 1 / factor) / (1 - 1 / factor)) for w, f in zip(wavelens, factors)
              if 1 + 1e-6 < f < factor * (1 - 1e-6)]  # (wavelength, smooth)
    candidates: list[tuple[float, float, float]] = []
    if medium:
        w, s = medium[0]
        candidates.append((1.0, 4.0, w * (3 * s + 1)))  # smooth = (orig/w - 1)/3
        if len(medium) >= 2:  # smooth = a/w + b with a = orig/(high-low), b = -low/(high-low); take low = 1
            (w1, s1), (w2, s2) = medium[0], medium[-1]
            a = (s1 - s2) / (1 / w1 - 1 / w2)
            b = s1 - a / w1
            if b < 0:
                high = 1 - 1 / b
                candidates.append((1.0, high, a * (high - 1)))
    else:
        unscaled = [w for w, f in zip(wavelens, factors) if f <= 1 + 1e-6]
        scaled = [w for w, f in zip(wavelens, factors) if f >= factor * (1 - 1e-6)]
        lo, hi = 4 * max(unscaled, default=0.0), min(scaled, default=float("inf"))  # orig in (lo, hi] for 1/4
        candidates.append((1.0, 4.0, 8192.0 if lo < 8192 <= hi else (lo + hi) / 2 if hi < float("inf") else lo * 2))
    for low, high, original in candidates:
        if abs(original - round(original)) < 1e-3 * original:
            original = float(round(original))
        want = _llama3_factors(theta, dim, factor, low, high, original)
        if all(abs(x - y) <= 1e-4 * max(abs(x), 1.0) for x, y in zip(want, factors)):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": int(round(original))}
    raise GGUFFamilyError("rope_freqs does not match any llama3 rope scaling (unsupported rope frequencies)")


# -- reading the hyper-parameters ---------------------------------------------------------------------------


def read_shape(meta, embedding_rows: int, rope_freqs: list[float] | None = None) -> tuple[GGUFFamily, ModelShape]:
    """The family and hyper-parameters of a GGUF from its ``<arch>.*`` keys (refusing what it cannot convert)."""
    arch = meta.get("general.architecture")
    family = family_for(arch)
    experts = int(_key(meta, arch, "expert_count", 0) or 0)
    if experts > 0:
        raise GGUFFamilyError(f"unsupported mixture-of-experts model ({arch}.expert_count={experts})")
    hidden = int(_key(meta, arch, "embedding_length", required=True))
    heads = int(_key(meta, arch, "attention.head_count", required=True))
    kv_heads = int(_key(meta, arch, "attention.head_count_kv", heads))
    layers = int(_key(meta, arch, "block_count", required=True))
    if heads % kv_heads:
        raise GGUFFamilyError(f"inconsistent heads: {heads} heads, {kv_heads} kv heads")
    head_dim = int(_key(meta, arch, "attention.key_length", 0) or (hidden // heads if hidden % heads == 0 else 0))
    if not head_dim:
        raise GGUFFamilyError(f"cannot tell the head size: hidden {hidden} is not a multiple of {heads} heads")
    value_length = int(_key(meta, arch, "attention.value_length", head_dim))
    rope_dims = int(_key(meta, arch, "rope.dimension_count", head_dim))
    if value_length != head_dim or rope_dims != head_dim:
        raise GGUFFamilyError(f"unsupported head layout: key_length {head_dim}, value_length {value_length}, "
                              f"rope.dimension_count {rope_dims} (partial rotary or k/v size mismatch)")
    theta = float(_key(meta, arch, "rope.freq_base", 10000.0))
    context = int(_key(meta, arch, "context_length", 2048))
    scaling_type = _key(meta, arch, "rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_key(meta, arch, "rope.scaling.factor", required=True))}
    elif scaling_type not in (None, "none"):
        raise GGUFFamilyError(f"unsupported rope scaling type {scaling_type!r} (supported: linear, llama3)")
    if rope_freqs is not None:
        if arch != "llama" or rope_scaling:
            raise GGUFFamilyError(f"unsupported rope_freqs tensor in a {arch} GGUF with rope scaling {scaling_type!r}")
        rope_scaling = llama3_rope_from_factors(rope_freqs, theta, head_dim) or None
        if rope_scaling:
            original = rope_scaling["original_max_position_embeddings"]
            context = max(context, original)
    token_id = lambda key: None if meta.get(f"tokenizer.ggml.{key}_token_id") is None else int(  # noqa: E731
        meta.get(f"tokenizer.ggml.{key}_token_id"))
    common = {
        "vocab_size": embedding_rows, "hidden_size": hidden,
        "intermediate_size": int(_key(meta, arch, "feed_forward_length", required=True)),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "max_position_embeddings": context,
        "rms_norm_eps": float(f"{float(_key(meta, arch, 'attention.layer_norm_rms_epsilon', 1e-5 if arch == 'llama' else 1e-6)):.7g}"),  # float32 in the file
        "rope_theta": theta, "rope_scaling": rope_scaling,
        "bos_token_id": token_id("bos"), "eos_token_id": token_id("eos"), "pad_token_id": token_id("padding"),
    }
    model_type, extra = family.build(meta, common, layers)
    config = {"model_type": model_type, **common, **extra}
    shape = ModelShape(arch=arch, model_type=model_type, layers=layers, hidden=hidden,
                       intermediate=common["intermediate_size"], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       vocab=embedding_rows, context_length=context, rms_norm_eps=common["rms_norm_eps"],
                       rope_theta=theta, rope_scaling=rope_scaling, config=config)
    return family, shape


def expected_shape(hf_name: str, shape: ModelShape) -> tuple[int, ...]:
    """The torch shape a converted tensor must have."""
    q, kv, h, i = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
    leaf = ".".join(hf_name.rsplit(".", 2)[-2:])
    table = {
        "embed_tokens.weight": (shape.vocab, h), "lm_head.weight": (shape.vocab, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "q_norm.weight": (shape.head_dim,), "k_norm.weight": (shape.head_dim,),
        "gate_proj.weight": (i, h), "up_proj.weight": (i, h), "down_proj.weight": (h, i),
    }
    return table.get(leaf, (h,))
