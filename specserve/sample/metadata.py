"""Batched sampling inputs, built once per step from the requests' SamplingParams.

One row per logits row; unused features stay None so an all-greedy default batch allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sample.keyed import keyed_uniforms, tree_levels
from specserve.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling tensors (B = num_rows); a feature nobody in the batch uses is None.

    Row lists (`params`, `prompt_token_ids`, `output_token_ids`, `eos_token_ids`) are kept for rebuilding.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool  # every row is greedy
    all_random: bool  # no row is greedy
    temperature: torch.Tensor | None  # [B] f32, greedy rows 1.0; None when no row scales
    greedy_mask: torch.Tensor | None  # [B] bool; None when all greedy or all random
    top_k: torch.Tensor | None  # [B] int64, rows without top-k hold vocab_size
    top_p: torch.Tensor | None  # [B] f32, rows without top-p hold 1.0
    min_p: torch.Tensor | None  # [B] f32, rows without min-p hold 0.0
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [B] f32
    frequency_penalties: torch.Tensor | None  # [B] f32
    repetition_penalties: torch.Tensor | None  # [B] f32
    prompt_ids_padded: torch.Tensor | None  # [B, max_prompt_len] int64, padded with vocab_size
    output_ids_padded: torch.Tensor | None  # [B, max_output_len] int64, padded with vocab_size
    min_tokens_rows: torch.Tensor | None  # [K] int64: logits[rows[k], ids[k]] is set to -inf
    min_tokens_token_ids: torch.Tensor | None  # [K] int64
    seeds: dict[int, int]  # random seeded rows only: row -> seed
    max_num_logprobs: int | None  # None: no row wants logprobs
    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    eos_token_ids: list[set[int]]
    num_rows_per_request: list[int] | None = None  # set by expand_for_verification

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        seeds: list[int | None],
        eos_token_ids: list[set[int]] | set[int],
        vocab_size: int,
    ) -> SamplingMetadata:
        """Batch the rows' parameters; `seeds[i]` is row i's seed or None.

        `eos_token_ids` is one set shared by all rows or one set per row.
        """
        n = len(params)
        if isinstance(eos_token_ids, (set, frozenset)):
            eos_token_ids = [eos_token_ids] * n
        if not (len(output_token_ids) == len(prompt_token_ids) == len(seeds)
                == len(eos_token_ids) == n):
            raise ValueError(f"build needs one entry per row in every list (got {n} params)")
        greedy = [p.is_greedy for p in params]
        penalties = _penalty_tensors(params, prompt_token_ids, output_token_ids, vocab_size)
        min_rows, min_ids = _min_tokens_mask(params, [len(o) for o in output_token_ids],
                                             eos_token_ids, vocab_size)
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            temperature=_temperature(params),
            greedy_mask=_greedy_mask(greedy),
            top_k=_optional_tensor([p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size
                                    for p, g in zip(params, greedy)], vocab_size, torch.int64),
            top_p=_optional_tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)],
                                   1.0, torch.float32),
            min_p=_optional_tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)],
                                   0.0, torch.float32),
            no_penalties=penalties is None,
            **(penalties or dict.fromkeys(_PENALTY_FIELDS)),
            min_tokens_rows=min_rows,
            min_tokens_token_ids=min_ids,
            seeds={i: s for i, s in enumerate(seeds) if s is not None and not greedy[i]},
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None),
                                 default=None),
            params=list(params),
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            eos_token_ids=list(eos_token_ids),
        )

    def seeded_uniforms(self, offset: int = 0) -> dict[int, list[float]]:
        """{row: its keyed uniforms} of the seeded rows, one per level of `tree_sample`: keyed by the seed and
        the position, the row's output length (plus `offset`, a drafter's step ahead of the history it was
        given)."""
        levels = tree_levels(self.vocab_size)
        return {row: keyed_uniforms(seed, len(self.output_token_ids[row]) + offset, levels)
                for row, seed in self.seeds.items()}

    @property
    def argmax_only(self) -> bool:
        """Every row's token is the argmax of its raw logits: all greedy, nothing that edits the logits
        (penalties, min_tokens), no logprobs; the runner can then skip computing the full logits."""
        return (self.all_greedy and self.no_penalties and self.min_tokens_rows is None
                and self.max_num_logprobs is None)

    def expand_for_verification(self, draft_token_ids: list[list[int]]) -> SamplingMetadata:
        """Repeat request i's row len(drafts[i]) + 1 times; its row j sees output + drafts[:j].

        The last row of each request is the bonus position; seeded rows keep their request's seed.
        """
        if len(draft_token_ids) != self.num_rows:
            raise ValueError(f"need drafts for {self.num_rows} requests, got {len(draft_token_ids)}")
        return self.expand_rows([[d[:j] for j in range(len(d) + 1)] for d in draft_token_ids])

    def expand_rows(self, histories: list[list[list[int]]]) -> SamplingMetadata:
        """One row per entry of histories[i] for request i, seeing its output plus that entry's tokens (a
        chain's drafts so far, or a tree node's path); seeded rows keep their request's seed."""
        if len(histories) != self.num_rows:
            raise ValueError(f"need rows for {self.num_rows} requests, got {len(histories)}")
        rows = [i for i, h in enumerate(histories) for _ in h]
        meta = SamplingMetadata.build(
            [self.params[i] for i in rows],
            [self.output_token_ids[i] + list(extra) for i, h in enumerate(histories) for extra in h],
            [self.prompt_token_ids[i] for i in rows],
            [self.seeds.get(i) for i in rows],
            [self.eos_token_ids[i] for i in rows],
            self.vocab_size,
        )
        meta.num_rows_per_request = [len(h) for h in histories]
        return meta


