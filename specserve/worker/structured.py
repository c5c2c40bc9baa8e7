"""The runner's structured-output state: one grammar matcher per constrained request, masking the logits rows
it samples or verifies, advancing by the tokens it accepts, and shaping its drafts (cut at the first token the
grammar refuses; the tokens the grammar forces, drafted for free)."""
from __future__ import annotations

from typing import Callable

import torch

OnError = Callable[[str, Exception], None]  # (request, its grammar's error): the runner fails that request alone


class GrammarRequests:
    """Grammar matchers of the running requests that have structured_outputs."""

    def __init__(self) -> None:
        self.matchers: dict[str, object] = {}  # req_id → structured.grammar.GrammarMatcher
        self.compiled: dict[str, object] = {}  # req_id → its CompiledGrammar, to restart its matcher from
        # Requests whose matcher failed while a drafter asked it for masks (allowed_next), with the error.
        self.drafting_errors: dict[str, Exception] = {}

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.matchers

    def start(self, req_id: str, compiled, output_token_ids: list[int], on_error: OnError) -> None:
        """A new (or resumed) request: a fresh matcher, advanced over the outputs it already has."""
        from specserve.structured.grammar import GrammarMatcher

        self.matchers[req_id] = GrammarMatcher(compiled)
        self.compiled[req_id] = compiled
        self.accept(req_id, list(output_token_ids), on_error)

    def forget(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.compiled.pop(req_id, None)
        self.drafting_errors.pop(req_id, None)

    def logits_masks(self, req_ids: list[str], drafts: list[list[int]], on_error: OnError
                     ) -> list[tuple[int, torch.Tensor]]:
        """[(first logits row, allowed [n + 1, vocab] bool)] of the constrained requests among req_ids,
        whose logits rows are laid out n + 1 per request with n drafts (1 without drafts). A request whose
        matcher fails, or whose grammar allows no next token, goes to `on_error` and is masked no more."""
        masks, row = [], 0
        for rid, d in zip(req_ids, drafts):
            matcher = self.matchers.get(rid)
            if matcher is not None:
                try:
                    allowed = matcher.allowed_masks(d) if d else matcher.allowed_mask().unsqueeze(0)
                    if not allowed.any(dim=1).all():
                        raise ValueError("the grammar allows no next token")
                    masks.append((row, allowed))
                except Exception as exc:  # noqa: BLE001 - the matcher's failure is this request's alone
                    self.forget(rid)
                    on_error(rid, exc)
            row += len(d) + 1
        return masks

    @staticmethod
    def apply(logits: torch.Tensor, masks: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """logits [M, vocab], in place: tokens a grammar refuses get -inf."""
        for row, allowed in masks:
            logits[row:row + allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
        return logits

    @staticmethod
    def allowed_rows(masks: list[tuple[int, torch.Tensor]], num_rows: int, vocab_size: int) -> torch.Tensor:
        """The masks as one [num_rows, vocab] bool (rows of unconstrained requests allow everything)."""
        allowed = torch.ones(num_rows, vocab_size, dtype=torch.bool)
        for row, rows in masks:
            allowed[row:row + rows.shape[0]] = rows
        return allowed

    def allowed_next(self, req_ids: list[str]):
        """DraftInputs.allowed_next for a drafting call over req_ids: (row, drafts so far) -> the row's
        grammar mask after them, or None for an unconstrained request. A matcher that fails here fails its own
        request's drafting only: the error goes to drafting_errors, and the request is unconstrained for the rest
        of the call (the caller drops its drafts and restarts its matcher: `take_drafting_errors`, `restart`)."""
        def allowed(i: int, drafts: list[int]) -> torch.Tensor | None:
            matcher = self.matchers.get(req_ids[i])
            if matcher is None or req_ids[i] in self.drafting_errors:
                return None
            try:
                return _mask_after(matcher, drafts, req_ids[i])
            except Exception as exc:  # noqa: BLE001 - one request's grammar never stops the others' drafting
                self.drafting_errors[req_ids[i]] = exc
                return None

        return allowed

    def take_drafting_errors(self) -> dict[str, Exception]:
        """{req_id: error} of the matchers that failed while drafting since the last call."""
        errors, self.drafting_errors = self.drafting_errors, {}
        return errors

    def restart(self, req_id: str, output_token_ids: list[int], on_error: OnError) -> None:
        """A fresh matcher for a running request, advanced over the tokens it has accepted: a matcher that failed
        may be stuck in its error state, which rolling back does not leave."""
        compiled = self.compiled.get(req_id)
        if compiled is not None:
            self.start(req_id, compiled, output_token_ids, on_error)

    def accept(self, req_id: str, token_ids: list[int], on_error: OnError) -> None:
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return
        try:
            _advance(matcher, token_ids, req_id)
        except Exception as exc:  # noqa: BLE001 - the matcher's failure is this request's alone
            self.forget(req_id)
            on_error(req_id, exc)

    def allowed_prefix(self, req_id: str, draft_ids: list[int]) -> int:
        """How many leading drafts the request's grammar allows (all, for an unconstrained request)."""
        matcher = self.matchers.get(req_id)
        return len(draft_ids) if matcher is None else matcher.validate(draft_ids)

    def forced_tokens(self, req_id: str, max_tokens: int, on_error: OnError) -> list[int]:
        """The next tokens the request's grammar leaves no choice about (at most max_tokens)."""
        matcher = self.matchers.get(req_id)
        if matcher is None or max_tokens <= 0:
            return []
        try:
            return matcher.forced_tokens(max_tokens)
        except Exception as exc:  # noqa: BLE001 - the matcher's failure is this request's alone
            self.forget(req_id)
            on_error(req_id, exc)
            return []


def _mask_after(matcher, drafts: list[int], req_id: str) -> torch.Tensor:
    """[vocab] bool: the matcher's mask after `drafts`, its state unchanged on return."""
    accepted = matcher.accept(drafts)  # short of all only past an EOS (the grammar then allows EOS)
    try:
        if accepted != len(drafts) and not matcher.is_terminated():
            raise RuntimeError(f"request {req_id}: a draft broke its grammar")
        return matcher.allowed_mask()
    finally:
        matcher.rollback(accepted)


def _advance(matcher, token_ids: list[int], req_id: str) -> None:
    """Accept tokens the masks allowed (past an accepted EOS, with ignore_eos, the grammar takes nothing more)."""
    if matcher.accept(token_ids) != len(token_ids) and not matcher.is_terminated():
        raise RuntimeError(f"request {req_id}: token ids {token_ids} do not follow its grammar")
