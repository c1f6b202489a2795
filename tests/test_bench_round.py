"""The host side of `bench round` and `bench drafter` (their timings need a GPU): argument parsing,
byte-floor and tok/s arithmetic, and the device round the round bench times, run on numpy."""

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree_rtc.backend import Backend
from ddtree_rtc.bench import drafter as drafter_bench
from ddtree_rtc.bench import round as round_bench
from ddtree_rtc.cli import main
from ddtree_rtc.model.config import preset_config
from ddtree_rtc.model.dflash import expected_tensors
from ddtree_rtc.model.make_model import make_model
from ddtree_rtc.model.target import TargetModel
from ddtree_rtc.testing import random_bf16


@pytest.mark.parametrize("name", ["round", "drafter"])
def test_help_reaches_the_benchmark(name):
    res = CliRunner().invoke(main, ["bench", name, "--help"])
    assert res.exit_code == 0, res.output
    assert f"usage: ddtree-rtc bench {name}" in res.output and "--json" in res.output and "--batches" in res.output


def test_round_arguments():
    args = round_bench.parse_args(["--batches", "1,32", "--budgets", "16,64", "--accept-p", "0.42"])
    assert args.batches == (1, 32) and args.budgets == (16, 64) and args.accept_p == 0.42
    default = round_bench.parse_args([])
    assert default.batches == (1, 8, 32) and default.budgets == (16, 32, 64) and default.context == 1024


