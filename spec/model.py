"""The atom-core model: lanes with paged block tables (T blocks of S tokens each).

Read it like a mypyvy file: sorts, constants, state, then actions (named guard conjuncts and
updates over the pre-state), then invariants, one per line. `atom_core.proofs` checks it with
z3; `make generate` turns it into `atom_core/_generated/core.py`.

Ghost state (`holds`, `junk`) says what a physical block actually contains. The runtime never
reads it; it exists so that "a lane's block holds exactly its request's tokens" and "a cache
entry's key equals its block's content" are invariants, and a padding row that scribbles on a
cached block breaks one of them.
"""

from atom_core.spec.lang import (
    BOOL,
    INT,
    Model,
    assign,
    assign_all,
    emit,
    enabled,
    enum_sort,
    exists,
    fn_sort,
    forall,
    ident_sort,
    implies,
    index_sort,
    ite,
    live_when,
    one_of,
    require,
    use_model,
    value_sort,
    vector,
)
from atom_core.spec.lang import count as count_of

m = Model("atom-core eager")
use_model(m)

# ---------------------------------------------------------------- sorts
Lane = m.sort(index_sort("Lane", size="B"))     # rows of the compiled decode batch
Block = m.sort(index_sort("Block", size="K"))   # physical KV blocks
Req = m.sort(ident_sort("Req"))                 # requests
Slot = m.sort(index_sort("Slot", size="H"))     # host cache slots (one block's KV each)
Seq = m.sort(value_sort("Seq"))                 # token sequences (the KV a block holds)
# DRAINING: the block's request ended while a PD transfer still reads or writes it; it is freed
# when the transfer ends, never before.
# SPILLING: a cache entry being stored to a host slot; freed when the store ends, never before.
Owner = m.sort(enum_sort("Owner", "FREE SCRATCH LANE CACHE DRAINING SPILLING"))
# A host slot: STORING (a store from a device block is writing it), STORED (an entry), LOADING
# (an entry a hit is reading into a device block).
SlotState = m.sort(enum_sort("SlotState", "EMPTY STORING STORED LOADING"))
# IMPORTING (decode side): the lane waits for KV computed elsewhere. EXPORTING (prefill side): the
# lane's prompt KV is being sent.
Phase = m.sort(enum_sort(
    "Phase", "NONE WAITING PREFILL DECODE IMPORTING EXPORTING FINISHED ABORTED FAILED"))

# ---------------------------------------------------------------- configuration
B = m.const("B", INT)                 # lanes
K = m.const("K", INT)                 # kv blocks
C = m.const("C", INT)                 # prefill chunk (tokens)
S = m.const("S", INT)                 # block size (tokens per KV block)
PREFIX = m.const("PREFIX", BOOL)      # prefix cache on
RESERVED = m.const("RESERVED", BOOL)  # scratch discipline: a reserved block (else dynamic)
SCRATCH = m.const("SCRATCH", Block)   # the reserved scratch block
# blocks per lane's table: max_seq_len == T * S. Eager artifacts (and older configurations): 1.
T = m.const("T", INT, default=1)
# sliding-window layers beside global ones (Gemma3-style); older configurations: False
HYBRID = m.const("HYBRID", BOOL, default=False)
# host cache tier (evicted entries stored to host, hits loaded back); older configurations: off
HOST = m.const("HOST", BOOL, default=False)
H = m.const("H", INT, default=0)      # host cache slots
# preemption: a lane that needs a block when none is reusable may push another lane's request
# back to the waiting queue (its blocks freed). Off: every lane owns room for a whole table.
PREEMPT = m.const("PREEMPT", BOOL, default=False)

m.axiom("chunk_positive", C > 0)
# A chunk never straddles two blocks of a paged table. An eager table (T = 1) is one block of
# max_seq_len positions, which the RBLN stack does not require to be a multiple of the chunk: a
# prompt's last chunk is padded, and its valid tokens end within the block.
m.axiom("chunk_divides_block", implies(T > 1, S % C == 0),
        doc="with paged tables (block_size below max_seq_len) block_size must be a multiple of "
            "prefill_chunk: a chunk never straddles two blocks (an eager artifact, block_size "
            "== max_seq_len, may have any max_seq_len: its last chunk is padded)")
m.axiom("block_holds_a_chunk", C <= S,
        doc="prefill_chunk must not exceed block_size (max_seq_len unless given)")
m.axiom("lanes_positive", B > 0)
m.axiom("blocks_positive", K > 0)
m.axiom("tables_positive", T > 0)
m.axiom("host_cache_needs_prefix_cache", implies(HOST, PREFIX),
        doc="host_cache_blocks > 0 needs prefix_cache=True: the host tier holds prefix-cache "
            "entries evicted from the device; turn the prefix cache on or set "
            "host_cache_blocks=0")
# With one block per table no lane ever grows: preemption would only save a padding block.
m.axiom("preemption_with_tables", implies(PREEMPT, T > 1),
        doc="preemption=True needs paged tables (block_size below max_seq_len): with one block "
            "per table no lane ever needs another block, so there is nothing to preempt for")
# A host entry would have to carry the sliding-state snapshots too; not built.
m.axiom("hybrid_without_host_cache", ~(HYBRID & HOST),
        doc="a hybrid model (sliding_window set) cannot use the host cache: a host entry would "
            "have to carry the sliding-window snapshots its hits restore, which is not built; "
            "set host_cache_blocks=0 (the device prefix cache works for hybrid models)")

# ---------------------------------------------------------------- token sequences
empty = m.op("empty", [], Seq, doc="no tokens")
take = m.op("take", [Seq, INT], Seq, doc="the first n tokens")
push = m.op("push", [Seq, INT], Seq, doc="append one token")
slen = m.op("slen", [Seq], INT, doc="number of tokens")
m.axiom("empty_has_no_tokens", slen(empty()) == 0)
m.law("push_adds_a_token", forall((Seq, INT), lambda q, t: slen(push(q, t)) == slen(q) + 1))

# ---------------------------------------------------------------- state: blocks
owner = m.fn("owner", [Block], Owner,
             init=lambda b: ite(RESERVED & (b == SCRATCH), Owner.SCRATCH, Owner.FREE),
             doc="who holds the block; a function, so every block has exactly one owner")
owner_lane = m.fn("owner_lane", [Block], Lane, doc="the lane, when owner is LANE")
key = m.fn("key", [Block], Seq, init=lambda b: empty(),
           doc="the tokens a cache entry is indexed by")
head = m.fn("head", [Block], Seq, init=lambda b: empty(),
            doc="the key's first chunk, kept so that a miss compares chunks without slicing")
holds = m.fn("holds", [Block], Seq, ghost=True, doc="the tokens whose KV the block holds")
junk = m.fn("junk", [Block], BOOL, init=True, ghost=True,
            doc="the block was scribbled on (padding rows, failed writes)")

# ---------------------------------------------------------------- state: lanes
# Hybrid models keep each lane's sliding-window KV in a lane-local slot
# (local_block_tables[lane] == lane) laid out as the RBLN kernel keeps it: a window, the last
# min(p, W) positions in order, oldest first. A call at position q reads the first min(q, W)
# entries as positions q - min(q, W) .. q - 1 and appends its own, dropping the oldest once the
# window is full; so any write that is not the slot's own sequence's next position shifts or
# overwrites live state. Only a slot whose lane is idle (admission starts it afresh) may take
# padding rows.
local_holds = m.fn("local_holds", [Lane], Seq, ghost=True,
                   doc="tokens whose sliding-window state the lane's local slot holds")
local_junk = m.fn("local_junk", [Lane], BOOL, init=True, ghost=True,
                  doc="the lane's local slot was written by something other than its sequence")
# Hybrid prefix caching: a hit copies global KV only, so it must also restore the sliding state
# at the hit's length. The host keeps snapshots of a lane's local slot at chunk boundaries
# C, 2C, .., lane_snap(l) (taken by `snapshot`, or inherited from the entry it hit); a cache
# entry keeps its lane's (snap_upto), and a hybrid hit of n tokens needs n <= snap_upto.
lane_snap = m.fn("lane_snap", [Lane], INT, init=0,
                 doc="the lane has sliding-state snapshots at every chunk boundary up to this")
snap_upto = m.fn("snap_upto", [Block], INT, init=0,
                 doc="a cache entry has sliding-state snapshots at every chunk boundary up to this")
# Ghost: a snapshot at boundary n must hold the sliding state of its owner's first n tokens (the
# lane's sequence, the entry's key). These flags record any that does not (taken from a slot that
# held something else, or a boundary skipped); the invariants say they are never set.
lane_snap_junk = m.fn("lane_snap_junk", [Lane], BOOL, init=True, ghost=True,
                      doc="some snapshot of the lane is not its own sequence's state there")
snap_junk = m.fn("snap_junk", [Block], BOOL, init=True, ghost=True,
                 doc="some snapshot of the entry is not its key's state there")
# Ghost: how far the snapshots the host really holds go (taken by `snapshot`, handed over with
# the blocks and hits as the adapter's store moves them), so that a count that claims more
# (a hit restoring from a snapshot never taken) or fewer than were taken breaks an invariant.
lane_snap_taken = m.fn("lane_snap_taken", [Lane], INT, init=0, ghost=True,
                       doc="the last boundary the host holds a snapshot of the lane at")
snap_taken = m.fn("snap_taken", [Block], INT, init=0, ghost=True,
                  doc="the last boundary the host holds a snapshot of the entry at")
