"""RblnRuntime against a fake `rebel` module whose runtimes check every positional input's dtype
and shape like a compiled graph (and fail loudly otherwise), record every call, and compute with
a torch reference model, so tokens through the binding can be checked against the oracle."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from atom_core.batcher import AtomBatcher
from atom_core.config import Config
from atom_core.runtime import (
    RblnRuntime,
    RblnUnavailableError,
    Runtime,
    RuntimeInputError,
    RuntimeSpec,
    TorchReferenceRuntime,
)
from atom_core.runtime.rbln import GraphInputs, RblnArtifactError, RblnCapabilityError

C, S, K, V = 64, 256, 6, 128
SIZES = (4, 2, 1)
i64, i32, i16 = torch.int64, torch.int32, torch.int16


def prefill_signature(hybrid: bool, t: int = 1) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [("input_ids", i64, (1, C)), ("cache_position", i32, (1, C)),
            ("block_tables", i16, (t,)),
            *([("local_block_tables", i16, (1,))] if hybrid else []),
            ("query_position", i16, ())]


def decode_signature(b: int, hybrid: bool,
                     t: int = 1) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [("input_ids", i64, (b, 1)), ("cache_position", i32, (b, 1)),
            ("block_tables", i16, (b, t)),
            *([("local_block_tables", i16, (b, 1))] if hybrid else [])]


class FakeRuntime:
    """A stand-in for rebel.Runtime: one compiled graph with a fixed positional signature."""

    def __init__(self, compiled: Any, tensor_type: str = "numpy", device: Any = 0,
                 **kwargs: Any) -> None:
        self.name, self.path = Path(compiled.path).stem, compiled.path
        self.tensor_type, self.device, self.kwargs = tensor_type, device, kwargs
        self.world = compiled.world
        self.calls: list[tuple[str, tuple]] = []
        hybrid = self.world["hybrid"]
        t = self.world.get("T", 1)  # blocks per table of the artifact
        if self.name == "prefill":
            self.signature = prefill_signature(hybrid, t)
        else:
            self.signature = decode_signature(int(self.name.removeprefix("decoder_batch_")),
                                              hybrid, t)
        self.world["runtimes"][self.name] = self

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert not kwargs, f"{self.name}: graphs are called positionally, got {sorted(kwargs)}"
        assert self.tensor_type == "pt", f"{self.name}: loaded with tensor_type={self.tensor_type}"
        assert len(args) == len(self.signature), \
            f"{self.name}: expected {len(self.signature)} inputs, got {len(args)}"
        for i, (a, (name, dtype, shape)) in enumerate(zip(args, self.signature, strict=True)):
            assert isinstance(a, torch.Tensor), f"{self.name} input {i} ({name}) is {type(a)}"
            assert a.dtype == dtype and tuple(a.shape) == shape, (
                f"{self.name} input {i} ({name}): expected {dtype} {list(shape)}, "
                f"got {a.dtype} {list(a.shape)}")
        self.calls.append(("run", tuple(a.clone() for a in args)))
        ref = self.world["ref"]
        if ref is None:
            rows = 1 if self.name == "prefill" else self.signature[0][2][0]
            return torch.zeros(rows, 1, V)
        if self.name == "prefill":
            # the binding zeroes a short chunk's padding positions, as optimum-rbln does (the
            # kernel reads only the chunk's start); the reference checks them all
            start = int(args[1][0, 0])
            pos = torch.arange(start, start + C, dtype=i32).unsqueeze(0)
            return ref.prefill(args[0], pos, args[2], None, args[-1])
        return ref.decode(*args[:3], None)

    # the KV-cache methods vllm-rbln uses on a rebel runtime
    def _copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        self.calls.append(("copy", (src, dst, num_tokens)))
        if self.world["ref"] is not None:
            self.world["ref"].copy_kv_cache(src, dst, num_tokens)

    def _fetch_kv_cache(self, host: Any, block: int, offset: int, size: int,
                        layer: Any) -> None:
        self.calls.append(("fetch", (host, block, offset, size, layer)))
        if self.world["ref"] is not None:
            self.world["ref"].fetch_kv_cache(host, block)

    def _update_kv_cache(self, host: Any, block: int, offset: int, size: int,
                         layer: Any) -> None:
        self.calls.append(("update", (host, block, offset, size, layer)))
        if self.world["ref"] is not None:
            self.world["ref"].update_kv_cache(host, block)

    def _get_kv_cache_size(self, layer: Any) -> int:
        return 1000


class FakeCompiledModel:
    def __init__(self, path: str, world: dict) -> None:
        assert Path(path).exists(), f"no compiled file {path}"
        self.path, self.world = path, world


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Installs a fake `rebel` (and `rebel.kv_cache`) backed by a reference model."""
    spec = RuntimeSpec(num_blocks=K, block_size=S, max_seq_len=S, prefill_chunk=C,
                       batch_size=4, decoder_batch_sizes=SIZES)
    w: dict = {"ref": TorchReferenceRuntime(spec), "hybrid": False, "batch_size": 4,
               "runtimes": {}, "aligned": []}
    rebel = types.ModuleType("rebel")
    rebel.Runtime = FakeRuntime
    rebel.RBLNCompiledModel = lambda path: FakeCompiledModel(path, w)
    kv_cache = types.ModuleType("rebel.kv_cache")

    def aligned_tensor(n: int, dtype: Any, alignment: int, tensor_type: str) -> torch.Tensor:
        w["aligned"].append((n, dtype, alignment, tensor_type))
        return torch.zeros(n, dtype=torch.float16)

    kv_cache.aligned_tensor = aligned_tensor
    rebel.kv_cache = kv_cache
    monkeypatch.setitem(sys.modules, "rebel", rebel)
    monkeypatch.setitem(sys.modules, "rebel.kv_cache", kv_cache)
    return w


