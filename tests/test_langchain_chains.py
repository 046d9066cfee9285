"""Real LangChain chains, run as docs/langchain.md shows them, on SmolLM2.

The page is executed like a notebook: one namespace, one section per test, with `document`
preset to a long text with a planted fact. Each section's results are checked here, so the
page's claims (right answers, short draft contexts, equal batch results) are tested, and the
docs cannot drift from the code. The RAG section's acceptance rate and decode speed, against
the same chain on the target alone, are printed (`-s`) and attached to the test report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rapid_integrations import RapidInputError
from rapid_integrations.bench.recall import haystack
from tests.doc_examples import DOCS, python_sections
from tests.retrieval_fixtures import smol_tokenizer
from tests.test_langchain_reasoning import save_reasoning_model

PAGE = DOCS / "langchain.md"
SECTIONS = python_sections(PAGE)
FACT = "The access code of the amber otter vault is 4721."  # the docs ask for it
ANSWER = "4721"
# Long for the draft (its retrieved context is ~100-200 tokens), short enough for two CPU
# cores: at 8K tokens the target's prefill alone takes ~30 s here.
DOCUMENT_TOKENS = 1200


def draft_reads_less(stats: dict[str, Any], factor: int) -> bool:
    return stats["draft_context_tokens"] * factor < stats["target_context_tokens"]


def _check_chat_model(ns: dict[str, Any]) -> None:
    assert "Paris" in ns["reply"].content
    usage = ns["reply"].usage_metadata
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens"] == ns["stats"]["new_tokens"] > 0
    assert ns["stats"]["mode"] == "rapid"


def _check_lcel(ns: dict[str, Any]) -> None:
    assert ANSWER in ns["result"]["answer"]
    assert draft_reads_less(ns["result"]["stats"], 5), "the draft read the whole document"


def _check_rag(ns: dict[str, Any]) -> dict[str, Any]:
    assert ANSWER in ns["rag"]["answer"]
    rapid, alone = ns["rag"]["stats"], ns["target_alone"]["stats"]
    assert rapid["retrieval_fallback"] is None, "the vector store was not used"
    assert 0 < rapid["retrieved_tokens"] <= 2 * 400  # k=2 chunks of at most 400 characters
    assert draft_reads_less(rapid, 3)
    assert rapid["drafted_tokens"] > 0
    assert (alone["mode"], alone["drafted_tokens"]) == ("lc", 0)
    report = {
        "context_tokens": rapid["target_context_tokens"],
        "draft_context_tokens": rapid["draft_context_tokens"],
        "rapid_acceptance_rate": round(rapid["acceptance_rate"], 3),
        "rapid_decode_tokens_per_second": round(rapid["decode_tokens_per_second"], 2),
        "lc_decode_tokens_per_second": round(alone["decode_tokens_per_second"], 2),
        "lc_answer": str(ns["target_alone"]["answer"]),  # .text is a str subclass xdist cannot send
    }
    return report


def _check_history(ns: dict[str, Any]) -> None:
    assert "3958" in ns["last"].content  # the locker code told in the first turn
    assert draft_reads_less(ns["last"].response_metadata["rapid_stats"], 10)
    assert len(ns["history"]) == 2 + 3 * 2 + 2


def _check_streaming(ns: dict[str, Any]) -> None:
    assert len(ns["pieces"]) > 2
    assert all(answer.strip() for answer in ns["async_answers"])
    assert ns["batched"] == ns["sequential"]


def _check_logprobs(ns: dict[str, Any]) -> None:
    reply, tokens = ns["capital"], ns["tokens"]
    assert "Paris" in reply.content
    assert len(tokens) == reply.usage_metadata["output_tokens"]
    assert b"".join(bytes(t["bytes"]) for t in tokens).decode() == reply.content
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in tokens)
    assert ns["streamed"] == reply.response_metadata["logprobs"]


def _check_reasoning(ns: dict[str, Any]) -> None:
    thought = ns["thought"]
    reasoning = thought.additional_kwargs["reasoning_content"]
    assert reasoning and thought.content_blocks[0] == {"type": "reasoning", "reasoning": reasoning}
    details = thought.usage_metadata["output_token_details"]
    assert details == {"reasoning": 12 + len("</think>")}  # the budget, then the end marker
    assert ns["streamed_thought"] == reasoning
    chunks = ns["call_chunks"]
    assert sum(bool(c.tool_call_chunks) for c in chunks) > 1  # streamed, not only at the end
    [call] = ns["streamed_call"].tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    invoked = ns["caller"].invoke("Weather in Paris?").tool_calls
    assert [(c["name"], c["args"]) for c in invoked] == [(call["name"], call["args"])]


def _check_llm(ns: dict[str, Any]) -> None:
    assert ANSWER in ns["text_answer"]
    assert "\n" not in ns["text_answer"]
    info = ns["generation"].generation_info
    assert info["finish_reason"] in ("stop", "eos")
    assert draft_reads_less(info["rapid_stats"], 5)


def _check_from_model_id(ns: dict[str, Any]) -> None:
    assert "Paris" in ns["capital"]
    question = "What is the capital of France?"
    count = len(smol_tokenizer().encode(question, add_special_tokens=False))
    assert ns["hf_style"].get_num_tokens(question) == count


def _check_errors(ns: dict[str, Any]) -> None:
    assert isinstance(ns["rejected"], RapidInputError)
    assert "FunctionMessage" in str(ns["rejected"])


# Each check asserts on a section's results; it may return figures worth reporting.
CHECKS: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
    "A chat model": _check_chat_model,
    "An LCEL chain over a long document": _check_lcel,
    "RAG: your vector store feeds the draft": _check_rag,
    "A conversation with message history": _check_history,
    "Streaming, async and batch": _check_streaming,
    "Log probabilities": _check_logprobs,
    "Reasoning models and streamed tool calls": _check_reasoning,
    "RapidLLM for string prompts": _check_llm,
    "Coming from `HuggingFacePipeline`": _check_from_model_id,
    "Errors": _check_errors,
}


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The page's namespace: `document` is standard-library docstrings with FACT in the middle;
    `reasoning_model` a tiny model folder whose template opens a think section."""
    paragraphs = haystack(DOCUMENT_TOKENS, smol_tokenizer())
    middle = len(paragraphs) // 2
    return {
        "document": "\n\n".join([*paragraphs[:middle], FACT, *paragraphs[middle:]]),
        "reasoning_model": str(save_reasoning_model(tmp_path_factory.mktemp("reasoning-model"))),
    }


def test_every_docs_section_with_code_is_checked() -> None:
    assert [heading for heading, _ in SECTIONS] == list(CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize(("heading", "code"), SECTIONS, ids=[heading for heading, _ in SECTIONS])
def test_docs_chain(
    heading: str,
    code: str,
    namespace: dict[str, Any],
    record_property: Callable[[str, Any], None],
) -> None:
    exec(compile(code, f"{PAGE.name}: {heading}", "exec"), namespace)
    figures = CHECKS[heading](namespace)
    if figures:
        record_property(heading, figures)
        print(f"\n{heading}: {figures}")
