"""Run an orchestrator process: DHT peer + control loop + generation engine + HTTP API (uvicorn)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

from swarm.control import planning
from swarm.control.options import OrchestratorOptions
from swarm.control.orchestrator import Orchestrator, OrchestratorConfig
from swarm.runtime.dht import PeersUnreachable, StartupError, p2p_start_failure, reachable_maddrs, stop_dht
from swarm.trust.validation import swarm_validators

__all__ = ["OrchestratorOptions", "build_config", "serve", "run", "orchestrator_process_main"]

logger = logging.getLogger(__name__)


def build_config(options: OrchestratorOptions) -> OrchestratorConfig:
    """The options resolved for their model: its blocks, the planner's expectations and the DHT prefix."""
    from swarm.model.checkpoint import dht_prefix_for
    from swarm.model.compat import petals

    # the family's own config class (swarm.model.families): an unsupported family is a one-line ValueError
    model_config = petals.AutoDistributedConfig.from_pretrained(options.model_dir)
    given = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    given["dht_prefix"] = options.dht_prefix or dht_prefix_for(options.model_dir)
    return OrchestratorConfig(**given, num_blocks=model_config.num_hidden_layers,
                              expect=planning.expectations(options, model_config))


async def serve(options: OrchestratorOptions, report=None) -> None:
    """Run until cancelled (SIGTERM/SIGINT). ``report`` (a pipe end) receives ("ready", url, maddrs)."""
    import hivemind
    import uvicorn

    from swarm.model.compat import petals  # noqa: F401  (shim before anything petals)
    from swarm.api.app import create_app

    from swarm.trust.identity import Identity

    store = None
    if options.state_dir:
        from swarm.state import ownership
        from swarm.state.persistence import prepare
        from swarm.state.store import StateDir

        store = StateDir(options.state_dir)
        model = build_config(options)  # its prefix and number of blocks: whose state this may be
        ownership.claim(store, ownership.ModelIdentity.of(options.model_dir, model.dht_prefix), model.num_blocks)
        options = prepare(options, store)
    config = build_config(options)
    if store is not None:
        config.prefix_secret = store.prefix_secret()
    # the signing key: given, or kept in the state directory (servers pinned it: a restart must keep it)
    key_path = options.identity_key or (None if store is None else str(Path(options.state_dir) / "orchestrator.key"))
    identity = Identity.load_or_create(key_path) if key_path else Identity.generate()
    logger.info("orchestrator key %s: %s", identity.fingerprint, identity.public.decode())
    announce = (None if options.dht_announce_port is None
                else [f"/ip4/{options.dht_host}/tcp/{options.dht_announce_port}"])

    def start_dht(dial: list[str]):
        return hivemind.DHT(start=True, initial_peers=dial, ensure_bootstrap_success=bool(options.initial_peers),
                            host_maddrs=[f"/ip4/{options.dht_host}/tcp/{options.dht_port}"], announce_maddrs=announce,
                            identity_path=None if store is None else store.identity_path(),
                            record_validators=swarm_validators(identity, config.dht_prefix),
                            num_workers=32)  # the engine's lookups of every block's servers go through it too

    dht = _start_bootstrap(start_dht, list(options.initial_peers), [] if store is None else store.peers())
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    keeper = saver = None
    initial_peers = list(options.initial_peers) or maddrs
    engine = None
    orchestrator = None
    try:
        sock = _bind(options.http_host, options.http_port)
        url = f"http://{options.http_host}:{sock.getsockname()[1]}"
        ledger = None
        if store is not None:  # bans outlive a restart
            from swarm.trust.verification import CheckPolicy, Ledger

            ledger = Ledger(CheckPolicy(config.spot_check_rate, config.spot_check_new_rate,
                                        strikes_to_ban=config.spot_check_strikes),
                            path=Path(options.state_dir) / "bans.json")
        orchestrator = Orchestrator(config, dht, http_url=url, identity=identity, ledger=ledger)
        if store is not None:
            keeper = await _restore(store, options, orchestrator, maddrs, sock.getsockname()[1])
        await orchestrator.start()
        if keeper is not None:
            saver = asyncio.create_task(keeper.run(), name="orchestrator-state")
        if options.proxy:
            from swarm.engine.generation import GenerationEngine
            from swarm.engine.speculative import from_options as speculation

            engine = await asyncio.to_thread(GenerationEngine, options.model_dir, initial_peers=initial_peers,
                                             dht_prefix=config.dht_prefix, request_timeout=options.request_timeout_s,
                                             torch_dtype=options.torch_dtype, batch_sessions=options.batch_sessions,
                                             batch_lanes=options.batch_lanes,
                                             speculation=speculation(options),
                                             batch_bound=orchestrator.route_batch_bound,  # drafts per step
                                             route_ends=(orchestrator.route_ends  # ids in, tokens out
                                                         if options.token_choice == "servers" else None),
                                             dht=dht)  # one DHT and libp2p daemon for the orchestrator and it
            if options.use_server_to_server is not None:
                for client_config in (engine.model.config, engine.manager.config):
                    client_config.use_server_to_server = options.use_server_to_server
            from swarm.control.spot_checks import attach

            attach(orchestrator, engine, options.model_dir)
        app = create_app(orchestrator, engine, initial_peers=initial_peers, model_name=Path(options.model_dir).name,
                         api_keys=options.api_keys, stall_timeout_s=options.stall_timeout_s,
                         route_wait_s=options.route_wait_s, grow_tokens=options.grow_tokens)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        logger.info("orchestrator ready at %s; DHT %s", url, maddrs)
        if report is not None:
            report.send(("ready", url, initial_peers))
        await serving
    finally:
        if saver is not None:
            saver.cancel()  # its last save runs as it ends
            with contextlib.suppress(asyncio.CancelledError):
                await saver
        if orchestrator is not None:
            await orchestrator.stop()
        if orchestrator is not None and orchestrator.checks is not None:
            orchestrator.checks.close()
        if engine is not None:
            await asyncio.to_thread(engine.close)
        stop_dht(dht)


