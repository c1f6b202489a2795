"""The DFlash drafter at Kimi K2.6's drafter dims (6 layers, hidden 7168, 64 q / 8 kv heads of 128,
intermediate 18432, block 8, vocab 163840; `make-model --preset dflash-k2.6`'s config), random
weights made on the GPU, against byte floors over the read ceiling measured in the same run:

  * forward: one block forward (ddtree_rtc/model/dflash.py, ``block_forward``) at batch {1, 8, 32}
    and context {1k, 4k}, replayed from a CUDA graph (eager in ``extra``). Floor: every weight it
    reads (6 layers, final norm, the target's lm_head), the embedding rows, the context K/V of every
    layer and request, the logits it writes;
  * extend: the context update after a round (``context_kv`` of ``--extend-rows`` rows per
    request, root + accepted nodes, and their K/V writes), the per-round cost a drafter pays beside
    its forward. Floor: fc, each layer's k / v projections and norms, the hidden states read, the
    K/V rows written;
  * gqa: the drafter's attention kernel alone (``gqa_attention``: the block's 8 rows x 64 heads over
    the paged context K/V and the block's own K/V), against the K/V bytes it must read.

Context pages are scattered (a random permutation), page size 64. The L2 is flushed before every
timed run."""

from __future__ import annotations

import argparse

import numpy as np

from .harness import Row, random_bf16_device, read_ceiling_gbs, report, time_gpu

PAGE = 64
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 4096)
GQA_CONTEXTS = (1024, 4096, 16384)
EXTEND_ROWS = 5  # root + accepted nodes per request at tau ~ 5


def k26_config():
    """The DFlash config of ``make-model --preset dflash-k2.6`` (z-lab's Kimi K2.5/K2.6 drafter)."""
    from ..model.dflash import dflash_config_from_dict, random_dflash_dict

    return dflash_config_from_dict(random_dflash_dict("dflash-k2.6"), "<preset dflash-k2.6>")


def layer_weight_elems(c) -> int:
    """bf16 values of one drafter layer: q/k/v/o, q/k norms, gate_up, down, the two norms."""
    h, d = c.hidden_size, c.head_dim
    qo = 2 * c.num_attention_heads * d * h
    kv = 2 * c.num_key_value_heads * d * h
    return qo + kv + 2 * d + 3 * c.intermediate_size * h + 2 * h


def forward_bytes(c, batch: int, ctx: int) -> int:
    """Byte floor of one block forward: weights, lm_head, final norm, embedding rows, context K/V
    (every layer, K and V), logits written; bf16 throughout."""
    rows, kv_row = batch * c.block_size, c.num_key_value_heads * c.head_dim
    weights = c.num_hidden_layers * layer_weight_elems(c) + c.hidden_size + c.vocab_size * c.hidden_size
    context = c.num_hidden_layers * 2 * batch * ctx * kv_row
    logits = batch * (c.block_size - 1) * c.vocab_size
    return 2 * (weights + rows * c.hidden_size + context + logits)


def extend_bytes(c, rows: int) -> int:
    """Byte floor of adding ``rows`` context rows: fc and hidden_norm, each layer's k_proj, v_proj
    and k_norm, the target hidden states read, the K and V rows written; bf16."""
    h, kv_row, n_feat = c.hidden_size, c.num_key_value_heads * c.head_dim, len(c.target_layer_ids)
    weights = n_feat * h * h + h + c.num_hidden_layers * (2 * kv_row * h + c.head_dim)
    return 2 * (weights + rows * n_feat * h + c.num_hidden_layers * 2 * rows * kv_row)


def gqa_bytes(c, batch: int, ctx: int) -> int:
    """K/V bytes the attention must read (context and block, all kv heads) plus q read and out written."""
    kv_row, q_row = c.num_key_value_heads * c.head_dim, c.num_attention_heads * c.head_dim
    return 2 * (2 * batch * (ctx + c.block_size) * kv_row + 2 * batch * c.block_size * q_row)


