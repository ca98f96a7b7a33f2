"""The pictures (atom_core/viz/, `--html`), without a browser: each page is drawn from its
command's --json output (which --html leaves as it is) and carries it; a run's picture is its
records applied to the core again (a run that does not replay, or does not end in the reported
stuck state, draws nothing); long runs are downsampled. tests/test_viz_browser.py opens the
pages in Chromium."""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from atom_core import cli
from atom_core._generated import capacity, core
from atom_core.replay import record
from atom_core.seq import seq
from atom_core.viz import capacity as vcap
from atom_core.viz import replay_steps, timeline_of_trace
from atom_core.viz.page import MAX_COLUMNS, timeline_section

# a stuck run with paged tables: 3 lanes of T = 2 blocks, one block short (19 steps)
STUCK = ["check-config", "--lanes", "3", "--kv-blocks", "5", "--block-size", "2048",
         "--prefix-cache"]
LONG_STEPS = 10_000


def run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def page_data(text: str) -> dict:
    """The --json output a page carries."""
    m = re.search(r'<pre id="data">(.*?)</pre>', text, re.S)
    assert m, "the page carries no data"
    return json.loads(html.unescape(m.group(1)))


def rows(text: str, kind: str) -> list[str]:
    return re.findall(rf'<g class="row {kind}" data-{kind}="(\d+)"', text)


def synthetic_trace(steps: int, lanes: int = 2, blocks: int = 3) -> list[str]:
    """A batcher trace of `steps` steps driven through the core by a fixed priority (finish,
    copy, prefill, admit with a hit if one fits, decode, submit): admissions, prefix hits and
    evictions every few steps, without a runtime (fast enough for 10,000 steps)."""
    consts = {"B": lanes, "K": blocks, "C": 2, "S": 8, "PREFIX": True, "RESERVED": False,
              "SCRATCH": 0, "T": 1}
    s = core.init(core.Consts(**consts), ghost=False)
    lines = [json.dumps({"consts": consts})]
    nxt, decoded = 0, [0] * lanes

    def candidates():
        waiting = [r for r, ph in s.phase.items() if ph == core.PHASE_WAITING]
        for ln in range(lanes):
            if s.busy[ln] and decoded[ln] >= 2:
                yield "finish", {"l": ln, "keep": True}
        for ln in range(lanes):
            yield "copy_done", {"l": ln}
            yield "prefill", {"l": ln, "tok": 5}
        for r in waiting[:1]:
            for ln in range(lanes):
                for src in range(blocks):
                    for b in range(blocks):
                        yield "admit_hit", {"l": ln, "r": r, "src": src, "dst": b, "n": 2}
                for b in range(blocks):
                    yield "admit_miss", {"l": ln, "r": r, "dst": b}
        if any(s.busy):
            yield "decode", {"pad": 0, "lpad": 0, "tok": (5,) * lanes}
        if len(waiting) < 2:
            yield "submit", {"r": nxt, "p": seq([1, 2, 3, 4, 5][:3 + nxt % 3])}

    while len(lines) <= steps:
        for action, args in candidates():
            step = core.ACTIONS[action][0](s, **args)
            if step.rejected is None:
                break
        else:
            raise AssertionError("the driver found no step")
        if action == "submit":
            nxt += 1
        elif action == "decode":
            decoded = [d + 1 if s.busy[ln] else d for ln, d in enumerate(decoded)]
        elif action == "finish":
            decoded[args["l"]] = 0
        s = step.state
        lines.append(json.dumps(record(action, args, step.effects)))
    return lines


# --------------------------------------------------------------------------- check-config
def test_check_config_html_draws_the_stuck_run_of_its_json(capsys, tmp_path):
    code, plain = run(capsys, *STUCK, "--json")
    out = tmp_path / "stuck.html"
    code2, with_html = run(capsys, *STUCK, "--json", "--html", str(out))
    assert code == code2 == 1
    assert with_html == plain  # --html leaves --json's output as it was
    data = json.loads(plain)
    text = out.read_text()
    assert page_data(text) == data
    assert rows(text, "block") == [str(b) for b in range(data["kv_blocks"])]
    assert rows(text, "lane") == [str(ln) for ln in range(data["lanes"])]
    # the stuck point, at the run's last state, named by the property that fails
    assert f'class="stuck-marker" data-state="{len(data["trace"])}"' in text
    assert data["violated"] in text
    for r in data["stuck_state"]["lanes"]:  # each lane's request id is drawn
        assert f">{r}</text>" in text
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text and "<script" not in text  # opens offline, runs nothing