@pytest.mark.parametrize("argv,msg", [
    (["--budgets", "16,600"], r"--budgets: \[600\] outside 1..512"),
    (["--batches", "1,x"], "--batches: expected comma-separated integers, got '1,x'"),
    (["--accept-p", "0"], r"--accept-p must be in \(0, 1\], got 0.0"),
    (["--context", "0"], "--context must be >= 1"),
    (["--tau-tokens", "1"], "--tau-tokens must be >= 2"),
])
def test_round_bad_arguments_are_named(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        round_bench.parse_args(argv)
    assert e.value.code == 2
    import re

    assert re.search(msg, capsys.readouterr().err)


def test_drafter_arguments(capsys):
    args = drafter_bench.parse_args(["--contexts", "1024,4096", "--gqa-contexts", "512"])
    assert args.contexts == (1024, 4096) and args.gqa_contexts == (512,) and args.batches == (1, 8, 32)
    with pytest.raises(SystemExit):
        drafter_bench.parse_args(["--extend-rows", "0"])
    assert "--extend-rows" in capsys.readouterr().err


def test_int_list():
    assert round_bench.int_list("3", "--x", 1, 5) == (3,)
    with pytest.raises(ValueError, match=r"--x: \[0, 6\] outside 1..5"):
        round_bench.int_list("0,2,6", "--x", 1, 5)


def test_verify_floor_and_tok_s_arithmetic():
    weights = [{"attention": 100, "mlp": 10}, {"attention": 100, "mlp": 20}]
    # head 5000; embedding rows 2*3 x 4 x 2 B; logits 2*3 x 7 x 2 B; per layer: weights and 2 x (10+3) KV rows of 8 B;
    # layer 1 also 3 touched experts of 1000 B
    want = 5000 + 48 + 84 + (100 + 208 + 10) + (100 + 208 + 20 + 3000)
    assert round_bench.verify_floor_bytes(weights, {1: 3}, 1000, 5000, 2, 10, 3, 8, 4, 7) == want
    assert round_bench.tokens_per_second(8, 4.0, 2000.0) == pytest.approx(16000.0)


def test_drafter_byte_floors_count_the_checkpoint():
    """The floors against the drafter checkpoint's own tensor list (make-model --preset dflash-k2.6)."""
    c = drafter_bench.k26_config()
    size = {s.name: int(np.prod(s.shape)) for s in expected_tensors(c)}
    layers = sum(v for k, v in size.items() if k.startswith("layers."))
    assert layers == 6 * 528_496_896  # 6 x (q, k, v, o, 2 head norms, gate, up, down, 2 norms)
    h, v, kv_row = c.hidden_size, c.vocab_size, 8 * 128
    b, ctx = 8, 4096
    want = 2 * (layers + size["norm.weight"] + v * h + b * 8 * h + 6 * 2 * b * ctx * kv_row + b * 7 * v)
    assert drafter_bench.forward_bytes(c, b, ctx) == want
    extend = size["fc.weight"] + size["hidden_norm.weight"] + sum(
        n for k, n in size.items() if k.endswith(("k_proj.weight", "v_proj.weight", "k_norm.weight")))
    rows = 40
    assert drafter_bench.extend_bytes(c, rows) == 2 * (extend + rows * 6 * h + 6 * 2 * rows * kv_row)
    assert drafter_bench.gqa_bytes(c, 2, 100) == 2 * (2 * 2 * 108 * kv_row + 2 * 2 * 8 * 64 * 128)


@pytest.mark.parametrize("accept_p,budget", [(1.0, 8), (0.5, 16)])
def test_device_round_on_numpy(tmp_path, accept_p, budget):
    """The round the bench captures, on the numpy tiny model: the choices are the verify's argmax,
    the emitted tokens walk the tree along them, and the commit moves the accepted nodes' KV rows.
    The oracle learns the target's choice one depth per round, so the paths grow: to the whole depth
    at p = 1 (the tree is the rank-0 chain, nodes 1..7), through later-popped nodes at p = 0.5 (so
    the commit really moves rows)."""
    make_model(preset_config("tiny"), tmp_path, seed=3)
    model = TargetModel.load(tmp_path, Backend("numpy"))
    batch, ctx, depth = 3, 20, round_bench.DEPTH
    rd = round_bench.DeviceRound(model, batch=batch, budget=budget, ctx=ctx, accept_p=accept_p, seed=1)
    moved = 0
    rd.cache.data[...] = random_bf16(np.random.default_rng(0), rd.cache.data.shape, 0.5)
    for _ in range(depth + 1):
        seen, before = [], {}

        def mark(stage, seen=seen, before=before):
            seen.append(stage)
            if stage == "accept":
                before["cache"] = rd.cache.data.copy()

        out, choices, acc = rd.run(mark)
        assert tuple(seen) == round_bench.STAGES
        assert np.array_equal(choices, out.logits.astype(np.float32).argmax(axis=1).reshape(batch, 1 + budget))
        tree = rd.bufs.tree
        flat = rd.cache.data.reshape(rd.cache.data.shape[0], -1, rd.cache.data.shape[-1])
        flat_old = before["cache"].reshape(flat.shape)
        for b in range(batch):
            n = int(acc.accept_len[b])
            path = acc.accepted[b, :n]
            assert path[0] == 0 and all(tree.parents[b, path[j + 1]] == path[j] for j in range(n - 1))
            want = [int(tree.tokens[b, u]) for u in path[1:]] + [int(choices[b, path[-1]])]
            assert acc.emitted[b, :n].tolist() == want
            moved += int((path != np.arange(n)).sum())
            src = rd.alloc.slots(b, ctx + path.astype(np.int64))
            assert np.array_equal(flat[:, rd.alloc.slots(b, ctx + np.arange(n))], flat_old[:, src]), \
                f"request {b}: the commit moved the accepted rows"
            if n <= depth:  # teach the oracle the target's next choice
                rd.continuations[b][n] = want[-1]
                rd.drafter.admit(b, [0] * ctx, {})
        rd.logits = rd.draft_bf16()
    if accept_p == 1.0:
        assert acc.accept_len.tolist() == [depth + 1] * batch and moved == 0
    else:
        assert moved > 0 and acc.accept_len.max() >= 4, (moved, acc.accept_len)


def test_f32_to_bf16_bits_rounds_to_nearest_even():
    from ml_dtypes import bfloat16

    from ddtree_rtc.bench.harness import bf16_to_f32, f32_to_bf16_bits

    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 37
    x[:4] = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0]  # ties go to even
    bits = f32_to_bf16_bits(x)
    assert np.array_equal(bits, x.astype(bfloat16).view(np.uint16))
    assert np.array_equal(bf16_to_f32(bits), x.astype(bfloat16).astype(np.float32))
