"""The `rapid` command: questions about a text file, a chat over it, and the benchmark.

    rapid ask FILE --question Q [options]   answer one question, then print the stats
    rapid chat FILE [options]               a multi-turn conversation about FILE (stdin)
    rapid bench [--quick | --long | --eta-sweep | --prefill] [--out DIR]
                                            quality and speed of every method, side by side
    rapid bench --suite broad [--split dev|test] [--quick]
                                            the broad QA suite's candidates on one half
    rapid bench --suite short [--quick]     short chat and agent prompts: agreement with lc
    rapid serve [--host H] [--port P]       an OpenAI-compatible server (docs/serving.md)

Without --model the embedded SmolLM2-135M-Instruct answers (converted once on first use).
The answer goes to stdout and the stats to stderr; --json prints one JSON object instead
(one per turn in chat).

Exit codes (after sysexits.h): 0 success; 1 another rapid error; 2 bad usage or option value;
65 the document is empty, not text (undecodable in its encoding, UTF-8 unless --encoding, or
holding NUL bytes or control characters), or longer than the model's window; 66 the document
is missing or unreadable; 69 a model is not available; 130 interrupted.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rapid_integrations.config import (
    DRAFT_PRECISIONS,
    DTYPES,
    MODES,
    TARGET_PRECISIONS,
    TRUNCATIONS,
    RapidConfig,
)
from rapid_integrations.demo_data import demo_messages
from rapid_integrations.errors import (
    ContextWindowExceededError,
    ModelNotFoundError,
    RapidConfigError,
    RapidError,
    RapidInputError,
)
from rapid_integrations.output.outputs import RapidOutput
from rapid_integrations.output.stats_format import format_stats

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_DATAERR = 65
EXIT_NOINPUT = 66
EXIT_UNAVAILABLE = 69
EXIT_INTERRUPTED = 130
PREFILL_BAR_MIN_TOKENS = 1024
"""Prompts shorter than this prefill in about a second: no progress bar for them."""
QUIT_WORDS = frozenset({"exit", "quit", ":q"})

if TYPE_CHECKING:  # the engine imports torch: load it only when a command needs it
    from rapid_integrations.engine.rapid_engine import RapidEngine


class DocumentError(RapidInputError):
    """The document file cannot be used; `exit_code` says why (66 missing, 65 bad content)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---- entry point ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `rapid` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if not args.progress:
        _silence_progress()
    try:
        return int(args.run(args))
    except RapidError as exc:
        print(f"rapid: error: {_explain(exc)}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        print("rapid: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def exit_code(exc: RapidError) -> int:
    """The exit status for an error the package raised on purpose."""
    if isinstance(exc, DocumentError):
        return exc.exit_code
    if isinstance(exc, RapidConfigError):
        return EXIT_USAGE
    if isinstance(exc, (ContextWindowExceededError, RapidInputError)):
        return EXIT_DATAERR
    if isinstance(exc, ModelNotFoundError):
        return EXIT_UNAVAILABLE
    return EXIT_ERROR


def _explain(exc: RapidError) -> str:
    if isinstance(exc, ContextWindowExceededError):
        return f"{exc}\nrapid: hint: or --model a model with a longer window"
    return str(exc)


# ---- arguments ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The `rapid` argument parser: subcommands ask, chat, bench and serve."""
    parser = argparse.ArgumentParser(
        prog="rapid",
        description="RAPID retrieval-augmented speculative decoding over long documents.",
        epilog="Exit codes: 0 ok, 1 error, 2 usage, 65 bad document, 66 no document, "
        "69 model unavailable, 130 interrupted.",
    )
    parser.set_defaults(command=None)
    sub = parser.add_subparsers(title="commands")
    ask = sub.add_parser("ask", help="answer one question about a text file")
    ask.add_argument("file", type=Path, help="text file to read (UTF-8 unless --encoding)")
    ask.add_argument("-q", "--question", required=True, help="the question to answer")
    _document_options(ask)
    _generation_options(ask)
    ask.set_defaults(command="ask", run=run_ask)
    chat = sub.add_parser("chat", help="a conversation about a text file (questions on stdin)")
    chat.add_argument("file", type=Path, help="text file to read (UTF-8 unless --encoding)")
    _document_options(chat)
    _generation_options(chat)
    chat.set_defaults(command="chat", run=run_chat)
    bench = sub.add_parser("bench", help="benchmark quality and speed of every method")
    _bench_options(bench)
    bench.set_defaults(command="bench", run=run_bench_command)
    from rapid_integrations.serve import server  # imports no server library until it runs

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)")
    server.add_arguments(serve)
    serve.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide progress bars"
    )
    serve.set_defaults(command="serve", run=server.run)
    return parser


