"""Shared fixtures: a tiny random Llama checkpoint and its local transformers reference."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `chainswarm orchestrator` keeps state in the user's state directory by default: the tests' own, never the user's
# (one per pytest process, removed when it ends)
_STATE_DIR = os.environ["CHAINSWARM_STATE"] = __import__("tempfile").mkdtemp(prefix="chainswarm-test-state-")
# the local-transformers references (tests/real_model.py:greedy_reference) live in the user cache, keyed by a
# digest of the checkpoint and library versions; CHAINSWARM_FRESH_REFERENCES=1 decodes them anew into a directory of
# this run's own, shared by its xdist workers: made by the process that starts the run, removed when it ends
_REFERENCE_DIR_MADE_HERE = (os.environ.get("CHAINSWARM_FRESH_REFERENCES") == "1"
                            and "CHAINSWARM_REFERENCE_DIR" not in os.environ)
if _REFERENCE_DIR_MADE_HERE:
    os.environ["CHAINSWARM_REFERENCE_DIR"] = __import__("tempfile").mkdtemp(prefix="chainswarm-references-")


def pytest_unconfigure(config):
    __import__("shutil").rmtree(_STATE_DIR, ignore_errors=True)
    if not hasattr(config, "workerinput"):  # the controller (or the only process), once every worker has ended
        # hivemind's unix sockets that peers killed outside a LocalSwarm left in /tmp (a CLI orchestrator or server a
        # test SIGKILLs: 8-12 a run; a LocalSwarm removes its own when it stops), made since the suite started and
        # bound by no process (swarm.runtime.process.remove_stale_sockets)
        from swarm.runtime.process import remove_stale_sockets

        remove_stale_sockets(_SUITE_START)
    if _REFERENCE_DIR_MADE_HERE:
        __import__("shutil").rmtree(os.environ["CHAINSWARM_REFERENCE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 4-block random Llama (hidden 64) with a trained BPE tokenizer, written once per test session."""
    from swarm.model.checkpoint import TinyModelSpec, make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec(seed=1)))


@pytest.fixture(scope="session")
def reference_generate(tiny_model):
    """Greedy generation with the same checkpoint run locally in transformers (the ground truth)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()

    def generate(input_ids, max_new_tokens: int):
        with torch.inference_mode():
            return model.generate(
                input_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )

    return generate


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct as a float32 checkpoint from the model cache (see tests/real_model.py)."""
    from real_model import smollm2_checkpoint

    return smollm2_checkpoint("float32")


# -- the browser tests (tests/test_browser.py): never a silent skip -------------------------------------------
def pytest_terminal_summary(terminalreporter, config):
    _browser_summary(terminalreporter)
    _file_times_summary(terminalreporter, config)


def _browser_summary(terminalreporter):
    from browser import missing

    # the reports of the tests that were run or skipped (under pytest-xdist the controller collects nothing: the
    # workers' reports carry the markers; deselected items are not reports)
    ran = any(isinstance(report, pytest.TestReport) and report.when == "setup" and "browser" in report.keywords
              for reports in terminalreporter.stats.values() for report in reports)
    if not ran:
        return
    reason = missing()
    if reason:
        terminalreporter.write_sep("!", f"BROWSER TESTS NOT RUN: {reason}", red=True, bold=True)
    else:
        terminalreporter.write_line("browser tests ran in headless Chromium (tests/test_browser.py)", green=True)


# `make test` runs the suite on both cores (pytest-xdist, -n 2 --dist loadfile --no-loadscope-reorder), which hands
# out test files in collection order: the longest files go first, so that none starts last and runs alone at the end
# (the order of their durations in a full run: the fresh-clone runs of 2026-11-30 17:02 and 17:45).
LONGEST_FIRST = ("test_failpoints.py", "test_batched_sessions_real.py", "test_tools_api.py", "test_live_experiments.py",
                 "test_chaos.py", "test_real_model_swarm.py", "test_gemma3_swarm.py", "test_openai_api.py",
                 "test_restart.py", "test_single_session_real.py", "test_server_node.py", "test_runtime.py",
                 "test_family_swarm.py", "test_demo.py", "test_structured_outputs.py", "test_cli.py",
                 "test_batching_swarm.py", "test_replan_occupancy.py", "test_browser.py", "test_batch_experiments.py",
                 "test_hostile_peer.py", "test_drafting_replay.py", "test_replan.py", "test_multi_session.py",
                 "test_prefix_reuse.py", "test_compat.py", "test_api_schema.py", "test_gemma3_real.py")


