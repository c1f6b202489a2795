from pathlib import Path

import pytest

from ddtree_rtc.pipeline.schema import PipelineError, load_pipeline, parse_pipeline, parse_set_options

GOOD = """\
model:
  preset: tiny
runtime:
  backend: numpy
  max_batch: 4
decode:
  mode: autoregressive
  temperature: 0
workload:
  synthetic: {count: 3, prompt_len: 5, output_len: 4}
  concurrency: 2
output:
  json: out.json
"""


def test_good_pipeline_parses():
    p = parse_pipeline(GOOD, "good.yaml")
    assert p.model.preset == "tiny" and p.runtime.backend == "numpy" and p.decode.temperature == 0.0
    assert p.workload.synthetic.count == 3
    with pytest.raises(AttributeError):
        p.model.preset = "x"  # frozen


@pytest.mark.parametrize("text,msg", [
    (GOOD.replace("  max_batch: 4", "  max_batch: 4\n  max_bach: 3"),
     r"bad.yaml:6: unknown key 'runtime.max_bach'"),
    (GOOD.replace("backend: numpy", "backend: tpu"), r"bad.yaml:4: key 'runtime.backend': must be one"),
    (GOOD.replace("max_batch: 4", "max_batch: four"), r"bad.yaml:5: key 'runtime.max_batch': expected"),
    (GOOD.replace("workload:", "stages:\n  - {name: norm, kernel: rmsnorm}\nworkload:"),
     r"bad.yaml:9: key 'stages' was removed: .*delete it"),
    (GOOD.replace("concurrency: 2", "concurrency: 0"), r"concurrency must be >= 1"),
    (GOOD.replace("model:\n  preset: tiny\n", "model:\n  seed: 1\n"), r"bad.yaml:2: model: give 'preset'"),
    # an invariant's error points at the line of the key it names, not at its mapping's first line
    (GOOD.replace("temperature: 0", "temperature: 0\n  top_p: 2"), r"bad.yaml:9: decode: top_p must be in"),
    (GOOD.replace("concurrency: 2", "concurrency: 0"), r"bad.yaml:11: workload: concurrency must be >= 1"),
    ("model: [1, 2", r"bad.yaml:\d+: malformed YAML"),
    ("- 1\n- 2\n", "top level"),
    (GOOD + "extra: 1\n", r"bad.yaml:14: unknown key 'extra'"),
    (GOOD.replace("runtime:\n", "runtime:\n  arch: sm_80\n"), r"unsupported arch 'sm_80'"),
    (GOOD.replace("temperature: 0", "temperature: 0\n  auto_rows: any"), r"auto_rows is read only with budget 'auto'"),
    (GOOD.replace("temperature: 0", "temperature: 0\n  auto_rows: all"), r"key 'decode.auto_rows': must be one"),
])
def test_bad_pipelines_name_file_line_key(text, msg):
    with pytest.raises(PipelineError, match=msg):
        parse_pipeline(text, "bad.yaml")


def test_set_overrides():
    over = parse_set_options(("decode.budget=32", "runtime.cuda_graphs=false", "model.layers=2"))
    p = parse_pipeline(GOOD, "good.yaml", over)
    assert p.decode.budget == 32 and p.runtime.cuda_graphs is False and p.model.layers == 2
    with pytest.raises(PipelineError, match="expected key=value"):
        parse_set_options(("nonsense",))
    with pytest.raises(PipelineError, match="unknown key 'decode.budgett'"):
        parse_pipeline(GOOD, "good.yaml", parse_set_options(("decode.budgett=3",)))
    # a bad --set value is reported as the --set it came from, not as a line of the file
    with pytest.raises(PipelineError, match=r"^--set decode.temperature: decode: temperature must be >= 0"):
        parse_pipeline(GOOD, "good.yaml", parse_set_options(("decode.temperature=-1",)))
    with pytest.raises(PipelineError, match=r"^--set foo.bar: unknown key 'foo'"):
        parse_pipeline(GOOD, "good.yaml", parse_set_options(("foo.bar=1",)))
    # a checkpoint path overrides a preset: a preset pipeline runs a make-model output with one --set
    p = parse_pipeline(GOOD, "good.yaml", parse_set_options(("model.path=/some/dir",)))
    assert p.model.path == "/some/dir"


def test_decode_section():
    dd = GOOD.replace("  mode: autoregressive\n  temperature: 0\n", "  mode: ddtree\n  temperature: 0.7\n  budget: 32\n"
                      "  drafter: {kind: oracle, acceptance: {p: 0.77}}\n")
    p = parse_pipeline(dd, "dd.yaml")
    assert (p.decode.mode, p.decode.budget, p.decode.temperature) == ("ddtree", 32, 0.7)
    assert p.decode.drafter.kind == "oracle" and p.decode.drafter.acceptance.p == 0.77
    for text, msg in ((dd.replace("  drafter: {kind: oracle, acceptance: {p: 0.77}}\n", ""), "needs a drafter"),
                      (dd.replace("budget: 32", "budget: 600"), "budget 600 is outside 0..512"),
                      (dd.replace("kind: oracle", "kind: oracle, depth: 17"), "depth 17 is outside 1..16"),
                      (dd.replace("{p: 0.77}", "{p: 1.5}"), r"probabilities must be in \[0, 1\]"),
                      (dd.replace("kind: oracle", "kind: dflash"), "needs 'path'"),
                      (dd.replace("kind: oracle", "kindd: oracle"), "unknown key 'decode.drafter.kindd'")):
        with pytest.raises(PipelineError, match=msg):
            parse_pipeline(text, "bad.yaml")


