"""Text in and out: the model's tokenizer and chat template.

A model directory with Kimi's ``tiktoken.model`` gets text through it; its chat template comes from
``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` (rendered with jinja2).
Preset (random) models have neither, so they get a documented minimal pair instead:
:class:`ByteTokenizer` (model.tokenizer: a token id below 256 is that UTF-8 byte) and :data:`MINIMAL_CHAT_TEMPLATE`.
Any other directory without them takes token ids only and says so on text or chat input.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.sandbox

from ..model.tokenizer import ByteTokenizer, kimi_tokenizer

MINIMAL_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class TextError(ValueError):
    pass


class Text:
    def __init__(self, directory: Path, preset: bool):
        self.tokenizer = None
        self.template_source = None
        if (directory / "tiktoken.model").exists():
            self.tokenizer = kimi_tokenizer(directory)
        elif preset:
            self.tokenizer = ByteTokenizer()
        if (directory / "chat_template.jinja").exists():
            self.template_source = (directory / "chat_template.jinja").read_text()
        elif (directory / "tokenizer_config.json").exists():
            self.template_source = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
        if self.template_source is None and preset:
            self.template_source = MINIMAL_CHAT_TEMPLATE
        self._template = (None if self.template_source is None else
                          jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(self.template_source))
        self.directory = directory

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise TextError(f"the model has no tokenizer ({self.directory / 'tiktoken.model'} not found): "
                            f"send the prompt as token ids")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def chat(self, messages: list[dict]) -> list[int]:
        if self._template is None:
            raise TextError(f"the model has no chat template (no chat_template.jinja or tokenizer_config.json "
                            f"chat_template in {self.directory})")
        return self.encode(self._template.render(messages=messages, add_generation_prompt=True))
