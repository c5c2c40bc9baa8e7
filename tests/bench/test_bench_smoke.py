"""Smoke tests of the benchmark plumbing (prompt selection, table, JSON, CLI wiring, the transformers
baseline's padding); the benchmarks themselves are run by hand, not here."""
import json

import pytest

from specserve.bench.common import (
    DEFAULT_DATASET, BenchPrompt, evenly_spaced, format_table, hf_generate, load_hf_model, read_specbench,
    render_prompts, select_spread, write_json)
from specserve.bench.throughput import (
    ScenarioResult, build_report, check_args, cmd_throughput, format_report, greedy_agreement)
from tests.tiny_models import tiny_hf_model


def _rows(counts: dict[str, int]) -> list[dict]:
    return [{"question_id": f"{cat}-{i}", "category": cat, "turns": [f"{cat} question {i}", "follow-up"]}
            for cat, n in counts.items() for i in range(n)]


class FakeTokenizer:
    """Chat template = tags around the message; one token per character."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return f"<user>{messages[0]['content']}</user><assistant>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


# ---------------------------------------------------------------- prompts


def test_select_spread_round_robins_over_categories_in_file_order():
    rows = _rows({"a": 3, "b": 1, "c": 2})
    picked = [r["question_id"] for r in select_spread(rows, 5)]
    assert picked == ["a-0", "b-0", "c-0", "a-1", "c-1"]
    assert select_spread(rows, 5) == select_spread(rows, 5)
    assert len(select_spread(rows, 6)) == 6


def test_select_spread_rejects_impossible_counts():
    rows = _rows({"a": 2})
    with pytest.raises(ValueError, match="only 2"):
        select_spread(rows, 3)
    with pytest.raises(ValueError, match=">= 1"):
        select_spread(rows, 0)


def test_evenly_spaced():
    assert evenly_spaced(list(range(32)), 4) == [0, 8, 16, 24]
    assert evenly_spaced(list(range(3)), 3) == [0, 1, 2]
    assert evenly_spaced(list(range(3)), 0) == []
    with pytest.raises(ValueError):
        evenly_spaced([1, 2], 3)


def test_render_prompts_uses_first_turn_in_chat_template():
    prompts = render_prompts(FakeTokenizer(), _rows({"qa": 1}))
    assert prompts[0].text == "<user>qa question 0</user><assistant>"
    assert prompts[0].token_ids == [ord(c) for c in prompts[0].text]
    assert prompts[0].as_engine_prompt() == {"prompt": prompts[0].text, "prompt_token_ids": prompts[0].token_ids}


def test_read_specbench_reports_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"category": "qa", "turns": ["hi"]}) + "\n\n" + json.dumps({"turns": []}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:3"):
        read_specbench(path)
    with pytest.raises(FileNotFoundError, match="--dataset"):
        read_specbench(tmp_path / "missing.jsonl")


def test_default_dataset_selection_covers_every_category():
    rows = read_specbench(DEFAULT_DATASET)  # shipped with the package
    assert len(rows) == 480 and len({r["category"] for r in rows}) == 13
    categories = {r["category"] for r in rows}
    picked = select_spread(rows, 32)
    assert {r["category"] for r in picked} == categories
    counts = [sum(r["category"] == c for r in picked) for c in categories]
    assert max(counts) - min(counts) <= 1


# ---------------------------------------------------------------- table and JSON


def test_format_table_aligns_columns():
    text = format_table(["name", "tok/s"], [["specserve", 12.345], ["transformers", None]])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "tok/s"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["specserve", "12.35"] and lines[3].split() == ["transformers", "-"]
    assert len({len(line) for line in lines[:3]}) == 1  # numbers right-aligned to the header's end


def test_write_json_creates_folders_and_nulls_nan(tmp_path):
    path = write_json(tmp_path / "deep" / "out.json", {"x": float("nan"), "p": BenchPrompt(1, "qa", "t", [1])})
    data = json.loads(path.read_text())
    assert data == {"x": None, "p": {"question_id": 1, "category": "qa", "text": "t", "token_ids": [1]}}


def _result(scenario, engine, tokens, seconds, concurrency):
    extra = ({"num_preemptions": 0, "ttft_median_s": 0.05, "decode_tokens_per_s_median": 20.0, "per_request": []}
             if engine == "specserve" else {})
    return ScenarioResult(scenario, engine, len(tokens), concurrency, 10, sum(map(len, tokens)), seconds, tokens,
                          extra)


def test_report_has_ratios_agreement_and_a_readable_table(tmp_path):
    args = _parse(["--num-prompts", "2", "--batch1-prompts", "1"])
    prompts = render_prompts(FakeTokenizer(), _rows({"qa": 1, "rag": 1}))
    results = [_result("batch1", "specserve", [[1, 2, 3, 4]], 1.0, 1),
               _result("concurrent", "specserve", [[1, 2, 3, 4], [5, 6, 7, 8]], 1.0, 2),
               _result("batch1", "transformers", [[1, 2, 3, 4]], 2.0, 1),
               _result("concurrent", "transformers", [[1, 2, 3, 4], [5, 6, 0, 0]], 4.0, 2)]
    report = build_report(args, {"torch": "x"}, prompts, prompts[:1], results)
    cmp = report["specserve_vs_transformers"]
    assert cmp["batch1"]["speedup"] == pytest.approx(2.0) and cmp["batch1"]["identical_outputs"] == 1
    assert cmp["concurrent"]["speedup"] == pytest.approx(4.0)
    assert cmp["concurrent"]["mean_common_prefix_fraction"] == pytest.approx(0.75)
    text = format_report(report)
    assert "2 concurrent" in text and "4.00x" in text and "50 ms" in text
    data = json.loads(write_json(tmp_path / "t.json", report).read_text())
    assert data["results"][0]["output_tokens_per_s"] == 4.0 and "func" not in data["settings"]


def test_greedy_agreement_stops_at_specserve_eos():
    # specserve (ignore_eos) emits EOS=2 at index 2; transformers (min_new_tokens) masks it and diverges.
    agreement = greedy_agreement([[5, 6, 2, 7], [5, 6, 7, 8], [2, 1]], [[5, 6, 9, 9], [5, 0, 7, 8], [3, 3]], {2})
    assert agreement["compared_tokens"] == [2, 4, 0] and agreement["common_prefix_tokens"] == [2, 1, 0]
    assert agreement["identical_outputs"] == 2
    assert agreement["mean_common_prefix_fraction"] == pytest.approx((1 + 0.25 + 1) / 3)


# ---------------------------------------------------------------- command line


def _parse(extra: list[str]):
    from specserve.cli import build_parser

    return build_parser().parse_args(["bench", "throughput", *extra])


def test_cli_wiring():
    args = _parse(["--num-prompts", "2"])
    assert args.func is cmd_throughput
    assert (args.num_prompts, args.max_tokens, args.batch1_prompts, args.concurrency) == (2, 128, 4, 32)
    assert args.output_json == "bench_results/throughput.json" and not args.skip_hf and args.max_num_seqs is None
    with pytest.raises(ValueError, match="--batch1-prompts"):
        check_args(args)
    check_args(_parse(["--num-prompts", "2", "--batch1-prompts", "2"]))
    with pytest.raises(ValueError, match="--max-tokens"):
        check_args(_parse(["--max-tokens", "0"]))


# ---------------------------------------------------------------- transformers baseline


def test_hf_generate_left_padding_matches_unpadded(tmp_path):
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path / "tiny")
    model = load_hf_model(str(tmp_path / "tiny"))
    short, long = [5, 9, 3], [7, 1, 4, 8, 2, 6, 11]
    batched = hf_generate(model, [short, long], max_tokens=6, pad_token_id=0)
    alone = [hf_generate(model, [ids], max_tokens=6, pad_token_id=0)[0] for ids in (short, long)]
    assert [len(t) for t in batched] == [6, 6]
    assert batched == alone
    with pytest.raises(ValueError, match=".gguf"):
        load_hf_model(str(tmp_path / "missing.bin"))
