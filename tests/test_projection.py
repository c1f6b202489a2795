import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree_rtc.cli import main
from ddtree_rtc.projection import ProjectionError, RoundModel, experts_touched, load_platforms, project
from ddtree_rtc.projection.model import Fit, check_budget

FITS = {"moe": Fit(3.0, 0.5, "t"), "moe_full": Fit(0.0, 0.6, "t"), "attention": Fit(10.0, 0.6, "t"),
        "dense": Fit(2.0, 0.8, "t"), "head": Fit(1.0, 0.9, "t"), "topk": Fit(5.0, 0.4, "t"),
        "launch_us": 1.5, "build": {(1, 16): 9.0, (1, 64): 12.0}}


@pytest.fixture
def pf():
    return load_platforms()["h200"]


def test_terms_by_hand(pf):
    m = RoundModel(fits=FITS)
    bw = 4.8e12
    t = m.ar_step(pf, batch=1, context=1000)
    expert = 3 * 2048 * 7168 * 0.5625
    assert t["routed experts"] == pytest.approx(60 * (3.0 + 8 * expert / 8 / (bw * 0.5) * 1e6))
    attn = 2 * (7168 * 1536 + 7168 * 576 + 7168 * 384
                + (1536 * 64 * 192 + 512 * 64 * 256 + 64 * 128 * 7168 + 3 * 7168 * 2048) / 8)
    dense = 2 * 3 * 7168 * 18432 / 8
    assert t["attention + dense proj"] == pytest.approx(
        61 * (10.0 + attn / (bw * 0.6) * 1e6) + 2.0 + dense / (bw * 0.8) * 1e6)
    kv = 1000 * 576 * 2 / (bw * 0.6) * 1e6
    flops = 1000 * 8 * 2 * 1088 / (989e12 * 0.45) * 1e6
    assert t["MLA over context"] == pytest.approx(61 * max(kv, flops))
    head = 2 * 163840 * 7168 / 8 + 163840 * 2
    assert t["lm_head"] == pytest.approx(1.0 + head / (bw * 0.9) * 1e6)
    assert t["all-reduce"] == pytest.approx(123 * (20 + 7168 * 2 * 2 * 7 / 8 / 450e3))
    assert t["launch / graph"] == pytest.approx((61 * 6 + 4) * 1.5)
    assert t["drafter"] == 0 and t["topk + tree + accept"] == 0


@pytest.mark.parametrize("tokens", [1, 5, 33, 200])
def test_fan_out_vs_monte_carlo(tokens):
    rng = np.random.default_rng(tokens)
    counts = [len(np.unique(np.concatenate([rng.choice(384, 8, replace=False) for _ in range(tokens)])))
              for _ in range(400)]
    assert experts_touched(tokens) == pytest.approx(np.mean(counts), rel=0.02)
    assert experts_touched(tokens, skew=1.0) < experts_touched(tokens)


def test_tau_one_is_ar_plus_drafter(pf):
    m = RoundModel(fits=FITS)
    ar = m.ar_step(pf, 1, 4096)
    dd = m.ddtree_round(pf, 1, 4096, budget=0)
    extra = dd["drafter"] + dd["topk + tree + accept"] + (6 * 6 + 6) * 1.5
    assert sum(dd.values()) == pytest.approx(sum(ar.values()) + extra)
    assert dd["drafter"] > 0


def test_more_bandwidth_never_slower(pf):
    m = RoundModel()
    prev = None
    for bw in (1.0, 2.0, 4.8, 8.0, 16.0):
        us = sum(m.ddtree_round(dataclasses.replace(pf, mem_tbs=bw), 4, 4096, 64).values())
        assert prev is None or us <= prev
        prev = us
    assert sum(m.ddtree_round(pf, 1, 4096, 128).values()) > sum(m.ddtree_round(pf, 1, 4096, 16).values())


def test_bad_inputs(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("h200: {name: x, mem_tbs: 4.8}\n")
    with pytest.raises(ProjectionError, match="missing keys"):
        load_platforms(bad)
    bad.write_text("h200: [1, 2\n")
    with pytest.raises(ProjectionError, match="cannot read"):
        load_platforms(bad)
    with pytest.raises(ProjectionError, match="unknown platform"):
        project(["h100"])
    for b in (-1, 513):
        with pytest.raises(ProjectionError, match="0..512"):
            check_budget(b)


def test_cli(tmp_path):
    r = CliRunner().invoke(main, ["projection", "--platforms", "h200,b300", "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert "calibration" in r.output and (tmp_path / "p.json").exists()
    r = CliRunner().invoke(main, ["projection", "--budget", "600"])
    assert r.exit_code != 0 and "0..512" in r.output


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "p.png"
    r = CliRunner().invoke(main, ["projection", "--platforms", "b300", "--plot", str(out)])
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 1000
