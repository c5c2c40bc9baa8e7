"""Self-synthesized training data: multi-turn conversations whose assistant tokens are exactly the generated
ones, requests about documents, stopped loops, resume, and the shipped data's distance from Spec-Bench."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

from specserve.train.shards import Manifest, read_conversations
from specserve.train.synthesize import SynthConfig, _Conv, describe, synthesize
from specserve.train.text_filters import OverlapGuard, degenerate_reason, specbench_texts, word_ngrams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(REPO, "data", "selfchat")


# ---------------------------------------------------------------- generation with a scripted engine


class CharTokenizer:
    """A chat template of '<role>content|' and one id per character: it round-trips exactly."""

    def apply_chat_template(self, messages, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class ScriptedLLM:
    """Writes user turns from a pool (some degenerate, some duplicated) and answers as a deterministic
    function of the prompt and the sampling seed; records every request."""

    def __init__(self, seed: int = 0) -> None:
        r = random.Random(seed)
        topics = ["cats", "rivers", "taxes", "chess", "bread", "rockets", "poems", "jazz", "glaciers", "maps"]
        self.pool = [f"Tell me about {a} and {b} in {k} short points please" for a, b, k in
                     itertools.product(topics, topics, ["two", "five"])]
        r.shuffle(self.pool)
        self.pool += ["!!!!!!!!!!!!!!!!!!!!!!!!!!", "ok", self.pool[0]]
        self.tok = CharTokenizer()
        self.requests = []

    def get_tokenizer(self):
        return self.tok

    def generate(self, prompts, params, use_tqdm=False):
        outs = []
        for ids, p in zip(prompts, params):
            self.requests.append((list(ids), p))
            text = self.tok.decode(ids)
            if text.endswith("<user>"):
                r = random.Random(p.seed)
                t = r.choice(self.pool) if r.random() > 0.1 else r.choice(self.pool[-3:])
                finish = "length" if r.random() < 0.05 else "stop"
            elif text.endswith("Question:"):  # the user's question after a document
                r = random.Random(p.seed)
                t = r.choice(["why does the", "where is the", "how many"]) + f" {r.choice(self.pool[:20])}" + \
                    r.choice(["?", ""])
                finish = "stop"
            else:
                # -1, not None: hash(None) differs between processes
                r = random.Random(hash((tuple(ids), p.seed if p.temperature else -1)) & 0xFFFF)
                t = " ".join(r.choice(["yes", "so", "the", "answer", "is"]) for _ in range(r.randint(2, 9)))
                finish = "stop" if r.random() < 0.8 else "length"
            out_ids = self.tok.encode(t)[:p.max_tokens]
            outs.append(SimpleNamespace(error=None, outputs=[SimpleNamespace(
                text=self.tok.decode(out_ids), token_ids=out_ids, finish_reason=finish)]))
        return outs


def test_conversations_keep_exactly_the_generated_assistant_tokens(tmp_path):
    llm = ScriptedLLM()
    config = SynthConfig(conversations_per_shard=40, multi_turn_share=0.6, max_turns=3, template_share=0.1,
                         answer_max_tokens=64, max_seq_tokens=4096)
    templates = [f"Summarize the module number {i} for a beginner" for i in range(30)]
    manifest = synthesize(llm, str(tmp_path), 2, 7, config, "scripted", "cmd", OverlapGuard(["x"]), templates,
                          log=lambda *_: None)
    convs = read_conversations(str(tmp_path))
    assert manifest.data["totals"]["conversations"] == len(convs) > 60
    generated = {}
    for ids, p in llm.requests:
        generated.setdefault(tuple(ids), []).append(p)
    tok = llm.tok
    multi = 0
    users = [u for c in convs for u in c.meta["users"]]
    assert len(users) == len(set(users)) and all(degenerate_reason(u) is None for u in users)
    assert {c.meta["source"] for c in convs} == {"magpie", "template"}
    for c in convs:
        text = tok.decode(c.token_ids.tolist())
        assert text.startswith(f"<system>{c.meta['system']}|" if c.meta["system"] else "<user>")
        spans = np.flatnonzero(np.diff(np.r_[0, c.assistant.astype(int), 0]))
        assert len(spans) // 2 == len(c.meta["users"]) == len(c.meta["finish"])
        multi += len(c.meta["users"]) > 1
        for (a, b), user in zip(spans.reshape(-1, 2), c.meta["users"]):
            prompt = c.token_ids[:a].tolist()
            assert tuple(prompt) in generated  # the tokens before each answer are a prompt the engine saw
            assert tok.decode(prompt).endswith(f"<user>{user}|<assistant>")
            assert b - a <= 64
    assert multi >= 5
    mix = describe(str(tmp_path), OverlapGuard(["Tell me about cats and rivers in two short points please"]))
    assert mix["conversations"] == len(convs) and mix["max_specbench_5gram_share"] > 0.3


def test_resume_makes_the_same_shards_and_a_changed_config_is_refused(tmp_path):
    config = SynthConfig(conversations_per_shard=12, answer_max_tokens=32)
    kw = dict(seed=3, config=config, model_name="scripted", guard=None, template_prompts=(), log=lambda *_: None)
    synthesize(ScriptedLLM(), str(tmp_path / "a"), 3, **kw)
    synthesize(ScriptedLLM(), str(tmp_path / "b"), 1, **kw)
    synthesize(ScriptedLLM(), str(tmp_path / "b"), 3, **kw)  # resumed after shard 0
    a, b = Manifest(str(tmp_path / "a")), Manifest(str(tmp_path / "b"))
    assert [s["sha256"] for s in a.shards] == [s["sha256"] for s in b.shards]
    assert len(b.data["commands"]) == 1
    with pytest.raises(ValueError, match="config"):
        synthesize(ScriptedLLM(), str(tmp_path / "b"), 4, **dict(kw, config=SynthConfig(conversations_per_shard=13)))
    shard = tmp_path / "b" / b.shards[1]["file"]
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ValueError, match="sha256"):
        read_conversations(str(tmp_path / "b"))


def test_an_answer_whose_template_does_not_round_trip_ends_the_conversation():
    conv = _Conv("", "magpie", "hello there friend", {"temperature": 0.0}, 2)
    assert conv.add_answer([1, 2, 3], [4, 5], "x", "stop")
    assert not conv.add_answer([1, 2, 9, 4, 5, 6], [7], "y", "stop")  # earlier tokens re-rendered differently
    assert conv.add_answer([1, 2, 3, 4, 5, 6], [7], "y", "stop")
    record = conv.record()
    assert record.assistant.tolist() == [False, False, False, True, True, False, True]


def test_shipped_training_data_has_no_specbench_prompt():
    """No user turn of the shipped self-synthesized data, and no distillation prompt, shares more than 30% of
    its word 5-grams with any Spec-Bench prompt (brute force over the index's candidates)."""
    refs = specbench_texts()
    ref_grams = [word_ngrams(t, 5) for t in refs]
    texts = [u for c in read_conversations(SHIPPED) for u in c.meta["users"]]
    with open(os.path.join(REPO, "data", "distill", "prompts.jsonl")) as f:
        texts += [json.loads(line)["prompt"] for line in f]
    assert len(texts) > 2400
    index = {}
    for i, g in enumerate(ref_grams):
        for x in g:
            index.setdefault(x, set()).add(i)
    for t in texts:
        grams = word_ngrams(t, 5)
        candidates = set().union(*(index.get(g, set()) for g in grams)) if grams else set()
        worst = max((len(grams & ref_grams[i]) / len(grams) for i in candidates), default=0.0)
        assert worst <= 0.3, (t, worst)


def test_describe_command_reports_the_shipped_mix(capsys):
    from specserve.cli import main

    assert main(["synthesize-data", "--out", SHIPPED, "--describe"]) == 0
    mix = json.loads(capsys.readouterr().out)
    manifest = Manifest(SHIPPED)
    assert mix["conversations"] == manifest.data["totals"]["conversations"] >= 256
    assert mix["answer_tokens"] == manifest.data["totals"]["answer_tokens"]
    assert {"magpie", "template"} <= set(mix["sources"]) <= {"magpie", "template", "document"}
    assert mix["max_specbench_5gram_share"] <= 0.3
    with pytest.raises(SystemExit):
        main(["synthesize-data", "--out", SHIPPED])


def test_stopping_loops_ends_each_looping_answer_where_its_loop_shows_and_changes_nothing_else(tmp_path):
    """generate_answers(stop_loops=True) against plain generation on a tiny random model (whose greedy text
    loops): each answer is a prefix of the plain one, a stopped answer ends within check_every tokens of where
    first_loop finds the plain answer's loop (and the same loop), and an answer without a loop is unchanged."""
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    from specserve.train.shards import first_loop
    from specserve.train.synthesize import generate_answers
    from tests.tiny_models import save_hf_folder, tiny_hf_model

    folder = save_hf_folder(tiny_hf_model("llama", vocab_size=40), tmp_path / "m")
    llm = LLM(model=folder, max_model_len=256, max_num_seqs=6, max_num_batched_tokens=256, block_size=8)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 40, int(rng.integers(3, 12))).tolist() for _ in range(10)]
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=200, ignore_eos=True)
              for i in range(10)]
    plain = generate_answers(llm, prompts, params, stop_loops=False)
    stopped = generate_answers(llm, prompts, params, stop_loops=True, check_every=8)
    loops = 0
    for a, b in zip(plain, stopped):
        assert a.token_ids[:len(b.token_ids)] == b.token_ids
        loop = first_loop(a.token_ids)
        if loop is None:
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "length"
        else:
            loops += 1
            assert b.finish_reason == "loop" and loop[2] <= len(b.token_ids) < loop[2] + 8
            assert first_loop(b.token_ids) == loop
    assert loops >= 3
    assert not llm.llm_engine.has_unfinished_requests()


