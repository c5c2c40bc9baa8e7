"""Smoke tests of `specserve bench latency`'s plumbing: arguments, prompt selection, and the report's medians,
ratios, geometric means and greedy check on synthetic timings. No model runs here."""
import importlib.util
import json
import math

import pytest

from specserve.bench.common import BenchPrompt, write_json
from specserve.models.loader import default_model_path
from specserve.bench.latency import check_args, cmd_latency, hf_timing, median_rounds, select_per_category, spec_configs
from specserve.bench.latency_report import (
    DEFAULT_NUM_SPECULATIVE_TOKENS, HF_PLAIN, HF_PROMPT_LOOKUP, PLAIN, RequestTiming, acceptance_by_position,
    build_report, format_report, geometric_mean, summarize, summarize_methods)


def _parse(extra: list[str]):
    from specserve.cli import build_parser

    return build_parser().parse_args(["bench", "latency", *extra])


# ---------------------------------------------------------------- command line


def test_cli_defaults():
    args = _parse([])
    assert args.func is cmd_latency
    assert (args.prompts_per_category, args.max_tokens, args.methods, args.categories) == (4, 128, "ngram,suffix,draft_model,auto", None)
    assert args.output_json == "bench_results/latency.json" and not args.skip_hf and args.max_num_seqs == 1
    check_args(args)
    configs = spec_configs(args)
    assert {m: configs[m] for m in ("ngram", "suffix")} == {
        m: {"method": m, "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS[m]} for m in ("ngram", "suffix")}
    # the default draft: the target's own weights, quantized to int8 for the drafter
    assert configs["draft_model"] == {"method": "draft_model", "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS[
        "draft_model"], "model": default_model_path(), "quantization": "int8"}


def test_spec_configs_overrides():
    args = _parse(["--methods", "ngram,suffix,draft_model", "--draft-model", "/m/draft.gguf",
                   "--num-speculative-tokens", "3", "--spec-config-json",
                   '{"ngram": {"prompt_lookup_max": 3}, "suffix": {"num_speculative_tokens": 12}}'])
    configs = spec_configs(args)
    assert configs["ngram"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert configs["suffix"]["num_speculative_tokens"] == 12
    assert configs["draft_model"] == {"method": "draft_model", "num_speculative_tokens": 3, "model": "/m/draft.gguf"}
    assert spec_configs(_parse(["--methods", ""])) == {}


@pytest.mark.parametrize("extra, message", [
    (["--methods", "lookahead"], "unknown method"),
    (["--methods", "medusa"], "model is required for method 'medusa'"),
    (["--methods", "ngram,ngram"], "twice"),
    (["--methods", "draft_model", "--spec-config-json", '{"draft_model": {"quantization": "int4"}}'],
     "quantization must be"),
    (["--spec-config-json", '{"suffix": {"prompt_lookup_typo": 1}}'], "unknown speculative_config key"),
    (["--methods", "ngram", "--spec-config-json", '{"suffix": {}}'], "not in --methods"),
    (["--spec-config-json", '{"ngram": 3}'], "map method names"),
    (["--max-tokens", "1"], "--max-tokens"),
    (["--prompts-per-category", "0"], "--prompts-per-category"),
    (["--repeats", "0"], "--repeats"),
    (["--speculative-config", '{"method": "ngram"}'], "--methods"),
])
def test_check_args_refuses_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        check_args(_parse(extra))


def test_select_per_category():
    rows = [{"question_id": f"{c}{i}", "category": c, "turns": ["q"]} for c in "abc" for i in range(3)]
    assert [r["question_id"] for r in select_per_category(rows, None, 2)] == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert [r["question_id"] for r in select_per_category(rows, ["c", "a"], 1)] == ["c0", "a0"]
    with pytest.raises(ValueError, match="unknown category z"):
        select_per_category(rows, ["z"], 1)
    with pytest.raises(ValueError, match=r"a \(3\)"):
        select_per_category(rows, ["a"], 4)


def test_hf_timing_subtracts_the_one_token_generate(monkeypatch):
    durations = iter([0.5, 2.5])  # the 1-token generate, then the full one

    class FakeStopwatch:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.seconds = next(durations)

    monkeypatch.setattr("specserve.bench.latency.Stopwatch", FakeStopwatch)
    prompt = BenchPrompt(7, "qa", "text", [1, 2, 3])
    t = hf_timing(HF_PLAIN, prompt, lambda ids, n: list(range(n)), 11)
    assert (t.ttft_s, t.decode_s, t.total_s, t.num_output_tokens) == (0.5, 2.0, 2.5, 11)
    assert t.decode_tokens_per_s == pytest.approx(10 / 2.0) and t.e2e_tokens_per_s == pytest.approx(11 / 2.5)


# ---------------------------------------------------------------- report math


def _timing(method, category, qid, decode_s, tokens, ttft_s=0.1, acceptance=None):
    return RequestTiming(method, category, qid, 100, ttft_s=ttft_s, decode_s=decode_s, total_s=ttft_s + decode_s,
                         token_ids=tokens, acceptance_length=acceptance)


def _synthetic() -> list[RequestTiming]:
    same, other = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]
    t = []
    for cat, (q1, q2) in {"qa": ("qa1", "qa2"), "rag": ("rag1", "rag2")}.items():
        # decode tok/s = 4 / decode_s: plain 10 and 20 (median 15), ngram 20 and 40 (median 30), HF 5.
        t += [_timing(PLAIN, cat, q1, 0.4, same), _timing(PLAIN, cat, q2, 0.2, same)]
        t += [_timing("ngram", cat, q1, 0.2, same, acceptance=2.0),
              _timing("ngram", cat, q2, 0.1, other if cat == "rag" else same, acceptance=3.0)]
        t += [_timing(HF_PLAIN, cat, q, 0.8, same, ttft_s=0.3) for q in (q1, q2)]
        t += [_timing(HF_PROMPT_LOOKUP, cat, q, 1.6 if cat == "qa" else 0.4, same, ttft_s=0.3) for q in (q1, q2)]
    return t


def test_summarize_medians_ratios_and_greedy_check():
    rows = {(r["category"], r["method"]): r for r in summarize(_synthetic())}
    plain, ngram = rows["qa", PLAIN], rows["qa", "ngram"]
    assert plain["decode_tokens_per_s_median"] == pytest.approx(15.0)
    assert plain["decode_vs_specserve_plain"] == pytest.approx(1.0)
    assert plain["decode_vs_transformers_plain"] == pytest.approx(3.0)
    assert plain["greedy_reference"] is None and plain["acceptance_length_median"] is None
    assert ngram["decode_vs_specserve_plain"] == pytest.approx(2.0)
    assert ngram["decode_vs_transformers_plain"] == pytest.approx(6.0)
    assert ngram["acceptance_length_median"] == pytest.approx(2.5)
    assert ngram["ttft_median_s"] == pytest.approx(0.1)
    assert ngram["e2e_tokens_per_s_median"] == pytest.approx((5 / 0.3 + 5 / 0.2) / 2)
    assert (ngram["greedy_identical"], ngram["greedy_compared"]) == (2, 2)
    bad = rows["rag", "ngram"]
    assert (bad["greedy_identical"], bad["greedy_mismatches"]) == (1, [{"question_id": "rag2", "first_diff": 2}])
    assert rows["qa", HF_PROMPT_LOOKUP]["greedy_reference"] == HF_PLAIN
    assert rows["qa", HF_PROMPT_LOOKUP]["decode_vs_transformers_plain"] == pytest.approx(0.5)


def test_median_rounds_keeps_each_pairs_median_decode_round():
    same = [1, 2, 3]
    rounds = [[_timing(PLAIN, "qa", "q1", 0.30, same), _timing("ngram", "qa", "q1", 0.10, same, acceptance=2.0)],
              [_timing("ngram", "qa", "q1", 0.20, same, acceptance=2.5), _timing(PLAIN, "qa", "q1", 0.50, same)],
              [_timing(PLAIN, "qa", "q1", 0.40, same), _timing("ngram", "qa", "q1", 0.15, same, acceptance=3.0)]]
    plain, ngram = median_rounds(rounds)  # in the first round's order, whatever order later rounds ran in
    assert (plain.method, plain.decode_s, plain.spec_stats["decode_s_rounds"]) == (PLAIN, 0.40, [0.30, 0.50, 0.40])
    assert (ngram.method, ngram.decode_s, ngram.acceptance_length) == ("ngram", 0.15, 3.0)
    assert median_rounds(rounds[:2])[0].decode_s == 0.30  # even count: the lower middle
    assert median_rounds(rounds[:1])[0].spec_stats == {}
    rounds[2][1] = _timing("ngram", "qa", "q1", 0.15, [1, 2, 4])
    with pytest.raises(RuntimeError, match="different outputs across rounds"):
        median_rounds(rounds)


def test_paired_ratio_compares_each_prompt_with_plain_in_the_same_round():
    same = [1, 2, 3]
    plain1, plain2 = _timing(PLAIN, "qa", "q1", 0.4, same), _timing(PLAIN, "qa", "q2", 0.2, same)
    plain1.spec_stats = {"decode_s_rounds": [0.4, 0.8, 0.4]}  # round 2: the host was twice as slow
    ngram1, ngram2 = _timing("ngram", "qa", "q1", 0.2, same), _timing("ngram", "qa", "q2", 0.1, same)
    ngram1.spec_stats = {"decode_s_rounds": [0.2, 0.4, 0.25]}  # ... for both runs of the pair
    timings = [plain1, plain2, ngram1, ngram2, _timing(HF_PLAIN, "qa", "q1", 0.8, same)]
    rows = {(r["category"], r["method"]): r for r in summarize(timings)}
    # q1: per-round 2.0, 2.0, 1.6 -> median 2.0; q2 (one round): 2.0; geometric mean 2.0
    assert rows["qa", "ngram"]["decode_vs_specserve_plain_paired"] == pytest.approx(2.0)
    assert rows["qa", PLAIN]["decode_vs_specserve_plain_paired"] == pytest.approx(1.0)
    assert rows["qa", HF_PLAIN]["decode_vs_specserve_plain_paired"] is None
    summary = {s["method"]: s for s in summarize_methods(list(rows.values()))}
    assert summary["ngram"]["decode_vs_specserve_plain_paired_geomean"] == pytest.approx(2.0)
    assert summary["ngram"]["decode_vs_specserve_plain_paired_min"] == pytest.approx(2.0)


def test_summary_geometric_means():
    summary = {s["method"]: s for s in summarize_methods(summarize(_synthetic()))}
    assert summary["ngram"]["decode_vs_specserve_plain_geomean"] == pytest.approx(2.0)
    assert summary["ngram"]["acceptance_length_mean"] == pytest.approx(2.5)
    assert (summary["ngram"]["greedy_identical"], summary["ngram"]["greedy_compared"]) == (3, 4)
    # prompt lookup: 0.5x on qa, 2x on rag -> geometric mean 1x
    assert summary[HF_PROMPT_LOOKUP]["decode_vs_transformers_plain_geomean"] == pytest.approx(1.0)
    assert geometric_mean([2.0, 8.0, None, float("nan")]) == pytest.approx(4.0)
    assert math.isnan(geometric_mean([]))


def test_acceptance_by_position_is_per_drafting_round():
    a, b = _timing("eagle3", "qa", "q1", 0.2, [1, 2]), _timing("eagle3", "qa", "q2", 0.2, [1, 2])
    a.spec_stats = {"num_drafts": 10, "accepted_per_position": [8, 5, 2]}
    b.spec_stats = {"num_drafts": 30, "accepted_per_position": [12, 3]}
    assert acceptance_by_position([a, b]) == pytest.approx([0.5, 0.2, 0.05])
    summary = {s["method"]: s for s in summarize_methods(summarize([a, b]), [a, b])}
    assert summary["eagle3"]["acceptance_by_position"] == pytest.approx([0.5, 0.2, 0.05])
    assert acceptance_by_position([]) == []


def test_report_table_and_json(tmp_path):
    args = _parse(["--categories", "qa,rag", "--prompts-per-category", "2"])
    prompts = [BenchPrompt(q, c, "t", [1, 2]) for c in ("qa", "rag") for q in (f"{c}1", f"{c}2")]
    report = build_report(args, {"torch": "x"}, spec_configs(args), prompts, _synthetic())
    text = format_report(report)
    assert "specserve ngram" in text and "2.00x" in text and "1/2 MISMATCH" in text
    assert "GREEDY MISMATCH: specserve ngram, rag question rag2" in text and "token 2" in text
    assert len(report["greedy_mismatches"]) == 1
    data = json.loads(write_json(tmp_path / "latency.json", report).read_text())
    assert "func" not in data["settings"] and len(data["per_request"]) == 16
    assert data["per_request"][0]["decode_tokens_per_s"] == pytest.approx(10.0)


# ---------------------------------------------------------------- llama.cpp baseline


def test_llamacpp_timing_prefills_every_prompt_and_stops_at_max_tokens(monkeypatch):
    from specserve.bench import llamacpp

    clock = iter([10.0, 10.5, 12.0])  # start, the first token, the last

    class FakeLlama:
        def __init__(self):
            self.resets, self.calls = 0, []

        def reset(self):
            self.resets += 1

        def generate(self, tokens, **sampling):
            self.calls.append((list(tokens), sampling))
            yield from (7, 8, 2, 9, 9, 9)  # EOS (2) does not stop it

    monkeypatch.setattr(llamacpp.time, "perf_counter", lambda: next(clock))
    llm = FakeLlama()
    t = llamacpp.generate_timed(llm, BenchPrompt("q1", "qa", "text", [1, 2, 3]), 4, llamacpp.LLAMACPP_PLAIN)
    assert llm.resets == 1 and llm.calls[0][0] == [1, 2, 3]
    assert llm.calls[0][1]["top_k"] == 1 and llm.calls[0][1]["temp"] == 0.0 and llm.calls[0][1]["repeat_penalty"] == 1.0
    assert t.token_ids == [7, 8, 2, 9] and (t.ttft_s, t.decode_s, t.total_s) == (0.5, 1.5, 2.0)


def test_llamacpp_rows_compare_with_llamacpp_plain():
    from specserve.bench.llamacpp import LLAMACPP_PLAIN, LLAMACPP_PROMPT_LOOKUP

    same = [1, 2, 3, 4, 5]
    timings = [_timing(PLAIN, "qa", "q1", 0.2, same), _timing(LLAMACPP_PLAIN, "qa", "q1", 0.4, [1, 2, 3, 4, 6]),
               _timing(LLAMACPP_PROMPT_LOOKUP, "qa", "q1", 0.8, [1, 2, 3, 4, 6])]
    rows = {r["method"]: r for r in summarize(timings)}
    assert rows[PLAIN]["decode_vs_llamacpp_plain"] == pytest.approx(2.0)
    assert rows[LLAMACPP_PROMPT_LOOKUP]["greedy_reference"] == LLAMACPP_PLAIN
    assert rows[LLAMACPP_PROMPT_LOOKUP]["greedy_identical"] == 1
    assert rows[LLAMACPP_PLAIN]["greedy_reference"] is None  # its tokens are not held to specserve's


def test_llamacpp_needs_a_gguf_file_and_its_extra():
    """The comparison with llama.cpp itself is a benchmark (`specserve bench latency --llamacpp`), not a test:
    its extra builds llama.cpp from source. What the command checks first is tested here, with or without it."""
    from specserve.bench.llamacpp import run_llamacpp

    warmup = BenchPrompt("w", "warmup", "t", [1])
    with pytest.raises(ValueError, match="GGUF"):
        run_llamacpp("some/hf_folder", [], warmup, 8, 1, 4, print)
    if importlib.util.find_spec("llama_cpp") is None:
        with pytest.raises(ValueError, match=r"pip install 'specserve\[llamacpp\]'"):
            run_llamacpp("model.gguf", [], warmup, 8, 1, 4, print)
