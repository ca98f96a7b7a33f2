"""One worker's links to many peers, as the one `Transport` its PD worker expects.

A cluster runs the unchanged `DecodeWorker` and `PrefillWorker` (atom_core/pd/workers.py): each
still talks to "its peer" over one transport. Here that transport is a set of per-peer links
(each its own authenticated `SecureLink` when there is a key):

- `PrefillLinks`, a decode worker's links to the prefill workers. A prefill request goes to the
  prefill worker the router chose for it (`route`), or to the live one with the fewest
  unanswered requests; in a cluster "live" also means reported ready (`set_ready`: a worker
  still starting is linked, but asked nothing). When a prefill worker is lost, every request
  it had not answered is sent again, same id and nonce, to another live prefill worker
  (`retried`): it never saw a token, so nothing is duplicated, and the decode worker only sees
  the answer arrive. Cancelled ones get a local prefill_failed instead (it frees a block
  draining for them). When no prefill worker is left, the decode worker is told its peer is
  lost (its own `peer_lost` handling: the waiting requests are prefilled locally, the cluster
  resubmits the importing ones locally).
  A prefill worker that refuses a request for backpressure (full: `prefill_failed` with
  `busy`) has it asked again, same id and nonce, of another live prefill worker that has not
  refused it (`busy_retried`); when every live one has, the refusal reaches the decode worker,
  whose node prefills the request locally (`DecodeNode`): it never fails for backpressure.
  A prefill worker that let a request time out (`timed_out`: the decode worker's deadline for
  that attempt passed) is taken for hung: it is asked nothing more (`unresponsive`), its other
  unanswered requests are cancelled there and asked again elsewhere (`retried`), and it gets a
  `ping`. Any message from it (an answer, a late one included, or the `pong` its links send at
  their next poll, i.e. once its loop runs again) or a new link to it (a restart) makes it
  live again. With no prefill worker left to ask, the decode worker is told so, as when every
  one is lost.
  The decode node reports the workers it takes for hung (`hung_report`); the frontend sets
  them aside and tells the other decode nodes (`set_avoided`): those ask such a worker
  nothing either, and move what they asked of it elsewhere at once instead of each waiting
  for a deadline of its own. They do not ping it or report it themselves: only the decode
  nodes that saw it hang do, so it is used again once each of them has its answer.
  Every time a request is asked again (after a loss, a refusal or a hang) its `attempt`
  number grows: the decode worker's transfer deadline counts from the latest attempt.
- `DecodeLinks`, a prefill worker's links to the decode workers. Answers go back on the link the
  request came from; a decode worker that is lost (or says shutdown) has its requests cancelled
  inside the prefill worker (blocks freed) and nothing else: the prefill worker keeps serving the
  others, until its own node stops it. A `ping` is answered `pong` at once, by the links
  (the worker's loop polled them: it is running).

Wire ids must be unique across the decode workers (`DecodeWorker(wire_prefix=...)`).
A link set made `secure` (there is a key) takes only links that say they are secure: the worker
wraps nothing around it (`workers._secure`), so one plain link in it would carry prompts and KV
in the clear, unauthenticated, without anyone having asked for the insecure mode.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import torch

from atom_core.pd.transport import PEER_LOST, Message, Transport, TransportError

__all__ = ["DecodeLinks", "PrefillLinks", "try_send"]

log = logging.getLogger(__name__)


def try_send(link: Transport, header: dict[str, Any]) -> bool:
    """Send `header` on `link`; False if the link is lost (its loss shows in the next poll,
    which handles it)."""
    try:
        link.send(header)
    except TransportError:
        return False
    return True


# The longest sleep between two looks at idle links.
IDLE_POLL = 0.002

# A prefill request a prefill worker takes: a wire id of at most this many characters and a
# per-request nonce of 32 lowercase hex digits (secrets.token_hex(16)).
MAX_WIRE_CHARS = 64
_REQUEST_NONCE = re.compile(r"[0-9a-f]{32}\Z")
# The most of a peer's reason for leaving (its "error") kept for messages.
MAX_WHY_CHARS = 500


def wellformed_nonce(nonce: Any) -> bool:
    """`nonce` is a per-request nonce as decode workers make them."""
    return isinstance(nonce, str) and bool(_REQUEST_NONCE.match(nonce))


def wellformed_prefill(wire: Any, nonce: Any) -> bool:
    """`wire` and `nonce` of a prefill request are ones a prefill worker serves (else it drops
    the request unanswered: `PrefillWorker._on_prefill`, `DecodeLinks.poll`)."""
    return isinstance(wire, str) and len(wire) <= MAX_WIRE_CHARS and wellformed_nonce(nonce)


def _why(header: dict[str, Any], default: str) -> str:
    """A lost or departing peer's reason, as text of bounded size. The "error" of a shutdown
    comes from the peer: str() of a deeply nested JSON list would recurse past the
    interpreter's limit and raise out of `poll`."""
    why = header.get("error", default)
    return why[:MAX_WHY_CHARS] if isinstance(why, str) else f"{default} (a JSON " \
        f"{type(why).__name__} for its reason)"


