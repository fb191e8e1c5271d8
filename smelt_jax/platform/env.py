"""The one checked door for values from outside the command line: environment variables.

Every variable the library reads is named, defaulted and parsed here, and nowhere else (a test greps
the package for `os.environ` reads outside this module). A bad value is one line naming the variable
and what it takes (`EnvError`, exit 2), never a traceback. The rule for all of them: a variable set to
the empty string counts as unset (as the XDG spec says for XDG_CACHE_HOME, and as `${VAR:-default}`
reads it), so `SMELT_RUNS_DIR=` means the default `runs/`, never the current directory.

    SMELT_RUNS_DIR            runs root, a local path or gs://BUCKET/PATH      (default runs/)
    SMELT_LOCK_STALE_SECONDS  a trainer lock not refreshed this long is dead   (default 300; seconds > 0)
    SMELT_XLA_CACHE           compiled-program cache folder                    (default $XDG_CACHE_HOME/smelt_jax/xla)
    XDG_CACHE_HOME            the user's cache root; absolute paths only       (default ~/.cache)
    SMELT_DATA_DIR            corpus and data cache folder                     (default data_cache/ of the checkout)
    SMELT_CORPUS_MIRROR       where `smelt data build` fetches archives from   (default: their sources)
    JAX_PLATFORMS             JAX's platforms, comma-separated (cpu, tpu, cuda, rocm); read by JAX itself,
                              checked here against the devices present before JAX starts

The generated tpu-vm job scripts read SMELT_POLL_SECONDS and SMELT_DESCRIBE_RETRY_SECONDS in bash
(`sweep/tpu_vm.py`); docs/training.md "Input rules" lists every variable once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from smelt_jax.platform.errors import SmeltError

DEFAULT_RUNS_DIR = "runs"
DEFAULT_LOCK_STALE_SECONDS = 300.0
JAX_PLATFORM_NAMES = ("cpu", "tpu", "cuda", "rocm", "gpu", "metal")
# JAX_PLATFORMS names, and the device files without which they cannot start (none listed: no check)
PLATFORM_DEVICES = {"tpu": ("accel*", "vfio"), "cuda": ("nvidia[0-9]*",), "gpu": ("nvidia[0-9]*", "kfd"),
                    "rocm": ("kfd",)}


class EnvError(SmeltError, ValueError):
    """An environment variable with a value the library cannot use (one line, exit 2)."""


def _get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, None when unset or empty (the one rule for every variable)."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value else None


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 60 else repr(value[:50]) + f"... ({len(value)} characters)"


def runs_dir(environ: Mapping[str, str] | None = None) -> str:
    """SMELT_RUNS_DIR, else `runs` (relative to the current directory)."""
    return _get("SMELT_RUNS_DIR", environ) or DEFAULT_RUNS_DIR


def lock_stale_seconds(environ: Mapping[str, str] | None = None) -> float:
    """SMELT_LOCK_STALE_SECONDS as a positive, finite number of seconds, else the default 300."""
    text = _get("SMELT_LOCK_STALE_SECONDS", environ)
    if text is None:
        return DEFAULT_LOCK_STALE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise EnvError(f"SMELT_LOCK_STALE_SECONDS={_shown(text)} is not a positive number of seconds "
                       f"(e.g. 300 for five minutes); unset it for the default {DEFAULT_LOCK_STALE_SECONDS:g}")
    return value


def xdg_cache_home(environ: Mapping[str, str] | None = None) -> Path:
    """XDG_CACHE_HOME when it is an absolute path, else ~/.cache (the XDG spec: a relative path is
    invalid and ignored)."""
    text = _get("XDG_CACHE_HOME", environ)
    if text is not None and os.path.isabs(text):
        return Path(text)
    return Path.home() / ".cache"


def xla_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """SMELT_XLA_CACHE, else $XDG_CACHE_HOME/smelt_jax/xla: never inside the package or the checkout."""
    return _get("SMELT_XLA_CACHE", environ) or str(xdg_cache_home(environ) / "smelt_jax" / "xla")


def data_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """SMELT_DATA_DIR, or None (the caller's default: `data_cache/` of the checkout)."""
    return _get("SMELT_DATA_DIR", environ)


def corpus_mirror(environ: Mapping[str, str] | None = None) -> str | None:
    """SMELT_CORPUS_MIRROR, or None (archives come from their sources)."""
    return _get("SMELT_CORPUS_MIRROR", environ)


def jax_platforms(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The platforms JAX_PLATFORMS names (None when unset or empty: JAX chooses); EnvError for a name
    JAX does not know."""
    text = _get("JAX_PLATFORMS", environ)
    if text is None:
        return None
    names = tuple(part.strip().lower() for part in text.split(","))
    unknown = [n for n in names if n not in JAX_PLATFORM_NAMES]
    if unknown:
        raise EnvError(f"JAX_PLATFORMS={_shown(text)} names {', '.join(map(repr, unknown))}, not a JAX "
                       f"platform ({', '.join(JAX_PLATFORM_NAMES)}); unset it to let JAX choose")
    return names


def check_jax_platforms(dev: Path = Path("/dev"), environ: Mapping[str, str] | None = None) -> None:
    """EnvError (one line) when JAX_PLATFORMS names a platform whose devices this machine lacks
    (`tpu` without /dev/accel* or /dev/vfio, `cuda` without /dev/nvidia*): JAX would fail to start it
    with chained tracebacks (and libtpu's noise) once the command is under way."""
    for name in jax_platforms(environ) or ():
        patterns = PLATFORM_DEVICES.get(name)
        if patterns and not any(any(dev.glob(p)) for p in patterns):
            raise EnvError(f"JAX_PLATFORMS={_get('JAX_PLATFORMS', environ)} asks for {name}, but this machine "
                           f"has no {name} device ({', '.join(str(dev / p) for p in patterns)} absent); "
                           "unset JAX_PLATFORMS (or set it to cpu)")


def jax_backend_problem(err: BaseException, environ: Mapping[str, str] | None = None) -> str | None:
    """One line for JAX failing to start a backend that JAX_PLATFORMS asked for (its RuntimeError,
    possibly chained), else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = " ".join(str(err).split())
        if "Unable to initialize backend" in text:
            given = _get("JAX_PLATFORMS", environ)
            cause = text.split(" (set JAX_PLATFORMS=")[0][:200]
            where = f"JAX_PLATFORMS={given}: " if given else ""
            hint = "unset JAX_PLATFORMS (or set it to cpu)" if given else "check the accelerator"
            return f"{where}{cause}; {hint}"
        err = err.__cause__ or err.__context__
    return None
