"""Round-time model of K2.6 AR decoding and one DDTree round at TP8 (see docs/hardware.md).

Every term is `floor_us + work / (peak * eff)`: floor and eff are fitted per kernel family from this
repository's measured H200 benchmarks (benchmarks/*_h200.json) and carried to other platforms as the
same fraction of their roofline; floors (launch/latency bound) are carried unchanged.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from ..model.config import preset_config
from ..reference.tree_build import MAX_BUDGET

HERE = Path(__file__).parent
# The repository's benchmarks/ seen from the package (a link in the checkout, package data in the wheel).
BENCH = Path(str(resources.files(__package__) / "benchmarks"))
PLATFORM_KEYS = ("name", "mem_tbs", "bf16_tflops", "fp8_tflops", "fp4_tflops", "mem_gb", "sms", "l2_mb",
                 "link_gbs", "all_reduce")
TP = 8
# DFlash drafter for K2.6 (z-lab): 6 layers, hidden 7168, 64 q / 8 kv heads of 128, intermediate 18432, bf16.
DRAFTER = dict(layers=6, hidden=7168, q_heads=64, kv_heads=8, head_dim=128, inter=18432, block=8, ctx_layers=6)


class ProjectionError(ValueError):
    pass


@dataclass(frozen=True)
class Platform:
    key: str
    name: str
    mem_tbs: float
    bf16_tflops: float
    fp8_tflops: float
    fp4_tflops: float
    mem_gb: float
    sms: int
    l2_mb: float
    link_gbs: float
    ar_alpha_us: float
    ar_beta_gbs: float


def load_platforms(path: str | Path = HERE / "platforms.yaml") -> dict[str, Platform]:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ProjectionError(f"{p}: cannot read platform file: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise ProjectionError(f"{p}: expected a mapping of platform key -> figures")
    out = {}
    for key, d in raw.items():
        if not isinstance(d, dict):
            raise ProjectionError(f"{p}: platform {key!r} is not a mapping")
        missing = [k for k in PLATFORM_KEYS if k not in d]
        unknown = [k for k in d if k not in PLATFORM_KEYS]
        if missing or unknown:
            raise ProjectionError(f"{p}: platform {key!r}: missing keys {missing}, unknown keys {unknown}")
        ar = d["all_reduce"]
        if not isinstance(ar, dict) or set(ar) != {"alpha_us", "beta_gbs"}:
            raise ProjectionError(f"{p}: platform {key!r}: all_reduce needs exactly alpha_us and beta_gbs")
        vals = {k: d[k] for k in PLATFORM_KEYS if k not in ("name", "all_reduce")}
        vals.update(ar_alpha_us=ar["alpha_us"], ar_beta_gbs=ar["beta_gbs"])
        for k, v in vals.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ProjectionError(f"{p}: platform {key!r}: {k} must be a positive number, got {v!r}")
        out[key] = Platform(key=key, name=str(d["name"]), **vals)
    return out


def pick(platforms: dict[str, Platform], keys) -> list[Platform]:
    bad = [k for k in keys if k not in platforms]
    if bad:
        raise ProjectionError(f"unknown platform {bad}; known: {', '.join(platforms)}")
    return [platforms[k] for k in keys]


@dataclass(frozen=True)
class Fit:
    """floor_us + bytes / (ceiling * eff), fitted from one benchmark family's rows."""
    floor_us: float
    eff: float
    source: str

    def us(self, nbytes: float, peak_tbs: float) -> float:
        return self.floor_us + nbytes / (peak_tbs * 1e12 * self.eff) * 1e6


def fit_rows(path: Path, match) -> Fit:
    d = json.loads(path.read_text())
    ceil = d["ceilings"]["read_gbs"] * 1e9
    rows = [r for r in d["rows"] if match(r["case"]) and r.get("bytes")]
    if not rows:
        raise ProjectionError(f"{path}: no benchmark rows match this term")
    # least squares us = floor + bytes * slope; eff = achieved streaming rate / measured read ceiling
    x = [r["bytes"] for r in rows]
    y = [r["us"] for r in rows]
    n, mx, my = len(x), sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx > 0 else my / mx
    if slope <= 0:
        slope = my / mx
    floor = max(0.0, my - slope * mx)
    return Fit(floor, min(1.0, 1e6 / (slope * ceil)), f"{path.name}: {n} rows")


