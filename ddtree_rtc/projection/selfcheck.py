"""The model applied to the measured slice (K2.6 dims: dense layer 0 + 2 MoE layers, 64 heads, the
unsharded 163840-row head, one GPU): every AR step of decode_*.json / round_*.json and every DDTree round
of round_*.json, predicted from the component tables, beside its measured time."""
from __future__ import annotations

from dataclasses import replace

from .data import benchmark_dir, load_benchmark
from .model import Options, forward, k26_dims, measured_device, measured_union, tree_step_us
from .platforms import load_platforms, platform_of

TOLERANCE = 0.15


def slice_dims(layers: int = 3):
    return replace(k26_dims(), name=f"K2.6 slice ({layers} layers)", layers=layers, dense_layers=1)


def selfcheck() -> list[dict]:
    pfs = load_platforms()
    dims, opt = slice_dims(), Options(tp=1)
    out = []
    files = sorted(p.name for p in benchmark_dir().glob("decode_*.json")) + \
        sorted(p.name for p in benchmark_dir().glob("round_*.json"))
    for name in files:
        d = load_benchmark(name)
        pf = platform_of(d.get("device", ""), pfs)
        if pf is None or "quick" in name or (d.get("notes") or {}).get("shard", "none") != "none":
            continue  # (a rank's share, bench decode --shard: not the whole slice this models)
        dev = measured_device(f"{d['device']} ({name})", d["ceilings"]["read_gbs"], pf, pfs["h200"])
        union = measured_union()
        for r in d["rows"]:
            ex, case = r.get("extra") or {}, r["case"]
            b, ctx = ex.get("batch"), ex.get("ctx")
            if case.endswith("step (CUDA graph)"):
                pred = forward(dims, pf, dev, b, 1, ctx, opt, union.get((b, 0)))
                kind = "AR step"
            elif case.endswith("round (CUDA graph)"):
                v = list(ex["experts_touched"].values())
                pred = forward(dims, pf, dev, b, 1 + ex["budget"], ctx, opt, sum(v) / len(v))
                pred["tree step"] = tree_step_us(b, ex["budget"], dev)
                kind = f"DDTree round, budget {ex['budget']}"
            else:
                continue
            p = sum(pred.values())
            out.append({"file": name, "case": case, "kind": kind, "measured_us": r["us"], "predicted_us": p,
                        "ratio": p / r["us"], "within": abs(p / r["us"] - 1) <= TOLERANCE})
    return out


def _run_rows(name, d):
    """(label, batch, ctx, budget or 0, measured ms per step or round end to end, count) of a run file's
    runs: AR steps at their batch, DDTree rounds of one request at a time (batched DDTree runs skipped)."""
    runs = d["runs"] if "runs" in d else {"run": {"decode": d["decode"], "metrics": d["metrics"]}}
    out = []
    for key, run in runs.items():
        m, dec = run["metrics"], run["decode"]
        req, gen, prompt = m["requests"], m["generated_tokens"], m["prompt_tokens"]
        host_and_gpu_s = sum(v for k, v in m["stage_s"].items() if k != "prefill")
        if dec["mode"] == "autoregressive":
            steps = (m.get("cuda_graphs") or {}).get("replays") or m["steps"]
            batch, budget = round(gen / m["steps"]), 0
        elif m["steps"] >= m["decode_rounds"]:
            steps, batch, budget = m["decode_rounds"], 1, dec["budget"]
        else:
            continue
        out.append((f"{name} {key}", batch, prompt // req + gen // req // 2, budget, 1e3 * host_and_gpu_s / steps,
                    steps))
    return out


def end_to_end() -> list[dict]:
    """The engine's measured end-to-end step / round (host work included: scheduling, drafting, planning,
    the host sync) beside the modelled GPU time of the same forward: their difference is the host share
    the GPU-time projection leaves out. Read from k2_6_slice_*.json; not asserted (host-dependent)."""
    pfs = load_platforms()
    out = []
    for p in sorted(benchmark_dir().glob("k2_6_slice_*.json")):
        d = load_benchmark(p.name)
        pf = platform_of(d.get("device", ""), pfs)
        if pf is None:
            continue
        ref_read = {"h200": "decode_h200.json", "h100": "round_h100.json"}.get(pf.key)
        if ref_read is None:
            continue
        read = load_benchmark(ref_read)["ceilings"]["read_gbs"]  # the same GPU kind's measured read ceiling
        dev = measured_device(d["device"], read, pf, pfs["h200"])
        layers = (d.get("model") or {}).get("layers") or 3
        if "layers=2" in d.get("title", ""):
            layers = 2
        dims = slice_dims(layers)
        for label, batch, ctx, budget, ms, steps in _run_rows(p.name, d):
            t = forward(dims, pf, dev, batch, 1 + budget, ctx, Options(tp=1))
            if budget:
                t["tree step"] = tree_step_us(batch, budget, dev)
            gpu = sum(t.values()) / 1e3
            out.append({"run": label, "batch": batch, "budget": budget, "layers": layers, "steps": steps,
                        "measured_ms": ms, "model_gpu_ms": gpu, "host_ms": ms - gpu})
    return out
