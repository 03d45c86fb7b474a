"""The supported families registered with petals 2.2, on Chainswarm's block code.

petals 2.2 serves Llama-1/2 through transformers 4.34's ``LlamaDecoderLayer``; that stack cannot read a
Llama 3.x rope scaling, a Qwen2/Qwen3 or a Gemma 3 config, and runs Mistral's window one key too wide. Here each
family (:data:`swarm.model.arch.FAMILIES`) gets a petals config class whose ``block_class`` is
:class:`PetalsBlock` (a :class:`~swarm.model.block.DecoderBlock` with petals' ``forward(hidden, layer_past,
use_cache)`` and cache layout), and a client model (petals' ``DistributedLlamaModel`` with Gemma's scaled
embeddings and ``(1 + w)`` final norm where the family has them). :func:`register` puts them into
transformers' ``AutoConfig`` (types 4.34 does not know, and ``llama``/``mistral`` so that new rope scalings
parse) and petals' ``_CLASS_MAPPING`` (``llama`` replaced), so petals' server, client, memory accounting and
vanilla petals clients all use them. Rope settings that 4.34 would validate away are kept under
``chainswarm_rope_scaling`` and read back by :func:`config_dict`.

petals builds a block without its index (``config.block_class(config)``); :func:`install_server_hooks` makes
the server bind each loaded block to its layer (its window and rope), which Gemma 3's local/global layers need,
and size its KV cache with the real ``head_dim`` (:class:`ModelBackend`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from swarm.model.arch import FAMILIES, ArchSpec, arch_from_config, family_of, text_config
from swarm.model.block import Attention, DecoderBlock, RMSNorm
from swarm.model.petals_shim import petals  # noqa: F401  (the shim before petals' modules)
from hivemind.utils.tensor_descr import TensorDescriptor  # noqa: E402
from petals.client.lm_head import LMHead  # noqa: E402
from petals.server.backend import TransformerBackend  # noqa: E402
from petals.models.llama import DistributedLlamaConfig, DistributedLlamaForCausalLM, DistributedLlamaModel  # noqa: E402
from petals.utils import auto_config  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel  # noqa: E402

_ROPE_KEY = "chainswarm_rope_scaling"
logger = logging.getLogger(__name__)

# petals logs Meta's LLaMA terms for every config it reads (DistributedLlamaConfig.from_pretrained), whatever the
# family; each family's own terms are logged instead (ChainswarmConfig.from_pretrained)
_PETALS_TERMS = "Make sure you follow the LLaMA's terms of use"
LICENSE = "this checkpoint's license (its model card says which)"
TERMS = {"llama": f"{LICENSE}; Meta's Llama 1/2/3.x weights are under Meta's licenses (https://bit.ly/llama2-license, "
                  "https://www.llama.com/llama3_1/license/)",
         "gemma3": "the Gemma Terms of Use (https://ai.google.dev/gemma/terms)"}


_TERMS_LOGGED: set[tuple[str, str]] = set()  # (family, checkpoint) whose terms this process has logged


def _not_petals_llama_terms(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_PETALS_TERMS)


def config_dict(config: Any) -> dict:
    """A petals/transformers config as the checkpoint's ``config.json`` said it (rope scaling restored)."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kept = cfg.pop(_ROPE_KEY, None)
    if kept is not None:
        cfg["rope_scaling"] = kept
    return cfg


def arch_of(config: Any) -> ArchSpec:
    return arch_from_config(config_dict(config))


class ChainswarmConfig(DistributedLlamaConfig):
    """petals' Llama config carrying any supported family (``model_type`` is set per family)."""

    block_class = None  # PetalsBlock, set below
    attn_class = Attention
    block_prefix = "model.layers"

    def __init__(self, **kwargs):
        if kwargs.get("rope_scaling") is not None:  # 4.34 validates rope_scaling: keep it where it cannot
            kwargs[_ROPE_KEY] = kwargs.pop("rope_scaling")
        if kwargs.get("dtype") and not kwargs.get("torch_dtype"):  # current transformers write `dtype`
            kwargs["torch_dtype"] = kwargs.pop("dtype")
        read = "num_hidden_layers" in kwargs  # not the default instance transformers builds for to_diff_dict
        super().__init__(**kwargs)
        if read and self.__class__.model_type in FAMILIES:
            spec = arch_of(self)  # refuses what the block code cannot serve, at load time
            self.head_dim = spec.head_dim

    @classmethod
    def from_pretrained(cls, model_name_or_path, *args, **kwargs):
        result = super().from_pretrained(model_name_or_path, *args, **kwargs)
        family = FAMILIES[cls.model_type].name if cls.model_type in FAMILIES else None
        if family is not None and (family, str(model_name_or_path)) not in _TERMS_LOGGED:  # once a checkpoint (an
            _TERMS_LOGGED.add((family, str(model_name_or_path)))  # orchestrator reads its config three times)
            logger.info("Make sure you follow the terms of %s", TERMS.get(family, LICENSE))
        return result

    @property
    def arch(self) -> ArchSpec:
        return arch_of(self)

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