def test_the_replayed_run_must_end_in_the_reported_stuck_state(capsys):
    from atom_core.viz import check_config_page

    code, plain = run(capsys, *STUCK, "--json")
    data = json.loads(plain)
    consts = core.Consts(B=3, K=5, C=2, S=8, T=2, PREFIX=True, RESERVED=False, SCRATCH=0)
    assert "stuck-marker" in check_config_page(data, consts)
    wrong = {**data, "stuck_state": {**data["stuck_state"], "lanes": ["idle"] * 3}}
    with pytest.raises(ValueError, match="not to the reported stuck state"):
        check_config_page(wrong, consts)
    refused = {**data, "trace": data["trace"][1:]}  # an admission before its submit
    with pytest.raises(ValueError, match="is not allowed"):
        check_config_page(refused, consts)


def test_check_config_html_safe_and_write_errors(capsys, tmp_path):
    out = tmp_path / "safe.html"
    code, text = run(capsys, "check-config", "--lanes", "2", "--kv-blocks", "2", "--html",
                     str(out))
    assert code == 0 and "SAFE" in text
    assert "SAFE" in out.read_text() and "no stuck run to draw" in out.read_text()
    code, text = run(capsys, "check-config", "--lanes", "2", "--kv-blocks", "2", "--json",
                     "--html", str(tmp_path / "no" / "such" / "dir.html"))
    assert code == 2
    assert json.loads(text) == {"safe": False, "error": json.loads(text)["error"]}
    assert "cannot write" in json.loads(text)["error"]


# --------------------------------------------------------------------------- check-trace
def test_check_trace_html_marks_hits_evictions_and_a_refused_step(capsys, tmp_path):
    trace = synthetic_trace(60)
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(trace) + "\n")
    out = tmp_path / "good.html"
    code, plain = run(capsys, "check-trace", str(good), "--json")
    assert run(capsys, "check-trace", str(good), "--json", "--html", str(out)) == (code, plain)
    assert code == 0
    text = out.read_text()
    assert page_data(text) == json.loads(plain)
    kinds = set(re.findall(r'<g class="marks" data-kind="(\w+)"', text))
    assert {"admit", "hit", "evict"} <= kinds
    assert len(rows(text, "block")) == 3 and len(rows(text, "lane")) == 2
    # a step the spec refuses, after 60 good ones: drawn up to it, the refusal marked
    bad = tmp_path / "bad.jsonl"
    refused = json.dumps({"action": "admit_miss", "args": {"l": 0, "r": 999, "dst": 0}})
    bad.write_text("\n".join([*trace, refused]) + "\n")
    code, _ = run(capsys, "check-trace", str(bad), "--html", str(out))
    text = out.read_text()
    verdict = page_data(text)
    assert code == 1 and not verdict["ok"] and verdict["steps"] == 60
    assert f'class="stuck-marker" data-state="{verdict["steps"]}"' in text
    assert f"line {verdict['line']} refused" in text


