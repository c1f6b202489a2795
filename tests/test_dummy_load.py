"""``model.load: dummy`` and the simulated rank: a dummy load equals make-model + load bit for bit at
every TP / EP rank's shard; a simulated rank's weight bytes and collectives equal the real rank's in a
``--nproc N`` run; bad input is refused by key."""

import json
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.model import random_weights as rw
from ddtree_rtc.model.config import load_config, preset_config
from ddtree_rtc.model.dummy import shard_nbytes
from ddtree_rtc.model.make_model import make_model
from ddtree_rtc.model.shard import Shard
from ddtree_rtc.model.target import DenseMLP, TargetModel
from ddtree_rtc.parallel.simulated import SimulatedRank
from ddtree_rtc.pipeline.schema import PipelineError, parse_pipeline
from ddtree_rtc.testing import finish_process, start_cli_run

ROOT = Path(__file__).resolve().parents[1]


def arrays(model) -> dict:
    """Every weight array of a loaded model by a readable name."""
    out = {"embed": model.embed, "lm_head": model.lm_head, "final_norm": model.final_norm}
    for i, layer in enumerate(model.layers):
        out[f"{i}.input_norm"], out[f"{i}.post_norm"] = layer.input_norm, layer.post_norm
        out.update({f"{i}.attn.{k}": v for k, v in vars(layer.attn).items()})
        m = layer.mlp
        if isinstance(m, DenseMLP):
            out[f"{i}.w13"], out[f"{i}.w2"] = m.w13, m.w2
        else:
            out.update({f"{i}.moe.{k}": v for k, v in vars(m).items() if k != "experts"})
            out.update({f"{i}.experts.{k}": v for k, v in vars(m.experts).items()})
    return out


def assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if x is None or isinstance(x, (int, str)):
            assert x == y, k
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), k


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """tiny (decisive head, seed 5) and small cut to 2 layers (random head, seed 3), written once."""
    out = {}
    for preset, layers, head, seed in (("tiny", None, "decisive", 5), ("small", 2, "random", 3)):
        cfg = preset_config(preset)
        cfg = cfg if layers is None else cfg.with_layers(layers)
        d = tmp_path_factory.mktemp(preset)
        make_model(cfg, d, seed=seed, head=head)
        out[preset] = (d, head, seed)
    return out


CASES = [(p, w, ep) for p in ("tiny", "small") for w, ep in ((1, False), (2, False), (4, False), (2, True),
                                                               (4, True))]


@pytest.mark.parametrize("preset,world,ep", CASES)
def test_dummy_load_equals_make_model_then_load(checkpoints, preset, world, ep):
    d, head, seed = checkpoints[preset]
    cfg = load_config(d)
    be = Backend("numpy")
    ranks = range(world) if preset == "tiny" else sorted({0, world - 1})
    for r in ranks:
        shard = Shard(r, world, ep)
        comm = SimulatedRank(r, world) if world > 1 else None
        loaded = TargetModel.load(d, be, shard=shard, comm=comm)
        dummy = TargetModel.dummy(cfg, be, seed=seed, head=head, shard=shard, comm=comm)
        assert_same_bits(arrays(loaded), arrays(dummy))
        assert dummy.weight_nbytes() == loaded.weight_nbytes() == shard_nbytes(cfg, shard)


def test_dummy_makes_only_the_shard_and_progress(checkpoints):
    d, head, seed = checkpoints["tiny"]
    cfg = load_config(d)
    seen = []
    model = TargetModel.dummy(cfg, Backend("numpy"), seed=seed, head=head, shard=Shard(1, 4, False),
                              comm=SimulatedRank(1, 4), progress=seen.append)
    assert seen == list(range(1, cfg.num_hidden_layers + 1))
    assert model.lm_head.shape == (cfg.vocab_size // 4, cfg.hidden_size)
    assert not list(Path(d).parent.glob("*dummy*"))


def test_generator_values_and_slices():
    n = 64
    whole = rw.values(7, "model.layers.0.self_attn.o_proj.weight", (n, 4096), 4, np)
    x = (whole.astype(np.uint32) << 16).view(np.float32)
    std = 4096 ** -0.5 / np.sqrt(8)
    assert abs(x.std() / std - 1) < 0.02 and abs(x.mean()) < 0.02 * std
    assert np.abs(x).max() <= 3.47 * std * 1.01  # Irwin-Hall of 4: bounded at sqrt(12) std
    part = rw.values(7, "model.layers.0.self_attn.o_proj.weight", (n, 4096), 4, np, cols=(1024, 2048))
    assert np.array_equal(part, whole[:, 1024:2048])
    rows = rw.values(7, "model.layers.0.self_attn.o_proj.weight", (n, 4096), 4, np, rows=np.array([5, 2]))
    assert np.array_equal(rows, whole[[5, 2]])
    assert not np.array_equal(rw.values(8, "model.layers.0.self_attn.o_proj.weight", (n, 4096), 4, np), whole)
    bias = rw.values(0, "model.layers.1.mlp.gate.e_score_correction_bias", (4096,), 4, np)
    assert bias.dtype == np.float32 and bias.min() >= -0.05 and bias.max() < 0.05
    words = rw.values(0, "model.layers.1.mlp.experts.3.up_proj.weight_packed", (32, 16), 4, np)
    assert words.dtype == np.int32 and words[0, 0] == 0x0F0F0F0F
    assert rw.values(0, "model.layers.1.mlp.experts.3.up_proj.weight_packed", (32, 16), 4, np, rows=(1, 3))[0, 0] \
        == words[1, 0]
    bits = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0, 1.00390625], np.float32)
    assert np.array_equal(rw.to_bf16_bits(bits, np), bits.astype(bfloat16).view(np.uint16))


