"""The orchestrated volunteer server: profile, wait for an assignment, serve exactly those blocks.

:class:`ChainswarmServer` is a petals ``Server`` whose block choice belongs to the orchestrator:

1. On start it measures its profile (:mod:`server.profiling`) and publishes it as a
   :class:`swarm.trust.records.ServerProfile` DHT record, renewed every heartbeat (``update_period``) with a TTL
   of ``profile_ttl_factor`` heartbeats, so a vanished server drops out of the orchestrator's view.
2. ``_choose_blocks()`` — called by petals' ``run()`` loop — waits for the node's
   :class:`swarm.trust.records.Assignment` (state ``waiting``; an assignment with ``start == end`` means "hold no
   blocks" and keeps it waiting), sizes the KV cache to ``cache_slots`` block-slots of ``max_length`` tokens
   (the planner's Σ_k c_k·m_ij) plus the prefix-cache budget (state ``loading``) and returns the range. Once the blocks answer requests
   the state becomes ``serving``.
3. ``_should_choose_other_blocks()`` — polled every ``check_period`` s instead of petals' balance check —
   looks for a new assignment. Same range and lengths with no more slots than the loaded pool, under a new
   plan id: adopted in place.
   Another layout: state ``draining`` (petals sees the server as JOINING, so its routing opens no new
   sessions here), wait until every open session has ended (bounded by ``drain_timeout``), then let petals
   reload with the new range. Which assignment counts (signed by the orchestrator, well formed, within the
   model) is :class:`server.assignments.AssignmentInbox`'s business. An assignment whose blocks fail to load
   sends the node back to ``waiting`` until the orchestrator assigns another.

petals' own block selection and rebalancing never run. A launcher can follow a node through ``report``, a
``multiprocessing`` connection that receives ``("profiled", node_id, peer_id, profile_dict)`` once and
``("state", state, plan_id, start, end, cache_slots)`` on every change, preceded by ``("timings", {...})``
(profiling, last wait, drain and load durations in seconds) whenever a load completes.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Optional

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.data_structures import ServerState
from petals.server.server import Server

from server import batching, emulation, failpoints, layout, profiling, rtt, tickets as server_tickets, trust
from server.layout import _layout, _served_in_place  # noqa: F401  (tests import _served_in_place here)
from server.assignments import AssignmentInbox
from swarm.runtime.dht import join_with_retries
from swarm.trust import records
from swarm.trust.records import DRAINING, LOADING, SERVING, WAITING, Assignment, ServerProfile
from swarm.trust.validation import swarm_validators

logger = logging.getLogger(__name__)

_PLACEHOLDER_BLOCKS = "0:1"  # petals needs a span (or a GPU) at construction; the real one comes later
ANNOUNCE_PERIOD_MIN_S = 10.0  # petals' periodic block announcements, whatever the heartbeat (the CLI's default)
REPORT_RENEW_S = 30.0  # an unchanged prefix-eviction report is re-published this often (and lives twice as long)


class _Stopped(Exception):
    """The server was shut down while it waited for an assignment."""


class ChainswarmServer(Server):
    """A petals ``Server`` that serves the blocks the orchestrator assigns to ``node_id``.

    Keyword arguments (everything else goes to petals' ``Server``; ``num_blocks``/``block_indices`` are
    not accepted — the orchestrator decides):

    * ``node_id`` — the stable name the orchestrator knows this server by (default: host name + peer id);
    * ``memory_gb`` — memory budget for blocks + KV cache (default: free GPU / available host memory);
    * ``profile_cache_dir`` — where measured compute times are cached (default ``~/.cache/chainswarm``);
    * ``check_period`` — how often (s, on average) to look for a new assignment while serving (default 1);
    * ``assignment_poll`` — how often (s) to look for the first assignment while waiting (default 0.5);
    * ``drain_timeout`` — longest wait (s) for open sessions before a reload (default 300);
    * ``profile_ttl_factor`` — profile TTL in heartbeats (default 2.5); the heartbeat is ``update_period``
      (petals' block announcements: every ``max(update_period, ANNOUNCE_PERIOD_MIN_S)``);
    * ``rtt_period`` — how often (s) the RTT to the orchestrator is re-measured (default 30);
    * ``report`` — optional ``multiprocessing`` connection for launcher reports (see the module doc);
    * ``declared_profile`` — ``{"prefill_s", "decode_s", "rtt_s", "batch_step_s"}`` (any subset) to report
      instead of what is measured: emulated hardware in experiments (a "slow GPU" on a CPU box) and reproducible
      plans in tests. Real volunteers leave it unset; the RTT is still reported only once an orchestrator exists.
      (The batch curve: :func:`server.profiling.published_batch_steps`.)
    * ``max_batch`` — the batch bound of the server's inference pool (``run_node`` installs the batching pool
      and passes it; 1 = petals' own pool), published with the batch curve.
    * ``emulated_compute`` — ``{"prefill_s", "decode_s"}``: emulate an accelerator (:mod:`server.emulation`).
      Every inference step is delayed by that much per block and token, and the profile reports the
      measured (or declared) compute plus the emulated time.
    * ``identity_key`` — file with the node's signing key (created if missing; default: a new key per run, so
      a restart under the same node id is planned once the old profile has expired); ``orchestrator_key`` —
      the key whose assignments and tickets it obeys (else pinned on first use: :mod:`server.trust`);
      ``open_sessions`` — serve sessions without tickets (a trusted lab; :mod:`server.tickets`);
      ``failpoint_file`` — die at the phase that file names (tests and drills: :mod:`server.failpoints`).
    """

    def __init__(
        self,
        *,
        node_id: Optional[str] = None,
        memory_gb: Optional[float] = None,
        profile_cache_dir: Optional[str] = None,
        check_period: float = 1.0,
        assignment_poll: float = 0.5,
        drain_timeout: float = 300.0,
        profile_ttl_factor: float = 2.5,
        rtt_period: float = 30.0,
        report: Any = None,
        declared_profile: Optional[dict] = None,
        emulated_compute: Optional[dict] = None,
        identity_key: Optional[str] = None,
        orchestrator_key: Optional[str | bytes] = None,
        open_sessions: bool = False,
        max_batch: int = 1,
        failpoint_file: Optional[str] = None,
        **server_kwargs: Any,
    ):
        for key in ("num_blocks", "block_indices"):
            if server_kwargs.get(key) is not None:
                raise ValueError(f"{key} is chosen by the orchestrator; do not pass it to ChainswarmServer")
            server_kwargs.pop(key, None)
        if check_period <= 0 or assignment_poll <= 0 or drain_timeout < 0 or profile_ttl_factor < 1:
            raise ValueError("periods must be positive and the profile TTL at least one heartbeat")
        if memory_gb is not None:
            profiling.usable_memory_bytes("cpu", memory_gb)  # validates the budget before anything starts
        server_kwargs.setdefault("throughput", 1.0)  # petals' own benchmark is replaced by the profile
        server_kwargs.setdefault("update_period", 10.0)
        server_kwargs["attn_cache_tokens"] = 1  # placeholder, sized per assignment in _choose_blocks
        # petals' run() waits U(0, 2·this) between checks: a new assignment is looked for every check_period s on
        # average (with check_period / 2 it was twice a second, a third of an idle test swarm's DHT reads)
        server_kwargs["mean_balance_check_period"] = check_period
        quant_type = server_kwargs.get("quant_type")
        if isinstance(quant_type, str):
            server_kwargs["quant_type"] = profiling._quant(quant_type)
        started = time.perf_counter()
        failpoints.arm(failpoint_file)
        self.identity, self.trust = trust.identity_and_trust(server_kwargs, identity_key, orchestrator_key)
        self.open_sessions = open_sessions
        super().__init__(block_indices=_PLACEHOLDER_BLOCKS, **server_kwargs)
        if "record_validators" not in server_kwargs:  # the prefix was not known before petals resolved it
            self.dht.add_validators(swarm_validators(self.identity, self.dht_prefix))

        self.peer_id = self.dht.peer_id.to_base58()
        self.node_id = node_id or f"{socket.gethostname()}-{self.peer_id[-8:]}"
        self.check_period, self.assignment_poll = check_period, assignment_poll
        self.drain_timeout = drain_timeout
        self.heartbeat_period = float(self.update_period)
        self.profile_ttl = profile_ttl_factor * self.heartbeat_period
        # petals re-declares every block it serves (and pings the next servers) each announcement period, for vanilla
        # clients' routing; the orchestrator plans from the profile records. A faster heartbeat must not speed those
        # up too: with 2 s, an idle four-node swarm spent a whole core on DHT traffic (half with 6 s). A new range, a
        # state change and going offline are announced at once whatever the period.
        self.update_period = max(self.heartbeat_period, ANNOUNCE_PERIOD_MIN_S)
        self.expiration = max(self.expiration, 2 * self.update_period)
        self._report_sent: tuple = (None, -float("inf"))  # ((epoch, seq) last published, when)
        self.server_info.public_name = self.server_info.public_name or self.node_id

        self.petals_init_s = time.perf_counter() - started  # config, DHT + p2pd start
        started = time.perf_counter()
        # -- profile -----------------------------------------------------------------------------------
        try:
            self.trust.check_at_start(self.dht, self.dht_prefix)
            self.memory_bytes = profiling.usable_memory_bytes(self.device, memory_gb)
            self.block_bytes = profiling.block_bytes(self.block_config, self.torch_dtype, self.quant_type,
                                                     cache_dir=profile_cache_dir or profiling.default_cache_dir())
            self.cache_bytes_per_token = profiling.cache_bytes_per_token(self.block_config, self.torch_dtype)
            self.memory = layout.AssignmentMemory(self.block_bytes, self.cache_bytes_per_token)
            self.inbox = AssignmentInbox(self.dht, self.dht_prefix, self.node_id, self.trust,
                                         num_layers=self.block_config.num_hidden_layers, memory=self.memory,
                                         memory_bytes=self.memory_bytes)
            self.declared = dict(declared_profile or {})
            unknown = set(self.declared) - {"prefill_s", "decode_s", "rtt_s", "batch_step_s"}
            if unknown:
                raise ValueError("declared_profile accepts prefill_s, decode_s, rtt_s and batch_step_s, "
                                 f"not {sorted(unknown)}")
            if "prefill_s" in self.declared and "decode_s" in self.declared:
                self.compute = profiling.ComputeTimes(float(self.declared["prefill_s"]),
                                                      float(self.declared["decode_s"]))
            else:
                self.compute = profiling.compute_times(
                    self.block_config, self.device, self.torch_dtype, self.quant_type,
                    cache_dir=profile_cache_dir, tensor_parallel_devices=self.tensor_parallel_devices,
                )
            self.max_batch = int(max_batch)
            self.batch_steps = profiling.published_batch_steps(
                self.declared, self.block_config, self.device, self.torch_dtype, self.quant_type,
                max_batch=self.max_batch, decode_s=self.compute.decode_s, cache_dir=profile_cache_dir)
            if emulated_compute is not None:
                self.emulated = emulation.install(emulated_compute)
                self.compute = profiling.ComputeTimes(
                    self.compute.prefill_s + self.emulated.prefill_s, self.compute.decode_s + self.emulated.decode_s,
                    self.compute.measured_s, self.compute.cached)
                self.batch_steps = profiling.with_emulated_decode(self.batch_steps, self.emulated.decode_s)
        except BaseException:
            self.dht.shutdown()  # do not leave the DHT process and its p2pd behind
            raise
        self.server_info.inference_rps = 1.0 / self.compute.decode_s
        self.server_info.forward_rps = 1.0 / self.compute.prefill_s
        self.profiling_s = time.perf_counter() - started

        # -- lifecycle state ---------------------------------------------------------------------------
        self._lock = threading.RLock()
        self._state = WAITING
        self._current: Optional[Assignment] = None  # the assignment loaded (or being loaded)
        self._next: Optional[Assignment] = None  # the assignment to load after a drain
        self._acked_plan: Optional[str] = None  # plan id of an empty assignment we are waiting under
        self._wake = threading.Event()
        self._reports: "Optional[queue.Queue[tuple]]" = queue.Queue() if report is not None else None
        self.timings: dict[str, float] = {"petals_init_s": self.petals_init_s, "profiling_s": self.profiling_s,
                                          "compute_measured_s": self.compute.measured_s}

        self._rtt = rtt.RttMonitor(self.dht, self.dht_prefix, period=rtt_period,
                                   on_change=lambda _rtt: self._wake.set(),
                                   orchestrator_key=lambda: self.trust.key(self.dht, self.dht_prefix))
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="profile-heartbeat", daemon=True),
            self._rtt,
        ]
        if report is not None:
            self._threads.append(threading.Thread(target=self._report_loop, args=(report,),
                                                  name="launcher-report", daemon=True))
        profile = self.profile()
        logger.info("node %s (peer %s) profile: %s", self.node_id, self.peer_id, profile)
        too_small = profile.memory_shortfall()
        if too_small:  # the planner can give it nothing: say so where it runs
            logger.warning("node %s: %s", self.node_id, too_small)
        self._publish(profile)
        self._report(("profiled", self.node_id, self.peer_id, profile.to_dict()))
        for thread in self._threads:
            thread.start()

    # -- profile and state ---------------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def assignment(self) -> Optional[Assignment]:
        return self._current

    def profile(self) -> ServerProfile:
        """The profile as it would be published now."""
        with self._lock:
            current, state = self._current, self._state
            return ServerProfile(
                node_id=self.node_id,
                peer_id=self.peer_id,
                memory_bytes=self.memory_bytes,
                block_bytes=self.block_bytes,
                cache_bytes_per_token=self.cache_bytes_per_token,
                prefill_s=self.compute.prefill_s,
                decode_s=self.compute.decode_s,
                rtt_s=self._rtt.rtt_s if self._rtt.rtt_s is None else self.declared.get("rtt_s", self._rtt.rtt_s),
                device=str(self.device),
                torch_dtype=str(self.torch_dtype).replace("torch.", ""),
                quant_type=self.quant_type.name.lower(),
                state=state,
                plan_id=current.plan_id if current is not None else self._acked_plan,
                start=current.start if current is not None else None,
                end=current.end if current is not None else None,
                cache_slots=current.cache_slots if current is not None else 0,
                version=petals.__version__,
                batch_step_s=self.batch_steps,
                max_batch=self.max_batch,
                ends=self.max_batch > 1 and batching.ends_ready(),  # loaded with the blocks (server.ends)
                prefix_epoch=self._prefix_store().epoch,  # with the state: the orchestrator resets its index in step
            )

    def _set_state(self, state: str, current: Optional[Assignment] = None, *, keep_current: bool = False) -> None:
        with self._lock:
            if not keep_current:
                self._current = current
            changed = state != self._state
            self._state = state
            profile = self.profile()
        if changed:
            logger.info("node %s: %s (plan %s, blocks %s:%s, %d cache slots)", self.node_id, state,
                        profile.plan_id, profile.start, profile.end, profile.cache_slots)
        self._report(("state", state, profile.plan_id, profile.start, profile.end, profile.cache_slots))
        self._wake.set()

    def _publish(self, profile: Optional[ServerProfile] = None) -> None:
        try:
            records.publish_profile(self.dht, self.dht_prefix, profile or self.profile(), self.profile_ttl,
                                    self.identity.public)
        except Exception as exc:  # a DHT hiccup must not kill the heartbeat
            logger.warning("node %s could not publish its profile: %s", self.node_id, exc)

    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_period
        while not self.stop.is_set():
            self._wake.wait(0.1 if self._state == LOADING else max(0.0, next_beat - time.monotonic()))
            if self.stop.is_set():
                return
            woken = self._wake.is_set()
            self._wake.clear()
            self._check_loaded()
            if woken or time.monotonic() >= next_beat:
                self._publish()
                self._publish_prefix_report()
                next_beat = time.monotonic() + self.heartbeat_period

    @staticmethod
    def _prefix_store():
        from server.prefix_cache import STORE

        return STORE

    def _publish_prefix_report(self) -> None:
        """The prefix store's eviction report (``swarm.trust.prefix``), checked every heartbeat and published when
        its epoch or eviction sequence moved, else renewed every :data:`REPORT_RENEW_S` s. (The orchestrator acts
        only on new epochs and evictions; a report re-sent every heartbeat was two DHT stores a second of a
        four-node test swarm's idle traffic.)"""
        from swarm.trust.prefix import publish_report

        report = self._prefix_store().report()
        key, (sent, at) = (report["epoch"], report["seq"]), self._report_sent
        if key == sent and time.monotonic() - at < REPORT_RENEW_S:
            return
        try:
            ttl = max(self.profile_ttl, 2 * REPORT_RENEW_S)
            if publish_report(self.dht, self.dht_prefix, self.node_id, report, ttl, self.identity.public):
                self._report_sent = (key, time.monotonic())
        except Exception as exc:
            logger.warning("node %s could not publish its prefix report: %s", self.node_id, exc)

    def _check_loaded(self) -> None:
        with self._lock:
            container = self.module_container
            if self._state == LOADING and container is not None and container.ready.is_set():
                self.timings["last_load_s"] = time.perf_counter() - self._load_started
                self._report(("timings", dict(self.timings)))
                self._set_state(SERVING, keep_current=True)

    def _report(self, message: tuple) -> None:
        if self._reports is not None:
            self._reports.put(message)

    def _report_loop(self, report) -> None:
        while True:
            message = self._reports.get()
            try:
                report.send(message)
            except (OSError, EOFError, BrokenPipeError):
                return  # the launcher is gone; the watchdog takes care of us

    # -- petals hooks --------------------------------------------------------------------------------
    def run(self) -> None:
        """petals' serve loop; a range that fails to load is reported (state ``waiting``) and skipped until
        the orchestrator assigns something else, instead of ending the server."""
        while not self.stop.is_set():
            try:
                super().run()
                return
            except _Stopped:
                return
            except Exception as exc:
                failed = self._current
                if failed is None or self._state != LOADING:
                    raise
                logger.error("node %s could not load blocks %d:%d of plan %s: %s: %s", self.node_id, failed.start,
                             failed.end, failed.plan_id, type(exc).__name__, exc)
                self.inbox.failed(failed)
                self._acked_plan = None
                self._set_state(WAITING, None)
                self.module_container = None
                self._clean_memory_and_fds()

    def _choose_blocks(self) -> list[int]:
        """Wait for a non-empty assignment, size the KV cache for it and return its block range."""
        waited_since = time.perf_counter()
        assignment, self._next = self._next, None
        while True:
            if assignment is None:
                assignment = self.inbox.fetch()
                if assignment is None and self._current is not None and self._current.num_blocks:
                    assignment = self._current  # a restart after a crashed handler: keep serving the plan
            if assignment is not None and assignment.num_blocks > 0:
                break
            if self._state != WAITING or (assignment is not None and assignment.plan_id != self._acked_plan):
                self._acked_plan = assignment.plan_id if assignment is not None else self._acked_plan
                self._set_state(WAITING, None)
            if self.stop.wait(self.assignment_poll):
                raise _Stopped()
            assignment = None
        self.timings["last_wait_s"] = time.perf_counter() - waited_since
        self._load_started = time.perf_counter()
        self.attn_cache_bytes = self.memory.session_cache_bytes(assignment)
        self._prefix_store().configure(self.memory.prefix_cache_bytes(assignment))
        self.inference_max_length = assignment.max_length
        self.num_blocks = assignment.num_blocks
        self.server_info.throughput = self.server_info.forward_rps / ((assignment.num_blocks + 1) / 2)
        logger.info("node %s loads blocks %d:%d for plan %s: %d cache slots × %d tokens (+%d prefix tokens), "
                    "%.1f MiB of KV cache", self.node_id, assignment.start, assignment.end, assignment.plan_id,
                    assignment.cache_slots, assignment.max_length, assignment.prefix_cache_tokens,
                    self.memory.cache_bytes(assignment) / 2**20)
        self._set_state(LOADING, assignment)
        failpoints.hit("load")
        server_tickets.configure(open=self.open_sessions, orchestrator_key=self.trust.pinned, peer_id=self.peer_id,
                                 dht_prefix=self.dht_prefix)  # inherited by the handler processes forked next
        return list(range(assignment.start, assignment.end))

    def _should_choose_other_blocks(self) -> bool:
        """Adopt a new plan id in place, or drain and return True when the layout changes."""
        self._check_loaded()
        new = self.inbox.fetch()
        if new is None:
            return False
        in_place = _served_in_place(new, self._current)
        if self._current in (new, in_place):  # nothing new, or adopted already (with the pool's slots)
            return False
        if in_place is not None:
            logger.info("node %s adopts plan %s (same blocks, %d of its %d KV slots)", self.node_id, new.plan_id,
                        new.cache_slots, in_place.cache_slots)
            self._set_state(self._state, in_place)
            return False
        target = self._drain(new)
        if target is None:
            return False
        self._next = target
        return True

    def _drain(self, target: Assignment) -> Optional[Assignment]:
        """Stop taking sessions, wait until the open ones end, return the assignment to load next (None when
        the orchestrator went back to the current layout meanwhile)."""
        logger.info("node %s drains before moving to plan %s (blocks %d:%d)", self.node_id, target.plan_id,
                    target.start, target.end)
        began = time.perf_counter()
        self._set_state(DRAINING, keep_current=True)
        failpoints.hit("drain")
        container = self.module_container
        if container is not None:
            container.dht_announcer.announce(ServerState.JOINING)  # petals' routing opens no new sessions here
        next_poll = time.monotonic() + self.check_period
        while self.sessions_open():
            if time.perf_counter() - began > self.drain_timeout:
                logger.warning("node %s: sessions still open after the %.0f s drain timeout; reloading anyway",
                               self.node_id, self.drain_timeout)
                break
            if self.stop.wait(0.05):
                raise _Stopped()
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.check_period
                latest = self.inbox.fetch()
                if latest is not None and _layout(latest) == _layout(self._current):
                    logger.info("node %s: plan %s keeps the current blocks; drain cancelled", self.node_id,
                                latest.plan_id)
                    if container is not None:
                        container.dht_announcer.announce(ServerState.ONLINE)
                    self._set_state(SERVING, latest)
                    return None
                if latest is not None:
                    target = latest
        self.timings["last_drain_s"] = time.perf_counter() - began
        return target

    def sessions_open(self) -> bool:
        """Whether any inference session holds (or waits for) KV cache on this server."""
        container = self.module_container
        if container is None or not container.module_backends:
            return False
        cache = next(iter(container.module_backends.values())).memory_cache
        return (cache.current_size_bytes > 0 or cache.enqueued_size_bytes > 0
                or cache.sessions_open > 0)  # a session holds no page of the paged pool before its prefill

    def shutdown(self, timeout: Optional[float] = 5) -> None:
        self.stop.set()
        self._wake.set()
        self._rtt.stop()
        super().shutdown(timeout)


def run_node(server_kwargs: dict, *, report=None, push_counter=None) -> None:
    """Build a :class:`ChainswarmServer` (ticket-gated, push-fixed handler with the prefix store and multi-session
    streams; the batching pool: ``max_batch``) and run it until SIGTERM/SystemExit. ``join_timeout_s`` (default 0:
    one try) keeps trying to join while none of the initial peers answers (an orchestrator that is not up yet)."""
    from server import multi_session
    from swarm.runtime.process import freeze_imported_heap

    multi_session.install(push_counter=push_counter)
    freeze_imported_heap()
    server_kwargs = dict(server_kwargs)
    join_timeout_s = float(server_kwargs.pop("join_timeout_s", 0.0))
    bound = server_kwargs.get("max_batch")
    kwargs = batching.install(server_kwargs)
    server = join_with_retries(
        lambda: ChainswarmServer(report=report, max_batch=batching.DEFAULT_MAX_BATCH if bound is None else bound,
                                 **kwargs),
        kwargs.get("initial_peers") or [], timeout_s=join_timeout_s, what="the swarm", log=logger)
    try:
        server.run()
    finally:
        server.shutdown()


def node_process_main(server_kwargs: dict, launcher_pid: int, report=None, push_counter=None) -> None:
    """Entry point of a node child process started by :meth:`server.local_swarm.LocalSwarm.add_node`."""
    from swarm.runtime.dht import quiet_p2p_noise
    from swarm.runtime.process import become_group_leader, children_die_with_me

    become_group_leader(launcher_pid)
    children_die_with_me()  # a node that crashes leaves no DHT, handler or p2pd process behind
    quiet_p2p_noise()
    logging.basicConfig(level=os.environ.get("CHAINSWARM_LOGLEVEL", "WARNING"))
    try:
        run_node(server_kwargs, report=report, push_counter=push_counter)
    except Exception as exc:  # tell the launcher instead of leaving it waiting
        if report is not None:
            report.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
