"""A grammar that fails while a model drafter asks it for masks costs its own request its drafts, nothing more: the
other requests of the drafting call keep drafting, and every request's tokens are plain decoding's (greedy, a tiny
random Llama drafting for itself)."""
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.structured.grammar import GrammarError, GrammarMatcher
from specserve.worker.structured import GrammarRequests
from tests.worker.test_structured import ENGINE, _peaked_model, _prompts, _save_with_tokenizer

HEALTHY = StructuredOutputsParams(regex="[a-z ]+")
FAILING = StructuredOutputsParams(regex="[a-z ,]+")  # another grammar, so the injected fault can tell it apart


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _save_with_tokenizer(_peaked_model(), tmp_path_factory.mktemp("tiny_llama_drafting_faults"))


def _generate(llm: LLM):
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=s)
              for s in (FAILING, HEALTHY, HEALTHY, HEALTHY)]
    return llm.generate(_prompts(4), params, use_tqdm=False)


def _fail_masks_while_drafting(monkeypatch, failing_grammar) -> None:
    """The failing grammar's matcher raises whenever a drafter asks it for a mask (never when the target's rows
    are masked)."""
    drafting = {"now": False}
    allowed_next, fill = GrammarRequests.allowed_next, GrammarMatcher._fill

    def marked_allowed_next(self, req_ids):
        allowed = allowed_next(self, req_ids)

        def marked(i, drafts):
            drafting["now"] = True
            try:
                return allowed(i, drafts)
            finally:
                drafting["now"] = False
        return marked

    def failing_fill(self, words):
        if drafting["now"] and self._compiled is failing_grammar:
            raise GrammarError("injected while drafting")
        fill(self, words)

    monkeypatch.setattr(GrammarRequests, "allowed_next", marked_allowed_next)
    monkeypatch.setattr(GrammarMatcher, "_fill", failing_fill)


def test_a_grammar_failing_while_drafting_stops_only_its_requests_drafts(folder, monkeypatch):
    plain = [o.outputs[0].token_ids for o in _generate(LLM(model=folder, **ENGINE))]
    llm = LLM(model=folder, speculative_config={"method": "draft_model", "model": folder, "num_speculative_tokens": 3,
                                                "adaptive_draft_length": False}, **ENGINE)
    _fail_masks_while_drafting(monkeypatch, llm.llm_engine.compile_grammar(FAILING))
    outputs = _generate(llm)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    assert all(o.outputs[0].finish_reason != "error" for o in outputs)
    assert outputs[0].metrics.num_draft_tokens == 0
    for out in outputs[1:]:  # still drafting after the other request's grammar failed, and accepted
        assert out.metrics.num_draft_tokens >= len(out.outputs[0].token_ids) // 2 > 0
    assert not llm.llm_engine.runner.grammars.drafting_errors
