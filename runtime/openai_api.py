"""OpenAI's completions and chat completions wire format: request bodies to GenerateOptions, and
the response, stream chunk, usage and timings objects.

Follows the OpenAI API reference (`/v1/completions`, `/v1/chat/completions`, server-sent event
chunks, `stream_options.include_usage`), with vLLM's extensions `top_k`, `stop_token_ids`,
`return_token_ids` and `chat_template_kwargs.enable_thinking`, and llama.cpp's per-response
`timings` (prompt_n, prompt_ms, predicted_n, predicted_ms, predicted_per_second, draft_n,
draft_n_accepted) with the speculative figures added (rounds, tau, acceptance_histogram).
A field we cannot honour is refused with a 400 that names it, never ignored.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from dflash_iree.errors import DFlashError

from .options import GenerateOptions

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
          "stream_options", "n", "return_token_ids", "speculative", "num_speculative_tokens"}
FIELDS = {"completions": COMMON | {"prompt"},
          "chat": COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}}
IGNORED = {"user", "metadata", "store"}  # no effect on the output
# Refused unless at the value that means "off": field -> the values accepted.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
               "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "logit_bias": (None, {}),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None,),
               "response_format": (None, {"type": "text"}), "best_of": (None, 1), "echo": (None, False),
               "suffix": (None,), "min_tokens": (None, 0), "parallel_tool_calls": (None,), "audio": (None,),
               "modalities": (None, ["text"]), "prediction": (None,), "n": (None, 1)}
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the room left in the context


class ApiError(Exception):
    """A request the server refuses: HTTP `status`, one-line `message`, the `param` at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """OpenAI's error object: {"error": {message, type, param, code}}."""
        kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status, "invalid_request_error" if self.status < 500
                                                 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """What a request asks, in engine terms.

    prompt: text, token ids, or chat messages; options: GenerateOptions; max_tokens: the budget
    (None: the context's room); stream, include_usage, return_token_ids, enable_thinking: flags.
    """

    prompt: object
    options: GenerateOptions
    max_tokens: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    enable_thinking: bool


def _int(body: dict, name: str, low: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, not {v!r}", name)
    if low is not None and v < low:
        raise ApiError(400, f"{name} {v} is out of range: use {low} or more", name)
    return v


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false, not {v!r}", name)
    return v


def _stop(body: dict) -> list:
    stop = body.get("stop")
    items = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, f"stop must be a string or a list of strings, not {stop!r}", "stop")
    if any(s == "" for s in items):
        raise ApiError(400, "stop holds an empty string, which would end every completion at once; remove it", "stop")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, f"stop_token_ids must be a list of integer token ids, not {ids!r}", "stop_token_ids")
    return items + ids


