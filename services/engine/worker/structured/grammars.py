"""Grammars: StructuredSpec -> an xgrammar CompiledGrammar, compiled on a worker thread and cached by spec.

xgrammar was chosen over llguidance by measurement on SmolLM2's 49k-token vocabulary (this machine,
one thread, a nested JSON schema; `python benchmarks/structured_output.py --compare-libraries`): next-
token mask p50 2.2 us (llguidance 11.6 us, with a 1.5 ms worst case), compile 5 ms (cached: 0.06 ms).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from services.common.openai.protocol_structured import StructuredSpec
from services.common.openai.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_CACHE_ENTRIES = 256


class GrammarError(ValueError):
    """The constraint cannot be compiled: ``param`` is the request field to name in the 400."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


class GrammarHandle:
    """A request's grammar being compiled; the scheduler admits the request once ``ready``."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    @property
    def ready(self) -> bool:
        """Compiled without error (a failed grammar never becomes ready: the engine fails its request)."""
        return self._future.done() and self._future.exception() is None

    def result(self) -> Any:
        """The CompiledGrammar; raises GrammarError when it failed."""
        return self._future.result()

    def error(self) -> GrammarError | None:
        if not self._future.done():
            return None
        exc = self._future.exception()
        return exc if isinstance(exc, GrammarError) else (GrammarError(str(exc)) if exc else None)


def _choice_ebnf(choices: Sequence[str]) -> str:
    """root ::= "a" | "b" ... with each choice as an EBNF string literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs for one tokenizer; ``submit`` never blocks, ``compile`` does (and caches)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        on_compiled: Callable[[float], None] | None = None,
    ) -> None:
        self._tokenizer, self.vocab_size, self._stops = tokenizer, vocab_size, list(stop_token_ids)
        self._on_compiled = on_compiled  # compile seconds, for the metrics histogram
        self._lock = threading.Lock()
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on first use (~0.1 s)
        self._cache: OrderedDict[StructuredSpec, Future[Any]] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-grammar")

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self._stops
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids (special tokens kept: a reasoning end tag may be one)."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def submit(self, spec: StructuredSpec) -> GrammarHandle:
        """Compile on the worker thread (or reuse the cached result)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(spec)
                return GrammarHandle(future)
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return GrammarHandle(future)

    def compile(self, spec: StructuredSpec) -> Any:
        """Block until compiled; GrammarError (naming the field) when the spec is unusable."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredSpec) -> Any:
        start = time.perf_counter()
        try:
            grammar = self._dispatch(self._xgr_compiler(), spec)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
            raise GrammarError(_describe(spec, exc), _param(spec)) from exc
        if self._on_compiled is not None:
            self._on_compiled(time.perf_counter() - start)
        return grammar

    @staticmethod
    def _dispatch(compiler: Any, spec: StructuredSpec) -> Any:
        if spec.kind == "json":
            return compiler.compile_grammar(_json_schema_ebnf(spec.value))
        if spec.kind == "json_object":  # OpenAI's json_object: any JSON object (not an array, not a scalar)
            return compiler.compile_grammar(_json_schema_ebnf('{"type": "object"}'))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(_choice_ebnf(json.loads(spec.value)))
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.value)
        if "::=" in spec.value:
            return compiler.compile_grammar(spec.value)  # EBNF (GBNF)
        return compiler.compile_lark(spec.value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# xgrammar 0.2.9 lets raw control characters (U+0000-U+001F) into length-bounded strings
# (`maxLength` / `minLength`), which strict JSON parsers reject; its unbounded strings exclude them.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\"\\\0-\x1f]"


def _json_schema_ebnf(schema: str) -> str:
    """The schema's grammar (compact JSON, no free whitespace) with strict-JSON string characters."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return ebnf.replace(_BOUNDED_STRING_CHAR, _STRICT_STRING_CHAR)


def _param(spec: StructuredSpec) -> str:
    return {"json": "response_format", "json_object": "response_format"}.get(spec.kind, "structured_outputs")


def _describe(spec: StructuredSpec, exc: Exception) -> str:
    what = {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "grammar (EBNF with ::=, else Lark)",
        "structural_tag": "structural tag",
    }[spec.kind]
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"the {what} cannot be used for constrained decoding: {reason}"