def random_drafter(seed: int = 0, target=None):
    """DFlashModel with the K2.6 drafter dims on the GPU: weights N(0, 1/fan-in), norms 1. Its
    'target' (what the drafter borrows: the embedding, the lm_head behind head_logits, the shard
    and communicator) is ``target`` (a TargetModel: the drafter is then that rank's shard of heads
    and intermediate), or a one-rank stand-in with a random embedding and lm_head."""
    from types import SimpleNamespace

    from ml_dtypes import bfloat16

    from ..backend import Backend
    from ..model.dflash import DFlashLayer, DFlashModel
    from ..model.shard import Shard
    from ..parallel.comm import SingleRank

    c = k26_config()
    be = Backend("cuda") if target is None else target.backend
    counter = iter(range(seed * 1000, seed * 1000 + 1000))

    def w(n, k):
        return random_bf16_device((n, k), scale=k ** -0.5, seed=next(counter))

    def ones(n):
        return be.asarray(np.ones(n, dtype=bfloat16))

    h, d = c.hidden_size, c.head_dim
    if target is None:
        lm_head = w(c.vocab_size, h)
        target = SimpleNamespace(backend=be, embed=random_bf16_device((c.vocab_size, h), seed=next(counter)),
                                 lm_head=lm_head, shard=Shard(), comm=SingleRank(),
                                 head_logits=lambda rows: be.linear(rows, lm_head))
    n = target.shard.world
    qh, kvh, i = c.num_attention_heads // n, c.num_key_value_heads // n, c.intermediate_size // n
    layers = [DFlashLayer(ones(h), ones(h), w(qh * d, h), w(kvh * d, h), w(kvh * d, h), w(h, qh * d), ones(d), ones(d),
                          w(2 * i, h), w(h, i)) for _ in range(c.num_hidden_layers)]
    return DFlashModel(c, target, w(h, len(c.target_layer_ids) * h), ones(h), ones(h), layers)


