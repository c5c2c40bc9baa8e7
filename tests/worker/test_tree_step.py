"""Draft trees in a target step (worker/tree_step.py): every node's attention against a from-scratch reference
(context plus its ancestors, nothing else), a node's hidden state bitwise that of its path verified as a
chain, and the accepted path's K/V in the request's own slots afterwards."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.models.registry import build_model
from specserve.ops.attention import build_attention_metadata, copy_blocks, copy_slots, kernel_key_layout, kv_caches, \
    paged_attention, paged_metadata
from specserve.ops.kernels import kernel_usable
from specserve.sample.draft_tree import DraftTree
from specserve.worker.tree_step import accepted_moves, fit_to_scratch, layout
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model

BLOCK = 16


def random_tree(rng: random.Random, num_nodes: int, vocab: int) -> DraftTree:
    """A random tree in preorder: each node hangs under a random ancestor of the previous node (or the root)."""
    tokens, parents, path = [], [], []
    for i in range(num_nodes):
        parent = rng.choice([-1] + path)
        del path[path.index(parent) + 1 if parent != -1 else 0:]
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        tokens.append(rng.choice([t for t in range(vocab) if t not in taken]))
        parents.append(parent)
        path.append(i)
    return DraftTree(tuple(tokens), tuple(parents))


def test_draft_tree_checks_its_shape():
    assert DraftTree.chain([5, 6, 7]).is_chain
    tree = DraftTree.from_paths([[1, 2, 3], [1, 4], [5]])
    assert tree.tokens == (1, 2, 3, 4, 5) and tree.parents == (-1, 0, 1, 0, -1)
    assert tree.depths == (1, 2, 3, 2, 1) and tree.leaves == (2, 3, 4) and tree.first_path() == [0, 1, 2]
    assert tree.path_to(3) == [0, 3] and tree.children[0] == {2: 1, 4: 3}
    assert tree.prefix(4).leaves == (2, 3)
    with pytest.raises(ValueError, match="preorder"):
        DraftTree((1, 2, 3), (-1, -1, 0))
    with pytest.raises(ValueError, match="sibling"):
        DraftTree((1, 1), (-1, -1))


def _reference_attention(q, keys, values, scale):
    """q [H, D]; keys, values [L, Hkv, D]: softmax attention in float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [L, H, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("context", [1, 16, 37, 159])
def test_each_node_attends_to_the_context_and_its_ancestors_only(use_kernel, context):
    if use_kernel and not kernel_usable(torch.float32):
        pytest.skip("no C kernels on this machine")
    rng = random.Random(context)
    torch.manual_seed(context)
    heads, kv_heads, dim, num_blocks = 4, 2, 16, 40
    k_cache, v_cache = kv_caches((num_blocks, BLOCK, kv_heads, dim), torch.float32, 1)[0]
    table = list(range(0, 24, 2))  # scattered blocks
    tree = random_tree(rng, 12, 50)
    scratch = list(range(30, 40))
    tree = fit_to_scratch(tree, context, BLOCK, len(scratch))
    # the context's cached keys and values: tokens 0 .. context - 1 (the root, at `context`, is fed now)
    ctx_k, ctx_v = torch.randn(context, kv_heads, dim), torch.randn(context, kv_heads, dim)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
    k_cache[slots // BLOCK, slots % BLOCK] = ctx_k
    v_cache[slots // BLOCK, slots % BLOCK] = ctx_v
    step = layout(tree, context, 1, table, BLOCK, scratch)
    rows = 1 + len(tree)
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
    meta = build_attention_metadata([s[1] for s in step.sequences], [s[2] for s in step.sequences],
                                    [s[3] for s in step.sequences], BLOCK,
                                    torch.tensor(step.slots + [s for _, s in step.extra_writes]), use_kernel)
    meta.slot_rows = torch.tensor(list(range(rows)) + [r for r, _ in step.extra_writes])
    copy_blocks([(k_cache, v_cache)], step.block_copies)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25).view(rows, heads, dim)
    for row in range(rows):
        ancestors = [0] + [1 + a for a in tree.path_to(row - 1)]  # the root, then the path down to the node
        expected = _reference_attention(q[row], torch.cat([ctx_k, k[ancestors]]), torch.cat([ctx_v, v[ancestors]]),
                                        0.25)
        torch.testing.assert_close(out[row], expected, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    hf = tiny_hf_model("llama", seed=7)
    return build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)


def _prefill(model, prompt, table, num_blocks):
    caches = kv_caches(model.kv_cache_shape(num_blocks, BLOCK), torch.float32, model.num_layers)
    meta = paged_metadata([len(prompt)], [len(prompt)], [table], BLOCK, kernel_usable(torch.float32))
    with torch.inference_mode():
        model.forward(torch.tensor(prompt), torch.arange(len(prompt)), meta, caches)
    return caches


def _clone(caches):
    return [(kernel_key_layout(k), v.clone()) for k, v in caches]


def _same(a, b) -> bool:
    """Bitwise with the C kernels; the PyTorch fallback's attention pads each sequence's keys by the batch's
    bucket, so there a path alone and within a tree agree to rounding only."""
    if kernel_usable(torch.float32):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", [5, 16, 47])
def test_a_node_is_bitwise_its_path_verified_as_a_chain_and_the_accepted_path_moves_into_place(model, context):
    rng = random.Random(context)
    num_blocks, table, scratch_ids = 40, [3, 9, 4, 12, 7, 20], list(range(30, 40))
    prompt = [rng.randrange(160) for _ in range(context + 1)]  # the last one is the root, fed with the tree
    cached = _prefill(model, prompt[:context], table, num_blocks)
    tree = fit_to_scratch(random_tree(rng, 10, 160), context, BLOCK, len(scratch_ids))
    assert len(tree.leaves) > 1
    caches = _clone(cached)
    step = layout(tree, context, 1, table, BLOCK, list(scratch_ids))
    use_kernel = kernel_usable(torch.float32)
    meta = build_attention_metadata([s[1] for s in step.sequences], [s[2] for s in step.sequences],
                                    [s[3] for s in step.sequences], BLOCK,
                                    torch.tensor(step.slots + [s for _, s in step.extra_writes]), use_kernel)
    meta.slot_rows = torch.tensor(list(range(1 + len(tree))) + [r for r, _ in step.extra_writes])
    copy_blocks(caches, step.block_copies)
    with torch.inference_mode():
        hidden, _ = model.forward(torch.tensor([prompt[-1], *tree.tokens]), torch.tensor(step.positions), meta, caches)
    for leaf in tree.leaves:
        path = tree.path_to(leaf)
        chain_caches = _clone(cached)
        chain = [prompt[-1]] + [tree.tokens[v] for v in path]
        chain_meta = paged_metadata([len(chain)], [context + len(chain)], [table], BLOCK, use_kernel)
        with torch.inference_mode():
            chain_hidden, _ = model.forward(torch.tensor(chain), torch.arange(context, context + len(chain)),
                                            chain_meta, chain_caches)
        assert _same(hidden[0], chain_hidden[0])
        for depth, node in enumerate(path, 1):
            assert _same(hidden[1 + node], chain_hidden[depth]), (leaf, node)
    # accept the last leaf's path but its last node: its K/V must be the chain's in the request's slots
    path = tree.path_to(tree.leaves[-1])[:-1] or tree.path_to(tree.leaves[-1])
    moved = _clone(caches)
    copy_slots(moved, accepted_moves(step, path, table, BLOCK), BLOCK)
    chain_caches = _clone(cached)
    chain = [prompt[-1]] + [tree.tokens[v] for v in path]
    with torch.inference_mode():
        model.forward(torch.tensor(chain), torch.arange(context, context + len(chain)),
                      paged_metadata([len(chain)], [context + len(chain)], [table], BLOCK, use_kernel), chain_caches)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context + len(chain))])
    for (k, v), (ck, cv) in zip(moved, chain_caches):
        assert _same(k[slots // BLOCK, slots % BLOCK], ck[slots // BLOCK, slots % BLOCK])
        assert _same(v[slots // BLOCK, slots % BLOCK], cv[slots // BLOCK, slots % BLOCK])


def test_fit_to_scratch_keeps_whole_paths():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 4, 5], [6, 7], [8]])
    assert fit_to_scratch(tree, 10, BLOCK, 100) == tree
    assert fit_to_scratch(tree, 10, BLOCK, 0) == tree.prefix(3)  # the first path alone
    assert fit_to_scratch(tree, 10, BLOCK, 1) == tree.prefix(5)  # + the second path's own nodes
    # root at 14: position 15 differs between paths, so a path's blocks start at block 0: two each
    assert fit_to_scratch(tree, 14, BLOCK, 3) == tree.prefix(5)
    assert fit_to_scratch(tree, 14, BLOCK, 4) == tree.prefix(7)
    # root at 15: the paths differ from position 16 on, one block each
    assert fit_to_scratch(tree, 15, BLOCK, 2) == tree.prefix(7)
