"""RejectionSampler against references: obvious greedy cases, penalised argmax computed in Python, the
target distribution computed in numpy (statistical), the plain Sampler, and raw-logits log_softmax."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection_sampler import RejectionSampler
from specserve.sample.sampler import Sampler
from specserve.sampling_params import SamplingParams
from specserve.sample.spec_metadata import SpecDecodeMetadata, build_spec_decode_metadata
from tests.sample.reference import ref_probs

V = 10
EOS = 9
GREEDY = SamplingParams(temperature=0)


def build(params, outputs=None, prompts=None, vocab=V):
    n = len(params)
    return SamplingMetadata.build(params, outputs or [[] for _ in range(n)],
                                  prompts or [[] for _ in range(n)], [p.seed for p in params], {EOS}, vocab)


def spec_for(drafts):
    """Spec metadata as the runner builds it: each request scheduled n + 1 tokens after a 3-token gap."""
    ends = np.cumsum([len(d) + 4 for d in drafts]).tolist()
    return build_spec_decode_metadata(drafts, ends)


def peaked_logits(targets, vocab=V):
    """[sum(len), vocab] logits whose argmax in each row is the next entry of the flattened targets."""
    flat = [t for row in targets for t in row]
    logits = torch.zeros(len(flat), vocab)
    logits[torch.arange(len(flat)), torch.tensor(flat, dtype=torch.long)] = 5.0
    return logits


def verify(drafts, logits, params, draft_probs=None, outputs=None, prompts=None):
    meta = build(params, outputs=outputs, prompts=prompts, vocab=logits.shape[1])
    return RejectionSampler()(spec_for(drafts), logits, meta, draft_probs)


# ---- greedy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("drafts, targets, expected, accepted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),  # all accepted plus bonus
    ([1, 2, 3], [5, 2, 3, 4], [5], 0),  # first mismatch
    ([1, 2, 3], [1, 6, 3, 4], [1, 6], 1),  # middle mismatch
    ([1, 2, 3], [1, 2, 7, 4], [1, 2, 7], 2),  # last draft mismatches
    ([], [7], [7], 0),  # no drafts: one token
])
def test_greedy_single_request(drafts, targets, expected, accepted):
    out = verify([drafts], peaked_logits([targets]), [GREEDY])
    assert out.token_ids == [expected] and out.num_accepted == [accepted] and out.logprobs is None


RAGGED_DRAFTS = [[1, 2, 3], [], [4, 5], [], [6]]
RAGGED_TARGETS = [[1, 2, 8, 0], [7], [4, 5, 3], [2], [0, 1]]


def test_greedy_ragged_batch():
    out = verify(RAGGED_DRAFTS, peaked_logits(RAGGED_TARGETS), [GREEDY] * 5)
    assert out.token_ids == [[1, 2, 8], [7], [4, 5, 3], [2], [0]]
    assert out.num_accepted == [2, 0, 2, 0, 0]


def test_greedy_rows_in_a_random_batch_follow_the_greedy_rule():
    params = [GREEDY, SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.5, top_k=3),
              GREEDY]
    q = [torch.full((len(d), V), 1.0 / V) for d in RAGGED_DRAFTS]
    for draft_probs in (None, q):
        out = verify(RAGGED_DRAFTS, peaked_logits(RAGGED_TARGETS), params, draft_probs)
        assert [out.token_ids[i] for i in (0, 2, 4)] == [[1, 2, 8], [4, 5, 3], [0]]


def test_logits_rows_follow_logits_indices_in_any_order():
    """Row r of logits belongs to spec.logits_indices[r]; a layout with all draft rows first and all
    bonus rows last must verify exactly like the request-major one."""
    logits = torch.randn(11, V, generator=torch.Generator().manual_seed(3))
    ref_spec = spec_for(RAGGED_DRAFTS)
    draft_rows, bonus_rows = ref_spec.target_logits_indices, ref_spec.bonus_logits_indices
    perm = torch.cat([draft_rows, bonus_rows])  # new row r holds old row perm[r]
    spec = SpecDecodeMetadata(
        draft_token_ids=ref_spec.draft_token_ids, num_draft_tokens=ref_spec.num_draft_tokens,
        cu_num_draft_tokens=ref_spec.cu_num_draft_tokens,
        target_logits_indices=torch.arange(len(draft_rows)),
        bonus_logits_indices=torch.arange(len(draft_rows), len(perm)),
        logits_indices=ref_spec.logits_indices[perm])
    params = [SamplingParams(temperature=0.7, seed=s, logprobs=2) for s in range(5)]
    outs = []
    for sp, lg in ((ref_spec, logits), (spec, logits[perm])):
        meta = build(params)
        outs.append(RejectionSampler()(sp, lg, meta))
    assert outs[0].token_ids == outs[1].token_ids
    assert torch.equal(outs[0].logprobs.logprobs, outs[1].logprobs.logprobs)


# ---- penalties under verification --------------------------------------------------------------

def ref_penalised(row, p: SamplingParams, prompt, output):
    out = np.asarray(row, dtype=np.float64).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalty_changes_argmax_at_a_later_position():
    """Raw argmax is token 2 at both rows; after draft 2 is in the history, the frequency penalty
    makes token 4 win at row 1, so the second draft (2) must be rejected in favour of 4."""
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    logits = torch.zeros(3, V)
    logits[:, 2], logits[:, 4] = 3.0, 2.5
    out = verify([[2, 2]], logits, [params], outputs=[[0]])
    assert out.token_ids == [[2, 4]]
    assert int(np.argmax(ref_penalised(logits[1], params, [], [0, 2]))) == 4


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.4),
])
def test_greedy_verification_matches_penalised_argmax_reference(params):
    gen = torch.Generator().manual_seed(5)
    prompts, outputs = [[1, 3], [0], [5, 5, 6]], [[3, 3], [], [2]]
    for _ in range(20):
        logits = torch.randn(3 + 3 + 3, V, generator=gen)
        # Drafts are the raw argmax: the penalised target disagrees with them now and then.
        raw = logits.argmax(-1).tolist()
        drafts = [raw[0:2], raw[3:5], raw[6:8]]
        out = verify(drafts, logits, [params] * 3, outputs=outputs, prompts=prompts)
        for i, toks in enumerate(out.token_ids):
            expected = []
            for j in range(3):
                best = int(np.argmax(ref_penalised(logits[3 * i + j], params, prompts[i],
                                                   outputs[i] + drafts[i][:j])))
                expected.append(best)
                if j == 2 or best != drafts[i][j]:
                    break
            assert toks == expected


# ---- target distribution (statistical) ---------------------------------------------------------

def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def tv_bound(n: int) -> float:
    """E[TV] of n draws over V tokens is at most 0.4 * sqrt(V / n); allow 2.5 times that."""
    return float(np.sqrt(V / n))


K = 3
BATCH = 8_000
NUM_BATCHES = 3


def _emit_many(params, logits, draft_q, seed, seeded=False):
    """NUM_BATCHES x BATCH identical requests, k = K; drafts fixed (q one-hot) or sampled from draft_q;
    seeded: each request with a seed of its own (verified by coupling)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    # Fixed drafts, q one-hot: the likeliest tokens (the bonus is often reached), a second-best first
    # draft, and an unlikely one (outside top-k / top-p: always rejected).
    ranked = np.argsort(-logits[:K], axis=1)
    patterns = [ranked[:, 0].tolist(), [ranked[0, 1]] + ranked[1:, 0].tolist(),
                [ranked[0, -1]] + ranked[1:, 0].tolist()]
    all_tokens, all_drafts = [], []
    for b in range(NUM_BATCHES):
        batch = [replace(params, seed=seed * 10**6 + b * BATCH + i) for i in range(BATCH)] if seeded \
            else [params] * BATCH
        if draft_q is None:
            drafts, probs = [[int(t) for t in patterns[i % 3]] for i in range(BATCH)], None
        else:
            drafts = np.stack([rng.choice(V, size=BATCH, p=draft_q[j]) for j in range(K)], 1).tolist()
            q_rows = torch.tensor(draft_q, dtype=torch.float32)
            probs = [q_rows] * BATCH
        flat_logits = torch.tensor(logits, dtype=torch.float32).repeat(BATCH, 1)
        out = verify(drafts, flat_logits, batch, probs)
        all_tokens += out.token_ids
        all_drafts += drafts
    return all_tokens, all_drafts


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot-q", "draft-probs"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=0.9, top_p=0.7),
    SamplingParams(temperature=1.1, top_k=6, top_p=0.85, min_p=0.05),
], ids=["temperature", "top-k", "top-p", "all"])
def test_emitted_tokens_follow_the_target_distribution(params, with_q, seeded):
    gen = np.random.default_rng(17)
    logits = gen.normal(scale=1.5, size=(K + 1, V))
    target = np.stack([ref_probs(row, params) for row in logits])  # [K + 1, V]
    draft_q = None
    if with_q:
        q = np.exp(gen.normal(scale=1.5, size=(K, V)))
        draft_q = q / q.sum(axis=1, keepdims=True)
        assert tv(draft_q[0], target[0]) > 5 * tv_bound(NUM_BATCHES * BATCH), "q too close to p to tell"
    tokens, drafts = _emit_many(params, logits, draft_q, seed=3, seeded=seeded)

    for toks, d in zip(tokens, drafts):  # shape invariant: an accepted prefix, then one token
        assert 1 <= len(toks) <= K + 1 and toks[:-1] == d[:len(toks) - 1]
    # Reaching position j means drafts 0..j-1 were accepted; the token there must then follow p_j.
    # Position K is the bonus token.
    checked = 0
    for j in range(K + 1):
        at_j = np.array([t[j] for t in tokens if len(t) > j], dtype=np.int64)
        assert np.all(target[j][at_j] > 0), f"position {j} emitted a token outside the kept set"
        if len(at_j) >= 1000:
            freq = np.bincount(at_j, minlength=V) / len(at_j)
            assert tv(freq, target[j]) < tv_bound(len(at_j)), f"position {j}: {freq} vs {target[j]}"
            checked += 1
    assert checked >= 2


