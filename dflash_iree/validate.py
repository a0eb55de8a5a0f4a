"""Request and option checks: plain values in, a checked value out, or one `DFlashError` line.

Every value a user hands the engine (token ids, sampling settings, counts, text) passes through
one of these before the device sees it, so nothing from a request reaches an out-of-bounds gather
or a float the compiled graph turns into a silent wrong answer. Torch-free and IREE-free: the
CLI, the runtime and the compiler front end share them. Each message names the option and the fix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

from .errors import DFlashError

# The compiled sampler keys its randomness by the low 32 bits of the seed (export/sampling.py
# keyed_uniform: `seed & 0xFFFFFFFF`), so seeds outside [0, 2**32) would collide silently with
# seeds inside it.
SEED_LIMIT = 2**32
# Temperatures are float32 on the device. Below MIN_TEMPERATURE, logits / T overflows float32
# for ordinary logit ranges (NaN rows, whose argmax is the out-of-vocabulary id V); above
# MAX_TEMPERATURE every logit rounds to the same score. vLLM treats < 1e-5 as greedy
# (_SAMPLING_EPS); we refuse rather than change the request.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e5


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(value, option: str, low: int, high: int | None = None, fix: str = "") -> int:
    """`value` as an int in [low, high] (high None: no upper bound).

    Args:
        value: an int (numpy integers too; not bool, float or str).
        option: the option's name as the user wrote it, e.g. "--runs" or "max_new_tokens".
        fix: what the range means, appended to the message.

    Raises:
        DFlashError: not an integer, or outside the range.
    """
    span = f"{low} or more" if high is None else f"{low}..{high}"
    if not _is_int(value):
        raise DFlashError(f"{option} {value!r} is not an integer; use an integer, {span}{fix}")
    if value < low or (high is not None and value > high):
        raise DFlashError(f"{option} {value} is out of range: use {span}{fix}")
    return int(value)


def count(value, option: str, what: str) -> int:
    """A count that must be at least 1 (`--runs`, `--limit`, max_new_tokens).

    Raises:
        DFlashError: not an integer, or below 1; `what` says what the count counts.
    """
    return integer(value, option, 1, fix=f" ({what})")


def prompt(value):
    """A prompt's kind checked: text (str), token ids, or chat messages (a list of dicts).

    Raises:
        DFlashError: bytes, None, a number, or anything else that is none of the three.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise DFlashError("the prompt is bytes; decode it to text (str) first, or pass a list of token ids")
    if isinstance(value, Mapping):
        raise DFlashError("the prompt is one chat message (a dict); pass a list of messages: [{\"role\": ..., "
                          "\"content\": ...}]")
    if not isinstance(value, str) and (not hasattr(value, "__len__") or not hasattr(value, "__getitem__")):
        raise DFlashError(f"the prompt is a {type(value).__name__}; pass text (str), a list of token ids, or chat "
                          "messages [{\"role\": ..., \"content\": ...}]")
    return value


