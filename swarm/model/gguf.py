"""Convert a GGUF file (llama.cpp's format) of a supported family into a Hugging Face checkpoint folder.

Families: Llama 1/2/3.x and Mistral (GGUF architecture ``llama``), Qwen2/2.5 (``qwen2``), Qwen3 (``qwen3``) and
Gemma 3 text (``gemma3``); :mod:`swarm.model.gguf_families` says how each maps onto transformers' names. The
result is an ordinary directory — ``config.json`` (one :func:`swarm.model.arch.arch_from_config` parses),
``generation_config.json``, safetensors weights, the tokenizer files and ``chainswarm_model.json``
(provenance: source path and sha256) — that :class:`swarm.model.local_model.LocalModel` and petals load.

What the conversion has to undo (see ``shared/spec/real-model.md``):

* **Quantization.** Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (F32, F16, BF16,
  Q4_0, Q4_1, Q5_x, Q8_0, the K-quants, ...) and then cast to the requested dtype.
* **Dimension order.** GGUF lists dimensions innermost first; PyTorch's shape is the reverse.
* **q/k row order** (``llama`` only: llama.cpp permutes q/k rows for Llama/Mistral, not for Qwen2/Qwen3/Gemma 3).
  llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` inside each head so the two numbers a
  rotary embedding rotates together sit next to each other; transformers pairs row ``i`` with row
  ``i + head_dim/2``. :func:`unpermute_qk_rows` restores transformers' order (q per attention head, k per
  key/value head). Get this wrong and the model still looks plausible on easy prompts while its perplexity
  triples, which is why the tests measure perplexity.
* **Gemma's norms.** llama.cpp stores Gemma's ``(1 + w)`` norm weights as ``1 + w``; 1 is subtracted.
* **Tied head.** Without an ``output`` tensor the LM head is the embedding matrix (``tie_word_embeddings``).
* **Read-only memory maps.** ``GGUFReader`` maps the file read-only; arrays are copied before torch sees them.

Anything the converter cannot reproduce faithfully (another architecture, an unknown tokenizer or
pre-tokenizer, mixture-of-experts, an unsupported rope scaling, extra tensors) raises
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

from swarm.model.gguf_families import (ROPE_FREQS, GGUFFamily, GGUFFamilyError, ModelShape,
                                       expected_shape, read_shape)

DTYPES = ("float32", "float16", "bfloat16")
MAX_SHARD_BYTES = 2 * 1024**3  # bigger checkpoints are written in shards of at most this size (+ an index)
MODEL_INFO_FILE = "chainswarm_model.json"

__all__ = ["ConversionResult", "DTYPES", "GGUFConversionError", "ModelShape", "convert_gguf",
           "file_sha256", "load_gguf_weights", "read_model_info", "unpermute_qk_rows"]


class GGUFConversionError(ValueError):
    """The file cannot be converted; ``str(exc)`` is one line naming what is unsupported or wrong."""


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`convert_gguf` wrote."""

    path: Path
    shape: ModelShape
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
            if len(field.types) > 2:  # nested arrays: no supported key uses them
                return None
            if field.types[-1] != GGUFValueType.STRING and field.data:  # numbers: one vectorised read
                import numpy as np

                return np.concatenate([field.parts[i] for i in field.data]).tolist()
            return [scalar(field.parts[i], field.types[-1]) for i in field.data]
        return scalar(field.parts[field.data[0]], field.types[0])

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise GGUFConversionError(f"the GGUF lacks the required key {key!r}")
        return self.values[key]


def _dequantize(tensor):
    import numpy as np
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFConversionError(f"tensor {tensor.name}: {exc}") from None
    torch_shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dimension first
    return np.asarray(array, dtype=np.float32).reshape(torch_shape)


def _load_tensor(tensor, hf_name: str, shape: ModelShape, family: GGUFFamily, unpermute_qk: bool, torch_dtype):
    """Dequantize one GGUF tensor into a torch tensor of transformers' shape, row order, values and dtype."""
    import numpy as np
    import torch

    array = _dequantize(tensor)
    if family.permute_qk and unpermute_qk and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = shape.heads if tensor.name.endswith("attn_q.weight") else shape.kv_heads
        array = unpermute_qk_rows(array, heads)
    if family.shifted(hf_name):
        array = array - np.float32(family.norm_shift)  # llama.cpp stored Gemma's norms as 1 + w
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).copy()  # the reader's memory map is read-only
    return torch.from_numpy(array).to(torch_dtype)


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


