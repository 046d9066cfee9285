"""The `rapid` command: exit codes and messages, --json shape, ask and chat on tiny models."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from rapid_integrations.cli import (
    EXIT_DATAERR,
    EXIT_NOINPUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    main,
    read_document,
)
from rapid_integrations.demo import ANSWER_KEYWORD, QUESTION
from rapid_integrations.demo_data import demo_excerpt


@pytest.fixture(autouse=True)
def _restore_progress_settings(monkeypatch):
    """--no-progress silences bars process-wide; put things back after each test."""
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("TQDM_DISABLE", "1")
    yield
    hf_logging.enable_progress_bar()


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("a cab. a bad deal. " * 10)
    return path


def tiny_args(model_dir, *extra):
    return [
        "--model",
        str(model_dir),
        "--mode",
        "lc",
        "--max-new-tokens",
        "5",
        "--no-progress",
        *extra,
    ]


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == EXIT_USAGE
    assert "ask" in capsys.readouterr().err


BAD_DOCUMENTS = {
    "missing": (None, EXIT_NOINPUT, "no such file"),
    "directory": (None, EXIT_NOINPUT, "is a directory"),
    "empty": (b"", EXIT_DATAERR, "the document is empty"),
    "blank": (b" \n\t", EXIT_DATAERR, "the document is empty"),
    "binary": (b"\xff\xfe\x00", EXIT_DATAERR, "not UTF-8 text"),
    # Valid UTF-8, but not text: what a binary file or UTF-16 read as UTF-8 looks like.
    "nul bytes": (b"\x00" * 64, EXIT_DATAERR, "not a text file: a NUL byte at character 0"),
    "control characters": (
        b"a deal.\x01\x02\x1b",
        EXIT_DATAERR,
        "not a text file: the control character U+0001 at character 7",
    ),
    "latin-1": (
        "caf\xe9 au lait".encode("latin-1"),
        EXIT_DATAERR,
        "not UTF-8 text (byte 0xe9 at offset 3",
    ),
}


@pytest.mark.parametrize("command", ["ask", "chat"])
@pytest.mark.parametrize("kind", BAD_DOCUMENTS)
def test_unusable_documents_exit_before_loading_a_model(tmp_path, capsys, command, kind):
    content, code, message = BAD_DOCUMENTS[kind]
    path = tmp_path / "doc.txt"
    if kind == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    argv = [command, str(path), *(["-q", "why?"] if command == "ask" else [])]
    assert main([*argv, "--model", "/nonexistent/model"]) == code
    err = capsys.readouterr().err
    assert err.startswith(f"rapid: error: {path}") and message in err


def test_a_file_in_another_encoding_says_how_to_read_it(tmp_path, capsys):
    """A Latin-1 file is refused with both ways to read it, and `--encoding` reads it; an
    encoding Python does not know is a usage error."""
    path = tmp_path / "menu.txt"
    path.write_bytes("caf\xe9 au lait, cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    assert main(["ask", str(path), "-q", "why?", "--model", "/nonexistent"]) == EXIT_DATAERR
    err = capsys.readouterr().err
    assert "--encoding latin-1" in err and f"iconv -f latin1 -t utf-8 {path} >" in err
    assert read_document(path, "latin-1") == "café au lait, crème brûlée"
    argv = ["ask", str(path), "-q", "why?", "--encoding", "latin-1", "--model", "/nonexistent"]
    assert main(argv) == EXIT_UNAVAILABLE  # read, and refused only for the missing model
    argv[argv.index("latin-1")] = "klingon"
    assert main(argv) == EXIT_USAGE
    assert "unknown text encoding 'klingon'" in capsys.readouterr().err


def test_bad_option_values_exit_2_naming_the_field(doc, capsys):
    assert (
        main(["ask", str(doc), "-q", "x", "--gamma", "0", "--model", "/nonexistent"]) == EXIT_USAGE
    )
    assert "gamma" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["ask", str(doc), "-q", "x", "--mode", "fast"])
    assert exited.value.code == EXIT_USAGE


def test_empty_question_and_missing_model(doc, capsys):
    assert main(["ask", str(doc), "-q", "  "]) == EXIT_DATAERR
    assert "question is empty" in capsys.readouterr().err
    assert main(["ask", str(doc), "-q", "x", "--model", "/nonexistent/model"]) == EXIT_UNAVAILABLE
    assert "model folder not found" in capsys.readouterr().err


def test_document_beyond_the_window_says_how_to_fit_it(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "long.txt"
    path.write_text("a bad cab. " * 100)  # ~1100 characters: past the 512-token window
    for command in (["ask", str(path), "-q", "what?"], ["chat", str(path)]):
        assert main([*command, *tiny_args(tiny_model_dir)]) == EXIT_DATAERR
        err = capsys.readouterr().err
        assert "context window is 512 tokens" in err and "--truncation head_tail" in err
    argv = [
        "ask",
        str(path),
        "-q",
        "what?",
        *tiny_args(tiny_model_dir, "--truncation", "head_tail"),
    ]
    assert main(argv) == 0


def test_ask_prints_the_answer_then_stats(doc, tiny_model_dir, capsys):
    assert main(["ask", str(doc), "-q", "a cab?", *tiny_args(tiny_model_dir)]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "[lc] " in err and "decode" in err and "tokens" in err


def test_ask_json_shape(doc, tiny_model_dir, capsys):
    argv = ["ask", str(doc), "-q", "a cab?", *tiny_args(tiny_model_dir, "--json", "--seed", "3")]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {
        "file",
        "question",
        "answer",
        "token_ids",
        "finish_reason",
        "prompt_tokens",
        "stats",
    }
    assert result["question"] == "a cab?" and result["finish_reason"] in ("eos", "stop", "length")
    stats = result["stats"]
    assert (
        stats["mode"] == "lc"
        and stats["seed"] == 3
        and stats["target_context_tokens"] == result["prompt_tokens"]
    )
    assert {"prefill_seconds", "decode_tokens_per_second", "acceptance_rate"} <= set(stats)


def test_chat_answers_each_line_with_the_history(doc, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a cab?\n\n  \na deal?\nquit\nnever asked\n"))
    assert main(["chat", str(doc), *tiny_args(tiny_model_dir, "--json")]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["question"] for t in turns] == ["a cab?", "a deal?"]
    assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"]  # the first turn is history


def test_console_script_exit_code():
    done = subprocess.run(
        [sys.executable, "-m", "rapid_integrations.cli", "ask", "missing.txt", "-q", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == EXIT_NOINPUT and "missing.txt: no such file" in done.stderr


@pytest.mark.slow
def test_ask_with_the_embedded_model(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    # Half the README tests' excerpt (tests/test_readme.py), half the prefill: still a
    # document over the draft's budget, so the draft reads it through retrieval.
    path.write_text(demo_excerpt(3000))
    argv = ["ask", str(path), "-q", QUESTION, "--max-new-tokens", "40", "--json", "--no-progress"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert ANSWER_KEYWORD in result["answer"].lower()
    stats = result["stats"]
    assert (
        stats["mode"] == "rapid"
        and 0 < stats["draft_context_tokens"] < stats["target_context_tokens"]
    )
