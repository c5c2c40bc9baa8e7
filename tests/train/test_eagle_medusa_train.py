"""EAGLE-1 and Medusa training: each trained head's forward equals specserve's inference head after save and
load; training on greedily self-distilled text from a tiny target lifts held-back accuracy well above the
untrained head's; the saved folder drafts in the engine with output equal to plain greedy decoding.
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from specserve.llm import LLM
from specserve.models.drafter_loader import load_drafter_checkpoint
from specserve.models.eagle import EagleHead
from specserve.models.medusa import MedusaHeads
from specserve.models.registry import build_model
from specserve.sampling_params import SamplingParams
from specserve.train import loop
from specserve.train.eagle import build_eagle
from specserve.train.features import SequenceFeatures, TargetParts, answer_mask, target_states
from specserve.train.medusa import build_medusa
from tests.models.test_eagle_heads import DraftKV
from tests.spec_decode.test_eagle_e2e import counting_llama
from tests.tiny_models import hf_config_dict, hf_state_dict, perturb_norms_and_biases, save_hf_folder

VOCAB, PROMPT_LEN, NEW_TOKENS = 160, 8, 40
NUM_TRAIN, NUM_HELD = 304, 16
K = 3  # Medusa heads, and drafts per step in the engine
CONFIG = loop.LoopConfig(lr=1e-2, epochs=8, batch_tokens=8 * (PROMPT_LEN + NEW_TOKENS), progress=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: OpenMP's synchronization dominates their run time, badly so on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, PROMPT_LEN), generator=g).tolist()


@pytest.fixture(scope="module")
def hf():
    """An 8-layer Llama that counts x -> x + 1 until its layers make it jump: text with a pattern to learn."""
    return counting_llama(8)


@pytest.fixture(scope="module")
def spec_target(hf):
    return build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)


@pytest.fixture(scope="module")
def target(hf) -> TargetParts:
    return TargetParts.from_state_dict(hf_config_dict(hf), hf_state_dict(hf))


@pytest.fixture(scope="module")
def data(hf, spec_target):
    """Training and held-back sequences: random prompts + the target's greedy continuation, with the final
    hidden states of specserve's target."""
    ids = torch.tensor(random_prompts(NUM_TRAIN + NUM_HELD, seed=1))
    with torch.no_grad():
        seqs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
    feats = []
    for seq in seqs:
        states, argmax = target_states(spec_target, seq, "final")
        feats.append(SequenceFeatures(torch.tensor(seq), states, argmax, answer_mask(len(seq), PROMPT_LEN)))
    return feats[:NUM_TRAIN], feats[NUM_TRAIN:]


def as_saved(objective, folder: str):
    """Saves the objective's head to folder and gives its model the weights as written (float16)."""
    objective.save(folder)
    objective.model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
    return objective.model.eval()


# ---------------------------------------------------------------- training forward = inference head


def test_eagle_forward_equals_inference_head_after_save_and_load(target, spec_target, data, tmp_path):
    """Step 0 over a whole sequence equals the head's paged prefill; unrolled step 1 at every row t equals
    the head's single-token draft step after a prefill of rows 0..t (its own g, token t + 2, position t + 1)."""
    objective = build_eagle(target, data[0], seed=3)
    perturb_norms_and_biases(objective.model)
    folder = str(tmp_path / "eagle")
    model = as_saved(objective, folder)
    ckpt = load_drafter_checkpoint(folder, "eagle")
    assert sorted(ckpt.state_dict) == sorted(model.state_dict()) and "fc.bias" in ckpt.state_dict
    head = EagleHead(ckpt, spec_target)
    f = data[1][0]
    batch = loop.collate([f])
    with torch.no_grad():
        steps = [g[0] for g in model.unroll(batch.input_ids, batch.hidden, 2)]  # [T, H] each
    n = len(f) - 1  # step 0 rows 0..T-2 read tokens 1..T-1
    kv = DraftKV(head, [[5, 2, 9, 0, 7, 3, 11, 1, 4, 8, 6, 10, 12]])
    with torch.inference_mode():
        g = head.forward(f.input_ids[1:], head.target_features(f.hidden[:n]), torch.arange(n), kv.meta([(0, n)]),
                         kv.cache)
        assert (g - steps[0][:n]).abs().max().item() < 1e-4
        assert (head.compute_logits(g) - model.logits(steps[0][:n])).abs().max().item() < 1e-3
        assert torch.equal(head.greedy_tokens(g), model.logits(steps[0][:n]).argmax(-1))
        for t in range(n - 1):
            kv = DraftKV(head, [[3, 7, 1, 12, 5, 0, 9, 2, 11, 4, 8, 6, 10]])
            g = head.forward(f.input_ids[1:t + 2], f.hidden[:t + 1], torch.arange(t + 1), kv.meta([(0, t + 1)]),
                             kv.cache)[-1:]
            g = head.forward(f.input_ids[t + 2:t + 3], g, torch.tensor([t + 1]), kv.meta([(t + 1, 1)]), kv.cache)
            assert (g[0] - steps[1][t]).abs().max().item() < 1e-4, t


def test_medusa_forward_equals_inference_heads_after_save_and_load(target, spec_target, data, tmp_path):
    objective = build_medusa(target, data[0], num_heads=K, num_layers=2, seed=3)
    with torch.no_grad():  # fresh ResBlocks are the identity: give them weights that matter
        for p in objective.model.blocks.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    folder = str(tmp_path / "medusa")
    model = as_saved(objective, folder)
    ckpt = load_drafter_checkpoint(folder, "medusa")
    assert ckpt.num_heads == K and ckpt.num_layers == [2] * K
    heads = MedusaHeads(ckpt, spec_target)
    hidden = data[1][0].hidden
    with torch.inference_mode():
        logits = heads.forward(hidden)  # [K, T, V]
        greedy = heads.greedy_tokens(hidden)  # [T, K]
        expected = torch.stack([model.head_logits(k, hidden) for k in range(K)])
    assert (logits - expected).abs().max().item() < 1e-3
    assert torch.equal(greedy, expected.argmax(-1).t())
    assert len(set(greedy[:, 0].tolist())) > 1


