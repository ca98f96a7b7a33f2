"""An OpenAI-compatible HTTP server around the verified core (`atom-core serve`).

Layers: `engine` (one thread owns the AtomBatcher; requests reach it through a queue, each
client gets its events back through its own asyncio queue), `app` (FastAPI: the OpenAI
endpoints, auth, validation, streaming), `tokenizer`, `sampling` (host-side sampling through
the batcher's sampler hook), `metrics` (Prometheus), `runtimes` (which runtime serves: the torch
reference, RBLN, or one registered later). Needs the `serve` extra: pip install 'atom-core[serve]'.
"""
