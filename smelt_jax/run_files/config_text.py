"""The one parser of config text: a `smelt train --config` file (YAML or JSON) and a run's run.json.

Both formats follow the same rules, so a file means the same whatever its extension:

    a key given twice in one mapping     refused (JSON and YAML alike; neither keeps the last silently)
    YAML merge keys (`<<: *anchor`)      read as `yaml.safe_load` reads them (explicit keys win)
    nesting deeper than MAX_DEPTH        refused in one line (never a RecursionError)

Errors are `ConfigError` (one line, exit 2) naming the file.
"""

from __future__ import annotations

import json

from smelt_jax.design.config import ConfigError

MAX_DEPTH = 64  # mappings and lists inside each other; a run spec is at most a few levels deep


def _depth_error(path: str) -> ConfigError:
    return ConfigError(f"{path}: nested more than {MAX_DEPTH} levels deep; a run spec is a few levels "
                       "of mappings (model, schedule, ...)")


def check_depth(value: object, path: str) -> object:
    """`value` if its mappings and lists nest at most MAX_DEPTH levels, else ConfigError (iterative:
    no recursion on a deep value)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_DEPTH:
            raise _depth_error(path)
        stack.extend((child, depth + 1) for child in children)
    return value


def _no_twice(path: str):
    def pairs(items: list) -> dict:
        keys = [key for key, _ in items]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ConfigError(f"{path}: key {', '.join(twice)} given twice in one object")
        return dict(items)
    return pairs


def parse_json(text: str, path: str) -> object:
    """The JSON value of `text` (ConfigError naming `path`: not JSON, a key twice, too deep)."""
    try:
        value = json.loads(text, object_pairs_hook=_no_twice(path))
    except RecursionError:
        raise _depth_error(path) from None
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON ({' '.join(str(err).split())})") from None
    return check_depth(value, path)


def parse_yaml(text: str, path: str) -> object:
    """The YAML value of `text` as safe_load reads it (merge keys included), refusing a key given twice
    in one mapping and nesting deeper than MAX_DEPTH (ConfigError naming `path`)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        """safe_load, refusing a key given twice in one mapping (YAML would keep the last silently)."""

    def mapping(loader, node, deep=False):
        explicit = [key for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge"]
        keys = [loader.construct_object(key, deep=True) for key in explicit]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise ConfigError(f"{path}: key {', '.join(twice)} given twice (line {node.start_mark.line + 1})")
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)  # flattens `<<` merges

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        value = yaml.load(text, Loader=_Loader)  # noqa: S506 — a SafeLoader subclass
    except RecursionError:
        raise _depth_error(path) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())[:200]})") from None
    return check_depth(value, path)


def parse_config_text(text: str, path: str) -> object:
    """A config file's value: JSON for a `.json` name, else YAML (a superset of JSON)."""
    return parse_json(text, path) if str(path).endswith(".json") else parse_yaml(text, path)
