"""Autoregressive decoding: one forward gives every running request one token. The prefill's
first token is chosen the same way (``forward_tokens``), so both read the chosen tokens in the
step's one host sync."""

from __future__ import annotations

from ...model.target import ForwardBatch
from ..request import Request


def host_tokens(sampler, result, output: str, reqs: list[Request], positions):
    """Host int tokens from a forward's ``result``: the tokens themselves when ``output`` is
    'argmax', else the sampler's choice over the logits (row b: ``reqs[b]`` at ``positions[b]``)."""
    be = sampler.backend
    if output == "argmax":
        return be.to_host(result)
    return be.to_host(sampler.choose(result, reqs, positions))


def prefill_tokens(runner, sampler, clock, reqs: list[Request], hidden_layers=()):
    """Prefill every request's whole prompt in one forward; returns the host token each request
    emits first and the hidden states at ``hidden_layers`` (every prompt row, request by request)."""
    batch = ForwardBatch.causal([r.rid for r in reqs], [0] * len(reqs), [r.prompt for r in reqs])
    output = sampler.output_for(reqs)
    out = clock.time("prefill", runner.prefill, batch, hidden_layers=hidden_layers, output=output)
    result = out.tokens if output == "argmax" else out.logits
    positions = [len(r.prompt) for r in reqs]  # where each request's next token goes
    return clock.time("sample", host_tokens, sampler, result, output, reqs, positions), out.hidden


class AutoregressiveDecode:
    """One decode forward per step over every running request (``runner.decode``: replayed from
    the batch size's CUDA graph when the runner has graphs)."""

    width = min_rows = 1  # forward rows one request takes per step (the engine groups requests by min_rows)

    def __init__(self, runner, sampler, clock):
        self.runner, self.sampler, self.clock = runner, sampler, clock

    def tail(self, req: Request) -> int:
        """Cache rows written past the committed prefix: none."""
        return 0

    @staticmethod
    def shapes(batch: int) -> list[tuple]:
        """The runner shape a step of ``batch`` requests decodes in (engine.runner)."""
        return [(batch, 1, 0)]

    def run(self, reqs: list[Request], eos_id) -> None:
        batch = ForwardBatch.causal([r.rid for r in reqs], [r.length - 1 for r in reqs],
                                    [[r.output[-1]] for r in reqs])
        output = self.sampler.output_for(reqs)
        result = self.clock.time("decode", self.runner.decode, batch, output)
        positions = [r.length for r in reqs]  # where each request's next token goes
        tokens = self.clock.time("sample", host_tokens, self.sampler, result, output, reqs, positions)
        for r, t in zip(reqs, tokens):
            r.append(int(t), eos_id)
