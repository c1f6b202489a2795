"""Platform facts (platforms.yaml): every number with its source."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .data import ProjectionError

HERE = Path(__file__).parent
RATES = ("mem_tbs", "bf16_tflops", "fp8_tflops", "int8_tops", "fp4_tflops", "mem_gb")
COLLECTIVES = ("nccl", "nccl_graph", "oneshot", "nvls")
ANSWER_PLATFORMS = ("rtx_pro_6000", "h200", "b200", "b300")


@dataclass(frozen=True)
class Collective:
    alpha_us: float
    beta_gbs: float
    source: str
    unsure: bool

    def us(self, nbytes: float, ranks: int = 8) -> float:
        return self.alpha_us + 2 * (ranks - 1) / ranks * nbytes / (self.beta_gbs * 1e3)


@dataclass(frozen=True)
class Platform:
    key: str
    name: str
    mem_tbs: float
    bf16_tflops: float
    fp8_tflops: float
    int8_tops: float
    fp4_tflops: float
    mem_gb: float
    collectives: dict = field(hash=False)
    sources: dict = field(hash=False)
    unsure: tuple = ()

    def rate(self, precision: str) -> float:
        """Dense tensor rate (TFLOP/s) for the MMA precision a kernel uses; 0 if the platform has none."""
        return {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "int8": self.int8_tops,
                "fp4": self.fp4_tflops}[precision]


def _number(p, key, name, d):
    if not isinstance(d, dict) or "value" not in d or "source" not in d or set(d) - {"value", "source", "unsure"}:
        raise ProjectionError(f"{p}: platform {key!r}: {name} must be {{value, source[, unsure]}}, got {d!r}")
    v = d["value"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ProjectionError(f"{p}: platform {key!r}: {name} must be a number >= 0, got {v!r}")
    if not str(d["source"]).strip():
        raise ProjectionError(f"{p}: platform {key!r}: {name} has an empty source")
    return float(v), str(d["source"]), bool(d.get("unsure", False))


def load_platforms(path: str | Path | None = None) -> dict[str, Platform]:
    p = Path(path) if path else HERE / "platforms.yaml"
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
        want = {"name", "collectives", *RATES}
        missing, unknown = sorted(want - set(d)), sorted(set(d) - want)
        if missing or unknown:
            raise ProjectionError(f"{p}: platform {key!r}: missing keys {missing}, unknown keys {unknown}")
        vals, sources, unsure = {}, {}, []
        for name in RATES:
            vals[name], sources[name], u = _number(p, key, name, d[name])
            if u:
                unsure.append(name)
        if vals["mem_tbs"] <= 0 or vals["bf16_tflops"] <= 0:
            raise ProjectionError(f"{p}: platform {key!r}: mem_tbs and bf16_tflops must be > 0")
        cols = {}
        if not isinstance(d["collectives"], dict) or not {"nccl", "nccl_graph", "oneshot"} <= set(d["collectives"]):
            raise ProjectionError(f"{p}: platform {key!r}: collectives needs nccl, nccl_graph and oneshot")
        for ck, cd in d["collectives"].items():
            if ck not in COLLECTIVES:
                raise ProjectionError(f"{p}: platform {key!r}: unknown collective {ck!r} (known: {COLLECTIVES})")
            if not isinstance(cd, dict) or not {"alpha_us", "beta_gbs", "source"} <= set(cd):
                raise ProjectionError(f"{p}: platform {key!r}: collective {ck!r} needs alpha_us, beta_gbs, source")
            a, b = cd["alpha_us"], cd["beta_gbs"]
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 for x in (a, b)):
                raise ProjectionError(f"{p}: platform {key!r}: collective {ck!r}: alpha_us and beta_gbs must be > 0")
            cols[ck] = Collective(float(a), float(b), str(cd["source"]), bool(cd.get("unsure", False)))
            if cols[ck].unsure:
                unsure.append(f"collectives.{ck}")
        out[key] = Platform(key=key, name=str(d["name"]), collectives=cols, sources=sources,
                            unsure=tuple(unsure), **vals)
    return out


def pick(platforms: dict[str, Platform], keys) -> list[Platform]:
    bad = [k for k in keys if k not in platforms]
    if bad:
        raise ProjectionError(f"unknown platform {bad}; known: {', '.join(platforms)}")
    return [platforms[k] for k in keys]


def platform_of(device: str, platforms: dict[str, Platform]) -> Platform | None:
    """The platform whose GPU a benchmark file's ``device`` names ("NVIDIA H100 80GB HBM3" -> h100): its
    key, letters and digits only, inside the name's; where several are, the one named first ("NVIDIA H100
    ... (lent for kind nvidia-h200)" is an H100). None for anything else (a CPU, the numpy backend)."""
    name = re.sub(r"[^a-z0-9]", "", device.lower())
    at = {key: name.find(re.sub(r"[^a-z0-9]", "", key.lower())) for key in platforms}
    hits = [k for k, i in at.items() if i >= 0]
    return platforms[min(hits, key=at.get)] if hits else None
