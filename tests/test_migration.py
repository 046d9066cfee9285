"""docs/migration.md, executed: every Hugging Face parameter with a counterpart here is honoured.

The page's three tables (HuggingFacePipeline, ChatHuggingFace, HuggingFaceLLM) are read from
the page; each row whose counterpart is not "—" must have a check below, and the check runs
the counterpart on a tiny model (a saved folder, as a hub id would be loaded, or the objects).
Settings are checked as the exact RapidConfig overrides the adapter hands the engine, and
prompt handling against the engine called directly.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.types import BaseOutputParser, PydanticProgramMode
from transformers import AutoModelForCausalLM

from langchain_rapid import ChatRapid
from langchain_rapid import RapidLLM as LangChainLLM
from llamaindex_rapid import RapidLLM as LlamaIndexLLM
from rapid_integrations import RapidConfig, RapidConfigError, RapidEngine
from tests.doc_examples import DOCS
from tests.test_langchain_adapters import TokenCounter
from tests.test_tools import ADD
from tests.tiny import tool_engine

PAGE = DOCS / "migration.md"
PROMPT = "abc def"
TURN = [{"role": "user", "content": PROMPT}]
NONE = "—"
# The tests that need RapidConfig's top_k / min_p / repetition_penalty skip where it lacks them.
HAS_FILTERS = "top_k" in {f for f in RapidConfig.__dataclass_fields__}


def migration_rows() -> list[tuple[str, str, str]]:
    """(table, parameter, counterpart) of every row of the page's "From ..." tables."""
    rows = []
    for section in re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE):
        heading = section.partition("\n")[0]
        found = re.match(r"From `(\w+)`", heading)
        if not found:
            continue
        for line in section.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0] not in ("parameter", "---"):
                rows.append((found.group(1), cells[0], cells[1]))
    return rows


ROWS = migration_rows()
WITH_COUNTERPART = [(t, p) for t, p, c in ROWS if c != NONE]


@pytest.fixture(scope="module")
def engine(target: Any, tok: Any) -> RapidEngine:
    return RapidEngine(target, tokenizer=tok)


class Shout(BaseOutputParser):
    def parse(self, output: str) -> str:
        return output.upper()

    def format(self, query: str) -> str:
        return query


def loading_options(load: Callable[[], RapidEngine]) -> dict[str, Any]:
    """The keyword arguments `from_pretrained` received while `load()` built an engine."""
    seen: dict[str, Any] = {}
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
        assert load().generate("abc", max_new_tokens=2).token_ids
    return seen


# ---- checks: each gets the tiny model folder and an engine over the same tiny model --------

Check = Callable[[Path, RapidEngine], None]


def _pipeline_model_id(folder: Path, engine: RapidEngine) -> None:
    llm = LangChainLLM.from_model_id(str(folder), pipeline_kwargs={"max_new_tokens": 3})
    assert llm.get_engine().model_name == str(folder)
    assert llm.invoke(PROMPT) == llm.get_engine().generate(TURN, max_new_tokens=3).text


def _pipeline_task(folder: Path, engine: RapidEngine) -> None:
    assert LangChainLLM.from_model_id(str(folder), task="text-generation").model == str(folder)
    with pytest.raises(RapidConfigError, match="only 'text-generation'"):
        LangChainLLM.from_model_id(str(folder), task="summarization")


def _pipeline_backend(folder: Path, engine: RapidEngine) -> None:
    assert LangChainLLM.from_model_id(str(folder), backend="default").model == str(folder)
    with pytest.raises(RapidConfigError, match="backend"):
        LangChainLLM.from_model_id(str(folder), backend="openvino")


def _pipeline_device(folder: Path, engine: RapidEngine) -> None:
    llm = LangChainLLM.from_model_id(str(folder), device=-1)
    assert llm.device == "cpu"
    assert llm.get_engine().target.device.type == "cpu"


def _pipeline_device_map(folder: Path, engine: RapidEngine) -> None:
    llm = LangChainLLM.from_model_id(str(folder), device_map="cpu")
    assert llm.model_kwargs == {"device_map": "cpu"}
    assert loading_options(llm.get_engine)["device_map"] == "cpu"
    with pytest.raises(RapidConfigError, match="not both"):
        LangChainLLM.from_model_id(str(folder), device=-1, device_map="cpu")


def _pipeline_model_kwargs(folder: Path, engine: RapidEngine) -> None:
    llm = LangChainLLM.from_model_id(str(folder), model_kwargs={"attn_implementation": "eager"})
    assert llm.model_kwargs == {"attn_implementation": "eager"}
    assert llm.get_engine().target.config._attn_implementation == "eager"


