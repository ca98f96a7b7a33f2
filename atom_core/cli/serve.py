"""`serve`: the OpenAI-compatible HTTP server. Its options and its body are the server's own
(`atom_core.serve.main`, which imports no web stack until the command runs)."""

from __future__ import annotations

from atom_core.serve.main import add_arguments as serve_arguments
from atom_core.serve.main import cmd_serve

__all__ = ["cmd_serve", "serve_arguments"]
