"""YAML reading that remembers where every key was written, so errors can name file, line and key."""

from __future__ import annotations

from dataclasses import dataclass

import yaml


class PipelineError(ValueError):
    pass


@dataclass(frozen=True)
class Where:
    file: str  # or "--set KEY" for a value given on the command line
    line: int  # 1-based; 0: not from a file

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


class LinedDict(dict):
    """A mapping that also knows the line of each key (``where(key)``) and of itself."""

    file: str = "<yaml>"
    line: int = 0
    key_lines: dict

    def where(self, key=None) -> Where:
        at = self.key_lines.get(key, self.line) if key is not None else self.line
        return at if isinstance(at, Where) else Where(self.file, at)


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node):
    loader.flatten_mapping(node)
    d = LinedDict()
    d.file, d.line, d.key_lines = loader.name, node.start_mark.line + 1, {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in d:
            raise PipelineError(f"{loader.name}:{key_node.start_mark.line + 1}: duplicate key {key!r}")
        d[key] = loader.construct_object(value_node, deep=True)
        d.key_lines[key] = key_node.start_mark.line + 1
    return d


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, file: str) -> LinedDict:
    loader = _Loader(text)
    loader.name = file
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark else file
        raise PipelineError(f"{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    finally:
        loader.dispose()
    if not isinstance(data, LinedDict):
        raise PipelineError(f"{file}: a pipeline must be a YAML mapping at the top level")
    return data
