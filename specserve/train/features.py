"""The target-side inputs of EAGLE-3 training: self-distilled greedy sequences, and per sequence the
three aux hidden states and the target's own next-token choice at every position.

Features come from a transformers causal LM (`output_hidden_states`): HF `hidden_states[i]` is the
residual stream entering layer i, the "input of layer" convention specserve's EAGLE-3 head reads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SequenceFeatures:
    """One training sequence of T tokens.

    input_ids: [T] int64, the tokens.
    aux_hidden: [T, 3 * Ht] float32, the target's states entering layers `aux_layer_ids`, concatenated in order.
    target_ids: [T] int64, the target's argmax at each position (its choice for token t + 1); for greedily
        self-distilled text it equals input_ids[t + 1] in the generated part, so hard labels are exact.
    loss_mask: [T] bool, positions whose prediction counts (default all).
    """

    input_ids: torch.Tensor
    aux_hidden: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default aux layers for an L-layer target, "input of layer" convention: (2, L // 2, L - 3)."""
    if num_layers < 6:
        raise ValueError(f"EAGLE-3 needs three distinct aux layers (2, L // 2, L - 3); a target of {num_layers} "
                         f"layers has too few (need at least 6)")
    return 2, num_layers // 2, num_layers - 3


@torch.no_grad()
def greedy_sequences(hf_model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     batch_size: int = 16) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation of max_new_tokens tokens (no EOS stop).
    Prompts in one batch must have equal length (no padding, so no attention-mask subtleties)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[start:start + batch_size]]
        if len({len(p) for p in batch}) != 1:
            raise ValueError("greedy_sequences: prompts of one batch must have equal length")
        ids = torch.tensor(batch)
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        out.extend(gen.tolist())
    return out


@torch.no_grad()
def extract_features(hf_model, sequences: Sequence[Sequence[int]], aux_layer_ids: Sequence[int],
                     loss_masks: Sequence[torch.Tensor] | None = None) -> list[SequenceFeatures]:
    """One teacher-forced target pass per sequence -> its SequenceFeatures (aux states as float32)."""
    L = hf_model.config.num_hidden_layers
    if len(aux_layer_ids) != 3 or any(not 0 <= i < L for i in aux_layer_ids):
        raise ValueError(f"aux_layer_ids {list(aux_layer_ids)}: need 3 layer indices in [0, {L})")
    features = []
    for n, seq in enumerate(sequences):
        ids = torch.tensor([list(seq)], dtype=torch.int64)
        out = hf_model(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in aux_layer_ids], dim=-1).float()
        mask = torch.ones(ids.shape[1], dtype=torch.bool) if loss_masks is None else loss_masks[n].bool()
        features.append(SequenceFeatures(ids[0], aux, out.logits[0].argmax(-1), mask))
    return features
