"""Draft trees end to end (speculative_config draft_tree="auto"): greedy output is plain decoding's with
chunked prefill, preemption, prefix caching and M-RoPE prompts with images, and sampling keeps the target's
distribution; every test checks that trees with several paths were verified, and off the first path too.

The greedy tests draft with an oracle: trees holding plain decoding's next tokens on a random path (whole or
cut short) among decoys that share a random prefix with it, so accepted paths off the first path, partial
acceptance and rejection all happen every few steps."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from specserve.spec_decode.policy import DraftPolicy
from specserve.spec_decode.proposer import Drafts
from specserve.sample.draft_tree import DraftTree

import specserve.worker.model_runner as model_runner
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.spec_decode.test_mrope_images import ENGINE as VL_ENGINE, PARAMS as VL_PARAMS, _prompts as vl_prompts
from tests.spec_decode.test_spec_sampling_e2e import check_first_tokens_follow_the_target, tiny_pair  # noqa: F401
from tests.multimodal.tiny_vl import save_tiny_vl, tiny_vl
from tests.tiny_models import save_hf_folder, tiny_hf_model


@pytest.fixture
def tree_counts(monkeypatch):
    """Counts of the trees verified (with more than one path), and of accepted paths off the first one."""
    counts = Counter()
    layout, moves = model_runner.layout, model_runner.accepted_moves

    def counting_layout(tree, *args):
        counts["trees"] += len(tree.leaves) > 1
        return layout(tree, *args)

    def counting_moves(*args):
        out = moves(*args)
        counts["moved"] += bool(out)
        return out

    monkeypatch.setattr(model_runner, "layout", counting_layout)
    monkeypatch.setattr(model_runner, "accepted_moves", counting_moves)
    return counts


def _prompts(n: int) -> list[dict]:
    rng = random.Random(n)
    return [{"prompt_token_ids": [rng.randrange(3, 150) for _ in range(9 + 13 * i)]} for i in range(n)]


def oracle_tree(rng: random.Random, truth: list[int], vocab: int) -> DraftTree:
    """Plain decoding's next tokens (`truth`), whole or cut short, on one path among 1-3 decoys that follow
    it for a random number of tokens and then go astray; paths in random order."""
    paths = [truth[:rng.randint(1, len(truth))]]
    for _ in range(rng.randint(1, 3)):
        agree = rng.randint(0, len(truth) - 1)
        paths.append(truth[:agree] + [rng.randrange(vocab) for _ in range(rng.randint(1, 3))])
    rng.shuffle(paths)
    return DraftTree.from_paths(paths)


def use_oracle(llm: LLM, reference: list[list[int]], vocab: int, seed: int = 0) -> None:
    """The engine's proposer replaced by oracle trees built from plain decoding's outputs, for the next
    generate call (requests numbered from the engine's next request id, in prompt order)."""
    first = int(str(next(llm._counter)))  # the id this call would have taken; the next call starts after it
    rng = random.Random(seed)

    def propose(inputs):
        tokens, trees = [], []
        for rid, history, num_prompt, k in zip(inputs.req_ids, inputs.token_ids, inputs.num_prompt_tokens,
                                               inputs.num_drafts):
            done = len(history) - num_prompt
            ahead = reference[int(rid) - first - 1][done:done + k]
            tree = oracle_tree(rng, ahead, vocab) if k and ahead else None
            trees.append(tree)
            tokens.append(list(tree.tokens) if tree else [])
        return Drafts(token_ids=tokens, trees=trees)

    llm.llm_engine.runner.proposer.propose = propose


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    hf = tiny_hf_model("llama", seed=11, initializer_range=0.3)
    return save_hf_folder(hf, tmp_path_factory.mktemp("tree_target"))


@pytest.mark.parametrize("engine", [
    dict(max_num_batched_tokens=24),  # chunked prefill
    dict(num_kv_blocks=20, max_num_seqs=6),  # preemption
    dict(enable_prefix_caching=True),
], ids=["chunked_prefill", "preemption", "prefix_caching"])
@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_trees_keep_greedy_output(tiny_target, tree_counts, engine, method):
    base = dict(model=tiny_target, max_model_len=256, block_size=16, **engine)
    prompts = _prompts(6) + _prompts(2)  # repeated prompts: prefix cache hits
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(**base).generate(prompts, params, use_tqdm=False)]
    spec = dict(method=method, num_speculative_tokens=6, draft_tree="auto", adaptive_draft_length=False)
    llm = LLM(**base, speculative_config=spec)
    use_oracle(llm, plain, 160)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert tree_counts["trees"] > 0 and tree_counts["moved"] > 0, dict(tree_counts)
    if "num_kv_blocks" in engine:
        assert llm.get_metrics().num_preemptions > 0


