"""Chainswarm's client library: HTTP completions (SwarmClient) and orchestrator-routed petals models."""
from client.http import Completion, SwarmClient, SwarmError

__all__ = ["Completion", "SwarmClient", "SwarmError", "DirectSwarmModel"]


def __getattr__(name):  # DirectSwarmModel needs torch/petals: import it only when asked for
    if name == "DirectSwarmModel":
        from client.direct import DirectSwarmModel

        return DirectSwarmModel
    raise AttributeError(name)
