"""specserve.structured.grammar on the default model's tokenizer: walks through each kind of grammar produce
text that the spec's own reference accepts (jsonschema_rs, re.fullmatch), and the matcher's state moves
(accept, validate, rollback, draft masks, forced tokens) agree with stepping one token at a time."""
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema_rs
import pytest
import torch

from specserve.structured import grammar
from specserve.structured.grammar import GRAMMAR_KINDS, GrammarCompiler, GrammarError, GrammarMatcher
from specserve.tokenizer import load_tokenizer

EXTRA_IDS = 64  # the model's logits are wider than the tokenizer in some checkpoints

WEATHER = {"type": "object", "properties": {"temperature_celsius": {"type": "integer"}},
           "required": ["temperature_celsius"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    "tags": {"type": "array", "items": {"enum": ["admin", "staff", "guest"]}, "maxItems": 3},
    "manager": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["name", "age", "email", "zip", "tags"], "additionalProperties": False}
CATALOG = {"$defs": {"variant": {"type": "object", "properties": {
    "size": {"enum": ["S", "M", "L"]}, "price": {"type": "number", "minimum": 0}, "in_stock": {"type": "boolean"}},
    "required": ["size", "price", "in_stock"], "additionalProperties": False}},
    "type": "object", "properties": {
        "product": {"type": "string"},
        "variants": {"type": "array", "items": {"$ref": "#/$defs/variant"}, "minItems": 1}},
    "required": ["product", "variants"], "additionalProperties": False}
JSON_CASES = [
    (WEATHER, {"temperature_celsius": -12}),
    (PERSON, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "zip": "02139",
              "tags": ["admin", "guest"], "manager": None}),
    (CATALOG, {"product": "Trail Runner", "variants": [{"size": "M", "price": 89.5, "in_stock": True},
                                                        {"size": "L", "price": 92, "in_stock": False}]}),
]
PHONE = r"\+?1?[ -]?\(?[0-9]{3}\)?[ -]?[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
SQL_GBNF = r'''root ::= "SELECT " columns " FROM " ident where? ";"
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " ident " " op " " value
op ::= "=" | "<" | ">" | "<=" | ">="
value ::= [0-9] [0-9]? | "'" [a-z ]{0,8} "'"
ident ::= [a-z] [a-z_]{0,7}'''
SQL_LARK = r'''start: "SELECT " columns " FROM " IDENT where? ";"
columns: "*" | IDENT (", " IDENT)*
where: " WHERE " IDENT " " OP " " VALUE
OP: "=" | "<" | ">" | "<=" | ">="
VALUE: /[0-9][0-9]?/ | /'[a-z ]{0,8}'/
IDENT: /[a-z][a-z_]{0,7}/'''
# The same language as a Python regex, the reference the walks are checked against.
SQL_REGEX = r"SELECT (\*|[a-z][a-z_]{0,7}(, [a-z][a-z_]{0,7})*) FROM [a-z][a-z_]{0,7}" \
            r"( WHERE [a-z][a-z_]{0,7} (=|<|>|<=|>=) ([0-9][0-9]?|'[a-z ]{0,8}'))?;"
SQL_ANSWER = "SELECT name, age FROM users WHERE age >= 21;"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + EXTRA_IDS)


@pytest.fixture(scope="module")
def eos(tokenizer):
    return min(tokenizer.eos_token_ids)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def walk_answer(matcher, token_ids, eos_ids):
    """Accept each token after checking its mask allows it; EOS must be allowed only after the last one."""
    for token_id in token_ids:
        mask = matcher.allowed_mask()
        assert mask[token_id], f"token {token_id} refused"
        assert not mask[sorted(eos_ids)].any(), "EOS allowed before the output is complete"
        assert not matcher.is_terminated()
        assert matcher.accept([token_id]) == 1
    mask = matcher.allowed_mask()
    assert mask[sorted(eos_ids)].all()
    return mask


