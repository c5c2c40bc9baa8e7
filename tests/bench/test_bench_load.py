"""`specserve bench load`: argument checks, the report's arithmetic (per-token ITL, percentiles, median rounds,
ratios, greedy check) on synthetic step timings, the figure, and one small end-to-end run on the default model
whose speculative outputs must equal plain decoding's."""
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.bench.common import BenchPrompt, write_json
from specserve.bench.load import check_args, cmd_load, interleaved, parse_concurrency, prompts_by_level, save_plot
from specserve.bench.load_report import (
    PLAIN, BatchRun, RequestTrace, build_report, format_report, greedy_mismatches, itl_samples, median_rows,
    percentile, plain_vs_plain, ratio_table, summarize_run)
from specserve.bench.load_plot import plot_load
from specserve.cli import build_parser, main

DATASET = str(Path(__file__).parents[1] / "data" / "specbench_sample.jsonl")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _parse(extra: list[str]):
    return build_parser().parse_args(["bench", "load", "--methods", "ngram,suffix", *extra])


# ---------------------------------------------------------------- command line


def test_cli_defaults():
    args = build_parser().parse_args(["bench", "load"])
    assert args.func is cmd_load
    assert (args.concurrency, args.methods, args.max_tokens, args.repeats) == (
        "1,2,4,8,16,32,64", "ngram,suffix,draft_model,auto", 128, 1)
    assert (args.output_json, args.plot, args.replot) == ("bench_results/load.json", "bench_results/load.png", None)
    assert args.max_num_seqs is None  # then max(concurrency)
    assert (args.requests_per_slot, args.min_requests) == (2, 16)
    check_args(_parse([]))
    assert parse_concurrency("8, 1,4") == [1, 4, 8]


@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "0,2"], "--concurrency must be"),
    (["--concurrency", "1,x"], "--concurrency must be"),
    (["--concurrency", ""], "--concurrency must be"),
    (["--concurrency", "2,4,2"], "--concurrency lists a value twice"),
    (["--max-tokens", "1"], "--max-tokens must be >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--min-requests", "0"], "--min-requests must be >= 1"),
    (["--concurrency", "1,8", "--max-num-seqs", "4"], "--max-num-seqs 4 is below the largest --concurrency 8"),
    (["--plot", "load.jpg"], "--plot must name a .png"),
    (["--methods", "lookahead"], "--methods: unknown method"),
    (["--spec-config-json", '{"suffix": {"typo": 1}}'], "unknown speculative_config key"),
    (["--speculative-config", '{"method": "ngram"}'], "--methods and --spec-config-json"),
])
def test_check_args_refuses_bad_input(extra, message):
    with pytest.raises(ValueError, match=message):
        check_args(_parse(extra))


def test_bad_input_exits_2_naming_the_flag(capsys, tmp_path):
    assert main(["bench", "load", "--methods", "ngram", "--concurrency", "0"]) == 2
    assert "error: --concurrency must be" in capsys.readouterr().err
    assert main(["bench", "load", "--replot", str(tmp_path / "missing.json")]) == 2
    assert "--replot: no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- report arithmetic


def test_itl_splits_each_gap_over_the_tokens_it_brought():
    # deliveries at 1.0 (first token: TTFT, no ITL), 1.1 (1 token), 1.4 (3 tokens), 1.5 (2 tokens)
    assert itl_samples([1.0, 1.1, 1.4, 1.5], [1, 1, 3, 2]) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.05, 0.05])
    assert itl_samples([2.0], [4]) == []


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97: 3 + 0.97 * (4 - 3)
    assert (percentile(values, 0), percentile(values, 100), percentile([5.0], 99)) == (1.0, 4.0, 5.0)
    assert math.isnan(percentile([], 50))


def _trace(times, counts, tokens=None, qid=0, drafts=0, accepted=0, added=10.0, draft_tokens=0) -> RequestTrace:
    tokens = list(range(sum(counts))) if tokens is None else tokens
    return RequestTrace(BenchPrompt(qid, "qa", "t", [1, 2]), list(times), list(counts), tokens, drafts, accepted,
                        added, draft_tokens)


