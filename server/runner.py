"""Run one petals server for a fixed block range inside the current process.

``server_kwargs`` are petals ``Server`` keyword arguments; :func:`offline_server_kwargs` fills in what a
private, offline swarm needs. The function blocks until SIGTERM.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)


def offline_server_kwargs(
    model_dir: str,
    *,
    dht_prefix: str,
    initial_peers: list[str],
    block_indices: tuple[int, int] | None = None,
    num_blocks: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    announce_port: int | None = None,
    device: str | None = None,
    torch_dtype: str = "float32",
    cache_tokens: int = 8192,
    max_length: int = 1024,
    update_period: float = 5.0,
    throughput: float | str = 1.0,
    num_handlers: int = 2,
    **extra: Any,
) -> dict[str, Any]:
    """petals ``Server`` kwargs for a private swarm that never reaches the internet.

    ``block_indices`` pins the span ``[start, end)`` (which also switches petals' rebalancing off);
    ``num_blocks`` lets petals choose the blocks itself (the PETALS baseline). ``announce_port`` makes the
    server announce another port than it listens on (a WAN-emulation proxy in front of it). ``device`` None is
    CUDA where there is a GPU, else the CPU, as ``chainswarm server`` without ``--device``.
    """
    if (block_indices is None) == (num_blocks is None):
        raise ValueError("give exactly one of block_indices or num_blocks")
    kwargs: dict[str, Any] = dict(
        converted_model_name_or_path=str(model_dir),
        dht_prefix=dht_prefix,
        initial_peers=list(initial_peers),
        device=device,
        torch_dtype=torch_dtype,
        throughput=throughput,
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        use_relay=False,
        use_auto_relay=False,
        reachable_via_relay=False,
        skip_reachability_check=True,
        num_handlers=num_handlers,
        inference_max_length=max_length,
        attn_cache_tokens=cache_tokens,
        max_alloc_timeout=5,
        update_period=update_period,
        mean_balance_check_period=60,
        mean_block_selection_delay=0.5,
    )
    if announce_port is not None:
        kwargs["announce_maddrs"] = [f"/ip4/{host}/tcp/{announce_port}"]
    if block_indices is not None:
        start, end = block_indices
        kwargs["block_indices"] = f"{start}:{end}"
    else:
        kwargs["num_blocks"] = num_blocks
    kwargs.update(extra)
    return kwargs


def _report_when_ready(server, report) -> None:
    """Send ("ready", peer_id, start, end) through ``report`` once the server's blocks serve requests."""
    while not server.stop.is_set():
        container = getattr(server, "module_container", None)
        if container is not None and container.ready.wait(0.2):
            blocks = sorted(container.module_backends)
            indices = [int(uid.rsplit(".", 1)[1]) for uid in blocks]
            report.send(("ready", server.dht.peer_id.to_base58(), min(indices), max(indices) + 1))
            return
        server.stop.wait(0.1)


def serve(server_kwargs: dict[str, Any], report=None, server_class=None) -> None:
    """Build a petals server from ``server_kwargs`` and run it until SIGTERM / SystemExit.

    ``server_kwargs["emulated_compute"]`` (``{"prefill_s", "decode_s"}``, optional) emulates an accelerator
    (:mod:`server.emulation`); the server then announces the emulated speed to petals' routing and block
    selection (``inference_rps`` = ``throughput`` = 1 / decode_s, ``forward_rps`` = 1 / prefill_s), as
    petals' own benchmark would on that hardware.
    """
    from swarm.model.compat import petals  # noqa: F401  (applies the shim before petals.server is used)
    from petals.server.server import Server

    from swarm.model.families import install_server_hooks

    install_server_hooks()  # blocks bound to their layers, KV at the real head_dim

    server_kwargs = dict(server_kwargs)
    emulated = server_kwargs.pop("emulated_compute", None)
    if emulated is not None:
        from server import emulation

        emulated = emulation.install(emulated)
    server = (server_class or Server)(**server_kwargs)
    if emulated is not None and emulated.decode_s > 0:
        server.server_info.inference_rps = server.server_info.throughput = 1.0 / emulated.decode_s
        if emulated.prefill_s > 0:
            server.server_info.forward_rps = 1.0 / emulated.prefill_s
    if report is not None:
        threading.Thread(target=_report_when_ready, args=(server, report), daemon=True).start()
    try:
        server.run()
    finally:
        server.shutdown()


def server_process_main(server_kwargs: dict[str, Any], launcher_pid: int, report=None) -> None:
    """Entry point of a server child process started by :class:`server.local_swarm.LocalSwarm`."""
    from swarm.runtime.process import become_group_leader

    become_group_leader(launcher_pid)
    logging.basicConfig(level=os.environ.get("CHAINSWARM_LOGLEVEL", "WARNING"))
    try:
        serve(server_kwargs, report)
    except Exception as exc:  # tell the launcher instead of leaving it waiting for "ready"
        if report is not None:
            report.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
