"""Synthetic multi-client workloads for the fairness simulation (fairness-locality.md §10).

A workload is a list of *programs* (a tree-of-thought search, a judge run, a
chat conversation, one long-document question), each a small DAG of LLM
*calls*.  A call's prompt is a tuple of *segments* ``(uid, length)``; two calls
share a token prefix exactly as far as their segment tuples agree, and the
simulator turns segments into token ids (``segment_tokens``) and page hashes
(``prompt_hashes``, memoised per segment prefix, same hash chain as
``planner.prefix_index.page_hashes``).  A call becomes ready when all its
parents have finished (plus ``delay`` seconds of think time); root calls are
ready at the program's start time.

Generators (all lengths in tokens; ``U[a, b]`` = integer uniform; the means are
the [DLPM] Table 2 statistics the generators are calibrated to):

* ``ldqa`` long-document QA (LooGLE-like): prompt = document (U[0.9, 1.1] x
  21399) + question (U[30, 70]); output U[8, 22] (mean 15).  Mean prompt 21449.
  Each client asks Geometric(mean 16) questions about one document, then moves
  to a new one.  One call per program.
* ``tot`` tree of thoughts (GSM8K-like): a tree of height 4 with branching b
  (2 for well-behaved clients: 2+4+8+16 = 30 calls).  A node's prompt =
  question (U[0.5, 1.5] x 240) + the thoughts of its ancestors (each the
  ancestor's output truncated to 128 tokens) + a 16-token step instruction;
  output U[128, 384] (mean 256).  Mean prompt 546 for b = 2.  Children start when
  their parent finishes.
* ``judge`` LLM-as-a-judge, branch-solve-merge: D branch calls (prompt =
  article U[0.75, 1.25] x 2625 + a 40-token dimension instruction) and one merge
  call (article + each verdict truncated to 64 tokens + 16); output U[128, 384].
  Mean prompt ~2700 for D = 2.
* ``chat`` multi-turn chat (Chatbot-Arena-like): 1 + Geometric(p = 0.08) turns;
  turn t's prompt = the conversation so far + a new user message U[12, 72];
  output U[71, 213] (mean 142); Exp(5 s) think time between turns.  Mean prompt
  ~56.

Misbehaving-client scenarios (§10.1 Table 3), with client ``m0`` misbehaving
and ``w1..w3`` well-behaved:

* S1 "more requests": ldqa — m0 sends questions at ``ldqa_s1_factor`` (8) times
  the rate; tot — m0's trees have branching 4 (340 calls); judge — 16
  dimensions instead of 2; chat — m0 starts ``chat_s1_factor`` (8) times as many
  conversations.
* S2 "longer prefix": every client sends programs at the same rate; ldqa — m0's
  documents are twice as long; tot — m0's questions 10x as long; judge — an
  extra 600-token preamble before each of m0's articles.

Program starts follow a Gamma renewal process per client (shape 1/cv^2,
scale cv^2/rate; cv = 1 is Poisson): well-behaved clients are Poisson, the
misbehaving client is bursty (cv = 2).  Everything is deterministic for a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from planner.prefix_index import ROOT_HASH, page_hashes

WORKLOADS = ("ldqa", "tot", "judge", "chat")
SCENARIOS = ("s1", "s2")
MISBEHAVING = "m0"
WELL_BEHAVED = ("w1", "w2", "w3")
CLIENTS = (MISBEHAVING, *WELL_BEHAVED)

# Table 2 targets (mean prompt, mean output) the generators are calibrated to.
TABLE2 = {"ldqa": (21449, 15), "tot": (546, 256), "judge": (2701, 256), "chat": (56, 142)}
MAX_NEW_TOKENS = {"ldqa": 22, "tot": 384, "judge": 384, "chat": 213}


@dataclass
class Call:
    call_id: str
    client: str
    program_id: str
    segments: tuple  # ((uid, length), ...)
    output_tokens: int
    max_new_tokens: int
    parents: tuple = ()
    delay: float = 0.0  # think time after the last parent finishes

    @property
    def input_tokens(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass
class Program:
    program_id: str
    client: str
    kind: str
    start: float
    calls: list = field(default_factory=list)  # topological order


@dataclass
class Workload:
    name: str  # e.g. "tot-s1"
    kind: str
    scenario: str
    programs: list
    clients: tuple
    misbehaving: str
    horizon: float  # program starts lie in [0, horizon)
    rates: dict  # client -> programs per second
    cv: dict  # client -> coefficient of variation of inter-arrival times

    def calls(self) -> list:
        return [c for p in self.programs for c in p.calls]

    @property
    def well_behaved(self) -> tuple:
        return tuple(c for c in self.clients if c != self.misbehaving)


# ---------------------------------------------------------------- tokens / hashes
class SegmentIds:
    """Hands out unique segment uids."""

    def __init__(self) -> None:
        self._next = 1

    def __call__(self) -> int:
        uid = self._next
        self._next += 1
        return uid


def segment_tokens(uid: int, length: int) -> list:
    """Deterministic, segment-unique token ids (only their identity matters)."""
    base = uid << 24
    return list(range(base, base + length))


class PromptHasher:
    """Page hashes of segment-tuple prompts, memoised per segment prefix, identical to
    ``page_hashes(all tokens, page_size)`` but without rehashing shared prefixes."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._memo: dict = {(): ((), ())}  # segments prefix -> (hashes, leftover tokens)

    def __call__(self, segments: Sequence) -> tuple:
        segments = tuple(segments)
        k = len(segments)
        while segments[:k] not in self._memo:
            k -= 1
        hashes, tail = self._memo[segments[:k]]
        for i in range(k, len(segments)):
            uid, n = segments[i]
            toks = list(tail) + segment_tokens(uid, n)
            full = len(toks) // self.page_size
            root = hashes[-1] if hashes else ROOT_HASH
            new = page_hashes(toks[: full * self.page_size], self.page_size, root=root)
            hashes = hashes + tuple(new)
            tail = tuple(toks[full * self.page_size :])
            self._memo[segments[: i + 1]] = (hashes, tail)
        return hashes