def _pipeline_kwargs(folder: Path, engine: RapidEngine) -> None:
    llm = LangChainLLM.from_model_id(str(folder), pipeline_kwargs={"max_new_tokens": 4, "eta": 1})
    assert llm._config_overrides() == {"max_new_tokens": 4, "eta": 1}


def _generation(**pipeline_kwargs: Any) -> dict[str, Any]:
    """The RapidConfig overrides `from_model_id(pipeline_kwargs=...)` hands the engine."""
    llm = LangChainLLM.from_model_id("some/model", pipeline_kwargs=pipeline_kwargs)
    return llm._config_overrides()


def _pipeline_max_new_tokens(folder: Path, engine: RapidEngine) -> None:
    assert _generation(max_new_tokens=4) == {"max_new_tokens": 4}
    llm = LangChainLLM.from_model_id(
        str(folder), pipeline_kwargs={"max_new_tokens": 4}, rapid_config={"ignore_eos": True}
    )
    assert llm.generate([PROMPT]).generations[0][0].generation_info["usage"]["output_tokens"] == 4


def _pipeline_temperature(folder: Path, engine: RapidEngine) -> None:
    assert _generation(temperature=0.7) == {"temperature": 0.7}


@pytest.mark.skipif(not HAS_FILTERS, reason="RapidConfig.top_k not on main yet")
def _pipeline_top_k(folder: Path, engine: RapidEngine) -> None:
    assert _generation(top_k=50) == {"top_k": 50}


def _pipeline_top_p(folder: Path, engine: RapidEngine) -> None:
    assert _generation(top_p=0.9) == {"top_p": 0.9}


def _pipeline_do_sample(folder: Path, engine: RapidEngine) -> None:
    assert _generation(do_sample=False) == {"temperature": 0.0}
    assert _generation(do_sample=True) == {"temperature": 1.0}
    assert _generation(do_sample=True, temperature=0.5) == {"temperature": 0.5}
    with pytest.raises(RapidConfigError, match="do_sample=False is greedy"):
        _generation(do_sample=False, temperature=0.5)


@pytest.mark.skipif(not HAS_FILTERS, reason="RapidConfig.repetition_penalty not on main yet")
def _pipeline_repetition_penalty(folder: Path, engine: RapidEngine) -> None:
    assert _generation(repetition_penalty=1.2) == {"repetition_penalty": 1.2}


def _pipeline_return_full_text(folder: Path, engine: RapidEngine) -> None:
    assert _generation(return_full_text=False) == {}
    with pytest.raises(RapidConfigError, match="generated text only"):
        _generation(return_full_text=True)


def _pipeline_stop(folder: Path, engine: RapidEngine) -> None:
    llm = LangChainLLM(engine=engine, max_tokens=30, rapid_config={"ignore_eos": True})
    full = llm.invoke(PROMPT)
    stop = full[5:7]
    assert llm.invoke(PROMPT, stop=[stop]) == full[: full.index(stop)]


