"""Text in and out: the target's tokenizer, its chat template, stop strings, streaming detokenization.

Uses `tokenizers` for `tokenizer.json` and `jinja2` for the `chat_template` of
`tokenizer_config.json`, rendered the way Hugging Face renders it (a sandboxed environment with
`trim_blocks` / `lstrip_blocks`, `raise_exception`, and `add_generation_prompt`). Thinking is off by
default (`enable_thinking=False`): published DFlash drafters are trained without it, and their
acceptance collapses on thinking-mode text (z-lab/dflash#133).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dflash_iree import validate
from dflash_iree.errors import DFlashError


class TextCodec:
    """Tokenizer + chat template of a target checkpoint folder.

    Args:
        folder: the target's folder with `tokenizer.json` (and optionally `tokenizer_config.json`).
        vocab_size: the target's vocabulary size (manifest target.config.vocab_size), or None
            (unchecked: the eager tools, which index the model's own embedding).

    Raises:
        DFlashError: tokenizer.json is missing or unreadable, or holds an id (an added token
            included) at or above `vocab_size`.
    """

    def __init__(self, folder: str | Path, vocab_size: int | None = None):
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise DFlashError(f"{path} does not exist; text prompts need the target's tokenizer.json: pass a --target "
                              "folder that has one, or token ids (--prompt-ids)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise DFlashError(f"{path}: not a readable tokenizer ({e})") from None
        if vocab_size is not None:
            self._check_vocab(path, vocab_size)
        cfg_path = folder / "tokenizer_config.json"
        try:
            self.config = json.loads(cfg_path.read_bytes()) if cfg_path.is_file() else {}
        except (OSError, ValueError) as e:
            raise DFlashError(f"{cfg_path}: not a readable JSON file ({e}); fix or remove it") from None
        if not isinstance(self.config, dict):
            raise DFlashError(f"{cfg_path}: not a JSON object; fix or remove it")
        self.folder = folder

    def _check_vocab(self, path: Path, vocab_size: int) -> None:
        """Refuse a tokenizer that can emit an id the target has no embedding row for: once here,
        so that no text prompt reaches the device's gather with such an id (out of bounds there
        reads whatever lies past the table: a silent wrong answer, or a crash)."""
        # the largest id, not the count: ids need not be contiguous
        over = sorted((i, t) for t, i in self.tokenizer.get_vocab(with_added_tokens=True).items() if i >= vocab_size)
        if over:
            top = over[-1][0]
            shown = ", ".join(t for _, t in over[:3]) + (f" and {len(over) - 3} more" if len(over) > 3 else "")
            raise DFlashError(f"{path} has token ids up to {top} ({shown}), but the target's vocab_size is "
                              f"{vocab_size}: use the tokenizer.json that came with the target checkpoint (or remove "
                              f"the added tokens at {vocab_size} and above), or pass token ids (--prompt-ids)")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens added.

        Raises:
            DFlashError: `text` is not a str, or holds a lone surrogate (undecoded bytes).
        """
        if not isinstance(text, str):
            raise DFlashError(f"the prompt text is a {type(text).__name__}, not a str")
        return self.tokenizer.encode(validate.text(text, "the prompt"), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        """The id of a single (special) token, or None."""
        return self.tokenizer.token_to_id(text)

    def render_chat(self, messages: list[dict], enable_thinking: bool = False, add_generation_prompt: bool = True) -> str:
        """Render chat messages with the checkpoint's `chat_template` (jinja2).

        Raises:
            DFlashError: the checkpoint has no chat template, or the template raised an error.
        """
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DFlashError(f"chat message {i} is {m!r}; each message is {{\"role\": str, \"content\": str}}")
            validate.text(m["content"], f"chat message {i}")
        template = self.config.get("chat_template")
        if not template:
            where = Path(self.folder).resolve() / "tokenizer_config.json"
            raise DFlashError(f"{where} has no chat_template, so this target takes no chat messages: send text or "
                              "token ids instead (the server's /v1/completions), or use a target whose "
                              "tokenizer_config.json has a chat_template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        special = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        try:
            return env.from_string(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **special
            )
        except jinja2.exceptions.TemplateError as e:
            raise DFlashError(f"{self.folder}/tokenizer_config.json: the chat template failed: {e}") from None


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


class StreamDecoder:
    """Incremental detokenization: feed committed ids, get the new text piece.

    Holds back text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD) until the next
    token completes it, and text that could be the start of one of `stops`, so that the streamed
    text is the result's text: cut before a stop string, which is never shown (as vLLM's default,
    include_stop_str_in_output=False).

    stops: the request's stop strings (empty: none).
    """

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()):
        self.codec, self.stops, self.ids, self.emitted = codec, tuple(s for s in stops if s), [], ""

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        """The new text after `ids` are committed; `final`: the request is done, give the rest."""
        self.ids.extend(ids)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        at = find_stop(text, self.stops) if self.stops else None
        if at is not None:
            text = text[:at]
        elif not final:
            text = text[:len(text) - self._partial_stop(text)]
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece

    def _partial_stop(self, text: str) -> int:
        """Length of the longest end of `text` that a stop string starts with."""
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)
