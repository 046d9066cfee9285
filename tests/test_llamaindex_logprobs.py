"""Log probabilities through LlamaIndex (docs/algorithm.md section 12, docs/llamaindex.md):
`CompletionResponse.logprobs` and `ChatResponse.logprobs`, LlamaIndex's list of lists of
`LogProb` (per token: the emitted token, then its top alternatives), the text so far's in
every streamed response, as `text` is; OpenAI's chat shape in `raw["logprobs"]`. Checked
against the engine called directly, and on SmolLM2 against transformers' own log-softmax."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from llama_index.core.base.llms.types import LogProb
from llama_index.core.llms import ChatMessage

from llamaindex_rapid import RapidLLM
from rapid_integrations import RapidConfig, RapidConfigError, RapidEngine, RapidOutput
from rapid_integrations.output.logprobs import token_bytes
from tests.test_langchain_logprobs import SMOL_MESSAGES
from tests.test_logprobs import generate_logprobs

LONG = {"max_new_tokens": 30, "ignore_eos": True}
PROMPT = "abc def"
AS_MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def engine(tok: Any, target: Any, draft: Any) -> RapidEngine:
    return RapidEngine(target, draft, tokenizer=tok, config=RapidConfig(**LONG))


def expected(out: RapidOutput) -> list[list[LogProb]]:
    """Per token, the emitted token and then its alternatives, each with its bytes."""
    assert out.logprobs is not None

    def one(e: Any) -> LogProb:
        return LogProb(token=e.token, logprob=e.logprob, bytes=list(e.token_bytes))

    return [[one(e), *map(one, e.top_logprobs)] for e in out.logprobs]


def test_complete_and_chat_logprobs_are_the_engines(engine: RapidEngine) -> None:
    llm = RapidLLM(engine=engine, logprobs=True, top_logprobs=2)
    out = engine.generate(AS_MESSAGES, logprobs=True, top_logprobs=2)
    want = expected(out)
    assert len(want) == 30 and all(len(token) == 3 for token in want)
    assert llm.complete(PROMPT).logprobs == want
    chat = llm.chat([ChatMessage(role="user", content=PROMPT)])
    assert chat.logprobs == want
    assert chat.raw["logprobs"]["content"][0]["top_logprobs"][1]["token"] == want[0][2].token


def test_per_call_keywords_ask_and_nothing_is_reported_otherwise(engine: RapidEngine) -> None:
    llm = RapidLLM(engine=engine)
    want = expected(engine.generate(AS_MESSAGES, logprobs=True))
    assert llm.complete(PROMPT, logprobs=True).logprobs == want
    assert all(len(token) == 1 for token in want)  # no alternatives asked for
    plain = llm.complete(PROMPT)
    assert plain.logprobs is None and "logprobs" not in plain.raw
    assert all(r.logprobs is None for r in llm.stream_complete(PROMPT))


def test_options_combine_across_the_instance_and_the_call(engine: RapidEngine) -> None:
    """`top_logprobs` needs `logprobs`, which may come from elsewhere: the instance, its
    `rapid_config` or `generate_kwargs`, or the call."""
    want = expected(engine.generate(AS_MESSAGES, logprobs=True, top_logprobs=2))
    split = [
        ({"logprobs": True}, {"top_logprobs": 2}),
        ({"logprobs": True, "rapid_config": {"top_logprobs": 2}}, {}),
        ({"generate_kwargs": {"top_logprobs": 2}, "logprobs": True}, {}),
    ]
    for instance, call in split:
        assert RapidLLM(engine=engine, **instance).complete(PROMPT, **call).logprobs == want


def test_streamed_responses_carry_the_logprobs_so_far(engine: RapidEngine) -> None:
    """Like `text`, each response holds everything so far: the entries grow with the text and
    the last response's are the whole call's, sync and async, completion and chat."""
    llm = RapidLLM(engine=engine, logprobs=True, top_logprobs=1)
    whole = llm.complete(PROMPT).logprobs
    assert whole is not None
    messages = [ChatMessage(role="user", content=PROMPT)]

    async def collect(stream: Any) -> list[Any]:
        return [r async for r in await stream]

    streams = [
        list(llm.stream_complete(PROMPT)),
        list(llm.stream_chat(messages)),
        asyncio.run(collect(llm.astream_complete(PROMPT))),
        asyncio.run(collect(llm.astream_chat(messages))),
    ]
    for responses in streams:
        sizes = [len(r.logprobs or []) for r in responses]
        assert sizes == sorted(sizes) and len(set(sizes)) > 2  # grows over the stream
        for response in responses:
            assert response.logprobs in (None, whole[: len(response.logprobs or [])])
        assert responses[-1].logprobs == whole


def test_p_hat_rides_in_raw_in_openais_shape(engine: RapidEngine) -> None:
    response = RapidLLM(engine=engine, logprobs=True, logprobs_p_hat=True).complete(PROMPT)
    out = engine.generate(AS_MESSAGES, logprobs=True, logprobs_p_hat=True)
    assert out.logprobs is not None
    content = response.raw["logprobs"]["content"]
    assert [e["p_hat_logprob"] for e in content] == [e.p_hat_logprob for e in out.logprobs]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 5}, "logprobs"),
    ],
)
def test_bad_values_raise_the_packages_error(
    engine: RapidEngine, options: dict[str, Any], field: str
) -> None:
    with pytest.raises(RapidConfigError) as at_construction:
        RapidLLM(engine=engine, **options)
    assert at_construction.value.field == field
    with pytest.raises(RapidConfigError) as per_call:
        RapidLLM(engine=engine).complete(PROMPT, **options)
    assert per_call.value.field == field


@pytest.mark.slow
def test_eta0_greedy_chat_logprobs_equal_transformers(smol: Any, smol_engine: RapidEngine) -> None:
    """The emitted tokens (by their bytes), their log p and their alternatives are
    transformers' greedy tokens and log-softmax of its `output_logits` (float32: 1e-4)."""
    model, tokenizer = smol
    llm = RapidLLM(engine=smol_engine, eta=0.0, gamma=4, max_new_tokens=16, logprobs=True)
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in SMOL_MESSAGES]
    response = llm.chat(messages, top_logprobs=3, ignore_eos=True)
    assert response.raw["rapid_stats"]["accepted_tokens"] > 0  # drafts were verified
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(SMOL_MESSAGES, tokenize=False, add_generation_prompt=True)
    )
    want, logp = generate_logprobs(model, ids, 16, len(tokenizer))
    table = token_bytes(tokenizer, len(tokenizer))
    assert [bytes(token[0].bytes) for token in response.logprobs] == [table[i] for i in want]
    got = torch.tensor([[lp.logprob for lp in token] for token in response.logprobs]).double()
    assert torch.allclose(got[:, 0], logp[torch.arange(16), want], rtol=0, atol=1e-4)
    assert torch.allclose(got[:, 1:], logp.topk(3, dim=-1).values, rtol=0, atol=1e-4)
