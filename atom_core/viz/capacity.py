"""`min-blocks --html`: the capacity table as a picture. The fewest KV blocks per feature
combination against the lane count B, read from the committed table
(atom_core/_generated/capacity.py, through `config.min_kv_blocks`: what min-blocks and Config
use), with the cells `atom-core verify` proves told apart from those that follow the rule
beyond the proved sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from atom_core._generated import capacity
from atom_core.config import SCRATCH_MODES, min_kv_blocks
from atom_core.viz.page import esc, page

# The table sizes T the proofs check (proofs/capacity.py's COMBINATIONS; a test keeps these in
# step): lanes * T up to PROVED_LANES without preemption, every B up to it with preemption.
PROVED_TABLES = (1, 2)
PROVED_TABLES_PREEMPT = (2, 3)
# B drawn: 1 to at least this, and to the artifact's lanes up to MAX_DRAWN (beyond, its own
# column at the end).
MIN_DRAWN, MAX_DRAWN = 8, 32
SERIES_COLOURS = ("#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#9c755f",
                  "#76b7b2", "#d4a017")


@attrs.frozen
class Combination:
    prefix_cache: bool
    scratch: str
    preemption: bool

    @property
    def name(self) -> str:
        return (f"{'prefix cache' if self.prefix_cache else 'no prefix cache'}, {self.scratch} "
                f"scratch" + (", preemption" if self.preemption else ""))


def proved(b: int, tables: int, preemption: bool) -> bool:
    """Whether `atom-core verify` proves the minimum at B = b (sufficient and tight) for this
    T: the sizes its capacity proofs run (see PROVED_TABLES)."""
    if preemption:
        return tables in PROVED_TABLES_PREEMPT and b <= capacity.PROVED_LANES
    return tables in PROVED_TABLES and b * tables <= capacity.PROVED_LANES


def combinations(tables: int) -> list[Combination]:
    """Every feature combination at this T (preemption needs T > 1)."""
    return [Combination(p, s, pre) for pre in ((False, True) if tables > 1 else (False,))
            for p in (False, True) for s in SCRATCH_MODES]


def lanes_drawn(lanes: int) -> list[int]:
    top = max(MIN_DRAWN, min(lanes, MAX_DRAWN))
    return list(range(1, top + 1)) + ([lanes] if lanes > top else [])


def capacity_page(out: dict[str, Any], prefix_cache: bool, scratch: str,
                  preemption: bool) -> str:
    """The page of min-blocks' JSON `out` (its lanes, blocks_per_table and min_kv_blocks) for
    the artifact's own features; every combination drawn, the artifact's cell ringed."""
    t, lanes = out["blocks_per_table"], out["lanes"]
    spec_min = out.get("spec_min_kv_blocks", out["min_kv_blocks"])
    mine = Combination(prefix_cache, scratch, preemption)
    table_min = min_kv_blocks(lanes, prefix_cache, scratch, t, preemption)
    if table_min != spec_min:  # (the picture would disagree with the data)
        raise ValueError(f"the table gives {table_min} for this artifact, min-blocks said "
                         f"{spec_min}")
    bs = lanes_drawn(lanes)
    combos = combinations(t)
    cells = {(c, b): min_kv_blocks(b, c.prefix_cache, c.scratch, t, c.preemption)
             for c in combos for b in bs}
    raised = out["min_kv_blocks"] - spec_min
    head = (f"lanes={lanes}, {mine.name}, T = {t}: kv_blocks >= {out['min_kv_blocks']}"
            + (f" (optimum-rbln 0.12.0 compiles no fewer; the spec needs {spec_min})"
               if raised else ""))
    facts = [("rule", out["rule"]),
             ("proved", f"B * T <= {capacity.PROVED_LANES} for T in {PROVED_TABLES}; with "
                        f"preemption B <= {capacity.PROVED_LANES} for T in "
                        f"{PROVED_TABLES_PREEMPT} (`atom-core verify`: sufficient, and tight: "
                        "a stuck run one block below)")]
    chart = _chart(combos, bs, cells, t, mine, lanes)
    table = _table(combos, bs, cells, t, mine, lanes)
    note = ('<p class="note">Filled points and solid cells: proved minimums. Hollow points and '
            'hatched cells: the same rule beyond the proved sizes (it is linear in B, so it '
            'extends; `atom-core verify --max-lanes N` proves further). Combinations whose '
            'numbers coincide share one line.</p>')
    return page("atom-core min-blocks", head, None, facts,
                [f"<h2>Fewest KV blocks against the lane count B, T = {t}</h2>", note, chart,
                 table], out)


def _chart(combos: Sequence[Combination], bs: list[int], cells: dict[Any, int], t: int,
           mine: Combination, lanes: int) -> str:
    w, h, left, bottom, top, right = 820, 340, 56, 40, 16, 350
    top_k = max(cells.values())
    xs = {b: left + (i + 0.5) * (w - left - right) / len(bs) for i, b in enumerate(bs)}

    def y(k: int) -> float:
        return h - bottom - k * (h - bottom - top) / top_k

    # series with the same numbers are one line (the prefix cache costs no block)
    series: dict[tuple[int, ...], list[Combination]] = {}
    for c in combos:
        series.setdefault(tuple(cells[(c, b)] for b in bs), []).append(c)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="capacity-chart" width="{w}" '
           f'height="{h}" viewBox="0 0 {w} {h}">',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" '
           'stroke="#5b6472"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#5b6472"/>']
    for k in range(0, top_k + 1, max(1, top_k // 8)):
        out.append(f'<text class="ruler" x="{left - 6}" y="{y(k) + 3:.1f}" '
                   f'text-anchor="end">{k}</text><line x1="{left}" x2="{w - right}" '
                   f'y1="{y(k):.1f}" y2="{y(k):.1f}" stroke="#0001"/>')
    for b in bs:
        out.append(f'<text class="ruler" x="{xs[b]:.1f}" y="{h - bottom + 14}" '
                   f'text-anchor="middle">{b}</text>')
    out.append(f'<text class="rowlabel" x="{(left + w - right) / 2}" y="{h - 6}" '
               'text-anchor="middle">lanes B</text>')
    out.append(f'<text class="rowlabel" x="12" y="{top + 4}" transform="rotate(-90 12 '
               f'{(top + h - bottom) / 2})" text-anchor="end">min kv_blocks</text>')
    for i, (values, group) in enumerate(series.items()):
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        pts = " ".join(f"{xs[b]:.1f},{y(k):.1f}" for b, k in zip(bs, values, strict=True))
        out.append(f'<g class="series" data-name="{esc(" | ".join(c.name for c in group))}">'
                   f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for b, k in zip(bs, values, strict=True):
            solid = proved(b, t, group[0].preemption)
            out.append(f'<circle class="point {"proved" if solid else "extrapolated"}" '
                       f'cx="{xs[b]:.1f}" cy="{y(k):.1f}" r="4" stroke="{colour}" '
                       f'stroke-width="2" fill="{colour if solid else "#fff"}"><title>'
                       f'{esc(", ".join(c.name for c in group))}: B={b}: kv_blocks >= {k} '
                       f'({"proved" if solid else "the rule beyond the proved sizes"})'
                       '</title></circle>')
        ly = top + 8 + i * 38
        out.append(f'<line x1="{w - right + 14}" x2="{w - right + 34}" y1="{ly}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="3"/>')
        names = [c.name for c in group]
        if len(names) > 2:  # (two lines at most: the tooltips and the table name them all)
            names = [names[0], f"and {len(names) - 1} more with the same numbers"]
        for j, name in enumerate(names):
            out.append(f'<text class="rowlabel" x="{w - right + 40}" y="{ly + 4 + j * 13}">'
                       f'{esc(name)}</text>')
        out.append("</g>")
    if lanes in xs:
        k = cells[(mine, lanes)]
        out.append(f'<g class="artifact"><circle cx="{xs[lanes]:.1f}" cy="{y(k):.1f}" r="9" '
                   f'fill="none" stroke="#d00000" stroke-width="2"/><text class="stuck-text" '
                   f'x="{xs[lanes] + 12:.1f}" y="{y(k) - 10:.1f}">this artifact: {k}</text></g>')
    out.append("</svg>")
    return '<div class="scroll">' + "".join(out) + "</div>"


def _table(combos: Sequence[Combination], bs: list[int], cells: dict[Any, int], t: int,
           mine: Combination, lanes: int) -> str:
    top_k = max(cells.values())
    head = "".join(f"<th>B={b}</th>" for b in bs)
    rows = []
    for c in combos:
        tds = []
        for b in bs:
            k = cells[(c, b)]
            solid = proved(b, t, c.preemption)
            here = c == mine and b == lanes
            shade = 0.15 + 0.6 * k / top_k
            tds.append(f'<td class="cell {"proved" if solid else "extrapolated"}'
                       f'{" artifact" if here else ""}" data-b="{b}" data-k="{k}" '
                       f'style="--v:{shade:.2f}" title="{esc(c.name)}, B={b}: kv_blocks >= {k} '
                       f'({"proved" if solid else "beyond the proved sizes"})">{k}</td>')
        rows.append(f'<tr data-name="{esc(c.name)}"><th class="name">{esc(c.name)}</th>'
                    + "".join(tds) + "</tr>")
    style = ("<style>table.capacity{border-collapse:collapse;margin-top:12px;font-size:13px}"
             "table.capacity th,table.capacity td{border:1px solid #d8dde3;padding:3px 7px;"
             "text-align:center}table.capacity th.name{text-align:left;font-weight:500}"
             "td.proved{background:rgba(78,121,167,var(--v));font-weight:700}"
             "td.extrapolated{font-style:italic;color:#5b6472;background:repeating-linear-"
             "gradient(45deg,#fff 0 4px,#eef1f5 4px 8px)}"
             "td.artifact{outline:3px solid #d00000;outline-offset:-3px}</style>")
    return (style + '<table class="capacity"><tr><th class="name">features \\ lanes</th>'
            + head + "</tr>" + "".join(rows) + "</table>")