class PetalsBlock(DecoderBlock):
    """A :class:`DecoderBlock` built from a petals config, with petals' block interface: ``layer_past`` is
    ``(keys (b·kv, d, L), values (b·kv, L, d))`` and, with ``use_cache``, the cache extended by the new tokens
    is returned in the same layout. Unbound blocks (petals' throughput probe) compute as layer 0."""

    def __init__(self, config: ChainswarmConfig):
        super().__init__(config.arch)
        if self.layer_spec is None:
            self.bind_layer(0)

    def forward(self, hidden_states: torch.Tensor, *args, attention_mask=None, position_ids=None,
                layer_past=None, use_cache: bool = False, **kwargs):
        b = hidden_states.shape[0]
        kv, d = self.spec.num_kv_heads, self.spec.head_dim
        past = None
        if layer_past is not None:
            keys, values = layer_past
            length = keys.shape[-1]
            past = (keys.view(b, kv, d, length), values.view(b, kv, length, d))
        out, (keys, values) = self.run(hidden_states, past)
        if not use_cache:
            return (out,)
        return out, (keys.view(b * kv, d, -1), values.view(b * kv, -1, d))


ChainswarmConfig.block_class = PetalsBlock


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: the table times √hidden, the scale rounded to the table's dtype first."""

    def __init__(self, *args, scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out * torch.tensor(self.scale, dtype=out.dtype, device=out.device)


class ChainswarmModel(DistributedLlamaModel):
    """petals' client model (embeddings and final norm local, blocks on the swarm) for any family."""

    def __init__(self, config: ChainswarmConfig, *, dht=None):
        super().__init__(config, dht=dht)
        spec = config.arch
        if spec.final_logit_softcap:
            raise ValueError("final_logit_softcapping is not supported by Chainswarm's client")
        if spec.embed_scale != 1.0:
            self.embed_tokens = ScaledEmbedding(spec.vocab_size, spec.hidden_size, self.padding_idx,
                                                scale=spec.embed_scale)
        if spec.norm_offset:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        self.requires_grad_(False)


_GIVEN_DHT: contextvars.ContextVar = contextvars.ContextVar("chainswarm_given_dht", default=None)


@contextlib.contextmanager
def using_dht(dht) -> Any:
    """Client models built in this block find the servers through ``dht`` (a running hivemind DHT of the swarm)
    instead of starting a client DHT of their own. (A context, not a ``from_pretrained`` argument: transformers
    deep-copies the keyword arguments it is given into the model's configs, and a DHT does not copy.)"""
    token = _GIVEN_DHT.set(dht)
    try:
        yield
    finally:
        _GIVEN_DHT.reset(token)


class ChainswarmForCausalLM(DistributedLlamaForCausalLM):
    """Finds the servers through :func:`using_dht`'s DHT where one is given; else petals starts a client DHT of its
    own (a process and a libp2p daemon)."""

    def __init__(self, config: ChainswarmConfig):
        LlamaPreTrainedModel.__init__(self, config)
        self.model = ChainswarmModel(config, dht=_GIVEN_DHT.get())
        self.pretraining_tp = 1
        self.vocab_size = config.vocab_size
        self.lm_head = LMHead(config)
        self.post_init()


CLASSES: dict[str, tuple[type, type, type]] = {}  # model_type -> (config, model, causal LM)
for _model_type, _family in FAMILIES.items():
    _name = _family.name.capitalize()
    _config = type(f"Distributed{_name}Config", (ChainswarmConfig,), {"model_type": _model_type})
    _model = type(f"Distributed{_name}Model", (ChainswarmModel,), {"config_class": _config})
    _lm = type(f"Distributed{_name}ForCausalLM", (ChainswarmForCausalLM,), {"config_class": _config})
    CLASSES[_model_type] = (_config, _model, _lm)


class _ModelTypeOf:
    """What petals' ``AutoDistributed*`` asks ``AutoConfig`` for: the checkpoint's ``model_type``, read from a
    local ``config.json`` without transformers 4.34's validation (which refuses Llama 3.1's rope scaling)."""

    @staticmethod
    def from_pretrained(model_name_or_path, *args, **kwargs):
        path = Path(str(model_name_or_path)) / "config.json"
        if path.is_file():
            cfg = json.loads(path.read_text())
            family_of(cfg)  # an unsupported family: a one-line UnsupportedModel naming the supported ones
            return SimpleNamespace(model_type=text_config(cfg).get("model_type"))
        return AutoConfig.from_pretrained(model_name_or_path, *args, **kwargs)


def register() -> None:
    """Register every family with petals' AutoDistributed* (``llama`` replaced) and the types transformers
    4.34 does not know with its AutoConfig (idempotent). transformers' own ``llama``/``mistral`` classes stay
    as they are: local transformers is the independent reference of the tests."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, (config, model, lm) in CLASSES.items():
        if model_type not in CONFIG_MAPPING or CONFIG_MAPPING[model_type] is config:
            AutoConfig.register(model_type, config, exist_ok=True)
        auto_config._CLASS_MAPPING[model_type] = auto_config._ModelClasses(
            config=config, model=model, model_for_causal_lm=lm)
    auto_config.AutoConfig = _ModelTypeOf
    petals_config_logger = logging.getLogger("petals.models.llama.config")
    if _not_petals_llama_terms not in petals_config_logger.filters:
        petals_config_logger.addFilter(_not_petals_llama_terms)


# petals' load_pretrained_block first calls load_state_dict on the meta-initialised block only to check the
# names ("dummy load"), which makes torch warn that copying into a meta parameter is a no-op; the weights are
# then really set by accelerate's set_module_tensor_to_device (tests/test_batching checks they are).
_DUMMY_LOAD_WARNING = r".*copying from a non-meta parameter in the checkpoint to a meta parameter.*"


def _bound(load):
    @functools.wraps(load)
    def load_bound(model_name, block_index, *args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DUMMY_LOAD_WARNING, category=UserWarning)
            block = load(model_name, block_index, *args, **kwargs)
        if isinstance(block, DecoderBlock):
            block.bind_layer(block_index)
        return block

    load_bound.chainswarm_bound = True
    return load_bound


class ModelBackend(TransformerBackend):
    """petals' block backend with the KV cache at the block's real ``head_dim`` (petals assumes hidden /
    heads, which Qwen3's and Gemma 3's heads are not)."""

    def get_inference_cache_descriptors(self, batch_size: int, max_length: int):
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        tensors = []
        for device, heads in zip(self.module.devices, self.shard_num_heads):
            kv_heads = heads // config.num_key_value_groups
            tensors.append(TensorDescriptor((batch_size, kv_heads, head_dim, max_length), dtype=self.dtype, device=device))
            tensors.append(TensorDescriptor((batch_size, kv_heads, max_length, head_dim), dtype=self.dtype, device=device))
        return tensors


def load_block(model_dir: str, index: int, **kwargs) -> nn.Module:
    """petals' ``load_pretrained_block``, bound to its layer (what a server holds as block ``index``)."""
    from petals.server.from_pretrained import load_pretrained_block

    return _bound(load_pretrained_block)(model_dir, index, **kwargs)


def install_server_hooks() -> None:
    """In a server process, before petals' ``Server`` is built: bind every loaded block to its layer index, and
    use :class:`ModelBackend` unless a subclass of it is installed already (idempotent)."""
    import petals.server.server as server_module

    if not getattr(server_module.load_pretrained_block, "chainswarm_bound", False):
        server_module.load_pretrained_block = _bound(server_module.load_pretrained_block)
    if not issubclass(server_module.TransformerBackend, ModelBackend):
        server_module.TransformerBackend = ModelBackend
