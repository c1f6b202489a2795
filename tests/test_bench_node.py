"""`bench node`'s host glue on the numpy backend (tiny preset, 4 simulated ranks): flags, memory plan,
collective counts, per-rank EP expert load and the 8-GPU projection arithmetic. The GPU timers
(bench decode / round case runners, time_gpu, the read ceiling) are replaced by fixed figures here:
the timing itself runs on the GPU only (`ddtree-rtc bench node`)."""

import json

import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.bench import node
from ddtree_rtc.bench.harness import Row, Timing
from ddtree_rtc.model.config import preset_config
from ddtree_rtc.model.shard import Shard
from ddtree_rtc.model.target import TargetModel


def test_help_explains_every_flag():
    ap = node.make_parser()
    for action in ap._actions:  # noqa: SLF001 - argparse keeps no public list
        assert action.help and len(action.help) > 10, action.option_strings
    text = ap.format_help()
    for flag in ("--layouts", "--layers", "--quick", "--small-m", "--collective-us", "--hold-us", "--json"):
        assert flag in text


def test_flags_quick_and_refusals(capsys):
    a = node.parse_args(["--quick"])
    assert a.batches == (1, 10) and a.contexts == (1024,) and a.budgets == (8, 32) and a.iters == 5
    a = node.parse_args(["--quick", "--batches", "4"])
    assert a.batches == (4,)
    for bad in (["--layouts", "dp"], ["--small-m", "nope"], ["--rank", "8"], ["--layers", "62"],
                ["--budgets", "0"]):
        with pytest.raises(SystemExit):
            node.parse_args(bad)
        assert bad[0] in capsys.readouterr().err


def test_small_m_values_are_applied_both_ways():
    """--small-m on,off: runtime.small_m_path is a bool, so both values are offered and each sets
    the model's switch (a dummy model is made with it on, so 'off' must turn it off)."""
    assert node.small_m_choices() == ("on", "off")
    assert node.parse_args([]).small_m == ("on",)
    assert node.parse_args(["--small-m", "on,off"]).small_m == ("on", "off")
    model = TargetModel.dummy(preset_config("tiny"), Backend("numpy"))
    assert model.small_m_path is True
    node.SMALL_M_APPLY["off"](model)
    assert model.small_m_path is False and not model.small_m(1)
    node.SMALL_M_APPLY["on"](model)
    assert model.small_m_path is True and model.small_m(1)


def test_memory_plan_names_bytes_and_drops_layers():
    cfg = preset_config("k2.6")
    args = node.parse_args(["--quick"])
    shard = Shard(0, 8, False)
    n, fig = node.plan_memory(cfg, shard, args, 200 << 30)
    assert n == node.FULL_LAYERS and 70e9 < fig["full_depth_weights_bytes"] < 80e9
    n, fig = node.plan_memory(cfg, shard, args, 40 << 30)
    assert 1 < n < node.FULL_LAYERS and fig["needed_bytes"] <= 40 << 30
    args.layers = 61
    with pytest.raises(SystemExit, match=r"need .* GB .* GPU has 42.9 GB free"):
        node.plan_memory(cfg, shard, args, 40 << 30)


@pytest.mark.parametrize("argv", [["--quick", "--small-m", "on,off"], []])
@pytest.mark.parametrize("ep", [False, True])
def test_memory_plan_on_an_h100_and_an_h200(argv, ep):
    """auto on the H100 of the first GPU run (82.3 GB free; 58 layers of TP8 ran out of memory while
    making the weights, 40 ran): fewer than 58 layers, the plan's every part inside the free bytes;
    on an H200 (141 GB, ~138 free) all 61 layers, for either layout and either case set."""
    cfg, args = preset_config("k2.6"), node.parse_args(argv)
    shard = Shard(0, 8, ep)
    n, fig = node.plan_memory(cfg, shard, args, int(82.3e9))
    assert 40 <= n < 58 and fig["needed_bytes"] <= 82.3e9
    assert fig["needed_bytes"] >= fig["weights_bytes"] + fig["load_transient_bytes"] + fig["margin_bytes"]
    assert fig["needed_bytes"] >= (fig["weights_bytes"] + fig["drafter_bytes"] + fig["kv_bytes_largest_case"]
                                   + fig["run_bytes"] + fig["ep_other_rank_bytes"] + fig["margin_bytes"])
    assert (fig["ep_other_rank_bytes"] > 0) == ep
    n, fig = node.plan_memory(cfg, shard, args, int(138e9))
    assert n == node.FULL_LAYERS and fig["needed_bytes"] <= 138e9