def test_summarize_run():
    # two requests added at t=10.0; the second gets 3 tokens at 10.5 (2 after a 0.4 s gap: 0.2 s each)
    run = BatchRun("ngram", 2, 0, 10.0, 4, [_trace([10.2, 10.3, 10.4], [1, 1, 1], drafts=1, accepted=0, draft_tokens=3),
                                            _trace([10.1, 10.5], [1, 2], drafts=1, accepted=1, draft_tokens=2)])
    row = summarize_run(run)
    assert (row["wall_s"], row["num_output_tokens"]) == (pytest.approx(0.5), 6)
    assert row["tokens_per_s"] == pytest.approx(12.0)
    assert row["ttft_median_ms"] == pytest.approx(150.0)  # first tokens at 0.2 and 0.1 s
    assert row["num_itl_samples"] == 4  # ITLs 0.1, 0.1, 0.2, 0.2 s
    assert (row["itl_p50_ms"], row["itl_p99_ms"]) == (pytest.approx(150.0), pytest.approx(200.0))
    assert row["acceptance_length"] == pytest.approx(1.5)  # 1 + 1 accepted / 2 drafts
    assert (row["num_drafts"], row["num_draft_tokens"], row["num_accepted_tokens"]) == (2, 5, 1)
    assert row["drafted_step_share"] == pytest.approx(2 / 3)  # 2 drafted of 3 steps after a first token
    plain = summarize_run(BatchRun(PLAIN, 1, 0, 0.0, 2, [_trace([0.1, 0.2], [1, 1], added=0.0)]))
    assert plain["acceptance_length"] is None and plain["drafted_step_share"] is None


def _run(method, n, repeat, seconds, tokens=(1, 2, 3)) -> BatchRun:
    """n requests of len(tokens) tokens, the last delivered `seconds` after the start: n * 3 / seconds tok/s."""
    traces = [_trace([seconds / 2, seconds], [1, len(tokens) - 1], list(tokens), qid=i) for i in range(n)]
    return BatchRun(method, n, repeat, 0.0, 2, traces)


def _rounds() -> list[BatchRun]:
    # plain at N=1: 3 tok/s in every round; ngram at N=1: 6, 2, 4 tok/s (median 4); at N=2 ngram 1.5x plain
    runs = [_run(PLAIN, 1, r, 1.0) for r in range(3)]
    runs += [_run("ngram", 1, 0, 0.5), _run("ngram", 1, 1, 1.5), _run("ngram", 1, 2, 0.75)]
    return runs + [_run(PLAIN, 2, 0, 2.0), _run("ngram", 2, 0, 2 / 1.5)]


def test_median_rows_and_ratio_table():
    rows = {(r["method"], r["concurrency"]): r for r in median_rows(_rounds())}
    ngram = rows["ngram", 1]
    assert (ngram["tokens_per_s"], ngram["repeat"]) == (pytest.approx(4.0), 2)
    assert ngram["tokens_per_s_rounds"] == pytest.approx([6.0, 2.0, 4.0])
    assert ngram["vs_plain"] == pytest.approx(4 / 3) and rows[PLAIN, 1]["vs_plain"] == pytest.approx(1.0)
    assert ngram["vs_plain_rounds"] == pytest.approx([2.0, 2 / 3, 4 / 3])
    assert rows["ngram", 2]["vs_plain"] == pytest.approx(1.5)
    table = ratio_table(median_rows(_rounds()))
    assert [t["concurrency"] for t in table] == [1, 2]
    assert table[0] == {"concurrency": 1, "plain_tokens_per_s": pytest.approx(3.0), "ngram": pytest.approx(4 / 3)}
    assert table[1]["ngram"] == pytest.approx(1.5)


def test_the_ratio_to_plain_pairs_each_round_with_plain_of_the_same_round():
    """A host twice as slow in round 1 slows both methods there: the paired ratios are 1.1x in every round,
    while the median rounds of each (plain 3 tok/s, ngram 3.3) would also say 1.1x only by luck."""
    runs = [_run(PLAIN, 1, 0, 1.0), _run("ngram", 1, 0, 1 / 1.1), _run(PLAIN, 1, 1, 2.0), _run("ngram", 1, 1, 2 / 1.1),
            _run(PLAIN, 1, 2, 0.9), _run("ngram", 1, 2, 0.9 / 1.1)]
    rows = {(r["method"], r["concurrency"]): r for r in median_rows(runs)}
    assert rows["ngram", 1]["vs_plain_rounds"] == pytest.approx([1.1] * 3)
    assert rows["ngram", 1]["vs_plain"] == pytest.approx(1.1)


