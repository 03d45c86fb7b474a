"""petals' runtime, stopped before its blocks' weights are freed.

A server that moves to another range, drains or stops shuts its ``ModuleContainer`` down. petals 2.2 does that
in one sweep: it asks the runtime thread to stop (``Runtime.shutdown`` sends a trigger and returns at once) and
then frees every block's weights (``TransformerBackend.shutdown`` sets each parameter's data to an empty
tensor). A step the runtime thread is still computing at that moment reads weights whose memory is gone, and
the server process dies of SIGSEGV inside the matrix kernels. The test suite saw it about once in ten full runs:
a node that computed a step while a re-plan after a neighbour's death moved it crashed in oneDNN's packing of
a weight matrix (rows 576 and 1,536 floats apart: SmolLM2's weights), and with it every session it held.

:class:`JoiningRuntime` waits (bounded) for the runtime thread to finish the step in hand before the container
goes on to free the weights; :func:`install` makes petals' ``ModuleContainer`` build it.
"""
from __future__ import annotations

import logging
import threading

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.server.server import RuntimeWithDeduplicatedPools

logger = logging.getLogger(__name__)

STOP_WAIT_S = 60.0  # far above any step's compute; past it the container goes on and says so


class JoiningRuntime(RuntimeWithDeduplicatedPools):
    """petals' runtime whose :meth:`shutdown` returns once its thread has stopped (at most :data:`STOP_WAIT_S`)."""

    def shutdown(self) -> None:
        super().shutdown()
        if threading.current_thread() is self or not self.is_alive():
            return  # the thread's own shutdown on its way out, or a runtime that never started
        self.join(STOP_WAIT_S)
        if self.is_alive():
            logger.warning("the runtime thread is still computing a step after %.0f s; its blocks' weights are "
                           "freed now", STOP_WAIT_S)


def install() -> None:
    """Make petals' ``ModuleContainer`` build a :class:`JoiningRuntime` (in the server process, before
    ``Server.run()``)."""
    import petals.server.server as server_module

    server_module.RuntimeWithDeduplicatedPools = JoiningRuntime
