"""The docs name only what exists: repository paths, `smelt` commands and their flags, and `smelt_jax`
names (README.md and docs/*.md).

What is extracted, and how precisely (so that prose is never read as a reference):

- **Paths**: markdown link targets (relative to the document), and every token that starts with one of
  the repository's own top-level names (`smelt_jax/`, `experiments/`, `fits/`, `benchmarks/`, `docs/`,
  ... and the top-level files) anywhere in the text, code blocks included. Inside backticks a path
  relative to the package (`model/moe.py`, `kernels/tiled.py`: its first folder is a subpackage of
  `smelt_jax`) is resolved against `smelt_jax/`. Placeholders (`<suite>`, `SUITE`, `{...}`, `*`,
  `...`) are not paths; outputs a run creates are allowlisted below with their reason.
- **Commands**: `smelt WORD [WORD ...]` and `python -m smelt_jax WORD ...` inside backticks and fenced
  code blocks (a fenced line continues on lines that start with `[` or `-`, or after a trailing `\\`).
  Each word is checked against the real parser (`smelt_jax.cli.build_parser`) as long as the parser
  has subcommands there; `a|b` alternatives are each checked; an upper-case word is a placeholder.
- **Flags**: every `--flag` of that command text (up to `&&`, `;`, ` | `, a comment or a quote, which
  starts another program's text) must be an option of the (sub)command it follows.
- **Names**: `smelt_jax.module.name` (dotted, in backticks or prose) must be a module of the package,
  and `name` defined at its top level (read with `ast`, nothing imported).
- **The package map**: docs/architecture.md lists every module of `smelt_jax/` under its package's
  section, and names no module that is not there.

A failure lists every bad reference as `file:line: what`.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "smelt_jax"
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

# The repository's own top-level folders and files: a token that starts with one of these is a path.
REPO_DIRS = ("smelt_jax", "experiments", "fits", "benchmarks", "docs", "tests", "notebooks", "requirements")
REPO_FILES = ("README.md", "Makefile", "Dockerfile", "pyproject.toml", "setup.cfg", "ruff.toml")

# Paths that are outputs, created when something runs (never committed), with the reason.
RUNTIME_PATHS = {
    "experiments/layouts_ablations200m.json": "written by `smelt compile-report --suite ablations200m`, "
                                              "not run yet (docs/parallelism.md says so)",
    "fits/smelt16": "written by `smelt results export --suite smelt16` once smelt16 has trained "
                    "(docs/tpu-quickstart.md)",
}
# Paths that look like this repository's but name another one's files.
EXTERNAL_PATHS = {
    "docs/**/*.txt": "files inside Django's source archive, read by the corpus recipe (docs/data.md)",
}
# Records of results (docs/results-*.md) are not edited above their outcome line after their runs start, so
# they keep a module's name of the day they were written; these were moved into packages since (issue 52).
RECORDED_NAMES = {"smelt_jax.paper": "smelt_jax.design.paper", "smelt_jax.budget": "smelt_jax.design.budget"}
# Flags of other tools that the docs name on their own (a backtick span that starts with `--`); every
# other such flag must be an option of some smelt command.
OTHER_TOOLS_FLAGS = {
    "--tpu-type": "xpk workload create",
    "--num-slices": "xpk cluster create",
    "--spot": "xpk cluster create / gcloud compute tpus queued-resources create",
    "--on-demand": "xpk cluster create",
    "--reserved": "gcloud compute tpus queued-resources create",
    "--location": "gcloud container clusters",
}
# Top-level folders that only ever hold outputs (runs, rendered sweeps, caches): never checked.
RUNTIME_ROOTS = {
    "runs/": "the default runs root ($SMELT_RUNS_DIR), written by the trainer",
    "sweeps/": "rendered sweep commands (`smelt sweep submit --out`, default sweeps/SUITE/BACKEND)",
    "data_cache/": "caches (corpus builds, compile reports, XLA programs)",
}

_PLACEHOLDER = re.compile(r"[<>{}*?\[\]]|\.\.\.|\$|(?:^|/)[A-Z][A-Z0-9_]+(?:/|\.|$)")
_PATH_CHARS = r"[A-Za-z0-9_./-]"
_ROOT_TOKEN = re.compile(
    r"(?<![\w./$-])((?:" + "|".join(map(re.escape, REPO_DIRS)) + r")/[A-Za-z0-9_./<>{}*-]*"
    r"|(?:" + "|".join(map(re.escape, REPO_FILES)) + r")(?![\w.-]))")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_COMMAND = re.compile(r"(?<![\w./-])(?:smelt|python3? -m smelt_jax|-m smelt_jax)\s+([a-z][\w|-]*(?:\s+[A-Za-z][\w|-]*)*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
_DOTTED = re.compile(r"(?<![\w.])smelt_jax((?:\.[A-Za-z_]\w*)+)")
_COMMAND_END = re.compile(r"&&|;|\s\|\s|\s#|['\"`]|\)\s|\),")


@dataclass(frozen=True)
class Ref:
    doc: Path
    line: int
    kind: str  # path | command | name
    text: str
    context: str = ""  # for a command: the whole command text

    def where(self) -> str:
        doc = self.doc.relative_to(ROOT) if self.doc.is_relative_to(ROOT) else self.doc
        return f"{doc}:{self.line}"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _split_fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the text with fenced blocks blanked, keeping line numbers; the fenced lines as (line, text))."""
    prose, fenced, inside = [], [], False
    for number, line in enumerate(text.split("\n"), start=1):
        if _FENCE.match(line):
            inside = not inside
            prose.append("")
            continue
        if inside:
            fenced.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), fenced


