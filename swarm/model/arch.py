"""What a checkpoint's ``config.json`` says about its transformer blocks, family by family, in one plain object.

Chainswarm owns its block math (:mod:`swarm.model.block`); transformers is kept for configs and tokenizers only.
:func:`arch_from_config` reads a config written by an older transformers (``rope_scaling``, ``rope_theta``,
``torch_dtype``, ``sliding_window_pattern``) or a current one (``rope_parameters``, ``dtype``, ``layer_types``)
into an :class:`ArchSpec`: the shapes, norms, biases, activation, query scale, embedding scale and, per layer,
the attention window and the rotary embedding. Each supported family is a small strategy object
(:data:`FAMILIES`); anything else is refused with a one-line :class:`UnsupportedModel` that names them. A rope
scaling this code does not implement is refused too: serving it with plain RoPE would answer wrong text.

Plain Python (no torch, no transformers): the planner's per-block memory and the device checks read it too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

ROPE_KINDS = ("default", "linear", "dynamic", "llama3")


class UnsupportedModel(ValueError):
    """A checkpoint Chainswarm cannot serve correctly (its family or one of its features)."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: ``theta`` (base), ``kind`` (:data:`ROPE_KINDS`) and its parameters.

    ``original_max`` is the context the frequencies were trained for (``llama3``: ``original_max_position_embeddings``;
    ``dynamic``: ``max_position_embeddings``, past which the base grows with the sequence)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max: int = 2048
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclass(frozen=True)
class LayerSpec:
    """What differs between layers: the attention window (None: full attention) and the rotary embedding."""

    window: int | None
    rope: RopeSpec


