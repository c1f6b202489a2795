"""The model runner: every target forward the engine makes, planned into device buffers that are
kept per shape and, with ``graphs`` (CUDA backend), replayed as CUDA graphs.

A shape is a key (batch, rows, rows per request at most; 0 for causal):

- ``(B, 1, 0)``: an autoregressive decode step (``decode``).
- ``(B, T, width)``: a speculative round's verify of T rows in all, packed: request b's
  ``[root, nodes]`` (its own row count, at most ``width``), the requests one after another
  (``plan_tree`` -> ``fill_tree`` -> ``verify``). T is a bucket that holds the batch's rows; the
  rows past a request's tree are padding, copies of its root (``fill_tree``). The host half (cache
  slots, attention plan, the row -> (request, slot) map) needs nothing of the tree: the round makes
  it while the device drafts and builds, its copies queued on the stream from page-locked staging
  (``Backend.copy_in``) without waiting for it. The tree's tokens, positions and ancestor mask then
  go from ``TreeArrays`` into the shape's input buffers on the device, so the mask never visits the
  host.
- Prefill is ragged and runs eagerly (``prefill``).

A shape keeps one graph per output kind: the logits, or on several ranks their argmax merged across
the vocabulary slices (greedy batches; no logits gathered). A graph is captured ahead of its first
use (``capture``: the engine captures every shape decoding can reach when it starts, from the shapes'
template inputs), or else the first time its shape and output are seen. One eager warm-up run of the
same step comes first; it compiles nothing new but lets cuBLAS pick its kernels outside the capture, and the KV rows
it writes are the ones the replay writes again. The graph is then replayed for that step and every
later one of the shape. Per step the host writes only the step's inputs and attention plan into the
shape's fixed buffers (``TargetModel.prepare(..., into=...)``) and launches the graph.

Everything a captured kernel touches must keep its address for the graph's life: the inputs
(``StepInputs``), the MoE plan's buffers, and every intermediate. Intermediates come from a memory
pool private to the shape, so a buffer freed during capture is reused only by the same graph, never
by eager code that could run between two replays. Each attention plan is first made for the worst
case of its shape (every request at the full context) as a replay template: its work list has room
for any later plan written into it, and it always launches the split-K merge (which reads from device
memory how many tiles the current plan cut). Without graphs the same buffers are reused and the forward runs eagerly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.target import ForwardBatch, ForwardOutput, StepInputs, TargetModel
from ..reference.tree_build import mask_words
from .kv_cache import PAGE_SENTINEL


@dataclass
class _Shape:
    inputs: StepInputs
    moe_plan: Any
    pool: Any  # cupy.cuda.MemoryPool of the shape's intermediates (None on numpy / without graphs)
    mask: Any = None  # uint64 [T, words] tree mask buffer (tree shapes)
    self_bits: Any = None  # uint64 [width, words]: slot s sees only itself (padding rows)
    row_req: Any = None  # int32 [T]: the request of each verify row (tree shapes)
    row_slot: Any = None  # int32 [T]: its tree slot (0 = the root)
    pick: Any = None  # int32 [B, width]: the row of request b's slot j, -1 past its rows
    # per output kind ('logits', or 'argmax' on several ranks): the captured graph, its output
    # buffers and the collectives one replay runs (CommStats)
    graphs: dict = field(default_factory=dict)
    outs: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)


@dataclass
class TreeStep:
    """A planned verify forward: the shape's buffers, for ``fill_tree`` and ``verify``."""

    key: tuple  # (B, T, width)
    seq_ids: list
    prefix: np.ndarray  # host int64 [B]: committed tokens (the root's cache position)
    prefix_dev: Any  # backend int32 [B]
    inputs: StepInputs
    rows: np.ndarray = None  # host int64 [B]: verify rows of each request (its tree and padding)
    q_start: np.ndarray = None  # host int64 [B]: the row of each request's root
    row_req: np.ndarray = None  # host int64 [T]: the request (index) of each row

    @property
    def total(self) -> int:
        return self.key[1]


