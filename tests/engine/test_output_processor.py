"""Stop strings in the output processor, against a from-scratch reference that decodes every prefix of the output
as plain decoding would produce it (one token a step): min_tokens protects the text of its first tokens, the
output ends at the token that completed the stop string whatever the step sizes, and streamed text is never
taken back."""
from __future__ import annotations

import pytest

from specserve.engine.output_processor import OutputProcessor
from specserve.engine.request import Request, RequestStatus
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import load_tokenizer

TEXT = "Hi. How are you. I am fine. Thanks, and you? Good. Bye."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def reference(tokenizer, output: list[int], params: SamplingParams) -> tuple[str, list[int], str | None]:
    """(text, token ids, stop string) as plain decoding gives them: after each token, decode the whole output and
    look for a stop string beginning past the text of the first min_tokens tokens."""
    protected = len(tokenizer.decode(output[:params.min_tokens]))
    for n in range(params.min_tokens + 1, len(output) + 1):
        text = tokenizer.decode(output[:n])
        found = [(i, s) for s in params.stop if (i := text.find(s, protected)) >= 0]
        if found:
            index, stop = min(found)
            return text[:index + len(stop) if params.include_stop_str_in_output else index], output[:n], stop
    return tokenizer.decode(output), output, None


def run(tokenizer, output: list[int], params: SamplingParams, step_sizes: list[int]):
    """Feed `output` to an OutputProcessor in steps of step_sizes (cycled) until it reports a stop; returns the
    final completion and the text of every snapshot a stream would have sent."""
    prompt = tokenizer.encode("Q:")
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, prompt, [("r", params)], arrival_time=0.0)
    request = Request("r", prompt, params)
    request.status = RequestStatus.RUNNING
    streamed, i, step = [], 0, 0
    while i < len(output):
        size = step_sizes[step % len(step_sizes)]
        for token_id in output[i:i + size]:
            request.append_output_token(token_id)
        i, step = i + size, step + 1
        stop = processor.process(request, None, now=0.0)
        snapshot = processor.make_output("r")
        streamed.append(snapshot.outputs[0].text)
        if stop is not None:
            return snapshot.outputs[0], streamed
    raise AssertionError("the output ended without a stop string")


@pytest.mark.parametrize("min_tokens", [0, 3, 8, 12])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("step_sizes", [[1], [3], [2, 5, 1], [20]], ids=["plain", "k2", "mixed", "one-step"])
def test_stop_strings_match_plain_decoding_and_spare_the_min_tokens_text(tokenizer, min_tokens, include, step_sizes):
    output = tokenizer.encode(TEXT)
    params = SamplingParams(stop=["."], min_tokens=min_tokens, include_stop_str_in_output=include, max_tokens=64)
    text, token_ids, stop = reference(tokenizer, output, params)
    completion, streamed = run(tokenizer, output, params, step_sizes)
    assert (completion.text, completion.token_ids, completion.stop_reason) == (text, token_ids, stop)
    assert completion.finish_reason == "stop"
    assert text.startswith(tokenizer.decode(output[:min_tokens]))  # min_tokens' text is never cut
    assert all(completion.text.startswith(sent) for sent in streamed)  # nothing a stream sent is taken back


def test_a_stop_string_spanning_two_steps_is_found(tokenizer):
    output = tokenizer.encode(TEXT)
    params = SamplingParams(stop=["are you", "Thanks, and"], max_tokens=64)
    text, token_ids, stop = reference(tokenizer, output, params)
    for step_sizes in ([1], [2], [3, 1]):
        completion, _ = run(tokenizer, output, params, step_sizes)
        assert (completion.text, completion.token_ids, completion.stop_reason) == (text, token_ids, stop)