def lowest_id_walk(tokenizer, matcher, max_steps=64):
    """Always take the lowest allowed id (EOS, a low id, ends the walk as soon as the grammar may end)."""
    ids = []
    for _ in range(max_steps):
        token_id = int(matcher.allowed_mask().nonzero()[0])
        assert matcher.accept([token_id]) == 1
        if token_id in tokenizer.eos_token_ids:
            assert matcher.is_terminated()
            return tokenizer.decode(ids)
        ids.append(token_id)
    raise AssertionError(f"no EOS after {max_steps} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("schema, answer", JSON_CASES, ids=["weather", "person", "catalog"])
def test_json_schema_answer_walks_and_validates(tokenizer, compiler, schema, answer):
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    assert validator.is_valid(answer)
    text = json.dumps(answer)
    matcher = GrammarMatcher(compiler.compile("json", schema))
    walk_answer(matcher, encode(tokenizer, text), tokenizer.eos_token_ids)
    assert matcher.accept([min(tokenizer.eos_token_ids)]) == 1 and matcher.is_terminated()


def test_json_schema_refuses_what_the_schema_forbids(tokenizer, compiler):
    matcher = GrammarMatcher(compiler.compile("json", PERSON))
    bad_zip = json.dumps({"name": "Ada", "age": 36, "email": "ada@example.org", "zip": "0213x"})
    bad_enum = json.dumps({"name": "Ada", "age": 36, "email": "ada@example.org", "zip": "02139", "tags": ["root"]})
    for text, refused_at in ((bad_zip, bad_zip.index("0213x") + 4), (bad_enum, bad_enum.index("root"))):
        ids = encode(tokenizer, text)
        accepted = matcher.validate(ids)
        assert len(tokenizer.decode(ids[:accepted])) <= refused_at < len(tokenizer.decode(ids[:accepted + 1]))


def test_json_object_walk(tokenizer, compiler):
    text = json.dumps({"id": 7, "tags": ["a", "b"], "nested": {"ok": True, "x": None, "pi": 3.14}})
    matcher = GrammarMatcher(compiler.compile("json_object"))
    walk_answer(matcher, encode(tokenizer, text), tokenizer.eos_token_ids)
    assert isinstance(json.loads(text), dict)
    assert GrammarMatcher(compiler.compile("json_object")).validate(encode(tokenizer, "[1, 2]")) == 0


@pytest.mark.parametrize("kind, spec, reference", [
    ("regex", PHONE, PHONE),
    ("choice", CHOICES, "|".join(map(re.escape, CHOICES))),
    ("grammar", SQL_GBNF, SQL_REGEX),
    ("grammar", SQL_LARK, SQL_REGEX),
], ids=["regex", "choice", "gbnf", "lark"])
def test_lowest_id_walk_matches_the_reference(tokenizer, compiler, kind, spec, reference):
    text = lowest_id_walk(tokenizer, GrammarMatcher(compiler.compile(kind, spec)))
    assert re.fullmatch(reference, text), text


@pytest.mark.parametrize("kind, spec, answers", [
    ("regex", PHONE, ["+1 (415) 555-0134", "415-555-0134"]),
    ("choice", CHOICES, CHOICES),
    ("grammar", SQL_GBNF, [SQL_ANSWER, "SELECT * FROM t;"]),
    ("grammar", SQL_LARK, [SQL_ANSWER, "SELECT a, b_c FROM xy WHERE q = 'hi there';"]),
], ids=["regex", "choice", "gbnf", "lark"])
def test_known_answers_walk(tokenizer, compiler, kind, spec, answers):
    for answer in answers:
        matcher = GrammarMatcher(compiler.compile(kind, spec))
        ids = encode(tokenizer, answer)
        for token_id in ids:
            assert matcher.allowed_mask()[token_id]
            assert matcher.accept([token_id]) == 1
        assert matcher.allowed_mask()[min(tokenizer.eos_token_ids)], answer


def test_eos_allowed_exactly_where_the_grammar_may_end(tokenizer, compiler, eos):
    matcher = GrammarMatcher(compiler.compile("regex", "ab+"))
    a, b = encode(tokenizer, "a")[0], encode(tokenizer, "b")[0]
    assert not matcher.allowed_mask()[eos]
    assert matcher.accept([eos]) == 0
    matcher.accept([a])
    assert not matcher.allowed_mask()[eos]
    matcher.accept([b])
    mask = matcher.allowed_mask()
    assert mask[eos] and mask[b] and not matcher.is_terminated()  # may end, may go on
    assert matcher.accept([eos, b]) == 1 and matcher.is_terminated()
    assert matcher.accept([b]) == 0 and matcher.validate([eos]) == 0
    # A grammar that cannot go on is terminated before its EOS: only EOS is allowed.
    stopped = GrammarMatcher(compiler.compile("json", WEATHER))
    stopped.accept(encode(tokenizer, json.dumps({"temperature_celsius": 3})))
    assert stopped.is_terminated()
    assert stopped.allowed_mask().nonzero().flatten().tolist() == sorted(tokenizer.eos_token_ids)
    assert stopped.validate([eos]) == 1 and stopped.accept([eos]) == 1


def test_accept_validate_rollback_agree(tokenizer, compiler, eos):
    schema, answer = JSON_CASES[2]
    ids = encode(tokenizer, json.dumps(answer)) + [eos]
    wrong = encode(tokenizer, "}")[0]
    cut = 20
    assert ids[cut] != wrong
    corrupted = ids[:cut] + [wrong] + ids[cut:]
    matcher = GrammarMatcher(compiler.compile("json", schema))
    assert matcher.validate(corrupted) == cut
    assert matcher.validate(ids) == len(ids)  # validation leaves the state alone
    assert matcher.accept(corrupted) == cut
    assert matcher.accept(ids[cut:]) == len(ids) - cut and matcher.is_terminated()
    # Undo k tokens from every depth: the mask equals the one seen when the matcher was there before.
    replay = GrammarMatcher(compiler.compile("json", schema))
    masks = [replay.allowed_mask()]
    for token_id in ids:
        replay.accept([token_id])
        masks.append(replay.allowed_mask())
    for k in (1, 4, 16):
        for depth in range(k, len(ids) + 1, 7):
            matcher.rollback(len(ids) - depth)  # back to `depth` accepted tokens
            matcher.rollback(k)
            assert torch.equal(matcher.allowed_mask(), masks[depth - k])
            assert matcher.accept(ids[depth - k:]) == len(ids) - depth + k
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(len(ids) + 1)
    matcher.rollback(len(ids))
    assert torch.equal(matcher.allowed_mask(), masks[0])


def test_allowed_masks_equal_stepping(tokenizer, compiler, eos):
    schema, answer = JSON_CASES[1]
    ids = encode(tokenizer, json.dumps(answer)) + [eos]
    matcher = GrammarMatcher(compiler.compile("json", schema))
    for start in range(0, len(ids), 3):
        drafts = ids[start:start + 4]
        before = matcher.allowed_mask()
        got = matcher.allowed_masks(drafts)
        assert got.shape == (len(drafts) + 1, compiler.vocab_size) and got.dtype == torch.bool
        stepper = GrammarMatcher(compiler.compile("json", schema))
        stepper.accept(ids[:start])
        expected = [stepper.allowed_mask()]
        for token_id in drafts:
            stepper.accept([token_id])
            expected.append(stepper.allowed_mask())
        assert torch.equal(got, torch.stack(expected))
        assert torch.equal(matcher.allowed_mask(), before)  # state unchanged
        matcher.accept(ids[start:start + 3])
    bad = GrammarMatcher(compiler.compile("json", schema))
    with pytest.raises(ValueError, match="validate first"):
        bad.allowed_masks([ids[0], ids[0]])
    assert torch.equal(bad.allowed_mask(), GrammarMatcher(compiler.compile("json", schema)).allowed_mask())


def test_forced_tokens_spell_the_constant_key(tokenizer, compiler):
    matcher = GrammarMatcher(compiler.compile("json", WEATHER))
    assert matcher.accept(encode(tokenizer, "{")) == 1
    before = matcher.allowed_mask()
    forced = matcher.forced_tokens(32)
    text = tokenizer.decode(forced)
    assert text.startswith('"temperature_celsius"') and '"temperature_celsius": '.startswith(text), text
    assert torch.equal(matcher.allowed_mask(), before)  # state unchanged
    assert matcher.forced_tokens(2) == forced[:2]
    assert matcher.validate(forced) == len(forced)
    # Once the key is written, the value (any integer) is free: nothing more is forced.
    matcher.accept(forced)
    assert tokenizer.decode(forced + matcher.forced_tokens(8)) in ('"temperature_celsius":', '"temperature_celsius": ')
    assert matcher.forced_tokens(0) == []


@pytest.mark.parametrize("kind, spec, message", [
    ("json", {"type": "objectx"}, "json schema: .*objectx"),
    ("json", "{not json", "json schema: not valid JSON"),
    ("json", [1, 2], "json schema: expected a JSON object"),
    ("json", {"type": "string", "pattern": "(a"}, "json schema: .*unclosed group"),
    ("regex", "(a", "regex: .*unclosed group"),
    ("regex", 42, "regex: expected a non-empty string"),
    ("choice", [], "choice: expected a non-empty list"),
    ("choice", "yes", "choice: expected a non-empty list"),
    ("grammar", "root ::= undefined_rule", "grammar: .*undefined_rule"),
    ("grammar", "start: foo", "grammar: .*foo"),
    ("yaml", "a: 1", "unknown structured output kind 'yaml'"),
])
def test_invalid_specs_raise_value_error(compiler, kind, spec, message):
    with pytest.raises(ValueError, match="(?s)" + message):
        compiler.compile(kind, spec)


@pytest.mark.parametrize("kind, spec", [
    ("json", {"$ref": "#"}),  # refers only to itself
    ("regex", "[^\\x00-\\U0010FFFF]"),  # an empty character class
    ("grammar", "start: x\nx: x"),  # a rule with no way out
    ("json", {"anyOf": [{"$ref": "#"}]}),
])
def test_grammars_no_string_matches_are_refused_at_compile_time(compiler, kind, spec):
    """They compile, but a matcher cannot take its first step: a request with one must never reach a step."""
    with pytest.raises(ValueError, match="no string matches it"):
        compiler.compile(kind, spec)


@pytest.mark.parametrize("kind, spec", [("json", {"type": "object", "properties": {"next": {"$ref": "#"}}}),
                                        ("grammar", 'start: "a" start | "b"'), ("regex", "^$")])
def test_recursive_and_empty_string_grammars_that_match_something_compile(compiler, kind, spec):
    assert compiler.compile(kind, spec).kind == kind


def test_a_matcher_in_error_raises_grammar_error(compiler):
    matcher = GrammarMatcher(compiler.compile("regex", "ab"))
    matcher._matcher.consume_token(0)  # a token the grammar refuses puts llguidance's matcher in its error state
    with pytest.raises(GrammarError, match="grammar matcher failed"):
        matcher.allowed_mask()


def test_cache_returns_the_same_compiled_grammar(compiler, monkeypatch):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    first = compiler.compile("json", schema)
    assert compiler.compile("json", json.loads(json.dumps(schema))) is first
    assert compiler.compile("json", json.dumps(schema)) is first
    # Properties come out in the schema's order, so another order is another grammar.
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    assert compiler.compile("json", reordered) is not first
    assert compiler.compile("regex", "[0-9]+") is compiler.compile("regex", "[0-9]+")
    assert compiler.compile("choice", ["x", "y"]) is compiler.compile("choice", ("x", "y"))
    assert compiler.compile("json_object") is compiler.compile("json_object", {"ignored": True})
    assert compiler.compile("regex", "[0-9]+") is not compiler.compile("regex", "[0-9]*")
    monkeypatch.setattr(grammar, "CACHE_SIZE", 2)
    compiler.compile("regex", "x1"), compiler.compile("regex", "x2")
    evicted = compiler.compile("regex", "x0")
    compiler.compile("regex", "x3"), compiler.compile("regex", "x4")
    assert compiler.compile("regex", "x0") is not evicted


def test_mask_width_is_the_models_vocab(tokenizer, compiler):
    matcher = GrammarMatcher(compiler.compile("json_object"))
    mask = matcher.allowed_mask()
    assert mask.shape == (tokenizer.vocab_size + EXTRA_IDS,) and mask.dtype == torch.bool
    assert not mask[tokenizer.vocab_size:].any() and mask.any()
    assert not mask[tokenizer.all_special_ids].any()
    assert matcher.accept([tokenizer.vocab_size + 1]) == 0 and matcher.validate([tokenizer.vocab_size]) == 0
    assert matcher.accept(encode(tokenizer, "{")) == 1  # an unknown id leaves the matcher usable


def test_all_kinds_are_covered():
    assert set(GRAMMAR_KINDS) == {"json", "json_object", "regex", "choice", "grammar"}


def _rule_chain(num_rules: int) -> str:
    """A Lark grammar whose rules each refer to the next: llguidance recurses once per link."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(num_rules)) + f'r{num_rules}: "a"'


def _ref_chain(num_links: int) -> dict:
    """A JSON schema of arrays whose items refer to the next definition, num_links deep."""
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(num_links)}
    return {"$defs": {**defs, f"d{num_links}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def _nested_dict(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"anyOf": [value]}
    return value


@pytest.mark.parametrize("kind, spec, message", [
    ("json", "[" * 100_000 + "]" * 100_000, "json schema nests objects and arrays more than 100 levels"),
    ("json", _nested_dict(60), "json schema nests objects and arrays more than 100 levels"),
    ("regex", "(a)" * 10_001, "regex holds more than 10000 rules, groups and classes"),
    ("choice", [f"w{i}" for i in range(10_001)], "choice holds more than 10000 strings"),
], ids=["deep-json-text", "deep-schema", "many-groups", "many-choices"])
def test_specs_past_the_limits_are_refused_naming_the_limit(compiler, kind, spec, message):
    """A JSON text nested too deep to decode is a ValueError like any bad spec, not a RecursionError."""
    with pytest.raises(ValueError, match=message):
        compiler.compile(kind, spec)


_CHAINS_SCRIPT = """
import pytest
from specserve.structured.grammar import GrammarCompiler
from specserve.tokenizer import load_tokenizer
from tests.structured.test_grammar import _ref_chain, _rule_chain
tokenizer = load_tokenizer(None)
compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
assert compiler.compile("grammar", _rule_chain(9_990)).kind == "grammar"
assert compiler.compile("json", _ref_chain(4_990)).kind == "json"
with pytest.raises(ValueError, match="grammar holds more than 10000 rules, groups and classes"):
    compiler.compile("grammar", _rule_chain(20_000))
with pytest.raises(ValueError, match="json schema holds more than 10000 objects and arrays"):
    compiler.compile("json", _ref_chain(20_000))
print("all compiled or refused")
"""


def test_rule_and_ref_chains_compile_or_are_refused_without_overflowing_the_stack():
    """Chains of rules and of $refs just inside the limits (far past the ~2,500 links an 8 MiB stack holds)
    compile, longer ones are refused; in a child process, whose crash would otherwise end the test run."""
    result = subprocess.run([sys.executable, "-c", _CHAINS_SCRIPT], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0 and "all compiled or refused" in result.stdout, \
        (result.returncode, result.stderr[-2000:])
