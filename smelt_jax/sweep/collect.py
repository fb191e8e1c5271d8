"""Gather endpoint rows from run folders into the results store.

Each finished branch writes `branch<k>/endpoint.json` (its results row) and then appends that row to
the suite's store; a process killed between the two leaves an endpoint without its row. Collecting
appends every such row, so no endpoint is lost and none is trained twice. Appends replace rows of the
same (run_id, branch), so collecting twice changes nothing.

Run folders may be local or on a bucket (gs://, read directly through `smelt_jax.platform.storage`, i.e.
tensorstore: no gcsfs needed); the rows go to the results store of each suite under `store_root`
(default: the runs root, which may itself be the bucket). Collecting from a bucket lists every object
under the suite's prefix (checkpoint files included) and reads the `endpoint.json` ones.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from smelt_jax.run_files.rundir import results_dir, runs_root
from smelt_jax.platform.storage import is_gcs, naming
from smelt_jax.sweep.graph import stored_endpoint_keys
from smelt_jax.platform.errors import MissingInput, UsageError

ENDPOINT_GLOB = "*/branch*/endpoint.json"  # <suite>/<run id>/branch<k>/endpoint.json


@dataclasses.dataclass(frozen=True)
class CollectReport:
    suite: str
    endpoints: int   # endpoint.json files found
    appended: int    # rows that were missing from the store
    problems: tuple[str, ...] = ()  # one line per endpoint file that could not be collected
    set_aside: str = ""  # where a damaged results.parquet went before the table was rebuilt


def _read_row(text: str, where) -> dict:
    """An endpoint.json's row; a damaged file is named (delete it and retrain that branch, or fix it)."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: damaged endpoint file ({err}); fix or delete it and retrain that "
                         "branch") from None
    if not isinstance(row, dict):
        raise UsageError(f"{where}: an endpoint file holds one JSON object, got {type(row).__name__}")
    return row


