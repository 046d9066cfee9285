"""Log probabilities through LangChain (docs/algorithm.md section 12, docs/langchain.md): in
ChatOpenAI's place and shape, `response_metadata["logprobs"] = {"content": [...]}`, and in the
OpenAI completion LLM's, `generation_info["logprobs"]`; streamed chunks carry their own
tokens' entries, so that adding them gives the whole list. Checked against the engine called
directly, and on SmolLM2 against transformers' own log-softmax."""

from __future__ import annotations

import asyncio
import functools
import operator
from typing import Any

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from transformers import PreTrainedTokenizerBase

from langchain_rapid import ChatRapid, RapidLLM
from rapid_integrations import RapidConfigError, RapidEngine, RapidOutput
from rapid_integrations.output.logprobs import token_bytes
from tests.test_logprobs import generate_logprobs

PROMPT = "abc def"
MESSAGES = [{"role": "user", "content": PROMPT}]
LONG = {"max_new_tokens": 30, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_engine(target: Any, tok: PreTrainedTokenizerBase) -> RapidEngine:
    return RapidEngine(target, tokenizer=tok)


def chat_model(engine: RapidEngine, **options: Any) -> ChatRapid:
    return ChatRapid(engine=engine, max_tokens=30, rapid_config={"ignore_eos": True}, **options)


def chat_entries(out: RapidOutput) -> list[dict[str, Any]]:
    """ChatOpenAI's `logprobs["content"]` for the engine's entries, written out field by field."""
    assert out.logprobs is not None

    def entry(e: Any) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token_bytes)}

    return [{**entry(e), "top_logprobs": [entry(t) for t in e.top_logprobs]} for e in out.logprobs]


class LogprobRecorder(BaseCallbackHandler):
    """The `logprobs` each `on_llm_new_token` receives (as ChatOpenAI passes them)."""

    def __init__(self) -> None:
        self.logprobs: list[Any] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.logprobs.append(kwargs.get("logprobs"))


# ---- ChatRapid --------------------------------------------------------------------------------


def test_invoke_fills_response_metadata_as_chatopenai(tiny_engine: RapidEngine) -> None:
    reply = chat_model(tiny_engine, logprobs=True, top_logprobs=3).invoke(PROMPT)
    out = tiny_engine.generate(MESSAGES, logprobs=True, top_logprobs=3, **LONG)
    assert reply.response_metadata["logprobs"] == {"content": chat_entries(out), "refusal": None}
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == len(out.token_ids) == 30
    assert all(len(e["top_logprobs"]) == 3 for e in content)


def test_bind_and_call_keywords_ask_per_call(tiny_engine: RapidEngine) -> None:
    """`.bind(logprobs=True)` (ChatOpenAI's documented way) and invoke keywords, over an
    instance that does not ask; without them nothing is reported."""
    chat = chat_model(tiny_engine)
    want = chat_entries(tiny_engine.generate(MESSAGES, logprobs=True, **LONG))
    assert chat.bind(logprobs=True).invoke(PROMPT).response_metadata["logprobs"]["content"] == want
    assert chat.invoke(PROMPT, logprobs=True).response_metadata["logprobs"]["content"] == want
    with_alternatives = tiny_engine.generate(MESSAGES, logprobs=True, top_logprobs=2, **LONG)
    both = chat_model(tiny_engine, logprobs=True).invoke(PROMPT, top_logprobs=2)
    assert both.response_metadata["logprobs"]["content"] == chat_entries(with_alternatives)
    plain = chat.invoke(PROMPT)
    assert "logprobs" not in plain.response_metadata
    assert all("logprobs" not in c.response_metadata for c in chat.stream(PROMPT))


def test_streamed_chunks_carry_their_tokens_and_add_up_to_invoke(
    tiny_engine: RapidEngine,
) -> None:
    chat = chat_model(tiny_engine, logprobs=True, top_logprobs=2)
    chunks = list(chat.stream(PROMPT))
    whole = functools.reduce(operator.add, chunks)
    assert whole.response_metadata["logprobs"] == chat.invoke(PROMPT).response_metadata["logprobs"]
    per_chunk = [c.response_metadata.get("logprobs", {}).get("content", []) for c in chunks]
    assert sum(map(len, per_chunk)) == 30
    assert sum(1 for entries in per_chunk if entries) > 1  # spread over the stream, not at the end


def test_astream_chunks_add_up_to_invoke(tiny_engine: RapidEngine) -> None:
    chat = chat_model(tiny_engine, logprobs=True)
    want = chat.invoke(PROMPT).response_metadata["logprobs"]

    async def collect() -> list[Any]:
        return [chunk async for chunk in chat.astream(PROMPT)]

    assert (
        functools.reduce(operator.add, asyncio.run(collect())).response_metadata["logprobs"] == want
    )


def test_p_hat_is_the_extension_field_when_asked(tiny_engine: RapidEngine) -> None:
    reply = chat_model(tiny_engine, logprobs=True, logprobs_p_hat=True).invoke(PROMPT)
    out = tiny_engine.generate(MESSAGES, logprobs=True, logprobs_p_hat=True, **LONG)
    assert out.logprobs is not None
    got = [e["p_hat_logprob"] for e in reply.response_metadata["logprobs"]["content"]]
    assert got == [e.p_hat_logprob for e in out.logprobs]


