"""Constrained decoding for the server: JSON-schema / Lark grammars compiled by llguidance into per-token bitmasks
that the engine applies to the logits before sampling (see Engine.submit's ``constraint``).

llguidance is torch-free, reads the model's tokenizer.json directly and computes a mask in ~1 ms; a Constraint
holds one LLMatcher per job.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

_NO_WS = {
    "whitespace_flexible": False
}  # compact JSON: a small model cannot wander off into endless whitespace


class GrammarFactory:
    """Compiles grammars for one tokenizer (the llguidance tokenizer is built once, ~0.5 s)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        import llguidance as llg

        self._llg = llg
        self.vocab_size = int(vocab_size)
        self._tok = llg.LLTokenizer(
            tokenizer_json, n_vocab=self.vocab_size, eos_token=eos_ids[0] if eos_ids else None
        )
        self._lock = threading.Lock()

    def json_schema(self, schema: dict[str, Any] | None) -> Constraint:
        """Output must be one JSON value matching ``schema`` (None / {}: any JSON object)."""
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise InvalidArgumentError("response_format json_schema.schema must be a JSON object")
        schema = dict(schema)
        schema.setdefault("x-guidance", _NO_WS)
        grammar = self._llg.grammar_from("json_schema", json.dumps(schema))
        return self._matcher(grammar, "response_format json schema")

    def lark(self, source: str, what: str = "grammar") -> Constraint:
        return self._matcher(self._llg.grammar_from("lark", source), what)

    def _matcher(self, grammar: str, what: str) -> Constraint:
        is_err, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tok)
        if is_err:
            raise InvalidArgumentError(f"{what} is not supported: {'; '.join(messages)}")
        m = self._llg.LLMatcher(self._tok, grammar)
        if m.is_error():
            raise InvalidArgumentError(f"{what} is not supported: {m.get_error()}")
        return Constraint(m, self.vocab_size)


class Constraint:
    """One job's grammar state: ``mask()`` for the next token, ``advance(token)`` after each sampled token."""

    def __init__(self, matcher: Any, vocab_size: int):
        import llguidance.numpy as lnp

        self._m = matcher
        self._lnp = lnp
        self._bits = lnp.allocate_token_bitmask(1, vocab_size)

    def mask(self) -> list[int]:
        self._lnp.fill_next_token_bitmask(self._m, self._bits, 0)
        return self._bits[0].view(np.uint32).tolist()

    def advance(self, token: int) -> list[int]:
        if not self._m.consume_token(int(token)):
            raise InvalidArgumentError(
                f"constrained decoding: token {token} rejected ({self._m.get_error()})"
            )
        return self.mask()

    @property
    def done(self) -> bool:
        return self._m.is_stopped() or self._m.is_accepting()
