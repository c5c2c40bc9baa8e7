"""`specserve bench latency` and `bench throughput` exit with status 1 when a speculative output differs from
plain decoding's. The engines here are fakes whose speculative output can be made wrong on purpose, so the
commands run end to end (arguments, report, JSON, exit status) in a fraction of a second."""
import json
from pathlib import Path
from types import SimpleNamespace

from specserve.bench.common import mismatch_exit_status, read_specbench
from specserve.cli import main
from specserve.engine_args import speculative_config

DATASET = str(Path(__file__).parents[1] / "data" / "specbench_sample.jsonl")


class FakeTokenizer:
    eos_token_id = 0
    eos_token_ids = {0}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return f"<user>{messages[0]['content']}</user>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 + 1 for c in text]


class FakeLLM:
    """Greedy output = a function of the prompt. With speculation on (and not turned off per request), prompts
    whose text contains `wrong_on` get one token changed: a lossy speculative method."""

    def __init__(self, spec_config: dict | None, wrong_on: str | None):
        self.spec_config, self.wrong_on = spec_config, wrong_on
        self.config = SimpleNamespace(max_num_seqs=4)
        self.llm_engine = SimpleNamespace(kv_cache_manager=SimpleNamespace(reset_prefix_cache=lambda: None))
        self.plain_requests = 0

    def get_tokenizer(self):
        return FakeTokenizer()

    def get_metrics(self):
        return SimpleNamespace(num_preemptions=0)

    def generate(self, prompts, params, use_tqdm=False):
        speculative = self.spec_config is not None and params.num_speculative_tokens != 0
        self.plain_requests += 0 if speculative else len(prompts)
        return [self._output(p, params.max_tokens, speculative) for p in prompts]

    def _output(self, prompt: dict, max_tokens: int, speculative: bool):
        tokens = [(sum(prompt["prompt_token_ids"]) + i) % 97 + 1 for i in range(max_tokens)]
        if speculative and self.wrong_on and self.wrong_on in prompt["prompt"]:
            tokens[3] += 1
        drafts = 4 if speculative else 0
        metrics = SimpleNamespace(arrival_time=0.0, first_token_time=0.01, last_token_time=0.1, num_drafts=drafts,
                                  num_draft_tokens=2 * drafts, num_accepted_tokens=drafts,
                                  accepted_per_position=[drafts, 0], mean_acceptance_length=2.0 if drafts else None)
        return SimpleNamespace(error=None, outputs=[SimpleNamespace(token_ids=tokens)], metrics=metrics)


def _question(category: str) -> dict:
    return next(r for r in read_specbench(DATASET) if r["category"] == category)


# ---------------------------------------------------------------- the exit status itself


def test_mismatch_exit_status_names_each_mismatch(capsys):
    assert mismatch_exit_status("latency", []) == 0
    assert capsys.readouterr().err == ""
    assert mismatch_exit_status("latency", ["specserve ngram on rag question 7: output differs"]) == 1
    err = capsys.readouterr().err
    assert "specserve ngram on rag question 7" in err and "1 speculative output(s) differ" in err


# ---------------------------------------------------------------- bench latency


def _run_latency(monkeypatch, tmp_path, wrong_on: str | None) -> int:
    monkeypatch.setattr("specserve.bench.latency.load_specserve",
                        lambda args, method, config: FakeLLM(config, wrong_on if method == "ngram" else None))
    return main(["bench", "latency", "--dataset", DATASET, "--categories", "qa,rag", "--prompts-per-category", "1",
                 "--methods", "ngram,suffix", "--max-tokens", "8", "--skip-hf",
                 "--output-json", str(tmp_path / "latency.json")])


def test_latency_exits_1_naming_the_method_and_question(monkeypatch, tmp_path, capsys):
    rag = _question("rag")
    assert _run_latency(monkeypatch, tmp_path, wrong_on=rag["turns"][0]) == 1
    out, err = capsys.readouterr()
    assert "0/1 MISMATCH" in out and "GREEDY MISMATCH: specserve ngram" in out  # the table is still printed
    assert f"specserve ngram on rag question {rag['question_id']}" in err and "at token 3" in err
    assert "error: specserve suffix" not in err and err.count("error:") == 2
    report = json.loads((tmp_path / "latency.json").read_text())  # and the JSON still written
    assert [(m["method"], m["question_id"]) for m in report["greedy_mismatches"]] == [("ngram", rag["question_id"])]


def test_latency_exits_0_when_every_output_matches(monkeypatch, tmp_path, capsys):
    assert _run_latency(monkeypatch, tmp_path, wrong_on=None) == 0
    assert "error" not in capsys.readouterr().err


# ---------------------------------------------------------------- bench throughput


def _run_throughput(monkeypatch, tmp_path, extra: list[str], wrong_on: str | None) -> tuple[int, list[FakeLLM]]:
    engines = []

    def load(args):
        engines.append(FakeLLM(speculative_config(args), wrong_on))
        return engines[-1]

    monkeypatch.setattr("specserve.bench.throughput.load_specserve", load)
    code = main(["bench", "throughput", "--dataset", DATASET, "--num-prompts", "8", "--batch1-prompts", "2",
                 "--max-tokens", "8", "--skip-hf", "--output-json", str(tmp_path / "throughput.json"), *extra])
    return code, engines


def test_throughput_exits_1_when_speculation_changes_an_output(monkeypatch, tmp_path, capsys):
    qa = _question("qa")  # among the 8 concurrent prompts, not among the 2 batch-1 ones
    code, _ = _run_throughput(monkeypatch, tmp_path, ["--speculative-method", "ngram"], wrong_on=qa["turns"][0])
    assert code == 1
    out, err = capsys.readouterr()
    assert "speculative vs plain decoding, batch1: 2/2 outputs identical" in out
    assert "concurrent: 7/8 outputs identical MISMATCH" in out
    assert f"specserve ngram, concurrent, qa question {qa['question_id']}" in err and "at token 3" in err
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert report["speculative_vs_plain"]["concurrent"]["mismatches"] == [
        {"question_id": qa["question_id"], "category": "qa", "first_diff": 3}]


def test_throughput_checks_against_plain_decoding_only_with_speculation(monkeypatch, tmp_path, capsys):
    code, (engine,) = _run_throughput(monkeypatch, tmp_path, ["--speculative-method", "suffix"], wrong_on=None)
    assert code == 0 and engine.plain_requests == 2 + 8  # the untimed reference: both scenarios
    code, (engine,) = _run_throughput(monkeypatch, tmp_path, [], wrong_on="<user>")  # every prompt
    assert code == 0 and engine.plain_requests == 2 + 8 + 1  # the timed runs and the warm-up, nothing more
    assert json.loads((tmp_path / "throughput.json").read_text())["speculative_vs_plain"] == {}
    assert "error" not in capsys.readouterr().err

