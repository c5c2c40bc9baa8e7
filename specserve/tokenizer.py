"""Text <-> token ids for a model, from a Hugging Face folder or a GGUF file, plus chat templates
and streaming detokenization.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from specserve.models.loader import ModelLoadError, default_model_path

# Tokens that end an assistant turn in common chat formats; they stop generation when the
# chat template uses them, even if the tokenizer's eos is another token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# GGUF token_type values (llama.cpp's llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Gemma's chat format, for GGUF files that carry no template: a system message opens the first user turn,
# the assistant's role is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] ~ '\\n\\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- if (message['role'] == 'user') != loop.index0 is even -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\\n' }}"
    "{{ (system if loop.first else '') ~ (message['content'] | trim) ~ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}"
)

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre`; anything else gets GPT-2's.
_LLAMA3_LIKE_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{digits}"
    r"| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"),
                    _LLAMA3_LIKE_SPLIT.format(digits="{1,3}")),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _LLAMA3_LIKE_SPLIT.format(digits="")),
}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what a chat server needs: special ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        source: str = "",
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.source = source
        self._extra_eos_token_ids = set(extra_eos_token_ids)

    # ------------------------------------------------------------ constructors

    @classmethod
    def from_hf_folder(cls, path: str) -> "Tokenizer":
        """From tokenizer.json, tokenizer_config.json, and optionally chat_template.jinja and
        generation_config.json (for extra stop ids)."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"{tokenizer_file} not found: a tokenizer folder needs a tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        except Exception as e:
            raise ModelLoadError(f"{tokenizer_file}: not a valid tokenizers file ({e})") from e
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template_file = Path(path, "chat_template.jinja")
        template = template_file.read_text() if template_file.is_file() else _pick_template(config.get("chat_template"))
        generation = _read_json(os.path.join(path, "generation_config.json"))
        extra = generation.get("eos_token_id") or []
        return cls(backend, template, _token_content(config.get("bos_token")), _token_content(config.get("eos_token")),
                   extra if isinstance(extra, list) else [extra], source=path)

    @classmethod
    def from_gguf(cls, path: str, use_cache: bool = True) -> "Tokenizer":
        """From a GGUF file's `tokenizer.*` metadata: byte-level BPE (ggml model 'gpt2') or SentencePiece
        (model 'llama': merges by token score, byte fallback, as llama.cpp tokenizes it).

        Parsing the metadata takes seconds, so the result is cached next to the converted weights.
        """
        from specserve.models.gguf_cache import gguf_cache_dir

        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        folder = gguf_cache_dir(path) if use_cache else None
        cached = _read_tokenizer_cache(folder) if folder else None
        if cached is None:
            cached = _tokenizer_from_gguf(path)
            if folder:
                _write_tokenizer_cache(folder, *cached)
        backend, meta = cached
        return cls(backend, meta["chat_template"], meta["bos_token"], meta["eos_token"],
                   meta["extra_eos_token_ids"], source=path)

    # ------------------------------------------------------------ encoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text (e.g. <|im_start|>) stay whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text for token ids; incomplete UTF-8 at the ends shows as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs
    ) -> str:
        """The prompt text for a conversation, rendered like transformers' apply_chat_template(tokenize=False)."""
        if not self.chat_template:
            raise ValueError(f"{self.source}: this tokenizer has no chat template")
        # Like transformers: drop None values (OpenAI clients send content=None), templates test for presence.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return _compile_template(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **{**special, **kwargs}
        )

    # ------------------------------------------------------------ special tokens

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    @property
    def eos_token_ids(self) -> set[int]:
        """Ids that end generation: eos, generation_config's eos ids, and end-of-turn tokens the
        chat template writes (e.g. <|im_end|>)."""
        ids = set(self._extra_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        for token in END_OF_TURN_TOKENS:
            if self.chat_template and token in self.chat_template and self._token_id(token) is not None:
                ids.add(self._token_id(token))
        return ids

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of all special added tokens (those skip_special_tokens drops) plus bos/eos."""
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        return sorted(ids)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """A Tokenizer for a HF folder, a `.gguf` file, a catalog model name (specserve models), or the default
    model when `path` is None."""
    from specserve.config import resolve_model_name

    path = default_model_path() if path is None else resolve_model_name(os.fspath(path))
    if os.path.isdir(path):
        return Tokenizer.from_hf_folder(path)
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"Tokenizer path not found: {path} (expected a folder or a .gguf file)")
    raise ModelLoadError(f"{path}: expected a Hugging Face tokenizer folder or a file ending in .gguf")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each step decodes only a short window: tokens[prefix_offset:read_offset] were already shown,
    tokens[read_offset:] are new (the scheme vLLM and TGI use). A delta is held back while the
    window's text ends in U+FFFD, i.e. a multi-byte character split across tokens is incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the first output token its context (e.g. a leading space).
        self._ids: list[int] = list(prompt_ids or [])[-6:]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - 5, 0)
        self._pieces: list[str] = []

    def add(self, ids: Iterable[int]) -> str:
        """Append output token ids; return the text they complete (possibly "")."""
        return "".join(self._add_one(token_id) for token_id in ids)

    @property
    def text(self) -> str:
        """All output text released so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _add_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        shown = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        if len(window) <= len(shown) or window.endswith("\ufffd"):
            return ""
        delta = window[len(shown):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)


# ---------------------------------------------------------------- GGUF tokenizer building


def _tokenizer_from_gguf(path: str) -> tuple[tokenizers.Tokenizer, dict]:
    """(backend, meta) from a GGUF file; meta holds chat_template, bos/eos tokens, extra eos ids."""
    from specserve.models.gguf_loader import open_gguf

    reader = open_gguf(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    kind = fields.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{path}: tokenizer model {kind!r} is not supported; expected 'gpt2' (byte-level BPE) or 'llama' "
            "(SentencePiece)"
        )
    tokens = fields["tokenizer.ggml.tokens"]
    if kind == "gpt2":
        backend = build_byte_level_bpe(
            tokens, fields.get("tokenizer.ggml.merges", []), fields.get("tokenizer.ggml.token_type"),
            fields.get("tokenizer.ggml.pre"),
        )
    else:
        backend = build_sentencepiece_bpe(tokens, fields["tokenizer.ggml.scores"],
                                          fields.get("tokenizer.ggml.token_type"),
                                          bool(fields.get("tokenizer.ggml.add_space_prefix", True)))
    bos_id, eos_id = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    _add_bos_eos(backend, bos if fields.get("tokenizer.ggml.add_bos_token") else None,
                 tokens[eos_id] if fields.get("tokenizer.ggml.add_eos_token") else None)
    extra = [fields[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields]
    template = fields.get("tokenizer.chat_template")
    if template is None and "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
        template = GEMMA_CHAT_TEMPLATE
    meta = {
        "chat_template": template,
        "bos_token": bos,
        "eos_token": tokens[eos_id] if eos_id is not None else None,
        "extra_eos_token_ids": extra,
    }
    return backend, meta


def build_byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int] | None, pre: str | None
) -> tokenizers.Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer from GGUF vocabulary data.

    Control tokens become special added tokens and user-defined ones plain added tokens, so both
    are matched whole in text. The pre-tokenizer split follows `pre` (tokenizer.ggml.pre).
    """
    alphabet = _byte_to_unicode()
    allowed = set(alphabet.values())
    spelled = [t if set(t) <= allowed else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    types = token_types or [1] * len(tokens)
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocab.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, s, k in zip(tokens, spelled, types) if k == _CONTROL and t == s])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, s, k in zip(tokens, spelled, types) if k == _USER_DEFINED and t == s])
    return backend


def build_sentencepiece_bpe(tokens: list[str], scores: list[float], token_types: list[int] | None,
                           add_space_prefix: bool) -> tokenizers.Tokenizer:
    """A SentencePiece-BPE tokenizer (GGUF model 'llama': Gemma, Llama 2, Mistral) from GGUF vocabulary data.

    llama.cpp merges adjacent pieces into the vocabulary piece of highest score first; the merge list here
    ranks every split of a piece into two vocabulary pieces by that score, so BPE applies them in the same
    order. Spaces are '▁'; characters outside the vocabulary fall back to byte tokens <0xXX>."""
    types = token_types or [_NORMAL] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    mergeable = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == _NORMAL}
    ranked = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], mergeable[left], mergeable[right], left, right))
    ranked.sort()
    unk = next((t for t in ("<unk>",) if t in vocab), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(l, r) for *_, l, r in ranked], unk_token=unk,
                                              fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if add_space_prefix else []) + steps)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """GPT-2's regex split + byte mapping, or the split the named vocabulary was trained with."""
    split = _GGUF_PRE_SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _add_bos_eos(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Make encode(add_special_tokens=True) wrap text in bos/eos, when the GGUF asks for it."""
    if bos is None and eos is None:
        return
    ends = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    single = " ".join(([bos] if bos else []) + ["$A"] + ([eos] if eos else []))
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=ends)


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (spaces become 'Ġ', newlines 'Ċ', ...)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _read_tokenizer_cache(folder: Path) -> tuple[tokenizers.Tokenizer, dict] | None:
    """(backend, meta) from a cache folder, or None if absent or unreadable (it is then rebuilt)."""
    if not (folder / "tokenizer_meta.json").is_file():
        return None
    try:
        meta = json.loads((folder / "tokenizer_meta.json").read_text())
        return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), meta
    except Exception:
        return None


def _write_tokenizer_cache(folder: Path, backend: tokenizers.Tokenizer, meta: dict) -> None:
    """Store a built GGUF tokenizer; the meta file is written last and marks the entry complete."""
    from specserve.models.gguf_cache import atomic_write

    try:
        atomic_write(folder / "tokenizer.json", lambda tmp: backend.save(tmp))
        atomic_write(folder / "tokenizer_meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta)))
    except OSError:
        pass  # caching is an optimization; the tokenizer is still usable


# ---------------------------------------------------------------- HF folder helpers


def _read_json(file: str) -> dict:
    """A JSON file's contents, {} when it does not exist."""
    if not os.path.isfile(file):
        return {}
    try:
        return json.loads(Path(file).read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from e


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


def _pick_template(template: Any) -> str | None:
    """The default template when tokenizer_config.json lists several named ones."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


# ---------------------------------------------------------------- chat templates


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers marks assistant text with it);
    renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Jinja's own tojson escapes HTML characters, which would change prompts."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in the environment transformers uses (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, raise_exception, strftime_now, tojson)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
