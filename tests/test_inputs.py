"""What `smelt data prepare` and `smelt data tokenizer train` make of a researcher's own files (issue
26 E): folders of .txt / .md files are documents; unusable input is one line that counts the problems
by kind, lists the fields or columns found and names the flag; `tokenizer train` refuses input with no
document; a validation split under 100k tokens gives a warning."""

from __future__ import annotations

import json
from pathlib import Path


from smelt_jax.cli import main
from smelt_jax.data.input_checks import VAL_TOKENS_WARNING, no_documents_message, validation_warning
from smelt_jax.data.token_store import TokenStore


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _texts(folder: Path) -> dict[str, str]:
    files = {"notes/a.txt": "first document " * 40, "notes/b.md": "# second\n\nmarkdown " * 30,
             "essays/c.txt": "third one, in another folder " * 20, "essays/d.md": "fourth " * 50,
             "essays/skip.csv": "not an input"}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return files


def test_prepare_accepts_a_folder_of_text_files(tmp_path, capsys):
    _texts(tmp_path / "in")
    out = tmp_path / "store"
    assert main(["data", "prepare", "--input", str(tmp_path / "in"), "--out", str(out), "--quiet",
                 "--val-fraction", "0.3"]) == 0, capsys.readouterr().err
    store = TokenStore(str(out))
    assert store.manifest["totals"]["documents"] == 4  # one per .txt / .md file, the .csv ignored
    assert sorted(s["name"] for s in store.manifest["sources"]) == ["essays", "notes"]
    inputs = sorted(Path(i["input"]).name for i in store.manifest["inputs"])
    assert inputs == ["a.txt", "b.md", "c.txt", "d.md"]
    # --default-source labels every file instead of its folder
    out2 = tmp_path / "store2"
    assert main(["data", "prepare", "--input", str(tmp_path / "in" / "notes"), "--out", str(out2),
                 "--quiet", "--default-source", "mine", "--val-fraction", "0.5"]) == 0
    assert [s["name"] for s in TokenStore(str(out2)).manifest["sources"]] == ["mine"]


def test_no_text_field_counts_problems_and_lists_the_fields(tmp_path, capsys):
    shard = _write_jsonl(tmp_path / "in" / "a.jsonl",
                         [{"body": f"document {i} " * 10, "id": i, "source": "web"} for i in range(30)]
                         + [{"id": 99}])
    assert main(["data", "prepare", "--input", str(shard), "--out", str(tmp_path / "s"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "no usable documents" in err
    assert "1 input file(s), 31 record(s)" in err
    assert "31 without the text field (missing_text)" in err
    assert "fields found: body (str), id (int), source (str)" in err
    assert "--text-field body" in err
    # and the hint works
    assert main(["data", "prepare", "--input", str(shard), "--out", str(tmp_path / "s"), "--quiet",
                 "--text-field", "body", "--val-fraction", "0.3"]) == 0


def test_parquet_columns_are_listed(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"content": ["some text"] * 5, "label": [1, 2, 3, 4, 5]}), path)
    assert main(["data", "prepare", "--input", str(path), "--out", str(tmp_path / "s"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "fields found: content (str), label (int)" in err and "--text-field content" in err


def test_missing_source_hints_the_source_flags(tmp_path, capsys):
    shard = _write_jsonl(tmp_path / "a.jsonl", [{"text": f"t {i}"} for i in range(5)])
    assert main(["data", "prepare", "--input", str(shard), "--out", str(tmp_path / "s"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "5 without the source field (missing_source)" in err
    assert "--source-field FIELD or --default-source LABEL" in err and "--text-field" not in err


def test_tokenizer_train_refuses_input_with_no_documents(tmp_path, capsys):
    shard = _write_jsonl(tmp_path / "a.jsonl", [{"body": "x " * 50} for _ in range(10)])
    out = tmp_path / "tokenizer.json"
    assert main(["data", "tokenizer", "train", "--input", str(shard), "--vocab-size", "300",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert not out.exists()
    assert "no documents to train a tokenizer on" in err and "10 without the text field" in err
    assert "--text-field body" in err


def test_tokenizer_train_on_a_folder_of_text_files(tmp_path, capsys):
    _texts(tmp_path / "in")
    out = tmp_path / "tokenizer.json"
    assert main(["data", "tokenizer", "train", "--input", str(tmp_path / "in"), "--vocab-size", "300",
                 "--out", str(out), "--min-frequency", "1"]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["model"]["type"] == "BPE"


def test_a_small_validation_split_warns(tmp_path, capsys):
    shard = _write_jsonl(tmp_path / "a.jsonl",
                         [{"text": f"record number {i} " * 5, "source": "web"} for i in range(200)])
    assert main(["data", "prepare", "--input", str(shard), "--out", str(tmp_path / "s"), "--quiet"]) == 0
    captured = capsys.readouterr()
    val = TokenStore(str(tmp_path / "s")).manifest["totals"]["val"]["tokens"]
    assert 0 < val < VAL_TOKENS_WARNING
    assert f"warning: the validation split holds {val:,} tokens (--val-fraction 0.01)" in captured.err
    assert main(["data", "store-info", str(tmp_path / "s")]) == 0
    assert "warning: the validation split" in capsys.readouterr().err


def test_validation_warning_threshold():
    assert validation_warning(VAL_TOKENS_WARNING) is None
    assert validation_warning(VAL_TOKENS_WARNING - 1) is not None
    assert "175 tokens" in validation_warning(175, 0.01)


def test_no_documents_message_names_formats_when_nothing_was_read():
    line = no_documents_message({"non_utf8": 3}, {}, inputs=2, records=0)
    assert "2 input file(s), 0 record(s)" in line and ".txt" in line and "\n" not in line
    line = no_documents_message({"bad_json": 4}, {}, inputs=1, records=4)
    assert "4 not a JSON object (bad_json)" in line and "no fields found" in line