def _fenced_commands(fenced: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Fenced lines joined with their continuation lines, comments dropped."""
    joined: list[tuple[int, str]] = []
    continues = False
    for number, line in fenced:
        stripped = re.sub(r"(^|\s)#.*$", "", line).strip()
        if joined and (continues or stripped.startswith(("[", "-"))):
            joined[-1] = (joined[-1][0], joined[-1][1].rstrip("\\ ") + " " + stripped)
        else:
            joined.append((number, stripped))
        continues = stripped.endswith("\\")
    return joined


def _subpackages() -> frozenset[str]:
    return frozenset(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def extract(doc: Path) -> list[Ref]:
    text = doc.read_text()
    prose, fenced = _split_fences(text)
    refs: list[Ref] = []
    seen: set[tuple[int, str, str]] = set()

    def add(line: int, kind: str, value: str, context: str = "") -> None:
        if (line, kind, value) not in seen:
            seen.add((line, kind, value))
            refs.append(Ref(doc, line, kind, value, context))

    # Paths anywhere (prose and code), by their repository prefix.
    for match in _ROOT_TOKEN.finditer(text):
        add(_line_of(text, match.start()), "path", match.group(1))
    for match in _LINK.finditer(prose):
        target = match.group(1)
        if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
            add(_line_of(prose, match.start()), "link", target)
    code: list[tuple[int, str]] = [(_line_of(prose, m.start()), m.group(1)) for m in _SPAN.finditer(prose)]
    for line, span in code:
        if span.startswith("--"):  # a flag named on its own, next to the command in the prose
            add(line, "flag", _FLAG.match(span).group(1))
    subpackages = _subpackages()
    for line, span in code:
        token = span.strip()
        first = token.split("/", 1)[0]
        # `kernels/tiled.py`, `model/`, `data/corpus.open_dataset`; not `train/loss` (a metric's name).
        if "/" in token and first in subpackages and not _ROOT_TOKEN.match(token) \
                and re.fullmatch(_PATH_CHARS + "+", token) and (
                    token.endswith((".py", "/")) or (PACKAGE / (token.rpartition(".")[0] + ".py")).exists()):
            add(line, "path", "smelt_jax/" + token)
    code += _fenced_commands(fenced)
    for line, span in code:
        flat = " ".join(span.split())
        matches = list(_COMMAND.finditer(flat))
        for match, after in zip(matches, [m.start() for m in matches[1:]] + [len(flat)]):
            rest = flat[match.start(1):after]  # up to the next command (two on one line)
            end = _COMMAND_END.search(rest)
            add(line, "command", match.group(1), rest[:end.start()] if end else rest)
    for match in _DOTTED.finditer(text):
        add(_line_of(text, match.start()), "name", "smelt_jax" + match.group(1).rstrip("."))
    return refs


# ------------------------------------------------------------------------------------------ checkers


def _is_placeholder(path: str) -> bool:
    return bool(_PLACEHOLDER.search(path))


def check_path(ref: Ref) -> str | None:
    path = ref.text.rstrip(".,:;)")
    if ref.kind == "link":
        path = path.split("#", 1)[0]
        if not path:
            return None
        target = (ref.doc.parent / path).resolve()
        return None if target.exists() else f"link target {ref.text} does not exist"
    if any(path.startswith(r) for r in RUNTIME_ROOTS) or path in EXTERNAL_PATHS:
        return None
    if any(path == p or path.startswith(p) for p in RUNTIME_PATHS):
        return None
    if "*" in path and not _is_placeholder(path.replace("*", "")):  # a glob: it must match something
        return None if any(ROOT.glob(path)) else f"glob {path} matches nothing"
    if _is_placeholder(path):
        return None
    candidate = ROOT / path
    if candidate.exists():
        return None
    # `path.py:func`-style or `module.py` + attribute: `smelt_jax/data/corpus.open_dataset`.
    stem, dot, attr = path.rpartition(".")
    if dot and "/" not in attr and (ROOT / (stem + ".py")).exists():
        return None
    return f"path {path} does not exist"


@functools.cache
def parser() -> argparse.ArgumentParser:
    from smelt_jax.cli import build_parser
    return build_parser()


@functools.cache
def every_option() -> frozenset[str]:
    """The options of every smelt (sub)command."""
    found: set[str] = set()
    todo = [parser()]
    while todo:
        p = todo.pop()
        found |= _options(p)
        todo.extend((_subcommands(p) or {}).values())
    return frozenset(found)


def check_flag(ref: Ref) -> str | None:
    if ref.text in every_option() or ref.text in OTHER_TOOLS_FLAGS:
        return None
    return f"{ref.text}: no smelt command has this option (another tool's? add it to OTHER_TOOLS_FLAGS)"


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {option for action in p._actions for option in action.option_strings}


def check_command(ref: Ref) -> list[str]:
    """The words after `smelt` walk the parser's subcommands; the flags must be the last one's."""
    problems: list[str] = []
    words = ref.context.split()
    current, name = parser(), "smelt"
    for word in words:
        choices = _subcommands(current)
        if choices is None or not re.fullmatch(r"[a-z][a-z0-9-]*(\|[a-z][a-z0-9-]*)*", word):
            break
        alternatives = word.split("|")
        unknown = [w for w in alternatives if w not in choices]
        if unknown:
            problems.append(f"`{name} {word}`: no command {', '.join(unknown)} (has: {', '.join(sorted(choices))})")
            return problems
        # Flags after an alternation must exist in every alternative; continue with the first.
        current, name = choices[alternatives[0]], f"{name} {alternatives[0]}"
        parsers = [choices[w] for w in alternatives]
        if len(parsers) > 1:
            flags = set(_FLAG.findall(ref.context))
            for w, p in zip(alternatives, parsers):
                missing = sorted(flags - _options(p))
                if missing:
                    problems.append(f"`{name.rsplit(' ', 1)[0]} {w}` has no {', '.join(missing)}")
            return problems
    options = _options(current)
    for flag in _FLAG.findall(ref.context):
        if flag not in options:
            problems.append(f"`{name}` has no option {flag}")
    return problems


def _module_file(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The longest prefix of `parts` that is a module or package of smelt_jax, and the rest."""
    for n in range(len(parts), -1, -1):
        base = PACKAGE.joinpath(*parts[:n])
        if n and base.with_suffix(".py").is_file():
            return base.with_suffix(".py"), parts[n:]
        if (base / "__init__.py").is_file():
            return base / "__init__.py", parts[n:]
    return None, parts


@functools.cache
def _top_level_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _current_name(ref: Ref) -> str:
    """A record's name as the module is called now (RECORDED_NAMES); every other doc's name as written."""
    if ref.doc.name.startswith("results-"):
        for old, new in RECORDED_NAMES.items():
            if ref.text == old or ref.text.startswith(old + "."):
                return new + ref.text[len(old):]
    return ref.text


def check_name(ref: Ref) -> str | None:
    parts = _current_name(ref).split(".")[1:]
    path, rest = _module_file(parts)
    if path is None:
        return f"{ref.text}: smelt_jax has no such module"
    if not rest:
        return None
    if path.name == "__init__.py" and (path.parent / rest[0]).exists():
        return None
    if rest[0] in ("py",):  # `smelt_jax.x.py`: a file name written with dots
        return None
    if rest[0] not in _top_level_names(path):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        return f"{ref.text}: {module} defines no {rest[0]}"
    return None


@functools.cache
def _all_refs() -> tuple[Ref, ...]:
    return tuple(ref for doc in DOCS for ref in extract(doc))


def _problems(refs: list[Ref]) -> list[str]:
    out: list[str] = []
    for ref in refs:
        if ref.kind in ("path", "link"):
            found = [check_path(ref)]
        elif ref.kind == "command":
            found = check_command(ref)
        elif ref.kind == "flag":
            found = [check_flag(ref)]
        else:
            found = [check_name(ref)]
        out.extend(f"{ref.where()}: {p}" for p in found if p)
    return out


# --------------------------------------------------------------------------------------------- tests


def test_every_reference_in_the_docs_exists():
    refs = _all_refs()
    kinds = {kind: sum(r.kind == kind for r in refs) for kind in ("path", "link", "command", "flag", "name")}
    assert kinds["path"] > 200 and kinds["command"] > 100 and kinds["name"] > 20, kinds  # extraction works
    problems = _problems(refs)
    assert not problems, f"{len(problems)} bad references in the docs:\n" + "\n".join(problems)


def test_the_allowlists_are_needed():
    """Each runtime path is absent from the checkout (else it needs no allowance) and still named."""
    named = {ref.text for ref in _all_refs() if ref.kind == "path"}
    recorded = {ref.text for ref in _all_refs() if ref.kind == "name" and ref.doc.name.startswith("results-")}
    for old in RECORDED_NAMES:
        assert any(text == old or text.startswith(old + ".") for text in recorded), f"{old} is no longer named"
    for path, reason in {**RUNTIME_PATHS, **EXTERNAL_PATHS}.items():
        assert reason
        assert path in EXTERNAL_PATHS or not (ROOT / path).exists(), f"{path} exists now: drop its allowance"
        assert any(n.rstrip(".,:;)").startswith(path) for n in named), f"{path} is named nowhere any more"
    flags = {ref.text for ref in _all_refs() if ref.kind == "flag"}
    for flag in OTHER_TOOLS_FLAGS:
        assert flag in flags and flag not in every_option(), flag
    for folder in REPO_DIRS:
        assert (ROOT / folder).is_dir(), folder
    for name in REPO_FILES:
        assert (ROOT / name).is_file(), name


def _architecture_sections() -> dict[str, tuple[int, set[str]]]:
    """`### `smelt_jax/pkg/`` section -> (its line, the `*.py` names it lists)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    sections: dict[str, tuple[int, set[str]]] = {}
    for match in re.finditer(r"^### `(smelt_jax/[\w/]*)`.*$", text, flags=re.M):
        end = text.find("\n#", match.end())
        body = text[match.end():end if end >= 0 else len(text)]
        sections[match.group(1).rstrip("/")] = (_line_of(text, match.start()),
                                               set(re.findall(r"`(\w+\.py)`", body)))
    return sections


def test_the_package_map_lists_every_module():
    sections = _architecture_sections()
    problems = []
    for module in sorted(PACKAGE.rglob("*.py")):
        folder = str(module.parent.relative_to(ROOT))
        if module.name == "__init__.py" and folder != "smelt_jax":
            continue  # a subpackage's __init__ is its section
        if folder not in sections:
            problems.append(f"docs/architecture.md: no section `{folder}/` (for {module.relative_to(ROOT)})")
        elif module.name not in sections[folder][1]:
            problems.append(f"docs/architecture.md:{sections[folder][0]}: {module.relative_to(ROOT)} not listed")
    for folder, (line, names) in sections.items():
        for name in sorted(names):
            if not (ROOT / folder / name).is_file():
                problems.append(f"docs/architecture.md:{line}: lists {folder}/{name}, which does not exist")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------- the extraction on known inputs


def _refs_of(tmp_path, text: str) -> list[Ref]:
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    return extract(doc)


def test_extraction_reads_references_and_not_prose(tmp_path):
    refs = _refs_of(tmp_path, "\n".join([
        "The smelt train loop and SMELT models; `smelt16` and smelt_jax are words.",   # 1: nothing
        "See `smelt_jax/model/moe.py` and docs/kernels.md, and `kernels/tiled.py`.",   # 2: 3 paths
        "Run `smelt sweep status --suite S --all` or [the doc](kernels.md#tiles).",    # 3: command, link
        "Outputs: `runs/<suite>/results.parquet`, `fits/SUITE/results.csv`.",         # 4: placeholders
        "```",
        "smelt compile RUN_ID --topology v5p-8   # a comment --not-a-flag",           # 6: command
        "           [--remat full]",                                                   # 7: continues 6
        "```",
        "`smelt_jax.parallel.sharding.LOGICAL_AXIS_RULES` and `xpk ... --command='python -m smelt_jax train X'`",
    ]))
    got = [(r.line, r.kind, r.text, r.context) for r in refs]
    assert (2, "path", "smelt_jax/model/moe.py", "") in got
    assert (2, "path", "docs/kernels.md", "") in got
    assert (2, "path", "smelt_jax/kernels/tiled.py", "") in got
    assert (3, "link", "kernels.md#tiles", "") in got
    assert (3, "command", "sweep status", "sweep status --suite S --all") in got
    assert (6, "command", "compile RUN_ID", "compile RUN_ID --topology v5p-8 [--remat full]") in got
    assert (9, "name", "smelt_jax.parallel.sharding.LOGICAL_AXIS_RULES", "") in got
    assert (9, "command", "train X", "train X") in got
    assert not [r for r in refs if r.line in (1, 4) and r.kind != "path"]
    assert all(check_path(r) is None for r in refs if r.line == 4 and r.kind == "path")


@pytest.mark.parametrize("text, expected", [
    ("`smelt sweep status --suite S --all`", []),
    ("`smelt sweep stats --suite S`", ["no command stats"]),
    ("`smelt train RUN_ID --no-such-flag`", ["`smelt train` has no option --no-such-flag"]),
    ("`smelt sweep plan|submit --parallel 2`", ["`smelt sweep plan` has no --parallel"]),
    ("`smelt data tokenizer train --vocab-size 512`", []),
    ("`smelt results collect --runs-dir gs://b/runs`", []),
    ("`smelt COMMAND --help`", []),
    ("`python -m smelt_jax train X --branch 1 && smelt fit --whatever`", ["`smelt fit` has no option --whatever"]),
    ("see `docs/nowhere.md`", ["path docs/nowhere.md does not exist"]),
    ("`--eval-every` and `--tpu-type` and `--no-such-thing N`", ["--no-such-thing: no smelt command"]),
    ("[x](nowhere.md)", ["link target nowhere.md does not exist"]),
    ("`model/not_a_module.py`", ["path smelt_jax/model/not_a_module.py does not exist"]),
    ("`smelt_jax.parallel.sharding.NOT_DEFINED`", ["smelt_jax.parallel.sharding defines no NOT_DEFINED"]),
    ("`smelt_jax.nosuchmodule`", ["smelt_jax.nosuchmodule: smelt_jax defines no nosuchmodule"]),
    ("`smelt_jax.train.state.host_split` and smelt_jax/data/corpus.open_dataset", []),
])
def test_checks_flag_what_is_wrong(tmp_path, text, expected):
    problems = _problems(_refs_of(tmp_path, text))
    assert len(problems) == len(expected), problems
    for problem, fragment in zip(problems, expected):
        assert problem.startswith(f"{tmp_path / 'doc.md'}:1: ") and fragment in problem, problem