def test_builders_refuse_aux_features(target, data):
    aux = [SequenceFeatures(f.input_ids, f.hidden.repeat(1, 3), f.target_ids, f.loss_mask) for f in data[1]]
    for build in (build_eagle, build_medusa):
        with pytest.raises(ValueError, match="final hidden states"):
            build(target, aux)


# ---------------------------------------------------------------- training


def train_run(objective, data, folder: str) -> dict:
    train, held_out = data
    with torch.no_grad():
        before = objective.loss(loop.collate(train)).item()
    accuracy_before = loop.evaluate(objective, held_out)
    objective.save(os.path.join(folder, "untrained"))
    state = loop.train(objective, train, held_out, CONFIG, folder, log=lambda _: None)
    objective.save(folder)
    with torch.no_grad():
        after = objective.loss(loop.collate(train)).item()
    print(f"{type(objective).__name__}: loss {before:.3f} -> {after:.3f}; held-back accuracy by draft step "
          f"{[round(a, 3) for a in accuracy_before]} -> {[round(a, 3) for a in state.evals[-1]['accuracy']]}; "
          f"{state.seconds:.1f} s")
    return dict(before=before, after=after, accuracy_before=accuracy_before, accuracy=state.evals[-1]["accuracy"],
                folder=folder, state=state, objective=objective)


@pytest.fixture(scope="module")
def eagle_run(target, data, tmp_path_factory):
    return train_run(build_eagle(target, data[0], seed=0), data, str(tmp_path_factory.mktemp("eagle")))


@pytest.fixture(scope="module")
def medusa_run(target, data, tmp_path_factory):
    return train_run(build_medusa(target, data[0], num_heads=K, seed=0), data, str(tmp_path_factory.mktemp("medusa")))


@pytest.mark.parametrize("run", ["eagle_run", "medusa_run"])
def test_training_reduces_loss_and_drafts_held_back_text(run, request):
    """The untrained Medusa head 0 is the target's own LM head on h_t, which guesses x_{t+1} again for
    x_{t+2}: right only where the target repeats a token. Trained heads must learn the counting."""
    r = request.getfixturevalue(run)
    assert r["state"].done and len(r["state"].evals) == CONFIG.epochs
    assert r["after"] < 0.7 * r["before"]
    assert r["accuracy"][0] > r["accuracy_before"][0] + 0.15
    assert len(r["accuracy"]) == (2 if run == "eagle_run" else K)


def test_eagle_predicts_the_next_feature(eagle_run, data):
    """On held-back text, step 0's g_t lies nearer the target's next feature f_{t+1} than its input f_t:
    the head regresses forward, not onto what it read."""
    objective = eagle_run["objective"]
    batch = loop.collate(data[1])
    with torch.no_grad():
        g = objective.model.unroll(batch.input_ids, batch.hidden, 1)[0]
    _, counted = loop.step_labels(batch, 0)
    rows = counted[:, :-1]  # rows t whose f_{t+1} is a counted position
    g, now, after = g[:, :-1][rows], batch.hidden[:, :-1][rows], batch.hidden[:, 1:][rows]
    to_next, to_input = (g - after).norm(dim=-1).mean(), (g - now).norm(dim=-1).mean()
    print(f"mean |g_t - f_t+1| {to_next:.3f}, |g_t - f_t| {to_input:.3f}")
    assert to_next < to_input


# ---------------------------------------------------------------- the engine

ENGINE = dict(max_model_len=128, block_size=8, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_target(hf, tmp_path_factory):
    """The target as an HF folder, the prompts, and plain greedy decoding's tokens."""
    folder = save_hf_folder(hf, tmp_path_factory.mktemp("target"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, seed=99)]
    plain = LLM(model=folder, **ENGINE).generate(prompts, PARAMS, use_tqdm=False)
    return folder, prompts, [o.outputs[0].token_ids for o in plain]


def drafting(target_folder: str, method: str, head_folder: str, prompts: list[dict]):
    """(greedy tokens, engine metrics) with the head drafting K tokens every step (a fixed draft length:
    this compares heads, not the pricing)."""
    llm = LLM(model=target_folder, speculative_config={"method": method, "model": head_folder,
                                                       "num_speculative_tokens": K,
                                                       "adaptive_draft_length": False}, **ENGINE)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.get_metrics()


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_saved_head_drafts_in_the_engine_with_greedy_output(method, engine_target, request):
    """Greedy output equals plain decoding's, and the trained head gets more drafts accepted than the same
    head before training (the teacher-forced accuracy carries over to the engine's drafting)."""
    folder, prompts, plain = engine_target
    run = request.getfixturevalue(f"{method}_run")
    drafted, m = drafting(folder, method, run["folder"], prompts)
    untrained, m0 = drafting(folder, method, os.path.join(run["folder"], "untrained"), prompts)
    print(f"{method}: accepted {m.num_accepted_tokens} of {m.num_draft_tokens} drafts in {m.num_drafts} rounds "
          f"(untrained: {m0.num_accepted_tokens} of {m0.num_draft_tokens} in {m0.num_drafts}); by position "
          f"{m.accepted_per_position} (untrained {m0.accepted_per_position})")
    assert drafted == plain and untrained == plain
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0
    first, first0 = m.accepted_per_position[0] / m.num_drafts, m0.accepted_per_position[0] / m0.num_drafts
    assert first > first0 + 0.2
