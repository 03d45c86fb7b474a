"""``chainswarm plan``: plan block placement, chains and capacities for a swarm described in JSON.

    chainswarm plan --swarm FILE.json [--c N | --tuning lower-bound|surrogate|upper-bound] [--min-c N]
                    [--placement gbp-cr|petals|bprr|whole-model|random|auto] [--json]

Bad input prints one line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

HELP = "Plan block placement (GBP-CR), chains and cache slots (GCA) and JFFC bounds for a swarm file."

_TUNINGS = ("lower-bound", "surrogate", "upper-bound")
_PLACEMENTS = ("gbp-cr", "petals", "bprr", "whole-model", "random", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm", required=True, metavar="FILE.json", help="swarm description (JSON)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--c", type=int, metavar="N", help="fixed cache reservation c (no tuning)")
    how.add_argument(
        "--tuning", choices=_TUNINGS, default="lower-bound", help="how to choose c (default: lower-bound)"
    )
    parser.add_argument(
        "--placement", choices=_PLACEMENTS, default="gbp-cr", help="placement algorithm (default: gbp-cr)"
    )
    parser.add_argument("--min-c", type=int, default=1, metavar="N",
                        help="tune c among those whose chains include one of capacity >= N, where any does: the "
                        "slots a longest session needs, as the orchestrator asks for ceil(max_length / slot tokens) "
                        "(default: 1, the paper's rule)")
    parser.add_argument("--seed", type=int, default=0, help="seed for --placement random (default: 0)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _error(message: str) -> int:
    print(f"chainswarm plan: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from planner.plan import parse_swarm, plan

    try:
        with open(args.swarm, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        return _error(f"cannot read {args.swarm}: {exc.strerror or exc}")
    except json.JSONDecodeError as exc:
        return _error(f"{args.swarm} is not valid JSON: {exc}")
    if args.min_c < 1:
        return _error(f"--min-c must be >= 1, got {args.min_c}")
    try:
        model, servers, arrival_rate, target_load = parse_swarm(doc)
        result = plan(
            model,
            servers,
            arrival_rate,
            target_load=target_load,
            c=args.c,
            tuning=args.tuning,
            placement=args.placement,
            seed=args.seed,
            min_c=args.min_c,
        )
    except (ValueError, TypeError) as exc:
        return _error(str(exc))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        print(format_plan(result))
    return 0


def _num(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "inf"
    return f"{x:.{digits}f}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    return out


def format_plan(result) -> str:
    """A readable report of a :class:`planner.plan.Plan`."""
    m = result.model
    lines = [
        f"model: L={m.num_blocks} blocks, s_m={m.block_size_gb} GB, s_c={m.cache_slot_gb} GB; "
        f"lambda={result.arrival_rate} req/s, target load={result.target_load}",
        f"placement: {result.placement_method}"
        + (f"; c={result.c} ({result.tuning})" if result.c is not None else ""),
        "",
        "servers:",
    ]
    lines += _table(
        ["id", "blocks", "slots allocated", "slots free"],
        [
            [
                s.id,
                "unused" if s.span is None else f"[{s.start}, {s.end})",
                str(s.slots_allocated),
                str(s.slots_free),
            ]
            for s in result.servers
        ],
    )
    lines += ["", "chains (fastest first):"]
    lines += _table(
        ["#", "servers (blocks processed)", "capacity", "T (s)", "rate (1/s)"],
        [
            [
                str(k),
                " -> ".join(f"{sid}[{a},{b})" for sid, (a, b) in zip(ch.servers, ch.spans)),
                str(ch.capacity),
                _num(ch.service_time),
                _num(ch.rate),
            ]
            for k, ch in enumerate(result.chains)
        ],
    )
    lines += ["", f"total rate nu = {_num(result.total_rate)} req/s, total capacity C = {result.total_capacity}"]
    if result.bounds is None:
        lines.append(f"OVERLOADED: lambda = {result.arrival_rate} >= nu; response time unbounded")
    else:
        lines.append(
            f"mean response time (Theorem 3.7): {_num(result.bounds.lower)} s <= T <= "
            f"{_num(result.bounds.upper)} s"
        )
    if len(result.candidates) > 1:
        lines += ["", "c candidates (runs of c with the same chains folded; * = chosen):"]
        lines += _table(["c", "K(c)", "g(c)", "nu(c)", "T lower (s)", "T upper (s)"], _candidate_rows(result))
    return "\n".join(lines)


def _candidate_rows(result) -> list[list[str]]:
    """One row per run of consecutive feasible c with equal (K, ν, bounds); the chosen c stands alone."""
    runs: list[list] = []
    for cand in result.candidates:
        if not cand.feasible:
            continue
        key = (cand.num_chains, cand.total_rate, cand.lower, cand.upper)
        last = runs[-1] if runs else None
        if (
            last is not None
            and last[0] == key
            and last[2].c == cand.c - 1
            and result.c not in (cand.c, last[2].c)
        ):
            last[2] = cand
        else:
            runs.append([key, cand, cand])
    rows = []
    for _, first, last in runs:
        mark = "*" if first.c == result.c else " "
        c_text = str(first.c) if first.c == last.c else f"{first.c}-{last.c}"
        g_text = "inf" if first.g is None else (str(first.g) if first.c == last.c else f"{first.g}-{last.g}")
        rows.append(
            [
                mark + c_text,
                "inf" if first.num_chains is None else str(first.num_chains),
                g_text,
                _num(first.total_rate),
                _num(first.lower),
                _num(first.upper),
            ]
        )
    return rows