@pytest.mark.gpu
def test_dummy_on_the_gpu_matches_numpy(checkpoints):
    """The CuPy generator gives numpy's bits; the device repack of the dummy experts equals the host
    repack of the checkpoint's."""
    import cupy  # noqa: F401

    # rank 1 of 2 under EP (whole experts) and TP; a TP split of the experts' intermediate must leave
    # the CUDA kernels' 128-wide k blocks whole (tiny's 128 does not split, small's 256 does)
    for preset, ep in (("tiny", True), ("small", True), ("small", False)):
        d, head, seed = checkpoints[preset]
        cfg = load_config(d)
        shard, comm = Shard(1, 2, ep), SimulatedRank(1, 2)
        host = TargetModel.load(d, Backend("cuda"), shard=shard, comm=comm)
        dev = TargetModel.dummy(cfg, Backend("cuda"), seed=seed, head=head, shard=shard, comm=comm)
        experts = next(ly.mlp.experts for ly in host.layers if not isinstance(ly.mlp, DenseMLP))
        assert (experts.num_experts, experts.intermediate) == ((cfg.n_routed_experts // 2, cfg.moe_intermediate_size)
                                                               if ep else (cfg.n_routed_experts,
                                                                           cfg.moe_intermediate_size // 2))
        a = {k: (v.get() if hasattr(v, "get") else v) for k, v in arrays(host).items()}
        b = {k: (v.get() if hasattr(v, "get") else v) for k, v in arrays(dev).items()}
        assert_same_bits(a, b)
    z = rw.values(3, "model.embed_tokens.weight", (300, 256), 4, cupy)
    assert np.array_equal(z.get(), rw.values(3, "model.embed_tokens.weight", (300, 256), 4, np))


# -- the simulated rank against a real --nproc run -------------------------------------------------------
def _start(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    return out, start_cli_run(ROOT, out, "pipelines/tiny.yaml", "--set", "workload.synthetic.count=2",
                              "--set", "workload.synthetic.output_len=4", *args)


def _finish(started):
    out, p = started
    done = finish_process(p)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stderr


@pytest.mark.parametrize("ep", [False, True])
def test_simulated_rank_moves_the_real_ranks_bytes(tmp_path, ep):
    """The real job's local transport checks that every rank calls the same collective with the same
    bytes at every step, so rank 0's counts (the ones it reports) are every rank's. The real job and
    the simulated ranks run side by side."""
    extra = ("--set", "runtime.tensor_parallel=2", "--set", f"runtime.expert_parallel={str(ep).lower()}")
    started = _start(tmp_path, "real", "--nproc", "2", *extra)
    sims = [_start(tmp_path, f"sim{rank}", *extra, "--set", f"runtime.simulate_rank={rank}",
                   "--set", "model.load=dummy") for rank in ((1,) if ep else (0, 1))]
    real, _ = _finish(started)
    for sim, err in map(_finish, sims):
        assert "numerics are NOT the model's" in err and "NOT the model's" in sim["simulated_rank"]["note"]
        a, b = real["metrics"], sim["metrics"]
        assert b["weight_bytes"] == a["weight_bytes"]
        assert b["parallel"]["collectives"] == a["parallel"]["collectives"]
        assert b["parallel"]["transport"] == "simulated" and b["steps"] == a["steps"]


# -- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,key,words", [
    ("model: {preset: tiny}\nruntime: {tensor_parallel: 4, simulate_rank: 4}\n", "runtime", "outside [0, 4)"),
    ("model: {preset: tiny}\nruntime: {tensor_parallel: 4, simulate_rank: -1}\n", "runtime", "outside [0, 4)"),
    ("model: {preset: tiny}\nruntime: {simulate_rank: 0}\n", "runtime", "needs tensor_parallel >= 2"),
    ("model: {path: /some/ckpt, load: dummy}\n", "model", "takes no checkpoint 'path'"),
    ("model: {preset: tiny, load: lazy}\n", "model.load", "must be one of"),
    ("model: {preset: tiny}\nruntime: {simulate_collective_us: 5}\n", "runtime", "set simulate_rank"),
])
def test_bad_keys_are_refused_by_name(text, key, words):
    with pytest.raises(PipelineError) as e:
        parse_pipeline(text, "p.yaml")
    msg = str(e.value)
    assert msg.startswith("p.yaml:") and key in msg and words in msg
    if "simulate_rank" in text:
        assert "simulate_rank" in msg


def test_a_dummy_model_that_does_not_fit_is_refused_before_allocating(monkeypatch):
    from ddtree_rtc.pipeline import runner

    pipe = parse_pipeline("model: {preset: tiny, load: dummy}\nruntime: {backend: numpy}\n", "p.yaml")
    monkeypatch.setattr(runner, "free_memory", lambda backend: 1000)
    made = []
    monkeypatch.setattr(TargetModel, "dummy", classmethod(lambda cls, *a, **k: made.append(1)))
    with pytest.raises(PipelineError) as e:
        runner.build_engine(pipe, max_batch=1)
    need = shard_nbytes(preset_config("tiny"), Shard())
    assert f"needs {need} bytes" in str(e.value) and "has 1000 bytes" in str(e.value)
    assert "model.load: dummy" in str(e.value) and not made
