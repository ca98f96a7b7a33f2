"""Every picture and the live dashboard, opened in a real browser (Playwright driving Debian's
Chromium: `make install` installs it; Playwright's own browser download is not used), checked
for what a person looks at: one row per block, the stuck step marked and in view, the lanes'
request ids, proved cells apart from the rest, a 10,000-step trace drawn, live numbers that
change while requests run. Each view's screenshot goes to artifacts/browser/ (gitignored; or
$ATOM_ARTIFACTS), and with ATOM_WRITE_DOCS_IMAGES=1 also to docs/img/ (the README's pictures).

Without Chromium or Playwright the file skips, except under CI (CI set), where that fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from atom_core import cli

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("ATOM_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("ATOM_ARTIFACTS") or ROOT / "artifacts" / "browser")
DOCS_IMG = ROOT / "docs" / "img"
WRITE_DOCS = os.environ.get("ATOM_WRITE_DOCS_IMAGES") == "1"
# Chromium as CI runs it: no sandbox (root), no GPU, nothing fetched on its own behalf
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 800}

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # (the dev extra installs it)
    sync_playwright = None


def _need(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why}: under CI the browser tests must run, not skip")
        pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    _need(sync_playwright is not None, "playwright is not installed (pip install -e '.[dev]')")
    _need(shutil.which(CHROMIUM) is not None,
          f"no Chromium at {CHROMIUM} (apt-get install chromium; `make install` does)")
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=ARGS, viewport=VIEWPORT)
        yield ctx
        ctx.close()


@pytest.fixture
def page(browser):
    pg = browser.new_page()
    pg.fetched = []  # every URL the page asked for: the pictures ask for nothing
    pg.on("request", lambda r: pg.fetched.append(r.url))
    yield pg
    pg.close()


def snap(pg, name: str) -> Path:
    """The view's screenshot as a test artifact (and the docs' picture, when asked)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    png = pg.screenshot(full_page=True)
    path = ARTIFACTS / f"{name}.png"
    path.write_bytes(png)
    if WRITE_DOCS:
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        (DOCS_IMG / f"{name}.png").write_bytes(png)
    assert len(png) > 10_000  # (a blank page is a few hundred bytes)
    return path


def cli_json(capsys, *argv: str) -> dict:
    cli.main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def open_file(pg, path: Path) -> None:
    pg.goto(path.as_uri())
    assert pg.fetched == [path.as_uri()]  # offline: nothing but the file itself


def in_view(pg, locator) -> bool:
    """Whether the element is on screen without scrolling (a person sees it at once)."""
    box = locator.bounding_box()
    return box is not None and box["x"] + box["width"] <= VIEWPORT["width"] and box["x"] >= 0


# --------------------------------------------------------------------------- the pictures
def test_check_config_stuck_run(page, capsys, tmp_path):
    out = tmp_path / "check-config.html"
    data = cli_json(capsys, "check-config", "--lanes", "3", "--kv-blocks", "5", "--block-size",
                    "2048", "--prefix-cache", "--html", str(out))
    open_file(page, out)
    assert page.locator("svg.timeline g.row.block").count() == data["kv_blocks"]
    assert page.locator("svg.timeline g.row.lane").count() == data["lanes"]
    stuck = page.locator("g.stuck-marker")
    assert stuck.get_attribute("data-state") == str(len(data["trace"]))
    assert in_view(page, stuck.locator("rect"))
    assert data["violated"] in page.locator("g.stuck-marker text").text_content()
    labels = page.locator("svg.timeline text.cell-label").all_text_contents()
    assert set(data["stuck_state"]["lanes"]) <= set(labels)
    steps = page.locator("ul.steps li").all_inner_texts()
    assert len(steps) == len(data["trace"]) and "grow" in steps[-1]
    assert "UNSAFE" in page.locator(".headline").inner_text()
    snap(page, "check-config")


def test_min_blocks_capacity_picture(page, capsys, tmp_path):
    out = tmp_path / "min-blocks.html"
    data = cli_json(capsys, "min-blocks", "--lanes", "3", "--block-size", "2048",
                    "--prefix-cache", "--html", str(out))
    open_file(page, out)
    proved = page.locator("td.cell.proved")
    assert proved.count() > 0 and page.locator("td.cell.extrapolated").count() > 0
    # proved cells look different from the rest (a person tells them apart)
    style = "el => getComputedStyle(el).backgroundImage + getComputedStyle(el).fontStyle"
    assert proved.first.evaluate(style) != \
        page.locator("td.cell.extrapolated").first.evaluate(style)
    assert page.locator("td.cell.artifact").inner_text() == str(data["min_kv_blocks"])
    assert page.locator("svg.capacity-chart circle.point.proved").count() > 0
    assert page.locator("g.artifact").is_visible()
    snap(page, "min-blocks")


def test_check_trace(page, capsys, tmp_path):
    from test_viz import synthetic_trace

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(synthetic_trace(300)) + "\n")
    out = tmp_path / "check-trace.html"
    verdict = cli_json(capsys, "check-trace", str(trace), "--html", str(out))
    assert verdict["ok"]
    open_file(page, out)
    assert page.locator("svg.timeline").get_attribute("data-steps") == "300"
    assert page.locator("svg.timeline g.row.block").count() == 3
    kinds = page.locator("g.marks").evaluate_all("gs => gs.map(g => g.dataset.kind)")
    assert kinds == ["admit", "hit", "evict"]
    # hovering a column names its step
    assert re.search(r"^\d+\. \w+\(", page.locator("rect.act").nth(100).locator(
        "title").text_content())
    snap(page, "check-trace")


