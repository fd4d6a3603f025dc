"""Regex, JSON-schema and EBNF constraints on XGrammar (pinned: 0.2.9, see the Makefile).

XGrammar compiles a grammar against the tokenizer's byte-level vocabulary once (tokens that span
several characters, or half of a multi-byte UTF-8 character, are handled by its byte-level
automaton), and a matcher per sequence gives the packed allowed set of its state in microseconds,
with cheap fork and unlimited rollback. What this module adds:

- special and added tokens other than EOS are never allowed (XGrammar treats `<|im_start|>` of this
  tokenizer as ordinary text and would let it into a JSON string);
- EOS is the model's own end token (the engine's EOS ids), allowed only where the language may end;
- an invalid regex, schema or grammar is refused by `check` before any model loads, with XGrammar's
  message, in one line.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from pipeline.core import Constraint, Grammar, UserError
from pipeline.core.constrain import allows, pack, words

VERSION = "0.2.9"


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise UserError(f"regex / json_schema / ebnf constraints need XGrammar: run `make setup` "
                        f"(or pip install --no-deps xgrammar=={VERSION} apache-tvm-ffi pydantic)") from None
    return xgrammar


def engine_message(e: Exception) -> str:
    """XGrammar's error without its C++ location prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = " ".join(str(e).split())
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text)


_COMPILERS: dict = {}


def _compiler(backbone):
    """One TokenizerInfo + GrammarCompiler per tokenizer and vocabulary size (XGrammar caches
    compiled grammars inside it, so a schema repeated across requests compiles once)."""
    xgr = _xgr()
    tok, vocab = backbone.tokenizer, backbone.model.args.vocab_size
    key = (id(tok), vocab, tuple(backbone.eos_ids))
    if key not in _COMPILERS:
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=list(backbone.eos_ids))
        banned = set(getattr(tok, "all_special_ids", [])) | set(getattr(tok, "added_tokens_decoder", {}))
        allowed = torch.ones(vocab, dtype=torch.bool)
        allowed[[t for t in banned - set(backbone.eos_ids) if t < vocab]] = False
        eos = torch.zeros(vocab, dtype=torch.bool)
        eos[list(backbone.eos_ids)] = True
        _COMPILERS[key] = (xgr.GrammarCompiler(info, max_threads=2), pack(allowed), pack(eos), tok)
    return _COMPILERS[key]


class XGrammarConstraint(Grammar):
    """A grammar compiled by XGrammar; subclasses say how (`_compile`) and how to check it (`_parse`)."""
    kind = "grammar"

    def __init__(self, backbone, add_to_prompt: bool = False):
        self.add_to_prompt = bool(add_to_prompt)
        compiler, self.ban, self.eos_bits, self.tokenizer = _compiler(backbone)
        self.eos_ids = list(backbone.eos_ids)
        self.vocab_size = backbone.model.args.vocab_size
        try:
            self.compiled = self._compile(compiler)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"invalid {self.kind}: {engine_message(e)}") from None

    def _compile(self, compiler):
        raise NotImplementedError

    def start(self) -> Constraint:
        return Matcher(_xgr().GrammarMatcher(self.compiled, override_stop_tokens=self.eos_ids), self)


class Matcher(Constraint):
    """One sequence's XGrammar matcher; the allowed set of the current state is computed once and
    cached until the state moves."""

    def __init__(self, matcher, grammar: XGrammarConstraint, history: list[int] | None = None):
        self.m, self.g = matcher, grammar
        self.history = list(history or [])  # accepted tokens, for rollback bookkeeping and messages
        self._bits: torch.Tensor | None = None

    def _current(self) -> torch.Tensor:
        if self._bits is None:
            bits = torch.zeros(1, words(self.g.vocab_size), dtype=torch.int32)
            if not self.m.is_terminated():
                self.m.fill_next_token_bitmask(bits, 0)
            self._bits = bits[0] & self.g.ban
        return self._bits

    def fill(self, bits: torch.Tensor) -> None:
        bits.copy_(self._current())

    def advance(self, token: int) -> bool:
        if not allows(self._current(), token) or token in self.g.eos_ids or not self.m.accept_token(token):
            return False
        self.history.append(token)
        self._bits = None
        return True

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)
            del self.history[-n:]
            self._bits = None

    def fork(self) -> "Matcher":
        out = Matcher(self.m.fork(), self.g, self.history)
        out._bits = self._bits
        return out

    def is_complete(self) -> bool:
        bits = self._current()
        return not bool((bits & ~self.g.eos_bits).any())

    def can_end(self) -> bool:
        bits = self._current()
        return any(allows(bits, e) for e in self.g.eos_ids)

    def describe(self) -> str:
        text = self.g.tokenizer.decode(self.history)
        return f"{self.g.kind} state after {len(self.history)} tokens, text so far {text[-200:]!r}"


