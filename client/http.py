"""``SwarmClient``: generate text through a Chainswarm orchestrator over HTTP (OpenAI-style completions and chat)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import httpx


@dataclass
class Score:
    """A text scored by the model (:meth:`SwarmClient.score`): its tokens, each one's log-probability after the
    ones before it (None for the first, which follows nothing) and the ``top`` most likely tokens there."""

    tokens: list[str]
    logprobs: list[float | None]
    top: list[dict[str, float] | None]
    raw: dict | None = None

    @property
    def log_likelihood(self) -> float:
        """The sum of the scored tokens' log-probabilities (natural log)."""
        return sum(lp for lp in self.logprobs if lp is not None)

    @property
    def perplexity(self) -> float:
        """exp of the mean negative log-likelihood per scored token (nan for a text of one token)."""
        scored = sum(lp is not None for lp in self.logprobs)
        return math.exp(-self.log_likelihood / scored) if scored else math.nan


class SwarmError(RuntimeError):
    """The orchestrator refused or failed a request: ``status`` is the HTTP status, ``code`` which error it is
    (``context_length_exceeded``, ``rate_limited`` …) and ``param`` the request field at fault, if one is."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.param = status, code, message, param

    @classmethod
    def of(cls, status: int, error: dict) -> "SwarmError":
        """From an error object ``{"message", "type", "param", "code"}``."""
        return cls(status, error.get("code") or error.get("type") or "error", error.get("message", ""),
                   error.get("param"))


@dataclass
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    chain_id: str | None = None
    waiting_s: float | None = None
    service_s: float | None = None
    raw: dict | None = None


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds the orchestrator asked us to wait before retrying (None: do not retry)."""
    if response.status_code not in (429, 503):
        return None
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = dict(response.json()["error"])
    except (ValueError, KeyError, TypeError, AttributeError):
        error = {"message": response.text}
    raise SwarmError.of(response.status_code, error)


