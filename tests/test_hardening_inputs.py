"""Bad input at every public entry point: the engine (generate, stream), LangChain (ChatRapid,
RapidLLM), LlamaIndex (RapidLLM complete, chat) and the `rapid` CLI.

Each entry point gets the same inputs and must answer the same way: a `RapidError` subclass
naming what is wrong (the field, the sizes), or a normal answer with the fallback recorded in
the stats. Inputs a framework rejects itself, before any model runs, say so below. Cases
already pinned elsewhere (every invalid `RapidConfig` value, retriever failures inside
`prepare_draft_prompt`, bad documents for the CLI) are listed in docs/reliability.md.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.messages import HumanMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from pydantic import ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from langchain_rapid import ChatRapid
from langchain_rapid import RapidLLM as LangChainLLM
from llamaindex_rapid import RapidLLM as LlamaIndexLLM
from rapid_integrations import (
    ContextWindowExceededError,
    RapidConfig,
    RapidConfigError,
    RapidEngine,
    RapidInputError,
    RetrievalError,
)
from rapid_integrations.cli import EXIT_USAGE, main
from tests.retrieval_fixtures import HashingEmbedder
from tests.test_cli import tiny_args
from tests.tiny import reference_greedy, tiny_llama

Result = tuple[str, dict[str, Any]]  # the text, and the RapidStats as the framework reports them


def engine_generate(engine: RapidEngine, prompt: Any, **kw: Any) -> Result:
    out = engine.generate(prompt, **kw)
    return out.text, out.stats.to_dict()


def engine_stream(engine: RapidEngine, prompt: Any, **kw: Any) -> Result:
    stream = engine.stream(prompt, **kw)
    text = "".join(stream)
    assert stream.output is not None and stream.output.text == text
    return text, stream.output.stats.to_dict()


def chat_invoke(engine: RapidEngine, prompt: Any, **kw: Any) -> Result:
    message = ChatRapid(engine=engine).invoke(prompt, **kw)
    return str(message.content), message.response_metadata["rapid_stats"]


def llm_generate(engine: RapidEngine, prompt: Any, **kw: Any) -> Result:
    generation = LangChainLLM(engine=engine).generate([prompt], **kw).generations[0][0]
    return generation.text, (generation.generation_info or {})["rapid_stats"]


def index_complete(engine: RapidEngine, prompt: Any, **kw: Any) -> Result:
    response = LlamaIndexLLM(engine=engine).complete(prompt, **kw)
    return response.text, response.raw["rapid_stats"]


def index_chat(engine: RapidEngine, prompt: Any, **kw: Any) -> Result:
    response = LlamaIndexLLM(engine=engine).chat([ChatMessage(role="user", content=prompt)], **kw)
    return str(response.message.content), response.raw["rapid_stats"]


ENTRY_POINTS: dict[str, Callable[..., Result]] = {
    "engine.generate": engine_generate,
    "engine.stream": engine_stream,
    "ChatRapid.invoke": chat_invoke,
    "langchain RapidLLM.generate": llm_generate,
    "llamaindex RapidLLM.complete": index_complete,
    "llamaindex RapidLLM.chat": index_chat,
}
every_entry_point = pytest.mark.parametrize("entry", ENTRY_POINTS)


@pytest.fixture(scope="module")
def engine(target: PreTrainedModel, draft: PreTrainedModel, tok: PreTrainedTokenizerBase):
    cfg = RapidConfig(eta=2.0, gamma=4, max_new_tokens=16, ignore_eos=True)
    return RapidEngine(target, draft, tokenizer=tok, config=cfg)


# ---- prompts ----------------------------------------------------------------------------------


@every_entry_point
@pytest.mark.parametrize("prompt", ["", " \n\t "], ids=["empty", "whitespace"])
def test_empty_prompts_raise_input_errors(engine: RapidEngine, entry: str, prompt: str) -> None:
    with pytest.raises(RapidInputError, match="empty"):
        ENTRY_POINTS[entry](engine, prompt)


@pytest.mark.parametrize(
    "entry", ["engine.generate", "engine.stream", "llamaindex RapidLLM.complete"]
)
# object()'s own repr holds its address: pytest-xdist's workers must collect the same ids.
@pytest.mark.parametrize(
    "prompt", [3.5, None, b"abc", [1.5], pytest.param(object(), id="object()")], ids=repr
)
def test_prompts_of_the_wrong_type_raise_input_errors(
    engine: RapidEngine, entry: str, prompt: object
) -> None:
    with pytest.raises(RapidInputError, match="must be"):
        ENTRY_POINTS[entry](engine, prompt)


@pytest.mark.parametrize("model", [ChatRapid, LangChainLLM])
@pytest.mark.parametrize("prompt", [3.5, None, [{"role": "wizard", "content": "x"}]], ids=repr)
def test_langchain_rejects_wrong_types_itself(
    engine: RapidEngine, model: type[ChatRapid | LangChainLLM], prompt: object
) -> None:
    """LangChain's own input coercion raises (a ValueError) before the model is called."""
    with pytest.raises(ValueError, match=r"Invalid input type|Unexpected message type"):
        model(engine=engine).invoke(prompt)