_PENALTY_FIELDS = ("presence_penalties", "frequency_penalties", "repetition_penalties",
                   "prompt_ids_padded", "output_ids_padded")


def _optional_tensor(values: list, neutral, dtype: torch.dtype) -> torch.Tensor | None:
    """A [B] tensor of `values`, or None when every value is the neutral one."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype)


def _temperature(params: list[SamplingParams]) -> torch.Tensor | None:
    """[B] f32 temperatures with greedy rows at 1.0 (they are argmax-ed, never scaled)."""
    return _optional_tensor([1.0 if p.is_greedy else float(p.temperature) for p in params],
                            1.0, torch.float32)


def _greedy_mask(greedy: list[bool]) -> torch.Tensor | None:
    if all(greedy) or not any(greedy):
        return None
    return torch.tensor(greedy, dtype=torch.bool)


def _pad(rows: list[list[int]], pad: int) -> torch.Tensor:
    """[B, max_len] int64, right-padded with `pad` (at least one column)."""
    width = max(1, max((len(r) for r in rows), default=0))
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def _penalty_tensors(params, prompts, outputs, vocab_size: int) -> dict | None:
    """Penalty values and padded token histories, or None when no row uses a penalty."""
    if not any(p.uses_penalties for p in params):
        return None
    return dict(
        presence_penalties=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params],
                                          dtype=torch.float32),
        prompt_ids_padded=_pad(prompts, vocab_size),
        output_ids_padded=_pad(outputs, vocab_size),
    )


def _min_tokens_mask(params, output_lens: list[int], eos_token_ids: list[set[int]],
                     vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows [K], token ids [K]) to forbid: EOS and stop_token_ids while output < min_tokens.

    EOS is masked even under ignore_eos, so min_tokens always means "no stop token before it".
    """
    rows, ids = [], []
    for i, (p, n_out) in enumerate(zip(params, output_lens)):
        if n_out < p.min_tokens:
            banned = sorted(t for t in set(eos_token_ids[i]) | set(p.stop_token_ids) if t < vocab_size)
            rows += [i] * len(banned)
            ids += banned
    if not rows:
        return None, None
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)
