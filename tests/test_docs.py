"""The documentation: the generators, a strict MkDocs build, and a README whose links and numbers hold.

``make docs`` runs ``scripts/docs/generate.py`` (CLI reference from argparse, HTTP reference from the OpenAPI
schema, results tables from ``experiments/results/*.json``) and ``mkdocs build --strict``; this test does the
same into a temporary directory, so a broken link, a bad anchor or a missing page fails the suite. It also keeps
the README short, its relative links pointing at files that exist, and its headline numbers equal to the JSON.
"""
from __future__ import annotations

import json

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
README = ROOT / "README.md"
MAX_README_LINES = 250

sys.path.insert(0, str(ROOT / "scripts" / "docs"))
import results  # noqa: E402  (scripts/docs/results.py: the headline values)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Run the generators into docs/reference (as `make docs` does) and build the site strictly into a tmp dir."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "docs" / "generate.py")], cwd=ROOT, env=env, check=True,
                   timeout=300, capture_output=True)
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    build = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(out)], cwd=ROOT, env=env, timeout=300,
                           capture_output=True, text=True)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def test_strict_build_has_every_page(site):
    for page in ("index.html", "install/index.html", "architecture/index.html", "security/index.html",
                 "reference/cli/index.html", "reference/http-api/index.html", "reference/results/index.html"):
        assert (site / page).is_file(), page
    assert (site / "reference" / "openapi.json").is_file()


def test_cli_reference_lists_every_subcommand(site):
    from swarm.cli import SUBCOMMANDS

    text = (REFERENCE / "cli.md").read_text()
    for name in SUBCOMMANDS:
        assert f"## chainswarm {name}\n" in text, name
        assert f"usage: chainswarm {name} " in text, name
    assert "--batch-sessions" in text and "--max-batch" in text  # orchestrator and server options, from argparse


def test_http_reference_lists_the_generation_endpoints(site):
    text = (REFERENCE / "http-api.md").read_text()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/leases", "/v1/swarm"):
        assert f"`{path}`" in text, path
    assert "## POST /v1/chat/completions" in text and "`messages`" in text  # the request body's fields


def test_generated_tables_are_included_in_the_pages(site):
    html = (site / "batching" / "index.html").read_text()
    bench = json.loads((ROOT / "experiments" / "results" / "bench_batching.json").read_text())
    multi8 = next(r for r in bench["results"]["chainswarm_multi"] if r["sessions"] == 8)
    assert f"{multi8['tokens_per_s']:.1f}" in html and "--8&lt;--" not in html and "--8<--" not in html
    assert "device_check_h200.json" in (site / "models" / "index.html").read_text()


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_relative_links_exist():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    missing = []
    for link in links:
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            continue
        target = (ROOT / link.split("#", 1)[0]).resolve()
        if not target.exists():
            missing.append(link)
    assert not missing, f"README.md links to files that do not exist: {missing}"


def _readme_headline_rows() -> dict[str, str]:
    text = README.read_text()
    section = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and cells[0] not in ("result", "---"):
            rows[cells[0]] = cells[1]
    return rows


def test_readme_headline_numbers_equal_the_json():
    rows = _readme_headline_rows()
    expected = results.headline()
    assert rows, "README.md has no headline table"
    for what, value, _json, _page in expected:
        assert what in rows, f"README.md's headline table lacks the row {what!r}"
        assert rows[what] == value, f"README.md says {rows[what]!r} for {what!r}; the JSON gives {value!r}"
    assert set(rows) == {what for what, *_ in expected}, "a README headline row that no JSON backs"
