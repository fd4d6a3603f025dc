"""What a request becomes in the engine. `Admitter.to_engine` is the one mapping from a checked
`Spec` to the runner's `Request`, done the way `python -m pipeline` does a request line: the same
chat template and encode path, the same constraint path (`constraint_node` -> a compiled grammar,
`add_to_prompt` included), the request's `seed` or else the config's, and its sampling knobs over
the preset's (`SamplingParams`: what it gives of temperature, top_p and top_k, the preset's sampler
for the rest). A runner that takes no per-request knobs (beam search) refuses them, naming the field."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from omegaconf import DictConfig, OmegaConf

from pipeline.build import check_constraint, component, constraint_node, runner_class
from pipeline.core import Request, SamplingParams, UserError
from pipeline.decode import with_constraint_text
from pipeline.requests import encode
from pipeline.server.openai_api import APIError, Spec, bad, unsupported

# a request's constraint field (as a CLI request line names it) -> the request field it came from
PARAMS = {"json_schema": "response_format", "regex": "regex", "grammar": "grammar"}
GRAMMAR_CACHE = 64  # compiled grammars kept (the most recently used)


class Admitter:
    """Checks and encodes requests for one runner: its backbone's tokenizer and context, the
    config's chat settings, constraint and sampler."""

    def __init__(self, cfg: DictConfig, backbone):
        self.cfg, self.backbone = cfg, backbone
        self.limit = backbone.model.args.max_seq_len
        s = cfg.sampler
        # the preset's knobs, which a request's own override (temperature 0: greedy)
        self.sampling = SamplingParams(float(s.temperature) if s.do_sample else 0.0, float(s.top_p), int(s.top_k))
        self.per_request = runner_class(cfg).per_request
        self._grammars: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, spec: Spec) -> DictConfig | None:
        """The request's constraint node: its own, else the configured one."""
        own = spec.request.constraint
        if own and not self.cfg.get("request_constraints", True):
            raise bad(PARAMS[next(iter(own))], "this server ignores request constraints (request_constraints=false)")
        return constraint_node(self.cfg, own)

    def grammar(self, spec: Spec, node: DictConfig | None):
        """The compiled grammar of a constraint node, checked and compiled once per distinct node
        (blocking: call it off the event loop). An invalid one is a 400 naming the field."""
        if node is None:
            return None
        key = OmegaConf.to_yaml(node)
        with self._lock:
            if key not in self._grammars:
                try:
                    check_constraint(node)
                    self._grammars[key] = component(node, self.backbone)
                except (UserError, ValueError) as e:
                    own = spec.request.constraint
                    raise bad(PARAMS[next(iter(own))] if own else "constraint", str(e)) from None
                while len(self._grammars) > GRAMMAR_CACHE:
                    self._grammars.popitem(last=False)
            self._grammars.move_to_end(key)
            return self._grammars[key]

    def to_engine(self, spec: Spec, grammar) -> tuple[Request, int]:
        """The runner's Request for a checked spec and its grammar (its first choice: choice i is
        this with seed + i, a sibling of the first), and its prompt's length."""
        sampling = self.knobs(spec)
        field = "messages" if spec.kind == "chat" else "prompt"
        try:
            ids = encode(self.backbone.tokenizer, with_constraint_text(spec.request, grammar), spec.chat,
                         self.cfg.get("system_prompt"))
        except UserError as e:
            raise bad(field, str(e)) from None
        if len(ids) >= self.limit:
            raise APIError(400, f"{field}: the prompt is {len(ids)} tokens, the model's context is {self.limit}: "
                           "shorten it", field, "context_length_exceeded")
        seed = int(self.cfg.seed) if spec.seed is None else spec.seed
        if (spec.logprobs is not None or spec.n > 1 or spec.draft is not None) and not self.per_request:
            name = "logprobs" if spec.logprobs is not None else "n" if spec.n > 1 else "model"
            raise unsupported(name, f"{name} on this runner ({self.cfg.get('name')}: it takes no per-request options)")
        return Request(ids, seed, grammar, spec.max_tokens, sampling, spec.logprobs, spec.draft), len(ids)

    def knobs(self, spec: Spec) -> SamplingParams | None:
        """The request's sampling knobs: the preset's with what the request gives of temperature,
        top_p and top_k (None when it gives none: the preset's sampler). A runner without
        per-request knobs honours only what leaves its tokens as they are."""
        asked = {k: getattr(spec, k) for k in ("temperature", "top_p", "top_k") if getattr(spec, k) is not None}
        if not asked:
            return None
        try:
            params = replace(self.sampling, **asked)
        except ValueError as e:
            field = next((k for k in asked if str(e).startswith(k)), next(iter(asked)))
            raise bad(field, str(e)) from None
        if not self.per_request:
            if params != self.sampling and not (params.greedy and self.sampling.greedy):
                k = next(k for k in asked if asked[k] != getattr(self.sampling, k))
                raise unsupported(k, f"{k} {asked[k]} on this runner ({self.cfg.get('name')}: it takes no "
                                  "per-request sampling knobs)")
            return None
        return params