@every_entry_point
def test_prompt_over_the_window_names_both_sizes(engine: RapidEngine, entry: str) -> None:
    with pytest.raises(
        ContextWindowExceededError, match=r"has \d+ tokens but .* window is 512"
    ) as caught:
        ENTRY_POINTS[entry](engine, "abc " * 200)
    assert caught.value.prompt_tokens > 512 and caught.value.context_window == 512


def test_the_window_error_names_where_truncation_goes_and_each_named_form_works(
    engine: RapidEngine,
) -> None:
    long = "abc " * 200
    with pytest.raises(ContextWindowExceededError) as caught:
        engine.generate(long)
    message = str(caught.value)
    for form in ("RapidConfig(", "rapid_config=", "extra_body=", "--truncation head_tail"):
        assert form in message
    assert "retriev" in message and "docs/retrieval.md" in message
    # The constructor forms it names (the per-call ones: the test below): none raises.
    head_tail = {"truncation": "head_tail"}
    ChatRapid(engine=engine, rapid_config=head_tail).invoke(long)
    LlamaIndexLLM(engine=engine, rapid_config=head_tail).complete(long)
    RapidEngine(engine.target, engine.draft, engine.tokenizer, RapidConfig(**head_tail)).generate(
        long
    )


@every_entry_point
def test_head_tail_truncation_fits_the_window(engine: RapidEngine, entry: str) -> None:
    _, stats = ENTRY_POINTS[entry](engine, "abc " * 200, truncation="head_tail")
    assert stats["target_context_tokens"] + stats["new_tokens"] <= 512


ADAPTERS = {"ChatRapid": ChatRapid, "langchain RapidLLM": LangChainLLM, "llamaindex": LlamaIndexLLM}


def _stats_of(model: Any, prompt: str) -> dict[str, Any]:
    if isinstance(model, ChatRapid):
        return model.invoke(prompt).response_metadata["rapid_stats"]
    if isinstance(model, LangChainLLM):
        return (model.generate([prompt]).generations[0][0].generation_info or {})["rapid_stats"]
    return model.complete(prompt).raw["rapid_stats"]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_truncation_as_a_constructor_argument(engine: RapidEngine, adapter: str) -> None:
    """What the window error says to pass works where users pass settings first: the
    constructor (any RapidConfig field, into rapid_config), in both frameworks alike."""
    model = ADAPTERS[adapter](engine=engine, truncation="head_tail")
    assert model.rapid_config == {"truncation": "head_tail"}
    stats = _stats_of(model, "abc " * 200)
    assert stats["target_context_tokens"] + stats["new_tokens"] <= 512
    with pytest.raises(RapidConfigError, match=r"^truncation: given twice"):
        ADAPTERS[adapter](engine=engine, truncation="error", rapid_config={"truncation": "error"})