def _prompt(body: dict):
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > 1:
            raise ApiError(400, f"prompt holds {len(p)} prompts; send one prompt per request", "prompt")
        p = p[0]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise ApiError(400, "prompt must be a non-empty string or a non-empty list of integer token ids", "prompt")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ApiError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                               "are supported", "messages")
            content = "".join(c["text"] for c in content)
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
            raise ApiError(400, f"messages[{i}] must be an object with a string \"role\" and \"content\"", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def parse(kind: str, body, model: str) -> Parsed:
    """Check a request body of `kind` ("completions" or "chat") and map it onto the engine's terms.

    Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions and the context's
    room for chat; a sampled request without a seed gets a random one.

    Raises:
        ApiError: 400 for a body that is not an object, an unknown or unsupported field (named),
            a value of the wrong type or out of range; 404 for another model than `model`.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind] - IGNORED - set(UNSUPPORTED))
    if unknown:
        raise ApiError(400, f"unknown field {', '.join(unknown)}: this server takes {', '.join(sorted(FIELDS[kind]))}",
                       unknown[0])
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise ApiError(400, f"{name} is not supported by this server (got {body[name]!r}); leave it out", name)
    if body.get("model") not in (None, model):
        raise ApiError(404, f"the model {body['model']!r} does not exist: this server serves {model!r} "
                       "(GET /v1/models)", "model", "model_not_found")
    prompt = _prompt(body) if kind == "completions" else _messages(body)
    max_tokens = _int(body, "max_tokens", 1)
    if kind == "chat":
        mct = _int(body, "max_completion_tokens", 1)
        max_tokens = mct if mct is not None else max_tokens
    elif max_tokens is None:
        max_tokens = COMPLETIONS_MAX_TOKENS
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise ApiError(400, f"stream_options must be {{\"include_usage\": bool}}, not {stream_options!r}",
                       "stream_options")
    template = body.get("chat_template_kwargs") or {}
    if not isinstance(template, dict) or set(template) - {"enable_thinking"}:
        raise ApiError(400, "chat_template_kwargs takes only enable_thinking", "chat_template_kwargs")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    seed = _int(body, "seed")
    if seed is None:
        seed = secrets.randbelow(2**32) if temperature != 0 else 0
    top_k = _int(body, "top_k")
    try:
        options = GenerateOptions(
            max_new_tokens=max_tokens or 1, temperature=temperature,
            top_k=0 if top_k in (None, -1) else top_k,  # vLLM's -1: no cut
            top_p=1.0 if body.get("top_p") is None else body["top_p"], seed=seed, stop=_stop(body) or None,
            speculative=_flag(body, "speculative", True),
            num_speculative_tokens=_int(body, "num_speculative_tokens", 1))
    except DFlashError as e:  # validate's messages begin with the option they refuse
        raise ApiError(400, str(e), param_of(str(e))) from None
    return Parsed(prompt, options, max_tokens, _flag(body, "stream"), _flag(stream_options, "include_usage"),
                  _flag(body, "return_token_ids"), _flag(template, "enable_thinking"))


# The request fields that GenerateOptions and the engine check (dflash_iree/validate.py), named as
# `param` of their refusals.
OPTION_FIELDS = ("temperature", "top_k", "top_p", "seed", "stop", "num_speculative_tokens")


def param_of(message: str) -> str | None:
    """The request field a refusal's message names first (validate's messages begin with it), or None."""
    return next((f for f in OPTION_FIELDS if message.startswith(f + " ")), None)


def usage(prompt_n: int, completion_n: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_n, "completion_tokens": completion_n, "total_tokens": prompt_n + completion_n}


def timings(prompt_n: int, result, queue_s: float) -> dict:
    """llama.cpp's per-response timings, with the speculative figures of `result` (GenerationResult).

    prompt_ms: prefill and its first token to the host (the time to first token once admitted);
    predicted_n: new tokens, the first included; predicted_ms: from the first token to the last;
    predicted_per_second: the tokens after the first over predicted_ms; queue_ms: waiting for a
    stream; draft_n: draft tokens verified (rounds x num_speculative_tokens); draft_n_accepted:
    those kept; tau: mean acceptance length (accepted + 1 per round); acceptance_histogram: rounds
    per tau = 1..block_size ([] for plain decoding).
    """
    n, pm, dm = len(result.tokens), result.ttft_ms, result.decode_s * 1e3
    return {"prompt_n": prompt_n, "prompt_ms": pm, "prompt_per_second": prompt_n / pm * 1e3 if pm > 0 else 0.0,
            "predicted_n": n, "predicted_ms": dm, "predicted_per_second": result.decode_tok_s,
            "queue_ms": queue_s * 1e3, "draft_n": len(result.accepted) * (result.block_size - 1),
            "draft_n_accepted": sum(result.accepted), "rounds": len(result.accepted), "tau": result.tau_mean,
            "acceptance_histogram": result.histogram}


def completion(kind: str, rid: str, model: str, text: str, token_ids: list[int] | None, finish_reason: str | None,
               extra: dict) -> dict:
    """A whole (non-streamed) response of `kind`; `extra` adds usage and timings."""
    choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice], **extra}


def chunk(kind: str, rid: str, model: str, text: str | None, token_ids: list[int] | None,
          finish_reason: str | None = None, role: bool = False, extra: dict | None = None,
          choices: bool = True) -> dict:
    """One server-sent event's object; `role`: chat's first chunk (delta.role); `choices` False:
    the usage chunk of include_usage (choices [])."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": []}
    if choices:
        c = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if kind == "chat":
            c["delta"] = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        else:
            c["text"] = text or ""
        if token_ids is not None:
            c["token_ids"] = token_ids
        out["choices"] = [c]
    return out | (extra or {})