def _chat_from_model_id(folder: Path, engine: RapidEngine) -> None:
    # In the folder's float64: the call below repeats the reply's draws from the prefix cache,
    # which in bf16 may change a draw (docs/algorithm.md section 8).
    chat = ChatRapid.from_model_id(
        str(folder),
        model_kwargs={"dtype": torch.float64},
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        do_sample=True,
    )
    assert chat._config_overrides() == {"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9}
    assert chat.get_engine().target.dtype == torch.float64
    reply = chat.invoke(PROMPT)
    assert (
        reply.content
        == chat.get_engine()
        .generate(
            TURN,
            max_new_tokens=5,
            temperature=0.5,
            top_p=0.9,
            seed=reply.response_metadata["rapid_stats"]["seed"],
        )
        .text
    )


def _chat_tokenizer(folder: Path, engine: RapidEngine) -> None:
    chat = ChatRapid(model=str(folder), tokenizer=str(folder), max_tokens=4)
    assert chat.invoke(PROMPT).content == engine.generate(TURN, max_new_tokens=4).text
    assert chat.get_engine().tokenizer.get_vocab() == engine.tokenizer.get_vocab()


def _chat_model_id(folder: Path, engine: RapidEngine) -> None:
    chat = ChatRapid(model=str(folder), max_tokens=4)
    assert chat.invoke(PROMPT).content == engine.generate(TURN, max_new_tokens=4).text


def _chat_field(name: str, value: Any, config: dict[str, Any]) -> Check:
    def check(folder: Path, engine: RapidEngine) -> None:
        assert ChatRapid(engine=engine, **{name: value})._config_overrides() == config

    return check


def _chat_stop(folder: Path, engine: RapidEngine) -> None:
    chat = ChatRapid(engine=engine, max_tokens=30, rapid_config={"ignore_eos": True})
    full = chat.invoke(PROMPT).content
    stopped = chat.model_copy(update={"stop": [full[5:7]]}).invoke(PROMPT)
    assert stopped.content == full[: full.index(full[5:7])]


def _chat_streaming(folder: Path, engine: RapidEngine) -> None:
    tokens = TokenCounter()
    reply = ChatRapid(engine=engine, streaming=True, max_tokens=8).invoke(
        PROMPT, config={"callbacks": [tokens]}
    )
    assert len(tokens.tokens) > 1 and "".join(tokens.tokens) == reply.content


def _chat_logprobs(folder: Path, engine: RapidEngine) -> None:
    reply = ChatRapid(engine=engine, max_tokens=6, logprobs=True, top_logprobs=2).invoke(PROMPT)
    out = engine.generate(TURN, max_new_tokens=6, logprobs=True, top_logprobs=2)
    content = reply.response_metadata["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in content] == [
        (e.token, e.logprob) for e in out.logprobs or ()
    ]
    assert all(len(e["top_logprobs"]) == 2 for e in content)


def _chat_tools(folder: Path, engine: RapidEngine) -> None:
    """ChatHuggingFace's bind_tools / with_structured_output, by constrained decoding on a
    tiny model that can write JSON: the calls are the engine's own, the answer validates."""
    json_engine = tool_engine(5)
    spec = ADD
    chat = ChatRapid(engine=json_engine, max_tokens=150)
    message = chat.bind_tools([spec], tool_choice="add").invoke("add")
    out = json_engine.generate(
        [{"role": "user", "content": "add"}], tools=[spec], tool_choice="add", max_new_tokens=150
    )
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        (c.name, c.arguments) for c in out.tool_calls
    ]
    assert len(message.tool_calls) == 1 and 0 <= message.tool_calls[0]["args"]["a"] <= 9
    schema = spec["function"]["parameters"] | {"title": "add"}
    answer = chat.with_structured_output(schema, method="json_schema").invoke("add")
    assert set(answer) == {"a"} and 0 <= answer["a"] <= 9


def _chat_model_kwargs(folder: Path, engine: RapidEngine) -> None:
    chat = ChatRapid(model=str(folder), model_kwargs={"attn_implementation": "eager"})
    assert chat.get_engine().target.config._attn_implementation == "eager"


