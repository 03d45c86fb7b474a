"""Model checkpoints without a hub.

``make_random_model`` writes a random-weight checkpoint of any supported family (``config.json`` +
safetensors) and a real byte-level BPE tokenizer trained offline on text shipped with the project, so tests,
the demo and a volunteer's first try run on machines that cannot download models. A Llama comes from
transformers 4.34's own ``LlamaForCausalLM`` (its config in 4.34's format); the families 4.34 cannot build
(Mistral, Qwen2/2.5, Qwen3, Gemma 3) from Chainswarm's block code (:class:`~swarm.model.local_model.LocalModel`),
their config in the format a current transformers writes (``rope_parameters``, ``layer_types``, ``dtype``).
Any such directory — or a real local checkpoint such as a Llama-2-7B folder — is then loaded the same way by
the servers, the orchestrator and petals.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from swarm.model.arch import FAMILIES

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
FAMILY_NAMES = tuple(dict.fromkeys(family.name for family in FAMILIES.values()))  # llama, mistral, qwen2, ...
_SLIDING = tuple(name for name in FAMILY_NAMES if name != "llama")  # the families whose configs have a window
GEMMA_GLOBAL_EVERY = 6  # Gemma 3: five local (sliding-window) layers, then one global


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a random checkpoint. Defaults make a model that runs a token in milliseconds on a CPU.

    ``head_dim`` (None: hidden // heads) and ``window`` (the sliding window; None: Mistral, Qwen2 and Qwen3 attend
    to every key, Gemma 3's local layers get a window of a quarter of ``max_length``) apply to the families
    built from Chainswarm's block code, not to ``llama``."""

    family: str = "llama"
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None  # None = heads (no grouped-query attention)
    intermediate: int | None = None  # None = the usual ~8/3 * hidden, rounded up to a multiple of 16
    vocab: int = 1024
    max_length: int = 1024  # max_position_embeddings: prompt + generated tokens
    seed: int = 0
    head_dim: int | None = None
    window: int | None = None

    @property
    def head_size(self) -> int:
        """The dimension of one attention head: ``head_dim``, else hidden / heads."""
        return self.head_dim or self.hidden // self.heads

    def __post_init__(self) -> None:
        if self.family not in FAMILY_NAMES:
            raise ValueError(f"unknown family {self.family!r}; choose one of {', '.join(FAMILY_NAMES)}")
        if self.layers < 1 or self.hidden < 1 or self.heads < 1 or self.vocab < 1 or self.max_length < 1:
            raise ValueError(f"all sizes must be positive: {self}")
        if self.head_dim is not None and self.family == "llama":
            raise ValueError("a llama's head_dim is hidden / heads (transformers 4.34 builds it): leave it out")
        if self.window is not None and (self.family not in _SLIDING or self.window < 1):
            raise ValueError(f"window must be positive and only {', '.join(_SLIDING)} have one")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden size {self.hidden} is not divisible by the number of heads {self.heads}")
        if self.head_size % 2:
            raise ValueError(f"the head dimension must be even (RoPE rotates pairs), not {self.head_size}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least {256 + len(SPECIAL_TOKENS)}")


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the project's bundled corpus (deterministic, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = resources.files("swarm").joinpath("model/assets/tokenizer_corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=None
    )


def make_random_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random-weight float32 checkpoint of ``spec.family`` and its tokenizer to ``out_dir``; return the
    path. The same spec and seed write the same bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec.vocab)
    if spec.family == "llama":
        _write_llama(out, spec, tokenizer)
    else:
        _write_family(out, spec, tokenizer)
    tokenizer.save_pretrained(out)
    (out / "chainswarm_model.json").write_text(json.dumps({"generator": "chainswarm make-model", **asdict(spec)}, indent=2))
    return out


def _intermediate(spec: TinyModelSpec) -> int:
    return spec.intermediate or -(-(8 * spec.hidden // 3) // 16) * 16


def _write_llama(out: Path, spec: TinyModelSpec, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=max(spec.vocab, len(tokenizer)),
        hidden_size=spec.hidden,
        intermediate_size=_intermediate(spec),
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads or spec.heads,
        max_position_embeddings=spec.max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)


def family_config(spec: TinyModelSpec, tokenizer) -> dict:
    """``config.json`` of a random Mistral, Qwen2, Qwen3 or Gemma 3 checkpoint, as a current transformers writes
    it (the family's own keys: q/k/v biases for Qwen2, q/k norms for Qwen3 and Gemma 3, Gemma's local/global
    layers with their two rope bases)."""
    head_dim = spec.head_size
    window = spec.window
    layers = ["full_attention"] * spec.layers
    if spec.family == "gemma3":
        window = window or max(1, spec.max_length // 4)
        every = min(GEMMA_GLOBAL_EVERY, spec.layers)  # a model shorter than the pattern still has a global layer
        layers = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(spec.layers)]
    elif window:
        layers = ["sliding_attention"] * spec.layers
    cfg = {
        "architectures": [{"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}[spec.family]],
        "model_type": next(t for t, f in FAMILIES.items() if f.name == spec.family),  # gemma3: gemma3_text
        "vocab_size": max(spec.vocab, len(tokenizer)), "hidden_size": spec.hidden,
        "intermediate_size": _intermediate(spec), "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads or spec.heads, "head_dim": head_dim,
        "max_position_embeddings": spec.max_length, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "hidden_act": "silu", "layer_types": layers, "sliding_window": window,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": None,
        "tie_word_embeddings": spec.family == "gemma3", "dtype": "float32",
    }
    if spec.family in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=bool(window), max_window_layers=0 if window else spec.layers)
    if spec.family == "gemma3":
        del cfg["hidden_act"]
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                   final_logit_softcapping=None, rope_parameters={
                       "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return cfg


def _write_family(out: Path, spec: TinyModelSpec, tokenizer) -> None:
    import torch
    from safetensors.torch import save_file

    from swarm.model.arch import arch_from_config
    from swarm.model.local_model import LocalModel

    cfg = family_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = LocalModel(arch_from_config(cfg))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Llama-style norms start at 1, Gemma's (1 + w) at w = 0: jitter both
                param.add_(torch.randn_like(param), alpha=0.1)
            else:  # projections, biases (Qwen2's too: a zero bias would test nothing) and embeddings
                param.normal_(0.0, cfg["initializer_range"])
    state = {(name if name.startswith("lm_head.") else f"model.{name}"): tensor.contiguous()
             for name, tensor in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def dht_prefix_for(model_dir: str | Path) -> str:
    """The DHT prefix a local checkpoint is served under (petals needs one for a local directory).

    Derived from the directory name so every process pointing at the same folder agrees on it.
    """
    name = Path(model_dir).resolve().name or "model"
    cleaned = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name).strip("-_") or "model"
    return f"{cleaned}-cs"