busy = m.fn("busy", [Lane], BOOL, init=False, doc="the lane serves a request")
lane_req = m.fn("lane_req", [Lane], Req, doc="the request a busy lane serves")
# A lane's table is its blocks in token order; only the last one (the tail) is ever written.
# A block records where it starts in its sequence (`start`), so the proofs compare token
# positions without multiplying by S; the runtime's position p -> (table[p // S], p % S) follows
# from the bounded invariant `tables_are_dense`.
tail = m.fn("tail", [Lane], Block, doc="the lane's last block: the one its next token's KV goes to")
nblocks = m.fn("nblocks", [Lane], INT, init=0, doc="blocks in the lane's table (<= T)")
start = m.fn("start", [Block], INT, init=0,
             doc="the position of the block's first token in its lane's sequence (or its key)")
length = m.fn("length", [Lane], INT, init=0, doc="tokens whose KV the lane's blocks hold")
lane_seq = m.fn("lane_seq", [Lane], Seq, doc="prompt + generated tokens of the lane's request")
lane_plen = m.fn("lane_plen", [Lane], INT, init=0, doc="prompt length of the lane's request")
copying = m.fn("copying", [Lane], BOOL, init=False,
               doc="a prefix-hit copy into the lane's block is in flight")
copy_src = m.fn("copy_src", [Lane], Block, doc="the cache entry an in-flight copy reads")
copy_host = m.fn("copy_host", [Lane], BOOL, init=False,
                 doc="the in-flight copy is a load from a host slot (else from a device entry)")
copy_slot = m.fn("copy_slot", [Lane], Slot, doc="the host slot an in-flight load reads")
transfer = m.fn("transfer", [Block], BOOL, init=False,
                doc="a PD transfer (an import writing, an export reading) is using the block")
transfer_req = m.fn("transfer_req", [Block], Req,
                    doc="the request whose transfer uses the block (events name requests)")
# Ghost: the outside world's view of transfers, by request, so that an event naming the wrong
# request (late, duplicate) releasing a block whose own transfer still runs breaks an invariant.
xfer_live = m.fn("xfer_live", [Req], BOOL, init=False, ghost=True,
                 doc="the request's transfer is still running")
xfer_block = m.fn("xfer_block", [Req], Block, ghost=True,
                  doc="a block that transfer uses (its first): while it runs, one stays pinned")
# By block: which blocks each running transfer uses (every block of the table it was started
# with), so that freeing or unpinning any one of them early (not just the first) is caught.
xfer_on = m.fn("xfer_on", [Block], BOOL, init=False, ghost=True,
               doc="a running transfer uses the block")
xfer_of = m.fn("xfer_of", [Block], Req, ghost=True, doc="the request whose transfer uses it")

# ---------------------------------------------------------------- state: host cache
slot_state = m.fn("slot_state", [Slot], SlotState, init=SlotState.EMPTY)
slot_key = m.fn("slot_key", [Slot], Seq, init=lambda h: empty(),
                doc="the tokens a host entry is indexed by")
slot_head = m.fn("slot_head", [Slot], Seq, init=lambda h: empty(), doc="its first chunk")
slot_start = m.fn("slot_start", [Slot], INT, init=0,
                  doc="the position of the host entry's first token in its key (its block's)")
slot_block = m.fn("slot_block", [Slot], Block, doc="the device block a store reads")
spill_slot = m.fn("spill_slot", [Block], Slot, doc="the slot a spilling block is stored into")
load_lane = m.fn("load_lane", [Slot], Lane, doc="the lane a loading slot is read into")
slot_holds = m.fn("slot_holds", [Slot], Seq, ghost=True, doc="the tokens whose KV it holds")
slot_junk = m.fn("slot_junk", [Slot], BOOL, init=True, ghost=True,
                 doc="the slot holds nothing valid (a store in flight or failed)")

# ---------------------------------------------------------------- state: requests
phase = m.fn("phase", [Req], Phase, init=Phase.NONE)
req_lane = m.fn("req_lane", [Req], Lane, doc="the lane of a running request")
prompt = m.fn("prompt", [Req], Seq, init=lambda r: empty(),
              doc="the prompt of a submitted request")

# ---------------------------------------------------------------- lookups
# The policy finds the cache entries (device and host) whose first chunk is a prompt's by value
# (`core.where_head`, `core.where_slot_head`), not by comparing every entry's head.
m.lookup(head)
m.lookup(slot_head)


# ---------------------------------------------------------------- definitions
def running(r):
    return one_of(phase(r), Phase.PREFILL, Phase.DECODE, Phase.IMPORTING, Phase.EXPORTING)


def ended(r):
    return one_of(phase(r), Phase.FINISHED, Phase.ABORTED, Phase.FAILED)


@m.definition
def decoding(l: Lane):
    return busy(l) & (phase(lane_req(l)) == Phase.DECODE)


@m.definition
def prefilling(l: Lane):
    return busy(l) & (phase(lane_req(l)) == Phase.PREFILL)


@m.definition
def importing(l: Lane):
    return busy(l) & (phase(lane_req(l)) == Phase.IMPORTING)


@m.definition
def exporting(l: Lane):
    return busy(l) & (phase(lane_req(l)) == Phase.EXPORTING)


@m.definition
def moving(l: Lane):
    """Lane l's blocks are in a PD transfer."""
    return importing(l) | exporting(l)


@m.definition
def table_covers_prompt(l: Lane):
    """Lane l's table has a block for every prompt position: an import can be written."""
    return start(tail(l)) + S >= lane_plen(l)


def hit_ok(r, b):
    """Entry b shares at least the prompt's first chunk, and a token is left to compute; for a
    hybrid model it also has the sliding state there (else the hit is not usable, and a miss
    must not wait for it)."""
    return ((slen(prompt(r)) > C) & (owner(b) == Owner.CACHE) & (start(b) == 0)
            & (head(b) == take(prompt(r), C)) & (slen(key(b)) >= C)
            & implies(HYBRID, snap_upto(b) >= C))


def hybrid_evicts_its_hit(dst, b):
    """A hybrid model's miss may take the entry b of its own prefix hit as a plain block (and
    compute the prefix again) when b is the only block it could take: the hit's copy needs a
    second block, and a hybrid lane cannot take the entry over (`admit_adopt`), since restoring
    its sliding state is part of the copy."""
    # (`o == b`, not `o == dst`: the same under `b == dst`, and the generated code then
    # evaluates the quantifier only for a hybrid model's hit at dst, not on every miss)
    return HYBRID & (b == dst) & forall(Block, lambda o: implies(reusable(o), o == b))


@m.definition
def computing(l: Lane):
    """Lane l computes on the device (prefill or decode) with no copy in flight."""
    return (prefilling(l) | decoding(l)) & ~copying(l)


@m.definition
def tail_full(l: Lane):
    return length(l) == start(tail(l)) + S


@m.definition
def at_table_end(l: Lane):
    """Decoding lane l has filled its whole table: it can only finish (which frees it)."""
    return decoding(l) & tail_full(l) & (nblocks(l) == T)


@m.definition
def needs_block(l: Lane):
    """Lane l cannot compute another token before its table grows."""
    return computing(l) & tail_full(l) & (nblocks(l) < T)


@m.definition
def import_waits(l: Lane):
    """Importing lane l's table does not cover its prompt yet: it waits for its next block
    (`import_grow`) before its transfer can start."""
    return importing(l) & ~table_covers_prompt(l)


@m.definition
def lane_block(b: Block, l: Lane):
    """b is one of lane l's blocks (any position of its table)."""
    return (owner(b) == Owner.LANE) & (owner_lane(b) == l)


@m.definition
def pinned(b: Block):
    """An in-flight copy reads b: it must stay cached and untouched until the copy is done."""
    return exists(Lane, lambda l: copying(l) & ~copy_host(l) & (copy_src(l) == b))


@m.definition
def reusable(b: Block):
    """A block an admission may take: free, or an unpinned cache entry it evicts."""
    return one_of(owner(b), Owner.FREE, Owner.CACHE) & ~pinned(b)


def quiescent():
    """No copy in flight (the adapter completes each copy within the step that started it) and
    no block waiting for a transfer of an ended request to stop."""
    return (forall(Lane, lambda l: ~copying(l))
            & forall(Block, lambda b: owner(b) != Owner.DRAINING)
            & forall(Slot, lambda h: slot_state(h) != SlotState.STORING))


def needs_scratch():
    """Some decode row is not a decoding lane, so it computes (and writes) padding."""
    return exists(Lane, lambda l: ~decoding(l))


def row_block(l, pad):
    """The block decode row l writes: its own for a decoding lane, else the padding target."""
    return ite(decoding(l), tail(l), pad)


def row_position(l):
    """The position decode row l computes at: a decoding lane's next token; a padding row
    (its write lands in the padding targets, global and local), 0."""
    return ite(decoding(l), length(l), 0)


def local_row(l, lpad):
    """The local slot decode row l reads and writes (hybrid): its own for a decoding lane,
    else `lpad`, the slot of an idle lane (`local_pad_ok`)."""
    return ite(decoding(l), l, lpad)


def local_pad_ok(lpad):
    """A padding row writes at position 0 of its local slot: that is harmless only in a slot
    no busy lane's window lives in (it would shift or overwrite it: see the local slots)."""
    return implies(HYBRID & needs_scratch(), ~busy(lpad))