def _common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model: local folder or .gguf (default: embedded)")
    p.add_argument("--draft", help="draft model (default: the target itself)")
    p.add_argument("--dtype", default="auto", help=", ".join(DTYPES))
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: CUDA when present)")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide progress bars"
    )


def _document_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encoding",
        default="utf-8",
        help="the file's text encoding, any Python codec name (default utf-8; e.g. latin-1)",
    )


def _generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        default="rapid",
        choices=MODES,
        help="rapid (default), sd, lc (target alone) or rag (draft on retrieved text)",
    )
    p.add_argument("--eta", type=float, help=f"transfer strength (default {RapidConfig.eta})")
    p.add_argument("--gamma", type=int, help=f"draft tokens per step (default {RapidConfig.gamma})")
    p.add_argument("--temperature", type=float, help="0 for greedy (default 0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1)")
    p.add_argument(
        "--max-new-tokens", type=int, help=f"answer cap (default {RapidConfig.max_new_tokens})"
    )
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument(
        "--truncation",
        choices=TRUNCATIONS,
        help="a prompt beyond the window: error (default) or keep head and tail",
    )
    p.add_argument("--retrieval-budget", type=int, help="tokens of retrieved context C^S")
    _common_options(p)


def _bench_options(p: argparse.ArgumentParser) -> None:
    """`rapid bench`'s options, in the groups its --help lists."""
    _preset_options(p.add_argument_group("presets"))
    _task_options(p.add_argument_group("tasks"))
    _method_options(p.add_argument_group("methods and models"))
    _speed_options(p.add_argument_group("speed-only runs"))
    _only_options(p)
    _common_options(p)


def _preset_options(p: argparse._ArgumentGroup) -> None:
    presets = p.add_mutually_exclusive_group()
    presets.add_argument(
        "--quick",
        dest="preset",
        action="store_const",
        const="quick",
        help="small preset (run times: docs/performance.md, Reproduce)",
    )
    presets.add_argument(
        "--long",
        dest="preset",
        action="store_const",
        const="long",
        help="speed at 16K and 32K (YaRN), every decoding variant, with bounds",
    )
    presets.add_argument(
        "--eta-sweep",
        dest="preset",
        action="store_const",
        const="eta-sweep",
        help="QA accuracy of lc, rag and rapid over eta at 2K-8K, 5 tasks per cell",
    )
    presets.add_argument(
        "--prefill",
        dest="preset",
        action="store_const",
        const="prefill",
        help="prefill speed at 8K and 32K by chunk size, against transformers",
    )
    p.add_argument("--gammas", type=_ints, help="--long: fixed gammas rapid also runs at")
    p.add_argument("--chunk-sizes", type=_ints, help="--prefill: chunk sizes tried")
    p.add_argument("--out", type=Path, help="output folder (default bench-out)")


