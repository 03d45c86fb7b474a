"""Live-swarm experiments on this machine (WAN-emulated local swarms): Table 1 replay, fairness, model
validation (``chainswarm experiment``, :mod:`.cli`) and ``chainswarm demo`` (:mod:`.demo`)."""
