"""τ(budget): tokens per round (bonus included), from evidence, with its bound enforced.

Sources: the published chain acceptance of z-lab's Kimi-K2.5-DFlash drafter (block 8, so depth 7), this
repository's oracle drafter profile, or a measured histogram (`--tau-from`, a run JSON). A published chain
τ gives a band for DDTree: from the chain itself (DDTree gains nothing) up to the oracle tree drafted with
the chain's per-depth acceptance, capped at +35% over the chain (the DDTree paper's largest gain)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from .data import ProjectionError

DEPTH = 7
PUBLISHED_CHAIN = {"gsm8k": 5.3, "math500": 5.5, "humaneval": 5.3, "mbpp": 4.5, "mt-bench": 3.7}
PUBLISHED_SOURCE = ("z-lab Kimi-K2.5-DFlash model card (huggingface.co/z-lab/Kimi-K2.5-DFlash), block size 8: "
                    "acceptance length GSM8K 5.3, Math500 5.5, HumanEval 5.3, MBPP 4.5, MT-Bench 3.7")
DDTREE_GAIN_MAX = 0.35
GAIN_SOURCE = "DDTree paper: up to +35% tokens per round over the DFlash chain (the band's top)"
ORACLE_P = 0.77  # the acceptance of benchmarks/round_h100.json's oracle drafter


def tau_bound(budget: int, depth: int = DEPTH) -> int:
    return min(budget + 1, depth + 1)


def check_tau(tau: float, budget: int, depth: int = DEPTH, what: str = "tau") -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or tau != tau:
        raise ProjectionError(f"{what}={tau!r} is not a number")
    bound = tau_bound(budget, depth)
    if tau < 1.0 or tau > bound + 1e-9:
        raise ProjectionError(f"{what}={tau:g} at budget {budget}, depth {depth}: tokens per round must lie in "
                              f"[1, min(budget + 1, depth + 1) = {bound}]")
    return float(tau)


def chain_tau(p: float, length: int) -> float:
    """Expected tokens of a chain of `length` drafts, each accepted with probability p given its parent."""
    return sum(p ** k for k in range(length + 1))


@cache
def chain_p(tau: float, depth: int = DEPTH) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tau(mid, depth) < tau else (lo, mid)
    return (lo + hi) / 2


@cache
def _oracle(p: float):
    from ..speculative.drafters import OracleDrafter
    return OracleDrafter(None, 163840, DEPTH, lambda rid, prompt: [], accept_p=p)


@cache
def oracle_tree_tau(p: float, budget: int) -> float:
    """τ of the oracle drafter's best-first tree of `budget` nodes (OracleDrafter.expected_tau)."""
    if budget == 0:
        return 1.0
    return _oracle(round(p, 6)).expected_tau(budget)


@dataclass(frozen=True)
class Tau:
    kind: str                  # published / oracle / measured / fixed
    source: str
    chain: float | None = None  # published chain τ (depth 7)
    point: float | None = None  # measured or fixed τ
    budget: int | None = None   # the one budget a measured or fixed τ holds at

    def budgets(self, candidates):
        return [self.budget] if self.budget is not None else list(candidates)

    def band(self, budget: int) -> tuple[float, float]:
        """(low, high) τ at `budget`, both within the bound (checked)."""
        if self.kind in ("measured", "fixed"):
            if budget != self.budget:
                raise ProjectionError(f"{self.kind} tau holds at budget {self.budget} only, asked at {budget}")
            lo = hi = self.point
        elif self.kind == "oracle":
            lo = hi = oracle_tree_tau(ORACLE_P, budget)
        else:
            p = chain_p(self.chain)
            lo = chain_tau(p, min(budget, DEPTH))
            hi = max(lo, min(oracle_tree_tau(p, budget), self.chain * (1 + DDTREE_GAIN_MAX)))
        check_tau(lo, budget, what=f"{self.kind} tau (low)")
        check_tau(hi, budget, what=f"{self.kind} tau (high)")
        return lo, hi


def published(dataset: str = "mean") -> Tau:
    if dataset == "mean":
        v = sum(PUBLISHED_CHAIN.values()) / len(PUBLISHED_CHAIN)
    elif dataset in PUBLISHED_CHAIN:
        v = PUBLISHED_CHAIN[dataset]
    else:
        raise ProjectionError(f"unknown dataset {dataset!r}; known: mean, {', '.join(PUBLISHED_CHAIN)}")
    return Tau("published", f"{PUBLISHED_SOURCE}; {dataset} = {v:.2f}; band top: {GAIN_SOURCE}", chain=v)


def oracle() -> Tau:
    return Tau("oracle", f"oracle drafter profile at acceptance p = {ORACLE_P} (OracleDrafter.expected_tau; "
                         "round_h100.json tau_expected 4.45 / 5.06 / 5.72 at budgets 16 / 32 / 64)")


def at_budget(t: Tau, budget: int) -> Tau:
    """A published or oracle τ held at one budget (the band is still checked against its bound there)."""
    out = replace(t, budget=budget, source=f"{t.source}; budget fixed at {budget}")
    out.band(budget)
    return out


def fixed(tau: float, budget: int) -> Tau:
    check_tau(tau, budget, what="--tau")
    return Tau("fixed", f"--tau {tau:g} at budget {budget}", point=float(tau), budget=budget)


def from_run(spec: str) -> Tau:
    """`FILE` (a `ddtree-rtc run` JSON) or `FILE:RUN` (one run of a JSON holding several under 'runs'):
    τ = the mean of its tokens-per-round histogram, at the run's budget."""
    path, _, run = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ProjectionError(f"--tau-from {p}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProjectionError(f"--tau-from {p}: not JSON: {e}") from None
    if "runs" in d:
        if run not in d["runs"]:
            raise ProjectionError(f"--tau-from {p}: name one run as FILE:RUN; runs: {', '.join(d['runs'])}")
        d = d["runs"][run]
    spec_ = (d.get("metrics") or {}).get("speculative")
    if not isinstance(spec_, dict) or not isinstance(spec_.get("tokens_per_round_hist"), dict):
        raise ProjectionError(f"--tau-from {spec}: no metrics.speculative.tokens_per_round_hist (not a DDTree run)")
    hist = {int(k): int(v) for k, v in spec_["tokens_per_round_hist"].items()}
    n = sum(hist.values())
    if n <= 0:
        raise ProjectionError(f"--tau-from {spec}: empty tokens_per_round_hist")
    budget = spec_.get("budget") or (d.get("decode") or {}).get("budget")
    if not isinstance(budget, int):
        raise ProjectionError(f"--tau-from {spec}: no budget in metrics.speculative.budget or decode.budget")
    tau = sum(k * v for k, v in hist.items()) / n
    if max(hist) > tau_bound(budget):
        raise ProjectionError(f"--tau-from {spec}: histogram has rounds of {max(hist)} tokens, above "
                              f"min(budget + 1, depth + 1) = {tau_bound(budget)}")
    check_tau(tau, budget, what=f"--tau-from {spec}")
    return Tau("measured", f"{spec}: mean of {n} rounds' tokens-per-round histogram = {tau:.2f} at budget {budget}",
               point=tau, budget=budget)
