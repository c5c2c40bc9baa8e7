"""Structured output in the runner, on a tiny random Llama with the default model's tokenizer: constrained
greedy output is the same with every speculative method as without, drafts the grammar refuses are cut before
verification, the grammar's forced tokens are drafted, and random sampling keeps the masked target distribution."""
import collections
import json

import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.structured.grammar import GrammarMatcher
from specserve.tokenizer import load_tokenizer
from tests.tiny_models import tiny_hf_model

VOCAB = 49152
ENGINE = dict(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=512, block_size=16, kv_cache_memory_bytes=64 << 20)
SCHEMA = {"type": "object", "properties": {"temperature_celsius": {"type": "integer"},
                                           "weather_condition": {"enum": ["sunny", "cloudy", "rain"]}},
          "required": ["temperature_celsius", "weather_condition"], "additionalProperties": False}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"(ab|ba)+c{2,4}"),
    "choice": StructuredOutputsParams(choice=["the quick brown fox", "the lazy dog", "a cat"]),
}


def _peaked_model():
    """A tiny random Llama whose LM head is scaled up: random weights give nearly flat next-token
    distributions over 49152 ids; scaled, a few tokens carry most of the mass, as in a trained model."""
    model = tiny_hf_model("llama", vocab_size=VOCAB, max_position_embeddings=512)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


def _save_with_tokenizer(model, path) -> str:
    model.save_pretrained(str(path))
    tok = load_tokenizer(None)
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": tok.eos_token, "bos_token": tok.bos_token}))
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama over the default model's 49152-token vocabulary (peaked), with its tokenizer."""
    return _save_with_tokenizer(_peaked_model(), tmp_path_factory.mktemp("tiny_llama_smollm_vocab"))


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory):
    """The same model with every weight nudged: a draft model whose q is close to the target's p but not
    equal, so its drafts are often allowed by a grammar and sometimes rejected."""
    model = _peaked_model()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    return _save_with_tokenizer(model, tmp_path_factory.mktemp("near_draft"))


def _prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 4000, (8 + 3 * i,), generator=g).tolist() for i in range(n)]


def _greedy(folder: str, structured, spec: dict | None = None, max_tokens: int = 40):
    llm = LLM(model=folder, speculative_config=spec, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    "auto": {"method": "auto"},
}


@pytest.mark.parametrize("kind,method", [("json", m) for m in SPECS] + [("regex", "suffix"), ("regex", "auto"),
                                                                         ("regex", "draft_model"),
                                                                         ("choice", "draft_model")])
def test_constrained_greedy_output_is_the_same_with_speculation(kind, method, folder):
    plain, _ = _greedy(folder, CONSTRAINTS[kind])
    spec = dict(SPECS[method], model=folder) if method == "draft_model" else SPECS[method]
    outputs, llm = _greedy(folder, CONSTRAINTS[kind], dict(spec, adaptive_draft_length=False))
    assert outputs == plain
    m = llm.get_metrics()
    if kind == "json":  # the schema's keys are forced: drafted whatever the method
        assert m.num_drafts > 0
    if method == "draft_model":  # the target's own weights drafting under the grammar's masks: right
        assert m.num_drafts > 0 and m.num_accepted_tokens >= 0.9 * m.num_draft_tokens
    tok = llm.get_tokenizer()
    for ids in outputs:  # the constraint holds on what was generated (a random model: maybe cut short)
        matcher = GrammarMatcher(llm.llm_engine._grammar_compiler.compile(CONSTRAINTS[kind].kind,
                                                                          CONSTRAINTS[kind].spec))
        assert matcher.accept(ids) == len(ids), tok.decode(ids)


def test_forced_tokens_are_drafted_and_accepted(folder):
    """The schema's keys are forced: with a drafter that never drafts, the grammar's own drafts (the
    tokenizer's spelling of the forced text) are verified, and nearly all accepted (the target may spell
    the same text with other tokens)."""
    from specserve.spec_decode.proposer import Drafts

    plain, _ = _greedy(folder, CONSTRAINTS["json"])
    llm = LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 6,
                                                "adaptive_draft_length": False}, **ENGINE)
    llm.llm_engine.runner.proposer.propose = lambda inputs: Drafts([[] for _ in inputs.req_ids])
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["json"])
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    m = llm.get_metrics()
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert m.num_drafts >= 4 and m.num_draft_tokens >= 4 * 3  # the first key, after `{`, in every request
    assert m.num_accepted_tokens >= 0.9 * m.num_draft_tokens


def test_drafts_the_grammar_refuses_are_cut_before_verification(folder):
    """A proposer that drafts only tokens the grammar refuses after the first: no refused token is
    ever scheduled for verification, and the output is unchanged."""
    structured = CONSTRAINTS["regex"]
    plain, _ = _greedy(folder, structured)
    llm = LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                "adaptive_draft_length": False}, **ENGINE)
    runner = llm.llm_engine.runner
    compiled = llm.llm_engine.compile_grammar(structured)
    refused = llm.get_tokenizer().encode("zzz", add_special_tokens=False)[0]
    cut = []

    def propose(inputs):
        from specserve.spec_decode.proposer import Drafts

        drafts = []
        for history, n, num_prompt in zip(inputs.token_ids, inputs.num_drafts, inputs.num_prompt_tokens):
            matcher = GrammarMatcher(compiled)
            matcher.accept(history[num_prompt:])
            good = matcher.forced_tokens(1) or [int(matcher.allowed_mask().nonzero()[0])]
            drafts.append((good + [refused] * n)[:n])
        return Drafts(drafts)

    runner.proposer.propose = propose
    verify = runner.sample_or_verify

    def checking(hidden, batch):
        for rid, drafts in zip(batch.sample_req_ids, batch.draft_token_ids):
            assert refused not in drafts
            cut.append(len(drafts))
        return verify(hidden, batch)

    runner.sample_or_verify = checking
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=structured)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert max(cut) >= 1  # the allowed first draft went through