def scratch_ok(pad):
    return ite(RESERVED, owner(pad) == Owner.SCRATCH, reusable(pad))


def prompt_kv(l, tok):
    """The tokens whose KV a whole prefill of lane l's prompt leaves in its block, tok being the
    first sampled token (which adds no KV): what an import must deliver."""
    return take(push(lane_seq(l), tok), lane_plen(l))


def next_len(l):
    return ite(length(l) + C < lane_plen(l), length(l) + C, lane_plen(l))


def occupy(l, r, dst, n, ph=Phase.PREFILL, src=None):
    """The updates every admission shares: lane l takes request r into block dst."""
    assign(busy(l), True)
    assign(lane_req(l), r)
    assign(tail(l), dst)
    assign(nblocks(l), 1)
    assign(start(dst), 0)
    assign(length(l), n)
    assign(lane_seq(l), prompt(r))
    assign(lane_plen(l), slen(prompt(r)))
    assign(phase(r), ph)
    assign(req_lane(r), l)
    assign(owner(dst), Owner.LANE)
    assign(owner_lane(dst), l)
    # a fresh sequence: its sliding state is that of the empty prefix until a hit's copy_done
    # restores the snapshot at the hit's length
    assign(local_holds(l), take(prompt(r), 0))
    assign(local_junk(l), False)
    if src is None:  # no snapshots yet (an idle lane has none: lane_snap(l) == 0)
        assign(lane_snap_junk(l), False)
        assign(lane_snap_taken(l), 0)
    else:  # the entry's snapshots up to the hit's length: its key and the prompt agree there
        assign(lane_snap(l), ite(n <= snap_upto(src), n, snap_upto(src)))
        assign(lane_snap_junk(l), snap_junk(src))
        assign(lane_snap_taken(l), ite(n <= snap_taken(src), n, snap_taken(src)))


def release(l, to_cache):
    """The lane's blocks go back to the free pool (or into the cache)."""
    assign(busy(l), False)
    assign_all(owner, lambda b: ite(lane_block(b, l), ite(to_cache, Owner.CACHE, Owner.FREE),
                                    owner(b)))
    assign(lane_snap(l), 0)  # the entry keeps them (retire), else they are dropped


def cancel(l):
    """The lane's request ends early: an in-flight copy into it stops and unpins its source; a
    block a PD transfer still uses drains until the transfer ends (it is not free before)."""
    assign(busy(l), False)
    assign_all(owner, lambda b: ite(lane_block(b, l),
                                    ite(transfer(b), Owner.DRAINING, Owner.FREE), owner(b)))
    assign(copying(l), False)
    # (over every slot: with no host tier there is no slot to index)
    assign_all(slot_state, lambda h: ite(copying(l) & copy_host(l) & (copy_slot(l) == h),
                                         SlotState.STORED, slot_state(h)))
    assign(lane_snap(l), 0)  # partial work is never cached: its snapshots are dropped


def retire(l, keep):
    """Lane l's request is done; its KV becomes cache entries (keep) or the blocks are freed.
    The full blocks got their keys when they filled (`grow`); the tail gets its own now."""
    b = tail(l)
    assign(key(b), take(lane_seq(l), length(l)))
    assign(head(b), take(take(lane_seq(l), length(l)), C))
    assign(snap_upto(b), lane_snap(l))  # <= length(l): the key covers every snapshot
    assign(snap_junk(b), lane_snap_junk(l))
    assign(snap_taken(b), lane_snap_taken(l))
    release(l, keep)


# ---------------------------------------------------------------- actions
@m.action
def submit(r: Req, p: Seq):
    """A new request with prompt p enters the waiting queue."""
    require("request_is_new", phase(r) == Phase.NONE)
    require("prompt_not_empty", slen(p) > 0)
    require("prompt_fits", slen(p) < T * S)
    assign(phase(r), Phase.WAITING)
    assign(prompt(r), p)


@m.action
def admit_miss(l: Lane, r: Req, dst: Block):
    """Admit r into idle lane l with an empty block (evicting dst if it is a cache entry)."""
    require("lane_idle", ~busy(l))
    require("request_waiting", phase(r) == Phase.WAITING)
    require("dst_reusable", reusable(dst))
    require("no_cache_hit", implies(PREFIX, forall(Block, lambda b: ~(
        hit_ok(r, b) & ~hybrid_evicts_its_hit(dst, b)))))
    occupy(l, r, dst, 0)
    assign(holds(dst), take(prompt(r), 0))
    assign(junk(dst), False)
    emit("admit", lane=l, request=r, block=dst)


def hits_entry(l, r, src, n):
    """The guards an admission from cache entry src starts with (`admit_hit`, `admit_adopt`):
    idle lane l, waiting request r, and src agrees with r's prompt through n tokens (whole
    chunks) with a token left to compute."""
    require("lane_idle", ~busy(l))
    require("request_waiting", phase(r) == Phase.WAITING)
    require("src_cached", owner(src) == Owner.CACHE)
    require("n_whole_chunks", (n >= C) & (n % C == 0))
    require("n_within_entry", n <= slen(key(src)))
    require("token_left_to_compute", n < slen(prompt(r)))
    require("prefix_matches", take(key(src), n) == take(prompt(r), n))


def into_first_block(src, n):
    """... and the hit lands in the lane's first block: src starts a sequence, n fits a block."""
    require("src_first_block", start(src) == 0)
    require("n_within_block", n <= S)


@m.action
def admit_hit(l: Lane, r: Req, src: Block, dst: Block, n: INT):
    """Admit r into idle lane l by copying n cached tokens from entry src into a fresh dst."""
    live_when(PREFIX)
    hits_entry(l, r, src, n)
    require("hybrid_snapshot_at_n", implies(HYBRID, n <= snap_upto(src)))
    into_first_block(src, n)
    require("dst_not_src", dst != src)
    require("dst_reusable", reusable(dst))
    occupy(l, r, dst, n, src=src)
    assign(junk(dst), True)  # nothing valid in it until the copy lands
    assign(copying(l), True)
    assign(copy_host(l), False)
    assign(copy_src(l), src)
    emit("admit", lane=l, request=r, block=dst)
    emit("copy", lane=l, src=src, dst=dst, n=n)


@m.action
def admit_adopt(l: Lane, r: Req, src: Block, n: INT):
    """Admit r into idle lane l by taking cache entry src over: its first n tokens are already
    the prompt's KV, so nothing is copied, and the prefill overwrites the rest. For when src is
    the only reusable block: a copy would need a second one, and a miss must not skip the hit
    (`no_cache_hit`), so without it the request would wait for a running one to end, forever
    when every other lane is idle (the seeds' stuck state: one lane, two blocks, the same prompt
    twice). With it the prefix cache costs no block beyond what the lanes need. The entry is
    gone afterwards (the policy copies instead whenever it can). Not for a hybrid model: its hit
    restores the sliding state as part of the copy (`copy_done`); its miss evicts the entry
    instead (`hybrid_evicts_its_hit`)."""
    live_when(PREFIX & ~HYBRID)
    require("not_hybrid", ~HYBRID)
    hits_entry(l, r, src, n)
    into_first_block(src, n)
    require("src_unpinned", ~pinned(src))
    occupy(l, r, src, n, src=src)
    # the lane's n tokens are the entry's first n (`prefix_matches`), whose KV the block holds
    assign(holds(src), take(holds(src), n))
    # Ghost: slot j of the block holds token start(src) + j; as the lane's first block it must
    # hold token j, so the block holds its own tokens only if it starts a sequence already.
    assign(junk(src), start(src) != 0)
    emit("admit", lane=l, request=r, block=src)


@m.action
def copy_done(l: Lane):
    """The runtime finished copying lane l's prefix hit (and, for a hybrid model, restoring the
    lane's local slot from its snapshot at the hit's length); the source is unpinned."""
    live_when(PREFIX)
    require("copy_in_flight", copying(l) & ~copy_host(l))
    assign(copying(l), False)
    assign(holds(tail(l)), take(holds(copy_src(l)), length(l)))
    # Ghost: the copy moves slot j of the source to slot j of the target, so the target holds
    # its own tokens only if both blocks sit at the same position of their sequences.
    assign(junk(tail(l)), start(copy_src(l)) != start(tail(l)))
    # Ghost: the restore reads the snapshot at length(l); it is the lane's own state there only
    # if the lane has one there (and its snapshots are sound).
    assign(local_holds(l), take(lane_seq(l), length(l)))
    assign(local_junk(l), lane_snap_junk(l) | (length(l) > lane_snap(l)))


@m.action
def snapshot(l: Lane):
    """Hybrid prefix cache: the host saves lane l's local slot (its sliding state) at the next
    chunk boundary, so that a later hit of that length can restore it."""
    live_when(HYBRID & PREFIX)
    require("hybrid_prefix_cache", HYBRID & PREFIX)
    require("lane_computing", computing(l))
    require("next_boundary", length(l) == lane_snap(l) + C)
    assign(lane_snap(l), length(l))
    # Ghost: the new snapshot holds whatever the slot holds, and a skipped boundary has none.
    assign(lane_snap_junk(l), lane_snap_junk(l) | local_junk(l)
           | (local_holds(l) != take(lane_seq(l), length(l))) | (length(l) != lane_snap(l) + C))
    assign(lane_snap_taken(l), ite(lane_snap_taken(l) < length(l), length(l),
                                   lane_snap_taken(l)))
    emit("snapshot", lane=l, n=length(l))


