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

One module (~420 lines) for the three XGrammar-backed options (regex, json_schema, ebnf): they
share the tokenizer info, the special-token mask, the compile cache and the state class.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pipeline.core import Constraint, Grammar, UserError
from pipeline.core.bits import allows, pack, unpack, words

VERSION = "0.2.9"
CACHE_BYTES = 64 << 20  # XGrammar's own cache of compiled grammars, bounded (a server sees many distinct ones)


def _xgr():
    try:  # installed by `make setup` (not a pip dependency) and slow to import: only constraints load it
        import xgrammar
    except ImportError:
        raise UserError(f"regex / json_schema / ebnf constraints need XGrammar: run `make setup` "
                        f"(or pip install --no-deps xgrammar=={VERSION} apache-tvm-ffi pydantic)") from None
    return xgrammar


def engine_message(e: Exception) -> str:
    """XGrammar's error without its C++ location prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = " ".join(str(e).split())
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text)


def quiet(fn):
    """Run fn with the C++ side's stderr (XGrammar logs its warnings there) captured: returns
    (result, [warning, ...]) with each warning stripped of its location prefix."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            result = fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    warnings = list(dict.fromkeys(re.sub(r"^Warning:\s*", "", engine_message(line))
                                  for line in text.splitlines() if line.strip()))
    return result, warnings


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
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
        _COMPILERS[key] = (compiler, pack(allowed), pack(eos), tok)
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
            self.compiled, self.approximations = quiet(lambda: self._compile(compiler))
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
        if not self.m.is_completed():  # EOS is not allowed yet: no mask needed (it is filled later,
            return False  # on the engine's worker thread, while the forward runs)
        bits = self._current()
        return not bool((bits & ~self.g.eos_bits).any())

    def can_end(self) -> bool:
        return bool(self.m.is_completed())

    def describe(self) -> str:
        text = self.g.tokenizer.decode(self.history)
        return f"{self.g.kind} state after {len(self.history)} tokens, text so far {text[-200:]!r}"


_REF_SIBLINGS_OK = {"$ref", "$schema", "$id", "id", "definitions", "$defs", "title", "description", "$comment",
                    "default", "examples"}
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


def lint(schema, strict_mode: bool) -> list[str]:
    """Deviations XGrammar makes without a warning, found on JSONSchemaBench: keywords next to a
    `$ref` are dropped; a `required` property the object's `properties` do not define cannot be
    written under strict_mode (it forbids other properties), so the requirement is dropped; an
    `enum` whose values do not have the `type` beside it is generated from the enum alone; an
    anyOf/oneOf/allOf next to `properties` is not merged with them (other properties get through)."""
    out: list[str] = []

    def walk(node, where: str) -> None:
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")
            return
        if not isinstance(node, dict):
            return
        if "$ref" in node and set(node) - _REF_SIBLINGS_OK:
            out.append(f"{where or '/'}: keywords next to $ref are ignored ({', '.join(sorted(set(node) - _REF_SIBLINGS_OK))})")
        props = node.get("properties")
        if strict_mode and isinstance(node.get("required"), list) and node.get("additionalProperties") is not True:
            missing = [r for r in node["required"] if not isinstance(props, dict) or r not in props]
            if missing and (isinstance(props, dict) or node.get("type") == "object"):
                out.append(f"{where or '/'}: required {missing} not among its properties, which strict_mode forbids "
                           "(constraint.strict_mode=false allows other properties)")
        mixed = [k for k in ("anyOf", "oneOf", "allOf") if k in node]
        if mixed and any(k in node for k in ("properties", "additionalProperties", "items")):
            out.append(f"{where or '/'}: {mixed[0]} next to properties/items is not merged with them")
        types = node.get("type")
        if isinstance(node.get("enum"), list) and isinstance(types, (str, list)):
            kinds = tuple(_JSON_TYPES[t] for t in ([types] if isinstance(types, str) else types) if t in _JSON_TYPES)
            bad = [v for v in node["enum"] if kinds and not (isinstance(v, kinds) and
                                                             not (isinstance(v, bool) and bool not in kinds))]
            if bad:
                out.append(f"{where or '/'}: enum values {bad[:3]} do not have type {types}")
        for k, v in node.items():
            if k not in ("enum", "const", "default", "examples"):
                walk(v, f"{where}/{k}")

    walk(schema, "")
    return out


_SCANS: dict = {}