def _exact_distribution(llm: LLM, prompt: list[int], compiled, eos: int, temperature: float,
                        depth: int = 15, floor: float = 1e-6) -> dict[tuple, float]:
    """P(token sequence) under the masked, renormalised target at this temperature, by walking the grammar:
    every sequence the grammar allows up to EOS (a choice grammar ends within a few tokens), leaving out
    branches less likely than `floor` (the caller checks how much mass that leaves out)."""
    model = llm.llm_engine.model
    out: dict[tuple, float] = {}

    def walk(history: list[int], matcher: GrammarMatcher, prob: float) -> None:
        logits = _last_logits(model, prompt + history).masked_fill(~matcher.allowed_mask(), float("-inf"))
        p = torch.softmax(logits / temperature, -1)
        for tok in (p > floor / prob).nonzero().flatten().tolist():
            if tok == eos:
                out[tuple(history + [tok])] = prob * p[tok].item()
            elif len(history) < depth:
                matcher.accept([tok])
                walk(history + [tok], matcher, prob * p[tok].item())
                matcher.rollback(1)

    walk([], GrammarMatcher(compiled), 1.0)
    return out


def _choices_near_the_model(llm: LLM, prompt: list[int]) -> list[str]:
    """Choices spelled from the model's own likely tokens (its top continuations), so that a self-draft
    sampling without the grammar often drafts allowed tokens, and sometimes refused ones."""
    model, tok = llm.llm_engine.model, llm.get_tokenizer()
    first = _last_logits(model, prompt).topk(2).indices.tolist()
    second = _last_logits(model, prompt + first[:1]).topk(2).indices.tolist()
    third = _last_logits(model, prompt + [first[0], second[0]]).argmax().item()
    seqs = [[first[0], second[0], third], [first[0], second[0]], [first[0], second[1]], [first[1]]]
    return list(dict.fromkeys(tok.decode(s) for s in seqs))


def _last_logits(model, tokens: list[int]) -> torch.Tensor:
    from specserve.ops.attention import build_attention_metadata, kv_caches

    n = len(tokens)
    blocks = list(range(-(-n // 16)))
    meta = build_attention_metadata([n], [n], [blocks], 16, torch.arange(n))
    caches = kv_caches(model.kv_cache_shape(len(blocks), 16), torch.float32, model.num_layers)
    with torch.inference_mode():
        hidden, _ = model.forward(torch.tensor(tokens), torch.arange(n), meta, caches)
        return model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_random_sampling_keeps_the_masked_target_distribution(spec, folder, near_draft):
    """Seeded samples under a choice constraint against the exact masked, renormalised target distribution
    over whole outputs. The choices are spelled from the model's likely tokens, so a draft model close to
    the target, sampling without the grammar, drafts allowed tokens (its q then feeds rejection sampling,
    which rejects some) as well as refused ones (cut before verification); the distribution is the same."""
    config = {"method": "draft_model", "model": near_draft, "num_speculative_tokens": 3,
              "adaptive_draft_length": False} if spec else None
    llm = LLM(model=folder, speculative_config=config, **dict(ENGINE, max_num_seqs=256))
    prompt = _prompts(1)[0]
    structured = StructuredOutputsParams(choice=_choices_near_the_model(llm, prompt))
    temperature, eos = 0.5, 2
    exact = _exact_distribution(llm, prompt, llm.llm_engine.compile_grammar(structured), eos, temperature)
    assert abs(sum(exact.values()) - 1) < 1e-3 and sum(p > 0.05 for p in exact.values()) >= 2
    n = 1500
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=16, structured_outputs=structured)
              for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)
    matcher = GrammarMatcher(llm.llm_engine.compile_grammar(structured))
    assert all(matcher.validate(list(ids)) == len(ids) for ids in counts)  # nothing outside the grammar
    # by choice (the text, whatever its spelling in tokens), then each likely spelling on its own
    tok, by_text = llm.get_tokenizer(), collections.Counter()
    for seq, p in exact.items():
        by_text[tok.decode(list(seq[:-1]))] += p
    seen_text = collections.Counter()
    for seq, count in counts.items():
        seen_text[tok.decode(list(seq[:-1]))] += count / n
    assert set(by_text) <= set(structured.choice) and set(seen_text) <= set(structured.choice)
    tv = 0.5 * sum(abs(seen_text[t] - p) for t, p in by_text.items())
    assert tv < 0.04, (tv, seen_text, by_text)
    for seq, p in exact.items():
        if p > 0.02:
            assert abs(counts[seq] / n - p) < 4 * (p * (1 - p) / n) ** 0.5, (seq, counts[seq] / n, p)
    if spec:  # the draft model's own drafts were verified, and some rejected
        m = llm.get_metrics()
        assert m.num_draft_tokens > 300 and m.num_accepted_tokens < m.num_draft_tokens