def test_joint_of_first_two_positions_with_fixed_drafts():
    """Joint law of (t0, t1 or 'stop'): P(t0) = p0(t0), and t1 exists iff t0 is the draft, then ~ p1."""
    params = SamplingParams(temperature=1.0)
    logits = np.random.default_rng(4).normal(scale=1.0, size=(K + 1, V))
    p = np.stack([ref_probs(row, params) for row in logits])
    tokens, drafts = _emit_many(params, logits, None, seed=8)
    joint = np.zeros((V, V + 1))  # column V: nothing emitted at position 1
    expected = np.zeros((V, V + 1))
    for t, d in zip(tokens, drafts):
        joint[t[0], t[1] if len(t) > 1 else V] += 1
        expected[:, V] += p[0]
        expected[d[0], V] -= p[0][d[0]]
        expected[d[0], :V] += p[0][d[0]] * p[1]
    joint /= len(tokens)
    expected /= len(tokens)
    assert 0.5 * np.abs(joint - expected).sum() < float(np.sqrt(V * (V + 1) / len(tokens)))


# ---- seeds --------------------------------------------------------------------------------------

MINE = SamplingParams(temperature=1.0, seed=1234)


def _seeded_tokens(batch_params, drafts, mine_row, logits, with_q):
    """Tokens of row `mine_row`; q (when given) random for the other rows, uniform for it."""
    q = [torch.softmax(torch.randn(len(d), V), -1) for d in drafts] if with_q else None
    if q is not None:
        q[mine_row] = torch.full((len(drafts[mine_row]), V), 1.0 / V)
    return verify(drafts, logits, batch_params, q).token_ids[mine_row]