def token_ids(ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """Token ids checked against the vocabulary: every id an int in [0, vocab_size).

    Args:
        ids: a sequence of ints (list, tuple, numpy array). Not bytes or str: those are text.
        vocab_size: the target's vocabulary size (manifest target.config.vocab_size).
        what: "prompt", "stop", ... for the message.

    Returns:
        The ids as a list of Python ints.

    Raises:
        DFlashError: bytes or str given as ids, an id that is not an integer, or one outside
            [0, vocab_size), naming its position and value.
    """
    if isinstance(ids, (bytes, bytearray, memoryview)):
        raise DFlashError(f"{what} is bytes; decode it to text (str) first, or pass a list of token ids")
    out = []
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise DFlashError(f"{what} token {i} is {t!r}, not an integer token id; use ids in 0..{vocab_size - 1}")
        if not 0 <= t < vocab_size:
            raise DFlashError(f"{what} token id {int(t)} (position {i}) is outside the vocabulary: use ids in "
                              f"0..{vocab_size - 1} (the target's vocab_size {vocab_size})")
        out.append(int(t))
    return out


def _number(value, option: str, use: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DFlashError(f"{option} {value!r} is not a number; use {use}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range
        raise DFlashError(f"{option} {value} is not a finite number; use {use}") from None
    if not math.isfinite(value):
        raise DFlashError(f"{option} {value} is not a finite number; use {use}")
    return value


def seconds(value, option: str) -> float:
    """A duration in seconds: a finite number >= 0.

    Raises:
        DFlashError: not a number, NaN, inf or negative, naming OPTION.
    """
    use = "a number of seconds >= 0"
    value = _number(value, option, use)
    if value < 0:
        raise DFlashError(f"{option} {value:g} is out of range: use {use}")
    return value


def temperature(value) -> float:
    """Temperature: 0 (greedy) or a finite float in [MIN_TEMPERATURE, MAX_TEMPERATURE].

    Raises:
        DFlashError: NaN, inf, negative, or outside what float32 sampling does faithfully.
    """
    use = f"0 (greedy) or {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}"
    value = _number(value, "temperature", use)
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise DFlashError(f"temperature {value} is out of range: use {use}")
    return value


def top_p(value) -> float:
    """Nucleus mass: a finite float in (0, 1] (1: no cut).

    Raises:
        DFlashError: NaN, inf, or outside (0, 1].
    """
    value = _number(value, "top_p", "a number in (0, 1]")
    if not 0 < value <= 1:
        raise DFlashError(f"top_p {value} is out of range: use a number in (0, 1] (1: no nucleus cut)")
    return value


def sampling(temp, top_k, top_p_, seed, vocab_size: int | None) -> tuple[float, int, float, int]:
    """The four sampling settings, checked; top_k above the vocabulary is clamped to it (the
    same cut: every token kept), so that no int64 overflow reaches the device; vocab_size None
    (the options alone, before the artifacts are known) clamps nothing.

    Returns:
        (temperature float, top_k int in [0, vocab_size], top_p float, seed int in [0, 2**32)).

    Raises:
        DFlashError: the first setting out of range (see `temperature`, `top_p`); top_k not an
            integer >= 0; seed not an integer in [0, 2**32).
    """
    t = temperature(temp)
    k = integer(top_k, "top_k", 0, fix=" (0: no top-k cut)")
    p = top_p(top_p_)
    s = integer(seed, "seed", 0, SEED_LIMIT - 1,
                fix=" (the sampler uses the seed's low 32 bits, so larger seeds would repeat smaller ones)")
    return t, k if vocab_size is None else min(k, vocab_size), p, s


def num_speculative_tokens(value, block_size: int) -> int:
    """Draft depth: an int in 1..block_size - 1.

    Raises:
        DFlashError: not an integer, or outside the range.
    """
    return integer(value, "num_speculative_tokens", 1, block_size - 1,
                   fix=f" (block_size - 1 of these artifacts is {block_size - 1})")


def index(value, option: str, n: int, where: str) -> int:
    """An index into n items (`demo --index`): an int in 0..n-1.

    Raises:
        DFlashError: not an integer, or outside the range.
    """
    return integer(value, option, 0, n - 1, fix=f" ({where} holds {n})")


def text(value: str, where: str) -> str:
    """A prompt or stop string checked to be real text: no lone surrogates (what undecodable
    bytes become in argv, or a JSON "\\udcff" escape), which the tokenizer cannot encode.

    Raises:
        DFlashError: the string holds a lone surrogate, naming its position and the --encoding fix.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DFlashError(f"{where} is not valid text: character {e.start} is {value[e.start]!r}, an undecodable byte "
                          "or a lone surrogate; pass UTF-8 text, or name its encoding with --encoding") from None
    return value


def decode(data: bytes, encoding: str, where: str) -> str:
    """Bytes (a prompt file, a command-line prompt) as text in `encoding`, strictly.

    Raises:
        DFlashError: an unknown encoding, or bytes that are not valid in it, naming the offset.
    """
    try:
        return data.decode(encoding)
    except LookupError:
        raise DFlashError(f"--encoding {encoding}: unknown encoding; use a Python codec name such as utf-8 or "
                          "latin-1") from None
    except UnicodeDecodeError as e:
        lines = data.count(b"\n", 0, e.start) + 1
        line = f" (line {lines})" if b"\n" in data else ""
        raise DFlashError(f"{where} is not valid {encoding}: byte {data[e.start]:#04x} at offset {e.start}{line}; pass "
                          "--encoding with the text's encoding (e.g. --encoding latin-1)") from None


def stop_items(stop) -> list:
    """The `stop` argument as a list of str and int items (one item alone is accepted).

    Raises:
        DFlashError: an item that is neither a string nor an integer token id; bytes, a dict or a
            number that is no integer in place of the list.
    """
    if isinstance(stop, (bytes, bytearray, memoryview, Mapping)) or (
            stop is not None and not isinstance(stop, (str, Iterable)) and not _is_int(stop)):
        raise DFlashError(f"stop {stop!r} is neither a stop string, an integer token id, nor a list of them")
    items = [stop] if isinstance(stop, str) or _is_int(stop) else list(stop or [])
    for s in items:
        if not isinstance(s, str) and not _is_int(s):
            raise DFlashError(f"stop item {s!r} is neither a stop string nor an integer token id")
    return items


def all_ids(items: Iterable, vocab_size: int, what: str) -> frozenset[int]:
    """`token_ids` of the integer items of a mixed list, as a set."""
    return frozenset(token_ids([s for s in items if not isinstance(s, str)], vocab_size, what))
