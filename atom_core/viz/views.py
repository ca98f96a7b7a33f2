"""One page per command, each drawn from the command's own `--json` object (and, for the runs,
the trace records the object summarises), which the page also carries: `check-config --html`
(the stuck run), `check-trace --html`, `demo --html`, `simulate --html`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from atom_core._generated import core
from atom_core.viz.page import esc, page, timeline_section
from atom_core.viz.timeline import Mark, Timeline, replay_steps, timeline_of_trace


def check_config_page(out: dict[str, Any], consts: core.Consts | None) -> str:
    """check-config's verdict; below the minimum, its stuck run replayed through the core
    (`consts`: the sizes the run was found at; None when there is no run) and checked to end
    in the JSON's stuck state."""
    what = f"lanes={out['lanes']}, kv_blocks={out['kv_blocks']}"
    facts: list[tuple[str, Any]] = [
        ("rule", out.get("rule", "")), ("lanes", out["lanes"]),
        ("kv_blocks", out["kv_blocks"]), ("min_kv_blocks", out.get("min_kv_blocks", "")),
        ("blocks per table (T)", out.get("blocks_per_table", ""))]
    title = "atom-core check-config"
    if "error" in out:
        return page(title, f"INVALID: {out['error']}", False, facts, [], out)
    if out["safe"]:
        return page(title, f"SAFE: {what} satisfies '{out['rule']}' (needs "
                           f"{out['min_kv_blocks']}): no stuck run to draw", True, facts, [], out)
    missing = out["min_kv_blocks"] - out["kv_blocks"]
    head = f"UNSAFE: {what} breaks '{out['rule']}': {missing} block(s) missing"
    if not out.get("trace") or consts is None:
        return page(title, head, False, facts,
                    [f'<p class="note">{esc(out.get("note", "no stuck run"))}</p>'], out)
    t = replay_steps(consts, [(s["action"], s["args"]) for s in out["trace"]],
                     name="stuck run")
    want = out["stuck_state"]
    if t.final != {k: want.get(k) for k in t.final}:
        raise ValueError(f"the stuck run replays to {t.final}, not to the reported stuck state "
                         f"{want}")
    violated = out.get("violated")
    stuck = f"progress property '{violated}' fails"
    t = t.with_marks([Mark(t.steps, "stuck", f"state {t.steps}: {stuck}")])
    facts += [("stuck state", f"lanes {want['lanes']}; blocks {want['blocks']}; waiting "
                              f"{list(want['waiting'])}"),
              ("run drawn at", f"prefill chunk {consts.C}, max_seq_len {consts.S} (the shape is "
                               "the same at any size)")]
    sec = timeline_section(t, stuck=stuck, heading="The run into the stuck state")
    return page(title, head, False, facts, [sec], out)


def check_trace_page(name: str, verdict: dict[str, Any],
                     lines: Iterable[str | bytes]) -> str:
    """check-trace's verdict over the trace: every good step drawn; a refused step marked where
    it would have been applied."""
    title = f"atom-core check-trace {name}"
    counts = ", ".join(f"{k} {n}" for k, n in sorted(verdict["counts"].items()))
    facts: list[tuple[str, Any]] = [("steps", verdict["steps"]), ("actions", counts)]
    if verdict["ok"]:
        head = f"OK: {verdict['steps']} steps, every one allowed by the spec"
        t = timeline_of_trace(lines, name=name)
        return page(title, head, True, facts, [timeline_section(t, heading="Blocks over time")],
                    verdict)
    head = f"line {verdict['line']}: {verdict['error']} (after {verdict['steps']} good steps)"
    if verdict["line"] == 1:  # (no constants: nothing to draw)
        return page(title, head, False, facts, [], verdict)
    t = timeline_of_trace(lines, name=name, limit=verdict["steps"])
    bad = f"line {verdict['line']} refused: {verdict['error']}"
    t = t.with_marks([Mark(t.steps, "bad", bad)])
    return page(title, head, False, facts,
                [timeline_section(t, stuck=bad[:200], heading="Blocks over time, up to the "
                                                              "refused step")], verdict)


def demo_page(out: dict[str, Any], trace: Sequence[str]) -> str:
    c = out["config"]
    t = timeline_of_trace(trace, name="demo")
    head = ("token-exact vs oracle: YES, every request equals the oracle's tokens"
            if out["exact"] else f"token-exact vs oracle: NO, requests {out['mismatches']} "
                                 "differ")
    facts = [("runtime", out["runtime"]),
             ("configuration", f"lanes={c['lanes']}, kv_blocks={c['kv_blocks']} ({c['rule']}), "
                               f"max_seq_len={c['max_seq_len']}, "
                               f"prefill_chunk={c['prefill_chunk']}"),
             ("requests", f"{out['requests']} ({out['shared_prefix_requests']} share a system "
                          f"prompt); {out['completed']} completed, {out['errors']} failed"),
             ("prefix-hit tokens", f"{out['prefix_hit_tokens']} ({out['prefill_saved_pct']}% "
                                   "of prompt tokens)"),
             ("generated tokens", out["generated_tokens"])]
    return page("atom-core demo", head, bool(out["exact"]), facts,
                [timeline_section(t, heading="Blocks over time")], out)


def simulate_page(report: dict[str, Any], timelines: Sequence[Timeline]) -> str:
    """A seed's run: one timeline per batcher (colocated: one; PD: decode and prefill), with
    the injected faults and the failures marked."""
    c = report["config"]
    head = "OK: every check held" if report["ok"] else \
        "FAILED: " + "; ".join(report["failures"][:3])
    facts = [("seed", report["seed"]), ("steps", f"{report['steps']} ticks with faults, "
                                                 f"{report['ticks']} with the drain"),
             ("config", ", ".join(f"{k}={v}" for k, v in c.items())),
             ("requests", f"{report['requests']} ({report['completed']} finished, "
                          f"{report['errors']} failed, {report['aborted']} aborted)"),
             ("faults injected", f"{report['faults_injected']} ("
              + (", ".join(f"{k} {n}" for k, n in report["faults_by_kind"].items() if n)
                 or "none") + ")"),
             ("replay", report["replay"])]
    sections = [timeline_section(t, heading=f"{t.name}: blocks over time (ticks in the step "
                                            "tooltips; faults marked)") for t in timelines]
    return page(f"atom-core simulate --seed {report['seed']}", head, bool(report["ok"]), facts,
                sections, report)