@m.action
def prefill(l: Lane, tok: INT):
    """Compute the next chunk of lane l's prompt; the last chunk samples the first token."""
    require("lane_prefilling", prefilling(l))
    require("no_copy_in_flight", ~copying(l))
    require("chunk_within_block", next_len(l) <= start(tail(l)) + S)
    done = next_len(l) == lane_plen(l)
    seq_after = ite(done, push(lane_seq(l), tok), lane_seq(l))
    assign(length(l), next_len(l))
    assign(lane_seq(l), seq_after)
    assign(holds(tail(l)), take(seq_after, next_len(l)))  # sampling adds no KV
    assign(local_holds(l), take(seq_after, next_len(l)))
    assign(phase(lane_req(l)), ite(done, Phase.DECODE, Phase.PREFILL))
    emit("prefill", lane=l, block=tail(l), start=length(l), end=next_len(l))


def extend(l, dst):
    """The updates `grow` and `grow_hit` share: lane l's full tail is now immutable, so it gets
    its content key (the whole prefix up to its end, as a hash chain would), ready to be cached
    when the request ends; dst becomes the lane's next block."""
    full = tail(l)
    assign(key(full), take(lane_seq(l), length(l)))
    assign(head(full), take(take(lane_seq(l), length(l)), C))
    # the lane's snapshots so far (all at or before the block's end): a hit into the entry it
    # becomes restores the sliding state at the hit's length from them
    assign(snap_upto(full), lane_snap(l))
    assign(snap_junk(full), lane_snap_junk(l))
    assign(snap_taken(full), lane_snap_taken(l))
    assign(tail(l), dst)
    assign(nblocks(l), nblocks(l) + 1)
    assign(start(dst), length(l))
    assign(owner(dst), Owner.LANE)
    assign(owner_lane(dst), l)
    emit("grow", lane=l, block=dst, pos=nblocks(l))


def at_block_boundary_mid_prompt(l):
    """The guards a hit into lane l's next block starts with (`grow_hit`, `grow_host_hit`): its
    tail is full in the middle of its prompt, with no copy in flight."""
    require("lane_prefilling", prefilling(l))
    require("no_copy_in_flight", ~copying(l))
    require("tail_full", tail_full(l))
    require("table_not_full", nblocks(l) < T)


def continues_prompt(l, k, n):
    """The guards on a hit's length (`grow_hit`, `grow_host_hit`): n more tokens (whole chunks,
    within a block) of an entry with key k, which agrees with lane l's prompt through them,
    and a token left to compute."""
    require("n_whole_chunks", (n > 0) & (n % C == 0))
    require("n_within_block", n <= S)
    require("n_within_entry", length(l) + n <= slen(k))
    require("token_left_to_compute", length(l) + n < lane_plen(l))
    require("prefix_matches", take(k, length(l) + n) == take(lane_seq(l), length(l) + n))


@m.action
def grow(l: Lane, dst: Block):
    """Lane l's tail is full and it has more to compute: dst becomes its next block."""
    live_when(T > 1)
    require("lane_computing", computing(l))
    require("tail_full", tail_full(l))
    require("table_not_full", nblocks(l) < T)
    require("dst_reusable", reusable(dst))
    extend(l, dst)
    assign(holds(dst), take(lane_seq(l), length(l)))  # none of its own tokens yet
    assign(junk(dst), False)


@m.action
def grow_hit(l: Lane, src: Block, dst: Block, n: INT):
    """A prefix hit that spans several blocks, one block at a time: lane l's tail is full in the
    middle of its prompt, and the cache entry src, at the same position of a sequence with the
    same prefix, holds n more of its tokens; dst becomes the lane's next block with those n
    tokens copied from src (`copy_done` ends the copy, and for a hybrid model restores the
    sliding state at length + n from the entry's snapshot there). Each block is copied, not
    shared: one rule for every runtime, and a block is never in two tables
    (docs/design/paged-tables.md)."""
    live_when(PREFIX & (T > 1))
    at_block_boundary_mid_prompt(l)
    require("src_cached", owner(src) == Owner.CACHE)
    require("src_at_the_boundary", start(src) == length(l))
    continues_prompt(l, key(src), n)
    require("hybrid_snapshot_at_n", implies(HYBRID, length(l) + n <= snap_upto(src)))
    require("dst_not_src", dst != src)
    require("dst_reusable", reusable(dst))
    extend(l, dst)
    assign(length(l), length(l) + n)
    # a hybrid lane takes the entry's snapshots up to the hit's end (its key agrees with the
    # prompt there), so copy_done restores the sliding state at length + n. (Its ghost flag
    # stays: the lane's and the entry's snapshots are both its own, so no update is needed.)
    assign(lane_snap(l), ite(length(l) + n <= snap_upto(src), length(l) + n, snap_upto(src)))
    assign(lane_snap_taken(l), ite(length(l) + n <= snap_taken(src), length(l) + n,
                                   snap_taken(src)))
    assign(junk(dst), True)  # nothing valid in it until the copy lands
    assign(copying(l), True)
    assign(copy_host(l), False)
    assign(copy_src(l), src)
    emit("copy", lane=l, src=src, dst=dst, n=n)


@m.action
def grow_adopt(l: Lane, src: Block, n: INT):
    """A hit past the first block when its entry is the only reusable block: lane l's tail is
    full in the middle of its prompt, and the cache entry src, at the same position of a
    sequence with the same prefix, holds n more of its tokens; src itself becomes the lane's
    next block (its slots are at the lane's own positions: nothing is copied), and the entry
    is gone. Without it the lane would grow into src as a plain block and compute those n
    tokens again (the policy copies instead whenever a second block is free). Not for a
    hybrid model: its hit restores the sliding state with the copy (`copy_done`)."""
    live_when(PREFIX & (T > 1) & ~HYBRID)
    require("not_hybrid", ~HYBRID)
    at_block_boundary_mid_prompt(l)
    require("src_cached", owner(src) == Owner.CACHE)
    require("src_at_the_boundary", start(src) == length(l))
    continues_prompt(l, key(src), n)
    require("src_unpinned", ~pinned(src))
    extend(l, src)
    assign(length(l), length(l) + n)
    # the lane's tokens up to length + n are the entry's (`prefix_matches`), whose KV it holds
    assign(holds(src), take(holds(src), length(l) + n))
    # Ghost: slot j of src holds token start(src) + j, the lane's own only at its boundary
    assign(junk(src), start(src) != length(l))


@m.action
def preempt(l: Lane):
    """Lane l's request goes back to the waiting queue to make room: some lane waits for a block
    (to grow, or a decode call for its padding target) and none is reusable. Its blocks are
    freed, never cached: their content is exactly what the restart recomputes. Its prompt
    becomes everything it has (prompt and sampled tokens), so the restart's prefill samples its
    next token."""
    live_when(PREEMPT)
    require("preemption_on", PREEMPT)
    require("lane_computing", computing(l))
    require("a_lane_waits_for_a_block", exists(Lane, lambda n: needs_block(n) | import_waits(n))
            | (~RESERVED & needs_scratch() & exists(Lane, lambda n: decoding(n))))
    require("no_block_reusable", forall(Block, lambda b: ~reusable(b)))
    # (<=, not <: a lane one token short of its table's end holds T * S tokens with the one it
    # sampled; its restart prefills them all, samples, and finishes at the table's end. Were it
    # never preemptable, lanes filling every block could leave a decode call no padding target.)
    require("requeue_fits", slen(lane_seq(l)) <= T * S)
    r = lane_req(l)
    assign(phase(r), Phase.WAITING)
    assign(prompt(r), lane_seq(l))
    assign(busy(l), False)
    assign_all(owner, lambda b: ite(lane_block(b, l), Owner.FREE, owner(b)))
    # a hybrid lane's snapshots go too (its full blocks are freed, not cached): the restart
    # recomputes its sliding state from its first token, as any admission does
    assign(lane_snap(l), 0)
    emit("preempt", lane=l, request=r)


@m.action
def decode(pad: Block, lpad: Lane, tok: fn_sort(Lane, ret=INT)):
    """One decode call over every row: decoding lanes append a token, other rows write padding
    into `pad` (the scratch target) and, for a hybrid model, into lane `lpad`'s local slot.
    With every lane busy and one not decoding there is no such slot: decode waits (the lane
    that is not decoding prefills, or its transfer ends). B + 1 local slots (a lane left idle)
    are what a hybrid model needs for decode never to wait."""
    require("no_block_overflow", forall(Lane, lambda l: implies(
        decoding(l), length(l) < start(tail(l)) + S)))
    require("scratch_target_ok", implies(needs_scratch(), scratch_ok(pad)))
    require("local_pad_ok", local_pad_ok(lpad))
    assign_all(length, lambda l: ite(decoding(l), length(l) + 1, length(l)))
    assign_all(lane_seq, lambda l: ite(decoding(l), push(lane_seq(l), tok(l)), lane_seq(l)))
    # A dynamic scratch target that was a cache entry is evicted by the scribble.
    assign_all(owner, lambda b: ite(
        needs_scratch() & ~RESERVED & (b == pad) & (owner(b) == Owner.CACHE),
        Owner.FREE, owner(b)))
    # Ghost: what each row's write does to the block it lands in. A write by a row that is not
    # the block's owning decoding lane is a scribble.
    assign_all(holds, lambda b: ite(
        (owner(b) == Owner.LANE) & decoding(owner_lane(b)) & (tail(owner_lane(b)) == b),
        # == take(lane_seq, length + 1): the token sampled now adds no KV yet
        take(push(lane_seq(owner_lane(b)), tok(owner_lane(b))), length(owner_lane(b)) + 1),
        holds(b)))
    assign_all(junk, lambda b: junk(b) | exists(Lane, lambda l: (row_block(l, pad) == b) & ~(
        decoding(l) & (owner(b) == Owner.LANE) & (owner_lane(b) == l))))
    # Ghost, hybrid: a decoding row appends its token's state to its own window; a padding
    # row's write into a slot shifts or overwrites whatever window it holds.
    assign_all(local_holds, lambda l: ite(
        decoding(l), take(push(lane_seq(l), tok(l)), length(l) + 1), local_holds(l)))
    assign_all(local_junk, lambda n: local_junk(n) | (HYBRID & exists(Lane, lambda l: (
        local_row(l, lpad) == n) & ~decoding(l))))
    emit("decode", rows=vector(Lane, lambda l: row_block(l, pad)),
         positions=vector(Lane, lambda l: row_position(l)),
         live=vector(Lane, lambda l: decoding(l)),
         local=vector(Lane, lambda l: local_row(l, lpad)))


