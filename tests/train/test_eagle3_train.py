"""EAGLE-3 training: the trained head's forward (TTT steps included) equals specserve's inference head after
save and load, with rope scaling too; training on greedily self-distilled data from a tiny target learns to
draft it; a stopped run resumes with the same loss curve; the saved folder drafts in the engine with output
equal to plain greedy decoding; `specserve train-drafter` runs the whole pipeline on a tiny target.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from specserve.llm import LLM
from specserve.models.drafter_loader import load_drafter_checkpoint
from specserve.models.eagle import Eagle3Head
from specserve.models.registry import build_model
from specserve.sampling_params import SamplingParams
from specserve.train import loop
from specserve.train.eagle3 import Eagle3DraftModel, Eagle3HeadConfig, Eagle3Objective, build_draft_vocab
from specserve.train.features import (FeatureStore, decode_states, encode_states, SequenceFeatures, answer_mask, default_aux_layers,
                                      masked_targets, target_states, write_feature_store)
from tests.models.test_eagle_heads import DraftKV
from tests.tiny_models import hf_config_dict, hf_state_dict, perturb_norms_and_biases, save_hf_folder, tiny_hf_model

LAYERS, VOCAB, DRAFT_VOCAB = 8, 160, 96
PROMPT_LEN, NEW_TOKENS = 8, 40


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, PROMPT_LEN), generator=g).tolist()


@pytest.fixture(scope="module")
def target():
    return tiny_hf_model("llama", num_hidden_layers=LAYERS, initializer_range=0.1)


@pytest.fixture(scope="module")
def spec_target(target):
    return build_model(hf_config_dict(target), hf_state_dict(target), dtype=torch.float32,
                       aux_hidden_layers=default_aux_layers(LAYERS))


def greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0).tolist()


@pytest.fixture(scope="module")
def sequences(target):
    return greedy(target, random_prompts(40, seed=1), NEW_TOKENS)


@pytest.fixture(scope="module")
def data(spec_target, sequences):
    """32 training and 8 held-out sequences of 48 tokens: random prompts + the target's greedy continuation."""
    feats = []
    for seq in sequences:
        states, argmax = target_states(spec_target, seq, "aux")
        feats.append(SequenceFeatures(torch.tensor(seq), states, argmax, answer_mask(len(seq), PROMPT_LEN)))
    return feats[:32], feats[32:]


def new_model(target, features, seed: int = 0) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    vocab = build_draft_vocab(masked_targets(features), VOCAB, DRAFT_VOCAB)
    config = Eagle3HeadConfig.from_target(target.config, DRAFT_VOCAB, default_aux_layers(LAYERS))
    return Eagle3DraftModel(config, target.model.embed_tokens.weight, vocab, target.lm_head.weight.detach())


