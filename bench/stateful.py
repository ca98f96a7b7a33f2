"""Hypothesis stateful throughput of the core state machine (atom_core.testing.machine).

    .venv/bin/python -m bench.stateful [EXAMPLES] [--steps N] [--no-mirror]

Runs the machine under the `ci` profile's settings (derandomized, no deadline) for EXAMPLES
examples per feature combination (prefix cache on/off x reserved/dynamic scratch) and prints
hypothesis steps (rule executions) per second and core action calls per second. Every step
runs the full checks (invariants, transition invariants, progress, lifecycle model, policy
refinement, and with the mirror a ghost-off replay), so this is the fuzzer's speed, not the
core's.
"""

from __future__ import annotations

import argparse
import sys
import time

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from atom_core._generated import core as committed
from atom_core.testing.lifecycle import FEATURES, Stats
from atom_core.testing.machine import make_machine
from atom_core.testing.strategies import configs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stateful", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("examples", nargs="?", type=int, default=50,
                    help="examples per feature combination (ci profile: 50)")
    ap.add_argument("--steps", type=int, default=50,
                    help="stateful_step_count, rules per example (hypothesis default: 50)")
    ap.add_argument("--no-mirror", action="store_true", help="skip the ghost-off replay")
    opts = ap.parse_args(argv)

    cfg = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                   max_examples=opts.examples, stateful_step_count=opts.steps,
                   suppress_health_check=[HealthCheck.too_slow])
    total_steps = total_calls = 0
    total_time = 0.0
    for prefix, scratch in FEATURES:
        machine = make_machine(config=configs(committed, prefix, scratch),
                               mirror=not opts.no_mirror)
        Stats.reset()
        t0 = time.perf_counter()
        run_state_machine_as_test(machine, settings=cfg)
        dt = time.perf_counter() - t0
        total_steps, total_calls, total_time = (total_steps + Stats.steps,
                                                total_calls + Stats.calls, total_time + dt)
        name = f"{'prefix' if prefix else 'noprefix'}-{scratch}"
        print(f"{name:18s} {Stats.steps:7d} steps {Stats.calls:7d} calls {dt:6.2f} s "
              f"{Stats.steps / dt:8.0f} steps/s {Stats.calls / dt:8.0f} calls/s")
    print(f"{'total':18s} {total_steps:7d} steps {total_calls:7d} calls {total_time:6.2f} s "
          f"{total_steps / total_time:8.0f} steps/s {total_calls / total_time:8.0f} calls/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
