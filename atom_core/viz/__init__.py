"""Pictures of runs: standalone HTML pages (inline SVG, nothing fetched) drawn from the commands'
own JSON and trace records, so that a picture and its data never disagree.

    timeline  a run's records applied to the generated core again: each block's, host slot's
              and lane's owner after every step, and the marks (admissions, hits, evictions,
              spills, preemptions, failures)
    page      the SVG of a timeline (blocks x steps; long runs downsampled) and the page shell
    views     one page per command: check-config (the stuck run), check-trace, demo, simulate
    capacity  min-blocks: the capacity table against the lane count, proved cells marked

Stdlib, attrs and the generated core only: no torch, no z3."""

from __future__ import annotations

from atom_core.viz.capacity import capacity_page
from atom_core.viz.timeline import Mark, Timeline, replay_steps, timeline_of_trace
from atom_core.viz.views import check_config_page, check_trace_page, demo_page, simulate_page

__all__ = ["Mark", "Timeline", "capacity_page", "check_config_page", "check_trace_page",
           "demo_page", "replay_steps", "simulate_page", "timeline_of_trace", "write_page"]


def write_page(path: str, text: str) -> None:
    """Write a page (UTF-8) to `path`."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
