"""A server's runtime stops before its container frees the blocks' weights (server/runtime.py).

petals' ``ModuleContainer.shutdown`` stops the runtime and then empties every parameter; with petals' own
runtime the first returns while a step is still being computed, and that step then reads freed weights (a
SIGSEGV in the matrix kernels). Here a real runtime thread computes a step with a weight matrix while the
container's two moves run from another thread, exactly in petals' order: stop the runtime, empty the weights.
"""
import multiprocessing as mp
import threading

import torch

from server import runtime
from swarm.model.compat import petals  # noqa: F401

STEP_S = 0.8


class _Pool:
    """The least of a hivemind task pool that a runtime drives: one batch, computed by ``process_func``."""

    name, priority = "inference", 0

    def __init__(self, weight: torch.Tensor, step_s: float):
        self.weight, self.step_s, self.release = weight, step_s, threading.Event()
        self.batch_receiver, self._sender = mp.Pipe(duplex=False)
        self.started, self.finished = threading.Event(), threading.Event()
        self.outputs: list = []

    def is_alive(self) -> bool:
        return True

    def terminate(self) -> None:  # (petals' pools are processes the runtime stops first)
        pass

    def join(self, timeout=None) -> None:
        pass

    def submit(self) -> None:
        self._sender.send(0)

    def load_batch_to_runtime(self, timeout=None, device=None):
        return self.batch_receiver.recv(), [torch.ones(3, self.weight.shape[1])]

    def process_func(self, x):
        self.started.set()
        self.release.wait(self.step_s)  # the step is under way when the container shuts down
        try:
            self.outputs.append(torch.nn.functional.linear(x, self.weight).sum().item())
        except RuntimeError as exc:  # the weights were emptied under the step
            self.outputs.append(exc)
            raise
        finally:
            self.finished.set()
        return [x]

    def send_outputs_from_runtime(self, batch_index, outputs) -> None:
        pass

    def send_exception_from_runtime(self, batch_index, exception) -> None:
        pass


class _Backend:
    def __init__(self, pool: _Pool):
        self.pool = pool

    def get_pools(self):
        return [self.pool]


def _shutdown_during_a_step(runtime_class, step_s: float) -> tuple[bool, _Pool]:
    """Start ``runtime_class`` on one backend, let a step begin, then shut down as ``ModuleContainer`` does:
    stop the runtime, then empty the weights (``TransformerBackend.shutdown``); the step goes on at most
    ``step_s``, or until the weights are emptied. Returns whether the step had finished when the runtime's shutdown
    returned, and the pool."""
    pool = _Pool(torch.full((4, 5), 2.0), step_s)
    worker = runtime_class({"block": _Backend(pool)}, prefetch_batches=0)
    worker.start()
    assert worker.ready.wait(10)
    pool.submit()
    assert pool.started.wait(10)
    worker.shutdown()
    finished_first = pool.finished.is_set()
    pool.weight.data = torch.tensor([])  # what TransformerBackend.shutdown does to every parameter
    pool.release.set()
    assert pool.finished.wait(10)
    worker.join(10)
    assert not worker.is_alive()
    return finished_first, pool


def test_the_runtime_finishes_the_step_in_hand_before_the_weights_are_emptied():
    finished_first, pool = _shutdown_during_a_step(runtime.JoiningRuntime, STEP_S)
    assert finished_first
    assert pool.outputs == [3 * 4 * 5 * 2.0]  # computed with the weights it started with


def test_petals_own_runtime_returns_while_the_step_still_runs():
    """The race this module closes: petals' runtime returns at once, and the step then finds its weights gone
    (here torch raises on the emptied matrix; a kernel already reading the freed memory crashes instead)."""
    [petals_runtime] = runtime.JoiningRuntime.__bases__  # petals' RuntimeWithDeduplicatedPools
    finished_first, pool = _shutdown_during_a_step(petals_runtime, 60.0)  # a step that lasts until released
    assert not finished_first
    assert len(pool.outputs) == 1 and isinstance(pool.outputs[0], RuntimeError)


def test_install_makes_petals_containers_build_the_joining_runtime():
    import petals.server.server as server_module

    runtime.install()
    assert server_module.RuntimeWithDeduplicatedPools is runtime.JoiningRuntime