def _fake_decode_case(model, batch, ctx, iters, gate, weight_bytes):
    rows = []
    for i in range(model.num_layers):
        moe = model.cfg.is_moe_layer(i)
        rows.append(Row(f"L{i} attention", 10.0, extra={"stage": "attention", "layer": i, "floor_us": 2.0}))
        rows.append(Row(f"L{i} mlp", 20.0 if moe else 5.0, extra={"stage": "moe" if moe else "dense", "layer": i,
                                                                   "floor_us": 4.0, "experts_touched": 3}))
    rows.append(Row("head", 7.0, extra={"stage": "head", "layer": -1, "floor_us": 1.0}))
    common = {"graph_us": 100.0, "queued_us": 90.0, "eager_us": 150.0, "mean_stage_us": {}, "mean_stage_floor_us": {}}
    return rows + [Row("step (CUDA graph)", 100.0, extra=common), Row("eager", 150.0), Row("queued", 90.0)]


def _fake_round_case(model, batch, budget, args, gate, weight_bytes, tau_stats, chain=False):
    summ = {"graph_us": 200.0 + budget, "queued_us": 190.0, "eager_us": 300.0, "verify_floor_us": 50.0,
            "stage_us": {"verify": 120.0}, "ar_step_us": 100.0, "experts_touched": {1: 5}, "tau": tau_stats.tau}
    return [Row("draft", 1.0, extra={"stage": "draft"}), Row("round (CUDA graph)", summ["graph_us"], extra=summ)]


@pytest.fixture
def fake_gpu(monkeypatch):
    from ddtree_rtc.bench import decode
    from ddtree_rtc.bench import round as round_bench

    monkeypatch.setattr(decode, "bench_case", _fake_decode_case)
    monkeypatch.setattr(round_bench, "bench_case", _fake_round_case)
    monkeypatch.setattr(node, "time_gpu", lambda fn, warmup=0, iters=1: (fn(), Timing(3.0, 3.0, 3.0))[1])
    monkeypatch.setattr(node, "read_ceiling_gbs", lambda: 1000.0)
    # the scaling probe: the step's graph 10 µs and each round's 20 µs per MoE layer below the fakes' depth 3
    monkeypatch.setattr(node, "graph_step_us", lambda model, b, ctx, iters: 100.0 - 10.0 * (3 - model.num_layers))
    monkeypatch.setattr(node, "graph_round_us", lambda model, b, budget, ctx, p, chain, iters:
                        200.0 + (7 if chain else budget) - 20.0 * (3 - model.num_layers))


# path: the MoE components' kernels. tiny at TP4 has expert intermediate 32, under moe_small's
# multiple of 128, so the small-M path declines there; at EP4 the experts stay whole.
@pytest.mark.parametrize("layout,small_m,path", [("tp", "on", "general"), ("ep", "on", "small-m"),
                                                 ("ep", "off", "general")])