def _start_bootstrap(start_dht, given: list[str], remembered: list[str]):
    """The orchestrator's DHT peer. ``given`` initial peers (``--initial-peers``) must answer; without them the
    orchestrator is the swarm's bootstrap, and the servers it ``remembered`` from its last run are dialled as a
    hint only: those whose address does not answer are skipped (one log line), and when none of the others lets
    the libp2p daemon start either, it starts on its own port alone — servers that come back rejoin through it."""
    def start(peers: list[str]):  # a daemon that will not start: its one-line StartupError
        try:
            return start_dht(peers)
        except Exception as exc:
            failure = p2p_start_failure(exc, peers, "--dht-port", "are those peers up, and their addresses right?")
            if failure is None:
                raise
            raise failure from None

    dial = given or reachable_maddrs(remembered)
    if not given and len(dial) < len(remembered):
        logger.info("%d of the %d servers remembered from the last run do not answer: not dialled (they rejoin "
                    "when they are back)", len(remembered) - len(dial), len(remembered))
    try:
        return start(dial)
    except PeersUnreachable:
        if given:
            raise
    logger.info("none of the remembered servers let the DHT join them: starting the swarm's DHT alone")
    return start([])


async def _restore(store, options: OrchestratorOptions, orchestrator: Orchestrator, maddrs: list[str],
                   http_port: int):
    """Record the ports bound, re-adopt the saved plan and counters, wait for the planned servers (bounded)."""
    from swarm.state.persistence import Persistence, bound_tcp_port

    store.record_ports(dht_port=bound_tcp_port(maddrs) if options.dht_announce_port is None else None,
                       http_port=http_port)
    keeper = Persistence(store, orchestrator)
    restored = keeper.restore()
    if restored["plan_id"] is not None:
        began = time.monotonic()
        missing = await keeper.await_servers(orchestrator.config.assignment_ttl_s)
        logger.info("restored plan %s and the counters of %d clients from %s; %s after %.1f s", restored["plan_id"],
                    len(restored["clients"]), store.path,
                    f"servers not back: {sorted(missing)}" if missing else "all its servers are back",
                    time.monotonic() - began)
    return keeper


def _bind(host: str, port: int):
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port} (--http): {exc.strerror or exc}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def run(options: OrchestratorOptions, report=None) -> None:
    """Blocking entry point with clean SIGTERM/SIGINT handling; the DHT's process dies with this one."""
    from swarm.runtime.dht import quiet_p2p_noise
    from swarm.runtime.process import children_die_with_me, freeze_imported_heap

    children_die_with_me()
    quiet_p2p_noise()
    freeze_imported_heap()
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
    from swarm.runtime.process import become_group_leader

    become_group_leader(launcher_pid)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # run() installs the asyncio handler
    logging.basicConfig(level=os.environ.get("CHAINSWARM_LOGLEVEL", "WARNING"))
    try:
        run(options, report)
    except Exception as exc:
        report.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