def endpoint_result(row: dict, where="endpoint row"):
    """The `EndpointResult` an endpoint.json row describes (loss_<source> keys -> losses_by_source);
    a row with missing or bad fields is a UsageError naming `where` (the file)."""
    from smelt_jax.run_files.results import FIXED_COLUMNS, LOSS_PREFIX, EndpointResult
    optional = {f.name for f in dataclasses.fields(EndpointResult)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    missing = [c for c in FIXED_COLUMNS if c not in row and c not in optional]
    if missing:
        raise UsageError(f"{where}: endpoint file lacks {', '.join(missing)}; fix or delete it and retrain "
                         "that branch")
    fields = {k: v for k, v in row.items() if k in FIXED_COLUMNS}
    losses = {k[len(LOSS_PREFIX):]: v for k, v in row.items() if k.startswith(LOSS_PREFIX)}
    try:
        return EndpointResult(**fields, losses_by_source=losses)
    except (UsageError, TypeError) as err:
        raise UsageError(f"{where}: {err}; fix or delete it and retrain that branch") from None


def _endpoint(path):
    """One endpoint file read through `readers.read_item`: its EndpointResult, or a Skipped naming it
    (not UTF-8, a folder, damaged JSON, a bad row)."""
    from smelt_jax.run_files.readers import read_item
    where = str(path)
    return read_item(where, lambda text: endpoint_result(_read_row(text, where), where))


def _append_missing(suite: str, paths: list, store_root: Path) -> CollectReport:
    """Append the rows missing from the store; then rewrite the CSV from the parquet table, so a
    truncated or stale results.csv is repaired even when nothing was missing. `paths`: the endpoint
    files (local or gs://), each read through `_endpoint`. A damaged results.parquet is set aside and
    rebuilt from every endpoint file; a file that cannot be read, does not parse or holds a bad row is
    reported (one line naming it) and the rest collected."""
    from smelt_jax.run_files.readers import Skipped
    from smelt_jax.run_files.results import append_result, rewrite_csv, set_aside_damaged
    folder = results_dir(suite, store_root)
    aside = set_aside_damaged(folder)
    stored = stored_endpoint_keys(suite, store_root)
    appended, problems = 0, []
    for path in paths:
        try:
            result = _endpoint(path)
        except FileNotFoundError:  # removed while collecting
            continue
        if isinstance(result, Skipped):
            problems.append(f"{result.path}: {result.reason}")
            continue
        if (result.run_id, result.branch) not in stored:
            append_result(result, folder)
            appended += 1
    if not appended:
        rewrite_csv(folder)
    return CollectReport(suite, len(paths), appended, tuple(problems), str(aside or ""))


def collect_suite(suite: str, root: Path | None = None) -> CollectReport:
    """Appends the missing endpoint rows of one suite under a local runs root."""
    root = Path(root) if root is not None else runs_root()
    return _append_missing(suite, sorted((root / suite).glob(ENDPOINT_GLOB)), root)


def collect_run(run_id: str, root: Path | None = None) -> CollectReport:
    """Appends the missing endpoint rows of one run (an id or unique prefix: `run_lookup.find_run`,
    the suites then the runs root) to its suite's store under a local runs root."""
    from smelt_jax.run_files.run_lookup import find_run
    root = Path(root) if root is not None else runs_root()
    run = find_run(run_id, root)
    return _append_missing(run.suite, sorted((root / run.suite / run.id).glob("branch*/endpoint.json")), root)


def _bucket_endpoints(root: str, suite: str | None = None) -> list[str]:
    """URLs of the endpoint.json files under `root` (one suite, or all of them)."""
    import fnmatch

    from smelt_jax.platform import storage as gcs
    base = root.rstrip("/") + "/"
    prefix = base + suite if suite else root.rstrip("/")
    pattern = ENDPOINT_GLOB if suite else "*/" + ENDPOINT_GLOB
    found = []
    for url in gcs.list_files(prefix):
        relative = url[len(prefix) + 1:] if suite else url[len(base):]
        if fnmatch.fnmatchcase(relative, pattern) and relative.count("/") == pattern.count("/"):
            found.append(url)
    return sorted(found)


def collect(root: str | Path | None = None, suites: list[str] | None = None,
            store_root: Path | None = None, run_id: str | None = None,
            skipped: list | None = None) -> list[CollectReport]:
    """Collects every suite under `root` (or the named ones, or the one run `run_id` names: local roots
    only). A gs:// root's rows go to the local store under `store_root` (default: the local runs
    root). Folders of a local runs root that cannot be suites (`lost+found`, `smoke-old`) are left
    alone and appended to `skipped` (`readers.Skipped`, one line each) when a list is given."""
    root_text = str(root) if root is not None else str(runs_root())
    if run_id is not None:
        if "://" in root_text:
            raise UsageError("--run collects from a local runs root; use --suite for gs:// roots")
        return [collect_run(run_id, Path(root_text))]
    if is_gcs(root_text):
        if not suites:
            base = root_text.rstrip("/") + "/"
            suites = sorted({url[len(base):].split("/", 1)[0] for url in _bucket_endpoints(root_text)})
        from smelt_jax.platform.storage import as_path
        store = as_path(store_root) if store_root is not None else runs_root()
        return [_append_missing(suite, _bucket_endpoints(root_text, suite), store) for suite in suites]
    if "://" in root_text:
        raise UsageError(f"unsupported runs root {root_text!r}: a local path or gs://")
    local = Path(root_text)
    if not local.is_dir():
        raise MissingInput(f"runs root {local} does not exist")
    if not suites:
        from smelt_jax.run_files.readers import suite_folders
        suites, foreign = suite_folders(local)
        if skipped is not None:
            skipped.extend(foreign)
    return [collect_suite(name, local) for name in suites]


def export(suite: str, out_path: str | Path, root: Path | None = None,
           include_custom: bool = False) -> tuple[int, int]:
    """Writes the suite's results store (`<runs root>/<suite>`, local) as a suite fit folder keeps it
    (`fits/<suite>/results.csv`: scaling.endpoints.export_table): the suite's own grid runs only, unless
    `include_custom` (then every row, with an `origin` column: grid, override, config). Returns (endpoint
    rows written, off-grid rows left out)."""
    from smelt_jax.run_files.results import read_results
    from smelt_jax.run_files.rundir import results_dir
    from smelt_jax.run_files.run_lookup import grid_ids
    from smelt_jax.scaling.endpoints import export_table

    table = read_results(results_dir(suite, root))
    if table.empty:
        raise MissingInput(f"no endpoint rows for suite {suite!r} under {results_dir(suite, root)} "
                           "(`smelt results collect` first)")
    on_grid = table["run_id"].astype(str).isin(grid_ids(suite))
    left_out = int((~on_grid).sum())
    if not include_custom:
        if not on_grid.any():
            raise MissingInput(f"none of the {len(table)} endpoint rows of suite {suite!r} is one of the "
                               "suite's own runs (config-file or --override runs): pass --include-custom "
                               "to export them")
        table = table[on_grid]
    out = export_table(table)
    if include_custom:  # the grid as the suite defines it now; off it, the origin recorded (or "custom")
        stored = table["origin"].fillna("").astype(str) if "origin" in table.columns else on_grid.map(str)
        origin = stored.where(stored.isin(("override", "config")), "custom").where(~on_grid, "grid")
        out["origin"] = origin.loc[table.sort_values(["run_id", "branch"], kind="stable").index].to_numpy()
        left_out = 0
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with naming(out_path):  # a full disk says which file (issue 53)
        out.to_csv(out_path, index=False, float_format="%.8g")
    return len(out), left_out