# ---------------------------------------------------------------- arrivals
def gamma_arrivals(rng: np.random.Generator, rate: float, cv: float, horizon: float) -> list:
    """Start times of a Gamma renewal process on [0, horizon): inter-arrival times
    ~ Gamma(shape = 1/cv^2, scale = cv^2/rate), mean 1/rate (cv = 1: Poisson)."""
    if rate <= 0:
        return []
    shape, scale = 1.0 / cv**2, cv**2 / rate
    out, t = [], 0.0
    while True:
        t += float(rng.gamma(shape, scale))
        if t >= horizon:
            return out
        out.append(t)


def _uniform(rng, mean: float, rel: float) -> int:
    lo, hi = int(round(mean * (1 - rel))), int(round(mean * (1 + rel)))
    return int(rng.integers(lo, hi + 1))


def _out(rng, mean: int) -> int:
    return int(rng.integers(mean // 2, mean + mean // 2 + 1))


# ---------------------------------------------------------------- generators
def gen_ldqa(rng, ids, client, starts, *, doc_scale=1.0, questions_per_doc=16.0):
    programs = []
    doc, left = None, 0
    for n, t in enumerate(starts):
        if left <= 0:
            doc = (ids(), _uniform(rng, 21399 * doc_scale, 0.1))
            left = int(rng.geometric(1.0 / questions_per_doc))
        left -= 1
        pid = f"{client}.q{n}"
        call = Call(f"{pid}.0", client, pid, (doc, (ids(), int(rng.integers(30, 71)))),
                    int(rng.integers(8, 23)), MAX_NEW_TOKENS["ldqa"])
        programs.append(Program(pid, client, "ldqa", t, [call]))
    return programs


def gen_tot(rng, ids, client, starts, *, branching=2, question_scale=1.0, height=4, keep=128):
    programs = []
    for n, t in enumerate(starts):
        pid = f"{client}.t{n}"
        question = (ids(), _uniform(rng, 240 * question_scale, 0.5))
        calls = []
        # frontier of (call, prefix segments for children)
        frontier = [(None, (question,))]
        for level in range(1, height + 1):
            nxt = []
            for parent, prefix in frontier:
                for _ in range(branching):
                    cid = f"{pid}.{len(calls)}"
                    o = _out(rng, 256)
                    call = Call(cid, client, pid, prefix + ((ids(), 16),), o, MAX_NEW_TOKENS["tot"],
                                parents=() if parent is None else (parent.call_id,))
                    calls.append(call)
                    nxt.append((call, prefix + ((ids(), min(o, keep)),)))
            frontier = nxt
        programs.append(Program(pid, client, "tot", t, calls))
    return programs


def gen_judge(rng, ids, client, starts, *, dimensions=2, preamble=0, verdict_keep=64):
    programs = []
    pre = ((ids(), preamble),) if preamble else ()
    dims = [(ids(), 40) for _ in range(dimensions)]  # the same instructions for every article
    for n, t in enumerate(starts):
        pid = f"{client}.j{n}"
        article = pre + ((ids(), _uniform(rng, 2625, 0.25)),)
        calls = []
        for d in range(dimensions):
            calls.append(Call(f"{pid}.{d}", client, pid, article + (dims[d],), _out(rng, 256), MAX_NEW_TOKENS["judge"]))
        verdicts = tuple((ids(), min(c.output_tokens, verdict_keep)) for c in calls)
        calls.append(Call(f"{pid}.m", client, pid, article + verdicts + ((ids(), 16),), _out(rng, 256),
                          MAX_NEW_TOKENS["judge"], parents=tuple(c.call_id for c in calls)))
        programs.append(Program(pid, client, "judge", t, calls))
    return programs


def gen_chat(rng, ids, client, starts, *, p_more=0.08, think=5.0):
    programs = []
    for n, t in enumerate(starts):
        pid = f"{client}.c{n}"
        history: tuple = ()
        calls = []
        turns = int(rng.geometric(1.0 - p_more))  # 1 + Geometric(p_more) extra turns
        for k in range(turns):
            msg = (ids(), int(rng.integers(12, 73)))
            o = int(rng.integers(71, 214))
            call = Call(f"{pid}.{k}", client, pid, history + (msg,), o, MAX_NEW_TOKENS["chat"],
                        parents=(calls[-1].call_id,) if calls else (),
                        delay=float(rng.exponential(think)) if calls else 0.0)
            calls.append(call)
            history = history + (msg, (ids(), o))
        programs.append(Program(pid, client, "chat", t, calls))
    return programs


GENERATORS: dict[str, Callable] = {"ldqa": gen_ldqa, "tot": gen_tot, "judge": gen_judge, "chat": gen_chat}


def scenario_options(kind: str, scenario: str, client: str) -> dict:
    """Generator options of one client in a scenario (§10.1 Table 3)."""
    if client != MISBEHAVING:
        return {}
    if scenario == "s1":
        return {"tot": {"branching": 4}, "judge": {"dimensions": 16}}.get(kind, {})
    return {"ldqa": {"doc_scale": 2.0}, "tot": {"question_scale": 10.0}, "judge": {"preamble": 600}}.get(kind, {})


# Rate multiplier of the misbehaving client (S1 for the workloads whose
# misbehaviour is a higher request rate).
RATE_FACTOR = {("ldqa", "s1"): 8.0, ("chat", "s1"): 8.0}


def build_workload(
    kind: str,
    scenario: str,
    *,
    rate: float,
    horizon: float,
    seed: int = 0,
    page_size: int = 16,
    cv_well: float = 1.0,
    cv_mis: float = 2.0,
) -> Workload:
    """Programs of the four clients; ``rate`` = programs per second of a well-behaved client."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown workload {kind!r}; expected one of {WORKLOADS}")
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")
    ids = SegmentIds()
    programs, rates, cvs = [], {}, {}
    for i, client in enumerate(CLIENTS):
        rng = np.random.default_rng([seed, i, WORKLOADS.index(kind), SCENARIOS.index(scenario)])
        mis = client == MISBEHAVING
        r = rate * (RATE_FACTOR.get((kind, scenario), 1.0) if mis else 1.0)
        cv = cv_mis if mis else cv_well
        starts = gamma_arrivals(rng, r, cv, horizon)
        programs += GENERATORS[kind](rng, ids, client, starts, **scenario_options(kind, scenario, client))
        rates[client], cvs[client] = r, cv
    programs.sort(key=lambda p: (p.start, p.program_id))
    return Workload(f"{kind}-{scenario}", kind, scenario, programs, CLIENTS, MISBEHAVING, horizon, rates, cvs)


def generator_stats(kind: str, n_programs: int = 400, seed: int = 0, **options) -> dict:
    """Empirical statistics of a generator (mean prompt/output tokens, calls per program)."""
    rng = np.random.default_rng(seed)
    programs = GENERATORS[kind](rng, SegmentIds(), "x", [float(i) for i in range(n_programs)], **options)
    calls = [c for p in programs for c in p.calls]
    return {
        "programs": len(programs),
        "calls": len(calls),
        "calls_per_program": len(calls) / max(1, len(programs)),
        "mean_prompt": float(np.mean([c.input_tokens for c in calls])),
        "mean_output": float(np.mean([c.output_tokens for c in calls])),
        "max_prompt": int(max(c.input_tokens for c in calls)),
        "max_output": int(max(c.output_tokens for c in calls)),
    }


def expected_call_cost(kind: str, **options) -> dict:
    """Means used to size arrival rates: per program, the cold and warm work in
    (prefill tokens, output tokens).  Warm assumes every shared prefix is cached."""
    programs = GENERATORS[kind](np.random.default_rng(12345), SegmentIds(), "x", [float(i) for i in range(200)], **options)
    cold_in = warm_in = out = 0.0
    seen: set = set()
    for p in programs:
        for c in p.calls:
            cold_in += c.input_tokens
            out += c.output_tokens
            shared = 0
            for k in range(len(c.segments), 0, -1):
                if c.segments[:k] in seen:
                    shared = sum(n for _, n in c.segments[:k])
                    break
            warm_in += c.input_tokens - shared
            for k in range(1, len(c.segments) + 1):
                seen.add(c.segments[:k])
    n = len(programs)
    return {"cold_input": cold_in / n, "warm_input": warm_in / n, "output": out / n}


def jsonable_stats(w: Workload) -> dict:
    """Per-client counts and means of a generated workload (for the JSON)."""
    out = {}
    for client in w.clients:
        calls = [c for p in w.programs if p.client == client for c in p.calls]
        progs = [p for p in w.programs if p.client == client]
        out[client] = {
            "programs": len(progs),
            "calls": len(calls),
            "rate_programs_per_s": w.rates[client],
            "cv": w.cv[client],
            "mean_prompt": float(np.mean([c.input_tokens for c in calls])) if calls else math.nan,
            "mean_output": float(np.mean([c.output_tokens for c in calls])) if calls else math.nan,
        }
    return out
