"""Convert a Llama-architecture GGUF file (llama.cpp's format) into a Hugging Face Llama checkpoint.

The result is an ordinary directory — ``config.json``, ``generation_config.json``, safetensors weights, the
tokenizer files and ``chainswarm_model.json`` (provenance: source path and sha256) — that
``AutoModelForCausalLM`` / ``AutoTokenizer`` and petals load like any local checkpoint.

What the conversion has to undo (see ``shared/spec/real-model.md``):

* **Quantization.** Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (F32, F16, BF16,
  Q4_0, Q4_1, Q5_x, Q8_0, the K-quants, ...) and then cast to the requested dtype.
* **Dimension order.** GGUF lists dimensions innermost first; PyTorch's shape is the reverse.
* **q/k row order.** llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` inside each head so
  the two numbers a rotary embedding rotates together sit next to each other; transformers' Llama pairs row
  ``i`` with row ``i + head_dim/2``. :func:`unpermute_qk_rows` restores transformers' order (q per attention
  head, k per key/value head). Get this wrong and the model still looks plausible on easy prompts while its
  perplexity triples, which is why the tests measure perplexity.
* **Tied head.** Without an ``output`` tensor the LM head is the embedding matrix (``tie_word_embeddings``).
* **Read-only memory maps.** ``GGUFReader`` maps the file read-only; arrays are copied before torch sees them.

Anything the converter cannot reproduce faithfully (another architecture, a non-BPE tokenizer, an unknown
pre-tokenizer, mixture-of-experts, rope scaling transformers 4.34 lacks, extra tensors) raises
:class:`GGUFConversionError` with a one-line message naming it.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
MAX_SHARD_BYTES = 2 * 1024**3  # bigger checkpoints are written in shards of at most this size (+ an index)
MODEL_INFO_FILE = "chainswarm_model.json"

# GGUF tensor name (per block, after "blk.N.") -> transformers parameter name (after "model.layers.N.")
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFConversionError(ValueError):
    """The file cannot be converted; ``str(exc)`` is one line naming what is unsupported or wrong."""


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters of a Llama GGUF, in transformers' terms."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`convert_gguf` wrote."""

    path: Path
    shape: LlamaShape
    dtype: str
    parameters: int
    source_sha256: str
    seconds: float
    tensor_types: dict[str, int]


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unpermute_qk_rows(weight, n_heads: int):
    """Undo llama.cpp's per-head row interleaving of a q or k projection (rows = n_heads * head_dim).

    In the GGUF, head ``h`` stores its rows as ``a0, b0, a1, b1, ...`` where ``a`` is the first half of the
    head in transformers' order and ``b`` the second half; this puts them back as ``a0, a1, ..., b0, b1, ...``.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFConversionError(f"cannot split {rows} q/k rows into {n_heads} heads of rotary pairs")
    half = rows // n_heads // 2
    per_head = weight.reshape(n_heads, half, 2, *weight.shape[1:])  # [head, pair index, which half, ...]
    return per_head.swapaxes(1, 2).reshape(weight.shape)


class _Metadata:
    """The GGUF key/values as plain Python values (strings decoded, arrays as lists)."""

    def __init__(self, reader) -> None:
        self.values: dict[str, Any] = {name: self._decode(field) for name, field in reader.fields.items()}

    @staticmethod
    def _decode(field) -> Any:
        from gguf import GGUFValueType

        def scalar(part, kind):
            return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part.tolist()[0]

        if not field.types:
            return None
        if field.types[0] == GGUFValueType.ARRAY:
            if len(field.types) > 2:  # nested arrays: no Llama key uses them
                return None
            return [scalar(field.parts[i], field.types[-1]) for i in field.data]
        return scalar(field.parts[field.data[0]], field.types[0])

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise GGUFConversionError(f"the GGUF lacks the required key {key!r}")
        return self.values[key]


def _read_shape(meta: _Metadata, embedding_rows: int) -> LlamaShape:
    """Llama hyper-parameters from the ``llama.*`` keys; refuse variants transformers 4.34 cannot run."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"unsupported GGUF architecture {arch!r}: only 'llama' converts")
    experts = int(meta.get("llama.expert_count", 0) or 0)
    if experts > 0:
        raise GGUFConversionError(f"unsupported mixture-of-experts Llama (llama.expert_count={experts})")
    hidden = int(meta.require("llama.embedding_length"))
    heads = int(meta.require("llama.attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    if hidden % heads or heads % kv_heads:
        raise GGUFConversionError(f"inconsistent heads: hidden {hidden}, {heads} heads, {kv_heads} kv heads")
    head_dim = hidden // heads
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        if int(meta.get(key, head_dim)) != head_dim:
            raise GGUFConversionError(f"unsupported {key}={meta.get(key)} (transformers 4.34 needs {head_dim})")
    scaling_type = meta.get("llama.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": float(meta.require("llama.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise GGUFConversionError(f"unsupported rope scaling type {scaling_type!r} (only linear)")
    return LlamaShape(
        layers=int(meta.require("llama.block_count")),
        hidden=hidden,
        intermediate=int(meta.require("llama.feed_forward_length")),
        heads=heads,
        kv_heads=kv_heads,
        vocab=embedding_rows,
        context_length=int(meta.get("llama.context_length", 2048)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
    )


def _hf_name(gguf_name: str) -> str | None:
    """transformers' parameter name for a GGUF tensor name, or None if the tensor is not a Llama weight."""
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    block, _, suffix = rest.partition(".")
    if prefix == "blk" and block.isdigit() and suffix in _BLOCK_TENSORS:
        return f"model.layers.{int(block)}.{_BLOCK_TENSORS[suffix]}"
    return None


def _load_tensor(tensor, shape: LlamaShape, unpermute_qk: bool, torch_dtype):
    """Dequantize one GGUF tensor into a torch tensor of transformers' shape, row order and dtype."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFConversionError(f"tensor {tensor.name}: {exc}") from None
    torch_shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dimension first
    array = np.asarray(array, dtype=np.float32).reshape(torch_shape)
    if unpermute_qk and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = shape.heads if tensor.name.endswith("attn_q.weight") else shape.kv_heads
        array = unpermute_qk_rows(array, heads)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).copy()  # the reader's memory map is read-only
    return torch.from_numpy(array).to(torch_dtype)


def _expected_shape(hf_name: str, shape: LlamaShape) -> tuple[int, ...]:
    kv = shape.kv_heads * shape.head_dim
    table = {
        "embed_tokens.weight": (shape.vocab, shape.hidden), "lm_head.weight": (shape.vocab, shape.hidden),
        "q_proj.weight": (shape.hidden, shape.hidden), "k_proj.weight": (kv, shape.hidden),
        "v_proj.weight": (kv, shape.hidden), "o_proj.weight": (shape.hidden, shape.hidden),
        "gate_proj.weight": (shape.intermediate, shape.hidden), "up_proj.weight": (shape.intermediate, shape.hidden),
        "down_proj.weight": (shape.hidden, shape.intermediate),
    }
    return table.get(hf_name.rsplit(".", 2)[-2] + ".weight", (shape.hidden,))


def _plan_shards(plan: list[tuple[str, Any]], element_bytes: int, max_shard_bytes: int) -> list[list]:
    """Group (name, tensor) pairs, in file order, into shards of at most ``max_shard_bytes`` of output."""
    shards: list[list] = [[]]
    size = 0
    for name, tensor in plan:
        nbytes = math.prod(int(d) for d in tensor.shape) * element_bytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


def _write_weights(out: Path, plan: list[tuple[str, Any]], shape: LlamaShape, dtype: str, unpermute_qk: bool,
                   max_shard_bytes: int) -> int:
    """Dequantize and save the weights shard by shard (bounded memory); return the parameter count."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    element_bytes = torch.empty((), dtype=torch_dtype).element_size()
    shards = _plan_shards(plan, element_bytes, max_shard_bytes)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    weight_map: dict[str, str] = {}
    parameters = total_bytes = 0
    for index, shard in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        state = {}
        for name, tensor in shard:
            value = _load_tensor(tensor, shape, unpermute_qk, torch_dtype)
            if tuple(value.shape) != _expected_shape(name, shape):
                raise GGUFConversionError(f"tensor {tensor.name} has shape {tuple(value.shape)}, "
                                          f"expected {_expected_shape(name, shape)}")
            state[name] = value
            weight_map[name] = filename
            parameters += value.numel()
            total_bytes += value.numel() * element_bytes
        save_file(state, str(out / filename), metadata={"format": "pt"})
        del state
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    return parameters


@dataclass
class _OpenGGUF:
    """A validated Llama GGUF: its metadata, shape and (transformers name, GGUF tensor) plan."""

    path: Path
    meta: _Metadata
    shape: LlamaShape
    plan: list[tuple[str, Any]]
    tied: bool
    tensor_types: dict[str, int]


def _open_llama_gguf(gguf_path: str | Path) -> _OpenGGUF:
    """Read and validate a GGUF (architecture, tokenizer kind, tensor names); nothing is dequantized yet."""
    from swarm.model.gguf_tokenizer import UnsupportedTokenizer, check_tokenizer_supported

    src = Path(gguf_path)
    if not src.is_file():
        raise GGUFConversionError(f"no such file: {src}")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFConversionError("the 'gguf' package is not installed (pip install 'gguf>=0.10')") from None
    try:
        reader = GGUFReader(str(src), "r")
    except Exception as exc:  # bad magic, truncated file, unknown version ...
        raise GGUFConversionError(f"cannot read {src} as GGUF: {' '.join(str(exc).split())}") from None
    meta = _Metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        _read_shape(meta, 0)  # report an architecture problem first if there is one
        raise GGUFConversionError("the GGUF has no token_embd.weight tensor")
    shape = _read_shape(meta, embedding_rows=int(tensors["token_embd.weight"].shape[-1]))
    try:
        check_tokenizer_supported(meta.values)
    except UnsupportedTokenizer as exc:
        raise GGUFConversionError(str(exc)) from None

    unknown = [name for name in tensors if _hf_name(name) is None]
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise GGUFConversionError(f"unsupported tensors in the GGUF: {', '.join(unknown[:3])}{more}")
    plan = [(_hf_name(name), t) for name, t in tensors.items()]
    present = {name for name, _ in plan}
    required = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{suffix}" for i in range(shape.layers) for suffix in _BLOCK_TENSORS.values()}
    missing = sorted(required - present)
    if missing:
        raise GGUFConversionError(f"the GGUF lacks {len(missing)} Llama tensors, e.g. {missing[0]}")
    extra_blocks = sorted(present - required - {"lm_head.weight"})
    if extra_blocks:
        raise GGUFConversionError(f"the GGUF has tensors beyond llama.block_count: {extra_blocks[0]}")
    if len(meta.get("tokenizer.ggml.tokens", [])) > shape.vocab:
        raise GGUFConversionError(f"the tokenizer has more tokens than the {shape.vocab} embedding rows")
    tensor_types = dict(sorted(Counter(t.tensor_type.name for t in tensors.values()).items()))
    return _OpenGGUF(src, meta, shape, plan, "lm_head.weight" not in present, tensor_types)


def load_llama_weights(gguf_path: str | Path, dtype: str = "float32", *, unpermute_qk: bool = True) -> dict:
    """All weights of a Llama GGUF as a transformers state dict in memory (a tied ``lm_head`` is omitted).

    The same tensors :func:`convert_gguf` writes, for callers that want to load them into a model directly
    (tests compare layouts this way without writing checkpoints).
    """
    import torch

    if dtype not in DTYPES:
        raise GGUFConversionError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    opened = _open_llama_gguf(gguf_path)
    return {name: _load_tensor(tensor, opened.shape, unpermute_qk, getattr(torch, dtype))
            for name, tensor in opened.plan}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", *,
                 unpermute_qk: bool = True, max_shard_bytes: int = MAX_SHARD_BYTES,
                 extra_info: dict | None = None) -> ConversionResult:
    """Convert a Llama GGUF into a transformers/petals checkpoint directory ``out_dir`` (created if needed).

    ``dtype`` is the dtype of the written weights (``float32``, ``float16`` or ``bfloat16``).
    ``unpermute_qk=False`` skips restoring transformers' q/k row order: it exists only so tests can prove
    that a wrong layout is detected. ``extra_info`` is merged into ``chainswarm_model.json``.
    Raises :class:`GGUFConversionError` (one-line message) for files it cannot convert faithfully.
    """
    from swarm.model.gguf_tokenizer import UnsupportedTokenizer, build_tokenizer

    started = time.perf_counter()
    if dtype not in DTYPES:
        raise GGUFConversionError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    opened = _open_llama_gguf(gguf_path)
    meta, shape = opened.meta, opened.shape
    try:
        tokenizer = build_tokenizer(meta.values, model_max_length=shape.context_length)
    except UnsupportedTokenizer as exc:
        raise GGUFConversionError(str(exc)) from None

    from transformers import GenerationConfig, LlamaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parameters = _write_weights(out, opened.plan, shape, dtype, unpermute_qk, max_shard_bytes)

    def token_id(key: str):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if value is None else int(value)

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context_length, rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta, rope_scaling=shape.rope_scaling, tie_word_embeddings=opened.tied,
        bos_token_id=token_id("bos"), eos_token_id=token_id("eos"), pad_token_id=token_id("padding"),
        torch_dtype=dtype, architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)

    sha = file_sha256(opened.path)
    info = {
        "generator": "chainswarm convert-gguf",
        "source": str(opened.path.resolve()),
        "source_sha256": sha,
        "source_name": meta.get("general.name"),
        "source_license": meta.get("general.license"),
        "dtype": dtype,
        "parameters": parameters,
        "tensor_types": opened.tensor_types,
        "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
        **({} if unpermute_qk else {"unpermute_qk": False}),
        **(extra_info or {}),
    }
    (out / MODEL_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return ConversionResult(out, shape, dtype, parameters, sha, time.perf_counter() - started,
                            opened.tensor_types)


def read_model_info(model_dir: str | Path) -> dict:
    """The ``chainswarm_model.json`` of a checkpoint directory ({} when absent or unreadable)."""
    try:
        return json.loads((Path(model_dir) / MODEL_INFO_FILE).read_text())
    except (OSError, ValueError):
        return {}
