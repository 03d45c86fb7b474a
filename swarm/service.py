"""Run an orchestrator process: DHT peer + control loop + generation engine + HTTP API (uvicorn)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from swarm.orchestrator import Orchestrator, OrchestratorConfig
from swarm.planning import Expectations

logger = logging.getLogger(__name__)


@dataclass
class OrchestratorOptions:
    """Everything ``chainswarm orchestrator`` accepts (also used by the local swarm launcher)."""

    model_dir: str
    initial_peers: list[str] = field(default_factory=list)  # empty: this orchestrator starts the DHT
    dht_host: str = "127.0.0.1"
    dht_port: int = 0
    dht_announce_port: int | None = None  # announce another port than dht_port (a WAN-emulation proxy)
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    dht_prefix: str | None = None
    policy: str = "dlpm"
    quantum: float = 8192.0
    target_load: float = 0.7
    expected_rate: float = 1.0
    expected_input_tokens: float | None = None
    expected_output_tokens: float | None = None
    max_length: int | None = None
    placement: str = "gbp-cr"
    tuning: str = "lower-bound"
    c: int | None = None
    replan_tolerance: float = 0.05
    refresh_s: float = 1.0
    queue_timeout_s: float = 600.0
    # A server that vanishes without closing its connections (killed machine, network partition) is noticed
    # by a session only when a step times out; then the session fails over to another chain.
    request_timeout_s: float = 30.0
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> client id
    proxy: bool = True  # load the client-side model and serve /v1/completions
    # The proxy's petals client: None keeps petals' default (server-to-server push on); False relays every
    # hop's activations through the orchestrator (the paper's model).
    use_server_to_server: bool | None = None
    # Prompt-prefix reuse: per-block prefix-store budget in tokens on every server (0 = off), reserved by the
    # planner; chain_quantum = per-client per-chain stickiness Q^w of the ``swarm`` policy (None = its default).
    prefix_cache_tokens: int = 0
    chain_quantum: float | None = None
    router: str = "jffc"  # "ws-rr": BPRR's per-request WS-RR paths instead of GCA chains + JFFC
    # No-progress watchdog: abort a session without a step or token for this long (None: 4x the planned step
    # time of the step in progress, clamped to [10, 60] s); see swarm.completion.
    stall_timeout_s: float | None = None
    # The serving dtype, one choice end to end: the engine's embeddings/LM head run in it and only servers that
    # compute in it are planned (a bfloat16 server behind a float32 head gives text matching neither reference).
    torch_dtype: str = "float32"


def build_config(options: OrchestratorOptions) -> OrchestratorConfig:
    from transformers import AutoConfig

    from swarm.checkpoint import dht_prefix_for

    model_config = AutoConfig.from_pretrained(options.model_dir)
    max_length = options.max_length or min(getattr(model_config, "max_position_embeddings", 2048), 2048)
    # Defaults follow the Azure code trace (mean 2,048 input / 28 output tokens), clipped to the session length.
    output_tokens = options.expected_output_tokens or min(28.0, max(1.0, max_length / 8))
    input_tokens = options.expected_input_tokens or min(2048.0, max(1.0, max_length / 2))
    expect = Expectations(
        max_length=max_length, input_tokens=input_tokens, output_tokens=output_tokens,
        arrival_rate=options.expected_rate, target_load=options.target_load, placement=options.placement,
        tuning=options.tuning, c=options.c, replan_tolerance=options.replan_tolerance,
        prefix_cache_tokens=options.prefix_cache_tokens,
    )
    return OrchestratorConfig(
        model_dir=options.model_dir, dht_prefix=options.dht_prefix or dht_prefix_for(options.model_dir),
        num_blocks=model_config.num_hidden_layers, expect=expect, policy=options.policy, quantum=options.quantum,
        refresh_s=options.refresh_s, queue_timeout_s=options.queue_timeout_s, chain_quantum=options.chain_quantum,
        router=options.router, torch_dtype=options.torch_dtype,
    )


async def serve(options: OrchestratorOptions, report=None) -> None:
    """Run until cancelled (SIGTERM/SIGINT). ``report`` (a pipe end) receives ("ready", url, maddrs)."""
    import hivemind
    import uvicorn

    from swarm.compat import petals  # noqa: F401  (shim before anything petals)
    from swarm.http_api import create_app

    config = build_config(options)
    announce = (None if options.dht_announce_port is None
                else [f"/ip4/{options.dht_host}/tcp/{options.dht_announce_port}"])
    dht = hivemind.DHT(start=True, initial_peers=list(options.initial_peers),
                       host_maddrs=[f"/ip4/{options.dht_host}/tcp/{options.dht_port}"], announce_maddrs=announce)
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    initial_peers = list(options.initial_peers) or maddrs
    engine = None
    orchestrator = None
    try:
        sock = _bind(options.http_host, options.http_port)
        url = f"http://{options.http_host}:{sock.getsockname()[1]}"
        orchestrator = Orchestrator(config, dht, http_url=url)
        await orchestrator.start()
        if options.proxy:
            from swarm.engine import GenerationEngine

            engine = await asyncio.to_thread(GenerationEngine, options.model_dir, initial_peers=initial_peers,
                                             dht_prefix=config.dht_prefix, request_timeout=options.request_timeout_s,
                                             torch_dtype=options.torch_dtype)
            if options.use_server_to_server is not None:
                for client_config in (engine.model.config, engine.manager.config):
                    client_config.use_server_to_server = options.use_server_to_server
        app = create_app(orchestrator, engine, initial_peers=initial_peers, model_name=Path(options.model_dir).name,
                         api_keys=options.api_keys, stall_timeout_s=options.stall_timeout_s)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        logger.info("orchestrator ready at %s; DHT %s", url, maddrs)
        if report is not None:
            report.send(("ready", url, initial_peers))
        await serving
    finally:
        if orchestrator is not None:
            await orchestrator.stop()
        if engine is not None:
            await asyncio.to_thread(engine.close)
        dht.shutdown()


def _bind(host: str, port: int):
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def run(options: OrchestratorOptions, report=None) -> None:
    """Blocking entry point with clean SIGTERM/SIGINT handling."""
    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(options, report)
        except asyncio.CancelledError:
            pass

    asyncio.run(main())


def orchestrator_process_main(options: OrchestratorOptions, launcher_pid: int, report) -> None:
    """Child-process entry point used by :class:`server.local_swarm.LocalSwarm`."""
    from swarm.process import become_group_leader

    become_group_leader(launcher_pid)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # run() installs the asyncio handler
    logging.basicConfig(level=os.environ.get("CHAINSWARM_LOGLEVEL", "WARNING"))
    try:
        run(options, report)
    except Exception as exc:
        report.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