def _task_options(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--lengths", type=_ints, help="context lengths, e.g. 2048,4096,8192")
    p.add_argument(
        "--suite",
        help="task set: standard (default: qa, short-prompt and speed suites), broad (the "
        "broad QA suite) or short (the short chat and agent prompts alone)",
    )
    p.add_argument(
        "--split", help="--suite broad: the dev half (default, to choose) or the test half"
    )
    p.add_argument("--texts", type=_words, help="--suite broad: text kinds docs,story,logs")
    p.add_argument(
        "--kinds",
        type=_words,
        help="task kinds: single,two,chat (--suite broad: also hop,absent,count)",
    )
    p.add_argument(
        "--tasks",
        dest="per_cell",
        type=int,
        help="tasks per kind and length (--suite broad: per text and question kind)",
    )
    p.add_argument("--max-new-tokens", type=int, help="answer cap of QA runs")


def _method_options(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--methods",
        type=_words,
        help="lc,rag,sd,rapid,hf,hf-pld; opt-in: magicdec (also --long), llama.cpp, "
        "llama.cpp-lookup (need rapid-integrations[llamacpp])",
    )
    p.add_argument("--etas", type=_floats, help="eta values of rapid, e.g. 0,5,10")
    p.add_argument(
        "--variants",
        type=_words,
        help="rapid variants the QA suite adds, e.g. no-lookup,paper,adaptive,deterministic",
    )
    p.add_argument("--variant-etas", type=_floats, help="eta values of the --variants")
    p.add_argument(
        "--draft-precision",
        choices=DRAFT_PRECISIONS,
        help="draft with a cheaper copy of the draft (int8-weight / int4-weight: weight-only)",
    )
    p.add_argument(
        "--target-precision",
        choices=TARGET_PRECISIONS,
        help="verify with a copy of the target (int4-weight: 4-bit weights, another model; "
        "docs/performance.md, An int4 target)",
    )
    p.add_argument(
        "--compile-draft",
        action="store_true",
        help="run the draft's decode passes through torch.compile (docs/performance.md, "
        "A compiled draft)",
    )
    p.add_argument(
        "--tiny-models",
        action="store_true",
        default=None,
        help="run the QA and speed suites on tiny random models (a smoke run)",
    )


def _speed_options(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--speed-tokens", type=int, help="tokens decoded by speed-only runs")
    p.add_argument(
        "--rounds",
        type=int,
        help="times speed-only runs repeat all their methods in turn (figures give the spread)",
    )
    p.add_argument("--speed-lengths", type=_ints, help="fixed-length speed runs ('' to skip)")
    p.add_argument(
        "--speed-kinds",
        type=_words,
        help="prompts of the speed-only runs and --long: single (default), rewrite (free-form)",
    )
    p.add_argument("--rope-lengths", type=_ints, help="RoPE-scaled speed runs ('' to skip)")
    p.add_argument(
        "--no-tiny-speed",
        dest="tiny_speed",
        action="store_false",
        default=None,
        help="skip the upward/downward runs with tiny random models",
    )


def _only_options(p: argparse.ArgumentParser) -> None:
    only = p.add_mutually_exclusive_group()
    only.add_argument(
        "--constrained",
        action="store_true",
        help="only the JSON-extraction suite under a schema (lc, rag, rapid at 4K and 8K)",
    )
    only.add_argument(
        "--logprobs",
        action="store_true",
        help="only the cost of log probabilities per token (lc, rapid at 4K; off, on, "
        "top-20, p_hat)",
    )
    only.add_argument(
        "--contention",
        action="store_true",
        help="only decode speed of lc, rapid beside one busy process (fixed vs managed threads)",
    )


def _words(text: str) -> tuple[str, ...]:
    """A comma-separated list; an empty string is an empty tuple (skips a suite)."""
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(w) for w in _words(text))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(w) for w in _words(text))


def _silence_progress() -> None:
    os.environ["TQDM_DISABLE"] = "1"  # tqdm >= 4.66 reads it: covers every library's bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# ---- documents and engines ------------------------------------------------------------------


# The control characters that file(1) takes as the mark of data, not text: C0 but BEL, BS,
# whitespace (tab, newlines, VT, FF) and ESC (terminal logs hold those), and DEL. Binary files
# (PDFs, archives, images, UTF-16 read as UTF-8) hold them.
_NOT_TEXT = re.compile(r"[\x00-\x06\x0e-\x1a\x1c-\x1f\x7f]")


def read_document(path: Path, encoding: str = "utf-8") -> str:
    """The text of `path` in `encoding`; raises `DocumentError` when it is missing, unreadable,
    not text in that encoding (undecodable, or holding NUL bytes or control characters), or
    empty, and `RapidConfigError` for an encoding Python does not know."""
    try:
        codecs.lookup(encoding)
    except LookupError as exc:
        raise RapidConfigError("encoding", f"unknown text encoding {encoding!r}") from exc
    if not path.exists():
        raise DocumentError(f"{path}: no such file", EXIT_NOINPUT)
    if path.is_dir():
        raise DocumentError(f"{path}: is a directory, not a text file", EXIT_NOINPUT)
    try:
        text = path.read_text(encoding=encoding)
    except UnicodeDecodeError as exc:
        raise DocumentError(_undecodable(path, encoding, exc), EXIT_DATAERR) from exc
    except OSError as exc:
        raise DocumentError(f"{path}: cannot read: {exc.strerror}", EXIT_NOINPUT) from exc
    control = _NOT_TEXT.search(text)
    if control:
        char = control.group()
        what = "a NUL byte" if char == "\0" else f"the control character U+{ord(char):04X}"
        raise DocumentError(
            f"{path}: not a text file: {what} at character {control.start()}; give a plain "
            "text file (extract the text of a PDF or word-processor file first)",
            EXIT_DATAERR,
        )
    if not text.strip():
        raise DocumentError(f"{path}: the document is empty", EXIT_DATAERR)
    return text