def poll_until(ready: Callable[[], bool], timeout: float) -> bool:
    """`ready()` at growing intervals (0.1 ms doubling up to IDLE_POLL) until it is true (True)
    or `timeout` passed (False)."""
    deadline = time.monotonic() + timeout
    pause = 0.0001
    while True:
        if ready():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, IDLE_POLL)


class _Links:
    """What both sides share: the links by peer, merged stats, polling waits."""

    def __init__(self, secure: bool) -> None:
        # the worker wraps nothing when every link is a SecureLink already (`workers._secure`)
        self.secure = secure
        self.links: dict[int, Transport] = {}
        self._all: list[Transport] = []  # every link ever added, for stats
        self._inbox: list[Message] = []  # made here, handed out by the next poll
        self._closed = False
        self.lost: dict[int, str] = {}  # peer -> why its link ended
        # peer -> the generation (process start) its current link goes to, None: not known
        self.gens: dict[int, int | None] = {}

    def add(self, peer: int, link: Transport, gen: int | None = None) -> None:
        """A (re)joined peer's link, its handshake done: used from now on. `gen`: the peer
        process's generation (its start count, `cluster_run.Linker`), when known. When it
        replaces a link the peer still has here (the peer restarted before its old link's loss
        was polled), what was in flight on the old link is settled as for a loss
        (`_lost_peer`): the old link is closed and never polled again, so otherwise those
        requests would wait for answers that cannot come (until a transfer timeout), and
        answers for the old process would go to the new one."""
        if self.secure and not getattr(link, "secure", False):
            # the worker wraps nothing around a secure link set: this link would run in clear
            raise ValueError(f"peer {peer}'s link is a plain {type(link).__name__} in a secure "
                             "link set (there is a key): wrap it in a SecureLink and complete "
                             "its handshake first")
        old = self.links.get(peer)
        self.links[peer] = link
        self.gens[peer] = gen
        self._all.append(link)
        self.lost.pop(peer, None)
        if old is not None and old is not link:
            old.close()
            # with the new link in place: a retry may go to the restarted peer itself
            self._lost_peer(peer, "its link was replaced: the peer restarted", self._inbox)

    @property
    def alive(self) -> bool:
        # never "lost" as a whole: peers come and go, the worker keeps serving
        return not self._closed

    @property
    def stats(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for link in self._all:
            out.update(link.stats)
        return dict(out)

    @property
    def dropped(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for link in self._all:
            out.update(getattr(link, "dropped", {}))
        return out

    def wait(self, timeout: float) -> bool:
        """Until some link has a message or `timeout`. Links have no shared wake-up, so this
        polls them, at first every 0.1 ms, then less often up to every IDLE_POLL (a quick
        answer stays quick, and idle workers leave the cores to busy ones)."""
        return poll_until(lambda: bool(self._inbox) or any(
            link.wait(0) for link in list(self.links.values())), timeout)

    def close(self) -> None:
        self._closed = True
        for link in self.links.values():
            link.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _gather(self) -> list[tuple[int, dict[str, Any], torch.Tensor | None]]:
        out = []
        for peer, link in sorted(self.links.items()):
            for header, tensor in link.poll():
                out.append((peer, header, tensor))
        return out

    def _lose(self, peer: int, why: str, out: list[Message]) -> None:
        """Close a peer's link once (a second report of the same loss does nothing), then let
        the role settle what the peer had in flight (`_lost_peer`), into `out`."""
        link = self.links.pop(peer, None)
        if link is None:
            return
        self.lost[peer] = why
        link.close()
        self._lost_peer(peer, why, out)

    def _lost_peer(self, peer: int, why: str, out: list[Message]) -> None:
        raise NotImplementedError


class PrefillLinks(_Links):
    """A decode worker's links to its prefill workers (see the module docstring)."""

    def __init__(self, secure: bool) -> None:
        super().__init__(secure)
        self._assigned: dict[str, int] = {}  # wire id -> the prefill worker the router chose
        self._where: dict[str, int] = {}  # wire id -> the link it was asked on, until answered
        self._asked: dict[str, dict[str, Any]] = {}  # wire id -> its prefill message
        self._attempts: dict[str, int] = {}  # wire id -> times asked, until answered
        self._cancelled: set[str] = set()
        self._told_lost = False  # the worker was told no prefill worker is left
        self.ready: frozenset[int] | None = None  # None: every linked one (`set_ready`)
        # rank -> the generation the frontend said is ready (None: it did not say)
        self._ready_gen: dict[int, int | None] = {}
        # peers (re)linked since the frontend last named them ready: a rank alone does not say
        # which process reported ready, so a new process is not taken for the old one
        self._unconfirmed: set[int] = set()
        self._refused: dict[str, set[int]] = {}  # wire id -> prefill workers that were full
        self.retried = 0  # prefill requests sent again after their prefill worker was lost
        self.busy_retried = 0  # prefill requests sent again after a worker refused them (full)
        # peer -> why it is taken for hung: linked, but asked nothing until it shows it is alive
        self.unresponsive: dict[int, str] = {}
        # peer -> the generation another decode node takes for hung (None: not known), as the
        # frontend names them (`set_avoided`): asked nothing, neither pinged nor reported here
        self.avoided: dict[int, int | None] = {}
        self.timeouts = 0  # requests whose deadline passed on a prefill worker (`timed_out`)
        self.moved = 0  # requests taken from a worker another decode node reported hung
        self.superseded = 0  # answers of a worker a request was taken from: dropped

    def route(self, wire: str, prefill: int | None) -> None:
        """Ask `prefill` for `wire`'s KV (None or not live: the least busy live one)."""
        if prefill is not None:
            self._assigned[wire] = prefill
        else:
            self._assigned.pop(wire, None)

    def live(self) -> list[int]:
        """The prefill workers to ask: linked, alive and, once the frontend said which are
        ready (`set_ready`), ready in the process this link goes to."""
        return sorted(p for p, link in self.links.items()
                      if link.alive and self._is_ready(p) and p not in self.unresponsive
                      and not self._avoided(p))

    def _avoided(self, peer: int) -> bool:
        """Another decode node takes the process this link goes to for hung (a report about
        an older process of that rank says nothing about this one)."""
        if peer not in self.avoided:
            return False
        want, have = self.avoided[peer], self.gens.get(peer)
        return want is None or have is None or want == have

    def set_avoided(self, avoided: Mapping[int, int | None]) -> None:
        """The prefill workers (rank -> generation, None: not known) that some decode node
        reports as not answering, as the frontend names them (replacing the last ones): asked
        nothing, and what they were asked here is moved to another live one now (or, with
        none left, the worker is told so) rather than waiting for its deadline there."""
        self.avoided = dict(avoided)
        touched = False
        for peer in sorted(self.avoided):
            if peer in self.links and self._avoided(peer) and peer in self._where.values() and \
                    peer not in self.unresponsive:  # (hung here: moved already)
                self.moved += self._move_from(peer)
                touched = True
        if touched:
            self._tell_if_none_left("the others are reported as not answering", self._inbox)
        self._rearm()

    def hung_report(self) -> list[list[int | None]]:
        """[rank, generation] of each prefill worker this decode worker takes for hung, for
        the frontend (the generation tells it which process the report is about)."""
        return [[p, self.gens.get(p)] for p in sorted(self.unresponsive)]

    def _is_ready(self, peer: int) -> bool:
        if self.ready is None:
            return True
        if peer not in self.ready:
            return False
        want, have = self._ready_gen.get(peer), self.gens.get(peer)
        if want is not None and have is not None:
            return want == have  # the frontend's ready report is this very process's
        return peer not in self._unconfirmed

    def set_ready(self, ready: Iterable[int] | Mapping[int, int | None]) -> None:
        """The prefill workers that reported ready to the frontend: a worker that is linked
        but still starting (or restarting) is asked nothing until it is one of them. A mapping
        names each one's generation (rank -> the generation that reported ready, or None):
        a link to another generation of that rank (a restarted process, linked before the
        frontend heard of the restart, or after an older ready list was sent) is not asked
        until the frontend names that generation ready. Without generations a link added
        after the last ready list waits for the next list that names its rank."""
        gens = dict(ready) if isinstance(ready, Mapping) else dict.fromkeys(ready)
        self.ready = frozenset(gens)
        self._ready_gen = gens
        self._unconfirmed -= self.ready
        self._rearm()

    def _rearm(self) -> None:
        if self.live():
            # a prefill worker can be asked again (the node clears the worker's `lost`): the
            # next time none is left the worker must be told again, or the requests in flight
            # to the last one would wait for answers that cannot come (transfer timeout)
            self._told_lost = False

    def add(self, peer: int, link: Transport, gen: int | None = None) -> None:
        self.unresponsive.pop(peer, None)  # a new process: the hung one is gone
        if self.ready is not None:
            # (before the old link's requests are retried: not to the new process, unready)
            self._unconfirmed.add(peer)
        super().add(peer, link, gen)
        self._rearm()

    def busy(self) -> bool:
        """Some prefill request is unanswered."""
        return bool(self._where)

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        if self._closed:
            raise TransportError("cannot send: the prefill links are closed")
        kind = header.get("kind")
        if kind == "prefill":
            self._ask(dict(header), self._assigned.pop(str(header.get("id")), None))
        elif kind == "cancel":
            wire = header.get("id")
            peer = self._where.get(wire) if isinstance(wire, str) else None
            if peer is not None:
                self._cancelled.add(wire)  # type: ignore[arg-type]
                try_send(self.links[peer], header)  # (a loss: the next poll ends the transfer)
        elif kind == "shutdown":
            # this decode worker is done with them; each prefill worker keeps serving the others
            for link in self.links.values():
                try_send(link, header)
        else:
            raise ValueError(f"a decode worker sends prefill, cancel or shutdown, not {kind!r}")

    def _ask(self, header: dict[str, Any], prefer: int | None,
             exclude: frozenset[int] = frozenset()) -> None:
        wire = header["id"]
        tried: set[int] = set(exclude)
        while True:
            live = [p for p in self.live() if p not in tried]
            if not live:
                self._where.pop(wire, None)
                self._asked.pop(wire, None)
                self._attempts.pop(wire, None)
                raise TransportError("no prefill worker is alive: the decode worker prefills "
                                     "locally until one reports ready")
            peer = prefer if prefer in live else min(
                live, key=lambda p: (sum(1 for w in self._where.values() if w == p), p))
            try:
                self.links[peer].send(header)
            except TransportError:
                tried.add(peer)  # its loss is handled at the next poll; try another
                continue
            self._where[wire], self._asked[wire] = peer, header
            self._attempts[wire] = self._attempts.get(wire, 0) + 1
            return

    def poll(self) -> list[Message]:
        out, self._inbox = self._inbox, []
        for peer, header, tensor in self._gather():
            kind = header.get("kind")
            if kind == PEER_LOST:
                self._lose(peer, _why(header, "its link ended"), out)
                continue
            self._alive_again(peer)
            if kind == "pong":
                continue  # (it did its job: the peer answered)
            wire = header.get("request_id" if kind == "kv" else "id")
            if kind in ("kv", "prefill_failed") and isinstance(wire, str) and wire in self._where:
                if self._where[wire] != peer:
                    # from a worker it was taken away from (hung, then woke): the worker the
                    # request went to answers it; this one's answer (a refusal of the cancel
                    # it was sent, say) would end a transfer still running elsewhere
                    self.superseded += 1
                    continue
                if kind == "prefill_failed" and header.get("busy") is True and \
                        self._ask_another(wire, peer):
                    continue
                self._answered(wire)
            out.append((header, tensor))
        return out

    def timed_out(self, wire: str) -> int | None:
        """The decode worker gave up on `wire` (its attempt's deadline passed; it cancelled
        it): the prefill worker asked is taken for hung (`unresponsive`, see the module
        docstring). Returns that worker, or None when `wire` was not waiting on any."""
        self.timeouts += 1
        peer = self._where.get(wire)
        if peer is None or peer not in self.links:
            return None  # (its worker was marked, or lost, a moment ago: already settled)
        self._answered(wire)  # cancelled: a late answer of the hung worker is stale
        self._hung(peer, f"request {wire} got no answer before its deadline", self._inbox)
        return peer

    def _hung(self, peer: int, why: str, out: list[Message]) -> None:
        if peer in self.unresponsive:
            return
        self.unresponsive[peer] = why
        log.warning("prefill worker %d is not answering (%s): it is asked nothing more until "
                    "it answers again; its unanswered requests go to another prefill worker "
                    "or to local prefill", peer, why)
        link = self.links[peer]
        # a live worker's links answer at their next poll, whether or not it holds anything
        # of ours (a request lost on the way leaves it nothing else to answer)
        try_send(link, {"kind": "ping", "nonce": secrets.token_hex(16)})
        self.retried += self._move_from(peer)
        self._tell_if_none_left(f"the last, {peer}, is not answering: {why}", out)

    def _move_from(self, peer: int) -> int:
        """Cancel on `peer` what it was asked and not answered, and ask another live prefill
        worker for each (same id and nonce); returns how many were asked again."""
        link, moved = self.links[peer], 0
        for wire in [w for w, p in self._where.items() if p == peer]:
            if wire in self._cancelled:
                self._answered(wire)  # ended on the decode side (cancel sent): not asked again
                continue
            header = self._asked[wire]
            # when it wakes it drops the request instead of prefilling it for nobody
            try_send(link, {"kind": "cancel", "id": wire, "nonce": header["nonce"]})
            moved += self._ask_again(header)
        return moved

    def _alive_again(self, peer: int) -> None:
        why = self.unresponsive.pop(peer, None)
        if why is None:
            return
        log.warning("prefill worker %d answers again: it is asked again", peer)
        self._rearm()

    def _ask_again(self, header: dict[str, Any], exclude: frozenset[int] = frozenset()
                   ) -> bool:
        """Ask another live prefill worker for `header`'s request, same id and nonce (a new
        `attempt`); False when none is left."""
        try:
            self._ask(header, None, exclude)
        except TransportError:
            return False
        return True

    def attempt(self, wire: str) -> int:
        """How many times `wire` was asked of a prefill worker, while it waits for its answer
        (0: it does not): each attempt has a deadline of its own (`DecodeWorker`), or a retry
        sent late in the first attempt's time would time out almost at once."""
        return self._attempts.get(wire, 0)

    def _ask_another(self, wire: str, peer: int) -> bool:
        """`peer` was full: ask a live prefill worker that has not refused `wire` (True), or
        False when there is none (or it was cancelled): the refusal then goes to the worker."""
        refused = self._refused.setdefault(wire, set())
        refused.add(peer)
        if wire in self._cancelled or not self._ask_again(self._asked[wire],
                                                          frozenset(refused)):
            return False
        self.busy_retried += 1
        return True

    def _answered(self, wire: str) -> None:
        self._where.pop(wire, None)
        self._asked.pop(wire, None)
        self._attempts.pop(wire, None)
        self._cancelled.discard(wire)
        self._refused.pop(wire, None)

    def _lost_peer(self, peer: int, why: str, out: list[Message]) -> None:
        self.unresponsive.pop(peer, None)  # gone rather than hung
        for wire in [w for w, p in self._where.items() if p == peer]:
            header = self._asked[wire]
            if wire in self._cancelled:
                # nothing will answer it now: end the transfer (frees its draining block)
                out.append(({"kind": "prefill_failed", "id": wire, "nonce": header["nonce"],
                             "error": f"prefill worker {peer} lost: {why}"}, None))
                self._answered(wire)
                continue
            if self._ask_again(header):
                self.retried += 1
            # (else none is left: the worker's own loss handling takes it)
        self._tell_if_none_left(f"the last, {peer}: {why}", out)

    def _tell_if_none_left(self, why: str, out: list[Message]) -> None:
        """With no prefill worker left to ask, tell the decode worker once (its peer-lost
        handling: local prefill), forgetting what was asked."""
        if self.live() or self._told_lost:
            return
        self._told_lost = True
        self._where.clear()
        self._asked.clear()
        self._attempts.clear()
        self._cancelled.clear()
        self._refused.clear()
        out.append(({"kind": PEER_LOST, "error": f"every prefill worker is lost or not "
                                                 f"answering ({why})"}, None))


class DecodeLinks(_Links):
    """A prefill worker's links to its decode workers (see the module docstring)."""

    def __init__(self, secure: bool) -> None:
        super().__init__(secure)
        # wire id -> (decode worker, nonce, the link it came on): the answer goes on that link
        # only, never on a newer one to a restarted decode worker (another process)
        self._from: dict[str, tuple[int, str, Transport]] = {}
        self.dropped_answers = 0  # for a decode worker that is gone
        self.refused = 0  # a request id another decode worker uses, or a foreign cancel

    def pending(self) -> int:
        return len(self._from)

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        kind = header.get("kind")
        if kind not in ("kv", "prefill_failed"):
            raise ValueError(f"a prefill worker sends kv or prefill_failed, not {kind!r}")
        wire = header.get("request_id" if kind == "kv" else "id")
        src = self._from.pop(wire, None) if isinstance(wire, str) else None
        link = self.links.get(src[0]) if src is not None else None
        if link is None or src is None or link is not src[2]:
            self.dropped_answers += 1  # its decode worker is gone: nobody waits for it
            return
        try:
            link.send(header, tensor)
        except TransportError:
            self.dropped_answers += 1  # the loss shows in the next poll

    def poll(self) -> list[Message]:
        out, self._inbox = self._inbox, []
        for peer, header, tensor in self._gather():
            kind = header.get("kind")
            if kind in (PEER_LOST, "shutdown"):
                self._lose(peer, _why(header, "it shut down"), out)
                continue
            if kind == "ping":
                self._pong(peer, header.get("nonce"))
                continue
            wire = header.get("id")
            if kind == "prefill":
                link = self.links.get(peer)
                if not wellformed_prefill(wire, header.get("nonce")) or wire in self._from \
                        or link is None:
                    # malformed (the worker would drop it unanswered, and its entry here would
                    # stay forever), in use (answering would go to its owner), or its decode
                    # worker left in this very poll (shut down): nobody would take the answer
                    self.refused += 1
                    continue
                self._from[wire] = (peer, str(header.get("nonce")), link)
            elif kind == "cancel" and (not isinstance(wire, str)
                                       or self._from.get(wire, (None,))[0] != peer):
                self.refused += 1  # only its own requests
                continue
            out.append((header, tensor))
        return out

    def _pong(self, peer: int, nonce: Any) -> None:
        """Answer a decode worker's ping: this worker's loop runs (it polled)."""
        link = self.links.get(peer)
        if link is None or not wellformed_nonce(nonce):
            self.refused += 1
            return
        try_send(link, {"kind": "pong", "nonce": nonce})

    def _lost_peer(self, peer: int, why: str, out: list[Message]) -> None:
        # its requests end here: cancelled inside the worker (their blocks freed); the answers
        # the worker sends for them are dropped (`send`)
        for wire, (p, nonce, _link) in self._from.items():
            if p == peer:
                out.append(({"kind": "cancel", "id": wire, "nonce": nonce}, None))
