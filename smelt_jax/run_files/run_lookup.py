"""Finding a run by id: the suites first, then the runs folder. The one lookup every command uses.

A run that no suite defines (a config file: `smelt train --config run.yaml`, or a suite run changed by
`--override`) is known by the spec its trainer saved, `<runs root>/<suite>/<run id>/run.json`
(`RunSpec.to_dict` plus `metadata` and `data`): `RunSpec.from_dict` of it must give the folder's id
again, so a spec that no longer describes its run under this code is refused (ConfigError), never
trained into another folder.

    find_run(id_or_prefix, root)   a suite run, else the one saved run whose id is or starts with it
    saved_runs(root)               every saved run that no suite defines (for `experiments list`)
    load_spec_file(path)           a RunSpec from a YAML or JSON file (one-line ConfigError otherwise)
    run_to_train(...)              what `smelt train` trains: an id or a config file, then overrides

On a gs:// runs root an exact id costs one object read; a prefix lists the objects of the run folders
it starts (`_saved_files`).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from smelt_jax.platform import storage
from smelt_jax.design import suites
from smelt_jax.design.config import ConfigError
from smelt_jax.design.descriptors import RunSpec
from smelt_jax.platform.errors import AmbiguousName, MissingInput, UnknownName, UsageError
from smelt_jax.run_files.path_names import check_run_id
from smelt_jax.run_files.rundir import runs_root
from smelt_jax.run_files.run_spec_file import read_run_spec
from smelt_jax.design.suites import NoSuites

def _saved_files(root, prefix: str = "") -> list:
    """run.json files of run folders `<root>/<suite>/<id>/` whose id starts with `prefix`. On gs:// an
    exact id costs one object check; a prefix with its suite (`smoke-xs-s8`) one listing of the objects
    of the run folders it starts; no prefix (or no suite in it) lists the whole runs root."""
    if storage.is_gcs(root):
        return _saved_urls(str(root), prefix)
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*/*/run.json")
                  if p.parent.name.startswith(prefix) and not p.parent.parent.name.startswith("."))


def _saved_urls(root: str, prefix: str) -> list[str]:
    base = storage.normalize(root).rstrip("/") + "/"
    if "-" in prefix:
        exact = f"{base}{prefix.split('-', 1)[0]}/{prefix}/run.json"
        if storage.exists(exact):
            return [exact]
        start = f"{base}{prefix.split('-', 1)[0]}/{prefix}"
    else:
        start = base
    found = []
    for url in storage.list_gcs_starting(start):
        parts = url[len(base):].split("/")
        if (len(parts) == 3 and parts[2] == "run.json" and parts[1].startswith(prefix)
                and not parts[0].startswith(".")):
            found.append(url)
    return found


def find_run(run_id: str, root=None) -> RunSpec:
    """The run with this id or unique id prefix: a suite's (`smelt_jax.design.suites`), else one saved under
    the runs root (`root`, default $SMELT_RUNS_DIR or ./runs). UnknownName names the nearest ids."""
    check_run_id(run_id)  # it becomes part of a path (a folder name, a gs:// object name)
    try:
        return suites.find_run(run_id)
    except AmbiguousName:
        raise
    except UnknownName as err:
        miss = err
    root = storage.as_path(root) if root is not None else runs_root()
    files = _saved_files(root, run_id)
    exact = [f for f in files if Path(str(f)).parent.name == run_id]
    if exact or len(files) == 1:
        chosen = (exact or files)[0]
        return read_run_spec(chosen, Path(str(chosen)).parent.name)
    if files:
        shown = ", ".join(Path(str(f)).parent.name for f in files[:6]) + (", ..." if len(files) > 6 else "")
        raise AmbiguousName(f"{run_id!r} is the start of {len(files)} saved run ids under {root} ({shown}); "
                            "give more of it")
    saved = [Path(str(f)).parent.name for f in _saved_files(root)]
    near = difflib.get_close_matches(run_id, saved, n=3, cutoff=0.5)
    hint = f"; saved runs nearest: {', '.join(near)}" if near else ""
    raise UnknownName(f"{miss}; nor is it saved under {root}{hint}") from None


def saved_runs(root=None) -> tuple[list[RunSpec], list[str]]:
    """(the runs saved under a runs root, local or gs://, that no suite defines, one line per run.json
    that does not describe a run or cannot be read: `skipped PATH: why`), sorted by id. Each run.json is
    read through `readers.read_run_item`, so one bad file never stops the others."""
    from smelt_jax.run_files.readers import Skipped, read_run_item
    root = storage.as_path(root) if root is not None else runs_root()
    runs, problems = [], []
    for path in _saved_files(root):
        record = read_run_item(path, Path(str(path)).parent.name)
        if record is None:  # removed meanwhile
            continue
        if isinstance(record, Skipped):
            problems.append(record.line())
            continue
        run = RunSpec.from_dict(record)
        try:
            suites.find_run(run.id)
        except UnknownName:
            runs.append(run)
    return sorted(runs, key=lambda r: r.id), problems


ORIGINS = ("grid", "override", "config")


def run_origin(run: RunSpec) -> str:
    """Where `run` came from (ORIGINS): "grid" when its suite defines exactly this run, "override" when
    its suite defines a run at its coordinates (scale, sparsity, arch, variant) with other content (a
    suite run changed by --override), else "config" (a config file's run, or an unknown suite)."""
    try:
        grid = suites.load_suite(run.suite)
    except (UnknownName, NoSuites):
        return "config"
    if any(r.id == run.id for r in grid):
        return "grid"
    coordinates = (run.scale, run.sparsity_label, run.arch, run.variant)
    same = any((r.scale, r.sparsity_label, r.arch, r.variant) == coordinates for r in grid)
    return "override" if same else "config"


def grid_ids(suite: str) -> set[str]:
    """The ids of the suite's own runs (empty for a suite no source defines: a config file's)."""
    try:
        return {r.id for r in suites.load_suite(suite)}
    except (UnknownName, NoSuites):
        return set()


def _parse_spec_text(text: str, path: str) -> object:
    """A config file's value (`config_text`: one set of rules for JSON and YAML)."""
    from smelt_jax.run_files.config_text import parse_config_text
    return parse_config_text(text, path)


def load_spec_file(path) -> RunSpec:
    """The RunSpec of a YAML or JSON file (the fields of `RunSpec.from_dict`); ConfigError naming the
    file and the field, MissingInput when there is no such file."""
    path = str(path)
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        raise MissingInput(f"no config file {path}") from None
    except (UnicodeDecodeError, IsADirectoryError) as err:
        raise ConfigError(f"{path}: not a text file ({err})") from None
    data = _parse_spec_text(text, path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a run spec is a mapping of fields (model, schedule, ...), got "
                          f"{type(data).__name__ if data is not None else 'an empty file'}")
    try:
        return RunSpec.from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def run_to_train(run_id: str | None, config: str | None, overrides: list[str], root=None) -> RunSpec:
    """What `smelt train` trains: the run `run_id` names (find_run) or the one `config` describes, with
    `overrides` (`smelt_jax.run_files.overrides`) applied; exactly one of run_id and config."""
    from smelt_jax.run_files.overrides import apply_overrides
    if (run_id is None) == (config is None):
        raise UsageError("give a run id or --config FILE, not both" if run_id else
                         "give a run id (smelt experiments list) or --config FILE")
    run = find_run(run_id, root) if run_id is not None else load_spec_file(config)
    return apply_overrides(run, overrides or [])