def _index_model_name(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(model_name=str(folder), max_new_tokens=4)
    assert llm.metadata.model_name == str(folder)
    assert llm.complete(PROMPT).text == engine.generate(TURN, max_new_tokens=4).text
    labelled = LlamaIndexLLM(model=engine.target, tokenizer=engine.tokenizer, model_name="tiny")
    assert labelled.metadata.model_name == "tiny" and labelled.get_engine().target is engine.target


def _index_model(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(model=engine.target, tokenizer=engine.tokenizer)
    assert llm.get_engine().target is engine.target


def _index_tokenizer_name(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(model=engine.target, tokenizer_name=str(folder), max_new_tokens=4)
    assert llm.get_engine().tokenizer.get_vocab() == engine.tokenizer.get_vocab()
    assert llm.complete(PROMPT).text == engine.generate(TURN, max_new_tokens=4).text


def _index_tokenizer(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(model=engine.target, tokenizer=engine.tokenizer)
    assert llm.get_engine().tokenizer is engine.tokenizer


def _index_context_window(folder: Path, engine: RapidEngine) -> None:
    assert LlamaIndexLLM(engine=engine, context_window=100).metadata.context_window == 100
    with pytest.warns(UserWarning, match="larger than the model's window"):
        assert LlamaIndexLLM(engine=engine, context_window=10**6).metadata.context_window == 512


def _index_max_new_tokens(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(engine=engine, max_new_tokens=7, rapid_config={"ignore_eos": True})
    assert llm.metadata.num_output == 7
    assert llm.complete(PROMPT).raw["usage"]["completion_tokens"] == 7


def _index_model_kwargs(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(model=str(folder), model_kwargs={"attn_implementation": "eager"})
    assert llm.get_engine().target.config._attn_implementation == "eager"


def _index_tokenizer_kwargs(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(model=str(folder), tokenizer_kwargs={"model_max_length": 77})
    assert llm.get_engine().tokenizer.model_max_length == 77


@pytest.mark.skipif(not HAS_FILTERS, reason="RapidConfig.top_k not on main yet")
def _index_generate_kwargs(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(
        engine=engine, generate_kwargs={"top_k": 50, "temperature": 0.7, "do_sample": True}
    )
    assert llm._overrides == {"top_k": 50, "temperature": 0.7}
    assert (
        llm.complete(PROMPT, seed=3).text
        == engine.generate(TURN, top_k=50, temperature=0.7, seed=3).text
    )


def _index_device_map(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(model=str(folder), device_map="cpu")
    assert loading_options(llm.get_engine)["device_map"] == "cpu"


def _index_system_prompt(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(engine=engine, system_prompt="be brief.", max_new_tokens=8)
    system = [{"role": "system", "content": "be brief."}]
    assert llm.complete(PROMPT).text == engine.generate(system + TURN, max_new_tokens=8).text


def _index_query_wrapper_prompt(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(
        engine=engine, query_wrapper_prompt="a {query_str} b", raw_completion=True, max_new_tokens=8
    )
    assert llm.complete(PROMPT).text == engine.generate(f"a {PROMPT} b", max_new_tokens=8).text


def _index_messages_to_prompt(folder: Path, engine: RapidEngine) -> None:
    def flat(messages: Any) -> str:
        return " ".join(m.content for m in messages)

    llm = LlamaIndexLLM(engine=engine, messages_to_prompt=flat, max_new_tokens=8)
    messages = [ChatMessage(role="user", content="abc"), ChatMessage(role="user", content="def")]
    assert llm.chat(messages).message.content == engine.generate("abc def", max_new_tokens=8).text


def _index_completion_to_prompt(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(engine=engine, completion_to_prompt=lambda p: f"{p}.", max_new_tokens=8)
    assert llm.complete(PROMPT).text == engine.generate(f"{PROMPT}.", max_new_tokens=8).text


def _index_is_chat_model(folder: Path, engine: RapidEngine) -> None:
    assert LlamaIndexLLM(engine=engine).metadata.is_chat_model
    assert not LlamaIndexLLM(engine=engine, is_chat_model=False).metadata.is_chat_model


def _index_callback_manager(folder: Path, engine: RapidEngine) -> None:
    counter = TokenCountingHandler()
    llm = LlamaIndexLLM(engine=engine, callback_manager=CallbackManager([counter]))
    response = llm.complete(PROMPT, max_new_tokens=5)
    assert counter.completion_llm_token_count == response.raw["usage"]["completion_tokens"]


def _index_tokenizer_outputs_to_remove(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(engine=engine, tokenizer_outputs_to_remove=["token_type_ids"])
    assert (
        llm.complete(PROMPT, max_new_tokens=4).text == engine.generate(TURN, max_new_tokens=4).text
    )


def _index_pydantic_program_mode(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(engine=engine, pydantic_program_mode=PydanticProgramMode.LLM)
    assert llm.pydantic_program_mode == PydanticProgramMode.LLM


def _index_output_parser(folder: Path, engine: RapidEngine) -> None:
    llm = LlamaIndexLLM(engine=engine, output_parser=Shout(), max_new_tokens=8)
    plain = LlamaIndexLLM(engine=engine, max_new_tokens=8)
    template = PromptTemplate("abc {x}")
    assert llm.predict(template, x="def") == plain.predict(template, x="def").upper()


CHECKS: dict[tuple[str, str], Check] = {
    ("HuggingFacePipeline", "`model_id`"): _pipeline_model_id,
    ("HuggingFacePipeline", "`task`"): _pipeline_task,
    ("HuggingFacePipeline", "`backend`"): _pipeline_backend,
    ("HuggingFacePipeline", "`device`"): _pipeline_device,
    ("HuggingFacePipeline", "`device_map`"): _pipeline_device_map,
    ("HuggingFacePipeline", "`model_kwargs`"): _pipeline_model_kwargs,
    ("HuggingFacePipeline", "`pipeline_kwargs`"): _pipeline_kwargs,
    ("HuggingFacePipeline", '`pipeline_kwargs["max_new_tokens"]`'): _pipeline_max_new_tokens,
    ("HuggingFacePipeline", '`pipeline_kwargs["temperature"]`'): _pipeline_temperature,
    ("HuggingFacePipeline", '`pipeline_kwargs["top_k"]`'): _pipeline_top_k,
    ("HuggingFacePipeline", '`pipeline_kwargs["top_p"]`'): _pipeline_top_p,
    ("HuggingFacePipeline", '`pipeline_kwargs["do_sample"]`'): _pipeline_do_sample,
    ("HuggingFacePipeline", '`pipeline_kwargs["repetition_penalty"]`'): (
        _pipeline_repetition_penalty
    ),
    ("HuggingFacePipeline", '`pipeline_kwargs["return_full_text"]`'): _pipeline_return_full_text,
    ("HuggingFacePipeline", "`stop` (per call)"): _pipeline_stop,
    (
        "ChatHuggingFace",
        "`from_model_id` generation keywords (`max_tokens`, `temperature`, "
        "`top_p`, `top_k`, `repetition_penalty`, `do_sample`)",
    ): _chat_from_model_id,
    ("ChatHuggingFace", "`tokenizer`"): _chat_tokenizer,
    ("ChatHuggingFace", "`model_id`"): _chat_model_id,
    ("ChatHuggingFace", "`temperature`"): _chat_field("temperature", 0.3, {"temperature": 0.3}),
    ("ChatHuggingFace", "`stop`"): _chat_stop,
    ("ChatHuggingFace", "`seed`"): _chat_field("seed", 5, {"seed": 5}),
    ("ChatHuggingFace", "`streaming`"): _chat_streaming,
    ("ChatHuggingFace", "`top_p`"): _chat_field("top_p", 0.8, {"top_p": 0.8}),
    ("ChatHuggingFace", "`max_tokens`"): _chat_field("max_tokens", 9, {"max_new_tokens": 9}),
    ("ChatHuggingFace", "`model_kwargs`"): _chat_model_kwargs,
    ("ChatHuggingFace", "`logprobs`, `top_logprobs`"): _chat_logprobs,
    ("ChatHuggingFace", "`bind_tools`, `with_structured_output`"): _chat_tools,
    ("HuggingFaceLLM", "`model_name`"): _index_model_name,
    ("HuggingFaceLLM", "`model`"): _index_model,
    ("HuggingFaceLLM", "`tokenizer_name`"): _index_tokenizer_name,
    ("HuggingFaceLLM", "`tokenizer`"): _index_tokenizer,
    ("HuggingFaceLLM", "`context_window`"): _index_context_window,
    ("HuggingFaceLLM", "`max_new_tokens`"): _index_max_new_tokens,
    ("HuggingFaceLLM", "`model_kwargs`"): _index_model_kwargs,
    ("HuggingFaceLLM", "`tokenizer_kwargs`"): _index_tokenizer_kwargs,
    ("HuggingFaceLLM", "`generate_kwargs`"): _index_generate_kwargs,
    ("HuggingFaceLLM", "`device_map`"): _index_device_map,
    ("HuggingFaceLLM", "`system_prompt`"): _index_system_prompt,
    ("HuggingFaceLLM", "`query_wrapper_prompt`"): _index_query_wrapper_prompt,
    ("HuggingFaceLLM", "`messages_to_prompt`"): _index_messages_to_prompt,
    ("HuggingFaceLLM", "`completion_to_prompt`"): _index_completion_to_prompt,
    ("HuggingFaceLLM", "`is_chat_model`"): _index_is_chat_model,
    ("HuggingFaceLLM", "`callback_manager`"): _index_callback_manager,
    ("HuggingFaceLLM", "`tokenizer_outputs_to_remove`"): _index_tokenizer_outputs_to_remove,
    ("HuggingFaceLLM", "`pydantic_program_mode`"): _index_pydantic_program_mode,
    ("HuggingFaceLLM", "`output_parser`"): _index_output_parser,
}


def test_every_row_with_a_counterpart_has_a_check() -> None:
    assert {"HuggingFacePipeline", "ChatHuggingFace", "HuggingFaceLLM"} == {t for t, _, _ in ROWS}
    assert sorted(WITH_COUNTERPART) == sorted(CHECKS)


@pytest.mark.parametrize("row", WITH_COUNTERPART, ids=[f"{t}:{p}" for t, p in WITH_COUNTERPART])
def test_migration_row(
    row: tuple[str, str],
    tiny_model_dir: Path,
    engine: RapidEngine,
) -> None:
    check = CHECKS[row]
    for mark in getattr(check, "pytestmark", ()):
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    check(tiny_model_dir, engine)
