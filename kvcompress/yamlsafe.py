"""Bounded, safe YAML for stack files.

PyYAML's safe loader never builds Python objects; on top of it this module bounds what a small
hostile file can cost, the way libraries that load untrusted YAML do (go-yaml's alias-expansion
limit, a nesting limit instead of a ``RecursionError``):

* files: regular files of at most :data:`MAX_BYTES`, UTF-8 text (a UTF-16/32 byte-order mark, a NUL
  byte or invalid UTF-8 is refused in one line);
* structure: at most :data:`MAX_DEPTH` nested collections and :data:`MAX_NODES` nodes *once aliases
  are expanded* ("billion laughs": nine nested aliases in 400 bytes are 10^9 nodes), checked on the
  parser's event stream (iterative, stops at the first excess) before any node is built;
* mappings: duplicate keys and keys that are lists or mappings are refused; merge keys (``<<``) work,
  explicit keys overriding merged ones.

Every problem is a :class:`~kvcompress.errors.ConfigError` whose path is the file.
"""

from __future__ import annotations

import codecs
from typing import Any

import yaml

from .errors import ConfigError, Phrase, bounded
from .files import read_bounded

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 10_000

_MERGE_TAG = "tag:yaml.org,2002:merge"
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"))


class SafeLoader(yaml.SafeLoader):
    """Safe YAML loader that rejects duplicate and unhashable keys (merge keys are supported)."""


def _construct_mapping(loader: SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a plain value, found a {type(key).__name__} key",
                key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {bounded(key, 80)}",
                                                    key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)  # SafeConstructor: flattens merge keys first


SafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_EventLoader = getattr(yaml, "CSafeLoader", SafeLoader)  # events only: libyaml's parser is 20x faster


def _line(event: Any) -> str:
    mark = getattr(event, "start_mark", None)
    return f" (line {mark.line + 1})" if mark is not None else ""


def check_structure(text: str, source: str) -> None:
    """Refuse YAML nested deeper than :data:`MAX_DEPTH` or with more than :data:`MAX_NODES` nodes once
    aliases are expanded; reads parser events only (libyaml's parser when installed: no node is built, no
    recursion, and it stops at the first excess)."""
    loader = _EventLoader(text)
    aliases = False
    frames: list[list[Any]] = [[None, 0]]  # [anchor, expanded node count] per open collection
    anchors: dict[str, int] = {}
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                if len(frames) > MAX_DEPTH:
                    raise ConfigError(source, f"YAML nested at most {MAX_DEPTH} levels deep",
                                      Phrase(f"deeper nesting{_line(event)}"))
                frames.append([event.anchor, 1])
                continue
            if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                anchor, size = frames.pop()
                if anchor is not None:
                    anchors[anchor] = size
            elif isinstance(event, yaml.ScalarEvent):
                size = 1
                if event.anchor is not None:
                    anchors[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                size, aliases = anchors.get(event.anchor, 1), True
            else:
                continue
            frames[-1][1] += size
            if frames[-1][1] > MAX_NODES:
                raise ConfigError(source, f"YAML of at most {MAX_NODES:,} nodes once aliases are expanded",
                                  Phrase(f"more{_line(event)}"),
                                  hint="nested aliases (a 'billion laughs' file) are refused" if aliases else
                                  "a stack file holds a few dozen values")
    except yaml.YAMLError as exc:
        raise _invalid(source, exc) from None
    finally:
        loader.dispose()


def read_yaml(text: str, source: str) -> Any:
    """Parse YAML text with the bounded safe loader."""
    check_structure(text, source)
    try:
        return yaml.load(text, Loader=SafeLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        raise _invalid(source, exc) from None


def _invalid(source: str, exc: yaml.YAMLError) -> ConfigError:
    """``valid YAML, got <the parser's problem> (line L, column C)``, without the source excerpt."""
    problem = getattr(exc, "problem", None) or str(exc)
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow
        problem, where = f"unacceptable character #x{exc.character:04x}: {exc.reason}", f" (character {exc.position})"
    context = getattr(exc, "context", None)
    return ConfigError(source, "valid YAML", Phrase(f"{problem}{where}"), hint=context)


def decode_text(data: bytes, source: str) -> str:
    """UTF-8 text of ``data`` (a UTF-8 byte-order mark is dropped); anything else is refused."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise ConfigError(source, "UTF-8 text", Phrase(f"{name} text (byte-order mark)"),
                              hint=f"convert it, e.g. iconv -f {name} -t UTF-8")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(source, "UTF-8 text", Phrase(f"binary data (a NUL byte at offset {nul})"))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, "UTF-8 text", Phrase(f"invalid UTF-8 at byte {exc.start}")) from None


def load_file(path: str) -> Any:
    """The parsed content of a YAML stack file, every limit above applied."""
    return read_yaml(decode_text(read_bounded(path, "YAML stack file", MAX_BYTES), path), path)