@m.action
def finish(l: Lane, keep: BOOL):
    """Lane l's request is done; its block becomes a cache entry (keep) or free."""
    require("lane_decoding", decoding(l))
    require("keep_needs_prefix_cache", implies(keep, PREFIX))
    assign(phase(lane_req(l)), Phase.FINISHED)
    retire(l, keep)
    emit("release", lane=l, block=tail(l))


@m.action
def abort_waiting(r: Req):
    """The client gives up on a request that has no lane yet."""
    require("request_waiting", phase(r) == Phase.WAITING)
    assign(phase(r), Phase.ABORTED)


@m.action
def abort_running(l: Lane):
    """The client gives up on lane l's request; its partial KV is dropped, never cached."""
    require("lane_busy", busy(l))
    assign(phase(lane_req(l)), Phase.ABORTED)
    cancel(l)
    emit("release", lane=l, block=tail(l))


@m.action
def fail(l: Lane):
    """A runtime error attributed to lane l's request: it ends, its block may be half-written."""
    require("lane_busy", busy(l))
    assign(phase(lane_req(l)), Phase.FAILED)
    assign(junk(tail(l)), True)
    assign(local_junk(l), True)  # the failed call may have half-written the local slot too
    cancel(l)
    emit("release", lane=l, block=tail(l))


@m.action
def discard(b: Block):
    """A failed runtime call may have written into b, a block no lane owns (the padding target):
    whatever it held is gone, and a cache entry there is dropped."""
    require("not_a_lane_block", one_of(owner(b), Owner.FREE, Owner.CACHE, Owner.SCRATCH))
    require("not_pinned", ~pinned(b))
    assign(owner(b), ite(owner(b) == Owner.CACHE, Owner.FREE, owner(b)))
    assign(junk(b), True)


# ---------------------------------------------------------------- host cache
@m.action
def spill(b: Block, h: Slot):
    """Evict cache entry b to host slot h: the store (device -> host) pins both until it ends."""
    live_when(HOST)
    require("host_cache_on", HOST)
    require("entry_cached", owner(b) == Owner.CACHE)
    require("entry_unpinned", ~pinned(b))
    require("slot_empty", slot_state(h) == SlotState.EMPTY)
    assign(owner(b), Owner.SPILLING)
    assign(spill_slot(b), h)
    assign(slot_state(h), SlotState.STORING)
    assign(slot_block(h), b)
    assign(slot_key(h), key(b))
    assign(slot_head(h), head(b))  # (its content is the block's once store_done lands)
    assign(slot_start(h), start(b))
    emit("store", block=b, slot=h)


@m.action
def store_done(h: Slot):
    """The store into h completed: h is a host entry, and its device block is free."""
    live_when(HOST)
    require("slot_storing", slot_state(h) == SlotState.STORING)
    b = slot_block(h)
    assign(slot_state(h), SlotState.STORED)
    assign(owner(b), Owner.FREE)
    assign(slot_holds(h), holds(b))
    assign(slot_junk(h), junk(b))


@m.action
def store_fail(h: Slot):
    """The store into h failed: the entry is dropped (the device block is free, the slot empty)."""
    live_when(HOST)
    require("slot_storing", slot_state(h) == SlotState.STORING)
    assign(slot_state(h), SlotState.EMPTY)
    assign(owner(slot_block(h)), Owner.FREE)


@m.action
def host_evict(h: Slot):
    """Drop host entry h (never one a store writes or a load reads)."""
    live_when(HOST)
    require("slot_stored", slot_state(h) == SlotState.STORED)
    assign(slot_state(h), SlotState.EMPTY)


@m.action
def admit_host_hit(l: Lane, r: Req, h: Slot, dst: Block, n: INT):
    """Admit r into idle lane l by loading n tokens of host entry h into a fresh dst."""
    live_when(HOST)
    require("lane_idle", ~busy(l))
    require("request_waiting", phase(r) == Phase.WAITING)
    require("slot_stored", slot_state(h) == SlotState.STORED)
    require("n_whole_chunks", (n >= C) & (n % C == 0))
    require("n_within_entry", n <= slen(slot_key(h)))
    require("token_left_to_compute", n < slen(prompt(r)))
    require("prefix_matches", take(slot_key(h), n) == take(prompt(r), n))
    require("slot_first_block", slot_start(h) == 0)
    require("n_within_block", n <= S)
    require("dst_reusable", reusable(dst))
    occupy(l, r, dst, n)
    assign(junk(dst), True)  # nothing valid in it until the load lands
    assign(copying(l), True)
    assign(copy_host(l), True)
    assign(copy_slot(l), h)
    assign(slot_state(h), SlotState.LOADING)
    assign(load_lane(h), l)
    emit("admit", lane=l, request=r, block=dst)
    emit("load", lane=l, slot=h, dst=dst, n=n)


@m.action
def grow_host_hit(l: Lane, h: Slot, dst: Block, n: INT):
    """`grow_hit` from the host tier: lane l's tail is full in the middle of its prompt, and
    host entry h, at the same position of a sequence with the same prefix, holds n more of its
    tokens; dst becomes the lane's next block, loaded with those n tokens (`load_done` ends the
    load). The slot is read, not moved: it stays a host entry."""
    live_when(HOST & (T > 1))
    at_block_boundary_mid_prompt(l)
    require("slot_stored", slot_state(h) == SlotState.STORED)
    require("slot_at_the_boundary", slot_start(h) == length(l))
    continues_prompt(l, slot_key(h), n)
    require("dst_reusable", reusable(dst))
    extend(l, dst)
    assign(length(l), length(l) + n)
    assign(junk(dst), True)  # nothing valid in it until the load lands
    assign(copying(l), True)
    assign(copy_host(l), True)
    assign(copy_slot(l), h)
    assign(slot_state(h), SlotState.LOADING)
    assign(load_lane(h), l)
    emit("load", lane=l, slot=h, dst=dst, n=n)


@m.action
def load_done(l: Lane):
    """The load into lane l's block completed; its slot is a plain host entry again."""
    live_when(HOST)
    require("load_in_flight", copying(l) & copy_host(l))
    assign(copying(l), False)
    assign(holds(tail(l)), take(slot_holds(copy_slot(l)), length(l)))
    # Ghost: slot j of the entry lands in slot j of the tail, so the tail holds its own tokens
    # only if both sit at the same position of their sequences.
    assign(junk(tail(l)), slot_junk(copy_slot(l)) | (slot_start(copy_slot(l)) != start(tail(l))))
    assign(slot_state(copy_slot(l)), SlotState.STORED)


@m.action
def load_fail(l: Lane):
    """The load into lane l's block failed: the request recomputes that block's tokens (the
    blocks before it hold theirs; nothing past the block's start is read, so the half-written
    block is an empty one)."""
    live_when(HOST)
    require("load_in_flight", copying(l) & copy_host(l))
    assign(copying(l), False)
    assign(length(l), start(tail(l)))
    assign(holds(tail(l)), take(lane_seq(l), start(tail(l))))
    assign(junk(tail(l)), False)
    assign(slot_state(copy_slot(l)), SlotState.STORED)
    emit("recompute", lane=l)


# ---------------------------------------------------------------- PD: decode side
def end_transfer(r):
    """Ghost: r's transfer ended; it uses none of its blocks any more, whichever the step frees."""
    assign(xfer_live(r), False)
    assign_all(xfer_on, lambda b: xfer_on(b) & (xfer_of(b) != r))


@m.action
def admit_import(l: Lane, r: Req, dst: Block):
    """Admit r into idle lane l to receive its prompt's KV from a prefill worker, dst being its
    first block (`import_grow` adds the others). Never through the cache: the transfer writes
    the whole prompt into fresh blocks."""
    require("lane_idle", ~busy(l))
    require("request_waiting", phase(r) == Phase.WAITING)
    # An importing lane is never preempted (it computes nothing: `computing`), so with
    # preemption's smaller pool two of them each holding part of a table could wait for each
    # other forever. One table grows at a time; it takes blocks from computing lanes (`preempt`)
    # or from lanes whose transfer ends.
    require("one_import_table_growing", implies(PREEMPT, forall(Lane, lambda n: ~import_waits(n))))
    require("dst_reusable", reusable(dst))
    occupy(l, r, dst, 0, Phase.IMPORTING)
    # dst may be an evicted entry: its snapshots go with it (an imported lane takes none)
    assign(snap_upto(dst), 0)
    assign(transfer(dst), True)
    assign(transfer_req(dst), r)
    assign(xfer_live(r), True)
    assign(xfer_block(r), dst)
    assign(xfer_on(dst), True)
    assign(xfer_of(dst), r)
    # Ghost: only the transfer writes into dst from now on; any other write marks it junk.
    assign(junk(dst), False)
    emit("inbound", lane=l, request=r, block=dst)


