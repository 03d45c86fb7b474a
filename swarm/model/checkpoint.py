"""Model checkpoints without a hub.

``make_random_llama`` writes a random-weight Llama checkpoint (``config.json`` + safetensors) and a real
byte-level BPE tokenizer trained offline on text shipped with the project, so tests and the demo run on
machines that cannot download models. Any such directory — or a real local checkpoint such as a
Llama-2-7B folder — is then loaded the same way by ``transformers`` and by petals.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of a random Llama checkpoint. Defaults make a model that runs a token in milliseconds on a CPU."""

    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None  # None = heads (no grouped-query attention)
    intermediate: int | None = None  # None = the usual ~8/3 * hidden, rounded up to a multiple of 16
    vocab: int = 1024
    max_length: int = 1024  # max_position_embeddings: prompt + generated tokens
    seed: int = 0

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden < 1 or self.heads < 1 or self.vocab < 1 or self.max_length < 1:
            raise ValueError(f"all sizes must be positive: {self}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden size {self.hidden} is not divisible by the number of heads {self.heads}")
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


def make_random_llama(out_dir: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write a random-weight float32 Llama checkpoint and its tokenizer to ``out_dir``; return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec.vocab)
    intermediate = spec.intermediate or -(-(8 * spec.hidden // 3) // 16) * 16
    config = LlamaConfig(
        vocab_size=max(spec.vocab, len(tokenizer)),
        hidden_size=spec.hidden,
        intermediate_size=intermediate,
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
    tokenizer.save_pretrained(out)
    (out / "chainswarm_model.json").write_text(json.dumps({"generator": "chainswarm make-model", **asdict(spec)}, indent=2))
    return out


def dht_prefix_for(model_dir: str | Path) -> str:
    """The DHT prefix a local checkpoint is served under (petals needs one for a local directory).

    Derived from the directory name so every process pointing at the same folder agrees on it.
    """
    name = Path(model_dir).resolve().name or "model"
    cleaned = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name).strip("-_") or "model"
    return f"{cleaned}-cs"
