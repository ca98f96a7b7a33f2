"""atom-core: a formally verified KV-cache scheduler for LLM serving on static-shape NPUs."""
