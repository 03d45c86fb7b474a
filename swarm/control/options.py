"""The orchestrator's options: one dataclass from the command line to the orchestrator.

:class:`OrchestratorOptions` is the single source of every option of an orchestrator process: its default and
its help text live on its field. ``chainswarm orchestrator`` generates its arguments from the fields
(:func:`arguments`, :func:`from_arguments`); :class:`server.local_swarm.LocalSwarm` passes them as keywords;
:func:`swarm.service.build_config` resolves them against the model into the orchestrator's
:class:`~swarm.control.orchestrator.OrchestratorConfig` (a subclass that adds what the model decides), deriving the
planner's :class:`~swarm.control.planning.Expectations` in one function (:func:`swarm.control.planning.expectations`).

Fields marked ``cli=False`` have no generated argument: the command line writes them by hand (``--http
HOST:PORT``, ``--api-key``, ``--api-keys-file``, ``--no-proxy``) or leaves them to programs.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Iterator

from planner.plan import PLACEMENTS

POLICIES = ("dlpm", "vtc", "fcfs", "lpm", "swarm", "bfio", "lcf")
TUNINGS = ("lower-bound", "surrogate", "upper-bound")
KV_ADMISSIONS = ("tokens", "slots")
ROUTER_NAMES = ("jffc", "ws-rr")  # the table of implementations is swarm.control.routers.ROUTERS
DTYPES = ("float32", "float16", "bfloat16")
SPECULATIVE = ("off", "ngram")  # the builders are swarm.engine.speculative.SPECULATORS


def option(default: Any = MISSING, *, help: str, flag: str | None = None, cli: bool = True,
           default_factory: Any = MISSING, **argparse_kwargs: Any) -> Any:
    """A field with its help text; ``flag`` (default ``--field-name``) and ``argparse_kwargs`` (``choices``,
    ``metavar``, ``nargs``) shape its command-line argument, ``cli=False`` leaves it out."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "flag": flag, "cli": cli, "argparse": argparse_kwargs})