@pytest.mark.parametrize("with_q", [False, True])
def test_seeded_request_ignores_batch_mates(with_q):
    flat = torch.randn(4, V, generator=torch.Generator().manual_seed(21)) * 0.3  # acceptance is a coin flip
    mine_drafts = [1, 2, 3]
    others = [SamplingParams(), SamplingParams(seed=7, top_k=5), GREEDY,
              SamplingParams(temperature=0.5, frequency_penalty=0.5, seed=99)]
    other_drafts = [[4], [], [5, 6], [7, 8, 0, 1]]
    seen = set()
    for trial in range(10):
        alone = _seeded_tokens([MINE], [mine_drafts], 0, flat, with_q)
        torch.manual_seed(trial)
        batch = others[:2] + [MINE] + others[2:]
        drafts = other_drafts[:2] + [mine_drafts] + other_drafts[2:]
        logits = torch.randn(sum(len(d) + 1 for d in drafts), V)
        logits[3:7] = flat  # request 2's rows come after the 2 + 1 rows of requests 0 and 1
        assert _seeded_tokens(batch, drafts, 2, logits, with_q) == alone
        seen.add(tuple(alone))
    assert len(seen) == 1
    outcomes = {tuple(_seeded_tokens([SamplingParams(temperature=1.0, seed=s)], [mine_drafts], 0, flat,
                                     with_q)) for s in range(20)}
    assert len(outcomes) > 1, "the seed should matter"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.8, seed=5),
                                    SamplingParams(temperature=0.7, top_k=4, seed=6)], ids=["top-p", "top-k"])
