"""`specserve bench structured`'s checks and wiring (the benchmark itself is run by hand): every task's schema
is valid, invalid and differing outputs are reported, and the command is registered."""
import jsonschema_rs

from specserve.bench.structured import TASKS, RunResult, _check, _schema_error
from specserve.cli import build_parser


def test_every_task_schema_is_a_valid_schema_that_its_own_example_can_follow():
    for _, schema in TASKS:
        jsonschema_rs.validator_for(schema)  # raises on an invalid schema
    assert _schema_error('{"name": "Ann", "age": 3, "email": "a@b.c", "student": true}', TASKS[0][1]) is None
    assert "not JSON" in _schema_error('{"name": ', TASKS[0][1])
    assert "schema" in _schema_error('{"name": "Ann"}', TASKS[0][1])


def test_check_reports_invalid_outputs_and_speculative_differences():
    valid = '{"name": "Ann", "age": 3, "email": "a@b.c", "student": true}'
    plain = RunResult("plain", True, token_ids=[[1, 2, 3]], texts=[valid])
    same = RunResult("suffix", True, token_ids=[[1, 2, 3]], texts=[valid])
    other = RunResult("ngram", True, token_ids=[[1, 2, 4]], texts=['{"name": 1}'])
    runs = {(None, False): RunResult("plain", False, texts=["free text"]), (None, True): plain,
            ("suffix", True): same, ("ngram", True): other}
    problems = _check(runs, ["suffix", "ngram"])
    assert len(problems) == 2 and all(p.startswith("ngram task 0") for p in problems)


def test_the_command_is_registered():
    args = build_parser().parse_args(["bench", "structured", "--methods", "suffix", "--max-tokens", "32"])
    assert args.methods == "suffix" and args.max_tokens == 32 and callable(args.func)
