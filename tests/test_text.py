"""Tokenizer, chat template, stop strings and streaming detokenization (runtime/text.py)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_iree.errors import DFlashError
from dflash_iree.runtime.text import StreamDecoder, TextCodec, find_stop

# The shape of Qwen3's template: system/user/assistant turns, and an empty think block when
# thinking is off.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "héllo wörld ✓"] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return TextCodec(folder)


def test_round_trip(codec):
    text = "def f(x):\n    return x + 1\nhéllo ✓"
    assert codec.decode(codec.encode(text)) == text


def test_chat_template_thinking_off_by_default(codec):
    out = codec.render_chat([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert "<think>" not in codec.render_chat([{"role": "user", "content": "hi"}], enable_thinking=True)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(DFlashError, match="tokenizer.json does not exist"):
        TextCodec(tmp_path)


def test_find_stop():
    assert find_stop("abc\n\ndef", ["\n\n", "zz"]) == 3
    assert find_stop("abc", ["zz"]) is None


def test_stream_decoder_holds_partial_utf8(codec):
    ids = codec.encode("héllo wörld ✓ done")
    stream = StreamDecoder(codec)
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) == "héllo wörld ✓ done"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stop", ["wör", "ld ✓", "o w", "done", "zz"])
def test_stream_decoder_shows_the_result_text_cut_before_a_stop(codec, stop):
    """Streamed pieces join to the text cut before the stop string (never showing it, nor a start of
    it that turns out to be one), as the result's text is; without a stop everything comes out."""
    text = "héllo wörld ✓ done"
    ids = codec.encode(text)
    stream = StreamDecoder(codec, [stop])
    pieces = [stream.push([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    at = text.find(stop)
    assert "".join(pieces) == (text if at < 0 else text[:at])


def test_engine_stream_equals_generate_with_a_stop_string(long_artifacts):
    """`stream` shows what `generate` returns: the text cut before the stop string (the CLI's
    default output is the stream)."""
    from dflash_iree.runtime.engine import Engine

    engine = Engine.load(long_artifacts)
    full = engine.generate("def f(x):", 40).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    pieces = engine.stream("def f(x):", 40, stop=[stop])
    streamed = ""
    try:
        while True:
            streamed += next(pieces)
    except StopIteration as end:
        result = end.value
    assert stop not in streamed and streamed == result.text == engine.generate("def f(x):", 40, stop=[stop]).text
    assert full.startswith(streamed) and len(streamed) <= len(full) // 2
