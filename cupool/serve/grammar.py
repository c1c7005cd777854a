"""Structured output: `response_format` (json_object, json_schema) compiled by llguidance into a
matcher whose next-token mask the engine applies in its sampling step (`Engine.submit`'s
constraint hook; `cupool.sampling.apply_token_mask` reads llguidance's bitmask layout as it is).

The mask of a step depends on the token sampled in the step before, so the engine does not
pipeline steps while a constrained request runs (it reads each step's tokens before it launches
the next); the step itself is the same captured graph with the mask applied, one variant of the
step (a graph of its own on a GPU). Per step and constrained request the host computes one
mask (llguidance, typically tens of microseconds) and copies [B, ceil(V / 32)] int32 words to
the device.

JSON is compact (no free whitespace between tokens), so a model cannot spend its tokens on
whitespace. The llguidance tokenizer is built once per server, on the first constrained request
(about a second for a large vocabulary).
"""

from __future__ import annotations

import json
import logging
import threading

from cupool.serve.protocol import bad_request

log = logging.getLogger("cupool.serve")
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarConstraint:
    """The engine's constraint over one llguidance matcher: fill / accept / done."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill(self, words) -> None:
        """Write the allowed next tokens into `words` (int32 [ceil(V / 32)], contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            log.error("the grammar refused token %d: %s", token, self.matcher.get_error())

    def done(self) -> bool:
        """The grammar is complete: nothing but EOS could follow."""
        return self.matcher.is_stopped()


class Grammars:
    """Compiles a server's response formats against its tokenizer (V: the model's vocabulary,
    the width of its logits; eos_ids: the ids that end a generation)."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, sorted(eos_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance.hf
                try:
                    self._lltok = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab, eos_token=self.eos_ids or None)
                except (ValueError, TypeError) as e:
                    raise bad_request(f"structured output is not available for this model: "
                                      f"llguidance cannot read its tokenizer ({e})",
                                      "response_format") from None
            return self._lltok

    @staticmethod
    def schema_of(response_format: dict | None) -> dict | None:
        """The JSON schema a response_format asks for (None: free text); APIError 400 for a
        response_format this server does not serve."""
        if response_format is None:
            return None
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("response_format json_schema needs {\"json_schema\": "
                                  "{\"name\": ..., \"schema\": {...}}}", "response_format")
            return spec.get("schema") or {}
        raise bad_request(f"response_format.type must be 'text', 'json_object' or "
                          f"'json_schema', got {kind!r}", "response_format")

    def constraint(self, schema: dict) -> GrammarConstraint:
        """A fresh matcher of `schema` (APIError 400 where llguidance cannot compile it)."""
        try:
            import llguidance
        except ImportError:
            raise bad_request("structured output needs llguidance on the server (pip install "
                              "'cupool[serve]')", "response_format") from None
        if self.tokenizer is None:
            raise bad_request("structured output needs the model's tokenizer", "response_format")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise bad_request(f"response_format: the schema does not compile: {e}",
                              "response_format") from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise bad_request(f"response_format: the schema does not compile: "
                              f"{matcher.get_error()}", "response_format")
        return GrammarConstraint(matcher)