@dataclass(frozen=True)
class ArchSpec:
    """The block architecture of one checkpoint (the paper's per-block memory ``s_m`` and cache size come from it)."""

    family: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + w)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # Gemma 3: post-attention and pre/post-feedforward norms around each sublayer
    activation: str = "silu"  # or "gelu_tanh"
    query_scale: float = 0.0  # multiplies q·k; 0 means head_dim ** -0.5
    embed_scale: float = 1.0
    tie_word_embeddings: bool = False
    final_logit_softcap: float | None = None
    layers: tuple[LayerSpec, ...] = field(default_factory=tuple)
    dtype: str | None = None

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    def layer(self, index: int) -> LayerSpec:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} outside 0..{self.num_layers - 1}")
        return self.layers[index]

    @property
    def uniform_layers(self) -> bool:
        return all(layer == self.layers[0] for layer in self.layers)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes one token's keys and values take in one block's cache (real head_dim and KV heads)."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def block_params(self) -> int:
        """Parameters of one block (what a server loads per block)."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        norms = h * (4 if self.sandwich_norms else 2) + (2 * self.head_dim if self.qk_norm else 0)
        return attn + mlp + norms


# -- reading configs -----------------------------------------------------------------------------------------


def _rope(params: Mapping[str, Any], theta: float, max_positions: int) -> RopeSpec:
    kind = str(params.get("rope_type", params.get("type", "default")) or "default")
    if kind not in ROPE_KINDS:
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")
    theta = float(params.get("rope_theta", theta))
    factor = float(params.get("factor", 1.0) or 1.0)
    original = int(params.get("original_max_position_embeddings") or max_positions)
    return RopeSpec(theta=theta, kind=kind, factor=factor, original_max=original,
                    low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(params.get("high_freq_factor", 4.0)))


def rope_for(cfg: Mapping[str, Any], layer_type: str = "full_attention", *, local_theta: float | None = None) -> RopeSpec:
    """The rotary embedding of layers of ``layer_type``, from either config format.

    Current transformers write ``rope_parameters`` (one dict, or one per layer type, e.g. Gemma 3's
    ``full_attention``/``sliding_attention``); older ones ``rope_theta`` + ``rope_scaling`` (and Gemma 3's
    ``rope_local_base_freq`` for its sliding layers, which never scale)."""
    max_positions = int(cfg.get("max_position_embeddings") or 2048)
    theta = float(cfg.get("rope_theta", 10000.0) or 10000.0)
    params = cfg.get("rope_parameters")
    if params:
        if layer_type in params and isinstance(params[layer_type], Mapping):
            params = params[layer_type]
        elif any(isinstance(v, Mapping) for v in params.values()):
            raise UnsupportedModel(f"rope_parameters has no entry for {layer_type!r} layers")
        return _rope(params, theta, max_positions)
    if local_theta is not None:
        return RopeSpec(theta=float(local_theta), original_max=max_positions)
    return _rope(cfg.get("rope_scaling") or {}, theta, max_positions)


def _layer_types(cfg: Mapping[str, Any], layers: int, default_window: int | None) -> list[str]:
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise UnsupportedModel(f"layer_types lists {len(types)} layers, the model has {layers}")
        for t in types:
            if t not in ("full_attention", "sliding_attention"):
                raise UnsupportedModel(f"layer type {t!r} is not supported")
        return list(types)
    kind = "sliding_attention" if default_window else "full_attention"
    return [kind] * layers


class Family:
    """One model family: how its config reads into an :class:`ArchSpec` (subclasses set the differences)."""

    name = ""
    model_types: tuple[str, ...] = ()
    tie_default = False
    qkv_bias = False
    qk_norm = False
    gemma = False

    def window(self, cfg: Mapping[str, Any]) -> int | None:
        return None

    def layer_types(self, cfg: Mapping[str, Any], layers: int) -> list[str]:
        return _layer_types(cfg, layers, self.window(cfg))

    def layer_rope(self, cfg: Mapping[str, Any], layer_type: str) -> RopeSpec:
        return rope_for(cfg, layer_type)

    def parse(self, cfg: Mapping[str, Any]) -> ArchSpec:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        window = self.window(cfg) or cfg.get("sliding_window")
        specs = tuple(LayerSpec(window=int(window) if t == "sliding_attention" and window else None,
                                rope=self.layer_rope(cfg, t))
                      for t in self.layer_types(cfg, layers))
        act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
        if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModel(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
        return ArchSpec(
            family=self.name, model_type=str(cfg.get("model_type")), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            norm_offset=1.0 if self.gemma else 0.0,
            qkv_bias=bool(cfg.get("attention_bias", self.qkv_bias)) or self.qkv_bias,
            o_bias=bool(cfg.get("attention_bias", False)) and not self.qkv_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=self.qk_norm, sandwich_norms=self.gemma,
            activation="silu" if act == "silu" else "gelu_tanh",
            query_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if self.gemma else 0.0,
            embed_scale=math.sqrt(hidden) if self.gemma else 1.0,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", self.tie_default)),
            final_logit_softcap=cfg.get("final_logit_softcapping") if self.gemma else None,
            layers=specs, dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )


class Llama(Family):
    name, model_types = "llama", ("llama",)


class Mistral(Family):
    name, model_types = "mistral", ("mistral",)

    def window(self, cfg):
        return cfg.get("sliding_window")


class Qwen2(Family):
    name, model_types, qkv_bias = "qwen2", ("qwen2",), True

    def window(self, cfg):
        return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None

    def layer_types(self, cfg, layers):
        if cfg.get("layer_types") or not self.window(cfg):
            return _layer_types(cfg, layers, None)
        first = int(cfg.get("max_window_layers", layers))  # transformers: layers from max_window_layers on slide
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


class Qwen3(Qwen2):
    name, model_types, qkv_bias, qk_norm = "qwen3", ("qwen3",), False, True


class Gemma3(Family):
    name, model_types, tie_default, qk_norm, gemma = "gemma3", ("gemma3_text",), True, True, True

    def window(self, cfg):
        return cfg.get("sliding_window")

    def layer_types(self, cfg, layers):
        if cfg.get("layer_types"):
            return _layer_types(cfg, layers, None)
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]

    def layer_rope(self, cfg, layer_type):
        if layer_type == "sliding_attention" and not cfg.get("rope_parameters"):
            return rope_for(cfg, layer_type, local_theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        return rope_for(cfg, layer_type)


FAMILIES: dict[str, Family] = {t: f for f in (Llama(), Mistral(), Qwen2(), Qwen3(), Gemma3()) for t in f.model_types}
SUPPORTED = "llama (1/2/3.x), mistral, qwen2 (Qwen2/2.5), qwen3, gemma3 (text)"


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: a multimodal Gemma 3 wrapper's ``text_config``, else the config itself."""
    if cfg.get("model_type") == "gemma3" and isinstance(cfg.get("text_config"), Mapping):
        return {"model_type": "gemma3_text", **cfg["text_config"]}
    return cfg


def family_of(cfg: Mapping[str, Any]) -> Family:
    model_type = text_config(cfg).get("model_type")
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise UnsupportedModel(f"model type {model_type!r} is not supported; Chainswarm serves {SUPPORTED}")
    return family


def arch_from_config(cfg: Mapping[str, Any]) -> ArchSpec:
    """The :class:`ArchSpec` of a checkpoint config (a ``config.json`` dict, or a transformers config's
    ``to_dict()``). Raises :class:`UnsupportedModel` with a one-line reason."""
    cfg = text_config(cfg)
    try:
        return family_of(cfg).parse(cfg)
    except KeyError as exc:
        raise UnsupportedModel(f"config.json lacks {exc.args[0]!r}") from None

