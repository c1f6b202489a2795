"""The choice of tokens: what a forward returns (logits, or on several ranks their argmax), and the
token each row gets from it (argmax at temperature 0, else a seeded top-p sample).

A sample is keyed by (engine seed, the request's stream, position), never by batch slot or step,
so a request samples the same tokens whatever else is in the batch and however many tokens a
round emits: a speculative round's tree node and the autoregressive step it stands for use one key.
"""

from __future__ import annotations

import numpy as np

from ..reference.sampling import position_keys
from .request import Request


class Sampler:
    """Token choice for one engine: its backend, its seed and the number of ranks the logits are
    sliced over (``world``)."""

    def __init__(self, backend, seed: int = 0, world: int = 1, model=None):
        """``model``: on several ranks, the tensor-parallel target whose vocabulary slice the logits
        are (its communicator and vocabulary offset: ddtree_rtc.parallel.vocab samples across ranks)."""
        if world > 1 and model is None:
            raise ValueError(f"a sampler over {world} ranks needs the model (its communicator and vocabulary slice)")
        self.backend, self.seed, self.world, self.model = backend, seed, world, model

    def sample_keys(self, reqs: list[Request], positions) -> np.ndarray:
        """uint64 row keys of the draws that give request b its token at ``positions[b]`` (host
        keys, or device keys when ``positions`` is a device array). The stream is the request's own
        seed, or its id when it has none."""
        # Python ints taken modulo 2**64: any 64-bit seed gives a stream, and no seed overflows.
        streams = np.array([(2 * r.seed + 1 if r.seed is not None else 2 * int(r.rid)) % 2**64 for r in reqs],
                           np.uint64)
        if not hasattr(positions, "__cuda_array_interface__"):
            positions = np.asarray(positions, np.int64)
        return position_keys(self.seed, streams, positions)

    def output_for(self, reqs: list[Request]) -> str:
        """What a forward for ``reqs`` returns: on several ranks, when every request is greedy, the
        argmax merged across the vocabulary slices, else this rank's slice of the logits, which
        ``choose`` samples exchanging only (value, id) pairs (no logits gathered either way); on
        one rank the logits."""
        if self.world > 1:
            return "shard" if any(r.temperature for r in reqs) else "argmax"
        return "logits"

    def outputs(self) -> tuple[str, ...]:
        """Every output ``output_for`` may ask a forward for."""
        return ("argmax", "shard") if self.world > 1 else ("logits",)

    def choose(self, logits, reqs: list[Request], positions):
        """Backend int32 tokens for the rows of ``logits`` (row b: request ``reqs[b]``'s token at
        ``positions[b]``): argmax where the request's temperature is 0, else its seeded sample."""
        be = self.backend
        temps = np.array([r.temperature for r in reqs], dtype=np.float32)
        if not temps.any():
            return be.argmax(logits)
        top_p = np.array([r.top_p for r in reqs], dtype=np.float32)
        keys = self.sample_keys(reqs, positions)  # on the device when positions are
        if self.world > 1:  # ``logits`` is this rank's vocabulary slice (output 'shard')
            from ..parallel import vocab

            return vocab.sample(self.model, logits, temps, top_p,
                                be.asarray(keys) if isinstance(keys, np.ndarray) else keys)
        return be.sample(logits, be.asarray(temps), be.asarray(top_p), self.seed,
                         keys=be.asarray(keys) if isinstance(keys, np.ndarray) else keys)
