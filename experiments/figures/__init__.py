"""Drivers of the model-driven simulations: the paper's Figs. 3–9 (:mod:`.paper`, :mod:`.tuning`,
:mod:`.baselines`, :mod:`.auto`), Fig. 8 with batching servers, churn and fairness; each runs
:mod:`experiments.sim` and writes JSON, PNG and its section through :mod:`experiments.report`.
:mod:`.cli` is ``chainswarm simulate``."""