class SwarmClient:
    """A small, synchronous client of the orchestrator's HTTP API.

    >>> client = SwarmClient("http://127.0.0.1:8000", api_key="secret")
    >>> client.generate("Once upon a time", max_new_tokens=32, temperature=0).text
    >>> for piece in client.stream("Once upon a time", max_new_tokens=32): print(piece, end="")
    >>> client.chat([{"role": "user", "content": "What is the capital of France?"}], temperature=0).text

    Sampling keywords of :meth:`generate`, :meth:`stream`, :meth:`chat` and :meth:`chat_stream`: ``temperature``
    (0: greedy), ``top_p``, ``seed`` (same seed and prompt: same text) and ``stop`` (strings that end the text,
    never part of it).
    """

    def __init__(self, url: str, api_key: str | None = None, *, client_id: str | None = None,
                 timeout: float = 600.0, retries: int = 3, max_retry_wait_s: float = 60.0,
                 reconnect_s: float = 60.0):
        headers = {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        if client_id:
            headers["X-Client-Id"] = client_id
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries, self.max_retry_wait_s = retries, max_retry_wait_s
        self.reconnect_s = reconnect_s  # how long a refused connection is retried (an orchestrator restarting)

    def _post(self, path: str, body: dict) -> httpx.Response:
        """POST, honouring the orchestrator's Retry-After on 429 (queue full) and 503 (queue timeout): wait as
        told (at most ``max_retry_wait_s``) and try again, up to ``retries`` times. A refused connection (the
        request never reached it: an orchestrator restarting) is retried for up to ``reconnect_s`` seconds."""
        for attempt in range(self.retries + 1):
            response = self._connect(lambda: self._http.post(path, json=body))
            wait = _retry_after(response)
            if wait is None or attempt == self.retries or wait > self.max_retry_wait_s:
                return response
            time.sleep(wait)
        return response  # pragma: no cover - the loop always returns

    def _connect(self, send):
        deadline, pause = time.monotonic() + self.reconnect_s, 0.25
        while True:
            try:
                return send()
            except httpx.ConnectError:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2.0, pause * 2)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SwarmClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                  stop: list[str] | None, stream: bool) -> dict:
        body = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "stream": stream}
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = list(stop)
        return body

    def _complete(self, path: str, body: dict) -> tuple[dict, dict]:
        response = self._post(path, body)
        _raise_for(response)
        doc = response.json()
        return doc, doc["choices"][0]

    @staticmethod
    def _completion(doc: dict, text: str, choice: dict) -> Completion:
        usage, swarm = doc["usage"], doc.get("chainswarm", {})
        return Completion(text, choice["finish_reason"], usage["prompt_tokens"], usage["completion_tokens"],
                          swarm.get("chain_id"), swarm.get("waiting_s"), swarm.get("service_s"), doc)

    def generate(self, prompt: str, max_new_tokens: int = 32, *, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, stop: list[str] | None = None) -> Completion:
        """The text that follows ``prompt`` (``POST /v1/completions``)."""
        body = {"prompt": prompt, **self._sampling(max_new_tokens, temperature, top_p, seed, stop, False)}
        doc, choice = self._complete("/v1/completions", body)
        return self._completion(doc, choice["text"], choice)

    def stream(self, prompt: str, max_new_tokens: int = 32, *, temperature: float = 1.0, top_p: float = 1.0,
               seed: int | None = None, stop: list[str] | None = None) -> Iterator[str]:
        """Yield text pieces as the swarm generates them (server-sent events)."""
        body = {"prompt": prompt, **self._sampling(max_new_tokens, temperature, top_p, seed, stop, True)}
        yield from self._events("/v1/completions", body, lambda choice: choice.get("text"))

    def chat(self, messages: list[dict], max_new_tokens: int = 32, *, temperature: float = 1.0, top_p: float = 1.0,
             seed: int | None = None, stop: list[str] | None = None) -> Completion:
        """The assistant's answer to ``messages`` (``[{"role": ..., "content": ...}]``, through the model's chat
        template: ``POST /v1/chat/completions``)."""
        body = {"messages": messages, **self._sampling(max_new_tokens, temperature, top_p, seed, stop, False)}
        doc, choice = self._complete("/v1/chat/completions", body)
        return self._completion(doc, choice["message"].get("content") or "", choice)

    def chat_stream(self, messages: list[dict], max_new_tokens: int = 32, *, temperature: float = 1.0,
                    top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None) -> Iterator[str]:
        """Yield the answer's text pieces as the swarm generates them."""
        body = {"messages": messages, **self._sampling(max_new_tokens, temperature, top_p, seed, stop, True)}
        yield from self._events("/v1/chat/completions", body, lambda choice: choice.get("delta", {}).get("content"))

    def score(self, text: str, *, top: int = 0) -> Score:
        """Every token of ``text`` with its log-probability under the served model after the tokens before it, and
        the ``top`` (at most 5) most likely tokens at each position: ``POST /v1/completions`` with ``echo``,
        ``logprobs`` and ``max_tokens`` 0 (nothing is generated)."""
        doc, choice = self._complete("/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True,
                                                         "logprobs": top})
        logprobs = choice["logprobs"]
        return Score(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], doc)

    def _events(self, path: str, body: dict, text_of) -> Iterator[str]:
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise SwarmError.of(503, chunk["error"])
                text = text_of(chunk["choices"][0]) if chunk.get("choices") else None
                if text:
                    yield text

    def swarm(self) -> dict[str, Any]:
        response = self._http.get("/v1/swarm")
        _raise_for(response)
        return response.json()

    # leases: for clients that drive the chain themselves (see client.direct.DirectSwarmModel)
    def lease(self, input_tokens: int, max_new_tokens: int, *, timeout_s: float | None = None) -> dict:
        body: dict[str, Any] = {"input_tokens": input_tokens, "max_new_tokens": max_new_tokens}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        response = self._post("/v1/leases", body)
        _raise_for(response)
        return response.json()

    def reroute(self, lease_id: str, start: int, end: int, failed_peers: list[str]) -> list[dict]:
        return self.reroute_lease(lease_id, start, end, failed_peers)["route"]

    def reroute_lease(self, lease_id: str, start: int, end: int, failed_peers: list[str]) -> dict:
        """The reroute answer: ``route`` and a fresh session ``ticket`` (base64) covering it."""
        response = self._http.post(f"/v1/leases/{lease_id}/reroute",
                                   json={"start": start, "end": end, "failed_peers": failed_peers})
        _raise_for(response)
        return response.json()

    def renew(self, lease_id: str) -> dict:
        """Keep a lease alive another TTL (its holder's heartbeat)."""
        response = self._http.post(f"/v1/leases/{lease_id}/renew")
        _raise_for(response)
        return response.json()

    def release(self, lease_id: str, output_tokens: int | None = None) -> None:
        params = {} if output_tokens is None else {"output_tokens": output_tokens}
        _raise_for(self._http.delete(f"/v1/leases/{lease_id}", params=params))