def test_moving_stop_loops_from_is_refused_only_where_it_changes_shards_already_made(tmp_path):
    from specserve.train.shards import config_changes

    recorded = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(SynthConfig()))).items()
                if k != "stop_loops_from"}  # a folder made before the setting existed
    assert config_changes(SynthConfig(), recorded, 5) == []
    assert config_changes(SynthConfig(stop_loops_from=5), recorded, 5) == []  # from the next shard on
    assert config_changes(SynthConfig(stop_loops_from=9), recorded, 5) == []
    assert config_changes(SynthConfig(stop_loops_from=4), recorded, 5) == ["stop_loops_from"]
    assert config_changes(SynthConfig(stop_loops_from=2), dict(recorded, stop_loops_from=3), 5) == ["stop_loops_from"]
    assert config_changes(SynthConfig(answer_max_tokens=64), recorded, 0) == ["answer_max_tokens"]
    kw = dict(seed=3, model_name="scripted", guard=None, template_prompts=(), log=lambda *_: None)
    small = SynthConfig(conversations_per_shard=8, answer_max_tokens=16)
    synthesize(ScriptedLLM(), str(tmp_path), 2, config=small, **kw)
    synthesize(ScriptedLLM(), str(tmp_path), 3, config=dataclasses.replace(small, stop_loops_from=3), **kw)
    assert Manifest(str(tmp_path)).data["config"]["stop_loops_from"] == 3
    with pytest.raises(ValueError, match="stop_loops_from"):
        synthesize(ScriptedLLM(), str(tmp_path), 4, config=dataclasses.replace(small, stop_loops_from=1), **kw)


