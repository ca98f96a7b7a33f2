"""`make generate`'s proof half: the capacity table and the witnesses that certify it tight.

Writes atom_core/_generated/capacity.py (from the progress proofs) and
atom_core/_generated/witnesses.py (every stuck run searched afresh, each replayed in z3 before
it is written). This is the one way to refresh the witnesses, e.g. after a change to the spec;
`atom-core verify` then replays them.
"""

from __future__ import annotations

import argparse
import pathlib

from atom_core.proofs.run import MAX_BLOCKS, MAX_LANES, default_jobs, generate

GENERATED = pathlib.Path(__file__).resolve().parent.parent / "atom_core" / "_generated"


def main(argv: list[str] | None = None) -> int:
    from atom_core.spec.model import MODEL

    ap = argparse.ArgumentParser(description="prove the capacity rules; write the table and "
                                             "the stuck runs that certify them tight")
    ap.add_argument("--capacity", type=pathlib.Path, default=GENERATED / "capacity.py")
    ap.add_argument("--witnesses", type=pathlib.Path, default=GENERATED / "witnesses.py")
    ap.add_argument("-j", "--jobs", type=int, default=default_jobs())
    args = ap.parse_args(argv)
    cap, wit = generate(MODEL, MAX_LANES, MAX_BLOCKS, args.jobs)
    args.capacity.write_text(cap)
    args.witnesses.write_text(wit)
    print(f"wrote {args.capacity} and {args.witnesses}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