def test_head_tail_truncation_keeps_the_head_and_the_tail(
    engine: RapidEngine, tok: PreTrainedTokenizerBase
) -> None:
    """What the target reads is the prompt's first tokens followed by its last ones."""
    ids = tok.encode("kab " * 20 + "abcdefghijkl " * 46 + " def ghi")
    read: list[int] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        read.extend(kwargs["input_ids"][0].tolist())

    hook = engine.target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = engine.generate(
            ids, mode="lc", truncation="head_tail", max_new_tokens=2, prefix_cache_bytes=0
        )
    finally:
        hook.remove()
    seen = read[: out.prompt_tokens]
    assert len(seen) == out.prompt_tokens < 512 - 1
    head = next(i for i, (a, b) in enumerate(zip(seen, ids, strict=False)) if a != b)
    assert seen == ids[:head] + ids[len(ids) - (len(seen) - head) :]
    assert head >= 80 and len(seen) - head >= 8  # the instruction and the question


def test_draft_prompt_over_the_drafts_window_names_the_draft(
    tok: PreTrainedTokenizerBase, target: PreTrainedModel
) -> None:
    small_draft = tiny_llama(len(tok), seed=2, layers=1, window=64)
    engine = RapidEngine(target, small_draft, tokenizer=tok)
    with pytest.raises(ContextWindowExceededError, match="the draft prompt has 100 tokens"):
        engine.generate("abc", "a" * 100)
    assert engine.generate("abc " * 30, mode="sd", truncation="head_tail", max_new_tokens=4).text


def test_prompts_at_the_edges_of_the_window(
    engine: RapidEngine, target: PreTrainedModel, tok: PreTrainedTokenizerBase
) -> None:
    """One token, and one short of the window (room for exactly one new token), both work."""
    assert engine.generate([5], mode="lc", max_new_tokens=3).token_ids == reference_greedy(
        target, [5], 3, len(tok)
    )
    out = engine.generate([5] * 511, mode="lc")
    assert (len(out.token_ids), out.finish_reason) == (1, "length")
    with pytest.raises(ContextWindowExceededError):
        engine.generate([5] * 512, mode="lc")


@pytest.mark.parametrize(
    "ids", [[5, True], [5, -1], [5, 10**6], [5, 2.0], torch.tensor([[5, 6]])], ids=repr
)
def test_bad_token_ids_raise_input_errors(engine: RapidEngine, ids: object) -> None:
    with pytest.raises(RapidInputError, match="token ids must be integers"):
        engine.generate(ids, "a")


@every_entry_point
def test_cjk_emoji_and_control_characters(engine: RapidEngine, entry: str) -> None:
    """Characters outside the vocabulary read as unknown tokens; nothing breaks, nothing
    garbled comes out (the byte-level case is fuzzed in test_hardening_fuzz)."""
    text, stats = ENTRY_POINTS[entry](
        engine, "naïve 你好，世界 🎉👩‍👩‍👧 \x00\x07\x1b\u200b\ufeff abc"
    )
    assert stats["new_tokens"] > 0 and "\ufffd" not in text


@pytest.mark.slow
def test_multibyte_text_through_the_real_model(smol_engine: RapidEngine) -> None:
    """Byte-level BPE: emoji and CJK characters span several tokens, in the prompt and in the
    answer; a stop string taken from the answer is found across token boundaries."""
    prompt = [{"role": "user", "content": "Translate to Chinese, add an emoji: good morning 🌅"}]
    settings = {"max_new_tokens": 24, "eta": 0.0}
    out = smol_engine.generate(prompt, **settings)
    stream = smol_engine.stream(prompt, **settings)
    assert "".join(stream) == out.text and "\ufffd" not in out.text
    stop = out.text.strip()[1:4]
    cut = smol_engine.generate(prompt, stop=[stop], **settings)
    assert cut.finish_reason == "stop" and cut.text == out.text[: out.text.index(stop)]


# ---- generation settings ---------------------------------------------------------------------

INVALID = [
    ("max_new_tokens", 0),
    ("max_new_tokens", -1),
    ("gamma", 0),
    ("top_p", 1.5),
    ("temperature", -1.0),
    ("eta", math.nan),
    ("residual", "none"),
    ("no_such_field", 1),
]