class Context:
    """Paged context K/V of ``batch`` requests x ``ctx`` rows for ``layers`` drafter layers (all by
    default; random), pages scattered, and the block's tokens / positions."""

    def __init__(self, model, batch: int, ctx: int, seed: int, layers: int | None = None):
        c, be = model.cfg, model.backend
        layers = c.num_hidden_layers if layers is None else layers
        rng = np.random.default_rng(seed)
        per_req = -(-ctx // PAGE)
        pages, row = batch * per_req, model.kv_heads * c.head_dim  # this rank's kv heads
        self.k = be.empty((layers, pages, PAGE, row), "bf16")
        self.v = be.empty((layers, pages, PAGE, row), "bf16")
        for n in range(layers):  # a layer at a time keeps the fp32 temporaries small
            self.k[n] = random_bf16_device((pages, PAGE, row), seed=seed * 100 + 2 * n)
            self.v[n] = random_bf16_device((pages, PAGE, row), seed=seed * 100 + 2 * n + 1)
        self.page_table = be.asarray(rng.permutation(pages).astype(np.int32).reshape(batch, per_req))
        self.lens = be.asarray(np.full(batch, ctx, np.int32))
        self.starts = be.asarray(np.zeros(batch, np.int32))
        tokens = np.full((batch, c.block_size), c.mask_token_id, np.int32)
        tokens[:, 0] = rng.integers(0, c.vocab_size, batch)
        self.tokens = be.asarray(tokens.reshape(-1))
        self.positions = be.asarray(np.tile(np.arange(ctx, ctx + c.block_size), batch).astype(np.int32))

    def slots(self, positions: np.ndarray):
        """Host int64 cache slots of context ``positions`` [batch, n] (each row one request's)."""
        pt = self.page_table.get()
        pages = np.take_along_axis(pt, positions // PAGE, axis=1)
        return pages.astype(np.int64) * PAGE + positions % PAGE

    def forward(self, model):
        layers = range(model.cfg.num_hidden_layers)
        return model.block_forward(self.tokens, self.positions, [self.k[n] for n in layers],
                                   [self.v[n] for n in layers], self.page_table, self.lens, self.starts)


def bench_forward(model, batch: int, ctx: int, iters: int) -> list[Row]:
    from .round import capture

    c = model.cfg
    cx = Context(model, batch, ctx, seed=batch * 10 + ctx // 1024)
    t_eager = time_gpu(lambda: cx.forward(model), warmup=2, iters=iters).median_us
    graph, pool = capture(lambda: cx.forward(model))
    t_graph = time_gpu(graph.launch, warmup=2, iters=iters).median_us
    nbytes = forward_bytes(c, batch, ctx)
    floor = nbytes / read_ceiling_gbs() / 1e3
    del graph, pool
    return [Row(f"forward b{batch} ctx{ctx} (CUDA graph)", t_graph, bytes=nbytes,
                extra={"batch": batch, "ctx": ctx, "eager_us": t_eager, "floor_us": floor,
                       "over_floor": t_graph / floor})]


def bench_extend(model, batch: int, rows: int, iters: int) -> Row:
    from .round import capture

    c, be = model.cfg, model.backend
    n = batch * rows
    cx = Context(model, batch, rows, seed=7 + batch)
    hidden = {i: random_bf16_device((n, c.hidden_size), seed=50 + i) for i in c.target_layer_ids}
    positions = be.asarray(np.tile(np.arange(rows, dtype=np.int32), batch))
    slots = be.asarray(cx.slots(np.tile(np.arange(rows), (batch, 1))).astype(np.int32).reshape(-1))

    def extend():
        for layer, (k, v) in enumerate(model.context_kv(hidden, positions)):
            be.kv_cache_write(cx.k[layer], k, slots)
            be.kv_cache_write(cx.v[layer], v, slots)

    t_eager = time_gpu(extend, warmup=2, iters=iters).median_us
    graph, pool = capture(extend)
    t_graph = time_gpu(graph.launch, warmup=2, iters=iters).median_us
    nbytes = extend_bytes(c, n)
    floor = nbytes / read_ceiling_gbs() / 1e3
    del graph, pool
    return Row(f"extend b{batch} rows{rows} (CUDA graph)", t_graph, bytes=nbytes,
               extra={"batch": batch, "rows_per_request": rows, "eager_us": t_eager, "floor_us": floor,
                      "over_floor": t_graph / floor})


def bench_gqa(model, batch: int, ctx: int, iters: int) -> Row:
    c, be = model.cfg, model.backend
    cx = Context(model, batch, ctx, seed=3 + batch, layers=1)
    bs, hq, hkv, d = c.block_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = random_bf16_device((batch, bs, hq, d), seed=1)
    kb, vb = (random_bf16_device((batch, bs, hkv, d), seed=s) for s in (2, 3))
    k, v = (a[0].reshape(a.shape[1], PAGE, hkv, d) for a in (cx.k, cx.v))
    out = be.empty((batch, bs, hq, d), "bf16")

    def fn():
        be.gqa_attention(q, k, v, cx.page_table, cx.lens, kb, vb, model.scale, cx.starts, out=out)

    t = time_gpu(fn, warmup=3, iters=iters)
    nbytes = gqa_bytes(c, batch, ctx)
    return Row(f"gqa b{batch} ctx{ctx}", t.median_us, bytes=nbytes,
               extra={"batch": batch, "ctx": ctx, "min_us": t.min_us, "p90_us": t.p90_us,
                      "floor_us": nbytes / read_ceiling_gbs() / 1e3})


def parse_args(argv=None) -> argparse.Namespace:
    from .round import int_list

    ap = argparse.ArgumentParser(prog="ddtree-rtc bench drafter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="context rows of the forward rows")
    ap.add_argument("--gqa-contexts", default=",".join(map(str, GQA_CONTEXTS)), help="context rows of the gqa rows")
    ap.add_argument("--extend-rows", type=int, default=EXTEND_ROWS, help="context rows added per request per round")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        args.batches = int_list(args.batches, "--batches", 1, 4096)
        args.contexts = int_list(args.contexts, "--contexts", 1, 1 << 20)
        args.gqa_contexts = int_list(args.gqa_contexts, "--gqa-contexts", 1, 1 << 20)
    except ValueError as e:
        ap.error(str(e))
    if args.extend_rows < 1 or args.iters < 1:
        ap.error("--extend-rows and --iters must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import cupy

    model = random_drafter()
    rows = []
    for b in args.batches:
        for ctx in args.contexts:
            rows += bench_forward(model, b, ctx, args.iters)
            cupy.get_default_memory_pool().free_all_blocks()
            print(f"  forward b{b} ctx{ctx}: {rows[-1].us:.0f} µs", flush=True)
        rows.append(bench_extend(model, b, args.extend_rows, args.iters))
        for ctx in args.gqa_contexts:
            rows.append(bench_gqa(model, b, ctx, args.iters))
            cupy.get_default_memory_pool().free_all_blocks()
    c = model.cfg
    notes = {"model": f"DFlash drafter, K2.6 dims: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                      f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads of {c.head_dim}, intermediate "
                      f"{c.intermediate_size}, block {c.block_size}, vocab {c.vocab_size}; random weights",
             "page_size": PAGE,
             "floor": "forward: weights + lm_head + context K/V (all layers) + logits written; extend: fc + k/v "
                      "projections + hidden read + K/V written; gqa: K/V read + q read + out written; over the "
                      "read ceiling",
             "timing": "median, L2 flushed before each run; forward and extend replayed from a CUDA graph"}
    return report("DFlash drafter at K2.6 dims", rows, args.json, notes=notes)


if __name__ == "__main__":
    main()
