"""Renderers: report sections, plots and ``REPORT.md`` computed from the JSON the runs wrote (committed under
``experiments/results``). Imports :mod:`experiments.sim` (for model facts and metric definitions), never a
driver: :mod:`experiments.figures`, :mod:`experiments.live` and :mod:`experiments.bench` sit above."""
