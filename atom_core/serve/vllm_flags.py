"""vLLM's `vllm serve` flags and atom-core's answer to each: the one table the serve command's
parser is built from (its aliases, the flags it accepts as no-ops, the values it accepts, the
flags it refuses naming why) and the README's table is checked against
(tests/test_serve_vllm_flags.py).

A vLLM user's launch script should either work or say, for each flag atom-core does not have,
what atom-core does instead: never "unrecognized arguments".
"""

from __future__ import annotations

import argparse
from typing import Any

import attrs


@attrs.frozen
class Alias:
    """The vLLM flag is another name of an atom-core flag (same meaning, same values)."""

    target: str
    note: str = ""


@attrs.frozen
class NoOp:
    """Accepted and ignored: what it turns off or on does not exist in atom-core (`why`)."""

    why: str
    takes_value: bool = False


@attrs.frozen
class Only:
    """Accepted with the one value atom-core's behaviour matches (`value`); any other value is
    refused saying `why`."""

    value: str
    why: str


@attrs.frozen
class Refused:
    """Refused at parse time, naming the flag, saying why and what to use instead."""

    why: str
    takes_value: bool = True


Answer = Alias | NoOp | Only | Refused

_ONE_DEVICE = "atom-core serves one model on one device per process (a PD cluster spreads " \
              "prefill and decode: `atom-core pd-cluster`)"

# vLLM flag -> atom-core's answer. Flags vLLM and atom-core share by name (--host, --port,
# --api-key, --served-model-name, --block-size, --seed, --tokenizer, --dtype, --chat-template,
# --max-logprobs) are atom-core's own and not listed.
VLLM_FLAGS: dict[str, Answer] = {
    # ----- the same setting under vLLM's name
    "--max-num-seqs": Alias("--lanes", "the batch size: requests decoded together"),
    "--max-model-len": Alias("--max-seq-len", "prompt + reply tokens of one request"),
    "--enable-prefix-caching": Alias("--prefix-cache"),
    "--num-gpu-blocks-override": Alias("--kv-blocks", "the number of KV blocks"),
    "--uvicorn-log-level": Alias("--log-level"),
    # ----- accepted, nothing to do
    "--enforce-eager": NoOp("atom-core captures no CUDA graphs: the static shapes are compiled "
                            "ahead of time (--compiled)"),
    "--enable-chunked-prefill": NoOp("atom-core always prefills in chunks of --prefill-chunk "
                                     "tokens"),
    "--no-enable-chunked-prefill": Refused("atom-core always prefills in chunks of "
                                           "--prefill-chunk tokens (a larger chunk: fewer "
                                           "prefill calls per prompt)", takes_value=False),
    "--disable-log-requests": NoOp("atom-core never logs requests' content"),
    "--enable-log-requests": NoOp("atom-core never logs requests' content; /metrics and "
                                  "/state show them as counts"),
    "--disable-log-stats": NoOp("atom-core logs no periodic stats: read /metrics"),
    "--disable-frontend-multiprocessing": NoOp("the server and its engine thread are one "
                                               "process"),
    "--enable-prompt-tokens-details": NoOp("usage.prompt_tokens_details.cached_tokens is "
                                           "always sent"),
    "--trust-remote-code": NoOp("atom-core never runs a checkpoint's own code: transformers' "
                                "built-in architectures only (without the flag, vLLM's default, "
                                "the same)"),
    # ----- accepted with the value that matches atom-core
    "--tensor-parallel-size": Only("1", _ONE_DEVICE),
    "--pipeline-parallel-size": Only("1", _ONE_DEVICE),
    "--data-parallel-size": Only("1", _ONE_DEVICE + "; run several servers behind a balancer"),
    "--scheduling-policy": Only("fcfs", "atom-core admits requests first come, first served"),
    "--tokenizer-mode": Only("auto", "atom-core loads the model directory's tokenizer with "
                                     "transformers' AutoTokenizer"),
    "--load-format": Only("auto", "atom-core loads safetensors or pytorch_model*.bin as "
                                  "save_pretrained writes them"),
    # ----- refused: what to do instead
    "--gpu-memory-utilization": Refused(
        "atom-core sizes the KV cache in blocks, not as a share of device memory: give "
        "--kv-blocks (default: the proved minimum for the other settings; `atom-core "
        "min-blocks` prints it)"),
    "--kv-cache-memory-bytes": Refused("give the KV cache as a number of blocks: --kv-blocks"),
    "--swap-space": Refused("atom-core's host memory tier is counted in blocks: "
                            "--host-cache-blocks"),
    "--cpu-offload-gb": Refused("atom-core does not offload weights"),
    "--kv-cache-dtype": Refused("the KV cache has the model's dtype (the compiled artifact's on "
                                "RBLN)"),
    "--quantization": Refused("atom-core serves a checkpoint's weights as they are (on RBLN, "
                              "as compiled)"),
    "--max-num-batched-tokens": Refused(
        "atom-core runs one prefill chunk or one decode step per step: the prefill's size is "
        "--prefill-chunk, the decode batch --lanes (alias --max-num-seqs)"),
    "--preemption-mode": Refused("atom-core preempts by recompute only: --preemption turns it "
                                 "on"),
    "--speculative-config": Refused("speculative decoding is not implemented"),
    "--enable-lora": Refused("LoRA adapters are not implemented", takes_value=False),
    "--lora-modules": Refused("LoRA adapters are not implemented"),
    "--enable-auto-tool-choice": Refused("tool calling is not implemented (tools are a 400)",
                                         takes_value=False),
    "--tool-call-parser": Refused("tool calling is not implemented (tools are a 400)"),
    "--reasoning-parser": Refused("reasoning parsers are not implemented"),
    "--structured-outputs-config": Refused("structured output is not implemented "
                                           "(response_format json_* is a 400)"),
    "--guided-decoding-backend": Refused("structured output is not implemented "
                                         "(response_format json_* is a 400)"),
    "--kv-transfer-config": Refused("atom-core's own prefill/decode disaggregation is "
                                    "`atom-core pd-cluster`"),
    "--revision": Refused("atom-core serves a local directory only, never the model hub: "
                          "download the revision, give its directory as --model"),
    "--download-dir": Refused("atom-core serves a local directory only, never the model hub"),
    "--device": Refused("the device is the runtime's: --runtime reference|hf (CPU) or rbln "
                        "(--compiled)"),
    "--generation-config": Refused("sampling defaults are the request's parameters (and the "
                                   "OpenAI defaults); end tokens come from the model "
                                   "directory's generation_config.json"),
    "--override-generation-config": Refused("sampling defaults are the request's parameters"),
    "--ssl-keyfile": Refused("serve TLS from a reverse proxy in front of atom-core"),
    "--ssl-certfile": Refused("serve TLS from a reverse proxy in front of atom-core"),
    "--allowed-origins": Refused("atom-core sends no CORS headers: put a proxy in front for "
                                 "browsers"),
    "--root-path": Refused("serve under a prefix from a reverse proxy in front of atom-core"),
    "--return-tokens-as-token-ids": Refused(
        "send return_token_ids in the request: each choice then has token_ids",
        takes_value=False),
    "--max-seq-len-to-capture": Refused("atom-core captures no CUDA graphs"),
    "--limit-mm-per-prompt": Refused("atom-core serves text only"),
    "--hf-overrides": Refused("atom-core serves the checkpoint's config.json as it is"),
    "--skip-tokenizer-init": Refused("the server needs the tokenizer (prompts may be text)",
                                     takes_value=False),
}