@m.action
def import_grow(l: Lane, dst: Block):
    """Importing lane l's table does not reach its prompt's end yet: dst becomes its next block,
    pinned for the same transfer. The transfer writes only once the table covers the prompt
    (the adapter starts it then), so every block is in place before any KV lands."""
    live_when(T > 1)
    require("lane_importing", importing(l))
    require("table_short_of_prompt", start(tail(l)) + S < lane_plen(l))
    require("table_not_full", nblocks(l) < T)
    require("dst_reusable", reusable(dst))
    assign(tail(l), dst)
    assign(nblocks(l), nblocks(l) + 1)
    assign(start(dst), start(tail(l)) + S)
    assign(owner(dst), Owner.LANE)
    assign(owner_lane(dst), l)
    assign(snap_upto(dst), 0)  # as in admit_import
    assign(transfer(dst), True)
    assign(transfer_req(dst), lane_req(l))
    assign(xfer_on(dst), True)
    assign(xfer_of(dst), lane_req(l))
    assign(junk(dst), False)  # as in admit_import: only the transfer writes it from now on
    emit("grow", lane=l, block=dst, pos=nblocks(l))


@m.action
def import_done(r: Req, p: Seq, tok: INT):
    """r's transfer ended with KV for tokens p and first token tok. Accepted only while r is
    importing (a late or duplicate event changes nothing), when its table covers the prompt,
    and when p is r's whole prompt (a partial or mismatched result fails r through
    `transfer_fail`). Every block of the lane now holds its part; the full ones get their keys
    as `extend` gives them (no snapshots: an imported lane took none)."""
    require("request_importing", phase(r) == Phase.IMPORTING)
    l = req_lane(r)
    require("table_covers_prompt", table_covers_prompt(l))
    require("covers_prompt", p == prompt_kv(l, tok))
    b = tail(l)

    def full(c):
        return lane_block(c, l) & (c != b)

    assign_all(transfer, lambda c: ite(lane_block(c, l), False, transfer(c)))
    end_transfer(r)
    # what the transfer wrote: each block the prompt up to its end, the tail the whole prompt
    assign_all(holds, lambda c: ite(full(c), take(p, start(c) + S), ite(c == b, p, holds(c))))
    assign_all(key, lambda c: ite(full(c), take(p, start(c) + S), key(c)))
    assign_all(head, lambda c: ite(full(c), take(take(p, start(c) + S), C), head(c)))
    assign_all(snap_junk, lambda c: ite(full(c), False, snap_junk(c)))
    assign_all(snap_taken, lambda c: ite(full(c), 0, snap_taken(c)))
    assign(local_holds(l), p)  # a hybrid payload carries the prompt's sliding state too
    assign(length(l), lane_plen(l))
    assign(lane_seq(l), push(lane_seq(l), tok))
    assign(phase(r), Phase.DECODE)
    emit("imported", lane=l, request=r, block=b)


# ---------------------------------------------------------------- PD: prefill side
@m.action
def export(l: Lane):
    """Lane l has prefilled its prompt (and sampled the first token): its KV (every block of its
    table) is sent to a decode worker, pinned until the send ends."""
    require("lane_prefilled", decoding(l) & (length(l) == lane_plen(l)))
    assign(phase(lane_req(l)), Phase.EXPORTING)
    assign_all(transfer, lambda b: ite(lane_block(b, l), True, transfer(b)))
    assign_all(transfer_req, lambda b: ite(lane_block(b, l), lane_req(l), transfer_req(b)))
    assign(xfer_live(lane_req(l)), True)
    assign(xfer_block(lane_req(l)), tail(l))
    assign_all(xfer_on, lambda b: xfer_on(b) | lane_block(b, l))
    assign_all(xfer_of, lambda b: ite(lane_block(b, l), lane_req(l), xfer_of(b)))
    emit("outbound", lane=l, request=lane_req(l), block=tail(l), n=length(l))


@m.action
def export_done(r: Req, keep: BOOL):
    """r's KV was sent; its blocks are released (to the cache when keep)."""
    require("request_exporting", phase(r) == Phase.EXPORTING)
    require("keep_needs_prefix_cache", implies(keep, PREFIX))
    l = req_lane(r)
    assign(phase(r), Phase.FINISHED)
    assign_all(transfer, lambda b: ite(lane_block(b, l), False, transfer(b)))
    end_transfer(r)
    retire(l, keep)
    emit("release", lane=l, block=tail(l))


@m.action
def forget(r: Req):
    """The adapter drops an ended request it no longer reports: its id reads as never
    submitted again (a map keeps no entry at the initial value), so a long-running server does
    not keep every prompt it has served. Not while a block still drains for r (its transfer's
    end names r)."""
    require("request_ended", ended(r))
    require("no_transfer_of_request", forall(Block, lambda b: implies(
        owner(b) == Owner.DRAINING, transfer_req(b) != r)))
    assign(phase(r), Phase.NONE)
    assign(prompt(r), empty())


# ---------------------------------------------------------------- PD: both sides
@m.action
def transfer_fail(r: Req):
    """r's transfer ended without a usable result (an error; a partial, mismatched or
    unauthenticated payload): r fails and its blocks are freed, now that nothing uses them."""
    require("request_transferring", one_of(phase(r), Phase.IMPORTING, Phase.EXPORTING))
    l = req_lane(r)
    assign(phase(r), Phase.FAILED)
    assign_all(transfer, lambda b: ite(lane_block(b, l), False, transfer(b)))
    end_transfer(r)
    assign_all(junk, lambda b: junk(b) | lane_block(b, l))
    release(l, False)
    emit("release", lane=l, block=tail(l))


@m.action
def transfer_end(r: Req, b: Block):
    """r's transfer, which uses b, ended after r had ended (abort, failure): the deferred
    release of b and of every other block draining for r (one transfer, one end). Whatever it
    wrote is not trusted."""
    require("block_draining", owner(b) == Owner.DRAINING)
    require("transfer_of_request", transfer_req(b) == r)

    def drained(c):
        return (c == b) | ((owner(c) == Owner.DRAINING) & (transfer_req(c) == r))

    assign_all(owner, lambda c: ite(drained(c), Owner.FREE, owner(c)))
    assign_all(transfer, lambda c: ite(drained(c), False, transfer(c)))
    end_transfer(r)
    assign_all(junk, lambda c: junk(c) | drained(c))


# ---------------------------------------------------------------- invariants
inv = m.invariant

# Ownership: the lane tables and the owner function agree (so no block is in two tables). A
# lane's blocks are its tail and full blocks wholly before it.
inv("lane_block_owned", forall(Lane, lambda l: implies(busy(l), lane_block(tail(l), l))))
inv("owned_block_in_table", forall(Block, lambda b: implies(
    owner(b) == Owner.LANE, busy(owner_lane(b)) & (
        (tail(owner_lane(b)) == b) | (start(b) + S <= start(tail(owner_lane(b))))))))
inv("blocks_do_not_overlap", forall((Block, Block), lambda b, c: implies(
    (owner(c) == Owner.LANE) & lane_block(b, owner_lane(c)) & (b != c),
    (start(b) + S <= start(c)) | (start(c) + S <= start(b)))))
inv("lane_blocks_start_in_table", forall(Block, lambda b: implies(
    owner(b) == Owner.LANE, start(b) >= 0)))
inv("table_within_T", forall(Lane, lambda l: implies(
    busy(l), (nblocks(l) >= 1) & (nblocks(l) <= T))))
m.safety("no_block_in_two_tables", forall((Lane, Lane), lambda a, c: implies(
    busy(a) & busy(c) & (tail(a) == tail(c)), a == c)),
         doc="two busy lanes never write the same block")
inv("scratch_is_reserved_block", forall(Block, lambda b: (owner(b) == Owner.SCRATCH) == (
    RESERVED & (b == SCRATCH))))
inv("scratch_never_in_table", forall(Lane, lambda l: implies(
    busy(l), owner(tail(l)) != Owner.SCRATCH)))
inv("cache_needs_prefix_cache", forall(Block, lambda b: implies(owner(b) == Owner.CACHE, PREFIX)))

# Lifecycle: lanes and running requests are in bijection; nothing else holds a lane.
inv("busy_lane_runs_its_request", forall(Lane, lambda l: implies(
    busy(l), running(lane_req(l)) & (req_lane(lane_req(l)) == l))))
inv("running_request_has_lane", forall(Req, lambda r: implies(
    running(r), busy(req_lane(r)) & (lane_req(req_lane(r)) == r))))

# Content (ghost): the KV each block holds is what its owner says it is.
m.safety("lane_holds_its_tokens", forall(Lane, lambda l: implies(
    busy(l) & ~copying(l) & ~importing(l),
    ~junk(tail(l)) & (holds(tail(l)) == take(lane_seq(l), length(l))))),
         doc="a lane's block holds the KV of exactly its request's tokens")