def _read(value, what: str, suffixes: tuple[str, ...]) -> str:
    """An inline value or the path of a file holding it."""
    if isinstance(value, str) and (value.endswith(suffixes) or "\n" not in value and len(value) < 4096):
        path = Path(value).expanduser()
        try:
            if path.is_file():
                return path.read_text()
        except OSError:
            pass
        if value.endswith(suffixes):
            raise UserError(f"{what} file {value} does not exist: fix the path, or give the {what} inline")
    return value


def schema_text(schema) -> str:
    """A schema given as a dict (a request line, a config mapping), a JSON string or a file path."""
    if schema is None:
        raise UserError("constraint=json_schema needs a schema: constraint.schema=<file.json> or a request "
                        'line with "json_schema": {...}')
    if not isinstance(schema, str):
        try:
            from omegaconf import OmegaConf
            schema = OmegaConf.to_container(schema, resolve=True) if OmegaConf.is_config(schema) else schema
        except ImportError:
            pass
        return json.dumps(schema)
    text = _read(schema, "schema", (".json",))
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"invalid json_schema: not JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                        "give a schema file or an inline JSON object") from None
    return text


class JSONSchema(XGrammarConstraint):
    """JSON that validates against a JSON schema. Compact by default (`any_whitespace: false`:
    XGrammar's separators, no free whitespace, where a small model otherwise can loop on newlines);
    `strict_mode` forbids properties and items the schema does not name."""
    kind = "json_schema"

    def __init__(self, backbone, schema=None, any_whitespace: bool = False, indent: int | None = None,
                 strict_mode: bool = True, add_to_prompt: bool = False):
        self.schema = schema_text(schema)
        self.options = dict(any_whitespace=bool(any_whitespace), indent=indent, strict_mode=bool(strict_mode))
        super().__init__(backbone, add_to_prompt)

    @classmethod
    def check(cls, schema=None, any_whitespace: bool = False, indent: int | None = None, strict_mode: bool = True,
              **_) -> None:
        xgr = _xgr()
        try:
            xgr.Grammar.from_json_schema(schema_text(schema), any_whitespace=bool(any_whitespace), indent=indent,
                                         strict_mode=bool(strict_mode))
        except (RuntimeError, ValueError, TypeError) as e:
            raise UserError(f"invalid json_schema: {engine_message(e)}") from None

    def _compile(self, compiler):
        return compiler.compile_json_schema(self.schema, **self.options)

    def text(self) -> str:
        return f"Reply with JSON only, following this JSON schema:\n{self.schema}"


class Regex(XGrammarConstraint):
    """Text that matches a regular expression as a whole (XGrammar's regex dialect: ECMAScript-like)."""
    kind = "regex"

    def __init__(self, backbone, pattern: str | None = None, add_to_prompt: bool = False):
        self.pattern = self._pattern(pattern)
        super().__init__(backbone, add_to_prompt)

    @staticmethod
    def _pattern(pattern) -> str:
        if not isinstance(pattern, str) or not pattern:
            raise UserError(f"constraint=regex needs a pattern: constraint.pattern='...' (got {pattern!r})")
        return pattern

    @classmethod
    def check(cls, pattern=None, **_) -> None:
        xgr = _xgr()
        try:
            xgr.Grammar.from_regex(cls._pattern(pattern))
        except (RuntimeError, ValueError) as e:
            raise UserError(f"invalid regex {pattern!r}: {engine_message(e)}") from None

    def _compile(self, compiler):
        return compiler.compile_regex(self.pattern)

    def text(self) -> str:
        return f"Reply with text that matches this regular expression: {self.pattern}"


class EBNF(XGrammarConstraint):
    """Text in the language of a context-free grammar in XGrammar's EBNF (GBNF-like: `root ::= ...`),
    given inline or as a file (.ebnf / .gbnf)."""
    kind = "ebnf"

    def __init__(self, backbone, grammar: str | None = None, root: str = "root", add_to_prompt: bool = False):
        self.grammar, self.root = self._grammar(grammar), root
        super().__init__(backbone, add_to_prompt)

    @staticmethod
    def _grammar(grammar) -> str:
        if not isinstance(grammar, str) or not grammar.strip():
            raise UserError(f"constraint=ebnf needs a grammar: constraint.grammar=<file.ebnf> or the rules inline "
                            f"(got {grammar!r})")
        return _read(grammar, "grammar", (".ebnf", ".gbnf"))

    @classmethod
    def check(cls, grammar=None, root: str = "root", **_) -> None:
        xgr = _xgr()
        try:
            xgr.Grammar.from_ebnf(cls._grammar(grammar), root_rule_name=root)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"invalid grammar: {engine_message(e)}") from None

    def _compile(self, compiler):
        return compiler.compile_grammar(self.grammar, root_rule_name=self.root)

    def text(self) -> str:
        return f"Reply with text in the language of this grammar (EBNF):\n{self.grammar}"
