"""Execute the jupytext notebooks: `python -m smelt_jax.analysis.notebooks_runner notebooks [--fixture DIR]`.

Each `*.py` (jupytext percent format) in the folder is converted to a notebook and executed with nbclient in
its own `python3` kernel (the venv's; its kernelspec is installed into the venv on first use, idempotently).
The executed `.ipynb` is written next to the source (git-ignored; never edited by hand) unless `--no-write`.

Notebooks are parameterised by environment variables read in their first cell. Without `--fixture` they
use their defaults (committed data: `fits/paper`, the suite descriptors). `--fixture DIR` points them at a
small fixture: SMELT_RUNS_DIR=DIR/runs, SMELT_SUITE=DIR/suite.txt's content (default `fixture`),
SMELT_RESULTS_DIR=DIR/runs/<suite>, SMELT_FITS_DIR=DIR/fits, SMELT_CHINCHILLA_FITS_DIR=DIR/chinchilla,
SMELT_ANALYSIS_DIR=DIR/analysis, SMELT_SUITE_DIR=DIR/suite, SMELT_DESCRIPTOR_SUITE=smoke (each only when that path exists, the suite
always).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from smelt_jax.platform.errors import MissingInput

KERNEL = "python3"


def ensure_kernel() -> str:
    """Install the venv's python3 kernelspec into the venv unless it is there (and runs this Python)."""
    import json

    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = KernelSpecManager().find_kernel_specs().get(KERNEL)
    if spec_dir:
        argv = json.loads((Path(spec_dir) / "kernel.json").read_text()).get("argv", [])
        if argv and Path(argv[0]).resolve() == Path(sys.executable).resolve():
            return spec_dir
        if argv and argv[0] == "python" and Path(spec_dir).is_relative_to(Path(sys.prefix)):
            return spec_dir
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL],
                   check=True, capture_output=True)
    return KernelSpecManager().find_kernel_specs()[KERNEL]


def fixture_environment(fixture: Path) -> dict[str, str]:
    """Environment variables that point the notebooks at a fixture folder (see the module docstring)."""
    fixture = Path(fixture).absolute()
    suite_file = fixture / "suite.txt"
    suite = suite_file.read_text().strip() if suite_file.exists() else "fixture"
    env = {"SMELT_SUITE": suite, "SMELT_DESCRIPTOR_SUITE": "smoke"}
    for variable, path in (("SMELT_RUNS_DIR", fixture / "runs"), ("SMELT_RESULTS_DIR", fixture / "runs" / suite),
                           ("SMELT_FITS_DIR", fixture / "fits"), ("SMELT_CHINCHILLA_FITS_DIR", fixture / "chinchilla"),
                           ("SMELT_ANALYSIS_DIR", fixture / "analysis"), ("SMELT_SUITE_DIR", fixture / "suite")):
        if path.exists():
            env[variable] = str(path)
    return env


def execute_notebook(source: Path, *, cwd: Path, timeout: int = 600, write: bool = True):
    """Convert `source` (jupytext .py) and execute it; returns the executed notebook. Raises on a failing cell."""
    import jupytext
    from nbclient import NotebookClient

    notebook = jupytext.read(source)
    notebook.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3", "language": "python"}
    # startup_timeout: nbclient's default 60 s for the kernel to answer was missed on a loaded 2-core
    # machine (the integration tier beside a TPU compile); a kernel that needs 5 minutes is broken.
    client = NotebookClient(notebook, kernel_name=KERNEL, timeout=timeout, startup_timeout=300,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    if write:
        import nbformat
        nbformat.write(notebook, source.with_suffix(".ipynb"))
    return notebook


def run_all(folder: Path, *, fixture: Path | None = None, timeout: int = 600, write: bool = True,
            names: list[str] | None = None) -> list[tuple[str, float, object]]:
    """Execute every notebook of `folder` (or those named); returns (name, seconds, executed notebook)
    per notebook."""
    from smelt_jax.platform.jax_platform import pin_cpu_without_accelerator

    folder = Path(folder)
    sources = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if names:
        sources = [p for p in sources if p.stem in names]
    if not sources:
        raise MissingInput(f"no notebooks (*.py) in {folder}")
    ensure_kernel()
    cwd = folder.absolute().parent  # the repository root: default paths are relative to it
    timings = []
    # The kernels inherit os.environ; it is restored afterwards so a caller (a test) is not changed.
    saved = dict(os.environ)
    try:
        pin_cpu_without_accelerator()  # pin JAX to the CPU where there is no accelerator
        if fixture is not None:
            os.environ.update(fixture_environment(fixture))
        for source in sources:
            start = time.perf_counter()
            try:
                notebook = execute_notebook(source, cwd=cwd, timeout=timeout, write=write)
            except Exception as error:  # nbclient's CellExecutionError carries the cell and traceback
                raise RuntimeError(f"notebook {source} failed:\n{error}") from error
            timings.append((source.stem, time.perf_counter() - start, notebook))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m smelt_jax.analysis.notebooks_runner", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--fixture", type=Path, help="fixture folder (see the module docstring)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these notebooks (file stems)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--no-write", action="store_true", help="do not write the executed .ipynb")
    args = parser.parse_args(argv)
    try:
        timings = run_all(args.folder, fixture=args.fixture, timeout=args.timeout, write=not args.no_write,
                          names=args.only)
    except (RuntimeError, FileNotFoundError) as error:
        print(f"notebooks: {error}", file=sys.stderr)
        return 1
    for name, seconds, _ in timings:
        print(f"{name}: ok ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
