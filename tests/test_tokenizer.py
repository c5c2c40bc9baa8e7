"""Our tokenizer against transformers' tokenizer built from the same GGUF: encode, decode, chat
template; and streaming detokenization against a full decode."""

from __future__ import annotations

import os

import pytest

from specserve.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    "",
    "   ",
    "  leading spaces\tand\ttabs\n\n\nthree newlines   \n",
    "naïve café, Ünïcödé, 北京欢迎你, こんにちは, 안녕하세요",
    "emoji 😀👍🏽 🇺🇸 👨‍👩‍👧‍👦 🤖",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "12345678901 3.14159 1,000,000 -42 0x1F",
    "Ελληνικά кириллица العربية हिन्दी",
    "'s 've I'm DON'T they'll",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b <jupyter_code>x",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello. 👋"},
     {"role": "user", "content": "Name a prime > 10."}],
]


@pytest.fixture(scope="module")
def tokenizers_pair(default_gguf_path, tmp_path_factory):
    """(ours built from metadata, ours from the cache, transformers') for the default GGUF."""
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        built = Tokenizer.from_gguf(default_gguf_path)
        cached = Tokenizer.from_gguf(default_gguf_path)
    reference = AutoTokenizer.from_pretrained(os.path.dirname(default_gguf_path),
                                              gguf_file=os.path.basename(default_gguf_path))
    return built, cached, reference


@pytest.fixture(scope="module")
def ours(tokenizers_pair):
    return tokenizers_pair[0]


@pytest.mark.parametrize("which", [0, 1], ids=["built", "cached"])
def test_encode_decode_match_transformers(tokenizers_pair, which):
    ours, reference = tokenizers_pair[which], tokenizers_pair[2]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("which", [0, 1], ids=["built", "cached"])
def test_chat_template_matches_transformers(tokenizers_pair, which):
    ours, reference = tokenizers_pair[which], tokenizers_pair[2]
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_special_ids(tokenizers_pair):
    ours, _, reference = tokenizers_pair
    assert ours.eos_token_id == reference.eos_token_id == 2
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_ids == {2}  # <|im_end|>: SmolLM2-Instruct's eos and end of turn
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert ours.vocab_size == len(reference)


def test_hf_folder_round_trip(tokenizers_pair, tmp_path):
    """transformers saves the GGUF tokenizer as a HF folder; ours reads that folder identically."""
    ours, _, reference = tokenizers_pair
    reference.save_pretrained(tmp_path)
    folder = load_tokenizer(str(tmp_path))
    for text in TEXTS:
        assert folder.encode(text) == ours.encode(text)
    assert folder.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])
    assert folder.eos_token_id == ours.eos_token_id


def test_chat_template_helpers(ours):
    """raise_exception, tojson (no HTML escaping) and the generation tag work like transformers'."""
    ours = Tokenizer(ours.backend, chat_template=(
        "{% if messages|length == 0 %}{{ raise_exception('empty') }}{% endif %}"
        "{% generation %}{{ messages[0] | tojson }}{% endgeneration %}{{ bos_token }}"
    ), bos_token="<|im_start|>")
    assert ours.apply_chat_template([{"role": "user", "content": "<b>&"}]) == \
        '{"role": "user", "content": "<b>&"}<|im_start|>'
    with pytest.raises(Exception, match="empty"):
        ours.apply_chat_template([])


def stream(ours: Tokenizer, ids: list[int], prompt_ids=None, chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(ours, prompt_ids=prompt_ids)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_matches_full_decode(ours, chunk):
    for text in TEXTS + ["北京欢迎你😀👍🏽", "🇺🇸🇯🇵 done"]:
        ids = ours.encode(text)
        deltas = stream(ours, ids, chunk=chunk)
        assert "".join(deltas) == ours.decode(ids), text
        assert not any("\ufffd" in d for d in deltas), text


def test_incremental_detokenizer_holds_split_characters(ours):
    ids = ours.encode("👨‍👩‍👧‍👦 北京")
    # The test only means something if some character really spans several tokens.
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    deltas = stream(ours, ids)
    assert "" in deltas and "".join(deltas) == "👨‍👩‍👧‍👦 北京"


def test_incremental_detokenizer_after_prompt_and_specials(ours):
    prompt = ours.encode(ours.apply_chat_template(CONVERSATIONS[0]))
    output = ours.encode("Four. 🎉<|im_end|>")
    deltas = stream(ours, output, prompt_ids=prompt)
    assert "".join(deltas) == "Four. 🎉" == ours.decode(output)


def test_incremental_detokenizer_decodes_small_windows(ours):
    """Work per token stays bounded: no decode sees more than a handful of tokens."""
    lengths = []
    original = ours.decode

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return original(ids, skip_special_tokens)

    spy = Spy(ours.backend)
    ids = ours.encode("The quick brown fox jumps over the lazy dog. " * 40)
    assert "".join(stream(spy, ids)) == ours.decode(ids)
    assert len(ids) > 300 and max(lengths) <= 8


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_gemma3_gguf_sentencepiece_vocabulary_tokenizes_as_transformers(gemma3_gguf_path):
    """A SentencePiece GGUF vocabulary (tokenizer.ggml.model 'llama'): ids as transformers' own GGUF converter
    gives them (the same as llama.cpp's on these texts, checked once), and text back as it was."""
    import json
    import os

    from transformers import AutoTokenizer

    from specserve.bench.common import DEFAULT_DATASET

    ours = load_tokenizer(gemma3_gguf_path)
    reference = AutoTokenizer.from_pretrained(os.path.dirname(gemma3_gguf_path),
                                              gguf_file=os.path.basename(gemma3_gguf_path))
    rows = [json.loads(line) for line in open(DEFAULT_DATASET)][::40]
    texts = [r["turns"][0] for r in rows] + [
        "  leading spaces and\ttabs\n\nnew paragraphs", "Ünïcödé 日本語 テキスト 🙂🚀", "a\u00a0b\u2003c",
        "<start_of_turn>user\nHi<end_of_turn>\n", "numbers 1234567 3.14159", "x" * 50]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids[1:], skip_special_tokens=False) == text


def test_gemma3_gguf_gets_gemmas_chat_format(gemma3_gguf_path):
    tok = load_tokenizer(gemma3_gguf_path)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert tok.encode(text, add_special_tokens=False)[:2] == [2, 105]  # <bos>, <start_of_turn> whole
    assert {1, 106} <= tok.eos_token_ids  # <eos> and <end_of_turn> end a reply
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_catalog_name_loads_its_files_tokenizer(monkeypatch, default_gguf_path):
    """load_tokenizer takes a catalog model name (specserve models) as the engine does: the name's file."""
    from specserve.models import catalog

    asked = []
    monkeypatch.setattr(catalog, "resolve", lambda name: asked.append(name) or default_gguf_path)
    by_name = load_tokenizer("some-catalog-model")
    assert asked == ["some-catalog-model"]
    assert by_name.encode("Hello, world") == load_tokenizer(default_gguf_path).encode("Hello, world")
