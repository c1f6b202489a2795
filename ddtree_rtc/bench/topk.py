"""Vocabulary top-k on drafter-shaped logits: batch {1, 8, 32, 64} x k {16, 64, 256, 512}, depth 7,
V = 163840, bf16 Zipf logits (``bench.tree.zipf_logits``), plus one fp32 case. Bytes = the logits,
against the read ceiling. By default the kernel ``topk_workspace`` picks; ``--variants`` runs the
stream and radix kernels side by side on the same logits (stream takes k <= 256 only) and checks
that every variant's ids and log-probs equal the radix kernel's (``ids_equal`` and
``max_logq_diff`` in each row's extra)."""

from __future__ import annotations

import argparse

import numpy as np

from .harness import Row, report, time_gpu
from .tree import DEPTH, VOCAB, zipf_logits

BATCHES = (1, 8, 32, 64)
KS = (16, 64, 256, 512)
FP32_CASE = (32, 64)  # (batch, k)


def run_case(logits, k: int, dtype: str, variants, iters: int) -> list[Row]:
    """One row per variant (None: the default choice; "radix:N": radix with chunks of N 16-byte
    vectors), timed on the same logits; with several variants, each checked against the radix
    kernel's output."""
    import cupy

    from ..kernels import topk

    lead = logits.shape[:-1]
    batch = lead[0]
    rows, results = [], {}
    for spec in variants:
        variant, _, vectors = (spec or "").partition(":")
        variant = variant or None
        if variant == "stream" and k > topk.STREAM_MAX_K:
            continue
        ws = topk.topk_workspace(logits.shape, k, variant=variant, vectors=int(vectors) if vectors else None)
        label = ws.variant + (f" v={ws.vectors}" if ws.variant == "radix" else "")
        logq = cupy.empty((*lead, k), dtype=cupy.float32)
        ids = cupy.empty((*lead, k), dtype=cupy.int32)

        def fn(ws=ws, logq=logq, ids=ids):
            topk.topk_logprobs(logits, k, out_logq=logq, out_ids=ids, workspace=ws)

        t = time_gpu(fn, iters=iters)
        results[label] = (logq.get(), ids.get())
        rows.append(Row(f"topk b={batch} k={k} {dtype} [{label}]", t.median_us, bytes=logits.nbytes,
                        extra={"batch": batch, "k": k, "dtype": dtype, "depth": DEPTH, "vocab": VOCAB,
                               "variant": label, "min_us": t.min_us, "p90_us": t.p90_us}))
    if "radix" in results and len(results) > 1:
        lq_ref, id_ref = results["radix"]
        for r in rows:
            lq, got = results[r.extra["variant"]]
            r.extra["ids_equal"] = bool(np.array_equal(got, id_ref))
            r.extra["max_logq_diff"] = float(np.abs(lq - lq_ref).max())
    return rows


def main(argv=None) -> dict:
    import cupy

    from ..kernels import topk

    ap = argparse.ArgumentParser(prog="ddtree-rtc bench topk", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", action="store_true", help="both top-k kernels side by side, checked against radix")
    ap.add_argument("--radix-vectors", metavar="N,N", default="",
                    help="with --variants: extra radix rows with chunks of N 16-byte vectors (multiples of 256)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    variants = topk.VARIANTS if args.variants else (None,)
    if args.radix_vectors:
        if not args.variants:
            ap.error("--radix-vectors goes with --variants")
        variants += tuple(f"radix:{int(n)}" for n in args.radix_vectors.split(","))
    rows, logits_by_batch = [], {}
    for batch, k, dtype in [(b, k, "bf16") for b in BATCHES for k in KS] + [(*FP32_CASE, "fp32")]:
        if batch not in logits_by_batch:
            logits_by_batch[batch] = zipf_logits(batch, DEPTH, VOCAB, seed=batch)
        logits = logits_by_batch[batch]
        if dtype == "fp32":
            logits = (logits.astype(cupy.uint32) << 16).view(cupy.float32)
        new = run_case(logits, k, dtype, variants, args.iters)
        print(f"  b={batch} k={k} {dtype}: " + ", ".join(f"{r.extra['variant']} {r.us:.1f} µs" for r in new),
              flush=True)
        rows += new
    notes = {"logits": "bf16 Zipf (bench tree's), ranks shuffled per row; fp32 = the same values widened",
             "bytes": "the logits, read once"}
    return report("vocabulary top-k" + (" (every variant)" if args.variants else ""), rows, args.json, notes=notes)
