"""The committed record of a layout search's compiles, so `make compile-report` resumes on any machine.

A compile of a 100M train step for a v5p slice takes 1.5-3 minutes on these CPUs and the search makes
about four per configuration, so a whole suite is hours of compiling: more than one session, and the
cache under data_cache/ does not travel with a clone. The ledger does: one JSON line per compile
(name = the cache file's name, so configuration content, layout, remat, exchange and CACHE_VERSION are
in it; the run's key; the candidate; the report without its 25 largest instructions; the
`layout_search.PROGRAM_VERSION` of the program compiled, absent in records made before it was kept), sorted by name,
written by `compile_suite` beside the suite's layouts file (experiments/compile_results.jsonl for
smelt16). It is also the evidence behind layouts.json: every candidate the search compared, with its
walked bytes and roofline step.

A record counts only when it was analysed by the current `report.ANALYSIS_VERSION` (no HLO travels
with it to re-analyse from), or is a compile the compiler refused for memory (nothing to analyse); an
older one is compiled again. Fields whose accounting changed apart from the walk (`report.ICI_ACCOUNTING`)
are recomputed from what the record stores when it is read (`report.upgrade_ici`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from smelt_jax.compile.report import ANALYSIS_VERSION, CompileReport, upgrade_ici
from smelt_jax.platform.errors import UsageError

LEFT_OUT = ("hbm_top",)  # per-instruction rows: `smelt compile ID --breakdown` prints them


def report_from_dict(data: dict[str, Any]) -> CompileReport:
    fields = {f.name for f in dataclasses.fields(CompileReport)}
    if "fits" in data and "peak_fits_hbm" not in data:  # cache files written before the rename
        data = {**data, "peak_fits_hbm": data["fits"]}
    # a record analysed before the collectives' current accounting is recomputed from what it stores
    return upgrade_ici(CompileReport(**{k: v for k, v in data.items() if k in fields}))


@dataclasses.dataclass
class Ledger:
    """Compile records by name (a cache file's name); `load` a file, `get` a current report, `write`."""

    path: Path | None = None
    records: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | str | None) -> Ledger:
        """The ledger at `path` (empty when the file does not exist yet; None: an empty one, not written)."""
        if path is None:
            return cls()
        path = Path(path)
        records = {}
        if path.exists():
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    records[record["name"]] = record
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise UsageError(f"{path}:{n}: not a compile record ({err}); "
                                     "restore it from git or delete the line") from err
        return cls(path, records)

    def get(self, name: str) -> CompileReport | None:
        record = self.records.get(name)
        if record is None:
            return None
        report = record["report"]
        out_of_memory = not report.get("peak_fits_hbm") and report.get("peak_bytes") is None
        if report.get("analysis_version") != ANALYSIS_VERSION and not out_of_memory:  # nothing to analyse in an OOM
            return None
        return report_from_dict(record["report"])

    def add(self, name: str, key: str, candidate: dict[str, Any], report: CompileReport, program: int = 1) -> None:
        """Record one compile; `program`: the `layout_search.PROGRAM_VERSION` that compiled it."""
        data = {k: v for k, v in report.as_dict().items() if k not in LEFT_OUT}
        self.records[name] = {"name": name, "key": key, "candidate": candidate, "report": data, "program": program}

    def program(self, name: str) -> int:
        """The program version of the record `name` (1: recorded before versions were)."""
        return self.records[name].get("program", 1)

    def keep_only(self, names: set[str]) -> None:
        """Drop records of candidates no longer searched (another CACHE_VERSION, configuration or slice)."""
        self.records = {name: r for name, r in self.records.items() if name in names}

    def text(self) -> str:
        return "".join(json.dumps(self.records[name], sort_keys=True) + "\n" for name in sorted(self.records))

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(self.text())
        tmp.replace(self.path)  # atomic


def results_file(layouts_file: Path | str) -> Path:
    """The ledger beside a suite's layouts file: layouts.json -> compile_results.jsonl,
    layouts_SUITE.json -> compile_results_SUITE.jsonl."""
    layouts_file = Path(layouts_file)
    return layouts_file.with_name(layouts_file.name.replace("layouts", "compile_results", 1)
                                  .removesuffix(".json") + ".jsonl")