def test_chain_setting_verifies_a_trees_first_path_only(tiny_target, tree_counts):
    prompts, params = _prompts(4), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    base = dict(model=tiny_target, max_model_len=256, block_size=16)
    plain = [o.outputs[0].token_ids for o in LLM(**base).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**base, speculative_config=dict(method="suffix", num_speculative_tokens=6, adaptive_draft_length=False))
    use_oracle(llm, plain, 160)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    metrics = llm.get_metrics()
    assert tree_counts["trees"] == 0 and 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_trees_keep_greedy_output_on_image_prompts(tmp_path_factory, tree_counts):
    """M-RoPE: a node's three position rows advance by its depth from the root's, as a chain's would."""
    folder = save_tiny_vl(tiny_vl("qwen2_vl"), tmp_path_factory.mktemp("tree_vl"))
    plain = [o.outputs[0].token_ids for o in LLM(model=folder, **VL_ENGINE).generate(vl_prompts(), VL_PARAMS,
                                                                                     use_tqdm=False)]
    spec = dict(method="suffix", num_speculative_tokens=4, draft_tree="auto", adaptive_draft_length=False)
    llm = LLM(model=folder, speculative_config=spec, **VL_ENGINE)
    use_oracle(llm, plain, 117)
    assert [o.outputs[0].token_ids for o in llm.generate(vl_prompts(), VL_PARAMS, use_tqdm=False)] == plain
    assert tree_counts["trees"] > 0 and tree_counts["moved"] > 0, dict(tree_counts)


@pytest.mark.parametrize("sampling,seeded", [
    (dict(temperature=1.0), False),
    (dict(temperature=0.8, top_k=10, top_p=0.9), True),
], ids=["temperature", "top_k_top_p_seeded"])
def test_trees_keep_the_target_distribution(tiny_pair, tree_counts, sampling, seeded, monkeypatch):  # noqa: F811
    """Thousands of requests of one prompt: the suffix trie of their finished outputs offers several
    continuations at most nodes, verified as trees by recursive rejection (one-hot candidates). Rows are
    priced cheap so that trees are drafted at 32 requests a step too."""
    monkeypatch.setattr(DraftPolicy, "draft_costs", lambda self, option, n: [1.0 + 0.02 * k for k in range(n + 1)])
    hf, target, _ = tiny_pair
    check_first_tokens_follow_the_target(hf, target, {"method": "suffix", "num_speculative_tokens": 3,
                                                      "draft_tree": "auto"}, sampling, seeded, every_position=False)
    assert tree_counts["trees"] > 100 and tree_counts["moved"] > 0, dict(tree_counts)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_trees_expand_each_node_on_its_own_path(tmp_path, tree_counts, method, monkeypatch):
    """EAGLE-2 trees: a node's children come from the head fed along the node's path only. The tree's first
    path (the likeliest child at each node) must then be the head's greedy chain from the same history, which
    the chain drafter computes token by token: any wrong ancestor, position or stale key in the tree's
    expansion changes it. And greedy output stays plain decoding's."""
    from tests.models.drafter_checkpoints import write_eagle, write_eagle3

    hf = tiny_hf_model("llama", seed=5, num_hidden_layers=4, initializer_range=0.3)
    target = save_hf_folder(hf, tmp_path / "target")
    head = (write_eagle3(str(tmp_path), hf.config, draft_vocab_size=96, aux_layer_ids=[0, 2, 3]) if method == "eagle3"
            else write_eagle(str(tmp_path), hf.config)).folder
    monkeypatch.setattr(DraftPolicy, "draft_costs", lambda self, option, n: [1.0 + 0.01 * k for k in range(n + 1)])
    prompts, params = _prompts(3), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = dict(model=target, max_model_len=256, block_size=16, max_num_seqs=2)
    plain = [o.outputs[0].token_ids for o in LLM(**base).generate(prompts, params, use_tqdm=False)]
    drafted: dict[str, dict[tuple, list[int]]] = {}
    for shape in ("chain", "auto"):
        llm = LLM(**base, speculative_config=dict(method=method, model=head, num_speculative_tokens=4,
                                                  draft_tree=shape, adaptive_draft_length=False))
        proposer = llm.llm_engine.runner.proposer
        propose, seen = proposer.propose, drafted.setdefault(shape, {})

        def recording(inputs, propose=propose, seen=seen):
            out = propose(inputs)
            for i, history in enumerate(inputs.token_ids):
                tree = out.trees[i] if out.trees is not None else None
                tokens = [tree.tokens[v] for v in tree.first_path()] if tree is not None else out.token_ids[i]
                if tokens:
                    seen[tuple(history)] = tokens
            return out

        proposer.propose = recording
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    assert tree_counts["trees"] > 10
    common = drafted["chain"].keys() & drafted["auto"].keys()
    assert len(common) > 10
    for history in common:
        chain, first_path = drafted["chain"][history], drafted["auto"][history]
        n = min(len(chain), len(first_path))
        assert first_path[:n] == chain[:n], history


