"""The KV reservations of the sessions the orchestrator admitted, in KV tokens per block.

A request's reservation is a pair: what it holds now in the orchestrator's accounting — its prompt plus the
output tokens its reservation covers (all of ``max_tokens``, or ``--grow-tokens`` at a time for an answer that
grows) — and the most it may reach, its prompt plus ``max_tokens`` (the session's ``max_length`` on its
servers, whose paged pools hold only what it uses). Both are in whole pages (``Expectations.kv_need``); with
``--kv-admission slots`` both are ``max_length``, the papers' fixed-length sessions.
"""
from __future__ import annotations

from typing import Iterable


class ContextLengthExceeded(ValueError):
    """A request longer than any session of the swarm may be, or than any chain of the plan can hold: the client
    must shorten it (the API's 400 with OpenAI's code ``context_length_exceeded``)."""


class Reservations:
    def __init__(self, expect):
        self.expect = expect  # swarm.control.planning.Expectations
        self._held: dict[str, tuple[int, int]] = {}  # request id -> (reserved now, bound)

    def longest(self, chains: Iterable) -> int | None:
        """KV tokens per block of the largest first reservation some chain of the plan can hold (its budget
        c_k · slot_tokens with token admission, at most ``max_length``; ``max_length`` with slots); None
        without chains. Under ``max_length``, longer requests get a 400 (the planner's c and the expected
        lengths decide the budgets: ``--expected-input-tokens`` / ``--expected-output-tokens``)."""
        budgets = [c.capacity * self.expect.slot_tokens for c in chains]
        if not budgets:
            return None
        if self.expect.kv_admission != "tokens":
            return self.expect.max_length
        return min(self.expect.max_length, max(budgets))

    def check(self, input_tokens: int, max_new_tokens: int, reserve: int, chains: Iterable) -> None:
        """Refuse (:class:`ContextLengthExceeded`, the 400's text) a request no session may be or no chain of the
        plan can ever hold: past ``max_length``, or a first reservation larger than every chain's KV budget."""
        expect = self.expect
        prompt = f"prompt ({input_tokens} token{'' if input_tokens == 1 else 's'})"
        if input_tokens + max_new_tokens > expect.max_length:
            raise ContextLengthExceeded(f"{prompt} + max_tokens ({max_new_tokens}) exceeds the "
                                        f"swarm's maximum session length of {expect.max_length} tokens")
        need = expect.kv_need(input_tokens, reserve)
        largest = self.longest(chains)  # max_length with slots, which every need equals: never refused here
        if largest is not None and need > largest:
            raise ContextLengthExceeded(f"{prompt} + max_tokens ({max_new_tokens}) needs {need} KV "
                                        f"tokens per block, more than any chain of the current plan holds ({largest})")

    def open(self, request_id: str, input_tokens: int, reserve: int, max_new_tokens: int) -> None:
        """A request queued (or re-queued from where it stopped) with ``reserve`` output tokens covered."""
        self._held[request_id] = (self.expect.kv_need(input_tokens, reserve),
                                  self.expect.kv_need(input_tokens, max_new_tokens))

    def grow(self, request_id: str, more_tokens: int) -> int | None:
        """Cover ``more_tokens`` more output (never past the bound): the new reservation, None if unknown."""
        if request_id not in self._held:
            return None
        reserved, bound = self._held[request_id]
        self._held[request_id] = (min(bound, self.expect.kv_need(0, reserved + more_tokens)), bound)
        return self._held[request_id][0]

    def reserved(self, request_id: str) -> int:
        """KV tokens per block the session holds in the accounting now (``max_length`` if unknown)."""
        return self._held.get(request_id, (self.expect.max_length,))[0]

    def bound(self, request_id: str) -> int:
        """KV tokens per block the session may reach on its servers (``max_length`` if unknown)."""
        return self._held.get(request_id, (0, self.expect.max_length))[1]

    def close(self, request_id: str) -> None:
        self._held.pop(request_id, None)
