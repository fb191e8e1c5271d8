"""`smelt data build|info`: make the embedded corpus (idempotently) and describe it."""

from __future__ import annotations

import argparse
from pathlib import Path

from smelt_jax.cli import CliError


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="the embedded training corpus: build, info")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION")
    data.set_defaults(handler=lambda args: _usage(data))

    build = actions.add_parser(
        "build", help="build the corpus offline from text on this machine (verifies and keeps an "
                      "existing one)")
    build.add_argument("--out", type=Path, default=None,
                       help="corpus folder (default $SMELT_DATA_DIR/<version> or data_cache/<version>)")
    build.add_argument("--force", action="store_true",
                       help="rebuild even when a corpus (stale, damaged or current) is there")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(handler=_build)

    info = actions.add_parser("info", help="sources, documents, tokens and provenance of a built corpus")
    info.add_argument("--dir", type=Path, default=None, help="corpus folder (default as for build)")
    info.add_argument("--verify", action="store_true", help="also recompute every sha256")
    info.set_defaults(handler=_info)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _build(args) -> int:
    from smelt_jax.data.corpus import CorpusError, build_corpus

    try:
        result = build_corpus(args.out, force=args.force, progress=not args.quiet)
    except CorpusError as err:
        raise CliError(str(err)) from err
    totals = result.manifest["totals"]
    verb = "built" if result.built else "up to date (checksums verified)"
    print(f"corpus {result.manifest['corpus_version']} at {result.folder}: {verb}; "
          f"{totals['train']['tokens']:,} train / {totals['val']['tokens']:,} validation tokens; "
          f"digest {result.manifest['corpus_digest'][:16]}")
    return 0


def _info(args) -> int:
    from smelt_jax.data.corpus import Corpus, CorpusError, default_corpus_dir

    folder = args.dir or default_corpus_dir()
    try:
        corpus = Corpus(folder, verify=args.verify)
    except CorpusError as err:
        raise CliError(str(err)) from err
    manifest = corpus.manifest
    print(f"corpus {manifest['corpus_version']} at {folder}")
    print(f"  digest {manifest['corpus_digest']}  recipe {manifest['recipe_digest']}"
          + ("  (checksums verified)" if args.verify else ""))
    tok = manifest["tokenizer"]
    print(f"  tokenizer {tok['version']}: vocab {tok['vocab_size']}, BOS {tok['bos_id']}, "
          f"EOS {tok['eos_id']}, PAD {tok['pad_id']}")
    print(f"  built {manifest['build']['built_at']} in {manifest['build']['seconds']} s "
          f"(Python {manifest['build']['python']})")
    print()
    print("| source | kind | train docs | train tokens | val docs | val tokens |")
    print("|---|---|---:|---:|---:|---:|")
    for row in corpus.summary():
        print(f"| {row['source']} | {row['kind']} | {row['train_documents']:,} | {row['train_tokens']:,} "
              f"| {row['val_documents']:,} | {row['val_tokens']:,} |")
    print()
    print("provenance (files matched / used / skipped, bytes):")
    for source, meta in manifest["sources"].items():
        for part in meta["provenance"]:
            print(f"  {source:<11} {part['root']:<15} {part['files_matched']:>6} / {part['files_used']:>5} / "
                  f"{part['files_skipped']:>4}  {part['bytes']:>11,}  {part['path']}")
    return 0
