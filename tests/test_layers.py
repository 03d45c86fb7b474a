"""The import graph of the project's own packages: no cycles at all, and every arrow points down the layers.

Every ``import`` counts — at module level, inside functions, under ``TYPE_CHECKING``: a cycle broken by a lazy
import is still a cycle for the reader. The layers, lowest first, are :data:`LAYERS`; a module may import its
own layer and the ones below it. The documentation's architecture page (docs/architecture.md) lists the same rooms.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "swarm", "server", "client", "wan", "experiments")

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS = (
    "planner",            # pure algorithms: placement, chains, dispatch, fairness, bounds, prefix index
    "swarm.model",        # block code, families, petals shim, kernels, checkpoints, GGUF, model cache
    "swarm.trust",        # identities, signed records, tickets, record validators
    "swarm.runtime",      # peer processes and their DHT
    "swarm.state",        # the orchestrator's state directory
    "swarm.engine",       # generation: sessions, batching, multi-session wire, sampling, routing
    "swarm.control",      # the orchestrator: planning glue, routers, leases, failover, occupancy, status
    "swarm.api",          # HTTP: OpenAI routes, schemas, errors, metrics, web pages
    "swarm.service",      # the orchestrator process, assembled
    "swarm.commands",     # the `chainswarm` subcommands of the control plane
    "swarm.cli",
    "wan",                # user-space WAN emulation
    "server",             # the volunteer's node
    "client",             # client library and CLI
    "experiments.paths",
    "experiments.sim",
    "experiments.report",
    "experiments.figures",
    "experiments.live",
    "experiments.bench",
    "experiments",
)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (a ``from package import module`` names the module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{name} is in no layer: add its room to LAYERS"
    return LAYERS.index(best)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_checker_sees_a_lazy_import_cycle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_every_import_points_down_the_layers():
    upward = defaultdict(list)
    for name, targets in _graph().items():
        for target in targets:
            if _layer(target) > _layer(name):
                upward[name].append(target)
    assert not upward, dict(upward)
