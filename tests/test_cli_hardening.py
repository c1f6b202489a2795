"""The command line against inputs that used to break or mislead it, each through ``ddtree-rtc`` in a
subprocess as a user runs it (numpy backend, tiny preset): a clear one-line error naming the file,
line, key or tensor, given before any work, and never a traceback. The commands of each test run
side by side to keep the suite fast."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_rtc.backend import cuda_available

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "pipelines" / "tiny.yaml")
NUMPY = ("--set", "runtime.backend=numpy")


def _cli() -> list[str]:
    exe = shutil.which("ddtree-rtc")
    return [exe] if exe else [sys.executable, "-m", "ddtree_rtc.cli"]


def ddtree(*commands: list[str], cwd=None) -> list[subprocess.CompletedProcess]:
    """Run each argument list as ``ddtree-rtc ...`` at the same time; their results in order."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen(_cli() + list(map(str, c)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=cwd) for c in commands]
    out = []
    for c, p in zip(commands, procs):
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"ddtree-rtc {' '.join(map(str, c))} did not end in 240 s") from None
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def _refused(res: subprocess.CompletedProcess, *words: str) -> str:
    """The run failed with one ``Error:`` line holding ``words``, and no traceback."""
    assert res.returncode != 0, (res.args, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, res.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A make-model output (tiny preset)."""
    from ddtree_rtc.model.config import preset_config
    from ddtree_rtc.model.make_model import make_model

    d = tmp_path_factory.mktemp("cli_tiny")
    make_model(preset_config("tiny"), d, seed=2)
    return d


def test_runs_that_work(tmp_path, model_dir):
    """Item 14: a make-model output runs with --set model.path=DIR alone (the path overrides the
    preset); a preset model takes {"text": ...} prompts through the byte tokenizer, as serve does;
    outside a terminal, progress lines (requests done, tok/s) are printed."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "hello"}\n\n{"ids": [5, 6, 7]}\n')
    # a relative prompts path given with --set is read from the current directory
    work = ("--set", "workload.synthetic=null", "--set", "workload.prompts=prompts.jsonl",
            "--set", "workload.max_new_tokens=3")
    by_path, by_text = ddtree(
        ["run", TINY, *NUMPY, "--set", f"model.path={model_dir}", "--set", "output.json=a.json"],
        ["run", TINY, *NUMPY, *work, "--set", "output.json=b.json"], cwd=tmp_path)
    for res in (by_path, by_text):
        assert res.returncode == 0, res.stderr
        assert "progress: " in res.stderr and " tok/s" in res.stderr, res.stderr
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["model"]["dir"] == str(model_dir) and a["metrics"]["requests"] == 6
    assert "progress: 6/6 requests" in by_path.stderr
    b = json.loads((tmp_path / "b.json").read_text())
    assert [r["prompt"] for r in b["requests"]] == [list(b"hello"), [5, 6, 7]]
    assert "progress: 2/2 requests" in by_text.stderr
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*probe*"))


def test_truncated_shard_names_the_file_and_tensor(tmp_path, model_dir):
    """Item 3: a truncated shard used to give `mmap length is greater than file size`."""
    d = tmp_path / "cut"
    shutil.copytree(model_dir, d)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size // 2)
    (res,) = ddtree(["run", TINY, *NUMPY, "--set", f"model.path={d}", "--set", "output.json=null"])
    err = _refused(res, shard.name, "truncated", "tensor 'model.layers.")
    assert "mmap" not in err


def test_output_path_is_checked_before_any_work(tmp_path):
    """Item 4: a directory, a path under a file, or an unwritable directory used to fail after the
    whole run, leaving a .tmp file behind."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    cases = [(tmp_path, "is a directory"), (blocker / "out.json", "a parent of it is a file")]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((locked / "out.json", "cannot write"))
    results = ddtree(*[["run", TINY, *NUMPY, "--set", f"output.json={p}"] for p, _ in cases])
    for (path, words), res in zip(cases, results):
        _refused(res, "output.json", str(path), words)
        assert "loading weights" not in res.stderr and "running workload" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "locked"]
    locked.chmod(0o700)


def test_prompt_files_are_checked_line_by_line(tmp_path, model_dir):
    """Item 5: bad JSONL lines used to give tracebacks, truncate floats silently, ignore unknown keys,
    or be reported as "request 0" of the YAML."""
    lines = {
        "strings.jsonl": ('{"ids": [1, 2]}\n{"ids": ["a"]}\n', ":2:", "list of integer token ids"),
        "number.jsonl": ('{"ids": 5}\n', ":1:", "list of integer token ids"),
        "floats.jsonl": ('{"ids": [1.7, 2.2]}\n', ":1:", "list of integer token ids"),
        "extra.jsonl": ('{"ids": [1], "max_tokens": 4}\n', ":1:", "got keys ['ids', 'max_tokens']"),
        "vocab.jsonl": ('{"ids": [1]}\n\n{"ids": [1, 99999]}\n', ":3:", "outside the model's vocabulary"),
        "long.jsonl": ('{"ids": [1]}\n{"ids": ' + json.dumps(list(range(3, 300))) + "}\n", ":2:",
                       "max context"),
        "text.jsonl": ('{"text": "hi"}\n', ":1:", "tiktoken.model not found"),
    }
    cmds = []
    for name, (text, _, _) in lines.items():
        (tmp_path / name).write_text(text)
        cmds.append(["run", TINY, *NUMPY, "--set", "workload.synthetic=null", "--set",
                     f"workload.prompts={tmp_path / name}", "--set", "output.json=null",
                     *(("--set", f"model.path={model_dir}") if name == "text.jsonl" else ())])
    for (name, (_, line, words)), res in zip(lines.items(), ddtree(*cmds)):
        err = _refused(res, f"{tmp_path / name}{line}", words)
        assert "request 0" not in err, err


def test_config_and_yaml_errors_point_at_the_key(tmp_path, model_dir):
    """Item 11: the line of the key at fault (not its mapping's), a --set named as such, and a
    config.json value of the wrong type named by its key."""
    yaml = tmp_path / "p.yaml"
    yaml.write_text("model:\n  preset: tiny\nruntime:\n  backend: numpy\ndecode:\n  mode: ddtree\n"
                    "  temperature: 0.0\n  budget: 9999\n  drafter: {kind: random}\n")
    bad_cfg = tmp_path / "badcfg"
    shutil.copytree(model_dir, bad_cfg)
    cfg = json.loads((bad_cfg / "config.json").read_text())
    (bad_cfg / "config.json").write_text(json.dumps(cfg | {"hidden_size": "abc"}))
    line, override, config, serve = ddtree(["run", yaml], ["run", TINY, *NUMPY, "--set", "decode.budget=-1"],
                                           ["run", TINY, *NUMPY, "--set", f"model.path={bad_cfg}"],
                                           ["serve", TINY, *NUMPY, "--set", f"model.path={bad_cfg}", "--port", "0"])
    _refused(line, f"{yaml}:8: decode: budget 9999")
    err = _refused(override, "--set decode.budget: decode: budget -1")
    assert ":0:" not in err
    for res in (config, serve):
        _refused(res, "config.json: hidden_size must be an integer, got 'abc'")


def test_make_model_out_refuses_a_non_empty_directory(tmp_path, model_dir):
    """Item 12: tiny over small used to mix the shards; now --out must be empty or new, or --force
    replaces it whole."""
    busy, forced = tmp_path / "busy", tmp_path / "forced"
    for d in (busy, forced):
        shutil.copytree(model_dir, d)
        (d / "model-00009-of-00009.safetensors").write_text("stale")
    refused, replaced, fresh = ddtree(["make-model", "--preset", "tiny", "--out", busy],
                                      ["make-model", "--preset", "tiny", "--out", forced, "--force", "--layers", "2"],
                                      ["make-model", "--preset", "dflash-tiny", "--out", tmp_path / "new" / "d"])
    _refused(refused, str(busy), "not empty", "--force")
    assert (busy / "model-00009-of-00009.safetensors").read_text() == "stale"
    assert replaced.returncode == 0, replaced.stderr
    assert "2 layers" in replaced.stdout and not (forced / "model-00009-of-00009.safetensors").exists()
    assert fresh.returncode == 0 and (tmp_path / "new" / "d" / "model.safetensors").exists(), fresh.stderr
    assert not [p.name for p in tmp_path.rglob(".*tmp*")], "a temporary directory was left behind"


@pytest.mark.skipif(cuda_available(), reason="checks the message a machine without a GPU gives")
def test_bench_without_a_gpu_says_so_in_one_line():
    """Item 13: bench ceiling / round used to print raw tracebacks without a GPU."""
    for res in ddtree(["bench", "ceiling"], ["bench", "round", "--batches", "1"]):
        _refused(res, "GPU", "--help")


def test_serve_with_the_oracle_warns_and_answers(tmp_path):
    """Item 10: `ddtree-rtc serve` with the oracle drafter says at start that it is a measuring tool;
    the server it starts answers on loopback and stops on SIGTERM."""
    import re
    import signal
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = _cli() + ["serve", TINY, *NUMPY, "--port", "0", "--set", "decode.mode=ddtree",
                    "--set", "decode.drafter.kind=oracle", "--set", "decode.budget=8"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    seen, url = [], None
    try:
        deadline = time.monotonic() + 120
        while url is None:
            line = p.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(seen)
            seen.append(line)
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            url = m and m.group(1)
        log = "".join(seen)
        assert "oracle is a measuring tool" in log and "256 most recent" in log, log
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
    finally:
        p.send_signal(signal.SIGTERM)
        rest = p.communicate(timeout=60)[0]
    # uvicorn shuts down, then raises the signal it caught again (its exit status says SIGTERM)
    assert p.returncode in (0, -signal.SIGTERM) and "Finished server process" in rest, rest


def test_the_oracle_keeps_only_its_most_recent_continuations(tiny_dir):
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.model.target import TargetModel
    from ddtree_rtc.pipeline.runner import greedy_continuation

    cont = greedy_continuation(TargetModel.load(tiny_dir, Backend("numpy")), 3, 16, max_cached=2)
    first = cont(0, [5, 6])
    cont(1, [7]), cont(2, [5, 6]), cont(3, [8])  # [5, 6] used again: [7] is the oldest, and goes
    assert list(cont.cached) == [(5, 6), (8,)]
    assert cont(4, [5, 6]) == first


def test_an_interrupted_make_model_leaves_nothing(tmp_path):
    """Item 12: make-model writes into a temporary directory renamed into place at the end; an
    interrupt (Ctrl-C) on the way removes it and leaves --out as it was."""
    from ddtree_rtc.cli import _made_whole

    with pytest.raises(KeyboardInterrupt), _made_whole(tmp_path / "new") as tmp:
        (tmp / "model-00001-of-00004.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt), _made_whole(tmp_path / "old") as tmp:
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "old"]