def test_layout_glue_on_numpy(fake_gpu, layout, small_m, path):
    args = node.parse_args(["--world", "4", "--rank", "1", "--batches", "2", "--contexts", "8", "--budgets", "4",
                            "--layers", "3", "--no-drafter", "--collective-us", "20,8", "--iters", "1",
                            "--small-m", small_m])
    rows, lay = node.run_layout(layout, args, None, lambda msg: None, be=Backend("numpy"), preset="tiny")
    assert lay["layers"] == 3 and "NOT the model's" in lay["numerics"]
    (case,) = lay["cases"]
    cfg = preset_config("tiny")
    # two all-reduces per layer and the head's all-gather, for the step and each round
    assert case["ar"]["collectives"]["calls"] == 2 * 3 + 1
    ar_bytes = case["ar"]["collectives"]["bytes"]
    h = cfg.hidden_size
    # attention fp32 [T, H] x 3, dense layer 0 [T, H], MoE layers [2, T, H] x 2, head logits bf16 [T, V / 4]
    assert ar_bytes == 3 * 2 * h * 4 + 2 * h * 4 + 2 * 2 * 2 * h * 4 + 2 * (cfg.vocab_size // 4) * 2
    assert {c["component"] for c in (r.extra for r in rows) if "component" in c} == {
        "router", "routed experts", "shared expert", "all-reduce stand-in (device copy)"}
    assert {r.extra["path"] for r in rows if "component" in r.extra} == {path}
    assert [r["chain"] for r in case["rounds"]] == [False, True]
    assert case["rounds"][0]["collectives"]["calls"] == 7
    if layout == "ep":
        ep = case["ar"]["ep_ranks"]
        assert {r.extra["path"] for r in rows if "ep_rank" in r.extra} == {path}
        assert len(ep["us_per_rank"]) == 4 and sum(ep["pairs_per_rank"]) == 2 * cfg.num_experts_per_tok
        assert sum(case["rounds"][0]["ep_ranks"]["pairs_per_rank"]) == 2 * 5 * cfg.num_experts_per_tok
    p20, p8 = case["projection"]
    missing = node.FULL_LAYERS - 3
    assert p20["ar"]["collective_calls"] == 7 + 2 * missing
    assert p20["ar"]["per_token_us"] == pytest.approx(p20["ar"]["rank_us"] + 20 * p20["ar"]["collective_calls"])
    # scaled by the graph's slope between the probe's 1 layer and the 3 made, not by the stage rows
    assert case["ar"]["probe"] == {"layers": 1, "step_us": 80.0}
    probe = node.depth_view(TargetModel.dummy(preset_config("tiny").with_layers(3), Backend("numpy")), 1)
    assert probe.num_layers == 1 and probe.cfg.num_hidden_layers == 1 and probe.small_m(1)
    assert case["ar"]["step_us_61"] == pytest.approx(100.0 + missing * 10.0)
    assert [r["probe"]["per_moe_layer_graph_us"] for r in case["rounds"]] == [20.0, 20.0]
    assert case["rounds"][0]["round_us_61"] == pytest.approx(204.0 + missing * 20.0)
    chain = p8["rounds"][1]
    assert set(chain["published"]) == set(node.PUBLISHED_TAU)
    assert chain["published"]["GSM8K"]["tok_s_per_user"] == pytest.approx(1e6 * 5.3 / chain["round_total_us"])
    doc = node.summary_doc([lay], args)
    json.dumps(doc, default=node._json_default)


def test_layouts_give_back_their_model(fake_gpu, monkeypatch):
    """Each layout drops everything it made before the next is planned: its model (held in reference
    cycles by runners and graphs on the GPU) is collected by the time run_layout returns, and the
    next layout plans its layers on the free memory measured then."""
    import weakref

    made, planned = [], []
    dummy, plan = TargetModel.dummy.__func__, node.plan_memory

    def record_dummy(cls, *a, **k):
        model = dummy(cls, *a, **k)
        model.cycle = model  # as a runner or graph referring back to its model does
        made.append(weakref.ref(model))
        return model

    def record_plan(cfg, shard, args, free):
        planned.append([ref() is None for ref in made])
        return plan(cfg, shard, args, free)

    monkeypatch.setattr(TargetModel, "dummy", classmethod(record_dummy))
    monkeypatch.setattr(node, "plan_memory", record_plan)
    args = node.parse_args(["--world", "4", "--batches", "1", "--contexts", "8", "--budgets", "", "--no-chain",
                            "--layers", "2", "--no-drafter", "--no-components", "--iters", "1"])
    for layout in ("tp", "ep"):
        _, lay = node.run_layout(layout, args, None, lambda msg: None, be=Backend("numpy"), preset="tiny")
        assert made[-1]() is None, f"the {layout} layout's model is still alive"
        assert {"free_after_weights_bytes", "case_pool_peak_bytes", "free_after_release_bytes"} <= set(lay["memory"])
    assert planned == [[], [True]]


def test_drafter_shard_floor(monkeypatch):
    from types import SimpleNamespace

    from ddtree_rtc.bench.drafter import forward_bytes, k26_config

    monkeypatch.setattr(node, "read_ceiling_gbs", lambda: 1000.0)
    c = k26_config()
    whole = forward_bytes(c, 1, 1024)
    shard = SimpleNamespace(cfg=c, q_heads=8, kv_heads=1)
    row = node.drafter_shard_row(Row("forward", 100.0, bytes=whole, extra={}), shard, 1, 1024, 8)
    # the shard's weights are an eighth; the embedding rows and the gathered logits are whole
    assert whole / 8 < row.bytes < whole / 4
    assert row.extra["floor_us"] == pytest.approx(row.bytes / 1000.0 / 1e3)


class _Stream:
    """A fake GPU stream behind bench decode's gate: launches enqueued while the gate holds run back to
    back (1 ms a stage); once ``capacity`` launches are pending the host would block, so the gate times
    out and what follows runs at the host's launch rate (5 ms a stage)."""

    def __init__(self, capacity: int):
        self.capacity, self.clock, self.gate, self.held, self.count, self.passed = capacity, 0.0, 0, False, 0, {}

    def launch(self, n: int = 1) -> bool:
        for _ in range(n):
            if self.held:
                self.count += 1
                if self.count > self.capacity:
                    self.held, self.passed[self.gate] = False, True
        return self.held

    def synchronize(self):
        pass


def _fake_cupy(stream):
    from types import SimpleNamespace

    class Event:
        def record(self, _stream):
            stream.launch()
            self.t, self.gate = stream.clock, stream.gate

        @property
        def done(self):  # cupy.cuda.Event.done: whether the device has passed the event
            return stream.passed.get(self.gate, False)

        def synchronize(self):
            pass

    cuda = SimpleNamespace(Event=Event, get_current_stream=lambda: stream,
                           get_elapsed_time=lambda a, b: b.t - a.t)
    return SimpleNamespace(cuda=cuda)


class _Gate:
    def __init__(self, stream):
        self.stream = stream

    def close(self):
        s = self.stream
        s.gate, s.held, s.count = s.gate + 1, True, 0
        s.passed[s.gate] = False

    def open(self):
        self.stream.held = False


class _Model:
    def __init__(self, stream, stages: int, launches: int):
        self.stream, self.stages, self.launches = stream, stages, launches

    def run(self, inputs, cache, output, moe_plan, mark):
        for i in range(self.stages):
            queued = self.stream.launch(self.launches)
            self.stream.clock += 1.0 if queued else 5.0
            mark("attention" if i % 2 == 0 else "mlp", i // 2, None)


def test_queued_stage_times_stay_inside_the_launch_queue(monkeypatch):
    """A 40-layer step does not fit one gate's launch queue (the first GPU run: every stage after
    layer 33 timed at the host's rate). Stages go in windows, each behind its own gate, and a window
    whose gate times out is rerun smaller: every stage is then timed back to back."""
    import sys

    from ddtree_rtc.bench import decode

    stream = _Stream(capacity=40)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(stream))
    monkeypatch.setattr(decode, "flush_l2", lambda: None)
    model = _Model(stream, stages=30, launches=10)
    total, stages = decode.queued_stage_times(model, None, None, None, _Gate(stream), reps=2)
    assert [label for label, _ in stages] == [("attention" if i % 2 == 0 else "mlp", i // 2) for i in range(30)]
    assert [us for _, us in stages] == [1e3] * 30 and total == 30e3
    # one gate for the whole step (the old way) overflows and reads the host's rate
    stream = _Stream(capacity=40)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(stream))
    with pytest.raises(RuntimeError, match="one stage overflows"):
        decode.queued_stage_times(_Model(stream, stages=4, launches=50), None, None, None, _Gate(stream), reps=1)


def test_round_queued_stages_say_when_the_gate_did_not_hold(monkeypatch):
    """A round's verify is one stage, so it cannot be windowed: queued_stages says whether the gate
    held until the whole round was enqueued (False: the stage times are the host's)."""
    import sys

    from ddtree_rtc.bench import round as round_bench

    monkeypatch.setattr(round_bench, "flush_l2", lambda: None)
    for launches, held in ((5, True), (50, False)):
        stream = _Stream(capacity=40)
        monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(stream))

        def run(mark, stream=stream, launches=launches):
            for name in ("top-k", "verify", "commit"):
                stream.clock += 1.0 if stream.launch(launches) else 5.0
                mark(name)

        total, stages, ok = round_bench.queued_stages(run, _Gate(stream), reps=2)
        assert ok is held and list(stages) == ["top-k", "verify", "commit"]
        assert total == (3e3 if held else 3 * 5e3)


def test_weights_are_made_past_the_pool_and_the_pool_comes_back():
    """unpooled: CuPy's raw allocator while the weights are made, the pool again after, even when the
    make fails (an out-of-memory error must not leave the run without its pool)."""
    from types import SimpleNamespace

    calls = []
    cuda = SimpleNamespace(get_allocator=lambda: "pool", set_allocator=calls.append)
    be = SimpleNamespace(is_cuda=True, xp=SimpleNamespace(cuda=cuda))
    with pytest.raises(MemoryError), node.unpooled(be):
        calls.append("make")
        raise MemoryError
    assert calls == [None, "make", "pool"]


class _Device:
    """A fake GPU's memory as the caches outside CuPy keep it: graph allocation nodes (a cuBLAS GEMM
    captured on its default workspace pool) take memory from the graph memory pool, which keeps it
    reserved after their graph is destroyed until trimmed; cudaMallocAsync memory freed on a stream
    goes back to the default pool at the next synchronize and stays reserved there until trimmed."""

    TOTAL = 1 << 30

    def __init__(self):
        self.graph_used = self.graph_reserved = 0
        self.async_used = self.async_pending = self.async_reserved = 0

    def graph(self, nbytes: int):
        dev = self

        class Graph:  # held in a cycle, as a runner's graphs are: freed only by the collector
            def __init__(self):
                self.me = self
                dev.graph_used += nbytes
                dev.graph_reserved = max(dev.graph_reserved, dev.graph_used)

            def __del__(self):
                dev.graph_used -= nbytes

        Graph()

    def backend(self):
        from types import SimpleNamespace

        dev = self
        pool = SimpleNamespace(free_all_blocks=lambda: None, total_bytes=lambda: 0)

        def trim_async(handle, keep):
            dev.async_reserved = max(dev.async_used + dev.async_pending, keep)

        def synchronize():
            dev.async_pending = 0

        def graph_trim(cu_dev):
            dev.graph_reserved = dev.graph_used
            return (0,)

        rt = SimpleNamespace(
            deviceSynchronize=synchronize, cudaDevAttrMemoryPoolsSupported=115, cudaMemPoolAttrReservedMemCurrent=5,
            deviceGetAttribute=lambda attr, d: 1, deviceGetDefaultMemPool=lambda d: 77, memPoolTrimTo=trim_async,
            memPoolGetAttribute=lambda handle, attr: dev.async_reserved,
            memGetInfo=lambda: (dev.TOTAL - dev.graph_reserved - dev.async_reserved, dev.TOTAL))
        cuda = SimpleNamespace(runtime=rt, Device=lambda: SimpleNamespace(id=0))
        xp = SimpleNamespace(cuda=cuda, get_default_memory_pool=lambda: pool,
                             get_default_pinned_memory_pool=lambda: pool)
        driver = SimpleNamespace(
            CUresult=SimpleNamespace(CUDA_SUCCESS=0), cuDeviceGet=lambda d: (0, d), cuDeviceGraphMemTrim=graph_trim,
            CUgraphMem_attribute=SimpleNamespace(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT=2),
            cuDeviceGetGraphMemAttribute=lambda d, attr: (0, dev.graph_reserved))
        return SimpleNamespace(is_cuda=True, xp=xp), driver


def test_release_gives_back_what_graphs_and_async_frees_leave_in_the_device_pools(monkeypatch):
    """free_bytes (after each timed piece and each layout) gives back, besides CuPy's pools, what the
    CUDA graph memory pool and the default stream-ordered pool keep after their graphs / frees: a
    layout whose captured GEMMs took workspace from them (cuBLAS on its default pool) left that
    memory held after its release, a little more every layout. memory_phase records what each
    held before the release."""
    dev = _Device()
    be, driver = dev.backend()
    monkeypatch.setattr(node, "_driver", lambda: driver, raising=False)
    dev.graph(96 << 20)  # a captured piece's graphs, dropped (in a cycle) when the piece ends
    dev.async_reserved = dev.async_pending = 32 << 20  # freed by cudaMallocAsync's user, not yet synchronized
    assert node.free_bytes(be) == dev.TOTAL, f"{(dev.TOTAL - node.free_bytes(be)) >> 20} MiB kept after the release"
    dev.graph(64 << 20)
    row = node.memory_phase(be, "tp sm-on b1 ctx0k AR step")
    assert row == {"phase": "tp sm-on b1 ctx0k AR step", "free_bytes": dev.TOTAL,
                   "held_before_release": {"cupy_pool_bytes": 0, "graph_pool_bytes": 64 << 20, "async_pool_bytes": 0}}
    assert node.device_caches(be) == {"cupy_pool_bytes": 0, "graph_pool_bytes": 0, "async_pool_bytes": 0}


@pytest.mark.gpu
def test_layouts_on_the_gpu_give_their_memory_back():
    """The `small` preset as rank 0 of 2, both layouts one after the other on the GPU, every timer real:
    each layout's weights (made past CuPy's pool), caches and graphs go back before the next layout
    is planned, and no captured piece took memory from the CUDA graph memory pool (memory.phases,
    printed); every stage row is timed, and the step and the round also at the probe's depth."""
    from ddtree_rtc.bench.decode import Gate

    args = node.parse_args(["--world", "2", "--batches", "1,3", "--contexts", "64", "--budgets", "4", "--no-chain",
                            "--layers", "3", "--no-drafter", "--iters", "2", "--small-m", "on,off"])
    gate, be = Gate(), Backend("cuda")
    for layout in ("tp", "ep"):  # every kernel module either layout uses loaded (EP's MoE kernels are its own)
        node.run_layout(layout, args, gate, lambda msg: None, be=be, preset="small")
    start = node.free_bytes(be)
    layouts = [node.run_layout(layout, args, gate, lambda msg: None, be=be, preset="small")[1]
               for layout in ("tp", "ep")]
    story = "\n".join(_memory_story(lay) for lay in layouts)
    print(story)  # shown with -rP: the free bytes after each phase, and what the caches held before it
    for lay in layouts:
        mem = lay["memory"]
        assert mem["free_after_release_bytes"] >= mem["free_bytes"] - node.RELEASE_SLACK_BYTES, story
        # cuBLAS GEMMs captured on its default workspace pool took graph-pool memory (kernels/_cublas.py)
        graph_pool = [ph["phase"] for ph in mem["phases"] if ph["held_before_release"]["graph_pool_bytes"]]
        assert not graph_pool, f"graph allocation nodes in: {graph_pool}\n{story}"
        assert mem["free_after_weights_bytes"] < mem["free_bytes"]
        assert lay["layers"] == 3 and len(lay["cases"]) == 4
        for case in lay["cases"]:
            ar = case["ar"]
            assert sorted(map(int, ar["per_layer"])) == [0, 1, 2]
            assert all(s["us"] > 0 for v in ar["per_layer"].values() for s in v.values())
            assert ar["probe"]["layers"] == 1 and ar["probe"]["step_us"] > 0
            assert [r["probe"]["layers"] for r in case["rounds"]] == [1]
            assert case["auto"]["projection"][0]["auto"]["us_per_round"] > 0  # the auto row, simulated
    assert layouts[1]["memory"]["free_bytes"] >= start - node.RELEASE_SLACK_BYTES, story
    assert node.free_bytes(be) >= start - node.RELEASE_SLACK_BYTES, story


def _memory_story(lay: dict) -> str:
    """A layout's memory phases as lines: free MB after the phase's release (change from the layout's
    start), then what CuPy's pool, the graph memory pool and the async pool held before it."""
    phases = lay["memory"]["phases"]
    start = phases[0]["free_bytes"]
    lines = [f"{lay['layout']}: phase | free MB (vs start) | held before release MB: cupy pool / graph pool / async"]
    for ph in phases:
        held = ph["held_before_release"]
        lines.append(f"  {ph['phase']} | {ph['free_bytes'] / 1e6:.0f} ({(ph['free_bytes'] - start) / 1e6:+.0f}) | "
                     f"{held['cupy_pool_bytes'] / 1e6:.0f} / {held['graph_pool_bytes'] / 1e6:.0f} / "
                     f"{held['async_pool_bytes'] / 1e6:.0f}")
    return "\n".join(lines)


def _round_by_batch(model, batch, budget, args, gate, weight_bytes, tau_stats, chain=False):
    """A round whose costs depend on the batch and the nodes (the verify 100 µs + 10 µs per verify
    row), so two cases' cost models differ."""
    rows = batch * (1 + budget)
    summ = {"graph_us": 150.0 + 10.0 * rows, "queued_us": 190.0, "eager_us": 300.0, "verify_floor_us": 50.0,
            "stage_us": {"verify": 100.0 + 10.0 * rows}, "ar_step_us": 100.0, "experts_touched": {1: 5},
            "tau": tau_stats.tau}
    return [Row("draft", 1.0, extra={"stage": "draft"}), Row("round (CUDA graph)", summ["graph_us"], extra=summ)]


def _node_args(*extra):
    return node.parse_args(["--world", "4", "--rank", "1", "--batches", "1,3", "--contexts", "8", "--budgets", "4,16",
                            "--layers", "3", "--no-drafter", "--no-components", "--collective-us", "20,8",
                            "--iters", "1", "--auto-rounds", "120", *extra])


def test_the_auto_row_is_simulated_on_the_cases_own_costs(fake_gpu, monkeypatch):
    """bench node's auto row (bench/node_auto.py) on the numpy backend: per case and collective
    latency, auto and every measured setting simulated on a cost model made from that case's own
    projected figures. Each fixed setting's simulated round is its projected round and its exact
    tau the bench's oracle tau (so the model is the case's own: the fakes' rounds cost more with
    the batch, and another case's model would price them otherwise); auto's figures are consistent
    (tok/s = tokens over time, ratios of the tok/s, histograms summing to the rounds)."""
    from ddtree_rtc.bench import round as round_bench

    monkeypatch.setattr(round_bench, "bench_case", _round_by_batch)
    args = _node_args()
    assert node.parse_args([]).auto_rounds == 300 and args.auto_rounds == 120
    log = []
    _, lay = node.run_layout("tp", args, None, log.append, be=Backend("numpy"), preset="tiny")
    cases = lay["cases"]
    assert [c["batch"] for c in cases] == [1, 3]
    for c in cases:
        auto, b = c["auto"], c["batch"]
        assert auto["max_rows"] == 64 and auto["max_budget"] == 16 and auto["rounds"] == 120
        assert len(auto["projection"]) == len(c["projection"]) == 2
        for p, q in zip(c["projection"], auto["projection"]):
            assert q["collective_us"] == p["collective_us"]
            assert [s["setting"] for s in q["settings"]] == ["b4", "b16", "chain"]
            for s, r in zip(q["settings"], p["rounds"]):
                assert s["us_per_round"] == pytest.approx(r["round_total_us"], rel=1e-9)  # this case's costs
                assert s["tau"] == pytest.approx(r["tau_oracle"], rel=1e-5)
                assert s["tok_s_per_user"] == pytest.approx(r["tok_s_per_user_oracle"], rel=1e-5)
            a = q["auto"]
            assert a["tok_s_per_user"] == pytest.approx(1e6 * a["tau"] / a["us_per_round"], rel=1e-9)
            assert a["tokens_per_round"] == pytest.approx(b * a["tau"])
            by = {s["setting"]: s["tok_s_per_user"] for s in q["settings"]}
            assert q["auto_over_best"] == pytest.approx(a["tok_s_per_user"] / by[q["best"]]) and by[q["best"]] == max(
                by.values())
            assert q["auto_over_worst"] == pytest.approx(a["tok_s_per_user"] / by[q["worst"]]) and by[
                q["worst"]] == min(by.values())
            assert q["auto_over_chain"] == pytest.approx(a["tok_s_per_user"] / by["chain"])
            assert sum(a["rows_hist"].values()) == 120 and sum(a["nodes_hist"].values()) == 120 * b
            assert all(int(k) <= 64 for k in a["rows_hist"])  # the row cap of the invariant small-M path
            assert a["drafted_rounds"] + a["skipped_drafts"] == 120
            u = q["auto_uncapped"]  # the same rounds without the row cap
            assert u["auto_over_best"] == pytest.approx(u["tok_s_per_user"] / by[q["best"]])
            assert q["cost_model"]["fixed"] == [[b, pytest.approx(50e-6)]]  # graph - verify stage (s), this case's
    # the two cases' models differ (rounds cost more with the batch): the verify at the roots alone
    v1, v3 = (c["auto"]["projection"][0]["cost_model"]["verify"] for c in cases)
    assert v1[0][0] == 1 and v3[0][0] == 3 and v1 != v3
    assert any("auto (simulated on this case's costs" in m for m in log)


def test_the_auto_row_under_free_nodes_projects_at_least_the_best_fixed(fake_gpu):
    """Every round costs the same whatever its nodes (the fakes' verify does not grow with the
    budget, and the AR step costs as much as a round): auto takes its max_budget every round and
    projects at least the best fixed setting (exact figures, the same rounds); off the small-M path
    the row cap is gone."""
    from ddtree_rtc.bench import round as round_bench

    def flat_round(model, batch, budget, args, gate, weight_bytes, tau_stats, chain=False):
        summ = {"graph_us": 300.0, "queued_us": 190.0, "eager_us": 300.0, "verify_floor_us": 50.0,
                "stage_us": {"verify": 250.0}, "ar_step_us": 100.0, "experts_touched": {1: 5}, "tau": tau_stats.tau}
        return [Row("round (CUDA graph)", 300.0, extra=summ)]

    mp = pytest.MonkeyPatch()
    mp.setattr(round_bench, "bench_case", flat_round)
    mp.setattr(node, "graph_round_us", lambda model, b, budget, ctx, p, chain, iters: 300.0)
    mp.setattr(node, "graph_step_us", lambda model, b, ctx, iters: 100.0)
    # the AR step as dear as a round: every point of the table the same
    mp.setattr(node, "project_case", _flat_projection(node.project_case))
    try:
        args = _node_args("--small-m", "off", "--batches", "3")
        _, lay = node.run_layout("tp", args, None, lambda m: None, be=Backend("numpy"), preset="tiny")
    finally:
        mp.undo()
    (case,) = lay["cases"]
    auto = case["auto"]
    assert auto["max_rows"] is None and all("auto_uncapped" not in q for q in auto["projection"])
    for q in auto["projection"]:
        verify = {v for _, v in q["cost_model"]["verify"]}
        assert len(verify) == 1, q["cost_model"]  # nodes free
        assert q["auto"]["nodes_hist"] == {"16": 3 * 120}
        assert q["auto_over_best"] >= 1 - 1e-12 and q["auto_over_worst"] > 1


def _flat_projection(project):
    def flat(case, args, n_layers):
        out = project(case, args, n_layers)
        for p in out["projection"]:
            p["ar"]["per_token_us"] = p["rounds"][0]["round_total_us"]
        return out

    return flat