@every_entry_point
@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v}" for f, v in INVALID])
def test_invalid_settings_per_call_name_the_field(
    engine: RapidEngine, entry: str, field: str, value: object
) -> None:
    with pytest.raises(RapidConfigError) as caught:
        ENTRY_POINTS[entry](engine, "abc", **{field: value})
    assert caught.value.field == field


@every_entry_point
def test_a_misspelt_call_option_names_itself(engine: RapidEngine, entry: str) -> None:
    """Call options that are not RapidConfig fields (draft_prompt, tool_choice, ...) are
    checked by name too, when the call's options are built."""
    with pytest.raises(RapidConfigError) as caught:
        ENTRY_POINTS[entry](engine, "abc", draft_promt="a")
    assert caught.value.field == "draft_promt"


@every_entry_point
def test_stop_string_split_across_tokens(engine: RapidEngine, entry: str) -> None:
    """Every character is a token here, so a three-character stop spans three tokens."""
    full, _ = ENTRY_POINTS[entry](engine, "kab def", max_new_tokens=30)
    stop = full[10:13]
    text, stats = ENTRY_POINTS[entry](engine, "kab def", max_new_tokens=30, stop=[stop, "zzzz"])
    assert text == full[: full.index(stop)]
    assert stats["new_tokens"] >= len(text)


# ---- messages --------------------------------------------------------------------------------


def test_every_llamaindex_role_reaches_a_chat_role(engine: RapidEngine) -> None:
    """LlamaIndex's roles are an enum (unknown ones fail its own validation); each maps onto a
    role the chat template accepts, so none is dropped; function messages (OpenAI's old form,
    without call ids) are refused (docs/migration.md, tool messages)."""
    llm = LlamaIndexLLM(engine=engine)
    for role in set(MessageRole) - {MessageRole.FUNCTION}:
        messages = [ChatMessage(role=role, content="abc"), ChatMessage(role="user", content="d")]
        assert llm.chat(messages, max_new_tokens=2).raw["rapid_stats"]["new_tokens"] == 2
    with pytest.raises(RapidInputError, match="message 1: a function message"):
        llm.chat([ChatMessage(role="user", content="a"), ChatMessage(role="function", content="4")])
    with pytest.raises(ValidationError):
        ChatMessage(role="wizard", content="x")


def test_langchain_tool_messages_are_read_not_dropped(engine: RapidEngine) -> None:
    """ChatRapid renders tool results through the engine (docs/agents.md,
    tests/test_langchain_tools.py): the result adds to what the model reads."""
    chat = ChatRapid(engine=engine, max_tokens=1)
    alone = chat.invoke([HumanMessage("a")]).usage_metadata["input_tokens"]
    result = chat.invoke([HumanMessage("a"), ToolMessage("4", tool_call_id="c")])
    assert result.usage_metadata["input_tokens"] > alone


def test_content_a_text_model_cannot_read_is_refused_not_dropped(engine: RapidEngine) -> None:
    image = ImageBlock(url="https://example.com/a.png")
    message = ChatMessage(role="user", blocks=[TextBlock(text="what is this?"), image])
    with pytest.raises(RapidInputError, match="'image' content is not supported"):
        LlamaIndexLLM(engine=engine).chat([message])
    with pytest.raises(RapidInputError, match="'image' content is not supported"):
        ChatRapid(engine=engine).invoke(
            [HumanMessage([{"type": "image", "url": "https://example.com/a.png"}])]
        )


# ---- retrievers that fail ---------------------------------------------------------------------


