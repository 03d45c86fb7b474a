"""``chainswarm server``: run a volunteer server node in the foreground.

The node profiles itself, publishes the profile, waits for the orchestrator's assignment and serves those
blocks (:class:`server.node.ChainswarmServer`). GPU-related flags go to petals' ``Server`` as petals' own
``run_server`` passes them. SIGTERM and Ctrl-C shut petals down cleanly (handlers, DHT, p2pd).
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

logger = logging.getLogger("chainswarm.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="local model checkpoint directory")
    parser.add_argument("--initial-peers", required=True, nargs="+", metavar="MADDR",
                        help="multiaddrs of swarm peers to join (the orchestrator's, see GET /v1/swarm)")
    parser.add_argument("--node-id", help="stable name of this server for the orchestrator "
                        "(default: host name + peer id)")
    parser.add_argument("--dht-prefix", help="DHT prefix of the model (default: derived from the directory name)")
    parser.add_argument("--memory-gb", type=float, metavar="X",
                        help="memory budget for blocks + KV cache (default: free GPU / available host memory)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--torch-dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                        help="dtype the blocks compute in (default float32). It must be the swarm's serving dtype "
                        "(the orchestrator's --torch-dtype, float32 by default): the orchestrator runs the embeddings "
                        "and LM head in it and plans only servers that match, because a bfloat16 server behind a "
                        "float32 head gives greedy text that matches neither reference. 'auto' is petals' choice "
                        "(bfloat16 on CPU for float32 checkpoints); on GPU swarms use float16 or bfloat16 on every "
                        "server and the orchestrator alike")
    parser.add_argument("--quant-type", choices=["none", "int8", "nf4"],
                        help="weight quantisation (default: petals' choice, nf4 on GPU, none on CPU)")
    # petals' flag, refused with its reason (server_kwargs) rather than as an unknown argument
    parser.add_argument("--tensor-parallel-devices", nargs="+", metavar="DEVICE", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any)")
    parser.add_argument("--announce-host", help="address other peers reach this server at (NAT, proxy)")
    parser.add_argument("--announce-port", type=int, help="port other peers reach this server at")
    parser.add_argument("--identity-path", help="file with this peer's private key (a stable peer id)")
    parser.add_argument("--num-handlers", type=int, help="connection handler processes (default: 2 on CPU, 8 on GPU)")
    parser.add_argument("--update-period", type=float, default=10.0, metavar="S",
                        help="heartbeat: the profile record is renewed every S seconds (petals' block "
                        "announcements every max(S, 10) seconds)")
    parser.add_argument("--drain-timeout", type=float, default=300.0, metavar="S",
                        help="longest wait for open sessions before moving to new blocks")
    parser.add_argument("--cache-dir", metavar="DIR", help="where measured compute times are cached "
                        "(default ~/.cache/chainswarm)")
    parser.add_argument("--max-batch", type=int, default=16, metavar="N",
                        help="decode steps of up to N sessions run as one forward pass (default 16, the "
                        "orchestrator's --batch-sessions; 1 = petals')")
    parser.add_argument("--emulate-compute", metavar="PREFILL_MS,DECODE_MS",
                        help="experiments: emulate an accelerator that spends PREFILL_MS per block per prompt token "
                        "and DECODE_MS per block per decoded token (added to every inference step; reported in "
                        "the profile)")
    parser.add_argument("--orchestrator-key", metavar="KEY|FILE",
                        help="the orchestrator's public key (ssh-rsa AAAA..., its base64 body or a file; shown as "
                        "orchestrator_key in GET /v1/swarm): only assignments and session tickets it signed are "
                        "obeyed. Default: the first key seen publishing an orchestrator record (trust on first use)")
    parser.add_argument("--identity-key", metavar="FILE", help="this node's signing key for its DHT records "
                        "(RSA, created if missing; default: a new key per run)")
    parser.add_argument("--open", action="store_true", help="serve sessions without orchestrator tickets (a trusted "
                        "lab; vanilla petals clients): anyone who reaches this server can use its blocks")
    parser.add_argument("--join-timeout", type=float, default=300.0, metavar="S",
                        help="while none of the initial peers answers (the orchestrator not up yet, after a reboot "
                        "or a power cut), try again for up to S seconds, logging each try (default 300; 0: give up "
                        "at the first failure)")
    parser.add_argument("--log-level", default=os.environ.get("CHAINSWARM_LOGLEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])


class _BadInput(ValueError):
    pass


def server_kwargs(args: argparse.Namespace) -> dict:
    """Validate the command line and turn it into :class:`server.node.ChainswarmServer` kwargs."""
    from swarm.model.checkpoint import dht_prefix_for

    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise _BadInput(f"--model {args.model}: not a model directory (no config.json)")
    try:
        from hivemind.utils.multiaddr import Multiaddr

        for maddr in args.initial_peers:
            Multiaddr(maddr)
    except Exception as exc:
        raise _BadInput(f"--initial-peers: not a multiaddr: {exc}") from None
    for maddr in args.initial_peers:
        if "/p2p/" not in maddr:
            raise _BadInput(f"--initial-peers {maddr}: the multiaddr lacks the peer id (/p2p/...)")
    if args.memory_gb is not None and not (args.memory_gb > 0 and math.isfinite(args.memory_gb)):
        raise _BadInput("--memory-gb must be a positive number")
    for name in ("port", "announce_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 65536:
            raise _BadInput(f"--{name.replace('_', '-')} must be a TCP port number")
    if args.num_handlers is not None and args.num_handlers < 1:
        raise _BadInput("--num-handlers must be at least 1")
    if getattr(args, "max_batch", 8) < 1:
        raise _BadInput("--max-batch must be at least 1")
    if not 0 <= args.join_timeout <= 86400:
        raise _BadInput("--join-timeout must be between 0 and 86400 seconds")
    if not args.update_period > 0 or args.drain_timeout < 0:
        raise _BadInput("--update-period must be positive and --drain-timeout non-negative")
    if args.node_id is not None and (not args.node_id.strip() or len(args.node_id) > 128):
        raise _BadInput("--node-id must be a non-empty name of at most 128 characters")
    device = args.device
    if device is not None:
        _check_device(device)
    on_cpu = device == "cpu" or (device is None and not _cuda_available())
    if args.quant_type not in (None, "none") and (on_cpu or (device or "").startswith("mps")):
        raise _BadInput(f"--quant-type {args.quant_type} quantizes on CUDA devices only (bitsandbytes); on "
                        f"{device or 'this host'} the blocks would stay unquantized while the planner counted them "
                        "at the quantized size")
    if args.tensor_parallel_devices:
        raise _BadInput("--tensor-parallel-devices is not supported: Chainswarm's block code runs each block on one "
                        "device; run one server per GPU instead (--device cuda:N)")
    ip = "ip6" if ":" in args.host else "ip4"
    emulated = None
    if getattr(args, "emulate_compute", None):
        from server.emulation import EmulatedCompute

        try:
            emulated = EmulatedCompute.parse(args.emulate_compute).to_dict()
        except ValueError as exc:
            raise _BadInput(f"--emulate-compute: {exc}") from None
    kwargs = dict(
        converted_model_name_or_path=str(model),
        dht_prefix=args.dht_prefix or dht_prefix_for(model),
        initial_peers=list(args.initial_peers),
        node_id=args.node_id,
        memory_gb=args.memory_gb,
        profile_cache_dir=args.cache_dir,
        drain_timeout=args.drain_timeout,
        device=device,
        torch_dtype=args.torch_dtype,
        quant_type=args.quant_type,
        host_maddrs=[f"/{ip}/{args.host}/tcp/{args.port}"],
        num_handlers=args.num_handlers or (2 if on_cpu else 8),
        update_period=args.update_period,
        use_relay=False,
        use_auto_relay=False,
        reachable_via_relay=False,
        skip_reachability_check=True,
        emulated_compute=emulated,
        max_batch=getattr(args, "max_batch", 8),
        join_timeout_s=args.join_timeout,
    )
    if args.announce_host or args.announce_port:
        if not args.announce_port and not args.port:
            raise _BadInput("--announce-host needs --announce-port or a fixed --port")
        host = args.announce_host or args.host
        kwargs["announce_maddrs"] = [f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{args.announce_port or args.port}"]
    if args.identity_path:
        kwargs["identity_path"] = args.identity_path
    if args.orchestrator_key:
        from swarm.trust.identity import BadKeyError, parse_public_key

        try:
            kwargs["orchestrator_key"] = parse_public_key(args.orchestrator_key)
        except BadKeyError as exc:
            raise _BadInput(f"--orchestrator-key: {exc}") from None
    if args.identity_key:
        kwargs["identity_key"] = args.identity_key
    kwargs["open_sessions"] = bool(args.open)
    return kwargs


def _check_device(device: str) -> None:
    """``--device`` names a device this host has: cpu, cuda, cuda:N below the device count, or mps."""
    kind, colon, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (colon and (kind != "cuda" or not index.isdigit())):
        raise _BadInput(f"--device {device}: expected cpu, cuda[:N] or mps")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count() if _cuda_available() else 0
        if count == 0:
            why = "no CUDA device is visible" if torch.backends.cuda.is_built() else \
                f"this torch ({torch.__version__}) is built without CUDA"
            raise _BadInput(f"--device {device}: {why} (--device cpu serves on the CPU)")
        if index and int(index) >= count:
            raise _BadInput(f"--device {device}: this host has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if kind == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise _BadInput(f"--device {device}: no Apple MPS device here (--device cpu serves on the CPU)")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def run(args: argparse.Namespace) -> int:
    try:
        kwargs = server_kwargs(args)
    except _BadInput as exc:
        print(f"chainswarm server: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("server").setLevel(args.log_level)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SystemExit -> finally -> clean petals shutdown
    faulthandler.enable(all_threads=True)  # a crash in native code prints every thread's Python stack

    from server.node import run_node
    from swarm.runtime.dht import StartupError, p2p_start_failure, quiet_p2p_noise
    from swarm.runtime.process import children_die_with_me, remove_stale_sockets

    started = time.time()
    children_die_with_me()  # a server that crashes leaves no DHT, handler or p2pd process behind
    quiet_p2p_noise()

    try:
        run_node(kwargs)
    except KeyboardInterrupt:
        logger.info("interrupted, shutting down")
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"chainswarm server: error: {exc}", file=sys.stderr)
        return 1
    except StartupError as exc:  # no initial peer answered within --join-timeout
        print(f"chainswarm server: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        failure = p2p_start_failure(exc, kwargs["initial_peers"], "--port")
        if failure is None:
            raise
        print(f"chainswarm server: error: {failure}", file=sys.stderr)
        return 2
    finally:
        _reap_children()
        # a connection handler ends on SIGTERM at once (leave_stop_signals_to_parent) and hivemind never shuts its
        # P2P replica down: each stop left the handlers' socket files in /tmp (unbound ones only are removed)
        remove_stale_sockets(started)
    return 0


def _reap_children() -> None:
    """Kill whatever petals left of this process's own children (a hung handler, a p2pd), and wait for them
    (bounded) so that their sockets are unbound before the stale ones are removed."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=5)
    except Exception:
        pass
