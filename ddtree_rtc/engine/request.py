"""Requests: token ids in, token ids out, and why each one finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestError(ValueError):
    pass


# A request's sampling seed is a signed 64-bit integer, as in other OpenAI-compatible servers; its
# sampling stream is 2 * seed + 1 taken modulo 2**64 (engine.sampler.Sampler.sample_keys).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class FinishReason(str, enum.Enum):
    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None  # sampling seed (None: derived from the engine's seed and rid)
    budget: int | None = None  # speculative tree nodes per round (None: the engine's)
    output: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    # timing (seconds, host clock): set by the engine
    t_arrive: float = 0.0
    t_first: float | None = None
    t_done: float | None = None

    def validate(self, vocab_size: int, max_context: int) -> None:
        if not self.prompt:
            raise RequestError(f"request {self.rid}: empty prompt")
        bad = [t for t in self.prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"request {self.rid}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if self.max_new_tokens < 1:
            raise RequestError(f"request {self.rid}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        need = len(self.prompt) + self.max_new_tokens
        if need > max_context:
            raise RequestError(f"request {self.rid}: prompt ({len(self.prompt)}) + max_new_tokens "
                               f"({self.max_new_tokens}) = {need} exceeds the cache's max context {max_context}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise RequestError(f"request {self.rid}: temperature must be >= 0 and top_p in (0, 1]")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"request {self.rid}: seed must be an integer in [{SEED_MIN}, {SEED_MAX}] "
                               f"(a signed 64-bit integer), got {self.seed!r}")

    @property
    def length(self) -> int:
        """Tokens whose KV is (or is about to be) in the cache: prompt + generated."""
        return len(self.prompt) + len(self.output)

    def extend(self, tokens, eos_id: int | None) -> int:
        """Add a round's tokens in order, stopping at the first that finishes the request (EOS, a
        stop id, max_new_tokens); returns how many were taken."""
        for n, t in enumerate(tokens, 1):
            if self.append(int(t), eos_id):
                return n
        return len(tokens)

    def append(self, token: int, eos_id: int | None) -> bool:
        """Add one generated token; True once the request is finished."""
        self.output.append(token)
        if eos_id is not None and token == eos_id:
            self.finish = FinishReason.EOS
        elif token in self.stop_ids:
            self.finish = FinishReason.STOP
        elif len(self.output) >= self.max_new_tokens:
            self.finish = FinishReason.LENGTH
        return self.finish is not None
