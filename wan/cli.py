"""``chainswarm wan``: configure, run and measure the emulated WAN (see :mod:`wan`)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

HELP = "Emulate WAN latency between loopback hosts (RIPE Atlas RTTs or a matrix): config, run, measure."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="wan_command", metavar="ACTION")

    p = sub.add_parser("config", help="write a WAN config (JSON) from the RIPE Atlas data or a matrix")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ripe-atlas", metavar="CSV", nargs="?", const="", default=None,
                     help="build from the RIPE Atlas EU RTT file (default: experiments/data copy)")
    src.add_argument("--matrix", metavar="JSON",
                     help="RTT matrix in ms, a JSON file or inline JSON: [[0,40],[40,0]] (host 0 = client)")
    p.add_argument("--servers", type=int, default=9, help="number of servers (RIPE Atlas; default 9)")
    p.add_argument("--seed", type=int, default=0, help="random seed for anchor selection (default 0)")
    p.add_argument("--orchestrator", default="random",
                   help="'random' (paper), 'best' (lowest base latency) or an anchor id")
    p.add_argument("--eta", type=float, default=None, help="fraction of high-performance servers to mark")
    p.add_argument("--rtt-scale", type=float, default=1.0, help="multiply every RTT (default 1)")
    p.add_argument("--bandwidth-mbps", type=float, default=None, help="per-link bandwidth (default: unlimited)")
    p.add_argument("--no-connect-rtt", action="store_true", help="do not charge one RTT per new connection")
    p.add_argument("--out", "-o", metavar="FILE", help="output file (default: stdout)")

    p = sub.add_parser("run", help="run the emulator in the foreground until Ctrl-C, printing the port map")
    _common(p)
    p.add_argument("--port", action="append", default=[], metavar="HOST=REAL[:PROXY]",
                   help="fix a host's real (and proxy) port; repeatable")
    p.add_argument("--json", action="store_true", help="print the port map as JSON")

    p = sub.add_parser("measure", help="start echo servers behind the emulator and report configured vs achieved RTT")
    _common(p)
    p.add_argument("-n", type=int, default=20, help="echo round trips per link (default 20)")
    p.add_argument("--no-pairs", action="store_true", help="only measure client -> server links")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")

    p = sub.add_parser("check", help="report which backends are available here")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", required=True, metavar="FILE", help="WAN config written by 'wan config'")
    p.add_argument("--backend", choices=("userspace", "netem", "auto"), default="userspace",
                   help="userspace proxy (default), kernel netem (Linux, root), or auto")


def _error(msg: str) -> int:
    print(f"chainswarm wan: error: {msg}", file=sys.stderr)
    return 2


def _load_matrix(text: str) -> list[list[float]]:
    from pathlib import Path

    path = Path(text)
    raw = path.read_text() if not text.lstrip().startswith("[") and path.exists() else text
    data = json.loads(raw)
    if isinstance(data, dict):
        data = data.get("rtt_ms")
    if not isinstance(data, list):
        raise ValueError("expected a JSON list of rows")
    return data


def _parse_ports(items: list[str]) -> dict[str, int | tuple[int, int]]:
    out: dict[str, int | tuple[int, int]] = {}
    for item in items:
        host, sep, spec = item.partition("=")
        if not sep or not host:
            raise ValueError(f"--port {item!r}: expected HOST=REAL[:PROXY]")
        real, _, proxy = spec.partition(":")
        try:
            out[host] = (int(real), int(proxy)) if proxy else int(real)
        except ValueError:
            raise ValueError(f"--port {item!r}: ports must be integers") from None
    return out


def run(args: argparse.Namespace) -> int:
    import wan

    action = getattr(args, "wan_command", None)
    if action is None:
        return _error("choose an action: config, run, measure or check (see 'chainswarm wan --help')")
    try:
        if action == "config":
            return _config(args, wan)
        if action == "check":
            ok, why = wan.netem_available()
            print("userspace: available (default)")
            print(f"netem: {'available' if ok else 'unavailable'} ({why})")
            return 0
        config = wan.WanConfig.load(args.config)
        if action == "run":
            return _run(args, wan, config)
        return _measure(args, wan, config)
    except (wan.WanError, ValueError, OSError) as e:
        return _error(str(e).splitlines()[0] if str(e) else e.__class__.__name__)


def _config(args: argparse.Namespace, wan) -> int:
    if args.matrix is not None:
        try:
            matrix = _load_matrix(args.matrix)
        except (OSError, ValueError) as e:
            raise wan.WanError(f"--matrix: {e}") from None
        config = wan.WanConfig.from_matrix(matrix, bandwidth_mbps=args.bandwidth_mbps,
                                           connect_rtt=not args.no_connect_rtt)
        if args.rtt_scale != 1.0:
            config = config.scaled(args.rtt_scale)
    else:
        config = wan.WanConfig.from_ripe_atlas(
            args.ripe_atlas or None, args.servers, args.seed, orchestrator=args.orchestrator, eta=args.eta,
            rtt_scale=args.rtt_scale, bandwidth_mbps=args.bandwidth_mbps, connect_rtt=not args.no_connect_rtt)
    if args.out:
        config.save(args.out)
        rtts = ", ".join(f"{s}={v:.1f}" for s, v in config.client_rtts().items())
        print(f"wrote {args.out}: {len(config.servers)} servers; RTT(client, server) ms: {rtts}")
    else:
        print(config.to_json())
    return 0


def _run(args: argparse.Namespace, wan, config) -> int:
    emulator = wan.WanEmulator(config, backend=args.backend, ports=_parse_ports(args.port))
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        endpoints = emulator.start()
        if args.json:
            print(json.dumps({"backend": emulator.backend, "endpoints": {
                h: {"ip": e.ip, "real_port": e.real_port, "port": e.port,
                    "host_maddr": e.host_maddr, "announce_maddr": e.announce_maddr}
                for h, e in endpoints.items()}}, indent=2), flush=True)
        else:
            print(f"backend: {emulator.backend}; servers listen on the real port and announce the proxy port")
            print(f"{'host':>8} {'ip':>12} {'real':>6} {'announce':>8} {'RTT(client)':>12}")
            for h, e in endpoints.items():
                print(f"{h:>8} {e.ip:>12} {e.real_port:>6} {e.port:>8} {config.rtt(config.client, h):>12.2f}")
            print("running; Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            if not emulator.alive:
                return _error("the WAN emulator stopped unexpectedly (proxy process died)")
    finally:
        final = emulator.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    links = (final or {}).get("links", {})
    if links and not args.json:
        print("traffic per link (connections, bytes to dst / to src):")
        for link, c in links.items():
            print(f"  {link}: {c['connections']} conns, {c['bytes_to_dst']} / {c['bytes_to_src']} bytes")
    return 0


def _measure(args: argparse.Namespace, wan, config) -> int:
    if args.n < 1:
        return _error("-n must be >= 1")
    with wan.EchoServers({h: (config.ip(h), 0) for h in config.servers}) as echo:
        with wan.WanEmulator(config, backend=args.backend, ports=echo.ports) as emulator:
            rows = wan.measure_wan(config, emulator.endpoints, args.n, pairs=not args.no_pairs)
            backend = emulator.backend
            lateness = emulator.stats().get("lateness_ms")  # userspace: how late the proxy delivered
    if args.json:
        print(json.dumps({"backend": backend, "rows": rows, "lateness_ms": lateness}, indent=2))
    else:
        print(f"backend: {backend}")
        print(wan.format_report(rows))
        if lateness:
            print(f"proxy lateness (ms): median {lateness['p50']:.2f}, 90th percentile {lateness['p90']:.2f}, "
                  f"max {lateness['max']:.2f} over {lateness['chunks']} chunks")
    return 0