@dataclass
class OrchestratorOptions:
    """Everything ``chainswarm orchestrator`` accepts (also the keywords of ``LocalSwarm.add_orchestrator``)."""

    model_dir: str = option(flag="--model", help="local checkpoint directory (the model the swarm serves)")
    initial_peers: list[str] = option(default_factory=list, nargs="*", metavar="MADDR",
                                      help="join an existing DHT (default: start one; servers join with its address)")
    dht_host: str = option("127.0.0.1", flag="--host", help="address of the orchestrator's DHT peer")
    dht_port: int = option(0, help="TCP port of the DHT peer (default: any free)")
    dht_announce_port: int | None = option(None, cli=False,
                                           help="announce another port than dht_port (a WAN-emulation proxy)")
    http_host: str = option("127.0.0.1", cli=False, help="HTTP API address (--http HOST:PORT)")
    http_port: int = option(8000, cli=False, help="HTTP API port (0: any free)")
    dht_prefix: str | None = option(None, help="DHT prefix (default: derived from the model dir name)")
    policy: str = option("dlpm", choices=POLICIES, help="fairness policy for the central queue (default dlpm)")
    quantum: float = option(8192.0, help="DLPM quantum Q^u in cost units (w_e·input + w_q·output tokens)")
    target_load: float = option(0.7, help="planner's target load rho (default 0.7)")
    expected_rate: float = option(1.0, help="planning arrival rate, requests/s")
    expected_input_tokens: float | None = option(
        None, help="planning mean prompt length (default: 2048, at most half the session length)")
    expected_output_tokens: float | None = option(
        None, help="planning mean generated tokens (default: 28, at most an eighth of the session length)")
    max_length: int | None = option(None, help="the longest session allowed, prompt + output tokens (default: the "
                                    "model's context, at most 2,048); with --kv-admission slots also the KV slot size")
    kv_admission: str = option(
        "tokens", choices=KV_ADMISSIONS, help="tokens (default): a session reserves its own KV need (prompt + "
        "max_tokens, in 16-token pages) and a chain admits it while its token budget (c_k slots of the expected "
        "session length) has room; slots: every session reserves a max-length slot (the papers' fixed-length case)")
    placement: str = option("gbp-cr", choices=PLACEMENTS, help="block placement (default gbp-cr)")
    router: str = option("jffc", choices=ROUTER_NAMES,
                         help="jffc (default): GCA chains, the fairness queue and JFFC; ws-rr: BPRR's per-request "
                         "WS-RR paths over the placement (FCFS, no chains; pair with --placement bprr)")
    tuning: str = option("lower-bound", choices=TUNINGS, help="how c is tuned (default lower-bound)")
    c: int | None = option(None, help="fix the cache reservation c instead of tuning it")
    replan_tolerance: float = option(
        0.05, metavar="F", help="on a join or a failure, keep the current block ranges unless a fresh plan is better "
        "by more than this fraction (default 0.05); a large value keeps ranges, so survivors adopt the new plan "
        "without draining and reloading under load")
    replan_keep: float = option(
        0.5, metavar="F", help="make-before-break re-planning: servers that must reload for a new plan move in "
        "waves, each keeping at least this share of the routable chain capacity on the old plan's chains (default "
        "0.5); 0 = every server moves at once (break-before-make)")
    standby_chains: int = option(
        0, metavar="N", help="after each plan, servers it leaves idle hold up to N extra whole chains (standby: "
        "more often a live path after a failure, at the cost of blocks loaded and of slow chains taking bursts; "
        "-1 = as many as they form; default 0)")
    refresh_s: float = option(1.0, cli=False, help="seconds between reads of the servers' records")
    reports_s: float = option(2.0, cli=False, help="the servers' prefix eviction reports are read at most this "
                              "often (they change on evictions; servers send them on their heartbeats)")
    settle_s: float = option(2.0, cli=False, help="the first plan waits until the set of live servers has not changed "
                             "for this long (servers report their RTT once they see the orchestrator, not all at "
                             "once), at most 5x this")
    expect_servers: int = option(0, metavar="N", help="make the first plan as soon as N servers are live, without "
                                 "waiting for the set to settle (a fleet of known size); fewer live servers wait as "
                                 "without it; default 0: always wait")
    queue_timeout_s: float = option(300.0, flag="--max-queue-wait", metavar="S",
                                    help="a request that waited this long for a chain slot gets a 503 with "
                                    "Retry-After (default 300)")
    max_queue: int = option(1024, metavar="N", help="requests that may wait at once; past it a request gets a 429 "
                            "with Retry-After (default 1024)")
    max_queue_per_client: int = option(256, metavar="N", help="requests one client may have waiting at once; "
                                       "past it its requests get a 429 with Retry-After (default 256)")
    lease_ttl_s: float = option(60.0, flag="--lease-ttl", metavar="S",
                                help="a lease lives this long after its grant or its holder's last renewal (clients "
                                "renew every third of it while their session runs); a client that vanishes holds "
                                "its slots at most this long (default 60)")
    forget_idle_s: float = option(3600.0, metavar="S", help="forget the fairness counters of a client with nothing "
                                  "queued or running for this long (default 3600)")
    admin_clients: list[str] = option(default_factory=lambda: ["admin"], nargs="*", metavar="CLIENT",
                                      help="API-key clients that see operator detail in /v1/swarm (clients, "
                                      "leases, events; default: admin). Without API keys everyone does (a lab)")
    # A server that vanishes without closing its connections (killed machine, network partition) is noticed
    # by a session only when a step times out; then the session fails over to another chain.
    request_timeout_s: float = option(30.0, flag="--request-timeout",
                                      help="seconds a session step may take before its server counts as failed "
                                      "(default 30)")
    stall_timeout_s: float | None = option(
        None, flag="--stall-timeout", metavar="S",
        help="abort a session that makes no progress (no server step, no token) for S seconds, return its slot and "
        "retry it if it produced nothing (default: 4x the planned time of the step in progress, between 30 and 60 s)")
    route_wait_s: float = option(120.0, flag="--route-wait", metavar="S",
                                 help="a session whose server failed waits up to S seconds in its place in the "
                                 "queue for a chain with room for the rest of its answer, then fails with a 503 "
                                 "(a preempted one ends with finish_reason length; default 120: outlasts a re-plan "
                                 "and a block load)")
    suspect_s: float = option(60.0, flag="--failure-grace", metavar="S",
                              help="a server reported failed is left out of the plan for S seconds, unless its "
                              "record expires or it restarts as a new process (a second failure within S: not "
                              "before S; default 60)")
    grow_tokens: int = option(256, metavar="N",
                              help="an answer without max_tokens may run to the end of the session length; its KV "
                              "reservation covers N output tokens at a time and grows by N while its chain has room; "
                              "when it has none, the session is preempted and the rest queued again (recomputed, "
                              "up to --route-wait), and where no chain can hold more the answer ends with "
                              "finish_reason length (default 256)")
    torch_dtype: str = option("float32", choices=DTYPES,
                              help="the swarm's serving dtype: the orchestrator's embeddings and LM head run in it and "
                              "only servers that compute in it are planned (default float32; mixing dtypes changes "
                              "greedy answers)")
    batch_sessions: int = option(16, help="sessions the orchestrator steps together on one chain (one multi-session "
                                 "message per server and step, one LM-head pass; default 16; 0 = one petals session "
                                 "per request, as petals' own client)")
    batch_lanes: int = option(1, metavar="L",
                              help="cohorts per chain, each stepped through the chain on its own (default 1: one "
                              "lockstep cohort, every server waits while the others compute); with L > 1 a chain's "
                              "sessions are spread over L cohorts whose steps overlap on its servers, which pays "
                              "where servers have compute to spare (GPUs, many-core hosts), not on a CPU-bound one")
    speculative: str = option("ngram", choices=SPECULATIVE,
                              help="speculative decoding, batched and per-session: 'ngram' (the default) drafts up "
                              "to --speculative-k tokens per step from the request's own text and recent outputs and "
                              "the chain verifies them in the same pass (greedy answers unchanged, sampled ones keep "
                              "their distribution; a request opts out with speculative: false); 'off': one token per "
                              "step")
    speculative_k: int = option(8, metavar="K", help="most drafted tokens a session verifies per step (default 8)")
    speculative_shared: bool = option(False, action="store_true",
                                      help="draft from every client's recent outputs (default: each client's own "
                                      "only, so no client's text shapes another's drafts)")
    speculative_index_tokens: int = option(1_000_000, metavar="N",
                                           help="tokens of recent outputs the draft index keeps (default 1,000,000)")
    prefix_cache_tokens: int = option(0, help="prompt-prefix KV budget per served block, in tokens, reserved on every "
                                      "server (default 0 = no prefix reuse); pair with --policy swarm for "
                                      "locality-aware chains")
    chain_quantum: float | None = option(None, help="swarm policy: per-client per-chain stickiness quantum Q^w "
                                         "(default 16384)")
    api_keys: dict[str, str] = option(default_factory=dict, cli=False,
                                      help="API key -> client id (--api-key KEY=CLIENT, --api-keys-file)")
    token_choice: str = option("servers", choices=("servers", "orchestrator"),
                               help="where each generated token's embeddings, LM head and choice run: on the chain's "
                               "first and last servers (default: token ids travel, the orchestrator's CPU never caps "
                               "the swarm), or here (the earlier design, kept for comparison and for servers "
                               "that do not publish the chain's ends)")
    proxy: bool = option(True, cli=False, help="load the client-side model and serve /v1/completions (--no-proxy)")
    use_server_to_server: bool | None = option(
        None, cli=False, help="the proxy's petals client: None keeps petals' default (server-to-server push on); "
        "False relays every hop's activations through the orchestrator (the paper's model)")
    state_dir: str | None = option(
        None, metavar="DIR", help="keep the orchestrator's state here and restart from it: signing key, DHT identity "
        "and port, HTTP port, prefix namespace, API keys, plan and assignments, fairness counters (default for "
        "`chainswarm orchestrator`: $CHAINSWARM_STATE, else $XDG_STATE_HOME/chainswarm, else "
        "~/.local/state/chainswarm, then orchestrator/<dht prefix>-<model fingerprint>; a directory that belongs "
        "to another model is refused; --ephemeral keeps nothing)")
    log_level: str = option("INFO", help="logging level of the orchestrator process")
    # -- signed control plane (swarm.trust.identity, swarm.trust.tickets) --
    identity_key: str | None = option(None, metavar="FILE", help="the orchestrator's signing key (RSA, DER; "
                                      "created if missing; default: a new key per run). Servers pin its public "
                                      "key (shown in GET /v1/swarm as orchestrator_key)")
    ticket_ttl_s: float = option(120.0, help="lifetime of a session ticket in seconds (checked when a session opens)")
    # -- spot checks of the servers' arithmetic (swarm.trust.verification, swarm.control.spot_checks) --
    spot_check_rate: float = option(0.05, metavar="P",
                                    help="fraction of a trusted server's sessions whose span another server "
                                    "re-executes and compares (default 0.05; 0 with --spot-check-new-rate 0: off)")
    spot_check_new_rate: float = option(0.25, metavar="P",
                                        help="the same for a server that has not yet passed 5 checks (default 0.25)")
    spot_check_local: bool = option(False, action="store_true",
                                    help="where no other server holds a span, the orchestrator re-executes it "
                                    "itself (float32, from its checkpoint folder; costs its CPU and memory). "
                                    "It always does to settle a mismatch when no third server holds the span")
    dual_execution_clients: list[str] = option(default_factory=list, nargs="*", metavar="CLIENT",
                                               help="clients (API-key names) whose every request runs with dual "
                                               "execution: re-executed span by span on other servers, the answer "
                                               "only when both agree, charged twice (a request can ask for it "
                                               "itself: dual_execution)")
    spot_check_strikes: int = option(2, metavar="N", help="strikes (disagreeing with two others) that ban a server's "
                                     "node id and key for good (default 2; kept in the state directory)")


