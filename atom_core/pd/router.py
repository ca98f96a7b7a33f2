"""The cluster's router: which decode worker and which prefill worker serve a request.

Workers report their `Load` (ready or not, queue depth, free lanes, free KV blocks); a worker
that never reported ready, or was reported lost, is never chosen. For each request the router
asks its policy to pick one of the ready workers of each role, and remembers, per worker, a hash
of each block-aligned prefix of the prompts it sent there (`prefix_unit` tokens per step: the
granularity at which a prefix cache hits): that worker's prefix cache is likely to hold them.
Affinity applies to the roles in `affinity`, by default the prefill workers only: a decode
worker imports a prompt's KV into fresh blocks, so its prefix cache does not serve the next
prompt with that prefix, and the decode worker is chosen by load alone.

Default policy (`LeastLoaded`): prefix affinity first, load second. Among ready workers, the
one holding the longest remembered prefix of the prompt wins, unless its queue is more than
`slack` requests longer than the least loaded one's (then affinity would only queue the request
behind others); otherwise the least loaded: the shortest queue, then the most free lanes, then
the most free blocks, then the lowest worker id (deterministic). A policy is anything with
`choose(candidates, holders) -> worker id` (`Policy`); write your own for other trade-offs.

Between two reports the router counts what it assigned itself (`Load.queued` + 1 per
assignment), so a burst of requests spreads over the workers instead of all going to the one
that was least loaded at the last report. A worker's next report replaces that count (a worker
reports after taking requests); an assignment whose request ended before the worker's next
report (it never reached the worker: refused, aborted, its decode worker lost or it asked
another prefill worker) is taken back (`release`), so no count stays inflated.

A ready worker that a peer reports as not answering (a decode node took a prefill worker for
hung) is set aside (`avoid`): not chosen, and not among the `usable` ones the frontend names
to the decode nodes, until no peer reports it any more. It stays `ready` (it reported so and
was not lost): being set aside is the reporters' view, undone by their next report.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from atom_core._generated import core

__all__ = ["Assignment", "LeastLoaded", "Load", "Policy", "Router", "load_of"]

ROLES = ("prefill", "decode")
# Prefix hashes remembered per worker (oldest forgotten first): bounded memory whatever the
# traffic; a forgotten prefix only costs an affinity miss.
DEFAULT_REMEMBER = 4096
# Prefix steps hashed per prompt: the cost per request stays bounded for long prompts.
MAX_PREFIX_STEPS = 16


@attrs.define
class Load:
    """What a worker reports about itself."""

    ready: bool = False
    queued: int = 0  # requests it holds that have no lane yet
    free_lanes: int = 0
    free_blocks: int = 0  # free blocks plus cache entries it could evict

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> Load:
        """A load from a worker's report; ValueError if it is not one (a report comes from the
        wire: it is checked, never trusted blindly)."""
        if not isinstance(obj, dict) or set(obj) != {"ready", "queued", "free_lanes",
                                                      "free_blocks"}:
            raise ValueError(f"a load report has ready, queued, free_lanes and free_blocks, "
                             f"got {obj!r}"[:200])
        vals = [obj["queued"], obj["free_lanes"], obj["free_blocks"]]
        if not isinstance(obj["ready"], bool) or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 31
                for v in vals):
            raise ValueError(f"bad load report values {obj!r}"[:200])
        return cls(obj["ready"], *vals)


def load_of(batcher: Any, held: int = 0, ready: bool = True) -> Load:
    """A batcher's load: its waiting queue (plus `held` requests the worker keeps outside the
    batcher), its idle lanes, and its blocks that are free or only cached."""
    s = batcher.view
    free = sum(1 for o in s.owner if o in (core.OWNER_FREE, core.OWNER_CACHE))
    return Load(ready, len(batcher.waiting) + held, sum(1 for b in s.busy if not b), free)


@attrs.frozen
class Assignment:
    decode: int
    prefill: int | None  # None: no prefill worker is ready; the decode worker prefills locally


class Policy(Protocol):
    def choose(self, candidates: Mapping[int, Load], holders: Mapping[int, int]) -> int:
        """One of `candidates` (ready workers, never empty). `holders`: worker -> how many
        prefix steps of this prompt it was sent before (absent: none)."""
        ...


@attrs.define
class LeastLoaded:
    """The default policy (see the module docstring)."""

    slack: int = 2

    def choose(self, candidates: Mapping[int, Load], holders: Mapping[int, int]) -> int:
        def key(w: int) -> tuple[int, int, int, int]:
            ld = candidates[w]
            return ld.queued, -ld.free_lanes, -ld.free_blocks, w

        best = min(candidates, key=key)
        hit = [w for w in holders if w in candidates]
        if hit:
            w = max(hit, key=lambda w: (holders[w], -w))
            if candidates[w].queued <= candidates[best].queued + self.slack:
                return w
        return best


class Router:
    """Assigns requests to workers (see the module docstring). `prefix_unit`: tokens per prefix
    step (a config's `prefill_chunk` with one block per table, else its `block_size`)."""

    def __init__(self, prefix_unit: int, policy: Policy | None = None, *,
                 remember: int = DEFAULT_REMEMBER,
                 affinity: tuple[str, ...] = ("prefill",)) -> None:
        if isinstance(prefix_unit, bool) or not isinstance(prefix_unit, int) or prefix_unit < 1:
            raise ValueError(f"prefix_unit must be a positive integer, got {prefix_unit!r}")
        self.prefix_unit = prefix_unit
        self.policy: Policy = policy or LeastLoaded()
        self.remember = remember
        for role in affinity:
            self._check(role)
        self.affinity = frozenset(affinity)
        self.loads: dict[str, dict[int, Load]] = {r: {} for r in ROLES}
        self.lost: dict[str, set[int]] = {r: set() for r in ROLES}
        # role -> worker -> prefix hash -> steps (an LRU: most recent last)
        self._seen: dict[str, dict[int, OrderedDict[bytes, int]]] = {r: {} for r in ROLES}
        self.affinity_hits = {r: 0 for r in ROLES}  # choices of a worker holding a prefix
        self.reports: dict[str, dict[int, int]] = {r: {} for r in ROLES}  # reports received
        # workers a peer reports as not answering: never chosen while reported (`avoid`)
        self.avoided: dict[str, frozenset[int]] = {r: frozenset() for r in ROLES}

    # ------------------------------------------------------------------ reports
    def report(self, role: str, worker: int, load: Load) -> None:
        """`worker`'s current load. A ready report of a worker reported lost is a restart: it
        is used again, and what it was sent before is forgotten (its caches are new)."""
        self._check(role)
        if worker in self.lost[role]:
            if not load.ready:
                return  # a lost worker's late report (it is gone until it reports ready)
            self.lost[role].discard(worker)
            self._seen[role].pop(worker, None)
        self.loads[role][worker] = load
        self.reports[role][worker] = self.reports[role].get(worker, 0) + 1

    def release(self, role: str, worker: int, since: int) -> None:
        """A request assigned to `worker` when it had sent `since` reports (`reports`) ended:
        if it has sent none since, the assignment is still in its count: taken back."""
        ld = self.loads[role].get(worker)
        if ld is not None and self.reports[role].get(worker, 0) == since and ld.queued > 0:
            ld.queued -= 1

    def mark_lost(self, role: str, worker: int) -> None:
        """`worker` is gone: never chosen until it reports ready again."""
        self._check(role)
        self.lost[role].add(worker)
        self.loads[role].pop(worker, None)
        self._seen[role].pop(worker, None)

    def ready(self, role: str) -> list[int]:
        self._check(role)
        return sorted(w for w, ld in self.loads[role].items() if ld.ready)

    def avoid(self, role: str, workers: frozenset[int]) -> None:
        """The workers of `role` that some peer now reports as not answering (replacing the
        previous set): none of them is chosen until a later call leaves it out."""
        self._check(role)
        self.avoided[role] = frozenset(workers)

    def usable(self, role: str) -> list[int]:
        """The ready workers that may be chosen: ready, and not reported as not answering."""
        return [w for w in self.ready(role) if w not in self.avoided[role]]

    # ------------------------------------------------------------------ choices
    def assign(self, prompt: Sequence[int]) -> Assignment:
        """A decode worker and a prefill worker for `prompt`; RuntimeError when no decode worker
        is ready (the caller fails or holds the request)."""
        keys = self.prefix_keys(prompt)
        d = self.pick("decode", keys)
        if d is None:
            raise RuntimeError("no decode worker is ready: start one (or wait for one to "
                               "report ready) before submitting requests")
        return Assignment(d, self.pick("prefill", keys))

    def pick(self, role: str, keys: Sequence[bytes], exclude: frozenset[int] = frozenset()
             ) -> int | None:
        """A ready worker of `role` for a prompt with these `prefix_keys`, or None; counts the
        assignment in its load and remembers its prefixes there."""
        self._check(role)
        skip = exclude | self.avoided[role]
        cands = {w: ld for w, ld in self.loads[role].items() if ld.ready and w not in skip}
        if not cands:
            return None
        holders = self._holders(role, keys, cands) if role in self.affinity else {}
        w = self.policy.choose(cands, holders)
        if w not in cands:
            raise ValueError(f"policy {type(self.policy).__name__} chose worker {w!r}, not one "
                             f"of the ready {role} workers {sorted(cands)}")
        if w in holders:
            self.affinity_hits[role] += 1
        self.loads[role][w].queued += 1
        if role not in self.affinity:
            return w
        seen = self._seen[role].setdefault(w, OrderedDict())
        for steps, k in enumerate(keys, 1):
            seen[k] = steps
            seen.move_to_end(k)
        while len(seen) > self.remember:
            seen.popitem(last=False)
        return w

    def prefix_keys(self, prompt: Sequence[int]) -> list[bytes]:
        """A hash of each `prefix_unit`-aligned prefix of `prompt` (shortest first, at most
        MAX_PREFIX_STEPS): a hash chain, so equal keys mean equal prefixes."""
        keys: list[bytes] = []
        h = hashlib.blake2b(digest_size=16)
        u = self.prefix_unit
        for i in range(min(len(prompt) // u, MAX_PREFIX_STEPS)):
            h.update(array.array("q", prompt[i * u:(i + 1) * u]).tobytes())
            keys.append(h.copy().digest())
        return keys

    def _holders(self, role: str, keys: Sequence[bytes], cands: Mapping[int, Load]
                 ) -> dict[int, int]:
        out: dict[int, int] = {}
        for w in cands:
            seen = self._seen[role].get(w)
            if not seen:
                continue
            for k in reversed(keys):  # the longest prefix it holds
                if k in seen:
                    out[w] = seen[k]
                    break
        return out

    @staticmethod
    def _check(role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
