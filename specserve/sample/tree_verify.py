"""Verifying draft trees (spec_decode/tree.py) against the target's logits at the root and every node.

Rows: request i owns 1 + n_i consecutive logits rows, the root's then its nodes' in tree order (the layout
build_spec_decode_metadata gives when n_i counts nodes). Walking from the root, at each node:

- greedy: the child whose token is the row's argmax is accepted; none is: the argmax is emitted.
- seeded (coupling, as rejection_sampler's chains): the target's own keyed draw at the node's output position
  decides; the child holding it is accepted, else the draw is emitted. The tokens are plain decoding's with
  that seed.
- random: recursive rejection sampling over the children (SpecInfer, Miao et al. 2023, Algorithm 2): child c
  with token t and draft law q_c is accepted with probability min(1, r(t) / q_c(t)), r starting as the
  node's p; on rejection r becomes normalize(max(r - q_c, 0)); when every child is rejected a token is drawn
  from r. Deterministic children (prompt lookup, suffix trees: q one-hot) with distinct tokens make this the
  draw from p of t_1, else t_2 from p without t_1, ...: exactly p (a chain with a sampled q is the one-child
  case, Leviathan et al.'s rule).

Each node's p comes from the Sampler's own `compute_probs` with the request's output plus the node's path
as history, so penalties and min_tokens see what plain decoding would have seen.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import gather_logprobs, invalid_logits_errors, random_sample, target_probs
from specserve.sample.draft_tree import DraftTree


@dataclass
class TreeVerification:
    token_ids: list[list[int]]  # per request: accepted drafts + one recovered or bonus token
    accepted: list[list[int]]  # per request: the accepted nodes, root's child first
    logprobs: object | None = None  # LogprobsTensors, one row per emitted token
    errors: dict[int, Exception] = field(default_factory=dict)  # request -> why a row it emits from is invalid


def trees_of(drafts: list[list[int]], trees: list[DraftTree | None]) -> list[DraftTree]:
    """Every request's drafts as a tree (a chain where none was given)."""
    return [tree if tree is not None else DraftTree.chain(d) for d, tree in zip(drafts, trees)]


def verify_tree_argmax(trees: list[DraftTree], targets: torch.Tensor) -> TreeVerification:
    """targets: [sum(1 + n_i)] the argmax of each row (rows request-major)."""
    target = targets.tolist()

    def pick(_, row: int, kids: dict[int, int]) -> tuple[int, int | None]:
        return target[row], kids.get(target[row])

    tokens, accepted, _ = _walk(trees, pick)
    return TreeVerification(tokens, accepted)


def verify_tree_random(trees: list[DraftTree], logits: torch.Tensor, meta: SamplingMetadata,
                       draft_probs: list[torch.Tensor | None] | None = None) -> TreeVerification:
    """logits: [sum(1 + n_i), V] raw target logits, request-major; meta: one row per request (unexpanded);
    draft_probs: per request None (q one-hot) or [n_i, V] q of each node (chains drafted by sampling)."""
    if meta.num_rows != len(trees) or logits.shape[0] != sum(1 + len(t) for t in trees):
        raise ValueError(f"verify_tree_random: {meta.num_rows} requests and {logits.shape[0]} logits rows for "
                         f"{len(trees)} trees of {sum(map(len, trees))} nodes")
    histories = [[[tree.tokens[v] for v in tree.path_to(node)] for node in range(-1, len(tree))]
                 for tree in trees]
    expanded = meta.expand_rows(histories)
    probs, invalid = target_probs(logits, expanded)  # [rows, V], [rows]
    draws = _keyed_draws(probs, expanded)

    def pick(i: int, row: int, kids: dict[int, int]) -> tuple[int, int | None]:
        if row in draws:  # seeded: the target's own draw picks the child
            return draws[row], kids.get(draws[row])
        return _recursive_rejection(probs[row], kids, draft_probs[i] if draft_probs is not None else None)

    tokens, accepted, emitted_rows = _walk(trees, pick)
    logprobs = None
    if meta.max_num_logprobs is not None:
        emitted = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64)
        logprobs = gather_logprobs(logits[torch.tensor(emitted_rows, dtype=torch.long)], emitted,
                                   meta.max_num_logprobs)
    return TreeVerification(tokens, accepted, logprobs,
                            _emitting_row_errors(invalid, emitted_rows, tokens, expanded))


def _emitting_row_errors(invalid: torch.Tensor, emitted_rows: list[int], tokens: list[list[int]],
                         expanded: SamplingMetadata) -> dict[int, Exception]:
    """{request: error} for the requests that emitted a token from an invalid row (invalid: [rows] bool;
    emitted_rows request-major, len(tokens[i]) of them for request i)."""
    if not bool(invalid.any()):
        return {}
    request_of_emitted = [i for i, toks in enumerate(tokens) for _ in toks]
    at_emitted = invalid[torch.tensor(emitted_rows, dtype=torch.long)]
    return invalid_logits_errors(at_emitted, [expanded.params[r] for r in emitted_rows], request_of_emitted)


def _walk(trees: list[DraftTree], pick) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Each request's tree from its root, pick(request, logits row, {token: child}) -> (emitted token, the
    accepted child or None) at each node reached. Returns per request the tokens emitted and the accepted
    nodes, and the rows the emitted tokens came from (request-major)."""
    tokens, accepted, rows, first = [], [], [], 0
    for i, tree in enumerate(trees):
        path, node = [], -1
        while True:
            row = first + 1 + node
            rows.append(row)
            t, child = pick(i, row, tree.children[node])
            if child is None:
                break
            path.append(child)
            node = child
        tokens.append([tree.tokens[v] for v in path] + [t])
        accepted.append(path)
        first += 1 + len(tree)
    return tokens, accepted, rows


def _recursive_rejection(p: torch.Tensor, kids: dict[int, int], q: torch.Tensor | None) -> tuple[int, int | None]:
    """(token, the accepted child or None) at one node of target law p [V] (unnormalised allowed)."""
    residual = p.double()
    for token, child in kids.items():
        total = float(residual.sum())
        if total <= 0.0:
            break
        if q is None:  # q one-hot at token: accept with r(t); on rejection r loses t
            if _uniform() * total < float(residual[token]):
                return token, child
            residual = residual.clone()
            residual[token] = 0.0
        else:
            qc = q[child].double()
            r = residual / total
            if _uniform() * float(qc[token]) < float(r[token]):
                return token, child
            rest = (r - qc).clamp_min(0.0)
            residual = rest if float(rest.sum()) > 0.0 else r
    return int(random_sample(residual[None].float(), {})[0]), None


def _uniform() -> float:
    """U[0, 1) from torch's generator at float64 resolution (float32 draws lie on a 2^-24 grid, so a ratio below
    2^-24 would be accepted with probability 2^-24)."""
    return float(torch.rand((), dtype=torch.float64))


def _keyed_draws(probs: torch.Tensor, expanded: SamplingMetadata) -> dict[int, int]:
    """{row: the token the Sampler draws there} for the rows of seeded random requests."""
    uniforms = expanded.seeded_uniforms()
    if not uniforms:
        return {}
    rows = list(uniforms)
    draws = random_sample(probs[torch.tensor(rows, dtype=torch.long)], dict(enumerate(uniforms.values())))
    return dict(zip(rows, draws.tolist()))

