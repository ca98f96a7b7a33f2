"""Standalone HTML pages: inline SVG and CSS, no script, nothing fetched (a page opens offline
and can be attached to a bug report). `timeline_svg` draws a `Timeline`: blocks as rows, states
as columns, each cell coloured by its owner; lanes (with their request ids) and marks above.

Long runs are downsampled: past MAX_COLUMNS states, each column stands for several consecutive
steps and shows the state after the last of them, while its marks and its tooltip cover every
step in it (the page says so); the picture also scrolls sideways."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from atom_core.viz.timeline import MARK_KINDS, MARK_NAMES, Mark, Timeline

# At most this many columns; a longer run is downsampled to fit (see the module docstring).
MAX_COLUMNS = 1000
# Lane colours (cycled past ten lanes); the other owners have their own (`CSS`).
LANE_COLOURS = ("#e15759", "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#9c755f", "#d4a017",
                "#ff9da7", "#76b7b2", "#8c6d31")
LABEL_WIDTH = 150  # the row labels' column, px
TOOLTIP_MARKS = 4  # marks listed in one glyph's tooltip before "+N more"
STEP_LIST = 40  # runs up to this many steps also list them as text
ALARMS = frozenset(("fail", "fault", "check", "stuck", "bad"))  # marks said in red

# Owners: (CSS class, colour, legend text). Lanes are `lane{n % 10}`.
OWNERS = {
    "free": ("free", "#eceff3", "free"),
    "scratch": ("scratch", "#8a939e", "scratch (padding rows)"),
    "cache": ("cache", "#1b7f79", "prefix-cache entry"),
    "pinned": ("pinned", "#f2c14e", "pinned: a copy reads this entry"),
    "transfer": ("transfer", "#6a4c93", "in a PD transfer"),
    "draining": ("draining", "#a78bcc", "draining (its transfer still reads it)"),
    "spilling": ("spilling", "#c2185b", "spilling to a host slot"),
    "host-empty": ("free", "#eceff3", "host slot: empty"),
    "host-stored": ("host", "#8ecae6", "host slot: holds an entry"),
    "host-storing": ("hostbusy", "#cfe8f3", "host slot: store or load in flight"),
    "host-loading": ("hostbusy", "#cfe8f3", "host slot: store or load in flight"),
}
MARK_GLYPH = {"admit": ("#2e7d32", "▲"), "hit": ("#1b7f79", "●"), "evict": ("#c62828", "✕"),
              "spill": ("#c2185b", "▼"), "preempt": ("#6a1b9a", "◆"), "fail": ("#b71c1c", "!"),
              "fault": ("#e65100", "⚡"), "check": ("#d00000", "✖"), "stuck": ("#d00000", "■"),
              "bad": ("#d00000", "■")}

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"DejaVu Sans",sans-serif;margin:20px;color:#1d2330}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}
.headline{font-size:15px;margin:4px 0 10px}.bad{color:#b00020;font-weight:600}
.good{color:#2e7d32;font-weight:600}
table.facts{border-collapse:collapse;margin:6px 0}
table.facts td{padding:1px 10px 1px 0;vertical-align:top}table.facts td:first-child{color:#5b6472}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin:8px 0;font-size:12.5px}
.legend span.sw{display:inline-block;width:12px;height:12px;margin-right:4px;
vertical-align:-2px;border:1px solid #0002}
.scroll{overflow-x:auto;border:1px solid #d8dde3;padding:6px;background:#fff}
.note{color:#5b6472;font-size:12.5px;margin:4px 0}
details{margin-top:14px}pre{background:#f6f8fa;padding:8px;overflow-x:auto;font-size:12px}
svg text{font-family:"DejaVu Sans Mono",monospace}
.free{fill:#eceff3}.scratch{fill:#8a939e}.cache{fill:#1b7f79}.pinned{fill:#f2c14e}
.transfer{fill:#6a4c93}.draining{fill:#a78bcc}.spilling{fill:#c2185b}.host{fill:#8ecae6}
.hostbusy{fill:#cfe8f3}.prefill{fill-opacity:.55}.act{fill:#c9d1db}.act:hover{fill:#7b8794}
.rowlabel{font-size:11px;fill:#3b4350}.cell-label{font-size:10px;fill:#fff;pointer-events:none}
.ruler{font-size:10px;fill:#5b6472}.stuck-line{fill:#d0000022;stroke:#d00000;stroke-width:2}
.stuck-text{font-size:12px;fill:#d00000;font-weight:700}
ul.steps{list-style:none;padding:0;margin:8px 0;font:12.5px "DejaVu Sans Mono",monospace}
.mark-note{color:#2e7d32}
""" + "".join(f".lane{i}{{fill:{c}}}" for i, c in enumerate(LANE_COLOURS))


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


