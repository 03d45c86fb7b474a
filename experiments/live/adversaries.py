"""Hostile volunteers, for the spot checks' tests and benchmark: real server processes whose arithmetic lies.

An adversary is an ordinary Chainswarm node (:func:`server.node.node_process_main`) started through
:func:`adversary_node_main`, which first patches the block code of its own process
(:class:`swarm.model.block.DecoderBlock`, the one forward path of both the batched and the single-session
paths). Everything else — profile, keys, tickets, the wire — is honest, so only the spot checks can catch it:

* ``noise``: adds Gaussian noise of ``scale`` × the row's RMS to its last block's output;
* ``weights``: serves another checkpoint of the same shape (every weight multiplied by ``1 + scale·N(0, 1)``);
* ``skip``: skips its last block (returns its input; saves that block's time);
* ``late``: honest for its first ``after`` sessions, then ``noise``;
* ``ordinary``: cheats only on what ordinary traffic has and a re-asked check would not — decode steps
  (a check re-executes a span as one prefill); prefills are honest;
* ``tokens``: honest blocks, but as the chain's last server it returns other tokens than its LM head gives (the
  first token of every step with its lowest bit flipped, which ends the step as a rejected draft would): only
  the head check of a spot check sees it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

KINDS = ("noise", "weights", "skip", "late", "ordinary", "tokens")


@dataclass(frozen=True)
class Adversary:
    kind: str
    scale: float = 0.05
    after: int = 20  # late: honest sessions before it starts cheating
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown adversary {self.kind!r}; expected one of {KINDS}")


def install(adversary: Adversary) -> None:
    """Patch this process's block code (or, for ``tokens``, its choice of token) to behave as ``adversary``."""
    from swarm.model.block import DecoderBlock

    if adversary.kind == "tokens":
        import server.multi_session as multi_session

        honest_choice = multi_session.choose_step

        def lying_choice(chooser, context, scores, draft, *args, **kwargs):
            for token in honest_choice(chooser, context, scores, draft, *args, **kwargs):
                lie = token ^ 1 if not draft or token ^ 1 != draft[0] else token ^ 2
                yield lie  # a well-formed lie: another token than the draft's ends the step
                return

        multi_session.choose_step = lying_choice
        return

    loaded: list[int] = []  # the block indices of the latest load (petals loads a span in order)
    sessions = [0]
    generator = torch.Generator().manual_seed(adversary.seed)
    bind, step = DecoderBlock.bind_layer, DecoderBlock.step

    def bind_layer(self, index: int):
        if loaded and index <= loaded[-1]:
            loaded.clear()  # a new span is being loaded
        loaded.append(index)
        self._adversary_index = index
        return bind(self, index)

    def noisy(out: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        rms = out.float().pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(out.shape, generator=generator).to(out.device) * rms * adversary.scale
        if rows is not None:
            noise = noise * rows[:, None]
        return (out.float() + noise).to(out.dtype)

    def lying_step(self, hidden, segments, token_pos=None):
        index = getattr(self, "_adversary_index", None)
        first, last = (loaded[0], loaded[-1]) if loaded else (None, None)
        if index == first:
            sessions[0] += sum(s.b for s in segments if s.pos == 0)
        if adversary.kind == "weights" and not getattr(self, "_adversary_swapped", False):
            with torch.no_grad():
                for p in self.parameters():
                    p.mul_(1 + adversary.scale * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
            self._adversary_swapped = True
        if adversary.kind == "skip" and index == last:
            return hidden
        out = step(self, hidden, segments, token_pos)
        if index != last:
            return out
        if adversary.kind == "noise" or (adversary.kind == "late" and sessions[0] > adversary.after):
            return noisy(out)
        if adversary.kind == "ordinary":
            rows = torch.cat([torch.full((s.b * s.t,), float(s.t == 1 and s.pos > 0)) for s in segments])
            return noisy(out, rows) if rows.any() else out
        return out

    DecoderBlock.bind_layer, DecoderBlock.step = bind_layer, lying_step


def adversary_node_main(adversary: Adversary, server_kwargs: dict, launcher_pid: int, report=None,
                        push_counter=None) -> None:
    """A node process that lies as ``adversary`` (``LocalSwarm.add_node(process_main=main(adversary))``)."""
    from server.node import node_process_main

    install(adversary)
    node_process_main(server_kwargs, launcher_pid, report, push_counter)


def main(adversary: Adversary):
    """The ``process_main`` of an adversary node."""
    return functools.partial(adversary_node_main, adversary)