class Hangs:
    """A retriever that blocks until released (at teardown, so no thread outlives the test)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def retrieve(self, query: str) -> list[str]:
        self.release.wait(30)
        return ["too late"]


class Raises:
    def retrieve(self, query: str) -> list[str]:
        raise ConnectionError("vector store is down")


class Returns:
    def __init__(self, value: object) -> None:
        self.value = value

    def retrieve(self, query: str) -> Any:
        return self.value


RETRIEVERS: dict[str, tuple[Callable[[], Any], str]] = {
    "raises": (Raises, "retriever raised ConnectionError: vector store is down"),
    "hangs": (Hangs, "retriever timed out after 0.2 s"),
    "dict": (lambda: Returns({"a": 1}), "retriever returned dict, expected list[str]"),
    "ints": (lambda: Returns([1, 2]), "retriever returned list[int], expected list[str]"),
    "none": (lambda: Returns(None), "retriever returned NoneType, expected list[str]"),
}
RETRIEVAL = {
    "retrieval_budget": 8,
    "retrieval_timeout": 0.2,
    "retrieval_embedder": HashingEmbedder(),
    "retrieval_threshold": -1.0,
}
LONG_PROMPT = "notes.\n\n" + "abc def ghi. " * 12 + "\n\nkab def?"


@pytest.fixture
def failing_retriever(request: pytest.FixtureRequest) -> Iterator[tuple[Any, str]]:
    make, reason = RETRIEVERS[request.param]
    retriever = make()
    yield retriever, reason
    if isinstance(retriever, Hangs):
        retriever.release.set()


@every_entry_point
@pytest.mark.parametrize("failing_retriever", RETRIEVERS, indirect=True)
def test_failing_retrievers_fall_back_and_say_so(
    engine: RapidEngine, entry: str, failing_retriever: tuple[Any, str]
) -> None:
    retriever, reason = failing_retriever
    _, stats = ENTRY_POINTS[entry](engine, LONG_PROMPT, retriever=retriever, **RETRIEVAL)
    assert stats["retrieval_fallback"] == reason
    assert (
        stats["mode"] == "rapid"
        and 0 < stats["draft_context_tokens"] < stats["target_context_tokens"]
    )
    assert stats["new_tokens"] == 16


def test_failing_retriever_with_lc_or_raise_fallback(engine: RapidEngine) -> None:
    """The other two policies, seen from the engine: decode with the target alone, or raise."""
    out = engine.generate(LONG_PROMPT, retriever=Raises(), retrieval_fallback="lc", **RETRIEVAL)
    assert out.stats.mode == "lc" and out.stats.retrieval_fallback is not None
    assert out.token_ids == engine.generate(LONG_PROMPT, mode="lc").token_ids
    with pytest.raises(RetrievalError, match="vector store is down"):
        engine.generate(LONG_PROMPT, retriever=Raises(), retrieval_fallback="raise", **RETRIEVAL)


# ---- the command line ---------------------------------------------------------------------------


@pytest.fixture
def document(tmp_path: Path) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text("a cab. 你好，世界 🎉 \x07 a bad deal.\n" * 8, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("--max-new-tokens", "0", "max_new_tokens"),
        ("--max-new-tokens", "-1", "max_new_tokens"),
        ("--top-p", "2", "top_p"),
        ("--temperature", "-1", "temperature"),
        ("--eta", "nan", "eta"),
        ("--retrieval-budget", "0", "retrieval_budget"),
    ],
)
def test_cli_invalid_values_exit_2_naming_the_field(
    document: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, field: str
) -> None:
    argv = ["ask", str(document), "-q", "x", option, value, "--model", "/never/loaded"]
    assert main(argv) == EXIT_USAGE
    assert f"rapid: error: {field}:" in capsys.readouterr().err


def test_cli_wrong_types_are_usage_errors(document: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ask", str(document), "-q", "x", "--gamma", "many"])
    assert exited.value.code == EXIT_USAGE


def test_cli_reads_cjk_emoji_and_control_characters_and_stops_across_tokens(
    document: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["ask", str(document), "-q", "what deal? 你好 🎉", *tiny_args(tiny_model_dir, "--json")]
    argv[argv.index("--max-new-tokens") + 1] = "30"
    assert main([*argv, "--seed", "1"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["stats"]["target_context_tokens"] > 0 and "\ufffd" not in full["answer"]
    answer = full["answer"]
    assert len(answer) >= 10  # the tiny model's answer to this question: 29 characters
    stop = answer[len(answer) // 2 :][:3]
    assert main([*argv, "--seed", "1", "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["finish_reason"] == "stop"
    assert cut["answer"] == answer[: answer.index(stop)]
