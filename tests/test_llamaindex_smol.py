"""RAPID against the target alone inside one LlamaIndex query engine, on SmolLM2.

The same compact query engine over the long document runs twice: with RAPID (the draft reads
the retriever adapter's two nodes) and with the target alone (mode="lc"). Both must answer;
RAPID's draft must read a much shorter context. The figures are printed (`pytest -s`) for
the record; speed is not asserted, because this machine's cores are shared.
"""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, LlamaDebugHandler
from llama_index.core.node_parser import SentenceSplitter

from llamaindex_rapid import RapidLLM, RapidRetrieverAdapter
from rapid_integrations import RapidEngine
from tests.llamaindex_data import ANSWER, GENERATE, QUESTION, long_document

pytest_plugins = ["tests.llamaindex_fixtures"]


def _query(index: VectorStoreIndex, llm: RapidLLM) -> tuple[str, dict[str, Any]]:
    """The compact query engine's answer and the stats of its (single) LLM call."""
    engine = index.as_query_engine(llm=llm, similarity_top_k=100, response_mode="compact")
    # After building the engine: its synthesizer replaces the LLM's callback manager.
    debug = LlamaDebugHandler(print_trace_on_end=False)
    llm.callback_manager = CallbackManager([debug])
    answer = str(engine.query(QUESTION))
    (_, end), *more = debug.get_llm_inputs_outputs()
    assert not more, "compact mode should make exactly one LLM call"
    return answer, end.payload["response"].raw["rapid_stats"]


@pytest.mark.slow
def test_compact_query_engine_rapid_versus_target_alone(
    default_engine: RapidEngine, embed_model: Any
) -> None:
    index = VectorStoreIndex.from_documents(
        [Document(text=long_document())],
        embed_model=embed_model,
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0)],
    )
    adapter = RapidRetrieverAdapter(index, similarity_top_k=2)
    runs = {
        mode: _query(
            index,
            RapidLLM(engine=default_engine, retriever=adapter, mode=mode, generate_kwargs=GENERATE),
        )
        for mode in ("rapid", "lc")
    }
    for mode, (answer, stats) in runs.items():
        print(
            f"\n{mode}: {answer!r} target={stats['target_context_tokens']} "
            f"draft={stats['draft_context_tokens']} acceptance={stats['acceptance_rate']:.2f} "
            f"decode={stats['decode_tokens_per_second']:.1f} tok/s "
            f"prefill={stats['prefill_seconds']:.1f}s passes={stats['target_forward_passes']}"
        )
        assert ANSWER in answer
    rapid = runs["rapid"][1]
    assert rapid["mode"] == "rapid" and rapid["retrieval_fallback"] is None
    assert rapid["draft_context_tokens"] * 3 < rapid["target_context_tokens"]
    assert rapid["target_forward_passes"] < runs["lc"][1]["target_forward_passes"]
