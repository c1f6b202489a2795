"""Issue 45's GPU check of lossless decoding on the K2.6 slice (pipelines/k2_6_slice_ddtree_h200.yaml,
weights made on the device with ``model.load=dummy``), in one device call of a few minutes:

1. with the **random** head (choices near bf16 ties, where a verify row that differs from its AR twin by
   one bit shows), 10 requests x 128 tokens: AR at concurrency 1 and 10, chain, and DDTree at budgets 8
   and 32, each at concurrency 1 and 10. Every run's ids must equal AR's at concurrency 1;
2. with the pipeline's **decisive** head at acceptance p 0.77, budget 32, concurrency 10: the oracle's
   measured tau against ``OracleDrafter.expected_tau`` (the steady-state value; the last round of each
   request is cut by the end of its output, so measured sits a little below it).

    python tools/k2_6_lossless.py --out $OUT [--runs ar1,ar10,chain1,...] [--tokens 128]

Writes ``$OUT/k2_6_lossless.json`` and prints a table last; exits 1 when any ids differ.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PIPE = "pipelines/k2_6_slice_ddtree_h200.yaml"
LOGS = Path("/tmp/k2_6_lossless_logs")  # each run's log (a device call brings back only a few files)
RUNS = {  # name: overrides on top of the random-head, dummy-weight slice
    "ar1": {"decode.mode": "autoregressive", "workload.concurrency": 1},
    "ar10": {"decode.mode": "autoregressive", "workload.concurrency": 10},
    "chain1": {"decode.mode": "chain", "workload.concurrency": 1},
    "chain10": {"decode.mode": "chain", "workload.concurrency": 10},
    "b8c1": {"decode.budget": 8, "workload.concurrency": 1},
    "b8c10": {"decode.budget": 8, "workload.concurrency": 10},
    "b32c1": {"decode.budget": 32, "workload.concurrency": 1},
    "b32c10": {"decode.budget": 32, "workload.concurrency": 10},
}


def run(out: Path, name: str, over: dict, tokens: int, timeout: float, pipe: str = PIPE,
        extra: tuple[str, ...] = ("model.load=dummy",)) -> dict | None:
    js = out / f"lossless_{name}.json"
    cmd = ["ddtree-rtc", "run", pipe, "--quiet", *[x for e in extra for x in ("--set", e)],
           "--set", f"workload.synthetic.output_len={tokens}", "--set", f"output.json={js}"]
    for k, v in over.items():
        cmd += ["--set", f"{k}={v}"]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: timed out after {timeout:.0f} s", flush=True)
        return None
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / f"lossless_{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0 or not js.exists():
        print(f"{name}: rc={p.returncode}\n{(p.stdout + p.stderr)[-1500:]}", flush=True)
        return None
    r = json.loads(js.read_text())
    js.unlink()  # the ids are kept in the summary; $OUT holds few files
    print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_out"))
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    ap.add_argument("--no-tau", action="store_true")
    ap.add_argument("--pipeline", default=PIPE, help="another pipeline (a CPU check of this tool: tiny_ddtree.yaml)")
    ap.add_argument("--set", dest="extra", action="append", default=None,
                    help="overrides for every run, after model.load=dummy (--set model.load=... replaces it)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in a.runs.split(",") if n]
    extra = ("model.load=dummy", *(a.extra or ()))  # always: else a run first makes host weights
    res, ids = {}, {}
    for n in names:
        r = run(a.out, n, {"model.head": "random", **RUNS[n]}, a.tokens, a.timeout, a.pipeline, extra)
        if r is None:
            res[n] = {"error": True}
            continue
        ids[n] = {q["id"]: q["output"] for q in r["requests"]}
        m = r["metrics"]
        res[n] = {"tok_per_s_per_user": m["tok_per_s_per_user"], "tok_per_s": m["tok_per_s"],
                  "tau": (m.get("speculative") or {}).get("tau")}
    base = "ar1" if "ar1" in ids else next(iter(ids), None)
    bad = 0
    for n in ids:
        if base is None or n == base:
            continue
        diff = []
        for rid, out in ids[n].items():
            want = ids[base].get(rid)
            if want != out:
                k = next((i for i, (x, y) in enumerate(zip(out, want or [])) if x != y), min(len(out), len(want or [])))
                diff.append({"request": rid, "first_difference_at": k})
        res[n]["equal_to"] = base
        res[n]["differs"] = diff
        bad += bool(diff)
    tau = None
    if not a.no_tau:
        r = run(a.out, "tau", {"decode.budget": 32, "workload.concurrency": 10}, a.tokens, a.timeout, a.pipeline, extra)
        if r is not None:
            from ddtree_rtc.backend import Backend
            from ddtree_rtc.model.config import preset_config
            from ddtree_rtc.pipeline.schema import load_pipeline
            from ddtree_rtc.speculative.drafters import OracleDrafter

            pipe = load_pipeline(a.pipeline)
            d = pipe.decode
            vocab = preset_config(pipe.model.preset).vocab_size
            want = OracleDrafter(Backend("numpy", quiet=True), vocab, d.drafter.depth, None,
                                 accept_p=d.drafter.acceptance.p, seed=d.drafter.seed).expected_tau(32)
            got = r["metrics"]["speculative"]["tau"]
            tau = {"measured": got, "expected": want, "ratio": got / want,
                   "tok_per_s_per_user": r["metrics"]["tok_per_s_per_user"]}
    from ddtree_rtc.bench.harness import stamp

    summary = {**stamp(), "pipeline": a.pipeline, "tokens": a.tokens, "runs": res, "tau": tau,
               "ids": {n: {str(k): v for k, v in d.items()} for n, d in ids.items()}}
    (a.out / "k2_6_lossless.json").write_text(json.dumps(summary))
    print(f"\n{'run':<8} {'tok/s/user':>10} {'tau':>5}  ids vs {base}")
    for n, v in res.items():
        if v.get("error"):
            print(f"{n:<8} failed")
            continue
        first = min((d["first_difference_at"] for d in v.get("differs") or ()), default=None)
        eq = "-" if n == base else ("equal" if not v["differs"] else
                                    f"{len(v['differs'])} requests differ, first at token {first}")
        t = "-" if v["tau"] is None else f"{v['tau']:.2f}"
        print(f"{n:<8} {v['tok_per_s_per_user']:>10.1f} {t:>5}  {eq}")
    if tau:
        print(f"oracle tau (the pipeline's head and acceptance, budget 32, c10): measured {tau['measured']:.3f}, "
              f"expected {tau['expected']:.3f}, ratio {tau['ratio']:.3f}")
    return 1 if bad or any(v.get("error") for v in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
