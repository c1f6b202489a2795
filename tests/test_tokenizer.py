"""Text prompts through Kimi's tiktoken tokenizer (optional extra): the split pattern compiles in
tiktoken and text lines of a prompts file become ids. The model file here is a byte-level stand-in
(256 single-byte ranks plus a few merges) in tiktoken's own format; without tiktoken the pipeline
names the missing package."""

import base64
import json
import sys

import pytest

from ddtree_rtc.pipeline.runner import load_prompts
from ddtree_rtc.pipeline.schema import PipelineError, parse_pipeline

MERGES = [b"he", b"ll", b"hello", "中文".encode()]


def _pipeline(tmp_path, lines):
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    text = "model: {preset: tiny}\nworkload: {prompts: prompts.jsonl, concurrency: 1}\n"
    (tmp_path / "p.yaml").write_text(text)
    return parse_pipeline(text, file=str(tmp_path / "p.yaml"))


def _model_file(directory):
    ranks = [bytes([i]) for i in range(256)] + MERGES
    (directory / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))


def test_text_prompts_become_ids(tmp_path):
    pytest.importorskip("tiktoken")
    _model_file(tmp_path)
    pipe = _pipeline(tmp_path, [{"text": "hello world"}, {"ids": [5, 6]}, {"text": "中文 and 123,456!"}])
    prompts = load_prompts(pipe, 1000, tmp_path)
    assert prompts[1] == [5, 6]
    hello = 256 + MERGES.index(b"hello")
    assert prompts[0][0] == hello, "the merge of 'hello' applies inside one pre-token"
    for p, text in ((prompts[0], "hello world"), (prompts[2], "中文 and 123,456!")):
        ranks = [bytes([i]) for i in range(256)] + MERGES
        assert b"".join(ranks[t] for t in p) == text.encode(), "the ids decode back to the text"


def test_text_prompts_without_model_file(tmp_path):
    """A preset model takes text through the byte tokenizer ``serve`` uses; a checkpoint directory
    without Kimi's tokenizer file gets an error naming the file it needs."""
    pipe = _pipeline(tmp_path, [{"text": "hi"}])
    assert load_prompts(pipe, 1000, tmp_path) == [list(b"hi")]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    text = f"model: {{path: {ckpt}}}\nworkload: {{prompts: prompts.jsonl, concurrency: 1}}\n"
    pipe = parse_pipeline(text, file=str(tmp_path / "p.yaml"))
    with pytest.raises(PipelineError, match="tiktoken.model"):
        load_prompts(pipe, 1000, ckpt)


def test_text_prompts_without_tiktoken_name_the_package(tmp_path, monkeypatch):
    _model_file(tmp_path)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken now raises ImportError
    monkeypatch.setitem(sys.modules, "tiktoken.load", None)
    pipe = _pipeline(tmp_path, [{"text": "hi"}])
    with pytest.raises(PipelineError, match="pip install tiktoken"):
        load_prompts(pipe, 1000, tmp_path)