def test_decode_budget_auto():
    dd = GOOD.replace("  mode: autoregressive\n  temperature: 0\n", "  mode: ddtree\n  budget: auto\n  max_budget: 32\n"
                      "  drafter: {kind: oracle}\n")
    p = parse_pipeline(dd, "auto.yaml")
    assert (p.decode.budget, p.decode.max_budget, p.decode.cost_table) == ("auto", 32, None)
    for text, msg in ((dd.replace("max_budget: 32", "max_budget: 0"), "max_budget 0 is outside 1..512"),
                      (dd.replace("max_budget: 32", "max_budget: 513"), "max_budget 513 is outside 1..512"),
                      (dd.replace("mode: ddtree", "mode: chain"), "budget 'auto' needs mode 'ddtree'"),
                      (dd.replace("budget: auto", "budget: autoo"), "key 'decode.budget'.*'autoo'"),
                      (dd.replace("budget: auto", "budget: 8\n  cost_table: c.json"), "cost_table is read only")):
        with pytest.raises(PipelineError, match=msg):
            parse_pipeline(text, "bad.yaml")


@pytest.mark.parametrize("path", sorted(str(p) for p in Path("pipelines").glob("*.yaml")))
def test_shipped_pipelines_parse(path):
    p = load_pipeline(path)
    assert p.model is not None and p.workload is not None


def test_k2_6_ddtree_pipeline_taus():
    """pipelines/k2_6_slice_ddtree_h200.yaml's comment: acceptance p 0.42 / 0.77 / 0.93 give tau ~ 3 / 5 / 7
    at its budget (OracleDrafter.expected_tau at K2.6's vocabulary), and concurrency 1 / 10 and the
    autoregressive mode are one --set away."""
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.speculative.drafters import OracleDrafter

    path = "pipelines/k2_6_slice_ddtree_h200.yaml"
    p = load_pipeline(path)
    d = p.decode
    assert d.mode == "ddtree" and d.drafter.kind == "oracle" and d.drafter.acceptance.p == 0.77
    assert p.workload.concurrency == 10 and p.workload.synthetic.count >= 10
    for over in ({"workload.concurrency": 1}, {"decode.mode": "autoregressive"}):
        load_pipeline(path, over)
    be = Backend("numpy", quiet=True)
    for acc, tau in ((0.42, 3), (0.77, 5), (0.93, 7)):
        drafter = OracleDrafter(be, 163840, d.drafter.depth, None, accept_p=acc, seed=d.drafter.seed)
        assert abs(drafter.expected_tau(d.budget) - tau) < 0.1, (acc, drafter.expected_tau(d.budget))


def test_run_compiles_every_engine_kernel_but_not_the_benchmark_ones(monkeypatch):
    """`ddtree-rtc run` builds the families an engine may launch before its loop; bench_ceiling
    (benchmark-only) is left to `kernels build` and the benchmarks."""
    from types import SimpleNamespace

    from ddtree_rtc.kernels.registry import BENCHMARK_ONLY, SPECS
    from ddtree_rtc.pipeline.runner import compile_kernels
    from ddtree_rtc.rtc import builder

    built = []
    monkeypatch.setattr(builder, "load", lambda spec, arch, **params: built.append((spec.name, arch, params)))
    compile_kernels(SimpleNamespace(is_cuda=True, arch="sm_90a"))
    assert "bench_ceiling" in BENCHMARK_ONLY
    assert sorted(n for n, _, p in built) == sorted(set(SPECS) - BENCHMARK_ONLY)
    assert all(not p for _, _, p in built)


def test_every_pipeline_in_the_repository_parses():
    """The shipped pipelines (none carries the removed stages: list)."""
    for path in sorted(Path("pipelines").glob("*.yaml")):
        load_pipeline(path)


def test_model_head():
    p = parse_pipeline(GOOD.replace("  preset: tiny\n", "  preset: tiny\n  head: decisive\n"), "h.yaml")
    assert p.model.head == "decisive"
    assert load_pipeline("pipelines/k2_6_slice_ddtree_h200.yaml").model.head == "decisive"
    for text, msg in ((GOOD.replace("  preset: tiny\n", "  preset: tiny\n  head: peaked\n"), "head"),
                      (GOOD.replace("  preset: tiny\n", "  path: /x\n  head: decisive\n"), "not to a checkpoint")):
        with pytest.raises(PipelineError, match=msg):
            parse_pipeline(text, "bad.yaml")