@attrs.frozen
class Columns:
    """How states map to columns: column j shows state `last[j]` and stands for the states
    `first[j]..last[j]` (one each unless downsampled)."""

    first: tuple[int, ...]
    last: tuple[int, ...]

    @classmethod
    def of(cls, states: int, limit: int = MAX_COLUMNS) -> Columns:
        per = max(1, -(-states // limit))
        starts = range(0, states, per)
        return cls(tuple(starts), tuple(min(s + per, states) - 1 for s in starts))

    @property
    def per(self) -> int:
        return self.last[0] - self.first[0] + 1 if self.first else 1

    def column_of(self, state: int) -> int:
        return min(state // self.per, len(self.first) - 1)


def _owner_class(key: str) -> tuple[str, str, str]:
    """(CSS class, tooltip text, cell label) of a block or slot owner key."""
    if key.startswith("lane:"):
        _, ln, r = key.split(":")
        return f"lane{int(ln) % len(LANE_COLOURS)}", f"lane {ln} (request r{r})", f"r{r}"
    if key.startswith("transfer:"):
        return "transfer", f"in request r{key.split(':')[1]}'s PD transfer", ""
    cls, _colour, text = OWNERS.get(key, ("free", "", key))
    return cls, text, ""


def _segments(row: Sequence[str], cols: Columns) -> Iterable[tuple[int, int, str]]:
    """(first column, last column, value) runs of equal values along a row."""
    start, value = 0, row[cols.last[0]]
    for j in range(1, len(cols.last)):
        v = row[cols.last[j]]
        if v != value:
            yield start, j - 1, value
            start, value = j, v
    yield start, len(cols.last) - 1, value


def _steps_text(cols: Columns, a: int, b: int) -> str:
    lo, hi = cols.first[a], cols.last[b]
    return f"state {lo}" if lo == hi else f"states {lo}-{hi}"


def timeline_svg(t: Timeline, stuck: str | None = None) -> tuple[str, Columns]:
    """The SVG of `t` and its columns. `stuck`: the text of the stuck point, drawn over the
    last column (check-config's stuck state)."""
    cols = Columns.of(len(t.actions))
    n = len(cols.last)
    cw = max(2, min(40, 1080 // n))  # (a short run fits a laptop screen without scrolling)
    rows = len(t.blocks) + len(t.slots) + len(t.lanes)
    rh = 18 if rows <= 40 else 11 if rows <= 120 else 5
    kinds = [k for k in MARK_KINDS if any(m.kind == k for m in t.marks)]
    mh = 14  # a marks row
    top = 34 + (16 if stuck else 0)  # ruler and the action strip (and the stuck label)
    y_marks = top
    y_lanes = y_marks + mh * len(kinds) + (6 if kinds else 0)
    y_blocks = y_lanes + rh * len(t.lanes) + 8
    y_slots = y_blocks + rh * len(t.blocks) + (8 if t.slots else 0)
    height = y_slots + rh * len(t.slots) + 6
    width = LABEL_WIDTH + cw * n + 30  # (room for the last state number)
    label = f"stuck at state {t.steps} (red column): {stuck}" if stuck else ""
    width = max(width, LABEL_WIDTH + 8 * len(label) + 10)  # (the label never cut off)
    x0 = LABEL_WIDTH
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" data-steps="{t.steps}" '
           f'data-columns="{n}" data-per-column="{cols.per}">']
    # the ruler: a state number every ~60 px
    every = max(1, -(-60 // cw))
    for j in range(0, n, every):
        out.append(f'<text class="ruler" x="{x0 + j * cw}" y="{top - 22}">{cols.last[j]}</text>')
    out.append(f'<text class="rowlabel" x="4" y="{top - 22}">state</text>')
    out.append(f'<text class="rowlabel" x="4" y="{top - 6}">step (hover)</text>')
    out.append('<g class="actions">')
    for j in range(n):
        lo, hi = cols.first[j], cols.last[j]
        acts = t.actions[lo:hi + 1]
        text = "\n".join(acts[:TOOLTIP_MARKS]) + (
            f"\n... +{len(acts) - TOOLTIP_MARKS} more" if len(acts) > TOOLTIP_MARKS else "")
        out.append(f'<rect class="act" x="{x0 + j * cw}" y="{top - 14}" width="{max(1, cw - 1)}"'
                   f' height="10" data-column="{j}"><title>{esc(text)}</title></rect>')
    out.append("</g>")
    out += _marks(t.marks, kinds, cols, x0, cw, y_marks, mh)
    out += _rows("lane", t.lanes, cols, x0, cw, rh, y_lanes, _lane_cell)
    out += _rows("block", t.blocks, cols, x0, cw, rh, y_blocks, _block_cell)
    out += _rows("slot", t.slots, cols, x0, cw, rh, y_slots, _block_cell, label="host slot")
    if stuck is not None:
        x = x0 + (n - 1) * cw
        out.append(f'<g class="stuck-marker" data-state="{t.steps}">'
                   f'<rect class="stuck-line" x="{x - 1}" y="{top - 16}" width="{cw + 2}" '
                   f'height="{height - top + 14}"><title>{esc(stuck)}</title></rect>'
                   f'<text class="stuck-text" x="{x0}" y="13">{esc(label)}</text></g>')
    out.append("</svg>")
    return "".join(out), cols


def _lane_cell(key: str, ln: int) -> tuple[str, str, str]:
    if not key:
        return "free", f"lane {ln}: idle", ""
    r, phase = key.split(":")
    cls = f"lane{ln % len(LANE_COLOURS)}" + (" prefill" if phase == "prefill" else "")
    return cls, f"lane {ln}: request r{r} ({phase})", f"r{r}"


def _block_cell(key: str, _row: int) -> tuple[str, str, str]:
    return _owner_class(key)


def _rows(kind: str, rows: Sequence[Sequence[str]], cols: Columns, x0: int, cw: int, rh: int,
          y0: int, cell: Any, label: str | None = None) -> list[str]:
    out = []
    for i, row in enumerate(rows):
        y = y0 + i * rh
        out.append(f'<g class="row {kind}" data-{kind}="{i}">')
        if rh >= 8:
            out.append(f'<text class="rowlabel" x="4" y="{y + rh - 5}">{label or kind} {i}'
                       '</text>')
        for a, b, value in _segments(row, cols):
            cls, text, tag = cell(value, i)
            x, w = x0 + a * cw, (b - a + 1) * cw
            out.append(f'<rect class="{cls}" x="{x}" y="{y}" width="{w}" height="{rh - 1}">'
                       f'<title>{esc(f"{label or kind} {i}: {text}, {_steps_text(cols, a, b)}")}'
                       '</title></rect>')
            if tag and rh >= 14 and w >= 8 * len(tag) + 4:
                out.append(f'<text class="cell-label" x="{x + 3}" y="{y + rh - 5}">{esc(tag)}'
                           '</text>')
        out.append("</g>")
    return out


def _marks(marks: Sequence[Mark], kinds: list[str], cols: Columns, x0: int, cw: int,
           y0: int, mh: int) -> list[str]:
    by: dict[tuple[str, int], list[str]] = defaultdict(list)
    for m in marks:
        by[(m.kind, cols.column_of(m.step))].append(m.text)
    out = []
    for i, kind in enumerate(kinds):
        y = y0 + i * mh
        colour, glyph = MARK_GLYPH[kind]
        out.append(f'<g class="marks" data-kind="{kind}">'
                   f'<text class="rowlabel" x="4" y="{y + mh - 3}">{MARK_NAMES[kind]}</text>')
        size = min(12, max(9, cw))
        for (k, j), texts in sorted(by.items(), key=lambda kv: kv[0][1]):
            if k != kind:
                continue
            tip = "\n".join(texts[:TOOLTIP_MARKS]) + (
                f"\n... +{len(texts) - TOOLTIP_MARKS} more" if len(texts) > TOOLTIP_MARKS else "")
            out.append(f'<text class="mark" data-column="{j}" x="{x0 + j * cw + cw / 2:.1f}" '
                       f'y="{y + mh - 3}" text-anchor="middle" font-size="{size}" '
                       f'fill="{colour}">{glyph}<title>{esc(tip)}</title></text>')
        out.append("</g>")
    return out


def legend(t: Timeline) -> str:
    """Swatches for the owners, lanes and marks this timeline shows."""
    present = {key.split(":")[0] for row in (*t.blocks, *t.slots) for key in set(row)}
    seen: dict[str, str] = {}  # legend text -> colour, in OWNERS' order
    for key, (_cls, colour, text) in OWNERS.items():
        if key in present:
            seen.setdefault(text, colour)
    items = [f'<span><span class="sw" style="background:{c}"></span>{esc(x)}</span>'
             for x, c in seen.items()]
    items += [f'<span><span class="sw" style="background:{LANE_COLOURS[ln % len(LANE_COLOURS)]}">'
              f'</span>lane {ln} (paler: prefilling)</span>' for ln in range(len(t.lanes))]
    kinds = [k for k in MARK_KINDS if any(m.kind == k for m in t.marks)]
    items += [f'<span style="color:{MARK_GLYPH[k][0]}">{MARK_GLYPH[k][1]} {MARK_NAMES[k]}</span>'
              for k in kinds]
    return '<div class="legend">' + "".join(items) + "</div>"


def timeline_section(t: Timeline, stuck: str | None = None, heading: str | None = None) -> str:
    """A timeline with its heading, legend and the note on how it was drawn."""
    svg, cols = timeline_svg(t, stuck)
    c = t.consts
    size = (f"{c['B']} lanes, {c['K']} KV blocks" + (f", {c['H']} host slots" if c.get("H")
                                                    else "") + f", T = {c.get('T', 1)}")
    how = (f"{t.steps:,} steps: one column per state (scroll sideways for more)"
           if cols.per == 1 else
           f"{t.steps:,} steps, downsampled to {len(cols.last):,} columns of {cols.per} states "
           "each: a column shows the state after its last step, and its marks and tooltip cover "
           "every step in it (scroll sideways for more)")
    return (f'<section class="timeline-section" data-name="{esc(t.name)}">'
            + (f"<h2>{esc(heading)}</h2>" if heading else "")
            + f'<p class="note">{esc(size)}. Rows: lanes (their requests), then one per KV '
              f'block{", then one per host slot" if t.slots else ""}; columns: states after '
              f'each step (hover for the step). <span class="how">{esc(how)}</span></p>'
            + legend(t) + f'<div class="scroll">{svg}</div>' + _step_list(t) + "</section>")


def _step_list(t: Timeline) -> str:
    """A short run's steps as text under the picture (what hovering shows, readable at once),
    each with its marks."""
    if t.steps > STEP_LIST:
        return ""
    marks: dict[int, list[Mark]] = defaultdict(list)
    for m in t.marks:
        marks[m.step].append(m)

    def note(ms: list[Mark]) -> str:
        if not ms:
            return ""
        alarm = any(m.kind in ALARMS for m in ms)
        text = "; ".join(m.text.split(": ", 1)[-1] for m in ms)
        return f' <span class="{"bad" if alarm else "mark-note"}">&larr; {esc(text)}</span>'

    items = "".join(f'<li data-step="{i}">{esc(a)}{note(marks[i])}</li>'
                    for i, a in enumerate(t.actions) if i)
    return f'<ul class="steps">{items}</ul>' if items else ""


def page(title: str, headline: str, ok: bool | None, facts: Sequence[tuple[str, Any]],
         sections: Sequence[str], data: Any, data_name: str = "the --json output") -> str:
    """A whole page: title, the verdict line, facts, the sections, and the data the picture
    was drawn from (folded), so that one file carries both."""
    cls = "" if ok is None else "good" if ok else "bad"
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in facts)
    body = json.dumps(data, indent=1, sort_keys=False, default=str)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><meta name=\"viewport\" content=\"width=device-width\">"
            f"<style>{CSS}</style></head><body><h1>{esc(title)}</h1>"
            f'<p class="headline {cls}">{esc(headline)}</p>'
            + (f'<table class="facts">{rows}</table>' if rows else "")
            + "".join(sections)
            + f"<details><summary>{esc(data_name)}</summary><pre id=\"data\">{esc(body)}</pre>"
              "</details></body></html>\n")