def _argument_type(annotation: Any) -> Any:
    """The scalar type argparse converts to: ``float | None`` -> float, ``list[str]`` -> str."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    return annotation


def arguments() -> Iterator[tuple[str, dict[str, Any]]]:
    """(flag, ``add_argument`` keywords) of every option with a generated argument, in field order."""
    hints = typing.get_type_hints(OrchestratorOptions)
    for f in dataclasses.fields(OrchestratorOptions):
        meta = f.metadata
        if not meta["cli"]:
            continue
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"], **meta["argparse"]}
        flag_only = "action" in kwargs  # store_true: no value, no type
        if "choices" not in kwargs and not flag_only:
            kwargs.setdefault("metavar", flag[2:].replace("-", "_").upper())
        if f.default is MISSING and f.default_factory is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default if f.default_factory is MISSING else f.default_factory()
        kind = _argument_type(hints[f.name])
        if kind is not str and not flag_only:
            kwargs["type"] = kind
        yield flag, kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in arguments():
        parser.add_argument(flag, **kwargs)


def from_arguments(args: argparse.Namespace, **others: Any) -> OrchestratorOptions:
    """The options parsed by :func:`add_arguments`, plus the hand-written ones in ``others``."""
    return OrchestratorOptions(**{kwargs["dest"]: getattr(args, kwargs["dest"]) for _, kwargs in arguments()},
                               **others)