def _json_scan(backbone) -> tuple[torch.Tensor, torch.Tensor]:
    """What each token does to JSON's open structure, from either mode (outside / inside a string):
    delta[m, t], the change in open brackets; ends[m, t], whether it ends inside a string. EOS:
    delta -1000, so it ranks first where it is allowed (the output is complete). Escapes within one
    token are followed; one left open at a token's end is not (the ranking is a heuristic: validity
    comes from the grammar)."""
    tok, vocab = backbone.tokenizer, backbone.model.args.vocab_size
    key = (id(tok), vocab)
    if key not in _SCANS:
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # slow to import, loaded with the tokenizer
        byte = {v: k for k, v in bytes_to_unicode().items()}
        delta = torch.zeros(2, vocab, dtype=torch.long)
        ends = torch.zeros(2, vocab, dtype=torch.long)
        pieces = tok.convert_ids_to_tokens(list(range(min(vocab, len(tok)))))
        for t, piece in enumerate(pieces):
            text = "".join(chr(byte[ch]) if ch in byte else ch for ch in piece or "")
            for mode in (0, 1):
                inside, esc, d = bool(mode), False, 0
                for ch in text:
                    if inside:
                        if esc:
                            esc = False
                        elif ch == "\\":
                            esc = True
                        elif ch == '"':
                            inside = False
                    elif ch == '"':
                        inside = True
                    elif ch in "[{":
                        d += 1
                    elif ch in "]}":
                        d -= 1
                delta[mode, t], ends[mode, t] = d, int(inside)
        delta[:, list(backbone.eos_ids)] = -1000
        _SCANS[key] = (delta, ends)
    return _SCANS[key]


class JSONMatcher(Matcher):
    """A JSON-schema matcher that also follows the open structure (brackets, string) of its text, so
    that `close` can rank the allowed tokens by what is left to close after them."""

    def __init__(self, matcher, grammar, history=None, scan=None):
        super().__init__(matcher, grammar, history)
        self.open = list(scan or [(0, 0)])  # (open brackets, inside a string) after each token

    def advance(self, token: int) -> bool:
        if not super().advance(token):
            return False
        d, inside = self.open[-1]
        delta, ends = self.g.scan
        self.open.append((d + int(delta[inside, token]), int(ends[inside, token])))
        return True

    def rollback(self, n: int) -> None:
        super().rollback(n)
        if n:
            del self.open[-n:]

    def fork(self) -> "JSONMatcher":
        out = JSONMatcher(self.m.fork(), self.g, self.history, self.open)
        out._bits = self._bits
        return out

    def close(self, bits: torch.Tensor) -> None:
        """Keep the allowed tokens after which the least is left open (brackets + an open string)."""
        d, inside = self.open[-1]
        delta, ends = self.g.scan
        cost = delta[inside] + ends[inside]  # (V,): what is left open after each token, minus d
        allowed = unpack(bits[None], self.g.vocab_size)[0]
        cost = cost.masked_fill(~allowed, 1 << 30)
        bits.copy_(pack((allowed & (cost == cost.min()))[None])[0])


def _read(value, what: str, suffixes: tuple[str, ...], inline: bool = False) -> str:
    """An inline value or the path of a file holding it (a config's). inline: the value is the text
    itself, never opened as a path (a request's: what a client sends is data)."""
    if inline:
        return value
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


def schema_text(schema, inline: bool = False) -> str:
    """A schema given as a dict (a request line, a config mapping), a JSON string or (unless
    `inline`) a file path."""
    if schema is None:
        raise UserError("constraint=json_schema needs a schema: constraint.schema=<file.json> or a request "
                        'line with "json_schema": {...}')
    if not isinstance(schema, str):
        schema = OmegaConf.to_container(schema, resolve=True) if OmegaConf.is_config(schema) else schema
        return json.dumps(schema)
    text = _read(schema, "schema", (".json",), inline)
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"invalid json_schema: not JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                        "give a schema file or an inline JSON object") from None
    return text


