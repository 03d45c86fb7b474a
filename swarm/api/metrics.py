"""Prometheus metrics of the orchestrator (one registry per orchestrator, so tests can run several)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
MAX_CLIENT_LABELS = 64  # distinct client label values; later clients are counted under OTHER
OTHER = "_other"


class ClientLabels:
    """Bounded label values for client ids: the first ``limit`` clients keep their name, the rest share
    :data:`OTHER` (without API keys, clients name themselves: their number is not bounded)."""

    def __init__(self, limit: int = MAX_CLIENT_LABELS):
        self.limit, self.known = limit, set()

    def __call__(self, client: str) -> str:
        if client in self.known:
            return client
        if len(self.known) < self.limit:
            self.known.add(client)
            return client
        return OTHER


class _SwarmCollector:
    """Gauges read from the orchestrator's state at scrape time (never stale, nothing to keep in sync)."""

    def __init__(self, orchestrator, labels: ClientLabels):
        self.orchestrator, self.labels = orchestrator, labels

    def collect(self):
        status = self.orchestrator.status()
        servers = GaugeMetricFamily("chainswarm_servers", "servers by state", labels=["state"])
        states: dict[str, int] = {}
        for s in status["servers"]:
            state = "suspect" if s["suspect"] else s["state"]
            states[state] = states.get(state, 0) + 1
        for state, n in sorted(states.items()):
            servers.add_metric([state], n)
        yield servers
        capacity = GaugeMetricFamily("chainswarm_chain_capacity", "concurrent sessions per chain", labels=["chain"])
        active = GaugeMetricFamily("chainswarm_chain_active", "sessions running per chain", labels=["chain"])
        for c in status["chains"]:
            capacity.add_metric([c["id"]], c["capacity"])
            active.add_metric([c["id"]], c["active"])
        yield capacity
        yield active
        queue = GaugeMetricFamily("chainswarm_queue_length", "requests waiting per client", labels=["client"])
        service = GaugeMetricFamily("chainswarm_client_service", "service received (cost units)", labels=["client"])
        waiting: dict[str, float] = {}
        served: dict[str, float] = {}
        for client, info in status["clients"].items():
            label = self.labels(client)
            waiting[label] = waiting.get(label, 0) + info["waiting"]
            served[label] = served.get(label, 0.0) + info["service"]
        for label in waiting:
            queue.add_metric([label], waiting[label])
            service.add_metric([label], served[label])
        yield queue
        yield service
        prefix = status.get("prefix") or {}
        yield GaugeMetricFamily("chainswarm_prefix_hit_rate", "share of requests that reused a cached prompt prefix",
                                value=prefix.get("hit_rate", 0.0))
        yield GaugeMetricFamily("chainswarm_prefix_token_hit_rate", "share of prompt tokens reused from prefix caches",
                                value=prefix.get("token_hit_rate", 0.0))
        yield GaugeMetricFamily("chainswarm_prefix_tokens_saved", "prompt tokens not recomputed thanks to reuse",
                                value=prefix.get("tokens_saved", 0))
        yield GaugeMetricFamily("chainswarm_prefix_requests", "requests probed for prefix reuse",
                                value=prefix.get("requests", 0))
        cached = GaugeMetricFamily("chainswarm_chain_cached_prefix_tokens",
                                   "prompt tokens cached on every server of the chain (radix index)", labels=["chain"])
        for c in status["chains"]:
            cached.add_metric([c["id"]], c.get("cached_prefix_tokens", 0))
        yield cached
        plan = status["plan"] or {}
        yield GaugeMetricFamily("chainswarm_plan_capacity", "total chain capacity of the plan",
                                value=plan.get("total_capacity") or 0)
        yield GaugeMetricFamily("chainswarm_replans", "plans computed since start", value=plan.get("replans") or 0)
        checks = status.get("verification")  # spot checks (swarm.trust.verification)
        if checks is None:
            return
        counts = CounterMetricFamily("chainswarm_spot_checks", "spot checks of the servers' arithmetic, by outcome",
                                     labels=["outcome"])
        for outcome in ("passed", "mismatches", "inconclusive", "skipped", "strikes"):
            counts.add_metric([outcome], checks["counts"][outcome])
        yield counts
        yield GaugeMetricFamily("chainswarm_servers_banned", "servers banned by the spot checks",
                                value=len(checks["banned"]))
        yield GaugeMetricFamily("chainswarm_spot_check_overhead", "block-positions re-executed by checks per "
                                "block-position served", value=checks["overhead"])
        yield GaugeMetricFamily("chainswarm_spot_check_compute_overhead", "compute time of the checks (one prefill "
                                "each) per compute time served, by the servers' profiles",
                                value=checks.get("compute_overhead", 0.0))


