"""Value types and errors shared by every fairness scheduler.

Spec: ``fairness-locality.md`` §1 (cost model), §14.3 (chain table).  Nothing here
holds a clock: every time stamp is passed in by the caller (orchestrator or
simulator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

ClientId = Hashable
RequestId = Hashable
ChainId = Hashable
ServerId = Hashable


class FairnessError(Exception):
    """Base class of every error raised by the fairness schedulers."""


class UnknownRequestError(FairnessError, LookupError):
    """An event names a request the scheduler does not know (never submitted, or already finished)."""

    def __init__(self, request_id: RequestId, action: str = "") -> None:
        self.request_id = request_id
        where = f" in {action}" if action else ""
        super().__init__(
            f"unknown request {request_id!r}{where}: it was never submitted to this scheduler "
            "or has already finished, failed without re-queue, or been cancelled"
        )

    def __str__(self) -> str:  # LookupError would otherwise quote the message
        return self.args[0]


class UnknownClientError(FairnessError, LookupError):
    """A query or a state restore names a client the scheduler has never seen."""

    def __init__(self, client_id: ClientId, action: str = "") -> None:
        self.client_id = client_id
        where = f" in {action}" if action else ""
        super().__init__(f"unknown client {client_id!r}{where}: no request of this client was ever submitted")

    def __str__(self) -> str:
        return self.args[0]


class UnknownChainError(FairnessError, LookupError):
    """An event names a chain that is not in the scheduler's chain table."""

    def __init__(self, chain_id: ChainId, action: str = "") -> None:
        self.chain_id = chain_id
        where = f" in {action}" if action else ""
        super().__init__(f"unknown chain {chain_id!r}{where}: register it with set_chains() first")

    def __str__(self) -> str:
        return self.args[0]


class DuplicateRequestError(FairnessError, ValueError):
    """A request id was submitted while a request with the same id is still queued or running."""


class InvalidEventError(FairnessError, ValueError):
    """An event that makes no sense in the request's current state (e.g. tokens for a queued request)."""


@dataclass(frozen=True)
class CostWeights:
    """Cost function of §1.2: ``W = extend * n_e + output * n_q`` (w_e = w_p = 1, w_q = 2)."""

    extend: float = 1.0
    output: float = 2.0

    def __post_init__(self) -> None:
        if self.extend < 0 or self.output < 0:
            raise ValueError("cost weights must be non-negative")


