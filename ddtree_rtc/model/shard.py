"""Which part of the model one rank holds (docs/architecture.md, "Parallelism").

With ``world`` ranks: attention heads, the dense MLP's and the shared expert's intermediate, and the
lm_head's vocabulary rows are split evenly (rank r holds the r-th part); the routed experts either
split their intermediate the same way (tensor parallel) or, with ``expert_parallel``, rank r holds
experts [r E / world, (r + 1) E / world) whole. Embedding, norms, the q_a / kv_a projections (the
576-wide latent row and its cache) and the router are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = 32  # INT4 scale group: a tensor-parallel split of the routed experts keeps groups whole


class ShardError(ValueError):
    pass


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1
    expert_parallel: bool = False

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ShardError(f"rank {self.rank} of {self.world}: need 0 <= rank < world")

    def part(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's even share of ``n`` (``what`` names it in the error)."""
        if n % self.world:
            raise ShardError(f"{what} ({n}) does not split evenly over {self.world} ranks")
        step = n // self.world
        return self.rank * step, (self.rank + 1) * step

    def experts(self, num_experts: int) -> range:
        """The routed experts this rank holds."""
        if not self.expert_parallel:
            return range(num_experts)
        return range(*self.part(num_experts, "routed experts (expert parallel)"))

    def expert_intermediate(self, intermediate: int, multiple: int = GROUP) -> tuple[int, int] | None:
        """[start, stop) of the routed experts' intermediate on this rank (None: all of it); each
        rank's share must be a multiple of ``multiple`` (the INT4 group; the GPU kernels' 128-wide
        k block on the CUDA backend)."""
        if self.expert_parallel or self.world == 1:
            return None
        lo, hi = self.part(intermediate, "moe_intermediate_size (tensor-parallel experts)")
        if (hi - lo) % multiple:
            raise ShardError(f"moe_intermediate_size {intermediate} over {self.world} ranks leaves {hi - lo} per "
                             f"rank, not a multiple of {multiple} (the INT4 experts' k granularity on this "
                             f"backend); use expert_parallel")
        return lo, hi

    def check(self, cfg, multiple: int = GROUP) -> None:
        """Every split the config implies is even (all problems named at once); ``multiple`` as in
        ``expert_intermediate``."""
        problems = []
        checks = [(cfg.num_attention_heads, "attention heads"), (cfg.vocab_size, "vocab_size (lm_head)")]
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            checks.append((cfg.intermediate_size, "intermediate_size (dense MLP)"))
        if cfg.n_routed_experts:
            if cfg.n_shared_experts:
                checks.append((cfg.moe_intermediate_size * cfg.n_shared_experts, "shared expert intermediate"))
        for n, what in checks:
            try:
                self.part(n, what)
            except ShardError as e:
                problems.append(str(e))
        if cfg.n_routed_experts:
            try:
                self.experts(cfg.n_routed_experts)
                self.expert_intermediate(cfg.moe_intermediate_size, multiple)
            except ShardError as e:
                problems.append(str(e))
        if problems:
            raise ShardError("; ".join(problems))