# A full block is never written again; it holds its key (the lane's prefix up to its end, taken
# when it filled), ready to be a cache entry.
inv("full_block_holds_its_key", forall(Block, lambda b: implies(
    (owner(b) == Owner.LANE) & (tail(owner_lane(b)) != b) & ~importing(owner_lane(b)),
    ~junk(b) & (holds(b) == key(b)) & (head(b) == take(key(b), C)) & ~snap_junk(b)
    & (snap_upto(b) >= 0))))
m.safety("cache_key_is_content", forall(Block, lambda b: implies(
    owner(b) == Owner.CACHE, ~junk(b) & (holds(b) == key(b)))),
         doc="a cache entry holds the KV of its key: a hit copies what it claims")
inv("cache_head_is_first_chunk", forall(Block, lambda b: implies(
    owner(b) == Owner.CACHE, head(b) == take(key(b), C))))
inv("unsubmitted_request_has_no_prompt", forall(Req, lambda r: implies(
    phase(r) == Phase.NONE, prompt(r) == empty())))
# ... and a submitted one keeps its prompt until it is forgotten (results and replays name it).
inv("submitted_request_has_prompt", forall(Req, lambda r: implies(
    phase(r) != Phase.NONE, slen(prompt(r)) > 0)))

# Fit: a prompt that could never fit a block is never accepted.
inv("waiting_prompt_fits", forall(Req, lambda r: implies(
    phase(r) == Phase.WAITING, (slen(prompt(r)) > 0) & (slen(prompt(r)) <= T * S))))
inv("lane_prompt_fits", forall(Lane, lambda l: implies(
    busy(l), (lane_plen(l) > 0) & (lane_plen(l) <= T * S))))
# A lane's sequence is its prompt until the prefill samples, then one token past its KV: what a
# preempted request's new prompt is made of.
inv("lane_seq_length", forall(Lane, lambda l: implies(
    busy(l), slen(lane_seq(l)) == ite(prefilling(l) | importing(l), lane_plen(l),
                                      length(l) + 1))))

# Copies: the source of an in-flight copy is a pinned cache entry holding the lane's prefix.
inv("lane_computes_its_prompt", forall(Lane, lambda l: implies(
    prefilling(l) | importing(l), (lane_seq(l) == prompt(lane_req(l)))
    & (lane_plen(l) == slen(prompt(lane_req(l)))))))
inv("copy_only_while_prefilling", forall(Lane, lambda l: implies(copying(l), prefilling(l))))
inv("copy_source_cached", forall(Lane, lambda l: implies(
    copying(l) & ~copy_host(l), (owner(copy_src(l)) == Owner.CACHE) & (copy_src(l) != tail(l)))))
inv("copy_target_not_ready", forall(Lane, lambda l: implies(copying(l), junk(tail(l)))))
# A copy lands where it was read: slot j of the source (a device entry or a host slot) at slot j
# of the tail, both at the same position of their sequences.
inv("copy_at_its_position", forall(Lane, lambda l: implies(
    copying(l), ite(copy_host(l), slot_start(copy_slot(l)) == start(tail(l)),
                    start(copy_src(l)) == start(tail(l))))))
inv("copy_source_holds_prefix", forall(Lane, lambda l: implies(
    copying(l) & ~copy_host(l), (length(l) <= slen(key(copy_src(l))))
    & (take(key(copy_src(l)), length(l)) == take(lane_seq(l), length(l))))))

# Hybrid: a lane's local slot holds its own sequence's sliding state (reset on admission, never
# written by another lane's row).
inv("lane_local_state_is_its_own", forall(Lane, lambda l: implies(
    HYBRID & busy(l) & ~importing(l) & ~copying(l),
    ~local_junk(l) & (local_holds(l) == take(lane_seq(l), length(l))))))
# Hybrid prefix cache: a lane's and an entry's snapshots hold the sliding state of prefixes of
# its own tokens, at boundaries it has reached; so a hit restores the state at its own length.
inv("lane_snapshots_are_its_own", forall(Lane, lambda l: implies(
    busy(l), ~lane_snap_junk(l) & (lane_snap(l) >= 0) & (lane_snap(l) <= length(l)))))
# ... and exactly those the host holds: never one it was not given (a hit would restore the
# sliding state from nothing), never fewer (a cached block would serve no hybrid hit).
inv("lane_snapshots_were_taken", forall(Lane, lambda l: implies(
    busy(l), lane_snap(l) == lane_snap_taken(l))))
inv("entry_snapshots_were_taken", forall(Block, lambda b: implies(
    (owner(b) == Owner.CACHE) | ((owner(b) == Owner.LANE) & (tail(owner_lane(b)) != b)
                                & ~importing(owner_lane(b))),
    snap_upto(b) == snap_taken(b))))
# An importing lane's blocks carry no snapshots (an evicted entry's went with it when the lane
# took the block): the adapter holds none for them, and import_done leaves them so.
inv("importing_blocks_have_no_snapshots", forall(Block, lambda b: implies(
    (owner(b) == Owner.LANE) & importing(owner_lane(b)), snap_upto(b) == 0)))
inv("idle_lane_has_no_snapshots", forall(Lane, lambda l: implies(~busy(l), lane_snap(l) == 0)))
inv("entry_snapshots_are_its_own", forall(Block, lambda b: implies(
    owner(b) == Owner.CACHE, ~snap_junk(b) & (snap_upto(b) >= 0))))
# Without sliding-window layers there is no sliding state: nothing is snapshotted, and a lane
# whose load fails (`load_fail`) recomputes from its block's start with no snapshot past it.
inv("snapshots_need_hybrid", forall(Lane, lambda l: implies(~HYBRID, lane_snap(l) == 0))
    & forall(Block, lambda b: implies(~HYBRID, snap_upto(b) == 0)))
inv("hybrid_hit_has_snapshot", forall(Lane, lambda l: implies(
    HYBRID & copying(l), lane_snap(l) == length(l))))

# Host cache: a spilling block and its slot's store name each other, and the block holds the
# slot's key until the store lands; a stored or loading slot holds its key; a loading slot and
# its lane's load name each other, and the slot holds the lane's prefix.
inv("spilling_block_has_its_store", forall(Block, lambda b: implies(
    owner(b) == Owner.SPILLING, (slot_state(spill_slot(b)) == SlotState.STORING)
    & (slot_block(spill_slot(b)) == b))))
inv("storing_slot_key_is_content", forall(Slot, lambda h: implies(
    slot_state(h) == SlotState.STORING,
    ~junk(slot_block(h)) & (holds(slot_block(h)) == slot_key(h)))))
inv("storing_slot_reads_a_spilling_block", forall(Slot, lambda h: implies(
    slot_state(h) == SlotState.STORING,
    (owner(slot_block(h)) == Owner.SPILLING) & (spill_slot(slot_block(h)) == h)
    & (slot_start(h) == start(slot_block(h))))))
m.safety("host_key_is_content", forall(Slot, lambda h: implies(
    one_of(slot_state(h), SlotState.STORED, SlotState.LOADING),
    ~slot_junk(h) & (slot_holds(h) == slot_key(h)))),
         doc="a stored host entry holds the KV of its key")
inv("host_head_is_first_chunk", forall(Slot, lambda h: implies(
    slot_state(h) != SlotState.EMPTY, slot_head(h) == take(slot_key(h), C))))
inv("loading_slot_has_its_lane", forall(Slot, lambda h: implies(
    slot_state(h) == SlotState.LOADING, copying(load_lane(h)) & copy_host(load_lane(h))
    & (copy_slot(load_lane(h)) == h))))
inv("load_reads_a_loading_slot", forall(Lane, lambda l: implies(
    copying(l) & copy_host(l), (slot_state(copy_slot(l)) == SlotState.LOADING)
    & (load_lane(copy_slot(l)) == l) & (lane_snap(l) == 0)
    & (length(l) <= slen(slot_key(copy_slot(l))))
    & (take(slot_key(copy_slot(l)), length(l)) == take(lane_seq(l), length(l))))))
inv("host_needs_host_cache", forall(Slot, lambda h: implies(
    slot_state(h) != SlotState.EMPTY, HOST)) & forall(Block, lambda b: implies(
        owner(b) == Owner.SPILLING, HOST)))

# PD transfers: a block in a transfer is held by its lane's transfer or drains; every drain and
# every transferring lane has its transfer (so once transfers end, every such pin is released).
inv("transfer_block_held", forall(Block, lambda b: implies(
    transfer(b), (owner(b) == Owner.DRAINING)
    | ((owner(b) == Owner.LANE) & moving(owner_lane(b))))))
inv("draining_has_transfer", forall(Block, lambda b: implies(
    owner(b) == Owner.DRAINING, transfer(b) & ended(transfer_req(b)))))
inv("transfer_names_lane_request", forall(Block, lambda b: implies(
    transfer(b) & (owner(b) == Owner.LANE), transfer_req(b) == lane_req(owner_lane(b)))))
inv("running_transfer_pins_its_block", forall(Req, lambda r: implies(
    xfer_live(r), transfer(xfer_block(r)) & (transfer_req(xfer_block(r)) == r))))
inv("pinned_block_transfer_running", forall(Block, lambda b: implies(
    transfer(b), xfer_live(transfer_req(b)))))
