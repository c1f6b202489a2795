"""CUDA graphs of the target model's decode forward, one per batch size.

A graph is captured the first time a batch size is seen (after one eager warm-up run of the same
step, which compiles nothing new but lets cuBLAS pick its kernels outside the capture; the KV rows it writes are
the ones the replay writes again) and replayed for that step and every later one of that size: per
step the host only writes the step's tokens, positions, slots and attention plan into the graph's
fixed device buffers (``TargetModel.prepare(..., into=...)``) and launches the graph, so the
kernels run back to back without per-launch host overhead.

Everything the captured kernels touch must stay at the same address for the graph's life: the
inputs (``StepInputs``), the MoE plan's buffers, and every intermediate, which comes from a memory
pool private to the graph (intermediates freed during capture are reused only by the same graph,
never by eager code that could run between two replays). The attention plan is first made for the
worst case of the size (every row at the full context), so its work list has room for any later
plan written into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model.target import ForwardBatch, StepInputs, TargetModel


@dataclass
class _Captured:
    graph: Any  # cupy.cuda.graph.Graph
    inputs: StepInputs
    logits: Any  # bf16 [B, V]: the graph's output buffer
    pool: Any  # cupy.cuda.MemoryPool holding the graph's intermediates
    moe_plan: Any


class DecodeGraphs:
    """``forward(batch)`` = ``model.forward(batch, cache, output='logits').logits`` for decode
    batches (one new token per request), through a CUDA graph per batch size."""

    def __init__(self, model: TargetModel, cache, max_context: int):
        if not model.backend.is_cuda:
            raise ValueError("CUDA graphs need the cuda backend")
        self.model, self.cache = model, cache
        self.max_context = max_context
        self.page_width = cache.pages_for(max_context)
        self._graphs: dict[int, _Captured] = {}
        self.captures = 0
        self.replays = 0  # graph launches (the first of each size included)

    def __len__(self) -> int:
        return len(self._graphs)

    def _worst_case(self, b: int) -> ForwardBatch:
        """A batch of ``b`` decode rows at the longest context: the plan with the most work items."""
        ctx = np.full(b, self.max_context - 1, dtype=np.int64)
        return ForwardBatch([None] * b, ctx, np.ones(b, np.int64), np.zeros(b, np.int32), ctx.astype(np.int32),
                            None, np.arange(b))

    def _capture(self, batch: ForwardBatch) -> _Captured:
        import cupy

        model, b = self.model, len(batch.seq_ids)
        stream = cupy.cuda.Stream(non_blocking=True)
        pool = cupy.cuda.MemoryPool()
        with stream, cupy.cuda.using_allocator(pool.malloc):
            inputs = self._plan_worst(b)
            moe_plan = model.moe_plan(b)
            inputs = model.prepare(batch, self.cache, into=inputs, page_width=self.page_width)
            model.run(inputs, self.cache, output="logits", moe_plan=moe_plan)  # warm-up, the real step's writes
            stream.synchronize()
            stream.begin_capture()
            try:
                out = model.run(inputs, self.cache, output="logits", moe_plan=moe_plan)
            finally:
                graph = stream.end_capture()
            stream.synchronize()
        self.captures += 1
        return _Captured(graph, inputs, out.logits, pool, moe_plan)

    def _plan_worst(self, b: int) -> StepInputs:
        """StepInputs for ``b`` rows whose attention plan is sized for the worst case (page 0 stands
        in for every page: only the plan's capacity matters, it is overwritten before any run)."""
        model, be = self.model, self.model.backend
        wb = self._worst_case(b)
        table = np.zeros((b, self.page_width), np.int32)
        plan = be.mla_attention_plan(wb.ctx_lens, wb.num_new, table, model.dims.num_heads, self.cache.page_size,
                                     self.cache.num_pages, None)
        return StepInputs(wb, be.asarray(wb.tokens), be.asarray(wb.positions), be.zeros((b,), "int32"), plan,
                          be.asarray(np.asarray(wb.logit_rows, dtype=np.int64)))

    def graph_of(self, batch_size: int):
        """The captured graph of a batch size (KeyError before its first ``forward``)."""
        return self._graphs[batch_size].graph

    def forward(self, batch: ForwardBatch):
        """Logits bf16 [B, V] of a decode batch (the graph's output buffer: read it before the next
        call of the same batch size)."""
        if batch.tree_mask is not None or not np.all(batch.num_new == 1):
            raise ValueError("DecodeGraphs runs decode batches: one new token per request, no tree mask")
        if batch.logit_rows is None or not np.array_equal(batch.logit_rows, np.arange(len(batch.seq_ids))):
            raise ValueError("DecodeGraphs needs logits for every row (logit_rows = 0..B-1)")
        b = len(batch.seq_ids)
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._capture(batch)  # prepares this batch into the graph's inputs
        else:
            self.model.prepare(batch, self.cache, into=g.inputs, page_width=self.page_width)
        g.graph.launch()
        self.replays += 1
        return g.logits