def test_a_long_trace_is_downsampled_and_stays_small():
    t = timeline_of_trace(synthetic_trace(LONG_STEPS))
    assert t.steps == LONG_STEPS and len(t.blocks[0]) == LONG_STEPS + 1
    text = timeline_section(t)
    per = -(-(LONG_STEPS + 1) // MAX_COLUMNS)
    assert f'data-per-column="{per}"' in text and "downsampled" in text
    assert len(re.findall(r'class="act"', text)) <= MAX_COLUMNS
    assert len(text) < 2_000_000  # (about 1.2 MB: a file to attach to a bug report)


def test_timeline_owners_follow_the_core():
    """Each cell is the core's owner of that block after that step, lanes with their
    requests; hits and evictions are marked at the step that did them."""
    trace = synthetic_trace(40)
    t = timeline_of_trace(trace)
    s = core.init(core.Consts(**json.loads(trace[0])["consts"]), ghost=False)
    from atom_core.replay import _args

    for i, line in enumerate(trace[1:], start=1):
        rec = json.loads(line)
        s = core.ACTIONS[rec["action"]][0](s, **_args(rec["action"], rec["args"], s.consts)).state
        for b in range(s.consts.K):
            cell = t.blocks[b][i]
            if s.owner[b] == core.OWNER_LANE:
                assert cell == f"lane:{s.owner_lane[b]}:{s.lane_req[s.owner_lane[b]]}"
            else:
                assert cell in ("cache", "pinned", "free")
        kinds = {m.kind for m in t.marks if m.step == i}
        if rec["action"] == "admit_hit":
            assert {"admit", "hit"} <= kinds


def test_lanes_carry_their_request_and_phase():
    c = core.Consts(B=2, K=3, C=2, S=8, T=2, PREFIX=False, RESERVED=False, SCRATCH=0,
                    PREEMPT=True)
    steps = [("submit", {"r": 0, "p": [1, 2, 3]}), ("submit", {"r": 1, "p": [1, 2, 3]}),
             ("admit_miss", {"l": 0, "r": 0, "dst": 0}),
             ("admit_miss", {"l": 1, "r": 1, "dst": 1})]
    t = replay_steps(c, steps)
    assert [m.kind for m in t.marks] == ["admit", "admit"]
    assert t.lanes[0][-1] == "0:prefill" and t.blocks[1][-1] == "lane:1:1"
    assert t.blocks[2] == ("free",) * 5 and t.lanes[1][:4] == ("",) * 4


# --------------------------------------------------------------------------- min-blocks
def test_min_blocks_html_marks_proved_cells(capsys, tmp_path):
    out = tmp_path / "cap.html"
    argv = ["min-blocks", "--lanes", "3", "--prefix-cache", "--json"]
    code, plain = run(capsys, *argv)
    assert run(capsys, *argv, "--html", str(out)) == (code, plain)
    text = out.read_text()
    assert page_data(text) == json.loads(plain)
    cells = re.findall(r'<td class="cell (proved|extrapolated)( artifact)?" data-b="(\d+)" '
                       r'data-k="(\d+)"', text)
    assert len(cells) == 4 * vcap.MIN_DRAWN  # T = 1: four combinations, no preemption
    for kind, _here, b, _k in cells:
        assert (kind == "proved") == (int(b) <= capacity.PROVED_LANES)
    (mine,) = [c for c in cells if c[1]]
    assert (mine[2], mine[3]) == ("3", str(json.loads(plain)["min_kv_blocks"]))
    # paged tables with preemption: eight combinations, B * T <= the proved lanes
    run(capsys, "min-blocks", "--lanes", "40", "--block-size", "2048", "--preemption",
        "--html", str(out))
    text = out.read_text()
    assert text.count('<tr data-name=') == 8 and 'data-b="40"' in text


def test_proved_sizes_are_the_proofs():
    """The picture's proved cells are the sizes proofs/capacity.py checks."""
    pytest.importorskip("z3")
    from atom_core.proofs.capacity import COMBINATIONS

    plain = [f for f in COMBINATIONS if not f.hybrid and not f.host]
    assert {f.tables for f in plain if not f.preempt} == set(vcap.PROVED_TABLES)
    assert {f.tables for f in plain if f.preempt} == set(vcap.PROVED_TABLES_PREEMPT)
    for f in plain:
        for b in range(1, 9):
            assert vcap.proved(b, f.tables, f.preempt) == (b <= f.max_lanes(
                capacity.PROVED_LANES))


# --------------------------------------------------------------------------- runs
def test_demo_and_simulate_html_carry_their_json(capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "demo.html"
    argv = ["demo", "--requests", "6", "--max-new-tokens", "4", "--json"]
    code, plain = run(capsys, *argv, "--html", str(out))
    data = json.loads(plain)
    assert code == 0 and data["exact"]
    text = out.read_text()
    assert page_data(text)["requests"] == 6
    assert len(rows(text, "block")) == data["config"]["kv_blocks"]
    out = tmp_path / "sim.html"
    argv = ["simulate", "--seed", "1", "--steps", "15", "--mode", "pd", "--json"]
    code, plain = run(capsys, *argv, "--html", str(out))
    text = out.read_text()
    report = page_data(text)
    assert report["seed"] == 1 and report["ok"] == json.loads(plain)["ok"]
    names = re.findall(r'<section class="timeline-section" data-name="([^"]+)"', text)
    assert names == ["decode worker", "prefill worker"]
    code, plain = run(capsys, "simulate", "--seed", "1", "--mode", "cluster", "--steps", "5",
                      "--html", str(out), "--json")
    assert code == 2 and "--html draws one seed's colocated or pd run" in plain


def test_simulate_traced_replay_marks_faults_preemptions_and_spills():
    pytest.importorskip("torch")
    from atom_core import simulate
    from atom_core.simulate.traced import timelines

    report = simulate.run(0, 40, mode="colocated", preemption=True, host_cache_blocks=2,
                          prefix_cache=True)
    (t,) = timelines(report)
    assert t.name == "colocated batcher" and len(t.slots) == 2
    kinds = Counter(m.kind for m in t.marks)
    assert kinds["fault"] == sum(1 for e in report.events if e.kind not in ("step", "submit"))
    assert kinds["preempt"] and kinds["spill"] and kinds["hit"] and kinds["evict"]
    assert any("[tick " in a for a in t.actions[1:])


def test_viz_imports_neither_torch_nor_z3():
    import subprocess
    import sys

    code = ("import sys, atom_core.viz, atom_core.viz.capacity; "
            "print(sorted(m for m in ('torch', 'z3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


# --------------------------------------------------------------------------- the live page
def test_dashboard_routes_keys_and_counts():
    """The page opens without the key and holds no data; its data needs the key; hits and
    events follow what the batcher did (tests/test_viz_browser.py watches the page itself)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_serve import KEY, MODEL, Server, tiny_config

    from atom_core.serve.dashboard import HEADERS

    with Server(tiny_config()) as srv:
        page = httpx.get(srv.base + "/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert page.headers["content-security-policy"] == HEADERS["Content-Security-Policy"]
        assert "connect-src 'self'" in HEADERS["Content-Security-Policy"]
        assert "src=" not in page.text.replace('href="data:,"', "")  # nothing to fetch
        assert httpx.get(srv.base + "/dashboard/live").status_code == 401
        assert httpx.get(srv.base + "/dashboard?x=1", headers={}).status_code == 200
        assert httpx.post(srv.base + "/dashboard").status_code == 401  # (read-only)
        auth = {"Authorization": f"Bearer {KEY}"}
        c = srv.client()
        system = "the same long system prompt for every request, " * 3
        for i in range(3):  # sequential: each after the first hits the first's entry
            c.completions.create(model=MODEL, prompt=system + f"user {i}", max_tokens=4,
                                 temperature=0)
        srv.wait_at_rest()
        live = httpx.get(srv.base + "/dashboard/live", headers=auth).json()
        state = srv.state()
        assert set(live["hits"]) == {str(e["block"]) for e in state["cache"]}
        assert sum(live["hits"].values()) == sum(
            1 for e in live["events"] if "copied from the entry" in e["text"])
        assert max(live["hits"].values()) >= 2  # the shared prompt's first block, twice
        kinds = [e["kind"] for e in live["events"]]
        assert kinds.count("admit") == 3 and kinds.count("end") == 3
        # each request held ceil((prompt + 4) / 64) blocks, all released at its end
        ends = [e["text"] for e in live["events"] if e["kind"] == "end"]
        n = -(-(len(system) + len("user 0") + 4 - 1) // 64)
        assert all(f"{n} block(s) released" in t for t in ends), ends
        assert live["config"]["kv_blocks"] == srv.cfg.kv_blocks and live["model"] == MODEL