def _undecodable(path: Path, encoding: str, exc: UnicodeDecodeError) -> str:
    """The message for a file that is not text in `encoding`: where it fails, and the two ways
    to read it (name its encoding, or convert it to UTF-8)."""
    byte = exc.object[exc.start : exc.start + 1].hex()
    return (
        f"{path}: not {encoding.upper()} text (byte 0x{byte} at offset {exc.start}: "
        f"{exc.reason}); name its encoding, e.g. --encoding latin-1, or convert it to UTF-8: "
        f"iconv -f latin1 -t utf-8 {path} > {path.stem}-utf8{path.suffix}"
    )


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """`RapidConfig` fields given on the command line (validated: bad values raise
    `RapidConfigError` naming the field)."""
    fields = {
        "eta": args.eta,
        "gamma": args.gamma,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "stop": tuple(args.stop) if args.stop else None,
        "truncation": args.truncation,
        "retrieval_budget": args.retrieval_budget,
        "seed": args.seed,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    RapidConfig().replace(**given)  # fail fast, before any model loads
    return given


def build_engine(args: argparse.Namespace) -> RapidEngine:
    """The engine the options describe: --model/--draft, else the embedded default."""
    from rapid_integrations.engine.rapid_engine import RapidEngine
    from rapid_integrations.models.loading import default_model_dir, ensure_default_model
    from rapid_integrations.quiet import loading_bars

    fields = config_overrides(args)
    if args.model:
        config = RapidConfig().replace(**fields)
        with loading_bars(args.progress):  # a named model may take a while to load
            return RapidEngine(
                args.model, args.draft, config=config, device=args.device, dtype=args.dtype
            )
    if not (default_model_dir() / "config.json").is_file():
        print("rapid: converting the embedded model once (about 20 s)...", file=sys.stderr)
        ensure_default_model(progress=args.progress)
    return RapidEngine.from_default(args.draft, device=args.device, dtype=args.dtype, **fields)


# ---- ask and chat ---------------------------------------------------------------------------


def run_ask(args: argparse.Namespace) -> int:
    """`rapid ask FILE --question Q`: one answer, then its stats."""
    document = read_document(args.file, args.encoding)
    if not args.question.strip():
        raise RapidInputError("the question is empty")
    engine = build_engine(args)
    out = answer(engine, demo_messages(document, args.question), args, sys.stdout)
    if args.json:
        print(json.dumps(_json_result(args, args.question, out)))
    return EXIT_OK


def run_chat(args: argparse.Namespace) -> int:
    """`rapid chat FILE`: questions from stdin, one per line, until EOF or `quit`."""
    document = read_document(args.file, args.encoding)
    engine = build_engine(args)
    opening = demo_messages(document, "")
    size = engine.count_tokens(opening)
    if size >= engine.context_window and args.truncation != "head_tail":
        raise ContextWindowExceededError(size, engine.context_window)
    interactive = sys.stdin.isatty() and not args.json
    if interactive:
        print(f"{args.file}: {size} tokens. Ask away; 'quit' or Ctrl-D ends.", file=sys.stderr)
    history: list[dict[str, str]] = []
    for question in _questions(sys.stdin, interactive):
        turn = {"role": "user", "content": question}
        messages = [*history, turn] if history else demo_messages(document, question)
        out = answer(engine, messages, args, sys.stdout)
        if args.json:
            print(json.dumps(_json_result(args, question, out)), flush=True)
        history = [*messages, {"role": "assistant", "content": out.text.strip()}]
    return EXIT_OK


def _questions(stream: TextIO, interactive: bool) -> Iterator[str]:
    """Non-empty lines of `stream` until EOF or a quit word, prompting when interactive."""
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line or line.strip().lower() in QUIT_WORDS:
            return
        if line.strip():
            yield line.strip()


def answer(
    engine: RapidEngine, messages: list[dict[str, str]], args: argparse.Namespace, out: TextIO
) -> RapidOutput:
    """Generate the reply to `messages`. Text mode streams it to `out` and the stats to stderr;
    JSON mode only returns it."""
    with _prefill_progress(engine, messages, args.progress) as first_token:
        stream = engine.stream(messages, mode=args.mode)
        for delta in stream:
            first_token()
            if not args.json:
                out.write(delta)
                out.flush()
    result = stream.output
    assert result is not None  # the stream ran to its end
    if not args.json:
        out.write("\n")
        out.flush()  # the answer's end before the stats, when both go to one terminal
        print(format_stats(result), file=sys.stderr)
    return result


@contextmanager
def _prefill_progress(
    engine: RapidEngine, messages: list[dict[str, str]], enabled: bool
) -> Iterator[Callable[[], None]]:
    """A progress bar over the prompt tokens the target reads before the first answer token.

    The engine prefills in chunks; a forward hook on the target counts the tokens of each
    chunk as it completes. Yields a function to call on the first token: it closes the bar.
    """
    from tqdm.auto import tqdm

    total = engine.count_tokens(messages)
    show = enabled and total >= PREFILL_BAR_MIN_TOKENS
    bar = tqdm(total=total, unit="tok", desc="reading", leave=False, disable=None if show else True)

    def after(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and not bar.disable:
            bar.update(min(int(ids.shape[-1]), total - bar.n))

    handle = engine.target.register_forward_hook(after, with_kwargs=True)
    try:
        yield bar.close
    finally:
        handle.remove()
        bar.close()


def _json_result(args: argparse.Namespace, question: str, out: RapidOutput) -> dict[str, Any]:
    return {
        "file": str(args.file),
        "question": question,
        "answer": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "stats": out.stats.to_dict(),
    }


# ---- bench ----------------------------------------------------------------------------------


def run_bench_command(args: argparse.Namespace) -> int:
    """`rapid bench`: run the benchmark, write DIR/results.json, results.md and plots."""
    from rapid_integrations.bench.runner import BenchSettings, run_bench

    broad_only = [f for f, v in (("--split", args.split), ("--texts", args.texts)) if v]
    if broad_only and args.suite != "broad":  # never ignored silently
        raise RapidConfigError("suite", f"{' and '.join(broad_only)} need --suite broad")
    settings = BenchSettings.preset(
        args.preset or "full",
        gammas=args.gammas,
        chunk_sizes=args.chunk_sizes,
        out=args.out,
        lengths=args.lengths,
        kinds=args.kinds,
        per_cell=args.per_cell,
        methods=args.methods,
        etas=args.etas,
        variants=args.variants,
        variant_etas=args.variant_etas,
        max_new_tokens=args.max_new_tokens,
        speed_tokens=args.speed_tokens,
        rounds=args.rounds,
        speed_lengths=args.speed_lengths,
        speed_kinds=args.speed_kinds,
        rope_lengths=args.rope_lengths,
        tiny_speed=args.tiny_speed,
        tiny_models=args.tiny_models,
        model=args.model,
        draft=args.draft,
        draft_precision=args.draft_precision,
        target_precision=args.target_precision,
        compile_draft=args.compile_draft,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        progress=args.progress,
        suite=args.suite,
        split=args.split,
        texts=args.texts,
    )
    if args.constrained:
        from rapid_integrations.bench.constrained import run_constrained_bench

        out = run_constrained_bench(settings)
        print((out / "constrained.md").read_text())
        return EXIT_OK
    if args.logprobs:
        from rapid_integrations.bench.logprob_cost import LENGTHS, run_logprob_bench

        out = run_logprob_bench(settings, args.lengths or LENGTHS)
        print((out / "logprobs.md").read_text())
        return EXIT_OK
    if args.contention:
        from rapid_integrations.bench.contention import LENGTHS as CONTENTION_LENGTHS
        from rapid_integrations.bench.contention import run_contention_bench

        out = run_contention_bench(settings, args.lengths or CONTENTION_LENGTHS)
        print((out / "contention.md").read_text())
        return EXIT_OK
    out = run_bench(settings)
    results = json.loads((out / "results.json").read_text())
    if args.json:
        keep = ("machine", "dtype", "wall_seconds", "summary", "accuracy_cells", "speed_figures")
        print(json.dumps({"out": str(out), **{k: results.get(k) for k in keep}}))
    else:
        print((out / "results.md").read_text())
        print(f"rapid: wrote {out / 'results.json'}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