class JSONSchema(XGrammarConstraint):
    """JSON that validates against a JSON schema. Compact by default (`any_whitespace: false`:
    XGrammar's separators, no free whitespace, where a small model otherwise can loop on newlines);
    `strict_mode` forbids properties and items the schema does not name. `close_margin`: in the last
    that many tokens of max_new_tokens, where a token that closes a string, array or object (or EOS)
    is allowed, only those are (the engine's closing margin): an output that would loop past the
    budget ends as JSON instead of being cut off. 0 turns it off (the masked distribution throughout).
    `inline`: a schema string is the schema itself, never a path (a request's)."""
    kind = "json_schema"

    def __init__(self, backbone, schema=None, any_whitespace: bool = False, indent: int | None = None,
                 strict_mode: bool = True, add_to_prompt: bool = False, close_margin: int = 0,
                 approximate: bool = True, inline: bool = False):
        self.schema = schema_text(schema, inline)
        self.options = dict(any_whitespace=bool(any_whitespace), indent=indent, strict_mode=bool(strict_mode))
        if not isinstance(close_margin, int) or isinstance(close_margin, bool) or close_margin < 0:
            raise UserError(f"constraint.close_margin must be an int >= 0, got {close_margin!r}")
        self.close_margin = close_margin
        if not approximate:  # `check` refused it before the model loaded on the CLI; here for direct use
            self.check(self.schema, any_whitespace, indent, strict_mode, approximate=False, inline=True)
        super().__init__(backbone, add_to_prompt)
        self.scan = _json_scan(backbone) if close_margin else None

    def start(self) -> Constraint:
        m = _xgr().GrammarMatcher(self.compiled, override_stop_tokens=self.eos_ids)
        return JSONMatcher(m, self) if self.scan is not None else Matcher(m, self)

    @classmethod
    def check(cls, schema=None, any_whitespace: bool = False, indent: int | None = None, strict_mode: bool = True,
              approximate: bool = True, inline: bool = False, **_) -> list[str]:
        """Raises UserError for a schema XGrammar refuses; returns what it only approximates (its own
        warnings, e.g. oneOf as anyOf, minLength next to a pattern, and the deviations `lint` finds).
        approximate=False refuses those schemas too, with the first reason."""
        xgr = _xgr()
        text = schema_text(schema, inline)
        try:
            warnings = quiet(lambda: xgr.Grammar.from_json_schema(text, any_whitespace=bool(any_whitespace),
                                                                  indent=indent, strict_mode=bool(strict_mode)))[1]
        except (RuntimeError, ValueError, TypeError) as e:
            raise UserError(f"invalid json_schema: {engine_message(e)}") from None
        warnings += lint(json.loads(text), bool(strict_mode))
        if warnings and not approximate:
            raise UserError(f"json_schema is only approximated: {warnings[0]} (constraint.approximate=true accepts it)")
        return warnings

    def _compile(self, compiler):
        return compiler.compile_json_schema(self.schema, **self.options)

    def text(self) -> str:
        return f"Reply with JSON only, following this JSON schema:\n{json.dumps(json.loads(self.schema))}"


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
    def check(cls, pattern=None, **_) -> list[str]:
        xgr = _xgr()
        try:
            return quiet(lambda: xgr.Grammar.from_regex(cls._pattern(pattern)))[1]
        except (RuntimeError, ValueError) as e:
            raise UserError(f"invalid regex {pattern!r}: {engine_message(e)}") from None

    def _compile(self, compiler):
        return compiler.compile_regex(self.pattern)

    def text(self) -> str:
        return f"Reply with text that matches this regular expression: {self.pattern}"


class EBNF(XGrammarConstraint):
    """Text in the language of a context-free grammar in XGrammar's EBNF (GBNF-like: `root ::= ...`),
    given inline or as a file (.ebnf / .gbnf; `inline`: never a file, a request's grammar)."""
    kind = "ebnf"

    def __init__(self, backbone, grammar: str | None = None, root: str = "root", add_to_prompt: bool = False,
                 inline: bool = False):
        self.grammar, self.root = self._grammar(grammar, inline), root
        super().__init__(backbone, add_to_prompt)

    @staticmethod
    def _grammar(grammar, inline: bool = False) -> str:
        if not isinstance(grammar, str) or not grammar.strip():
            raise UserError(f"constraint=ebnf needs a grammar: constraint.grammar=<file.ebnf> or the rules inline "
                            f"(got {grammar!r})")
        return _read(grammar, "grammar", (".ebnf", ".gbnf"), inline)

    @classmethod
    def check(cls, grammar=None, root: str = "root", inline: bool = False, **_) -> list[str]:
        xgr = _xgr()
        text = cls._grammar(grammar, inline)
        try:
            return quiet(lambda: xgr.Grammar.from_ebnf(text, root_rule_name=root))[1]
        except (RuntimeError, ValueError) as e:
            raise UserError(f"invalid grammar: {engine_message(e)}") from None

    def _compile(self, compiler):
        return compiler.compile_grammar(self.grammar, root_rule_name=self.root)

    def text(self) -> str:
        return f"Reply with text in the language of this grammar (EBNF):\n{self.grammar}"