class ModelRunner:
    """Owns planning and CUDA graphs of the target forward (see the module doc)."""

    def __init__(self, model: TargetModel, cache, max_context: int, graphs: bool = False, hidden_layers=()):
        if graphs and not self.supports_graphs(model.backend):
            raise ValueError("CUDA graphs need the cuda backend")
        self.model, self.cache, self.max_context = model, cache, max_context
        self.graphs, self.hidden_layers = graphs, tuple(hidden_layers)
        self.page_width = cache.allocator.pages_for(max_context)
        self._shapes: dict[tuple, _Shape] = {}
        self.captures = 0
        self.replays = 0  # graph launches (the first of each shape included)

    @staticmethod
    def supports_graphs(backend) -> bool:
        """Whether a runner on ``backend`` can replay graphs (CUDA graphs: the cuda backend)."""
        return backend.is_cuda

    def __len__(self) -> int:
        return sum(len(s.graphs) for s in self._shapes.values())

    def graph_of(self, batch_size: int, tokens: int = 1, tree: int = 0, output: str = "logits"):
        """The captured graph of a shape (KeyError before its first forward): a decode step's
        ``(B, 1, 0)``, a verify's ``(B, T rows, width)``."""
        g = self._shapes[(batch_size, tokens, tree)].graphs.get(output)
        if g is None:
            raise KeyError(f"shape {(batch_size, tokens, tree)} has no captured {output} graph (graphs={self.graphs})")
        return g

    # -- eager forwards ------------------------------------------------------------------------
    def prefill(self, batch: ForwardBatch, hidden_layers=(), output: str = "logits") -> ForwardOutput:
        """A ragged prefill (or any batch), eagerly; logits (or their argmax: ``output``) for
        ``batch.logit_rows``."""
        return self.model.forward(batch, self.cache, output=output, hidden_layers=hidden_layers)

    # -- shapes --------------------------------------------------------------------------------
    def _shape(self, b: int, t: int, width: int) -> _Shape:
        """The buffers of a decode step (``width`` 0; keyed ``(b, 1, 0)``) or of a verify of ``t``
        rows with at most ``width`` per request (keyed ``(b, t, width)``; the template spreads the
        rows as ``plan_tree`` would, every later plan is written into it)."""
        key = (b, 1, 0) if not width else (b, t, width)
        s = self._shapes.get(key)
        if s is not None:
            return s
        model, be = self.model, self.model.backend
        pool, ctx = self._pool()
        with ctx:
            num_new = spread_rows(np.ones(b, np.int64), width, t) if width else np.ones(b, np.int64)
            total = int(num_new.sum())
            worst = self.max_context - num_new
            mask = self_bits = row_req = row_slot = pick = None
            if width:
                words = mask_words(width - 1)
                bits = np.zeros((width, words), np.uint64)
                col = np.arange(width)
                bits[col, col // 64] = np.uint64(1) << (col % 64).astype(np.uint64)
                self_bits = be.asarray(bits)
                slot = np.concatenate([np.arange(n) for n in num_new])
                mask = be.asarray(bits[slot])  # a valid mask until the first fill
                row_req, row_slot = be.zeros((total,), "int32"), be.zeros((total,), "int32")
                pick = be.zeros((b, width), "int32")
            pos = np.concatenate([np.arange(c, c + n) for c, n in zip(worst, num_new)]).astype(np.int32)
            rows = None if width else np.arange(b)
            table = np.zeros((b, self.page_width), np.int32)  # page 0 stands in: only capacity matters
            plan = be.mla_attention_plan(worst, num_new, table, model.dims.num_heads, self.cache.page_size,
                                         self.cache.num_pages, mask, check_mask=False, replay=True,
                                         split=model.attention_split(total))
            inputs = StepInputs(ForwardBatch([None] * b, worst, num_new, np.zeros(total, np.int32), pos, mask),
                                be.asarray(np.zeros(total, np.int32)), be.asarray(pos),
                                be.zeros((total,), "int32"), plan,
                                None if rows is None else be.asarray(rows.astype(np.int64)))
            s = self._shapes[key] = _Shape(inputs, model.moe_plan(total), pool, mask, self_bits, row_req, row_slot,
                                           pick)
        return s

    def _run(self, s: _Shape, hidden_layers, output: str = "logits") -> ForwardOutput:
        """Run the shape's prepared inputs: eagerly, or through its graph for ``output`` (captured
        on first use)."""
        model, cache = self.model, self.cache
        if not self.graphs:
            return model.run(s.inputs, cache, output=output, hidden_layers=hidden_layers, moe_plan=s.moe_plan)
        self._ensure_graph(s, hidden_layers, output)
        s.graphs[output].launch()
        model.comm.stats.add_counts(s.collectives[output])  # a replay's collectives are not seen by Python
        self.replays += 1
        return s.outs[output]

    def _pool(self):
        """A new shape's memory pool and the context that allocates from it: with graphs a pool
        private to the shape (the module doc), else none."""
        if not self.graphs:
            return None, contextlib.nullcontext()
        import cupy

        pool = cupy.cuda.MemoryPool()
        return pool, cupy.cuda.using_allocator(pool.malloc)

    def _ensure_graph(self, s: _Shape, hidden_layers, output: str) -> None:
        """The shape's graph for ``output``: captured (and counted) unless it is already."""
        if output not in s.graphs:
            self._capture(s, hidden_layers, output)
            self.captures += 1

    def _capture(self, s: _Shape, hidden_layers, output: str) -> None:
        """Capture the shape's forward for ``output`` into ``s.graphs`` (its outputs into
        ``s.outs``), after one eager run of the same step."""
        import cupy

        from ..parallel.comm import CommStats

        model, cache = self.model, self.cache
        stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.get_current_stream().synchronize()  # the inputs were written on the caller's stream
        with stream, cupy.cuda.using_allocator(s.pool.malloc):
            model.run(s.inputs, cache, output=output, hidden_layers=hidden_layers, moe_plan=s.moe_plan)
            stream.synchronize()
            counted, model.comm.stats = model.comm.stats, CommStats()  # what the capture enqueues
            stream.begin_capture()
            try:
                s.outs[output] = model.run(s.inputs, cache, output=output, hidden_layers=hidden_layers,
                                           moe_plan=s.moe_plan)
            finally:
                s.graphs[output] = stream.end_capture()
                s.collectives[output], model.comm.stats = model.comm.stats, counted
            stream.synchronize()

    def capture(self, keys, outputs=("logits",), max_bytes: int | None = None) -> list:
        """Capture the graphs of shapes ``keys`` (``(B, 1, 0)`` decode steps, ``(B, T, width)``
        verifies) for each of ``outputs`` before their first use, in order, so serving never stalls
        on a capture: each from its shape's template inputs (token 0 at the worst-case positions,
        every row's KV written to slot 0, the attention plan the worst case's), which later steps
        overwrite in place. Run it while no request holds a page (slot 0 is page 0's). A shape is
        not started once the shapes' pools hold ``max_bytes`` (None: no bound); those left are
        captured at their first use, as any shape not given here. Returns the keys left."""
        if not self.graphs:
            return []
        keys = list(dict.fromkeys(keys))
        for i, key in enumerate(keys):
            if max_bytes is not None and self.graph_bytes() >= max_bytes:
                return keys[i:]
            b, t, width = key
            s = self._shape(b, t, width)
            for output in outputs:
                self._ensure_graph(s, self._hidden(width), output)
        return []

    def _hidden(self, width: int) -> tuple:
        """The hidden layers a forward of this shape hands out: a verify's (``width`` > 0) the
        drafter's, a decode step's none."""
        return self.hidden_layers if width else ()

    def graph_bytes(self) -> int:
        """Device bytes the shapes' private pools hold (the graphs' intermediates and outputs)."""
        return sum(s.pool.total_bytes() for s in self._shapes.values() if s.pool is not None)

    # -- autoregressive decode -----------------------------------------------------------------
    def decode(self, batch: ForwardBatch, output: str = "logits"):
        """Logits bf16 [B, V] of a decode batch (one new token per request, logits for every row),
        or with ``output='argmax'`` their int32 argmax [B]. With graphs this is the graph's output
        buffer: read it before the next call of that size."""
        if batch.tree_mask is not None or not np.all(batch.num_new == 1):
            raise ValueError("decode runs decode batches: one new token per request, no tree mask")
        if batch.logit_rows is None or not np.array_equal(batch.logit_rows, np.arange(len(batch.seq_ids))):
            raise ValueError("decode needs logits for every row (logit_rows = 0..B-1)")
        pick = "tokens" if output == "argmax" else "logits"
        if not self.graphs:
            return getattr(self.model.forward(batch, self.cache, output=output), pick)
        s = self._shape(len(batch.seq_ids), 1, 0)
        s.inputs = self.model.prepare(batch, self.cache, into=s.inputs, page_width=self.page_width)
        return getattr(self._run(s, self._hidden(0), output), pick)

    # -- tree verify ---------------------------------------------------------------------------
    def plan_tree(self, seq_ids, prefix, rows, width: int | None = None, total: int | None = None) -> TreeStep:
        """The host half of a verify forward. ``rows``: an int (every request) or ``[B]`` ints, the
        rows request b verifies (its root and nodes, at cache positions prefix[b] + 0, 1, ...);
        ``width``: the most rows a request may take (the tree buffers' slots, the cache rows reserved
        past its prefix; default the largest of ``rows``); ``total``: the verify's rows, a bucket of
        at least their sum (default the sum): the extra rows go to the requests' spare slots, in
        request order (``spread_rows``), as padding. Writes the cache slots, the attention plan and
        the row -> (request, slot) map into the shape's buffers. No device sync; the tree's contents
        come later (``fill_tree``)."""
        model, be, cache = self.model, self.model.backend, self.cache
        prefix = np.asarray(prefix, np.int64)
        b = len(seq_ids)
        rows = np.broadcast_to(np.asarray(rows, np.int64), (b,))
        width = int(rows.max()) if width is None else int(width)
        total = int(rows.sum()) if total is None else int(total)
        num_new = spread_rows(rows, width, total)
        s = self._shape(b, total, width)
        q_start = np.cumsum(num_new) - num_new
        row_req = np.repeat(np.arange(b), num_new)
        row_slot = np.arange(total) - q_start[row_req]
        pick = np.full((b, width), -1, np.int64)
        pick[row_req, row_slot] = np.arange(total)
        table = cache.allocator.page_table(seq_ids, self.page_width)
        # every row's cache slot from the page table at once (one lookup per request was most of the
        # plan's host time that grows with the batch)
        pos = prefix[row_req] + row_slot
        page = table[row_req, pos // cache.page_size]
        if (page == PAGE_SENTINEL).any():
            r = int(row_req[np.argmax(page == PAGE_SENTINEL)])
            raise ValueError(f"sequence {seq_ids[r]!r}: positions {int(prefix[r])}..{int(prefix[r] + num_new[r] - 1)} "
                             f"outside its reserved pages")
        slots = page.astype(np.int64) * cache.page_size + pos % cache.page_size
        plan = be.mla_attention_plan(prefix, num_new, table, model.dims.num_heads, cache.page_size,
                                     cache.num_pages, s.mask, check_mask=False, into=s.inputs.plan)
        for dst, src in ((s.inputs.slots, slots), (s.row_req, row_req), (s.row_slot, row_slot), (s.pick, pick)):
            be.copy_in(dst, src)  # int64 -> the buffers' int32 in the copy
        s.inputs = StepInputs(ForwardBatch(list(seq_ids), prefix, num_new, None, None, s.mask),
                              s.inputs.tokens, s.inputs.positions, s.inputs.slots, plan, None)
        return TreeStep((b, total, width), list(seq_ids), prefix, be.asarray(prefix.astype(np.int32)), s.inputs,
                        num_new, q_start, row_req)

    def fill_tree(self, step: TreeStep, tree) -> None:
        """Device copy of ``tree`` (TreeArrays with at least ``width`` slots per request) into the
        step's inputs: row r gets slot ``row_slot[r]`` of request ``row_req[r]``. Rows past a tree's
        nodes (``num_nodes``) verify the root's token at the root's position seeing only themselves
        (their KV rows are written past the prefix and never read): copies of the root, so they
        route to the root's experts and add no MoE weight traffic (engine/decode/budget.py)."""
        s = self._shapes[step.key]
        xp = self.model.backend.xp
        req, slot = s.row_req, s.row_slot
        used = slot < tree.num_nodes[req]
        # each row reads one slot of the flattened tree: its own, or its request's root (slot 0, at
        # the root's position: prefix + depth 0). Few array operations: with the auto budget this
        # runs between the choice and the verify, while the device waits for it
        flat = req * tree.tokens.shape[1] + xp.where(used, slot, 0)
        xp.take(tree.tokens.reshape(-1), flat, out=s.inputs.tokens)
        xp.take(tree.positions.reshape(-1), flat, out=s.inputs.positions)
        words = s.mask.shape[1]
        rows = tree.mask.reshape(-1, tree.mask.shape[-1])
        if rows.shape[1] == words:
            xp.take(rows, flat, axis=0, out=s.mask)
        else:
            s.mask[...] = xp.take(rows, flat, axis=0)[:, :words]
        xp.copyto(s.mask, s.self_bits[slot], where=~used[:, None])

    def per_slot(self, step: TreeStep, values, fill=-1):
        """``values`` [T] of the verify's rows -> [B, width]: slot j of request b, ``fill`` past its
        rows (on the device, no sync)."""
        s = self._shapes[step.key]
        xp = self.model.backend.xp
        return xp.where(s.pick >= 0, values[xp.maximum(s.pick, 0)], fill).astype(values.dtype, copy=False)

    def verify(self, step: TreeStep, output: str = "logits") -> ForwardOutput:
        """Logits [T, V] of every row (or their argmax, ``output='argmax'``) and the hidden
        states at ``hidden_layers`` (with graphs: the graph's buffers, valid until the next verify
        of the shape)."""
        return self._run(self._shapes[step.key], self._hidden(step.key[2]), output)


def spread_rows(rows, width: int, total: int) -> np.ndarray:
    """Rows per request of a verify of ``total`` rows: ``rows`` [B] (each >= 1) plus the padding
    ``total - sum(rows)``, given to the requests in order, each up to ``width`` rows."""
    rows = np.asarray(rows, np.int64)
    extra = int(total) - int(rows.sum())
    if (rows < 1).any() or (rows > width).any() or extra < 0 or extra > int((width - rows).sum()):
        raise ValueError(f"a verify of {total} rows cannot hold rows {rows.tolist()} at most {width} per request")
    room = width - rows
    before = np.cumsum(room) - room
    return rows + np.clip(extra - before, 0, room)