def pytest_ignore_collect(collection_path, config):
    """``make test``'s second phase (``-m alone``) collects only the files that mark tests ``alone``: importing and
    collecting all ~60 files to select 24 tests took 11 s of that one-at-a-time phase, the three files 4 s."""
    if (config.getoption("markexpr") == "alone" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        if "mark.alone" not in collection_path.read_text(encoding="utf-8"):
            return True
    return None  # pytest's own rules (--ignore, collect_ignore) decide the rest: a False here would override them


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def pytest_collection_finish(session):
    """Every test module is imported: freeze what is alive now (swarm.runtime.process.freeze_imported_heap). A
    worker holds ~410k objects after collection, and every full collection walked them: 22 of them, 2.6 of its 18
    CPU-s, in one run of two real-model files (measured 2026-11-30); transformers' ``from_pretrained`` asks for one
    each time a test loads a model."""
    import gc

    from swarm.runtime.process import freeze_imported_heap

    gc.collect()  # once per worker: leave no garbage in the frozen generation
    freeze_imported_heap()


# -- a suite that always ends with its summary, and says what the machine looked like when a test failed --------
# `make test` kills pytest after 28 minutes (Makefile). A suite that runs into that limit prints no summary, so a
# failure on a loaded or failing machine would say nothing: past CHAINSWARM_SUITE_BUDGET_S (default 25 minutes)
# every test not yet started fails at once with that reason, and the summary still prints. The clock starts when
# scripts/run_tests.sh starts (CHAINSWARM_SUITE_START, wall-clock seconds: both phases and every worker count from
# it), and the budget leaves 3 minutes for the tests still running then. (With 24 minutes from each process's own
# start, a run beside a CPU-bound process was killed at 25 minutes with no summary.)
_SUITE_BUDGET_S = float(os.environ.get("CHAINSWARM_SUITE_BUDGET_S", 25 * 60))
_SUITE_START = float(os.environ.get("CHAINSWARM_SUITE_START") or __import__("time").time())


def pytest_runtest_setup(item):
    elapsed = __import__("time").time() - _SUITE_START
    if elapsed > _SUITE_BUDGET_S:
        pytest.fail(f"not run: the suite is past its budget of {_SUITE_BUDGET_S:.0f} s (CHAINSWARM_SUITE_BUDGET_S) "
                    f"after {elapsed:.0f} s", pytrace=False)


def _machine() -> str:
    import shutil
    import tempfile

    import psutil

    disk = shutil.disk_usage(tempfile.gettempdir())
    memory = psutil.virtual_memory()
    me = psutil.Process()
    children = me.children(recursive=True)
    return (f"free disk in {tempfile.gettempdir()}: {disk.free / 2**30:.1f} GiB; available memory "
            f"{memory.available / 2**30:.1f} GiB; load average {os.getloadavg()}; this test process has "
            f"{len(children)} live child processes; {len(psutil.pids())} processes on the machine")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        try:
            report.sections.append(("machine at the failure", _machine()))
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never hide the failure itself
            report.sections.append(("machine at the failure", f"unavailable: {exc!r}"))


# -- where the suite's time goes, by file (what LONGEST_FIRST orders) -------------------------------------------
# The controller (or the only process without xdist) adds up each file's setup, call and teardown times from the
# reports it receives, and the summary lists the longest files: the figures to keep LONGEST_FIRST in order by and
# the first place to look when the suite gets slower.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)


def _file_times_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not _FILE_SECONDS:  # an xdist worker: the controller prints it
        return
    longest = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:15]
    terminalreporter.write_sep("=", f"longest test files ({sum(_FILE_SECONDS.values()):.0f} s in all)")
    for path, seconds in longest:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
