"""The chain's ends on the servers that hold them: token embeddings at block 0, final norm and LM head at the last.

The orchestrator sends token ids to the chain's first server and gets token ids back from its last one
(:mod:`swarm.engine.multi_wire`: ``ids``, ``choose``, ``chosen``); what turns ids into hidden states and hidden
states into a choice runs here, on the volunteers that hold the first and last blocks, so that no one machine
computes every token's head (a Llama-3-70B head is ~0.2 s a token on a 2-core CPU).

* :class:`ChainEnds` — loaded in the server process with its blocks (:func:`server.batching.merge_inference_pools_batched`),
  before the connection handlers fork: the embedding table on the CPU (a gather, run in the handler that got the
  message; the forked handlers share the pages), the final norm and LM head on the blocks' device, in their dtype
  (a tied head is the embedding table itself, on a CPU server one tensor for both).
* :class:`HeadTask` — a task argument: ``submit_task(hidden (1, n, H), HeadTask(full))`` runs the head on the runtime
  (the device's one thread) and answers each row's argmax, and the float32 logits of the rows that need them.

The arithmetic is the one the orchestrator's own head ran (RMSNorm in float32, :func:`swarm.model.kernels.linear`,
Gemma's scaled embedding and ``(1 + w)`` norm), so a chain's greedy tokens are the same whichever side computes
them. The choice of token from those logits is :mod:`swarm.engine.sampling`'s (:func:`~swarm.engine.sampling.choose_step`),
shared with the orchestrator.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from swarm.model.arch import arch_from_config
from swarm.model.block import RMSNorm
from swarm.model.kernels import linear
from swarm.model.local_model import load_state_dict, read_config

logger = logging.getLogger(__name__)

__all__ = ["ChainEnds", "HeadTask", "ends_bytes"]


class HeadTask:
    """A task argument: the LM head over the given hidden rows ``(1, n, H)``. The runtime answers every row's argmax
    ``(1, n)`` and the float32 logits ``(1, m, V)`` of the rows ``full`` marks (those a sampler, a penalty or
    logprobs need; a plain greedy row needs only its argmax, so no vocabulary-sized row crosses to the handler)."""

    __slots__ = ("full",)

    def __init__(self, full=()):
        self.full = tuple(bool(f) for f in full)

    def __getstate__(self):
        return self.full

    def __setstate__(self, state):
        self.full = state

    def run(self, ends: "ChainEnds", hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.full) != hidden.shape[1]:
            raise ValueError(f"{len(self.full)} row marks for {hidden.shape[1]} rows")
        logits = ends.logits(hidden[0])
        mask = torch.tensor(self.full, dtype=torch.bool, device=logits.device)
        return logits.argmax(-1)[None], logits[mask][None]


def ends_bytes(config: dict, first: bool, last: bool, dtype_bytes: int) -> int:
    """Bytes the ends of a span take: the embedding table at the first block, the norm and head at the last (a tied
    head shares the table where both ends are on one server)."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    tied = bool(arch_from_config(config).tie_word_embeddings)
    table = hidden * vocab * dtype_bytes
    total = table if first else 0
    if last:
        total += hidden * dtype_bytes + (0 if (tied and first) else table)
    return total