def test_seeded_tokens_are_the_samplers_whatever_the_drafts(params):
    """Per output position fixed logits (a model whose next-token law depends on the position only): plain
    sampling one token a step, and verification of any drafts (right, wrong, with or without q), emit the same
    tokens at every position they reach."""
    num_positions = 12
    logits = torch.randn(num_positions + 8, V, generator=torch.Generator().manual_seed(3))
    plain = []
    for pos in range(num_positions):
        plain += Sampler()(logits[pos:pos + 1], build([params], outputs=[plain])).sampled_token_ids.tolist()
    rng = np.random.default_rng(0)
    for trial in range(40):
        out = []
        while len(out) < num_positions:
            n = int(rng.integers(0, 5))
            right = plain[len(out):len(out) + n]
            drafts = [t if rng.random() < 0.6 else int(rng.integers(V)) for t in right]
            q = [torch.softmax(torch.randn(len(drafts), V), -1)] if trial % 2 and drafts else None
            rows = logits[len(out):len(out) + len(drafts) + 1]
            out += verify([drafts], rows, [params], q, outputs=[list(out)]).token_ids[0]
        assert out[:num_positions] == plain, trial


def test_a_fixed_draft_is_accepted_as_often_as_rejection_sampling_accepts_it():
    """Coupling accepts a fixed draft d exactly when the target's draw is d: with probability p(d), as the
    rejection sampler with q one-hot does."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -1.0, -2.0, -2.0, -3.0, -3.0]] * 2)
    p1 = float(torch.softmax(logits[0], -1)[1])
    n = 6000
    seeded = [verify([[1]], logits, [SamplingParams(temperature=1.0, seed=s)]).token_ids[0] for s in range(n)]
    accepted = sum(len(t) == 2 for t in seeded) / n
    assert abs(accepted - p1) < 4 * np.sqrt(p1 * (1 - p1) / n)


# ---- logprobs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_come_from_raw_logits_of_the_emitting_rows(temperature):
    logits = torch.randn(11, V, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=temperature, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=temperature)] * 2 + [SamplingParams(temperature=temperature)]
    out = verify(RAGGED_DRAFTS, logits, params, prompts=[[1, 2, 4]] * 5)
    rows = []  # request i's rows start at sum over earlier requests of (n + 1)
    start = 0
    for d, toks in zip(RAGGED_DRAFTS, out.token_ids):
        rows += list(range(start, start + len(toks)))
        start += len(d) + 1
    emitted = torch.tensor([t for toks in out.token_ids for t in toks])
    lp = torch.log_softmax(logits[rows], dim=-1)
    assert out.logprobs.logprobs.shape == (len(emitted), 4)
    assert torch.equal(out.logprobs.token_ids[:, 0], emitted)
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], lp[torch.arange(len(rows)), emitted])
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], lp.topk(3, dim=-1).values)


# ---- input checks -------------------------------------------------------------------------------

def test_rejects_inputs_of_the_wrong_shape():
    spec, meta = spec_for([[1, 2]]), build([GREEDY])
    with pytest.raises(ValueError, match="logits must have shape"):
        RejectionSampler()(spec, torch.zeros(2, V), meta)
    with pytest.raises(ValueError, match="unexpanded"):
        RejectionSampler()(spec, torch.zeros(3, V), meta.expand_for_verification([[1, 2]]))
    with pytest.raises(ValueError, match=r"draft_probs\[0\]"):
        RejectionSampler()(spec, torch.zeros(3, V), meta, [torch.zeros(3, V)])
    with pytest.raises(ValueError, match="draft token ids"):
        RejectionSampler()(spec_for([[1, V]]), torch.zeros(3, V), meta)


def test_plain_greedy_shortcut_agrees_with_the_general_path():
    """Greedy without penalties takes a one-argmax shortcut; asking for logprobs forces the general path,
    which must emit the same tokens on random ragged batches (drafts often, not always, the argmax)."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(30):
        counts = torch.randint(0, 5, (4,), generator=gen).tolist()
        logits = torch.randn(sum(counts) + 4, V, generator=gen)
        spec = spec_for([[0] * n for n in counts])
        raw = logits.argmax(-1)
        noise = torch.randint(0, V, (sum(counts),), generator=gen)
        keep = torch.rand(sum(counts), generator=gen) < 0.7
        drafts = torch.where(keep, raw[spec.target_logits_indices], noise).tolist()
        per_request = [drafts[sum(counts[:i]):sum(counts[:i + 1])] for i in range(4)]
        fast = verify(per_request, logits, [GREEDY] * 4)
        general = verify(per_request, logits, [SamplingParams(temperature=0, logprobs=1)] * 4)
        assert fast.token_ids == general.token_ids and fast.num_accepted == general.num_accepted
        assert general.logprobs is not None and fast.logprobs is None