def test_features_are_the_targets_states_and_greedy_choices(target, spec_target, sequences, data, tmp_path):
    """aux states = transformers' hidden_states at the aux layers; target ids = its argmax, which for greedy
    text is the next token; the memmap store returns them in float16."""
    seq, f = sequences[0], data[0][0]
    with torch.no_grad():
        out = target(torch.tensor([seq]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in default_aux_layers(LAYERS)], -1)
    torch.testing.assert_close(f.hidden, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(f.target_ids, out.logits[0].argmax(-1))
    assert torch.equal(f.target_ids[PROMPT_LEN - 1:-1], torch.tensor(seq[PROMPT_LEN:]))
    assert f.loss_mask.tolist() == [False] * (PROMPT_LEN - 1) + [True] * (len(seq) - PROMPT_LEN + 1)
    store = write_feature_store(spec_target, sequences[:3], [PROMPT_LEN] * 3, str(tmp_path / "store"), "aux")
    assert len(store) == 3 and store.lengths() == [len(s) for s in sequences[:3]]
    again = FeatureStore(str(tmp_path / "store"))[0]
    torch.testing.assert_close(again.hidden, f.hidden, atol=2e-3, rtol=1e-3)  # float16 on disk
    assert torch.equal(again.target_ids, f.target_ids) and torch.equal(again.loss_mask, f.loss_mask)
    assert torch.equal(masked_targets(store), torch.cat([x.target_ids[x.loss_mask] for x in data[0][:3]]))


def test_q8_features_keep_each_block_to_its_own_scale(spec_target, sequences, data, tmp_path):
    """q8 stores int8 blocks of 32 values with a float16 scale: every value within half a step of its block's
    scale, an outlier costs only its own block, and the store masks by a given bool array."""
    h = torch.randn(5, 96) * torch.tensor([1.0] * 95 + [1000.0])
    values, scales = encode_states(h, "q8")
    back = decode_states(values, scales, "q8")
    step = torch.from_numpy(scales).float().repeat_interleave(32, -1)
    assert values.dtype == np.int8 and scales.shape == (5, 3)
    assert ((back - h).abs() <= step / 2 + 1e-3 * h.abs()).all()
    assert (back[:, :64] - h[:, :64]).abs().max() < 0.02  # blocks without the outlier keep their precision
    masks = [np.arange(len(s)) % 3 == 0 for s in sequences[:2]]
    store = write_feature_store(spec_target, sequences[:2], masks, str(tmp_path / "q8"), "aux", "q8")
    assert os.path.getsize(tmp_path / "q8" / "states.bin") == store.num_tokens * store.meta["width"]
    f = store[1]
    assert f.loss_mask.tolist() == masks[1].tolist()
    err = (f.hidden - data[0][1].hidden).abs() / (data[0][1].hidden.abs().amax(-1, keepdim=True) + 1e-6)
    assert err.max() < 0.02 and torch.equal(f.target_ids, data[0][1].target_ids)


def test_feature_store_resumes_and_extends_without_recomputing(spec_target, sequences, tmp_path, monkeypatch):
    """An interrupted store goes on from its last checkpoint, and a store asked for more sequences (a data
    folder that grew) computes only the new ones: either way the same files as one uninterrupted run."""
    from specserve.train import features

    fresh = write_feature_store(spec_target, sequences[:6], [PROMPT_LEN] * 6, str(tmp_path / "fresh"), "aux", "q8")
    calls, real = [], features.target_states

    def counted(model, seq, kind):
        calls.append(len(seq))
        if len(calls) == 5 and crash:
            raise KeyboardInterrupt
        return real(model, seq, kind)

    monkeypatch.setattr(features, "target_states", counted)
    folder = str(tmp_path / "grown")
    crash = False
    write_feature_store(spec_target, sequences[:2], [PROMPT_LEN] * 2, folder, "aux", "q8")
    crash = True
    with pytest.raises(KeyboardInterrupt):  # two new sequences written, the fifth fails
        write_feature_store(spec_target, sequences[:6], [PROMPT_LEN] * 6, folder, "aux", "q8", checkpoint_every_s=0)
    crash, calls[:] = False, []
    store = write_feature_store(spec_target, sequences[:6], [PROMPT_LEN] * 6, folder, "aux", "q8")
    assert len(calls) == 2 and store.meta["complete"] and store.meta["num_done"] == 6
    for name in ("states.bin", "scales.bin", "tokens.npy", "targets.npy", "mask.npy", "offsets.npy"):
        assert (tmp_path / "fresh" / name).read_bytes() == (tmp_path / "grown" / name).read_bytes(), name
    assert write_feature_store(spec_target, sequences[:6], [PROMPT_LEN] * 6, folder, "aux", "q8") and len(calls) == 2
    before = {p.name: p.read_bytes() for p in (tmp_path / "grown").iterdir()}
    first = write_feature_store(spec_target, sequences[:3], [PROMPT_LEN] * 3, folder, "aux", "q8")
    assert len(calls) == 2 and len(first) == 3 and first.sequence_ids() == [0, 1, 2]  # the larger store's first ones
    assert torch.equal(first[2].hidden, store[2].hidden) and first.num_tokens == int(store.offsets[3])
    assert {p.name: p.read_bytes() for p in (tmp_path / "grown").iterdir()} == before  # and it is kept whole
    other = write_feature_store(spec_target, sequences[1:4], [PROMPT_LEN] * 3, folder, "aux", "q8")
    assert len(calls) == 5 and len(other) == 3  # not a prefix: recomputed
    assert fresh.meta["num_loss_tokens"] == store.meta["num_loss_tokens"]


def test_draft_vocab_is_the_most_frequent_targets_ascending(data):
    train, _ = data
    vocab = build_draft_vocab(masked_targets(train), VOCAB, DRAFT_VOCAB)
    counts = torch.bincount(masked_targets(train), minlength=VOCAB)
    assert torch.equal(vocab.token_ids, vocab.token_ids.sort().values)
    assert counts[vocab.token_ids].min() >= counts[~vocab.t2d].max()
    assert torch.equal(torch.arange(DRAFT_VOCAB) + vocab.d2t, vocab.token_ids)
    assert int(vocab.t2d.sum()) == DRAFT_VOCAB
    ids = vocab.token_ids[[0, 5, DRAFT_VOCAB - 1]]
    assert vocab.to_draft(ids).tolist() == [0, 5, DRAFT_VOCAB - 1]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(masked_targets(train), VOCAB, VOCAB + 1)


def saved_and_loaded(model: Eagle3DraftModel, target, folder: str):
    """Saves the model's head to folder, gives the model the weights as written (float16) and loads the
    folder in the engine: (checkpoint, Eagle3Head on specserve's copy of target)."""
    Eagle3Objective(model).save(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    ckpt = load_drafter_checkpoint(folder, "eagle3")
    spec_target = build_model(hf_config_dict(target), hf_state_dict(target), dtype=torch.float32,
                              aux_hidden_layers=ckpt.aux_layers_for(target.config.num_hidden_layers))
    return ckpt, Eagle3Head(ckpt, spec_target)


def assert_forward_equals_head(model: Eagle3DraftModel, head: Eagle3Head, f: SequenceFeatures) -> None:
    """Step 0 over a whole sequence equals the head's paged prefill; TTT step i at row t equals the head's
    i-th single-token draft step after a prefill of rows 0..t (teacher-forced tokens)."""
    batch = loop.collate([f])
    with torch.no_grad():
        steps = [model.logits(s[0]) for s in model.unroll(batch.input_ids, batch.hidden, 3)]  # [T, Vd] each
    n = len(f) - 1  # step 0 rows 0..T-2 read tokens 1..T-1
    kv = DraftKV(head, [[5, 2, 9, 0, 7, 3, 11, 1, 4, 8, 6, 10, 12]])
    with torch.inference_mode():
        g = head.forward(f.input_ids[1:], head.project_aux(f.hidden[:n]), torch.arange(n), kv.meta([(0, n)]),
                         kv.cache)
        assert (head.compute_logits(g) - steps[0][:n]).abs().max().item() < 1e-4
        assert torch.equal(head.greedy_tokens(g), model.draft_to_target(steps[0][:n].argmax(-1)))
        t = 30  # a prefill of rows 0..t, then single-token steps at positions t + i reading token t + 1 + i
        kv = DraftKV(head, [[3, 7, 1, 12, 5, 0, 9, 2, 11, 4, 8, 6, 10]])
        g = head.forward(f.input_ids[1:t + 2], head.project_aux(f.hidden[:t + 1]), torch.arange(t + 1),
                         kv.meta([(0, t + 1)]), kv.cache)[-1:]
        for i in (1, 2):
            g = head.forward(f.input_ids[t + 1 + i:t + 2 + i], g, torch.tensor([t + i]), kv.meta([(t + i, 1)]),
                             kv.cache)
            assert (head.compute_logits(g)[0] - steps[i][t]).abs().max().item() < 1e-4, i


def test_training_forward_equals_inference_head_after_save_and_load(target, data, tmp_path):
    train, _ = data
    model = perturb_norms_and_biases(new_model(target, train, seed=3)).eval()
    ckpt, head = saved_and_loaded(model, target, str(tmp_path / "draft"))
    assert "embed_tokens.weight" not in ckpt.state_dict and "t2d" in ckpt.ignored_keys
    assert ckpt.aux_layers_for(LAYERS) == default_aux_layers(LAYERS)
    assert_forward_equals_head(model, head, train[0])


def test_rope_scaling_is_trained_and_saved_as_the_engine_applies_it(tmp_path):
    """A target with linear rope scaling: the head trains with the scaled RoPE and its config.json carries the
    scaling, so the training forward still equals the engine's head."""
    target = tiny_hf_model("llama", num_hidden_layers=LAYERS, initializer_range=0.1,
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    g = torch.Generator().manual_seed(2)
    f = SequenceFeatures(torch.randint(3, VOCAB, (PROMPT_LEN + NEW_TOKENS,), generator=g),
                         torch.randn(PROMPT_LEN + NEW_TOKENS, 3 * target.config.hidden_size, generator=g),
                         torch.randint(3, VOCAB, (PROMPT_LEN + NEW_TOKENS,), generator=g),
                         answer_mask(PROMPT_LEN + NEW_TOKENS, PROMPT_LEN))
    torch.manual_seed(3)
    config = Eagle3HeadConfig.from_target(target.config, DRAFT_VOCAB, default_aux_layers(LAYERS))
    vocab = build_draft_vocab(f.target_ids, VOCAB, DRAFT_VOCAB)
    model = perturb_norms_and_biases(Eagle3DraftModel(config, target.model.embed_tokens.weight, vocab)).eval()
    folder = str(tmp_path / "draft")
    _, head = saved_and_loaded(model, target, folder)
    with open(os.path.join(folder, "config.json")) as file:
        assert json.load(file)["rope_scaling"]["factor"] == 2.0
    assert_forward_equals_head(model, head, f)


CONFIG = loop.LoopConfig(lr=3e-3, epochs=10, batch_tokens=4 * (PROMPT_LEN + NEW_TOKENS), progress=False)


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    train, held_out = data
    objective = Eagle3Objective(new_model(target, train, seed=0), num_steps=3)
    with torch.no_grad():
        before = objective.loss(loop.collate(train)).item()
    accuracy_before = loop.evaluate(objective, held_out)
    folder = str(tmp_path_factory.mktemp("eagle3"))
    state = loop.train(objective, train, held_out, CONFIG, folder, log=lambda _: None)
    objective.save(folder)
    with torch.no_grad():
        after = objective.loss(loop.collate(train)).item()
    return dict(before=before, after=after, accuracy_before=accuracy_before, accuracy=state.evals[-1]["accuracy"],
                folder=folder, state=state)


def test_training_reduces_loss_and_drafts_held_out_text(trained):
    print(f"loss {trained['before']:.3f} -> {trained['after']:.3f}; held-out step-k accuracy "
          f"{trained['accuracy_before']} -> {trained['accuracy']}; {trained['state'].seconds:.1f} s")
    assert trained["state"].done and len(trained["state"].evals) == CONFIG.epochs
    assert trained["after"] < 0.5 * trained["before"]
    # chance is about 1 / Vd; the tiny target's text is half repeats of novel tokens, so 1.5K tokens teach
    # much less than that: the bar is "learned something that transfers", not a good drafter
    assert trained["accuracy"][0] > 20 / DRAFT_VOCAB
    assert trained["accuracy"][0] > trained["accuracy_before"][0] + 0.15
    log = [json.loads(line) for line in open(os.path.join(trained["folder"], loop.LOG))]
    assert [r["step"] for r in log if "loss" in r] == list(range(10, trained["state"].step + 1, 10))


def test_resume_continues_with_the_same_loss_curve(target, data, tmp_path):
    """A run stopped at step 13 and resumed from its checkpoint takes the same steps, to the same losses and
    weights, as one run straight through."""
    train, held_out = data
    config = loop.LoopConfig(lr=3e-3, epochs=3, batch_tokens=4 * (PROMPT_LEN + NEW_TOKENS), progress=False)
    quiet = dict(log=lambda _: None)
    straight = Eagle3Objective(new_model(target, train, seed=0), num_steps=2)
    full = loop.train(straight, train, held_out, config, str(tmp_path / "a"), **quiet)
    first = Eagle3Objective(new_model(target, train, seed=0), num_steps=2)
    stopped = loop.train(first, train, held_out, config, str(tmp_path / "b"), max_steps=13, **quiet)
    assert stopped.step == 13 and not stopped.done
    second = Eagle3Objective(new_model(target, train, seed=5), num_steps=2)  # other weights until resumed
    resumed = loop.train(second, train, held_out, config, str(tmp_path / "b"), resume=True, **quiet)
    assert resumed.done and resumed.step == full.step == 24
    assert resumed.losses == full.losses
    for (name, a), b in zip(straight.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="another configuration"):
        other = loop.LoopConfig(lr=1e-3, epochs=3, batch_tokens=config.batch_tokens, progress=False)
        loop.train(first, train, held_out, other, str(tmp_path / "b"), resume=True, **quiet)


def test_saved_head_drafts_in_the_engine_with_greedy_output(target, trained, tmp_path):
    folder = save_hf_folder(target, tmp_path / "target")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, seed=99)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine = dict(max_model_len=128, block_size=8, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    plain = [o.outputs[0].token_ids for o in LLM(model=folder, **engine).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=folder, speculative_config={"method": "eagle3", "model": trained["folder"],
                                                "num_speculative_tokens": 3,
                                                # a fixed draft length: this checks the head, not the pricing
                                                "adaptive_draft_length": False}, **engine)
    drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    m = llm.get_metrics()
    print(f"accepted {m.num_accepted_tokens} of {m.num_draft_tokens} drafts, {m.num_drafts} rounds")
    assert drafted == plain
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0


def test_train_drafter_command_end_to_end(target, tmp_path):
    """`specserve train-drafter` on a tiny target: answers, features, training, the head folder with its model
    card; --resume after the run reuses the answers and features and finds training done."""
    from specserve.cli import main
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    folder = save_hf_folder(target, tmp_path / "target")
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{t}" for t in p)}) + "\n"
                               for p in random_prompts(24, seed=4)))
    out = tmp_path / "head"
    argv = ["train-drafter", "--method", "eagle3", "--model", folder, "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "24", "--draft-vocab-size", "64", "--ttt-steps", "2", "--epochs", "2",
            "--batch-tokens", "128", "--held-out-every", "6", "--eval-prompts", "2",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8"]
    assert main(argv) == 0
    store = FeatureStore(str(out / "work" / "features"))
    assert len(store) == 24 and store.kind == "aux"
    assert len(store.meta["sequence_ids"]) == 24
    ckpt = load_drafter_checkpoint(str(out), "eagle3")
    assert ckpt.aux_layers_for(LAYERS) == default_aux_layers(LAYERS)
    card = (out / "README.md").read_text()
    assert "specserve train-drafter" in card and "Mean acceptance length at k=4 on 2 held-back prompts" in card
    assert "20 sequences trained on, 4 held back" in card
    steps = torch.load(out / "work" / loop.CHECKPOINT, weights_only=False)["state"]["step"]
    assert main(argv + ["--resume"]) == 0
    assert torch.load(out / "work" / loop.CHECKPOINT, weights_only=False)["state"]["step"] == steps
    with pytest.raises(SystemExit):
        main(["train-drafter", "--method", "nope", "--prompts", str(prompts), "--out", str(out)])
    assert main(argv[:-2] + ["--max-num-seqs", "4", "--max-tokens", "12", "--resume"]) == 2  # another run


def test_train_drafter_on_a_synthesized_data_folder(target, tmp_path):
    """--data: conversations from a `synthesize-data` folder train as they are; only assistant tokens count,
    every N-th conversation is held back, and the card names the folder and the feature settings."""
    from specserve.cli import main
    from specserve.train.shards import Conversation, Manifest, write_shard
    from specserve.train.synthesize import SynthConfig

    folder = save_hf_folder(target, tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    convs = []
    for seq in greedy(target, random_prompts(12, seed=5), 16):
        assistant = np.zeros(len(seq), bool)
        assistant[PROMPT_LEN:] = True
        convs.append(Conversation(np.array(seq), assistant, {"system": "", "users": ["t5 t6 t7"], "source": "magpie",
                                                             "answer": {"temperature": 0.0}, "finish": ["length"]}))
    manifest = Manifest(str(data))
    manifest.start("tiny", 0, SynthConfig(), "test")
    manifest.add(dict(file="shard-00000.npz", sha256=write_shard(str(data / "shard-00000.npz"), convs), conversations=12,
                      turns=12, tokens=sum(len(c.token_ids) for c in convs), answer_tokens=12 * 16))
    out = tmp_path / "head"
    argv = ["train-drafter", "--method", "eagle3", "--model", folder, "--data", str(data), "--out", str(out),
            "--draft-vocab-size", "64", "--ttt-steps", "2", "--epochs", "1", "--batch-tokens", "128",
            "--held-out-every", "4", "--eval-prompts", "0", "--feature-dtype", "q8"]
    assert main(argv) == 0
    store = FeatureStore(str(out / "work" / "features"))
    assert len(store) == 12 and store.meta["dtype"] == "q8"
    assert store.meta["num_loss_tokens"] == 12 * 16  # the prompt's last token through the answer's second-last
    card = (out / "README.md").read_text()
    assert "12 conversations from" in card and "9 sequences trained on, 3 held back" in card
    assert "as the engine computes them, stored as q8" in card
    with pytest.raises(SystemExit):  # one source of data
        main(argv + ["--prompts", "p.jsonl"])
    states = out / "work" / "features" / "states.bin"
    made = states.stat().st_mtime_ns
    smaller = ["--out", str(tmp_path / "small"), "--max-conversations", "5", "--features", str(out / "work" / "features")]
    assert main(argv[:7] + smaller + argv[9:]) == 0  # the same held-back conversations, fewer trained on
    assert "5 sequences trained on, 3 held back" in (tmp_path / "small" / "README.md").read_text()
    assert states.stat().st_mtime_ns == made  # the features were reused
    before = load_drafter_checkpoint(str(out), "eagle3").state_dict
    tuned = tmp_path / "tuned"
    assert main(argv[:7] + ["--out", str(tuned), "--init", str(out), "--features", str(out / "work" / "features"),
                            "--lr", "1e-4"] + argv[9:]) == 0  # from the saved head, its vocabulary kept
    after = load_drafter_checkpoint(str(tuned), "eagle3").state_dict
    assert torch.equal(after["d2t"], before["d2t"]) and not torch.equal(after["fc.weight"], before["fc.weight"])
    assert (after["fc.weight"].float() - before["fc.weight"].float()).abs().max() < 0.05


def test_loop_tails_cut_shortens_the_trained_conversations_and_keeps_the_held_back_whole(tmp_path):
    """--loop-tails cut: an answer ending in a repetition loop is trained on up to two periods of it; the
    held-back conversations are the target's answers as they are, so runs with and without the cut are
    measured on the same positions."""
    from specserve.train.pipeline import conversation_sequences
    from specserve.train.shards import Conversation, Manifest, write_shard
    from specserve.train.synthesize import SynthConfig

    rng = np.random.default_rng(0)
    convs = []
    for i in range(8):
        answer = rng.integers(100, 200, 30).tolist() + ([5, 6, 7] * 40 if i % 2 else rng.integers(100, 200, 120).tolist())
        ids = [1, 2, 3] + answer
        convs.append(Conversation(np.array(ids), np.array([False] * 3 + [True] * len(answer)),
                                  {"system": "", "users": ["u"], "finish": ["length"]}))
    manifest = Manifest(str(tmp_path))
    manifest.start("tiny", 0, SynthConfig(), "test")
    manifest.add(dict(file="shard-00000.npz", sha256=write_shard(str(tmp_path / "shard-00000.npz"), convs),
                      conversations=8, turns=8, tokens=0, answer_tokens=0))
    whole, held, _, _ = conversation_sequences(str(tmp_path), None, 4, "keep")
    cut, held_cut, _, _ = conversation_sequences(str(tmp_path), None, 4, "cut")
    assert held == held_cut == {3, 7}
    for (i, ids, mask), (j, cut_ids, cut_mask) in zip(whole, cut):
        assert i == j and cut_ids == ids[:len(cut_ids)]
        if i % 2 and i not in held:  # a looping answer trained on: 30 tokens of text, then two periods of 3
            assert len(cut_ids) == 3 + 30 + 6 and cut_mask.sum() == 30 + 6
        else:
            assert cut_ids == ids and np.array_equal(cut_mask, mask)


def test_a_subset_with_masks_counts_only_the_positions_both_allow():
    from specserve.train.features import Subset

    data = [SequenceFeatures(torch.arange(n), torch.randn(n, 3), torch.arange(n) + 1, torch.arange(n) % 3 > 0)
            for n in (5, 7)]
    masks = [np.array([True, True, False, True, False]), np.ones(7, bool)]
    sub = Subset(data, [1, 0], masks[::-1])
    assert len(sub) == 2 and torch.equal(sub[0].loss_mask, data[1].loss_mask)
    assert sub[1].loss_mask.tolist() == [False, True, False, False, False]
    assert torch.equal(sub[1].hidden, data[0].hidden) and torch.equal(sub[1].input_ids, data[0].input_ids)
    assert Subset(data, [0])[0] is data[0]