class _BatchCollector:
    """The engine's batched path (:meth:`swarm.engine.generation.GenerationEngine.batch_stats`), read at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.batch_stats()
        yield CounterMetricFamily("chainswarm_batched_steps", "chain steps of the batched path (one message per "
                                  "server for all the chain's sessions)", value=stats["steps"])
        yield CounterMetricFamily("chainswarm_batched_session_steps", "session-steps those chain steps carried "
                                  "(divided by chainswarm_batched_steps: the mean batch)", value=stats["sequence_steps"])
        yield CounterMetricFamily("chainswarm_batched_chosen_steps", "session-steps whose tokens the chain's last "
                                  "server chose (embeddings, LM head and sampling on the servers)",
                                  value=stats.get("chosen_steps", 0))
        yield CounterMetricFamily("chainswarm_batched_fallbacks", "batched sessions that went on as one petals "
                                  "session each (a server failed or has no multi-session streams)",
                                  value=stats["fallbacks"])
        yield GaugeMetricFamily("chainswarm_batched_generators", "live batches of sessions, one per chain and lane "
                                "(--batch-lanes)", value=stats["generators"])
        yield GaugeMetricFamily("chainswarm_batched_step_positions", "decode positions a chain step fills with "
                                "speculative drafts: its servers' smallest batch bound (--max-batch), the least over "
                                "live batches (0: none live)", value=stats["step_positions"])
        speculation = getattr(self.engine, "speculation", None)
        if speculation is not None:  # --speculative
            spec = speculation.stats()
            yield CounterMetricFamily("chainswarm_speculative_drafted_tokens", "tokens drafted for verification",
                                      value=spec["proposed"])
            yield CounterMetricFamily("chainswarm_speculative_accepted_tokens", "drafted tokens the chain's pass "
                                      "verified (each saved one step)", value=spec["accepted"])
            yield CounterMetricFamily("chainswarm_speculative_verifications", "decode steps that carried drafts",
                                      value=spec["verifications"])


class SwarmMetrics:
    def __init__(self, orchestrator, engine=None):
        self.registry = CollectorRegistry()
        self.client_label = ClientLabels()
        self.registry.register(_SwarmCollector(orchestrator, self.client_label))
        if engine is not None and hasattr(engine, "batch_stats"):
            self.registry.register(_BatchCollector(engine))
        self.requests = Counter("chainswarm_requests", "finished requests", ["client", "outcome"],
                                registry=self.registry)
        self.aborted = Counter("chainswarm_sessions_aborted", "sessions aborted, by reason (stalled: no progress "
                               "within the stall limit; client_gone; failed: the session raised; preempted: no KV "
                               "room for a growing answer, its rest queued again)", ["reason"], registry=self.registry)
        self.tokens = Counter("chainswarm_generated_tokens", "tokens generated", ["client"], registry=self.registry)
        self.waiting = Histogram("chainswarm_waiting_seconds", "queueing time before a chain slot",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.service = Histogram("chainswarm_service_seconds", "session time on the chain",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("chainswarm_time_to_first_token_seconds", "request arrival to its first token "
                              "(queueing included), per client", ["client"], buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("chainswarm_inter_token_latency_seconds", "time between consecutive tokens of a "
                             "session, per client", ["client"], buckets=_TOKEN_BUCKETS, registry=self.registry)

    def observe(self, client: str, outcome: str, waiting_s: float, service_s: float) -> None:
        self.requests.labels(self.client_label(client), outcome).inc()
        self.waiting.observe(waiting_s)
        self.service.observe(service_s)