def test_requests_about_documents_use_each_passage_once_from_earlier_shards_and_resume_identically(tmp_path):
    """From documents_from on, a share of first turns is a request about a document: a given docstring or an
    earlier shard's finished answer within passage_tokens, each used once; a question kind ends with the text
    the target wrote after the passage; the shards are the same when the run resumes midway."""
    from specserve.train.shards import read_shard
    from specserve.train.documents import DOCUMENT_TASKS, passage_key, passages_of

    docs = [f"Document {i}: the river {w} flows past {i} mills and {i % 7} bridges before the sea."
            for i, w in enumerate(["slowly", "quietly", "north", "east", "under hills"] * 4)]
    config = SynthConfig(conversations_per_shard=40, answer_max_tokens=64, documents_from=1, document_share=0.25,
                         passage_tokens=(12, 60), multi_turn_share=0.3)
    kw = dict(seed=5, config=config, model_name="scripted", guard=OverlapGuard(["x"]), template_prompts=(),
              documents=docs, log=lambda *_: None)
    synthesize(ScriptedLLM(), str(tmp_path / "a"), 4, **kw)
    synthesize(ScriptedLLM(), str(tmp_path / "b"), 2, **kw)
    synthesize(ScriptedLLM(), str(tmp_path / "b"), 4, **kw)
    a, b = Manifest(str(tmp_path / "a")), Manifest(str(tmp_path / "b"))
    assert [s["sha256"] for s in a.shards] == [s["sha256"] for s in b.shards]

    tok = CharTokenizer()
    shards = [read_shard(str(tmp_path / "a" / s["file"])) for s in a.shards]
    assert all(c.meta["source"] != "document" for c in shards[0])
    used, questions = [], 0
    for i, convs in enumerate(shards[1:], 1):
        pool = docs + [p for earlier in shards[:i] for p in passages_of(tok, earlier, config.passage_tokens)]
        documents = [c for c in convs if c.meta["source"] == "document"]
        assert len(documents) == round(40 * 0.25)
        for c in documents:
            first = c.meta["users"][0]
            inside = max((p for p in pool if p in first), key=len, default=None)
            assert inside is not None and len(first) - len(inside) < 200, first  # one passage and its request
            used.append(inside)
            assert c.meta["passage"] == passage_key(inside)
            if first.startswith(inside):  # the request after its document points up to it
                assert "below" not in first[len(inside):]
            assert c.meta["task"] in DOCUMENT_TASKS
            if c.meta["task"] == "question":
                assert first.startswith(DOCUMENT_TASKS["question"]) and "\n\nQuestion: " in first
                assert first.split("\n\nQuestion: ")[-1].endswith("?")
                questions += 1
        for c in convs:  # answers as passages: finished ones within the bounds only
            for text in passages_of(tok, [c], config.passage_tokens):
                assert 12 <= len(text) <= 60
    assert len(used) == len(set(used)) and any(p not in docs for p in used) and questions >= 3
    mix = describe(str(tmp_path / "a"))
    assert mix["sources"]["document"] == 30 and any(k.startswith("document: ") for k in mix["tasks"])


def test_documents_from_is_read_from_the_folder_when_not_given(tmp_path):
    from specserve.train.synthesize import shard_from

    args = SimpleNamespace(out=str(tmp_path), documents_from=None, stop_loops_from=-1)
    assert shard_from(args, "documents_from") == 0 and shard_from(args, "stop_loops_from") is None
    synthesize(ScriptedLLM(), str(tmp_path), 1, seed=1, config=SynthConfig(conversations_per_shard=6,
               answer_max_tokens=16, documents_from=4), model_name="scripted", log=lambda *_: None)
    assert shard_from(args, "documents_from") == 4