def test_medusa_trees_keep_greedy_output(tmp_path, tree_counts, monkeypatch):
    """Medusa's tree candidates (each head's top tokens at its depth, whatever the path) verified as trees."""
    from tests.models.drafter_checkpoints import write_medusa

    hf = tiny_hf_model("llama", seed=5, initializer_range=0.3)
    target = save_hf_folder(hf, tmp_path / "target")
    heads = write_medusa(str(tmp_path), hf.config, num_heads=3).folder
    monkeypatch.setattr(DraftPolicy, "draft_costs", lambda self, option, n: [1.0 + 0.01 * k for k in range(n + 1)])
    prompts, params = _prompts(3), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = dict(model=target, max_model_len=256, block_size=16)
    plain = [o.outputs[0].token_ids for o in LLM(**base).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**base, speculative_config=dict(method="medusa", model=heads, num_speculative_tokens=3,
                                              draft_tree="auto", adaptive_draft_length=False))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    assert tree_counts["trees"] > 10


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_a_static_token_tree_is_drafted_in_its_shape(tmp_path, method, monkeypatch):
    """vLLM's speculative_token_tree: every tree verified has the shape's nodes (as far as the drafter offers
    them within num_speculative_tokens), and greedy output stays plain decoding's."""
    from tests.models.drafter_checkpoints import write_eagle3, write_medusa

    hf = tiny_hf_model("llama", seed=5, num_hidden_layers=4, initializer_range=0.3)
    target = save_hf_folder(hf, tmp_path / "target")
    drafter = (write_eagle3(str(tmp_path), hf.config, draft_vocab_size=96, aux_layer_ids=[0, 2, 3]) if method == "eagle3"
               else write_medusa(str(tmp_path), hf.config, num_heads=3)).folder
    shape = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    sizes = Counter()
    layout = model_runner.layout

    def recording(tree, *args):
        sizes[len(tree)] += 1
        return layout(tree, *args)

    monkeypatch.setattr(model_runner, "layout", recording)
    prompts, params = _prompts(3), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = dict(model=target, max_model_len=256, block_size=16, max_num_seqs=2)
    plain = [o.outputs[0].token_ids for o in LLM(**base).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**base, speculative_config=dict(method=method, model=drafter, num_speculative_tokens=3,
                                              speculative_token_tree=str(shape), adaptive_draft_length=False))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    assert sizes[len(shape)] > 10 and max(sizes) == len(shape), sizes


def test_shape_chooser_runs_the_shape_with_more_throughput_and_keeps_checking_the_other():
    from specserve.spec_decode.tree import ShapeChooser

    for tree_rate, chain_rate in [(120.0, 100.0), (80.0, 100.0)]:
        chooser, used = ShapeChooser(), []
        for _ in range(60 * ShapeChooser.EPOCH):
            used.append(chooser.trees)
            chooser.observe(1, 1.0 / (tree_rate if chooser.trees else chain_rate))
        epochs = used[::ShapeChooser.EPOCH]
        assert epochs[:4] == [True, False, True, False]  # each tried twice first
        better = tree_rate > chain_rate
        late = epochs[10:]
        assert late.count(better) > 0.8 * len(late) and late.count(not better) > 0  # exploits, explores


def test_calibration_learns_how_often_nodes_of_a_probability_are_accepted():
    from specserve.spec_decode.tree import Calibration

    calibration, rng = Calibration(), random.Random(0)
    assert calibration(0.5) == pytest.approx(0.5)  # the drafter's word until something is seen
    for _ in range(3000):  # nodes given 0.5 are accepted a fifth of the time, nodes given 0.9 most of the time
        calibration.observe([0.5, 0.9], {n for n, rate in enumerate((0.1, 0.8)) if rng.random() < rate})
    assert calibration(0.5) == pytest.approx(0.1, abs=0.03) and calibration(0.9) == pytest.approx(0.8, abs=0.05)


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle", "eagle3", "medusa"])
def test_every_tree_drafter_keeps_plain_output_on_image_prompts(method, tmp_path, tree_counts, monkeypatch):
    """Each drafter's own trees on M-RoPE prompts with images (Qwen2-VL): the drafter and the target place a
    node at its depth's position rows; greedy output stays plain decoding's."""
    from tests.spec_decode.test_mrope_images import _spec

    monkeypatch.setattr(DraftPolicy, "draft_costs", lambda self, option, n: [1.0 + 0.01 * k for k in range(n + 1)])
    hf = tiny_vl("qwen2_vl")
    folder = save_tiny_vl(hf, tmp_path / "vl")
    plain = [o.outputs[0].token_ids for o in LLM(model=folder, **VL_ENGINE).generate(vl_prompts(), VL_PARAMS,
                                                                                     use_tqdm=False)]
    spec = dict(_spec(method, hf, folder, tmp_path), draft_tree="auto", adaptive_draft_length=False)
    llm = LLM(model=folder, speculative_config=spec, **VL_ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(vl_prompts(), VL_PARAMS, use_tqdm=False)] == plain
    assert tree_counts["trees"] > 0, dict(tree_counts)