def measured_fits(bench: Path = BENCH) -> dict[str, Fit]:
    moe = bench / "moe_h200.json"
    dec = bench / "decode_h200.json"
    fits = {
        "moe": fit_rows(moe, lambda c: c.startswith("TP8 shard")),
        "moe_full": fit_rows(moe, lambda c: c.startswith("K2.6 M=")),
        "attention": fit_rows(dec, lambda c: c.endswith(" attention") and " L1 " in c),
        "dense": fit_rows(dec, lambda c: c.endswith(" dense")),
        "head": fit_rows(dec, lambda c: c.endswith(" head")),
        "topk": fit_rows(bench / "tree_h200.json", lambda c: c.startswith("topk ")),
    }
    tree = json.loads((bench / "tree_h200.json").read_text())
    build = {}
    for r in tree["rows"]:
        c = r["case"]
        if c.startswith("build+accept b=") and "[graph" in c:
            b, n = c.split()[1:3]
            build[(int(b[2:]), int(n[7:]))] = r["us"]
        if c.startswith("floor b=1 budget=16"):
            fits["launch_us"] = r["us"] / 2  # two launches per graph replay in this row
    fits["build"] = build
    return fits


def experts_touched(tokens: int, n_experts: int = 384, k: int = 8, skew: float = 0.0) -> float:
    """Expected distinct experts hit per layer by `tokens` tokens of k picks each.

    skew = 0: uniform, each expert is picked by a token with probability k/n. skew > 0: Zipf(skew)
    popularity, an expert's per-token inclusion probability min(1, k * w_e) (independent tokens)."""
    if tokens <= 0:
        return 0.0
    if skew == 0.0:
        return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)
    w = [1.0 / (i + 1) ** skew for i in range(n_experts)]
    s = sum(w)
    return sum(1.0 - (1.0 - min(1.0, k * x / s)) ** tokens for x in w)


def tau_curve(budget: int, tau_max: float = 6.0, scale: float = 48.0) -> float:
    """Configured τ(budget) (tokens per round incl. bonus): 1 at budget 0, saturating at tau_max."""
    return 1.0 + (tau_max - 1.0) * (1.0 - math.exp(-budget / scale))


def check_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_BUDGET:
        raise ProjectionError(f"budget={budget!r} is outside the tree builder's range 0..{MAX_BUDGET}")
    return budget