# vLLM's short spellings
SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
         "-dp": "--data-parallel-size", "-q": "--quantization"}


def aliases(flag: str) -> list[str]:
    """Every vLLM name of atom-core's `flag`."""
    return [name for name, a in VLLM_FLAGS.items() if isinstance(a, Alias) and a.target == flag]


def add_with_aliases(g: Any, flag: str, help: str | None = None, **kw: Any) -> None:
    """Add `flag` to `g` (a parser or group) and, hidden, each vLLM name of it, writing the
    same option (an error then names the flag as it was typed: `argument --max-num-seqs`)."""
    names = aliases(flag)
    note = "vLLM: " + ", ".join(names) if names else ""
    text = "; ".join(x for x in (help, note) if x) or None
    g.add_argument(flag, help=text, **kw)
    for name in names:
        g.add_argument(name, **{**kw, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS})


def answer(flag: str) -> str:
    """atom-core's answer to a vLLM flag, in words (the README's table, the refusals)."""
    a = VLLM_FLAGS[flag]
    if isinstance(a, Alias):
        return f"alias of `{a.target}`" + (f" ({a.note})" if a.note else "")
    if isinstance(a, NoOp):
        return f"accepted, no effect: {a.why}"
    if isinstance(a, Only):
        return f"only `{a.value}`: {a.why}"
    return f"refused: {a.why}"


class _Answer(argparse.Action):
    """A vLLM flag that is a no-op, takes one value only, or is refused."""

    def __init__(self, option_strings: list[str], dest: str, flag: str = "", **kw: Any) -> None:
        self.flag, self.vllm = flag, VLLM_FLAGS[flag]
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:
        a, name = self.vllm, option_string or self.flag
        if isinstance(a, Refused):
            parser.error(f"{name} is vLLM's; atom-core does not have it: {a.why}")
        if isinstance(a, Only) and str(values) != a.value:
            parser.error(f"{name} {values}: atom-core takes only {a.value} ({a.why})")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """Register the table's no-ops, one-value and refused flags (aliases are added with their
    atom-core flags); hidden from --help, listed in the README's table and in `--help`'s
    epilog."""
    shorts: dict[str, list[str]] = {}
    for short, flag in SHORT.items():
        shorts.setdefault(flag, []).append(short)
    for flag, a in VLLM_FLAGS.items():
        if isinstance(a, Alias):
            continue
        names = [flag, *shorts.get(flag, [])]
        if isinstance(a, NoOp) or (isinstance(a, Refused) and not a.takes_value):
            kw: dict[str, Any] = {"nargs": 0}
        elif isinstance(a, Only):
            kw = {"nargs": None}
        else:  # (a refused flag's value, if any, is not even read)
            kw = {"nargs": "?"}
        p.add_argument(*names, action=_Answer, flag=flag, help=argparse.SUPPRESS, **kw)


def epilog() -> str:
    """`--help`'s note on vLLM's flags."""
    names = [f for f, a in VLLM_FLAGS.items() if isinstance(a, Alias)]
    return ("vLLM's flags: " + ", ".join(f"{f} (= {VLLM_FLAGS[f].target})"  # type: ignore[union-attr]
                                         for f in names)
            + "; the others vLLM has are accepted where atom-core's behaviour matches "
            "(e.g. --tensor-parallel-size 1, --enforce-eager) or refused saying why and what "
            "to give instead (README: 'vLLM's flags and parameters').")