def write_artifact(root: Path, names: list[str], **cfg: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    base = {"batch_size": 4, "decoder_batch_sizes": list(SIZES), "max_seq_len": S,
            "kvcache_block_size": S, "kvcache_num_blocks": K, "prefill_chunk_size": C}
    (root / "rbln_config.json").write_text(json.dumps({**base, **cfg}))
    (root / "config.json").write_text(json.dumps({"vocab_size": V}))
    for n in names:
        (root / f"{n}.rbln").write_bytes(b"")
    return root


ALL = ["prefill", "decoder_batch_4", "decoder_batch_2", "decoder_batch_1"]


@pytest.fixture
def rt(world: dict, tmp_path: Path) -> RblnRuntime:
    return RblnRuntime.from_compiled(write_artifact(tmp_path / "m", ALL), device=3)


def test_from_compiled_loads_every_graph(rt: RblnRuntime, world: dict) -> None:
    assert isinstance(rt, Runtime)
    assert (rt.num_blocks, rt.block_size, rt.max_seq_len, rt.prefill_chunk, rt.vocab_size) == \
        (K, S, S, C, V)
    assert rt.decoder_batch_sizes == SIZES and rt.batch_size == 4
    assert not rt.uses_local_block_tables
    assert sorted(world["runtimes"]) == sorted(ALL)
    assert all(r.tensor_type == "pt" and r.device == 3 for r in world["runtimes"].values())


def test_tokens_through_the_binding_match_the_oracle(rt: RblnRuntime, world: dict) -> None:
    """Requests in lanes 0 and 2 (graph of 4 rows, padding rows 1 and 3 at the scratch block),
    then lane 0 alone (graph of 1 row)."""
    ref: TorchReferenceRuntime = world["ref"]
    reqs = {0: (ref_prompt(100, 1), 12, 2), 2: (ref_prompt(7, 2), 5, 4)}   # lane: prompt, n, block
    scratch = 5
    seqs = {}
    for lane, (p, _, blk) in reqs.items():
        for s in range(0, len(p), C):
            chunk = p[s:s + C]
            logits = rt.prefill([chunk + [0] * (C - len(chunk))], [list(range(s, s + C))],
                                [blk], None, len(chunk) - 1)   # plain lists: the binding converts
        seqs[lane] = p + [int(torch.argmax(logits))]
    used = []
    while True:
        busy = [lane for lane, (p, n, _) in reqs.items() if len(seqs[lane]) - len(p) < n]
        if not busy:
            break
        b = rt.decode_batch_size(busy)
        used.append(b)
        rows = [(seqs[r][-1], len(seqs[r]) - 1, reqs[r][2]) if r in busy else (0, 0, scratch)
                for r in range(b)]
        logits = rt.decode([[t] for t, _, _ in rows], [[p] for _, p, _ in rows],
                           [[blk] for _, _, blk in rows], None)
        for r in busy:
            seqs[r].append(int(torch.argmax(logits[r, 0])))
    for lane, (p, n, _) in reqs.items():
        assert seqs[lane][len(p):] == ref.generate(p, n)
    assert used == [4] * 4 + [1] * 7
    assert len(world["runtimes"]["decoder_batch_1"].calls) == 7
    assert world["runtimes"]["decoder_batch_2"].calls == []


def ref_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_exact_dtypes_reach_the_graphs(rt: RblnRuntime, world: dict) -> None:
    rt.prefill(torch.zeros(1, C, dtype=torch.int32), torch.arange(C)[None],
               torch.tensor([1]), None, torch.tensor(5))
    rt.decode(torch.zeros(4, 1, dtype=torch.int16), torch.zeros(4, 1, dtype=torch.int64),
              torch.tensor([[1], [5], [5], [5]], dtype=torch.int64), None)
    (kind, args), = world["runtimes"]["prefill"].calls
    assert [(a.dtype, tuple(a.shape)) for a in args] == \
        [(d, s) for _, d, s in prefill_signature(False)]
    assert int(args[-1]) == 5
    (kind, args), = world["runtimes"]["decoder_batch_4"].calls
    assert [(a.dtype, tuple(a.shape)) for a in args] == \
        [(d, s) for _, d, s in decode_signature(4, False)]


def test_smaller_decode_graph_gets_a_table_with_its_row_count(rt: RblnRuntime,
                                                              world: dict) -> None:
    assert rt.decode_batch_size([0]) == 1
    assert rt.decode_batch_size([1]) == 2
    assert rt.decode_batch_size([0, 2]) == 4
    assert rt.decode_batch_size([3]) == 4
    with pytest.raises(RuntimeInputError):
        rt.decode_batch_size([4])
    rt.decode([[3]], [[0]], [[1]], None)
    (_, args), = world["runtimes"]["decoder_batch_1"].calls
    assert tuple(args[2].shape) == (1, 1)
    # the real bug: a full-batch block table handed to a smaller graph is refused up front
    with pytest.raises(RuntimeInputError, match="block_tables must have shape"):
        rt.decode([[3]], [[0]], [[1], [5], [5], [5]], None)
    with pytest.raises(RuntimeInputError, match="no decode graph has 3 rows"):
        rt.decode([[3]] * 3, [[0]] * 3, [[5]] * 3, None)
    assert len(world["runtimes"]["decoder_batch_1"].calls) == 1


def test_the_fake_graph_fails_loudly_on_a_wrong_input(rt: RblnRuntime, world: dict) -> None:
    """Proof that the fake would catch a binding that builds the wrong tensors."""
    dec1 = world["runtimes"]["decoder_batch_1"]
    ok = (torch.zeros(1, 1, dtype=i64), torch.zeros(1, 1, dtype=i32), torch.zeros(1, 1, dtype=i16))
    dec1(*ok)
    with pytest.raises(AssertionError, match="block_tables.*expected torch.int16 \\[1, 1\\]"):
        dec1(*ok[:2], torch.zeros(4, 1, dtype=i16))
    with pytest.raises(AssertionError, match="expected torch.int32"):
        dec1(ok[0], ok[1].long(), ok[2])
    with pytest.raises(AssertionError, match="expected 3 inputs"):
        dec1(*ok, torch.zeros(1, 1, dtype=i16))
    with pytest.raises(AssertionError, match="positionally"):
        world["runtimes"]["prefill"](input_ids=ok[0])


def test_block_operations_map_to_the_runtime_kv_methods(world: dict, tmp_path: Path) -> None:
    rt = RblnRuntime.from_compiled(write_artifact(tmp_path / "m", ALL), host_kv_transfers=True)
    pre = world["runtimes"]["prefill"]
    rt.copy_kv_cache(1, 2, 64)
    host = world["ref"].new_host_buffer()
    rt.fetch_kv_cache(host, 3)
    rt.update_kv_cache(host, 4)
    assert [(k, a if k == "copy" else a[1:]) for k, a in pre.calls] == [
        ("copy", (1, 2, 64)), ("fetch", (3, 0, S, None)), ("update", (4, 0, S, None))]
    assert pre.calls[1][1][0] is host and pre.calls[2][1][0] is host
    for bad in ((1, 1, 3), (1, K, 3), (1, 2, S + 1)):
        with pytest.raises(RuntimeInputError):
            rt.copy_kv_cache(*bad)
    with pytest.raises(RuntimeInputError):
        rt.fetch_kv_cache(host, -1)
    assert len(pre.calls) == 3


def kv_meta(i: int, layer_type: str, shape: list[int], dtype: str = "float16") -> dict:
    return {"name": f"past_key_values_{i}", "layer_index": i // 2, "shape": shape,
            "layer_type": layer_type, "is_auto": False, "dtype": dtype}


def test_host_transfers_are_off_unless_asked(rt: RblnRuntime, world: dict) -> None:
    """No wheel moves single blocks through the host: until a device shows fetch/update move
    exactly one block's content, the host tier and PD are refused unless opted into."""
    host = torch.zeros(8)
    for call in (lambda: rt.fetch_kv_cache(host, 1), lambda: rt.update_kv_cache(host, 1),
                 rt.new_host_buffer):
        with pytest.raises(RblnCapabilityError, match="host_kv_transfers=True"):
            call()
    assert world["runtimes"]["prefill"].calls == []
    cfg = Config(lanes=4, kv_blocks=K, max_seq_len=S, block_size=S, prefill_chunk=C,
                 prefix_cache=True, host_cache_blocks=2)
    with pytest.raises(ValueError, match="host_cache_blocks: host KV transfers .* are off"):
        AtomBatcher(cfg, rt)
    opted_in = RblnRuntime(prefill=object(), decoders={4: object()}, num_blocks=K,
                           block_size=S, max_seq_len=S, prefill_chunk=C, vocab_size=V,
                           host_kv_transfers=True, host_block_bytes=64)
    assert AtomBatcher(cfg, opted_in).config.host_cache_blocks == 2


def test_new_host_buffer_holds_one_block_of_every_full_layer(
        world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sized from cache_metas (one block of each global K/V cache; sliding slots are not
    blocks), never from the whole KV cache."""
    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(float16="np.float16"))
    metas = [kv_meta(0, "sliding_attention", [4, 2, 64, 16]),
             kv_meta(1, "sliding_attention", [4, 2, 64, 16]),
             kv_meta(2, "full_attention", [K, 2, S, 16]),
             kv_meta(3, "full_attention", [K, 2, S, 16])]
    world["hybrid"] = True
    rt = RblnRuntime.from_compiled(write_artifact(tmp_path / "m", ALL, cache_metas=metas,
                                                  cache_impl="hybrid", sliding_window=64),
                                   host_kv_transfers=True)
    assert rt.new_host_buffer().numel() == 2 * (2 * S * 16 * 2) // 2
    assert world["aligned"] == [(2 * S * 16 * 2, "np.float16", 0x1000, "pt")]
    bare = RblnRuntime.from_compiled(write_artifact(tmp_path / "b", ALL), host_kv_transfers=True)
    with pytest.raises(RblnCapabilityError, match="no cache_metas.*host_block_bytes="):
        bare.new_host_buffer()


def test_hybrid_graphs_take_local_block_tables(world: dict, tmp_path: Path) -> None:
    world["hybrid"], world["ref"] = True, None
    rt = RblnRuntime.from_compiled(write_artifact(tmp_path / "h", ALL, cache_impl="hybrid"))
    assert rt.uses_local_block_tables
    rt.prefill([[0] * C], [list(range(C))], [1], [2], 0)
    rt.decode([[0], [0]], [[0], [0]], [[1], [5]], [[0], [1]])
    (_, args), = world["runtimes"]["prefill"].calls
    assert args[3].tolist() == [2] and args[3].dtype == i16
    with pytest.raises(RuntimeInputError, match="needs local_block_tables"):
        rt.prefill([[0] * C], [list(range(C))], [1], None, 0)
    with pytest.raises(RuntimeInputError, match="lane ids"):
        rt.decode([[0], [0]], [[0], [0]], [[1], [5]], [[0], [4]])


def test_wrong_logits_shape_is_an_error(world: dict) -> None:
    class Bad:
        def __call__(self, *args: Any) -> torch.Tensor:
            return torch.zeros(1, V)

    rt = RblnRuntime(prefill=Bad(), decoders={1: Bad()}, num_blocks=K, block_size=S,
                     max_seq_len=S, prefill_chunk=C, vocab_size=V)
    with pytest.raises(RuntimeError, match="logits of shape \\[1, 128\\]"):
        rt.prefill([[0] * C], [list(range(C))], [0], None, 0)


def test_from_compiled_configuration_errors(world: dict, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="decoder_batch_1.rbln"):
        RblnRuntime.from_compiled(write_artifact(tmp_path / "a", ALL[:3]))
    for setting, cfg in (("use_inputs_embeds", {"use_inputs_embeds": True}),
                         ("cache_impl='sliding_window'", {"cache_impl": "sliding_window"}),
                         ("logits_to_keep=2", {"logits_to_keep": 2}),
                         ("phases", {"phases": ["prefill"]}),
                         ("lora_config", {"lora_config": {"adapters": []}}),
                         ("use_position_ids", {"use_position_ids": True}),
                         ("layer_type", {"cache_metas": [kv_meta(0, "linear_attention", [1])]})):
        with pytest.raises(RblnArtifactError, match=setting):
            RblnRuntime.from_compiled(write_artifact(tmp_path / setting, ALL, **cfg))
    with pytest.raises(FileNotFoundError):
        RblnRuntime.from_compiled(tmp_path / "nothing")
    # the layout before optimum-rbln 0.12.0 (one decoder.rbln) is gone: refused, saying so
    root = write_artifact(tmp_path / "old", ["prefill", "decoder"], decoder_batch_sizes=None)
    with pytest.raises(FileNotFoundError, match="decoder_batch_4.rbln.*recompile"):
        RblnRuntime.from_compiled(root)
    # explicit overrides win over the file
    rt = RblnRuntime.from_compiled(write_artifact(tmp_path / "o", ALL), vocab_size=V,
                                   num_blocks=4, decoder_batch_sizes=[2, 1])
    assert rt.decoder_batch_sizes == (2, 1) and rt.num_blocks == 4


def test_multimodal_artifact_loads_its_language_model(world: dict, tmp_path: Path) -> None:
    root = tmp_path / "mm"
    sub = write_artifact(root / "language_model", ALL)
    (root / "rbln_config.json").write_text(json.dumps(
        {"vision_tower": {"batch_size": 1}, "language_model": json.loads(
            (sub / "rbln_config.json").read_text())}))
    rt = RblnRuntime.from_compiled(root)
    assert rt.decoder_batch_sizes == SIZES and rt.vocab_size == V
    assert {Path(r.path).parent for r in world["runtimes"].values()} == {sub}
    bad = tmp_path / "mm2"
    bad.mkdir()
    (bad / "rbln_config.json").write_text(json.dumps({"language_model": {"max_seq_len": S}}))
    with pytest.raises(RblnArtifactError, match="language_model.*sub-folder"):
        RblnRuntime.from_compiled(bad)


def test_missing_rebel_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "rebel", None)     # import rebel -> ImportError
    with pytest.raises(RblnUnavailableError, match="pip install .*rebel-compiler"):
        RblnRuntime.from_compiled(tmp_path)
    # binding already-loaded runtime objects needs no rebel
    rt = RblnRuntime(prefill=object(), decoders={2: object(), 1: object()}, num_blocks=K,
                     block_size=S, max_seq_len=S, prefill_chunk=C, vocab_size=V,
                     host_kv_transfers=True, host_block_bytes=64)
    assert rt.decoder_batch_sizes == (2, 1) and rt.batch_size == 2
    with pytest.raises(RblnUnavailableError):
        rt.new_host_buffer()


def test_every_table_entry_must_be_a_block(world: dict, tmp_path: Path) -> None:
    """All T entries of every row the graph sees are block ids, also past a row's position
    (optimum-rbln never passes -1); checked before any graph runs."""
    world["ref"], world["T"] = None, 4
    rt = RblnRuntime.from_compiled(write_artifact(tmp_path / "p", ALL, max_seq_len=4 * S))
    ids, pos = [[0] * C], [list(range(C))]
    with pytest.raises(RuntimeInputError, match="block id outside"):
        rt.prefill(ids, pos, [1, -1, -1, -1], None, 0)
    with pytest.raises(RuntimeInputError, match=r"block_tables\[1\].*block id outside"):
        rt.decode([[0], [0]], [[5], [0]], [[1, 1, 1, 1], [2, -1, 2, 2]], None)
    rt.prefill(ids, pos, [1, 1, 1, 1], None, 0)   # the row's own block repeated: fine
    assert len(world["runtimes"]["prefill"].calls) == 1
    assert world["runtimes"]["decoder_batch_2"].calls == []


def test_sorted_decode_returns_logits_in_the_callers_row_order() -> None:
    """_requires_batch_sort: the graph gets rows longest first, the caller its own order back."""
    seen = []

    def graph(ids: torch.Tensor, pos: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        seen.append(pos[:, 0].tolist())
        return pos.float().unsqueeze(-1).expand(-1, 1, V).clone()  # each row: its position

    inputs = GraphInputs(max_seq_len=S, block_size=S, prefill_chunk=C, batch_sort=True)
    rt = RblnRuntime(prefill=object(), decoders={4: graph}, num_blocks=K, block_size=S,
                     max_seq_len=S, prefill_chunk=C, vocab_size=V, inputs=inputs)
    positions = [[3], [0], [9], [5]]
    logits = rt.decode([[1]] * 4, positions, [[0], [1], [2], [3]], None)
    assert seen == [[9, 5, 3, 0]]
    assert logits[:, 0, 0].tolist() == [3.0, 0.0, 9.0, 5.0]


def test_logits_to_keep_0_returns_the_query_positions_logits() -> None:
    """A prefill graph compiled with logits_to_keep=0 takes no query_position and returns every
    position's logits; the binding hands back the one at query_position."""
    def graph(ids: torch.Tensor, pos: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        return torch.arange(C, dtype=torch.float32).view(1, C, 1).expand(1, C, V).clone()

    inputs = GraphInputs(max_seq_len=S, block_size=S, prefill_chunk=C, logits_to_keep=0)
    rt = RblnRuntime(prefill=graph, decoders={1: object()}, num_blocks=K, block_size=S,
                     max_seq_len=S, prefill_chunk=C, vocab_size=V, inputs=inputs)
    logits = rt.prefill([[1] * C], [list(range(C))], [0], None, 5)
    assert tuple(logits.shape) == (1, 1, V) and logits[0, 0, 0] == 5.0
