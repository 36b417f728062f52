"""A config file's YAML, read into plain values with the line of every key.

``yaml.safe_load`` gives values without lines, lets a duplicate key silently win, and walks
nesting and aliases as deep as the text asks.  Here the nodes are composed by PyYAML's
``SafeLoader`` and walked by us: every key's line is noted under its dotted path
(``routes.summarize[0].model``), and a duplicate key, a tag other than a plain mapping or list,
nesting past ``MAX_DEPTH``, an alias bomb, NaN or infinity is a ``ConfigError`` naming the file
and the line, as is any YAML syntax error.  PyYAML itself is imported only when a file is read.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Final

from gpulock.core.errors import ConfigError

if TYPE_CHECKING:
    import yaml

__all__ = ["MAX_DEPTH", "load_mapping"]

# Aliases can make a small file expand into a huge tree ("billion laughs"); a config never needs
# anywhere near this many values.
_MAX_NODES: Final = 100_000
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"
_PLAIN_COLLECTION_TAGS: Final = frozenset({"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"})


def load_mapping(text: str, file: str) -> tuple[dict[Any, Any], dict[str, int]] | None:
    """The top-level mapping of ``text`` and the line of each of its keys, by dotted path; None
    when the document is empty (or holds only comments, or ``null``).

    ``file`` names the file in errors: a ConfigError with its line for anything that is not a
    mapping at the top, not valid YAML, or refused above.
    """
    import yaml

    try:
        loader = _loader_class()(text)
        loader.file = file  # type: ignore[attr-defined]
        try:
            root = loader.get_single_node()
            if root is None or root.tag == "tag:yaml.org,2002:null":
                return None
            if not isinstance(root, yaml.MappingNode):
                kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
                raise ConfigError(
                    f"the top level must be a mapping of keys to values, not {kind}",
                    file=file,
                    line=root.start_mark.line + 1,
                    hint="write one 'key: value' per line, e.g. 'default_gpu: 0'",
                )
            builder = _Builder(loader, file)
            document = builder.build(root, "")
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        raise _syntax_error(exc, file) from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        character = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(
            f"invalid YAML: {exc.reason} (character #x{character:04x})", file=file, line=line
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", file=file) from None
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply", file=file) from None
    return document, builder.lines


MAX_DEPTH: Final = 64  # levels of nesting; gpulock's deepest section needs 5


@functools.cache
def _loader_class() -> type[yaml.SafeLoader]:
    """A SafeLoader that refuses nesting past MAX_DEPTH, naming the line where it went past.

    PyYAML composes nodes recursively: thousands of ``[`` would otherwise end in a
    RecursionError that knows no line.
    """
    import yaml

    class Loader(yaml.SafeLoader):
        file = ""
        depth = 0

        def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                    raise ConfigError(
                        f"nested deeper than {MAX_DEPTH} levels (past the limit at column "
                        f"{mark.column + 1})",
                        file=self.file,
                        line=mark.line + 1,
                    )
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader


def _syntax_error(exc: yaml.MarkedYAMLError, file: str) -> ConfigError:
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "malformed"
    message = f"invalid YAML: {problem}"
    if exc.problem and exc.context:
        message += f" ({exc.context}"
        if exc.context_mark is not None and (mark is None or exc.context_mark.line != mark.line):
            message += f" that starts on line {exc.context_mark.line + 1}"
        message += ")"
    hint = None
    if "\\t" in message or "\t" in message:
        hint = "YAML indents with spaces, never tabs"
    elif "another document" in message:
        message = "invalid YAML: a second document starts here; a config file holds only one"
        hint = "remove this '---' line and what follows it, or merge the two"
    return ConfigError(
        message, file=file, line=mark.line + 1 if mark is not None else None, hint=hint
    )


class _Builder:
    """Turn composed nodes into plain Python values, noting every key's line on the way.

    Walking the nodes ourselves (rather than ``yaml.safe_load``) is what gives each value its
    line and catches duplicate keys, which PyYAML would silently resolve to the last one.
    """

    def __init__(self, loader: yaml.SafeLoader, file: str) -> None:
        self.loader = loader
        self.file = file
        self.lines: dict[str, int] = {}
        self._count = 0
        self._active: set[int] = set()

    def _error(self, node: yaml.Node, problem: str, key: str | None = None) -> ConfigError:
        return ConfigError(problem, file=self.file, line=node.start_mark.line + 1, key=key or None)

    def build(self, node: yaml.Node, path: str) -> Any:
        import yaml

        self._count += 1
        if self._count > _MAX_NODES:
            raise self._error(
                node, f"the document holds more than {_MAX_NODES} values once aliases are expanded"
            )
        if isinstance(node, yaml.ScalarNode):
            value = self.loader.construct_object(node)
            if isinstance(value, float) and not math.isfinite(value):
                # .nan and .inf are valid YAML, but no setting means them: NaN compares false
                # with everything (a threshold that never trips), inf never arrives.
                raise self._error(node, f"{node.value!r} is not a finite number", path or None)
            return value
        if node.tag not in _PLAIN_COLLECTION_TAGS:
            raise self._error(node, f"unsupported YAML tag {node.tag!r}", path)
        if id(node) in self._active:
            raise self._error(node, "an alias refers to a collection that contains it", path)
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                items = []
                for index, item in enumerate(node.value):
                    child = f"{path}[{index}]"
                    self.lines[child] = item.start_mark.line + 1
                    items.append(self.build(item, child))
                return items
            assert isinstance(node, yaml.MappingNode)
            return self._mapping(node, path)
        finally:
            self._active.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, path: str) -> dict[Any, Any]:
        import yaml

        result: dict[Any, Any] = {}
        first_line: dict[Any, int] = {}
        explicit: list[tuple[Any, str, yaml.Node]] = []
        merged: list[yaml.MappingNode] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merged.extend(self._merge_sources(value_node, path))
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise self._error(key_node, "a key must be a plain value, not a list or mapping")
            key = self.loader.construct_object(key_node)
            child = f"{path}.{key}" if path else str(key)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(
                    f"duplicate key (first set on line {first_line[key]})",
                    file=self.file,
                    line=line,
                    key=child,
                    hint="keep only one of them: YAML would silently use the last",
                )
            first_line[key] = line
            explicit.append((key, child, value_node))
        # '<<' merges: earlier sources win over later ones and explicit keys over all of them,
        # so build the sources last-first and let each overwrite.
        for source in reversed(merged):
            result.update(self._mapping(source, path))
        for key, child, value_node in explicit:
            if key in result:
                self._forget(child)  # lines noted for the merged value being overridden
            self.lines[child] = first_line[key]
            result[key] = self.build(value_node, child)
        return result

    def _merge_sources(self, value: yaml.Node, path: str) -> list[yaml.MappingNode]:
        import yaml

        if isinstance(value, yaml.MappingNode):
            return [value]
        if isinstance(value, yaml.SequenceNode) and all(
            isinstance(item, yaml.MappingNode) for item in value.value
        ):
            return list(value.value)
        raise self._error(value, "'<<' must merge a mapping or a list of mappings", path)

    def _forget(self, key: str) -> None:
        stale = [k for k in self.lines if k == key or k.startswith((f"{key}.", f"{key}["))]
        for k in stale:
            del self.lines[k]