m.safety("transfer_pins_what_it_uses", forall(Block, lambda b: transfer(b) == xfer_on(b)),
         doc="every block a PD transfer reads or writes is pinned until it ends")
inv("pinned_for_its_transfer", forall(Block, lambda b: implies(
    xfer_on(b), (transfer_req(b) == xfer_of(b)) & xfer_live(xfer_of(b)))))
inv("moving_lane_has_transfer", forall((Lane, Block), lambda l, b: implies(
    moving(l) & lane_block(b, l), transfer(b))))
# An importing lane's blocks wait for the transfer alone: nothing else writes them, its table
# never passes the prompt's end (its last block starts before it); it is never preempted (it
# computes nothing).
inv("import_target_untouched", forall(Lane, lambda l: implies(
    importing(l), ~local_junk(l) & (length(l) == 0) & ~copying(l)
    & (start(tail(l)) < lane_plen(l)))))
# With preemption one importing table grows at a time (`admit_import`): two could each hold part
# of the pool and wait for each other, neither computing, so neither preemptable.
inv("imports_grow_one_at_a_time", forall((Lane, Lane), lambda l, n: implies(
    PREEMPT & import_waits(l) & import_waits(n), l == n)))
inv("import_blocks_untouched", forall((Lane, Block), lambda l, b: implies(
    importing(l) & lane_block(b, l), ~junk(b))))
inv("export_after_prefill", forall(Lane, lambda l: implies(
    exporting(l), (length(l) == lane_plen(l)) & ~copying(l))))

# Lengths: nothing is written past the tail's end; prefill resumes on chunk boundaries.
# (An importing lane's length stays 0 while its table grows toward the prompt's end.)
inv("length_within_block", forall(Lane, lambda l: implies(
    busy(l), (start(tail(l)) >= 0) & (length(l) <= start(tail(l)) + S)
    & implies(~importing(l), length(l) >= start(tail(l))))))
inv("prefill_before_prompt_end", forall(Lane, lambda l: implies(
    prefilling(l), length(l) < lane_plen(l))))
inv("decode_after_prompt", forall(Lane, lambda l: implies(
    decoding(l), length(l) >= lane_plen(l))))

# Two kinds here (declared in this order: z3's search depends on the order of the hypotheses).
# Arithmetic: positions modulo the chunk, multiples of the block size; linear once C and S are
# numbers (with symbolic ones `%` and `*` are nonlinear), so proved for all lanes and blocks at
# the chunk and block size the bounded checks fix. Bounded: counting, proved for each size up
# to the cutoff (first-order logic over unbounded sorts cannot count).
inv("prefill_on_chunk_boundary", forall(Lane, lambda l: implies(
    prefilling(l), length(l) % C == 0)), arithmetic=True)
inv("lane_blocks_are_its_table", forall(Lane, lambda l: count_of(
    Block, lambda b: lane_block(b, l)) == ite(busy(l), nblocks(l), 0)), bounded=True)
# With `blocks_do_not_overlap` and `lane_blocks_are_its_table`: a lane's nblocks blocks lie in
# [0, (nblocks - 1) * S] at least S apart, so they start at 0, S, .., (nblocks - 1) * S: what the
# runtime's table[p // S] assumes.
inv("tables_are_dense", forall(Lane, lambda l: implies(
    busy(l), start(tail(l)) == (nblocks(l) - 1) * S)), arithmetic=True)
inv("snapshots_on_chunk_boundaries", forall(Lane, lambda l: implies(
    busy(l), lane_snap(l) % C == 0)) & forall(Block, lambda b: snap_upto(b) % C == 0),
    arithmetic=True)
inv("one_scratch_block_when_reserved",
    count_of(Block, lambda b: owner(b) == Owner.SCRATCH) == ite(RESERVED, 1, 0),
    bounded=True)

# ---------------------------------------------------------------- transition invariants
# An ended request never runs or waits again: it stays ended until forgotten (reads as new).
m.transition_invariant("ended_is_final", forall(Req, lambda r: implies(
    ended(r), (phase.post(r) == phase(r))
    | ((phase.post(r) == Phase.NONE) & (prompt.post(r) == empty())))))
# Without preemption a running request's work is never thrown away: it never waits again.
m.transition_invariant("requeued_only_by_preemption", forall(Req, lambda r: implies(
    running(r) & ~PREEMPT, phase.post(r) != Phase.WAITING)))
m.transition_invariant("host_content_untouched", forall(Slot, lambda h: implies(
    one_of(slot_state(h), SlotState.STORED, SlotState.LOADING)
    & one_of(slot_state.post(h), SlotState.STORED, SlotState.LOADING),
    (slot_holds.post(h) == slot_holds(h)) & (slot_key.post(h) == slot_key(h))
    & ~slot_junk.post(h))))
m.transition_invariant("cached_content_untouched", forall(Block, lambda b: implies(
    (owner(b) == Owner.CACHE) & (owner.post(b) == Owner.CACHE),
    (holds.post(b) == holds(b)) & (key.post(b) == key(b)) & ~junk.post(b))))

# ---------------------------------------------------------------- progress
def admission_room():
    """Without preemption every lane has room for a whole table, so an idle lane can always
    admit; with it, only one lane is sure to (a request admitted beside others may be
    preempted, and waits until a block is free)."""
    return ~PREEMPT | forall(Lane, lambda l: ~busy(l))


m.progress_property("idle_lane_admits", forall((Lane, Req), lambda l, r: implies(
    quiescent() & ~busy(l) & (phase(r) == Phase.WAITING) & admission_room(),
    enabled(admit_miss, l=l, r=r) | enabled(admit_hit, l=l, r=r, n=C)
    | enabled(admit_adopt, l=l, r=r, n=C))),
    doc="an idle lane and a waiting request can always be admitted (evicting if needed)")
m.progress_property("running_request_advances", implies(
    exists(Req, lambda r: running(r)),
    exists(Lane, lambda l: enabled(prefill, l=l))
    | exists(Lane, lambda l: enabled(copy_done, l=l))
    | exists(Lane, lambda l: enabled(load_done, l=l))
    | exists(Slot, lambda h: enabled(store_done, h=h))
    | (exists(Lane, lambda l: decoding(l)) & enabled(decode))
    | exists(Lane, lambda l: enabled(grow, l=l))
    | exists(Lane, lambda l: at_table_end(l))
    | exists(Lane, lambda l: enabled(import_grow, l=l))
    | exists(Lane, lambda l: (exporting(l) | (importing(l) & table_covers_prompt(l)))
             & enabled(transfer_fail, r=lane_req(l)))
    | exists(Block, lambda b: enabled(transfer_end, r=transfer_req(b), b=b))
    | exists(Lane, lambda l: enabled(preempt, l=l))),
    doc="some running request can always compute its next token, or must finish, or a PD "
        "transfer it waits for is still in flight, or a lane can be preempted to make room")
# Preemption makes progress only if it is not the lane that needs the block that must go: a
# lane running alone gets every block it needs, for its table and as the decode call's padding
# target (so a policy that never preempts the oldest lane while another can go lets the oldest
# lane finish, and then the next).
m.progress_property("lone_lane_is_never_preempted", forall(Lane, lambda l: implies(
    quiescent() & forall(Lane, lambda n: implies(n != l, ~busy(n))),
    ~enabled(preempt, l=l))),
    doc="a lane running alone never has to be preempted: it can finish at max_seq_len")
m.progress_property("idle_lane_imports", forall((Lane, Req), lambda l, r: implies(
    quiescent() & ~busy(l) & (phase(r) == Phase.WAITING) & admission_room(),
    enabled(admit_import, l=l, r=r))),
    doc="an idle lane can always take a request whose KV comes from a prefill worker (with "
        "preemption: when no lane is busy, as for `idle_lane_admits`)")
m.progress_property("import_table_grows", forall(Lane, lambda l: implies(
    quiescent() & import_waits(l), enabled(import_grow, l=l)
    # with preemption's smaller pool the block may have to come from a computing lane, from a
    # lane at its table's end (it finishes), or from a lane whose transfer is in flight (it
    # decodes, and can be preempted, once the transfer ends)
    | (PREEMPT & (exists(Lane, lambda n: enabled(preempt, l=n) | at_table_end(n))
                  | exists(Lane, lambda n: moving(n) & ~import_waits(n)))))),
    doc="an importing lane always gets its next block until its table covers the prompt (so "
        "its transfer can start); with preemption, or a computing lane can be preempted for "
        "it, or a lane at its table's end finishes, or another lane's transfer is in flight",
    live_when=T > 1)
m.progress_property("transfers_end", forall(Block, lambda b: implies(
    transfer(b), enabled(transfer_end, r=transfer_req(b), b=b)
    | enabled(transfer_fail, r=transfer_req(b)))),
    doc="every block a transfer pins is released when the transfer ends")

m.progress_property("stores_end", forall(Slot, lambda h: implies(
    slot_state(h) == SlotState.STORING, enabled(store_done, h=h) | enabled(store_fail, h=h))),
    doc="every store to the host tier can end, releasing its device block", live_when=HOST)

MODEL = m
# The actions only prefill/decode disaggregation uses; colocated serving never takes them.
PD_ACTIONS = ("admit_import", "import_grow", "import_done", "export", "export_done",
              "transfer_fail", "transfer_end")
# The actions only the host cache tier uses.
HOST_ACTIONS = ("spill", "store_done", "store_fail", "host_evict", "admit_host_hit",
                "grow_host_hit", "load_done", "load_fail")