def test_a_10000_step_trace_renders(page, tmp_path):
    """(Drawn here from the timeline: check-trace's own replay of 10,000 steps, with every
    invariant checked after each, takes far longer than drawing them.)"""
    from test_viz import LONG_STEPS, synthetic_trace

    from atom_core.viz import timeline_of_trace
    from atom_core.viz.page import page as html_page
    from atom_core.viz.page import timeline_section

    t = timeline_of_trace(synthetic_trace(LONG_STEPS), name="long")
    out = tmp_path / "long.html"
    out.write_text(html_page(f"a {LONG_STEPS:,}-step trace", "drawn", None, [],
                             [timeline_section(t)], {"steps": t.steps}))
    t0 = time.perf_counter()
    open_file(page, out)
    svg = page.locator("svg.timeline")
    assert svg.get_attribute("data-steps") == str(LONG_STEPS)
    assert int(svg.get_attribute("data-per-column")) > 1
    assert "downsampled" in page.locator(".how").inner_text()
    assert page.locator("svg.timeline g.row.block").count() == 3
    assert page.locator('g.marks[data-kind="hit"] text.mark').count() > 100
    assert svg.bounding_box()["width"] > 1000  # (drawn, not an empty box)
    assert time.perf_counter() - t0 < 30  # (seconds, on a loaded CI machine)
    snap(page, "long-trace")


def test_demo_run(page, capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "demo.html"
    data = cli_json(capsys, "demo", "--requests", "8", "--max-new-tokens", "4", "--html",
                    str(out))
    open_file(page, out)
    assert page.locator("svg.timeline g.row.block").count() == data["config"]["kv_blocks"]
    labels = set(page.locator("svg.timeline text.cell-label").all_text_contents())
    assert {f"r{r}" for r in range(4)} <= labels  # the first requests, in their lanes
    kinds = page.locator("g.marks").evaluate_all("gs => gs.map(g => g.dataset.kind)")
    assert {"admit", "hit"} <= set(kinds)
    assert "YES" in page.locator(".headline").inner_text()
    snap(page, "demo")


def test_simulate_run(page, capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "simulate.html"
    report = cli_json(capsys, "simulate", "--seed", "0", "--steps", "40", "--mode", "colocated",
                      "--set", "preemption=true", "--set", "host_cache_blocks=2",
                      "--prefix-cache", "--html", str(out))
    open_file(page, out)
    assert page.locator("svg.timeline g.row.slot").count() == 2  # the host tier's slots
    kinds = set(page.locator("g.marks").evaluate_all("gs => gs.map(g => g.dataset.kind)"))
    assert {"fault", "preempt", "spill", "hit", "evict"} <= kinds
    assert f"seed {report['seed']}" in page.title()
    snap(page, "simulate")


# --------------------------------------------------------------------------- the live page
def test_dashboard_live(page):
    pytest.importorskip("fastapi")
    from test_serve import KEY, MODEL, Server, tiny_config

    with Server(tiny_config(), delay=0.02) as srv:
        page.goto(srv.base + "/dashboard?every=250")
        form = page.locator("#keyform")
        form.wait_for(state="visible", timeout=5000)  # no key yet: the page asks for it
        page.fill("#key", KEY)
        page.click("#keyform button")
        page.locator("#main").wait_for(state="visible", timeout=5000)
        assert page.locator("#blocks .blk").count() == srv.cfg.kv_blocks
        before = int(page.locator("#c-generated").inner_text())
        stop, errors = threading.Event(), []

        def load(i: int) -> None:
            c = srv.client()
            n = 0
            while not stop.is_set():  # (bounded: the test stops it within seconds)
                try:
                    c.completions.create(model=MODEL, prompt="a shared system prompt, " * 3
                                         + f"user {i}.{n}", max_tokens=24, temperature=0)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return
                n += 1

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        try:
            # the lanes show the requests they serve, the numbers move
            page.wait_for_function(
                "() => [...document.querySelectorAll('#lanes tr')].filter("
                "r => /^r\\d+$/.test(r.children[1]?.textContent)).length >= 2", timeout=20000)
            page.wait_for_function(
                f"() => Number(document.querySelector('#c-generated').textContent) > {before}",
                timeout=20000)
            first = int(page.locator("#c-generated").inner_text())
            page.wait_for_function(
                f"() => Number(document.querySelector('#c-generated').textContent) > {first}",
                timeout=20000)
            page.wait_for_function("() => document.querySelector('#sp-tps polyline')"
                                   ".getAttribute('points').split(' ').length >= 4",
                                   timeout=20000)
            phases = page.locator("#lanes tr td:nth-child(3)").all_inner_texts()
            assert {"prefill", "decode"} & set(phases)
            assert page.locator("#blocks .blk[data-owner^='lane:']").count() >= 2
            page.wait_for_function("() => document.querySelectorAll('#events div').length > 5",
                                   timeout=20000)
            page.wait_for_function("() => [...document.querySelectorAll('#cache tr')].some("
                                   "r => Number(r.children[2]?.textContent) > 0)",
                                   timeout=20000)  # an entry with hits
            assert page.locator("#status").get_attribute("class") == "ok"
            snap(page, "dashboard")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors
        origin = urlparse(srv.base).netloc
        assert {urlparse(u).netloc for u in page.fetched} == {origin}  # no CDN, nothing else