def _write_weights(out: Path, opened: "_OpenGGUF", dtype: str, unpermute_qk: bool, max_shard_bytes: int) -> int:
    """Dequantize and save the weights shard by shard (bounded memory); return the parameter count."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    element_bytes = torch.empty((), dtype=torch_dtype).element_size()
    shards = _plan_shards(opened.plan, element_bytes, max_shard_bytes)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    weight_map: dict[str, str] = {}
    parameters = total_bytes = 0
    for index, shard in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        state = {}
        for name, tensor in shard:
            value = _load_tensor(tensor, name, opened.shape, opened.family, unpermute_qk, torch_dtype)
            if tuple(value.shape) != expected_shape(name, opened.shape):
                raise GGUFConversionError(f"tensor {tensor.name} has shape {tuple(value.shape)}, "
                                          f"expected {expected_shape(name, opened.shape)}")
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
    """A validated GGUF: its metadata, family, shape and (transformers name, GGUF tensor) plan."""

    path: Path
    meta: _Metadata
    family: GGUFFamily
    shape: ModelShape
    plan: list[tuple[str, Any]]
    tied: bool
    tensor_types: dict[str, int]


def _open_gguf(gguf_path: str | Path) -> _OpenGGUF:
    """Read and validate a GGUF (architecture, tokenizer kind, tensor names); nothing big is dequantized yet."""
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
    try:
        if "token_embd.weight" not in tensors:
            read_shape(meta, 0)  # report an architecture problem first if there is one
            raise GGUFConversionError("the GGUF has no token_embd.weight tensor")
        rope_freqs = None
        if ROPE_FREQS in tensors:
            rope_freqs = [float(x) for x in _dequantize(tensors.pop(ROPE_FREQS)).reshape(-1)]
        family, shape = read_shape(meta, int(tensors["token_embd.weight"].shape[-1]), rope_freqs)
    except GGUFFamilyError as exc:
        raise GGUFConversionError(str(exc)) from None
    try:
        check_tokenizer_supported(meta.values)
    except UnsupportedTokenizer as exc:
        raise GGUFConversionError(str(exc)) from None

    unknown = [name for name in tensors if family.hf_name(name) is None]
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise GGUFConversionError(f"unsupported tensors in the {shape.arch} GGUF: {', '.join(unknown[:3])}{more}")
    plan = [(family.hf_name(name), t) for name, t in tensors.items()]
    present = {name for name, _ in plan}
    required = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{suffix}" for i in range(shape.layers) for suffix in family.block.values()}
    missing = sorted(required - present)
    if missing:
        raise GGUFConversionError(f"the GGUF lacks {len(missing)} {shape.arch} tensors, e.g. {missing[0]}")
    extra_blocks = sorted(present - required - {"lm_head.weight"})
    if extra_blocks:
        raise GGUFConversionError(f"the GGUF has tensors beyond {shape.arch}.block_count: {extra_blocks[0]}")
    if len(meta.get("tokenizer.ggml.tokens", [])) > shape.vocab:
        raise GGUFConversionError(f"the tokenizer has more tokens than the {shape.vocab} embedding rows")
    tensor_types = dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))
    return _OpenGGUF(src, meta, family, shape, plan, "lm_head.weight" not in present, tensor_types)


def load_gguf_weights(gguf_path: str | Path, dtype: str = "float32", *, unpermute_qk: bool = True) -> dict:
    """All weights of a GGUF as a transformers state dict in memory (a tied ``lm_head`` is omitted).

    The same tensors :func:`convert_gguf` writes, for callers that want to load them into a model directly
    (tests compare layouts this way without writing checkpoints).
    """
    import torch

    if dtype not in DTYPES:
        raise GGUFConversionError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    opened = _open_gguf(gguf_path)
    return {name: _load_tensor(tensor, name, opened.shape, opened.family, unpermute_qk, getattr(torch, dtype))
            for name, tensor in opened.plan}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", *,
                 unpermute_qk: bool = True, max_shard_bytes: int = MAX_SHARD_BYTES,
                 extra_info: dict | None = None, chat_template: str | None = None) -> ConversionResult:
    """Convert a GGUF of a supported family into a checkpoint directory ``out_dir`` (created if needed).

    ``dtype`` is the dtype of the written weights (``float32``, ``float16`` or ``bfloat16``).
    ``unpermute_qk=False`` skips restoring transformers' q/k row order: it exists only so tests can prove
    that a wrong layout is detected. ``extra_info`` is merged into ``chainswarm_model.json``.
    ``chat_template`` is used only when the file carries none (``tokenizer.chat_template``).
    Raises :class:`GGUFConversionError` (one-line message) for files it cannot convert faithfully.
    """
    from swarm.model.gguf_tokenizer import UnsupportedTokenizer, build_tokenizer, finish_tokenizer_files

    started = time.perf_counter()
    if dtype not in DTYPES:
        raise GGUFConversionError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    opened = _open_gguf(gguf_path)
    meta, shape = opened.meta, opened.shape
    template = meta.get("tokenizer.chat_template") or chat_template
    try:
        tokenizer, tokenizer_info = build_tokenizer(meta.values, model_max_length=shape.context_length,
                                                    chat_template=template, with_info=True)
    except UnsupportedTokenizer as exc:
        raise GGUFConversionError(str(exc)) from None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parameters = _write_weights(out, opened, dtype, unpermute_qk, max_shard_bytes)

    config = {**shape.config, "tie_word_embeddings": opened.tied, "torch_dtype": dtype,
              "transformers_version": "4.34.1", "chainswarm_source": "gguf"}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config.get(key) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    finish_tokenizer_files(out, meta.values)

    sha = file_sha256(opened.path)
    info = {
        "generator": "chainswarm convert-gguf",
        "source": str(opened.path.resolve()),
        "source_sha256": sha,
        "source_name": meta.get("general.name"),
        "source_license": meta.get("general.license"),
        "architecture": shape.arch,
        "model_type": shape.model_type,
        "dtype": dtype,
        "parameters": parameters,
        "tensor_types": opened.tensor_types,
        "tokenizer_model": meta.get("tokenizer.ggml.model"),
        "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
        "chat_template_source": ("gguf" if meta.get("tokenizer.chat_template") else
                                 "supplied" if chat_template else None),
        **tokenizer_info,
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
