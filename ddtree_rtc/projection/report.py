"""Text table and optional plot for `ddtree-rtc projection`."""
from __future__ import annotations


def table(result: dict, calib: list[dict]) -> str:
    lines = []
    for key, rec in result.items():
        lines.append(f"== {rec['name']} ({key})")
        for c in ("c1", "c10"):
            r = rec[c]
            lines.append(f"  concurrency {c[1:]}: AR {r['ar_tok_s']:.1f} tok/s/user | DDTree {r['ddtree_tok_s']:.1f} "
                         f"tok/s/user (budget {r['budget']}, tau {r['tau']:.2f}) | dominant: {r['dominant']}")
            tot = sum(r["ddtree_terms_us"].values())
            lines.append("    round split (us): " + ", ".join(
                f"{k} {v:.0f} ({100 * v / tot:.0f}%)" for k, v in r["ddtree_terms_us"].items()))
    lines.append("== calibration (predicted / published)")
    for r in calib:
        lines.append(f"  {r['figure']}: {r['predicted']:.1f} / {r['published']:.1f} = {r['ratio']:.2f}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'ddtree-rtc[plot]'") from None
    bars, labels = [], []
    for key, rec in result.items():
        r = rec["c1"]
        bars += [r["ar_terms_us"], r["ddtree_terms_us"]]
        labels += [f"{key}\nAR", f"{key}\nDDTree b{r['budget']}"]
    terms = list(bars[0])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(bars)), 5))
    bottom = [0.0] * len(bars)
    for t in terms:
        vals = [b[t] / 1e3 for b in bars]
        ax.bar(labels, vals, bottom=bottom, label=t)
        bottom = [x + v for x, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step / round (concurrency 1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
