"""`atom-core serve`: build the runtime, the batcher, the engine and the app; run uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from atom_core import options as opt
from atom_core.config import SCRATCH_MODES, ConfigError
from atom_core.serve import vllm_flags as vf
from atom_core.serve.runtimes import ServeOptions

API_KEY_ENV = "ATOM_CORE_API_KEY"
NEEDS_SERVE = "atom-core serve needs the serve extra: pip install 'atom-core[serve]'"

# flag -> Config field, for the artifact settings given on the command line
_FIELDS = {"lanes": "lanes", "kv_blocks": "kv_blocks", "max_seq_len": "max_seq_len",
           "block_size": "block_size", "prefill_chunk": "prefill_chunk",
           "prefix_cache": "prefix_cache", "scratch": "scratch",
           "sliding_window": "sliding_window", "host_cache_blocks": "host_cache_blocks",
           "preemption": "preemption"}


# uvicorn's log levels
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Past these a typo, not a setting (the queue and a stream's interval count requests and
# tokens; a body is read into memory).
MAX_QUEUE = 1_000_000
MAX_STREAM_INTERVAL = 1_000_000
MAX_BODY_BYTES = 2**40
# The default queue: a burst of thousands of requests waits for a lane instead of getting 429s
# (vLLM queues without a bound). A waiting request holds its prompt's ids and its handler, a
# few KB for a typical prompt, no KV block: 4096 of them are megabytes of host memory.
DEFAULT_QUEUE = 4096
# Log-probabilities per token a request may ask for (logprobs, top_logprobs): --max-logprobs,
# by default vLLM's 20; above it a request is a 400 naming the limit. Bounded: per token of a
# reply, and with echo of its prompt, the server keeps k + 1 (token, log-probability) pairs
# until the response is written, about 250 bytes each as Python objects and JSON, so at
# k = 256 a request of 8,192 tokens holds about 0.5 GB per choice. vLLM's -1 (the whole
# vocabulary: 128k entries for Llama 3) would hold hundreds of GB for the same request.
DEFAULT_MAX_LOGPROBS = 20
MAX_LOGPROBS_BOUND = 256
# --dtype: what the runtimes serve ("auto": the runtime's own; vLLM's "float" is float32)
DTYPES = {"auto": "auto", "float32": "float32", "float": "float32"}


def _dtype(text: str) -> str:
    if text in DTYPES:
        return DTYPES[text]
    raise argparse.ArgumentTypeError(
        f"{text[:40]!r}: atom-core's reference and hf runtimes serve float32 (the dtype their "
        "greedy output is checked against transformers' generate() in), rbln the compiled "
        "artifact's dtype; give auto or float32")




def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--model", default=None,
                   help="'tiny' (the built-in seeded reference model, byte tokenizer; the "
                        "default) or a model directory (its tokenizer, loaded offline); "
                        "--runtime hf: tiny-llama, tiny-gemma3 or a local checkpoint directory")
    p.add_argument("--runtime", default="reference",
                   help="reference (torch, default), rbln (--compiled PATH), hf (transformers) "
                        "or another registered runtime")
    p.add_argument("--compiled", default=None, help="rbln: the compiled artifact's directory")
    p.add_argument("--rbln-config", default=None, metavar="PATH",
                   help="an rbln_config.json (or its directory): batch_size, "
                        "kvcache_num_blocks, kvcache_block_size, max_seq_len, "
                        "prefill_chunk_size, ...; the flags below win over it")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a directory with the tokenizer to use (default: the model's)")
    p.add_argument("--dtype", default="auto", type=_dtype,
                   help="the weights' dtype: auto (the runtime's: float32 for reference and "
                        "hf, the compiled artifact's for rbln) or float32")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a Jinja chat template (a file, or the template's text) replacing the "
                        "tokenizer's own (a model directory's tokenizer only)")
    g = p.add_argument_group("artifact settings (Config fields; default: --rbln-config's, "
                             "else 4 lanes, block_size 64, prefill_chunk 64, prefix cache on, "
                             "and max_seq_len the checkpoint's max_position_embeddings (capped "
                             "by --kv-blocks when given; 256 for the tiny model and a "
                             "tokenizer-only directory))")
    vf.add_with_aliases(g, "--lanes", dest="lanes", type=opt.count, default=None,
                        help="alias of batch_size")
    vf.add_with_aliases(g, "--kv-blocks", dest="kv_blocks", type=opt.count, default=None,
                        help="default: the proved minimum for the other settings")
    vf.add_with_aliases(g, "--max-seq-len", dest="max_seq_len", type=opt.length, default=None)
    g.add_argument("--block-size", type=opt.length, default=None)
    g.add_argument("--prefill-chunk", type=opt.count, default=None)
    vf.add_with_aliases(g, "--prefix-cache", dest="prefix_cache",
                        action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--scratch", choices=SCRATCH_MODES, default=None)
    g.add_argument("--sliding-window", type=opt.length, default=None)
    g.add_argument("--host-cache-blocks", type=opt.slots, default=None)
    g.add_argument("--preemption", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--seed", type=opt.seed, default=0, help="reference runtime: the model's seed")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model as given, as vLLM's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=opt.port(zero="a free port, which uvicorn's log names"),
                   default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"the Bearer key clients must send (default: ${API_KEY_ENV}); "
                        "required unless --insecure-no-auth")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve without any authentication (anyone who reaches the port can "
                        "use the model)")
    p.add_argument("--max-queue", default=DEFAULT_QUEUE,
                   type=opt.integer(0, MAX_QUEUE, zero="only as many requests in flight as lanes"),
                   help="requests waiting beyond the lanes before new ones get 429 (a burst "
                        "waits, as in vLLM, until this many wait); a waiting request holds its "
                        "prompt and no KV block, so the bound is host memory: at most "
                        "--max-body-bytes each (default: %(default)s)")
    p.add_argument("--request-timeout", type=opt.seconds(zero="never"), default=600.0,
                   help="seconds before a request is ended, sending included: a stream its "
                        "client has not read 1 s past it is dropped (0: never)")
    p.add_argument("--stream-interval", type=opt.integer(1, MAX_STREAM_INTERVAL), default=1,
                   metavar="N",
                   help="a stream sends its first token at once, then every N tokens (fewer, "
                        "larger writes: less server CPU per token, burstier tokens)")
    p.add_argument("--max-body-bytes", type=opt.integer(1, MAX_BODY_BYTES), default=32 * 2**20,
                   metavar="N",
                   help="the largest request body the server reads (larger: 413, before it is "
                        "read)")
    p.add_argument("--drain-timeout", type=opt.seconds(zero="abort them at once"), default=30.0,
                   help="on SIGINT/SIGTERM, seconds to let requests in flight finish before "
                        "they are aborted")
    p.add_argument("--max-logprobs", default=DEFAULT_MAX_LOGPROBS, metavar="K",
                   type=opt.integer(0, MAX_LOGPROBS_BOUND,
                                    zero="no request may ask for more than the chosen token's",
                                    why="memory per request: each token holds K + 1 of them; "
                                        "vLLM's -1, the whole vocabulary, is not taken"),
                   help="log-probabilities per token a request may ask for (logprobs, "
                        "top_logprobs; above: 400), as vLLM's (default: %(default)s); at most "
                        f"{MAX_LOGPROBS_BOUND}: each token of a reply, and with echo of its "
                        "prompt, holds K + 1 of them until the response is written")
    vf.add_with_aliases(p, "--log-level", dest="log_level", choices=LOG_LEVELS, default="info")
    vf.add_vllm_flags(p)
    p.epilog = vf.epilog()


def check(args: argparse.Namespace) -> tuple[ServeOptions, str | None]:
    """(the runtime's options, the API key): what the argument types could not check alone
    (the key, --model, --compiled, the artifact's settings), checked without loading anything
    heavy; ValueError / ConfigError naming the option and what to give. Kept on `args`: the
    --rbln-config is read once (it may be a pipe)."""
    from atom_core.serve import runtimes

    if getattr(args, "checked", None) is not None:
        return args.checked  # type: ignore[no-any-return]
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag} and --model "
                         f"{args.model}: give one")
    args.model = args.model_tag or args.model or runtimes.TINY
    if args.dtype != "auto" and args.runtime == "rbln":
        raise ValueError(f"--dtype {args.dtype}: --runtime rbln serves the compiled artifact's "
                         "dtype: give --dtype auto (or leave it out)")
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if key is None and not args.insecure_no_auth:
        raise ValueError(f"no API key: pass --api-key KEY or set ${API_KEY_ENV} (clients send "
                         "'Authorization: Bearer KEY'); --insecure-no-auth serves without one")
    if key is not None and args.insecure_no_auth:
        raise ValueError("--api-key and --insecure-no-auth contradict each other: pick one")
    overrides = {field: getattr(args, flag) for flag, field in _FIELDS.items()
                 if getattr(args, flag) is not None}
    opts = runtimes.check(ServeOptions(
        model=args.model, runtime=args.runtime, compiled=args.compiled,
        rbln_config=args.rbln_config, overrides=overrides, seed=args.seed,
        tokenizer=args.tokenizer, chat_template=args.chat_template))
    args.checked = (opts, key)
    return opts, key


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(app, engine, settings) from parsed arguments; ValueError/ConfigError on bad input."""
    opts, key = check(args)  # (before anything heavy is imported)
    from atom_core.batcher import AtomBatcher
    from atom_core.serve.app import ServerSettings, create_app
    from atom_core.serve.engine import Engine
    from atom_core.serve.runtimes import build

    cfg, rt, tok = build(opts)
    batcher = AtomBatcher(cfg, rt)  # the runtime checked, its capabilities read, once
    vocab = batcher.capabilities.vocab_size
    if isinstance(vocab, int):
        from atom_core.config import check_end_tokens
        from atom_core.serve.tokenizer import end_ids

        # (else every request would be refused by the batcher: no reply could end on them)
        check_end_tokens(end_ids(tok), vocab,
                         f"--model {args.model}: the tokenizer's end tokens do not fit the "
                         f"{args.runtime} runtime's model")
    name = args.served_model_name or args.model  # (vLLM's: the model as given)
    settings = ServerSettings(model_name=name, api_key=key, max_queue=args.max_queue,
                              request_timeout=args.request_timeout or None,
                              stream_interval=args.stream_interval,
                              max_body_bytes=args.max_body_bytes,
                              max_logprobs=args.max_logprobs)
    engine = Engine(batcher)
    return create_app(engine, tok, settings), engine, settings


def cmd_serve(args: argparse.Namespace) -> int:
    # serve reads local directories only: the model hub is never asked (nor waited for); set
    # before anything imports huggingface_hub, which reads it once
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:  # the options first: a busy port or a loading model would hide a mistake in them
        check(args)
    except (ValueError, ConfigError) as exc:
        print(f"atom-core serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvicorn
    except ImportError:
        print(NEEDS_SERVE, file=sys.stderr)
        return 2
    busy = _cannot_listen(args.host, args.port)
    if busy is not None:  # (before torch and the model load: that may take minutes)
        print(f"atom-core serve: {busy}", file=sys.stderr)
        return 2
    # (atom_core.runtime imports torch)
    from atom_core.runtime.host_memory import keep_freed_memory

    # before the model loads: a step's buffers then stay mapped between steps (see there)
    kept = keep_freed_memory()
    try:
        app, engine, settings = build(args)
    except ImportError as exc:
        print(f"{exc}\n{NEEDS_SERVE}", file=sys.stderr)
        return 2
    except (ValueError, ConfigError) as exc:
        print(f"atom-core serve: {exc}", file=sys.stderr)
        return 2
    if settings.api_key is None:
        print("warning: serving WITHOUT authentication (--insecure-no-auth)", file=sys.stderr)
    cfg = engine.batcher.config
    print(f"atom-core serve: model '{settings.model_name}' on {args.runtime}, lanes={cfg.lanes}, "
          f"kv_blocks={cfg.kv_blocks}, max_seq_len={cfg.max_seq_len}, block_size="
          f"{cfg.block_size} ({cfg.rule}); http://{args.host}:"
          f"{args.port or '<a free port: see uvicorn below>'}/v1", file=sys.stderr)
    if not kept:
        print("note: malloc thresholds left as they are (not glibc, or set in GLIBC_TUNABLES)",
              file=sys.stderr)
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown (the app's lifespan then ends every
    # request in flight and stops the engine) and afterwards raises the signal again for the
    # handler it found installed: with this one, that ends nothing and we exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE)
    server = draining_server(uvicorn.Server, engine, args.drain_timeout)(config)
    try:
        server.run()
    except KeyboardInterrupt:  # (a second SIGINT while the first one's shutdown runs)
        pass
    return 0 if server.started else 1


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (in use, no such address), or None. A
    check before the model loads; uvicorn binds for real afterwards (with SO_REUSEADDR, as
    here, so a port in TIME_WAIT passes both)."""
    import socket

    if not 1 <= port <= 65535:
        return None  # (0: the OS picks a free one; the option's type refuses the rest)
    try:
        with socket.create_server((host, port)):
            return None
    except (OSError, OverflowError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        return (f"cannot listen on {host}:{port}: {why}; pick another --port (or stop what "
                "listens there), or another --host")


# seconds a connection may stay open after the engine ended the requests in flight (a stream
# whose client stopped reading) before uvicorn cuts it
DRAIN_GRACE = 5.0


def draining_server(base: Any, engine: Any, drain_timeout: float) -> Any:
    """A uvicorn Server class whose graceful shutdown, `drain_timeout` seconds after it began,
    stops the engine: every request still in flight then ends with a clear error of its own (a
    stream an error event and `data: [DONE]`, a request without stream a 500 in the API's error
    shape) while its handler still runs. (uvicorn's own timeout cancels the handlers instead:
    a bare "Internal Server Error" or a stream cut mid-body; it stays as the backstop,
    DRAIN_GRACE later, for connections that still do not close.)"""

    class DrainingServer(base):  # type: ignore[misc, valid-type]
        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            # (engine.stop joins the engine thread: off the event loop)
            timer = loop.call_later(drain_timeout,
                                    lambda: loop.run_in_executor(None, engine.stop))
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return DrainingServer