class RoundModel:
    def __init__(self, fits: dict | None = None, skew: float = 0.0):
        self.cfg = preset_config("k2.6")
        self.fits = fits or measured_fits()
        self.skew = skew

    # -- byte counts (per GPU at TP8) -------------------------------------------------------------
    def expert_bytes(self) -> float:
        c = self.cfg
        params = 3 * c.moe_intermediate_size * c.hidden_size
        return params * (0.5 + 2 / 32)  # int4 + one bf16 scale per 32

    def attention_weight_bytes(self) -> float:
        c = self.cfg
        h, nh = c.hidden_size, c.num_attention_heads
        repl = h * c.q_lora_rank + h * (c.kv_lora_rank + c.qk_rope_head_dim) + h * c.n_routed_experts
        split = (c.q_lora_rank * nh * (c.qk_nope_head_dim + c.qk_rope_head_dim)
                 + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)
                 + nh * c.v_head_dim * h + 3 * h * c.moe_intermediate_size * c.n_shared_experts)
        return 2 * (repl + split / TP)

    def kv_bytes(self, context: int) -> float:
        return context * (self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim) * 2

    # -- the round --------------------------------------------------------------------------------
    def terms(self, pf: Platform, batch: int, context: int, nodes: int, drafter: bool,
              budget: int = 0) -> dict[str, float]:
        """µs per term for one forward of `nodes` tokens per request (1 = AR step)."""
        c, f = self.cfg, self.fits
        bw = pf.mem_tbs
        m = batch * nodes
        moe_layers = c.num_hidden_layers - 1
        t = {}
        t["routed experts"] = moe_layers * f["moe"].us(
            experts_touched(m, c.n_routed_experts, c.num_experts_per_tok, self.skew) * self.expert_bytes() / TP, bw)
        t["attention + dense proj"] = c.num_hidden_layers * f["attention"].us(self.attention_weight_bytes(), bw) \
            + f["dense"].us(2 * 3 * c.hidden_size * c.intermediate_size / TP, bw)
        t["MLA over context"] = c.num_hidden_layers * max(
            batch * self.kv_bytes(context) / (bw * 1e12 * f["attention"].eff) * 1e6,
            m * context * (c.num_attention_heads / TP) * 2 * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
            / (pf.bf16_tflops * 1e12 * 0.45) * 1e6)
        t["lm_head"] = f["head"].us(2 * c.vocab_size * c.hidden_size / TP + m * c.vocab_size * 2, bw)
        ar_bytes = m * c.hidden_size * 2
        one_ar = pf.ar_alpha_us + ar_bytes * 2 * (TP - 1) / TP / (pf.ar_beta_gbs * 1e3)
        t["all-reduce"] = (2 * c.num_hidden_layers + 1) * one_ar
        t["topk + tree + accept"] = 0.0
        t["drafter"] = 0.0
        if drafter:
            L = DRAFTER["block"] - 1
            t["topk + tree + accept"] = f["topk"].us(batch * L * c.vocab_size * 4, bw) + self._build_us(batch, budget)
            t["drafter"] = self.drafter_us(pf, batch, one_ar)
        kernels = 61 * 6 + 4 + (DRAFTER["layers"] * 6 + 6 if drafter else 0)
        t["launch / graph"] = kernels * f["launch_us"]
        return t

    def _build_us(self, batch: int, budget: int) -> float:
        build = self.fits["build"]
        bs = sorted({b for b, _ in build})
        b = min(bs, key=lambda x: abs(x - batch))
        ns = sorted(n for bb, n in build if bb == b)
        n = min([x for x in ns if x >= budget] or [ns[-1]])
        return build[(b, n)] * (budget / n if budget > n else 1.0)

    def drafter_us(self, pf: Platform, batch: int, one_ar: float) -> float:
        d, f = DRAFTER, self.fits
        h, q, kv = d["hidden"], d["q_heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * d["inter"]) / TP
        fc = 2 * h * d["ctx_layers"] * h / TP
        head = 2 * self.cfg.vocab_size * h / TP + batch * (d["block"] - 1) * self.cfg.vocab_size * 2
        return (d["layers"] * f["dense"].us(layer, pf.mem_tbs) + f["dense"].us(fc, pf.mem_tbs)
                + f["head"].us(head, pf.mem_tbs) + (2 * d["layers"] + 1) * one_ar)

    def ar_step(self, pf, batch=1, context=4096):
        return self.terms(pf, batch, context, 1, drafter=False)

    def ddtree_round(self, pf, batch=1, context=4096, budget=64):
        check_budget(budget)
        return self.terms(pf, batch, context, 1 + budget, drafter=True, budget=budget)

    def best_budget(self, pf, batch=1, context=4096, tau=None, budgets=(4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)):
        best = None
        for n in budgets:
            us = sum(self.ddtree_round(pf, batch, context, n).values())
            tps = (tau if tau is not None else tau_curve(n)) / us * 1e6
            if best is None or tps > best[1]:
                best = (n, tps)
        return best


def project(platform_keys=None, budget=None, tau=None, context=4096, platforms_path=None) -> dict:
    pfs = load_platforms(platforms_path) if platforms_path else load_platforms()
    chosen = pick(pfs, platform_keys or list(pfs))
    m = RoundModel()
    out = {}
    for pf in chosen:
        rec = {"name": pf.name}
        for conc in (1, 10):
            n = check_budget(budget) if budget is not None else m.best_budget(pf, conc, context, tau)[0]
            ar = m.ar_step(pf, conc, context)
            dd = m.ddtree_round(pf, conc, context, n)
            t = tau if tau is not None else tau_curve(n)
            rec[f"c{conc}"] = {
                "budget": n, "tau": t, "ar_terms_us": ar, "ddtree_terms_us": dd,
                "ar_tok_s": 1e6 / sum(ar.values()), "ddtree_tok_s": t * 1e6 / sum(dd.values()),
                "dominant": max(dd, key=dd.get)}
        out[pf.key] = rec
    return out


def calibration(tau=None) -> list[dict]:
    """The model's predictions beside the published figures it can be checked against."""
    pfs = load_platforms()
    m = RoundModel()
    pro, h200 = pfs["rtx_pro_6000"], pfs["h200"]

    def gemm_gbs(n_exp):
        b = n_exp * m.expert_bytes()
        return b / (m.fits["moe_full"].us(b, pro.mem_tbs) * 1e-6) / 1e9

    def dd(pf, conc):
        n, tps = m.best_budget(pf, conc, 4096, tau)
        return tps * conc

    rows = [
        ("PRO 6000 INT4 MoE GEMM M=1 (GB/s)", gemm_gbs(8), 1312.0),
        ("PRO 6000 INT4 MoE GEMM M>=256 plateau (GB/s)", gemm_gbs(384), 1211.0),
        ("PRO 6000 SGLang DDTree tok/s, concurrency 1", dd(pro, 1), 138.7),
        ("PRO 6000 SGLang DDTree tok/s total, concurrency 10", dd(pro, 10), 517.0),
        ("PRO 6000 vLLM K2.6 AR tok/s", 1e6 / sum(m.ar_step(pro).values()), 88.5),
        ("H200 SGLang TP8 K2.5 AR tok/s, concurrency 1", 1e6 / sum(m.ar_step(h200).values()), 106.0),
    ]
    return [{"figure": f, "predicted": p, "published": q, "ratio": p / q} for f, p, q in rows]
