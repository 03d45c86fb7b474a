"""Chainswarm's experiments, in rooms by concern; each room imports only the rooms below it:

    paths             where the committed inputs and results live (results/, data/, examples/)
    sim/              the model-driven simulators and their inputs (scenarios, workloads, traces, bounds)
    report/           renderers: sections, plots and REPORT.md from the JSON the runs wrote
    figures/          drivers that run the simulators and write figures; ``chainswarm simulate``
    live/, bench/     live-swarm experiments (``chainswarm experiment``, ``chainswarm demo``) and benchmarks

Layers, lowest first: paths < sim < report < figures < live, bench (live and bench never import each other).
"""
