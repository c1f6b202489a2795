"""Building-block kernels at K2.6 dims: RMSNorm, RoPE, embedding, SiLU*mul, argmax, sampling and the
cuBLAS linear, each against the read ceiling measured in the same run (linear at large M also
against the matmul ceiling). Bytes are the minimal bytes moved: every input read once, every output
written once. Peer: the same op as plain CuPy array expressions (fp32 math on upcast bf16); for the
linear, cupy.matmul in fp32 on upcast data."""

from __future__ import annotations

import argparse

from .harness import Row, bf16_to_f32, random_bf16_device, report, time_gpu

HIDDEN, VOCAB, HEADS = 7168, 163840, 64


def _bf16(x):
    """fp32 -> bf16 bits, round to nearest even."""
    import cupy

    b = cupy.ascontiguousarray(x, dtype=cupy.float32).view(cupy.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(cupy.uint16)


class _Bench:
    def __init__(self, iters: int):
        self.iters = iters
        self.rows: list[Row] = []

    def add(self, case, fn, nbytes, peer=None, peer_name="cupy", flops=None, ceiling="read"):
        t = time_gpu(fn, iters=self.iters)
        peer_us = time_gpu(peer, iters=self.iters).median_us if peer is not None else None
        self.rows.append(Row(case, t.median_us, bytes=int(nbytes), flops=flops, ceiling=ceiling,
                             peer=peer_name if peer is not None else None, peer_us=peer_us,
                             extra={"min_us": t.min_us, "p90_us": t.p90_us}))


def _rmsnorm(b: _Bench, ns):
    import cupy

    from ..kernels.rmsnorm import rmsnorm

    eps = 1e-5
    shapes = [((n, HIDDEN), f"rmsnorm [{n}, {HIDDEN}]") for n in ns]
    shapes += [((HEADS * n, 128), f"rmsnorm heads [{HEADS}*{n}, 128]") for n in ns]
    for shape, case in shapes:
        x, w = random_bf16_device(shape, seed=1), random_bf16_device(shape[-1:], seed=2)
        y = cupy.empty_like(x)

        def peer(x=x, w=w):
            h = bf16_to_f32(x)
            return _bf16(h / cupy.sqrt((h * h).mean(axis=-1, keepdims=True) + eps) * bf16_to_f32(w))

        b.add(case, lambda x=x, w=w, y=y: rmsnorm(x, w, eps, out=y), 2 * x.nbytes + w.nbytes, peer)


def _rope(b: _Bench, ns):
    import cupy

    from ..kernels.rope import rope
    from ..reference.rope import rope_inv_freq

    yarn = {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1}
    for n in ns:
        for head_dim, layout, what in ((64, "interleaved", "q_pe"), (128, "half", "drafter q")):
            x = random_bf16_device((n, HEADS, head_dim), seed=3)
            pos = cupy.arange(4096, 4096 + n, dtype=cupy.int32)
            inv = cupy.asarray(rope_inv_freq(head_dim, 50000.0, yarn if layout == "interleaved" else None))
            half = head_dim // 2

            def peer(x=x, pos=pos, inv=inv, half=half, layout=layout):
                ang = pos[:, None].astype(cupy.float32) * inv[None, :]
                c, s = cupy.cos(ang)[:, None, :], cupy.sin(ang)[:, None, :]
                h = bf16_to_f32(x)
                a, bb = (h[..., 0::2], h[..., 1::2]) if layout == "interleaved" else (h[..., :half], h[..., half:])
                ra, rb = a * c - bb * s, a * s + bb * c
                out = cupy.empty_like(h)
                if layout == "interleaved":
                    out[..., 0::2], out[..., 1::2] = ra, rb
                else:
                    out[..., :half], out[..., half:] = ra, rb
                x[...] = _bf16(out)

            b.add(f"rope {what} [{n}, {HEADS}, {head_dim}] {layout}",
                  lambda x=x, pos=pos, inv=inv, hd=head_dim, lay=layout: rope(x, pos, inv, 0, hd, lay),
                  2 * x.nbytes + pos.nbytes + inv.nbytes, peer)


def _embedding(b: _Bench, ns):
    import cupy

    from ..kernels.embedding import embedding

    table = random_bf16_device((VOCAB, HIDDEN), seed=4)
    for n in ns:
        ids = cupy.random.default_rng(5).integers(0, VOCAB, n, dtype=cupy.int32)
        y, y_peer = cupy.empty((n, HIDDEN), cupy.uint16), cupy.empty((n, HIDDEN), cupy.uint16)
        b.add(f"embedding {n} ids of [{VOCAB}, {HIDDEN}]", lambda ids=ids, y=y: embedding(ids, table, out=y),
              2 * n * HIDDEN * 2 + ids.nbytes,
              lambda ids=ids, y_peer=y_peer: cupy.take(table, ids, axis=0, out=y_peer))


def _silu_mul(b: _Bench, ns):
    import cupy

    from ..kernels.silu_mul import silu_mul

    for inter in (2048, 18432):
        for n in ns:
            x = random_bf16_device((n, 2 * inter), seed=6)

            def peer(x=x, inter=inter):
                g, u = bf16_to_f32(x[:, :inter]), bf16_to_f32(x[:, inter:])
                return _bf16(g / (1 + cupy.exp(-g)) * u)

            b.add(f"silu_mul [{n}, 2*{inter}]", lambda x=x: silu_mul(x), x.nbytes * 3 // 2, peer)


def _sampling(b: _Bench, batches):
    import cupy

    from ..kernels.sampling import argmax, sample

    def peer_sample(l, temp, top_p):
        z = bf16_to_f32(l) if l.dtype == cupy.uint16 else l
        z = z / temp
        p = cupy.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        sp = cupy.sort(p, axis=1)[:, ::-1]
        k = cupy.minimum((cupy.cumsum(sp, axis=1) < top_p).sum(axis=1, keepdims=True), z.shape[1] - 1)
        cut = cupy.take_along_axis(sp, k, axis=1)
        g = -cupy.log(-cupy.log(cupy.random.random(z.shape, dtype=cupy.float32)))
        return cupy.argmax(cupy.where(p >= cut, z + g, -cupy.inf), axis=1)

    for rows in batches:
        for dtype in ("bf16", "fp32"):
            if dtype == "fp32" and rows != batches[-1]:
                continue
            l = random_bf16_device((rows, VOCAB), scale=3.0, seed=7)
            if dtype == "fp32":
                l = bf16_to_f32(l)
            out = cupy.empty(rows, cupy.int32)
            f32 = bf16_to_f32(l) if dtype == "bf16" else l
            b.add(f"argmax {dtype} [{rows}, {VOCAB}]", lambda l=l, out=out: argmax(l, out=out), l.nbytes,
                  lambda f32=f32: cupy.argmax(f32, axis=1))
            for top_p in (0.9, 1.0):
                b.add(f"sample T=1 top_p={top_p} {dtype} [{rows}, {VOCAB}]",
                      lambda l=l, out=out, p=top_p: sample(l, 1.0, p, 1234, 0, out=out), l.nbytes,
                      lambda l=l, p=top_p: peer_sample(l, 1.0, p))


def _linear(b: _Bench, ms):
    import cupy

    from ..kernels.linear import linear

    w = random_bf16_device((HIDDEN, HIDDEN), seed=8)
    wf = bf16_to_f32(w)
    for m in ms:
        x = random_bf16_device((m, HIDDEN), seed=9)
        y = cupy.empty((m, HIDDEN), cupy.uint16)
        xf = bf16_to_f32(x)
        nbytes = w.nbytes + x.nbytes + y.nbytes
        flops = 2 * m * HIDDEN * HIDDEN
        peer = lambda xf=xf: cupy.matmul(xf, wf.T)  # noqa: E731
        b.add(f"linear M={m} [{HIDDEN}x{HIDDEN}]", lambda x=x, y=y: linear(x, w, out=y), nbytes, peer,
              peer_name="cupy fp32 matmul", flops=flops, ceiling="matmul" if m >= 1024 else "read")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="ddtree-rtc bench blocks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and iterations (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    ns = (1, 32) if args.quick else (1, 32, 1024)
    b = _Bench(iters=10 if args.quick else 50)
    _rmsnorm(b, ns)
    _rope(b, ns)
    _embedding(b, ns)
    _silu_mul(b, ns)
    _sampling(b, (1, 8) if args.quick else (1, 8, 32))
    _linear(b, (1, 64) if args.quick else (1, 8, 64, 1024))
    return report("building blocks at K2.6 dims", b.rows, args.json)


if __name__ == "__main__":
    main()
