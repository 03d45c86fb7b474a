"""The model-driven simulators and their inputs: the event-driven chain simulator (:mod:`.simulator`), the
paper's scenarios, the occupancy-dependent (batching) and PETALS/BPRR request simulators, churn epochs and
re-planning strategies, the token-level fairness simulator with its workloads and metrics, and the lower
bounds any placement must respect. Imports only :mod:`experiments.paths` and the project's packages."""