def test_interleaved_runs_compare_each_method_with_the_plain_runs_beside_it():
    """plain, ngram, plain, suffix, plain: the host slows down between the first and last plain run (3, then
    2, then 1 tok/s); each method is compared with the mean of its two neighbours."""
    assert interleaved(["ngram", "suffix"]) == [PLAIN, "ngram", PLAIN, "suffix", PLAIN]
    runs = [_run(PLAIN, 1, 0, 1.0), _run("ngram", 1, 0, 1 / 2.75), _run(PLAIN, 1, 0, 1.5), _run("suffix", 1, 0, 1.5),
            _run(PLAIN, 1, 0, 3.0)]  # ngram 8.25 tok/s, suffix 2 tok/s
    for position, run in enumerate(runs):
        run.position = position
    rows = {(r["method"], r["concurrency"]): r for r in median_rows(runs)}
    assert rows["ngram", 1]["vs_plain"] == pytest.approx(8.25 / 2.5)  # plain 3 and 2 beside it
    assert rows["suffix", 1]["vs_plain"] == pytest.approx(2 / 1.5)  # plain 2 and 1
    assert rows[PLAIN, 1]["vs_plain"] == 1.0 and rows[PLAIN, 1]["tokens_per_s"] == pytest.approx(2.0)


def test_plain_against_plain_gives_the_noise_floor_of_a_level():
    """plain, ngram, plain, suffix, plain, auto, plain over two rounds: the plain runs at places 2 and 4
    against the mean of the plain runs two places away; a lower median over rounds per place."""
    def round_(repeat, plain_seconds):
        runs = []
        for position, method in enumerate(interleaved(["ngram", "suffix", "auto"])):
            seconds = plain_seconds[position // 2] if method == PLAIN else 1.0
            runs.append(_run(method, 1, repeat, seconds))
            runs[-1].position = position
        return runs
    # tok/s 3 / s: round 0 plain 3, 2, 3, 2 tok/s; round 1 plain 3, 3, 3, 3
    runs = round_(0, [1.0, 1.5, 1.0, 1.5]) + round_(1, [1.0, 1.0, 1.0, 1.0]) + [_run(PLAIN, 2, 0, 1.0)]
    floor = plain_vs_plain(runs)
    assert floor == {1: [pytest.approx(2 / 3), pytest.approx(1.0)]}  # place 2: 2/3 and 1; place 4: 3/2 and 1
    table = ratio_table(median_rows(runs), floor)
    assert table[0]["plain_vs_plain"] == floor[1] and "plain_vs_plain" not in table[1]  # N=2 ran no methods


def test_greedy_mismatches_compare_with_plain_of_the_same_round():
    runs = _rounds() + [_run("suffix", 2, 0, 1.0, tokens=(1, 2, 3))]
    runs[-1].traces[1].token_ids = [1, 9, 3]
    (found,) = greedy_mismatches(runs)
    assert (found["method"], found["concurrency"], found["request"], found["first_diff"]) == ("suffix", 2, 1, 1)
    assert "specserve suffix, 2 in flight" in found["line"] and "at token 1" in found["line"]


def test_prompts_by_level_gives_each_level_its_own_prompts(capsys):
    class Tokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return messages[0]["content"]

        def encode(self, text, add_special_tokens=True):
            return [len(text)]

    rows = [{"question_id": f"{c}{i}", "category": c, "turns": [f"{c}{i}"]} for c in "abc" for i in range(2)]
    by_level = prompts_by_level(Tokenizer(), rows, [1, 2, 3])
    assert {n: [p.question_id for p in ps] for n, ps in by_level.items()} == {
        1: ["a0"], 2: ["b0", "c0"], 3: ["a1", "b1", "c1"]}  # round-robin over the categories, no repeats
    assert "note" not in capsys.readouterr().err
    by_level = prompts_by_level(Tokenizer(), rows, [4, 5])
    assert [p.question_id for p in by_level[5]] == ["b1", "c1", "a0", "b0", "c0"]  # wrapped around
    assert "prompts repeat" in capsys.readouterr().err
    by_level = prompts_by_level(Tokenizer(), rows, [1, 2], per_slot=1, min_requests=2)
    assert {n: len(ps) for n, ps in by_level.items()} == {1: 2, 2: 2}  # at least min_requests a level


def _synthetic_report(tmp_path) -> Path:
    args = _parse(["--concurrency", "1,2", "--output-json", str(tmp_path / "load.json")])
    prompts = {1: [BenchPrompt(0, "qa", "t", [1])], 2: [BenchPrompt(i, "qa", "t", [1]) for i in (1, 2)]}
    report = build_report(args, {"torch": "x"}, {"ngram": {"method": "ngram"}}, prompts, _rounds())
    text = format_report(report)
    assert "1.33x" in text and "1.50x" in text and "greedy check: 5/5" in text
    return write_json(args.output_json, report)


def test_replot_redraws_the_png_from_the_json(tmp_path, capsys):
    path = _synthetic_report(tmp_path)
    assert main(["bench", "load", "--replot", str(path), "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes().startswith(PNG_SIGNATURE)
    assert plot_load(json.loads(path.read_text()), tmp_path / "sub" / "direct.png").read_bytes()[:8] == PNG_SIGNATURE


def test_replot_draws_several_runs_together(tmp_path, capsys, monkeypatch):
    """Runs with different KV dtypes on one figure: each method of each run its own line, named by its dtype."""
    from specserve.bench import load_plot

    path = _synthetic_report(tmp_path)
    other = tmp_path / "int8.json"
    report = json.loads(path.read_text())
    other.write_text(json.dumps({**report, "kv_cache": {"kv_cache_dtype": "int8"}}))
    labels = []
    real = load_plot._finish
    monkeypatch.setattr(load_plot, "_finish", lambda fig, axes, *a: labels.append(
        [line.get_label() for line in axes[0].get_lines()]) or real(fig, axes, *a))
    out = tmp_path / "both.png"
    assert main(["bench", "load", "--replot", f"{path},{other}", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert labels == [["plain, KV auto", "ngram, KV auto", "plain, KV int8", "ngram, KV int8"]]
    assert main(["bench", "load", "--replot", f"{path},{tmp_path / 'nope.json'}"]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_no_matplotlib_skips_the_plot_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert save_plot({}, str(tmp_path / "x.png")) is False
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------- end to end


def test_end_to_end_on_the_default_model(tmp_path, capsys):
    """N in flight, two requests per slot: 2N requests per level, each level its own prompts."""
    out_json, out_png = tmp_path / "load.json", tmp_path / "load.png"
    code = main(["bench", "load", "--dataset", DATASET, "--concurrency", "1,3", "--methods", "ngram,suffix",
                 "--min-requests", "1",
                 "--max-tokens", "8", "--output-json", str(out_json), "--plot", str(out_png)])
    assert code == 0  # every speculative output equals plain decoding's
    report = json.loads(out_json.read_text())
    rows = {(r["method"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(m, n) for m in (PLAIN, "ngram", "suffix") for n in (1, 3)}
    for (method, n), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["num_output_tokens"] == 8 * 2 * n
        assert row["num_itl_samples"] == 7 * 2 * n and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert rows[PLAIN, 3]["vs_plain"] == pytest.approx(1.0)
    assert [t["concurrency"] for t in report["ratio_table"]] == [1, 3]
    assert (report["greedy_mismatches"], report["greedy_compared"]) == ([], 16)
    ids = [p["question_id"] for n in ("1", "3") for p in report["prompts"][n]]
    assert len(ids) == len(set(ids)) == 8  # each level its own prompts
    assert "itl" in report["definitions"] and report["environment"]["torch"]
    assert out_png.read_bytes().startswith(PNG_SIGNATURE)
    kv = report["kv_cache"]
    assert kv["kv_cache_dtype"] == "auto" and kv["bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # SmolLM2, fp32
    assert all(0 < row["peak_kv_blocks_in_use"] <= kv["num_blocks"] and row["num_preemptions"] == 0
               for row in rows.values())
    out = capsys.readouterr().out
    assert "ngram / plain" in out and "greedy check: 16/16" in out and "peak blocks in use (preemptions)" in out


class FakeEngine:
    """Each request gets one token a step, three in all; a step moves `clock` (if given) on by step_seconds and
    counts as a two-thread forward pass."""

    def __init__(self, clock: list[float] | None = None, step_seconds: float = 0.0):
        self.running, self.peak, self.kv_cache_manager = {}, 0, SimpleNamespace(reset_prefix_cache=lambda: None)
        self.clock, self.step_seconds = clock, step_seconds
        self.runner = SimpleNamespace(thread_policy=SimpleNamespace(runs={1: 5}))  # 5 before the run
        # a block per running request; 3 preemptions before the run and one during it
        self.scheduler = SimpleNamespace(num_preemptions=3, get_stats=lambda: SimpleNamespace(
            kv_cache_blocks_in_use=len(self.running)))

    def add_request(self, request_id, prompt, params):
        self.running[request_id] = []
        self.peak = max(self.peak, len(self.running))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        if self.clock is not None:
            self.clock[0] += self.step_seconds
        self.scheduler.num_preemptions = 4
        runs = self.runner.thread_policy.runs
        runs[2] = runs.get(2, 0) + 1
        outs = []
        for rid, tokens in list(self.running.items()):
            tokens.append(7)
            done = len(tokens) == 3
            outs.append(SimpleNamespace(request_id=rid, error=None, finished=done,
                                        outputs=[SimpleNamespace(token_ids=list(tokens))],
                                        metrics=SimpleNamespace(num_drafts=0, num_draft_tokens=0,
                                                                num_accepted_tokens=0)))
            if done:
                del self.running[rid]
        return outs


def test_run_batch_keeps_n_requests_in_flight_until_all_are_done():
    """A fake engine that gives each request one token a step for three steps: with 6 prompts at
    concurrency 2, never more than 2 run at once, and a finished one is replaced right away."""
    from specserve.bench.load import run_batch

    engine = FakeEngine()
    prompts = [BenchPrompt(i, "qa", "t", [1, 2]) for i in range(6)]
    run = run_batch(SimpleNamespace(llm_engine=engine), "plain", prompts, 3, "t", concurrency=2)
    assert engine.peak == 2 and run.num_steps == 9  # three rounds of two
    assert (run.peak_kv_blocks_in_use, run.num_preemptions) == (2, 1)  # held after a step; during the run
    assert run.steps_by_threads == {1: 0, 2: 9}  # the run's own forward passes, by thread count
    assert summarize_run(run)["steps_by_threads"] == {"1": 0, "2": 9}
    assert all(len(t.token_ids) == 3 for t in run.traces) and run.concurrency == 2


def test_each_level_warms_every_engine_at_its_concurrency(monkeypatch):
    """Before a level is timed every engine runs the warm-up prompt N at a time (not a Spec-Bench question)."""
    from specserve.bench import load

    calls = []
    monkeypatch.setattr(load, "render_prompts", lambda tokenizer, rows: [rows[0]["turns"][0]])
    monkeypatch.setattr(load, "run_batch", lambda llm, method, prompts, max_tokens, tag: calls.append(
        (method, len(prompts), set(prompts), tag)))
    engines = {PLAIN: type("Fake", (), {"get_tokenizer": lambda self: None})(), "ngram": None}
    load.warm_up(engines, 8)
    assert calls == [(PLAIN, 8, {load.WARMUP_MESSAGE}, "warmup"), ("ngram", 8, {load.WARMUP_MESSAGE}, "warmup")]


def test_lockstep_times_each_engine_by_its_own_steps(monkeypatch):
    """Two engines take turns a step each on one clock, one 10 ms a step and one 30 ms: each run's wall time
    is its own six steps (three per request, one at a time), not the 240 ms the clock moved in all."""
    from specserve.bench import load

    clock = [0.0]
    monkeypatch.setattr(load.time, "perf_counter", lambda: clock[0])
    engines = {PLAIN: SimpleNamespace(llm_engine=FakeEngine(clock, 0.010)),
               "ngram": SimpleNamespace(llm_engine=FakeEngine(clock, 0.030))}
    prompts = [BenchPrompt(i, "qa", "t", [1, 2]) for i in range(2)]
    plain, ngram = load.run_lockstep(engines, [PLAIN, "ngram"], prompts, 3, "t", 0, 1)
    assert clock[0] == pytest.approx(0.24)
    assert (plain.wall_s, ngram.wall_s) == (pytest.approx(0.06), pytest.approx(0.18))
    assert (plain.num_steps, ngram.num_steps) == (6, 6) and plain.traces[1].added == pytest.approx(0.03)
    assert median_rows([plain, ngram])[1]["vs_plain"] == pytest.approx(1 / 3)


def test_lockstep_end_to_end_on_the_default_model(tmp_path, capsys):
    out_json = tmp_path / "load.json"
    code = main(["bench", "load", "--dataset", DATASET, "--concurrency", "2", "--methods", "ngram,suffix",
                 "--min-requests", "1", "--max-tokens", "8", "--lockstep", "--output-json", str(out_json),
                 "--plot", ""])
    assert code == 0  # every speculative output equals plain decoding's
    report = json.loads(out_json.read_text())
    rows = {(r["method"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(m, 2) for m in (PLAIN, "ngram", "suffix")}
    assert all(r["tokens_per_s"] > 0 and r["num_output_tokens"] == 8 * 2 * 2 for r in rows.values())
    assert (report["greedy_mismatches"], report["greedy_compared"], report["settings"]["lockstep"]) == ([], 8, True)
    assert "(own steps)" in capsys.readouterr().err