def test_a_call_without_tokens_still_reports_an_empty_list(tiny_engine: RapidEngine) -> None:
    """ "gx" is answered by end of sequence at once (by the tiny target's weights): asked for,
    the key is there all the same, as OpenAI's is."""
    reply = ChatRapid(engine=tiny_engine, logprobs=True).invoke("gx")
    assert reply.content == "" and reply.response_metadata["finish_reason"] == "eos"
    assert reply.response_metadata["logprobs"] == {"content": [], "refusal": None}
    llm = RapidLLM(engine=tiny_engine, raw_completion=True, logprobs=True)
    info = llm.generate(["gx"]).generations[0][0].generation_info
    assert info["logprobs"] == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=True, as OpenAI's
        ({"logprobs": 5}, "logprobs"),  # a bool here: the alternatives are top_logprobs
    ],
)
def test_bad_values_raise_the_packages_error(
    tiny_engine: RapidEngine, options: dict[str, Any], field: str
) -> None:
    for make in (ChatRapid, RapidLLM):
        with pytest.raises(RapidConfigError) as at_construction:
            make(engine=tiny_engine, **options)
        assert at_construction.value.field == field
    with pytest.raises(RapidConfigError) as per_call:
        chat_model(tiny_engine).invoke(PROMPT, **options)
    assert per_call.value.field == field


# ---- RapidLLM ---------------------------------------------------------------------------------


def test_llm_generation_info_has_openai_completion_logprobs(tiny_engine: RapidEngine) -> None:
    llm = RapidLLM(engine=tiny_engine, max_tokens=30, rapid_config={"ignore_eos": True})
    result = llm.generate([PROMPT], logprobs=True, top_logprobs=2)
    got = result.generations[0][0].generation_info["logprobs"]
    out = tiny_engine.generate(MESSAGES, logprobs=True, top_logprobs=2, **LONG)
    assert out.logprobs is not None
    tokens = [e.token for e in out.logprobs]
    assert got == {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in out.logprobs],
        "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in out.logprobs],
        "text_offset": [sum(map(len, tokens[:i])) for i in range(len(tokens))],
    }
    chunks = list(llm.stream(PROMPT, logprobs=True, top_logprobs=2))  # strings, as BaseLLM's
    assert "".join(chunks) == out.text
    streamed = functools.reduce(operator.add, llm._stream(PROMPT, logprobs=True, top_logprobs=2))
    assert streamed.generation_info["logprobs"] == got
    assert "logprobs" not in llm.generate([PROMPT]).generations[0][0].generation_info


def test_llm_callbacks_get_each_chunks_logprobs(tiny_engine: RapidEngine) -> None:
    """As OpenAI's LLM hands them to `on_llm_new_token`, sync and async alike."""
    llm = RapidLLM(
        engine=tiny_engine, max_tokens=30, logprobs=True, rapid_config={"ignore_eos": True}
    )
    want = llm.generate([PROMPT]).generations[0][0].generation_info["logprobs"]["tokens"]
    sync, later = LogprobRecorder(), LogprobRecorder()
    list(llm.stream(PROMPT, config={"callbacks": [sync]}))

    async def consume() -> None:
        async for _ in llm.astream(PROMPT, config={"callbacks": [later]}):
            pass

    asyncio.run(consume())
    for recorder in (sync, later):
        assert [t for lp in recorder.logprobs if lp for t in lp["tokens"]] == want


# ---- SmolLM2 against transformers -------------------------------------------------------------

DOCUMENT = (
    "The Lighthouse Keeper's Log. Day one: the fog rolled in at dawn and the bell rang twice. "
    "Day two: a fishing boat named Marigold anchored in the bay; its captain, Ines Varga, "
    "asked for fresh water. Day three: the lamp's wick was replaced and the lens polished. "
)
SMOL_MESSAGES = [
    {"role": "user", "content": f"{DOCUMENT}\n\nWho was the captain of the Marigold?"},
]


def check_against_transformers(smol: Any, content: list[dict[str, Any]], top: int) -> None:
    """Each entry's token (by its bytes), log p and top alternatives are transformers'
    greedy token and log-softmax of its `output_logits` (float32: hence 1e-4)."""
    model, tokenizer = smol
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(SMOL_MESSAGES, tokenize=False, add_generation_prompt=True)
    )
    want, logp = generate_logprobs(model, ids, len(content), len(tokenizer))
    table = token_bytes(tokenizer, len(tokenizer))
    assert [bytes(e["bytes"]) for e in content] == [table[i] for i in want]
    got = torch.tensor([e["logprob"] for e in content], dtype=torch.float64)
    assert torch.allclose(got, logp[torch.arange(len(want)), want], rtol=0, atol=1e-4)
    for entry, row in zip(content, logp, strict=True):
        alternatives = torch.tensor([t["logprob"] for t in entry["top_logprobs"]]).double()
        assert torch.allclose(alternatives, row.topk(top).values, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_eta0_greedy_chat_logprobs_equal_transformers(smol: Any, smol_engine: RapidEngine) -> None:
    chat = ChatRapid(engine=smol_engine, eta=0.0, gamma=4, max_tokens=16, logprobs=True)
    reply = chat.invoke(SMOL_MESSAGES, top_logprobs=3, ignore_eos=True)
    assert reply.response_metadata["rapid_stats"]["accepted_tokens"] > 0  # drafts were verified
    check_against_transformers(smol, reply.response_metadata["logprobs"]["content"], 3)