@dataclass(frozen=True)
class ChainSpec:
    """One serving chain (a worker in the papers' terms), §14.3.

    Speed is given either per token (``decode_time`` = tdec_k seconds per output
    token, ``prefill_time`` = tpre_k seconds per prefilled token, ``fixed_time`` =
    tfix_k) or as the planner's mean service time ``mean_service_time`` = T_k, from
    which tdec_k = T_k / reference_output_tokens and tpre_k = tdec_k / 10 (§14.3
    placeholder).  ``servers`` lists the servers of the chain (used by the ``bfio``
    chain selector and by prefix matching); ``max_length`` bounds prompt plus
    max_new_tokens.  Chains are ranked for JFFC by ``decode_time`` and then by
    their position in the list given to ``set_chains`` (GCA order, fastest first).

    ``kv_tokens`` (optional) is the chain's KV budget in tokens per block (the
    planner's c_k slots of its expected session length): a request then takes
    :meth:`kv_need` of it — its prompt plus its output cap, in whole pages —
    and the chain admits it while the running requests' needs leave room
    (``capacity`` still bounds how many run).  Without it every request takes
    one of ``capacity`` slots (the papers' fixed-length sessions).
    """

    chain_id: ChainId
    capacity: int
    decode_time: float | None = None
    prefill_time: float | None = None
    fixed_time: float = 0.0
    mean_service_time: float | None = None
    reference_output_tokens: int = 128
    max_length: int | None = None
    servers: tuple = ()
    kv_tokens: int | None = None
    kv_page: int = 16

    def __post_init__(self) -> None:
        if self.kv_tokens is not None and self.kv_tokens < 0:
            raise ValueError(f"chain {self.chain_id!r}: kv_tokens must be >= 0")
        if self.kv_page < 1:
            raise ValueError(f"chain {self.chain_id!r}: kv_page must be >= 1")
        if self.capacity < 0:
            raise ValueError(f"chain {self.chain_id!r}: capacity must be >= 0")
        decode = self.decode_time
        if decode is None:
            if self.mean_service_time is None:
                decode = 1.0
            else:
                decode = self.mean_service_time / max(1, self.reference_output_tokens)
            object.__setattr__(self, "decode_time", float(decode))
        if self.prefill_time is None:
            object.__setattr__(self, "prefill_time", float(decode) / 10.0)
        if self.decode_time < 0 or self.prefill_time < 0 or self.fixed_time < 0:
            raise ValueError(f"chain {self.chain_id!r}: per-token times must be >= 0")
        object.__setattr__(self, "servers", tuple(self.servers))

    def fits(self, input_tokens: int, max_new_tokens: int | None) -> bool:
        """True when the prompt plus its output cap fit the chain's max length (and,
        with a KV budget, the whole budget): the chain could ever run it."""
        if self.max_length is not None and input_tokens + (max_new_tokens or 0) > self.max_length:
            return False
        return self.kv_tokens is None or self.kv_need(input_tokens, max_new_tokens) <= self.kv_tokens

    def kv_need(self, input_tokens: int, max_new_tokens: int | None) -> int:
        """KV tokens per block a request takes on this chain: prompt plus output cap
        (no cap: the rest of ``max_length``), rounded up to whole pages; 0 without
        a KV budget."""
        if self.kv_tokens is None:
            return 0
        tokens = input_tokens + (max_new_tokens if max_new_tokens is not None
                                 else max(0, (self.max_length or input_tokens) - input_tokens))
        return -(-max(1, tokens) // self.kv_page) * self.kv_page


@dataclass
class RequestState:
    """The scheduler's record of one request.  Read it; do not mutate it.

    ``seq`` is the global arrival sequence number assigned at submission (ties in
    every ordering).  While running, ``chain_id`` names its chain,
    ``matched_tokens`` the prefix reuse assumed at grant, and ``output_tokens``
    the tokens charged so far.
    """

    request_id: RequestId
    client_id: ClientId
    input_tokens: int
    arrival_time: float
    seq: int
    max_new_tokens: int | None = None
    page_hashes: tuple = ()
    state: str = "queued"  # queued | running
    chain_id: ChainId | None = None
    matched_tokens: int = 0
    output_tokens: int = 0
    grant_time: float | None = None
    recompute_free: bool = False  # re-queued after a chain failure: input not charged again (§15 Q16)
    kv_tokens: int = 0  # KV tokens per block held on its chain while running (ChainSpec.kv_need)
    charged_extend: float = 0.0  # extend cost charged to the deficit (after settlement/reconciliation)
    provisional: float = 0.0  # policy charge applied at pick time, settled after chain choice

    @property
    def extend_tokens(self) -> int:
        return self.input_tokens - self.matched_tokens


@dataclass(frozen=True)
class Grant:
    """A decision: start ``request_id`` on ``chain_id``.

    ``matched_tokens`` is the prefix reuse the scheduler assumed on that chain
    (report the real value later with ``on_prefill``); ``extend_tokens`` the
    input positions that must be computed.
    """

    request_id: RequestId
    client_id: ClientId
    chain_id: ChainId
    matched_tokens: int
    extend_tokens: int
    time: float


@dataclass
class ChainState:
    spec: ChainSpec
    order: int  # position in the chain list (JFFC tie-break)
    active: int = 0
    healthy: bool = True
    running: set = field(default_factory=set)
    held_tokens: int = 0  # KV tokens per block its running requests hold (with a KV budget)

    @property
    def free(self) -> int:
        if not self.healthy:
            return 0
        return max(0, self.spec.capacity - self.active)

    @property
    def free_tokens(self) -> int | None:
        """KV tokens per block left (None: no KV budget)."""
        if self.spec.kv_tokens is None:
            return None
        return max(0, self.spec.kv_tokens - self.held_tokens)

    def admits(self, r: "RequestState", tokens_left: int | None = None) -> bool:
        """A free slot, and room for ``r``'s KV need (in ``tokens_left``, else what is free now)."""
        if self.free <= 0 or not self.spec.fits(r.input_tokens, r.max_new_tokens):
            return False
        left = self.free_tokens if tokens_left is None else tokens_left
        return left is None or self.spec.kv_need(r.input_tokens, r.max_new_tokens) <= left


INF = math.inf