class ChainEnds:
    """The embedding (``first``) and/or the final norm and head (``last``) of one checkpoint (see the module doc)."""

    def __init__(self, model_dir: str | Path, *, first: bool, last: bool, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if not (first or last):
            raise ValueError("a span with neither end loads no ends")
        cfg = read_config(model_dir)
        self.model_dir = str(model_dir)
        self.spec = arch_from_config(cfg)
        self._tokenizer = None
        if self.spec.final_logit_softcap:
            raise ValueError("final_logit_softcapping is not supported")
        self.first, self.last, self.dtype, self.device = first, last, dtype, torch.device(device)
        self.vocab_size, self.hidden_size = self.spec.vocab_size, self.spec.hidden_size
        state = load_state_dict(model_dir, "model.embed_tokens.") if (first or self.spec.tie_word_embeddings) else {}
        table = state.get("weight")
        self.embedding: Optional[torch.Tensor] = None
        self.norm: Optional[RMSNorm] = None
        self.head: Optional[torch.Tensor] = None
        if first:
            self.embedding = table.to(dtype=dtype, device="cpu").contiguous()
        if last:
            norm = load_state_dict(model_dir, "model.norm.")
            self.norm = RMSNorm(self.hidden_size, self.spec.rms_norm_eps, self.spec.norm_offset)
            self.norm.load_state_dict(norm, strict=True)
            self.norm = self.norm.to(device=self.device, dtype=dtype).eval()
            if self.spec.tie_word_embeddings:
                reuse = self.embedding is not None and self.device.type == "cpu"
                self.head = self.embedding if reuse else table.to(dtype=dtype, device=self.device).contiguous()
            else:
                self.head = load_state_dict(model_dir, "lm_head.")["weight"].to(dtype=dtype, device=self.device)
        if self.embedding is not None and tuple(self.embedding.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"the embedding table is {tuple(self.embedding.shape)}, the config says "
                             f"({self.vocab_size}, {self.hidden_size})")

    def tokenizer(self):
        """The model's Hugging Face tokenizer (loaded once per process, when a grammar first needs it)."""
        if self._tokenizer is None:
            from swarm.model.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    @property
    def nbytes(self) -> int:
        tensors = {id(t): t for t in (self.embedding, self.head) if t is not None}
        norm = sum(p.numel() * p.element_size() for p in self.norm.parameters()) if self.norm is not None else 0
        return sum(t.numel() * t.element_size() for t in tensors.values()) + norm

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(1, n)`` (int64, checked against the vocabulary) as block 0's input ``(1, n, H)``."""
        if self.embedding is None:
            raise ValueError("this server does not hold block 0: it embeds no token ids")
        if ids.dtype != torch.int64 or ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"token ids must be int64 (1, n), got {ids.dtype} {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        hidden = torch.nn.functional.embedding(ids, self.embedding)
        if self.spec.embed_scale != 1.0:  # Gemma: √hidden, rounded to the serving dtype as transformers does
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over hidden rows ``(..., H)``: float32 logits ``(..., V)``."""
        if self.head is None:
            raise ValueError("this server does not hold the last block: it has no LM head")
        hidden = hidden.to(device=self.device, dtype=self.head.dtype)
        return linear(self.norm(hidden), self.head).float()


def span_ends(uids, num_layers: int) -> tuple[bool, bool]:
    """Whether a span of block ``uids`` (``prefix.i``) holds block 0 and whether it holds the last block."""
    indices = {int(str(uid).rsplit(".", 1)[1]) for uid in uids}
    return 0 in indices, num_layers - 1 in indices


def load_for_span(model_dir: str | Path | None, uids, num_layers: int, dtype: torch.dtype,
                  device: torch.device | str) -> Optional[ChainEnds]:
    """The ends a span of block ``uids`` (``prefix.i``) needs, or None (a middle span, no model folder, or ends
    that cannot be loaded: the orchestrator then runs them itself — logged)."""
    if model_dir is None:
        return None
    first, last = span_ends(uids, num_layers)
    if not (first or last):
        return None
    try:
        ends = ChainEnds(model_dir, first=first, last=last, dtype=dtype, device=device)
    except Exception as exc:  # noqa: BLE001 - a checkpoint this code cannot read ends serves hidden states only
        logger.warning("the chain's ends were not loaded (%s): the orchestrator computes them", exc)
        return None
    logger.info("loaded the chain's %s (%.1f MiB)", " and ".join(
        name for name, held in (("embeddings", first), ("final norm and LM head", last)) if held), ends.nbytes / 2**20)
    return ends
