"""The model applied to the measured slice (K2.6 dims: dense layer 0 + 2 MoE layers, 64 heads, the
unsharded 163840-row head, one GPU): every AR step of decode_*.json / round_*.json and every DDTree round
of round_*.json, predicted from the component tables, beside its measured time."""
from __future__ import annotations

from dataclasses import replace

from .data import benchmark_dir, load_benchmark
from .model import Options, forward, k26_dims, measured_device, measured_union, tree_step_us
from .platforms import load_platforms

TOLERANCE = 0.15


def slice_dims(layers: int = 3):
    return replace(k26_dims(), name=f"K2.6 slice ({layers} layers)", layers=layers, dense_layers=1)


def _device_platform(device: str, platforms):
    d = device.lower()
    for key in ("h200", "h100", "b300", "b200"):
        if key in d:
            return platforms[key]
    return None


def selfcheck() -> list[dict]:
    pfs = load_platforms()
    dims, opt = slice_dims(), Options(tp=1)
    out = []
    files = sorted(p.name for p in benchmark_dir().glob("decode_*.json")) + \
        sorted(p.name for p in benchmark_dir().glob("round_*.json"))
    for name in files:
        d = load_benchmark(name)
        pf = _device_platform(d.get("device", ""), pfs)
        if pf is None or "quick" in name:
            continue
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
