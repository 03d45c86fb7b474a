"""A whole model from Chainswarm's own block code in one process: embeddings, blocks, final norm, LM head.

What the swarm splits across servers, run end to end locally: the family goldens are checked against it
(per-block hidden states, logits, greedy tokens), the device check runs it on CUDA in float16/bfloat16, and it
is the reference for families that transformers 4.34 cannot run. Needs only torch and safetensors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from swarm.model.arch import ArchSpec, arch_from_config
from swarm.model.block import DecoderBlock, RMSNorm
from swarm.model.kernels import linear


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def load_state_dict(model_dir: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) checkpoint whose name starts with ``prefix``: safetensors, or the
    ``pytorch_model*.bin`` files older checkpoints ship (read as tensors only, memory-mapped), as petals' servers
    load them too."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    tensors = {}
    files = sorted(model_dir.glob("model*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    tensors[name[len(prefix):]] = f.get_tensor(name)
    if files:
        return tensors
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors or pytorch_model*.bin in {model_dir}")
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        tensors.update({name[len(prefix):]: t for name, t in state.items() if name.startswith(prefix)})
    return tensors


def load_blocks(model_dir: str | Path, indices: Sequence[int], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> list[DecoderBlock]:
    """Blocks ``indices`` of a checkpoint folder, loaded strictly (the orchestrator's own spot-check opinion and
    ``scripts/spread_check.py``)."""
    cfg = read_config(model_dir)
    return [blocks_from_state(cfg, load_state_dict(model_dir, f"model.layers.{i}."), i, dtype, device)
            for i in indices]


def blocks_from_state(cfg: dict, state: dict[str, torch.Tensor], index: int, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> DecoderBlock:
    """Block ``index`` of a model config, loaded strictly from ``state`` (its own tensors: ``self_attn.*`` ...)."""
    with torch.device("meta"):
        block = DecoderBlock(arch_from_config(cfg), index)
    block.load_state_dict(state, strict=True, assign=True)
    return block.to(device=device, dtype=dtype).eval()


class LocalModel(nn.Module):
    """Embeddings + :class:`DecoderBlock` s + final norm + LM head, loaded strictly from a checkpoint folder."""

    def __init__(self, spec: ArchSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "LocalModel":
        spec = arch_from_config(read_config(model_dir))
        with torch.device("meta"):
            model = cls(spec)
        state = load_state_dict(model_dir)
        renamed = {}
        for name, tensor in state.items():
            name = name[len("model."):] if name.startswith("model.") else name
            renamed[name] = tensor
        if spec.tie_word_embeddings:
            renamed.pop("lm_head.weight", None)
        model.load_state_dict(renamed, strict=True, assign=True)
        return model.to(device=device, dtype=dtype).eval()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(ids)
        if self.spec.embed_scale != 1.0:  # Gemma: √hidden, rounded to the serving dtype as transformers does
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype, device=hidden.device)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(self.norm(hidden), weight)  # the blocks' kernel choice
        cap = self.spec.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """``[input of block 0, output of block 0, ..., output of the last block]`` for one sequence ``(t,)``."""
        hidden = self.embed(ids[None])
        states = [hidden[0]]
        for block in self.layers:
            hidden, _ = block.run(hidden)
            states.append(hidden[0])
        return states

    @torch.inference_mode()
    def greedy(self, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy continuation with a KV cache per block: ``new_tokens`` ids and the logits of each step."""
        caches: list[Optional[tuple]] = [None] * len(self.layers)
        hidden, out, step_logits = self.embed(ids[None]), [], []
        for _ in range(new_tokens):
            for i, block in enumerate(self.layers):
                hidden, caches[i] = block.run(hidden, caches[i])
            logits = self.logits(hidden[0, -1:])[0].float()
            step_logits.append(logits)
            token = int(logits.argmax())
            out.append(token)
            hidden = self.embed(torch.tensor([[token]], device=ids.device))
        return out, torch.stack(step_logits)
