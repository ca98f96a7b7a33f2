"""How a message about a configuration names its settings: `ConfigError` and the `Vocabulary`
it is written over.

A setting reaches a `Config` through one of several interfaces (the Python API, the command
line, an artifact's rbln_config.json), and a refusal should say what to change in the words of
the one the user set it through. Its own module because both `atom_core.config` (the Config and
its capacity rules) and `atom_core.rbln_config` (reading an artifact's settings, which come
before any Config) raise these errors.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs


@attrs.frozen
class Term:
    """How one interface names a Config field: its `name` there, in its `style`'s syntax."""
    name: str
    # field: the Python API (kv_blocks=16); flag: the command line (--kv-blocks 16, --preemption,
    # --no-prefix-cache); key: an artifact's rbln_config.json (kvcache_num_blocks=16)
    style: str = "field"

    def give(self, value: Any) -> str:
        """What to write to set the field to `value`."""
        if self.style == "flag":
            if isinstance(value, bool):
                return self.name if value else "--no-" + self.name.removeprefix("--")
            return f"{self.name} {value}"
        if self.style == "key":
            return f"{self.name}=" + (json.dumps(value) if isinstance(value, (bool, str))
                                      else short(value))
        return f"{self.name}={short(value)}"

    def bound(self, op: str, n: int) -> str:
        """`op` (">=" or "<=") `n`, as this interface would say it."""
        if self.style == "flag":
            return f"{self.name} {n} or {'more' if op == '>=' else 'less'}"
        return f"{self.name} {op} {n}"

    def option(self) -> str:
        """The name to give a value to (`kv_blocks=`, `--kv-blocks`, `kvcache_num_blocks`)."""
        return f"{self.name}=" if self.style == "field" else self.name


@attrs.frozen
class Vocabulary:
    """The words a message about a Config uses for its fields: each message is written once,
    over a Vocabulary, and says what to change in the terms of the interface the user set it
    through (Config field names from the Python API, flags on the command line, rbln_config
    keys for an artifact), and where a value the user did not give came from."""
    terms: Mapping[str, Term] = attrs.field(factory=dict)
    # field -> where its value came from when the user did not give it here (a default, a key
    # of a file), said beside the value
    origins: Mapping[str, str] = attrs.field(factory=dict)

    def term(self, field: str) -> Term:
        return self.terms.get(field) or Term(field)

    def name(self, field: str) -> str:
        return self.term(field).name

    def option(self, field: str) -> str:
        return self.term(field).option()

    def give(self, field: str, value: Any) -> str:
        return self.term(field).give(value)

    def at_least(self, field: str, n: int) -> str:
        return self.term(field).bound(">=", n)

    def at_most(self, field: str, n: int) -> str:
        return self.term(field).bound("<=", n)

    def now(self, field: str, value: Any) -> str:
        """The field's value as it stands, with where it came from if the user did not give
        it (`block_size=64 (the built-in tiny model's default; --block-size sets it)`)."""
        origin = self.origins.get(field)
        if origin is None:
            return self.give(field, value)
        term = self.term(field)
        sets = f"; {term.name} sets it" if term.style == "flag" else ""
        return f"{field}={short(value)} ({origin}{sets})"


# The Python API's words: Config's own field names.
PYTHON = Vocabulary()


def flag_vocabulary(fields: Iterable[str], origins: Mapping[str, str] | None = None,
                    keys: Mapping[str, str] | None = None) -> Vocabulary:
    """The command line's words: `--field-name` for each of `fields` (the Config fields the
    command has a flag for), an rbln_config key for a field set by a file with no flag here
    (`keys`, field -> key), field names for the rest."""
    terms = {f: Term(k, "key") for f, k in (keys or {}).items()}
    terms.update({f: Term("--" + f.replace("_", "-"), "flag") for f in fields})
    return Vocabulary(terms, dict(origins or {}))


class ConfigError(ValueError):
    """A configuration the proofs do not cover; the message says what to change. Raised with
    a function of a `Vocabulary`, it says so in any interface's words (`in_terms`); str() gives
    the Python API's."""

    def __init__(self, message: str | Callable[[Vocabulary], str]) -> None:
        self._say: Callable[[Vocabulary], str] = \
            message if callable(message) else (lambda _v: message)
        super().__init__(self._say(PYTHON))

    def in_terms(self, vocab: Vocabulary) -> str:
        """The message in `vocab`'s words."""
        return self._say(vocab)

    def reworded(self, vocab: Vocabulary) -> ConfigError:
        """This error as `vocab` says it (for a caller that only reads str())."""
        return ConfigError(self.in_terms(vocab))

    def __reduce__(self) -> tuple[Any, ...]:
        # (the message function may not pickle: a process pool gets the words)
        return ConfigError, (str(self),)


def not_int_hint(value: Any) -> str:
    """Why an integer-looking value is refused: a numpy integer (np.int64(128)) reads as a
    positive integer in the message, so say it is not a Python int and how to convert it."""
    if isinstance(value, bool) or isinstance(value, int) or not hasattr(value, "__index__"):
        return ""
    kind = f"{type(value).__module__}.{type(value).__name__}"
    return f" (a {kind}, not a Python int: pass int(value))"


def short(value: Any) -> str:
    """repr(value), cut short: a message quotes what it refuses, and a value read from a file
    may be a list of a million items or a thousand-digit number."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<an integer of {value.bit_length()} bits>"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
