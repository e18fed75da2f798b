"""``python -m moejax.serve``: an OpenAI-compatible server whose expert cache is one live state that every
request shares, as it would be on the device.

    pip install -e ".[serve]"
    python -m moejax.serve --model default [--routing cache-prior --lam 0.5] [--cache-size 0.5]
                           [--offload --bandwidth-gbps 2] [--host 127.0.0.1] [--port 8000] [--max-queue 16]
                           [--api-key KEY | MOEJAX_API_KEY=KEY] [--cors-origins http://localhost:3000]

Endpoints (OpenAI's shapes; every failure is OpenAI's error object with status 400, 401, 403, 404, 408, 413,
415, 429 or 500). What a web page could send is refused before any route runs (``serve_access``: loopback
Host names only when bound to loopback, no foreign Origin unless --cors-origins lists it, JSON bodies only);
with a key, every route but /health and the dashboard page needs ``Authorization: Bearer KEY``:

  GET  /health                    {"status": "ok", "busy", "queued"}

  GET  /v1/models                 the served model (its id: the --model argument, or --served-name)
  POST /v1/completions            prompt (text or token ids), max_tokens (16), temperature, top_p, top_k,
                                  repetition_penalty, seed, stop, stream (+ stream_options.include_usage);
                                  sampling fields left out take the checkpoint's generation_config.json
                                  settings (--generation-config none: greedy)
  POST /v1/chat/completions       messages through the checkpoint's chat template (a plain "role: content"
                                  template when it has none); max_tokens (256, capped at the context left)
  GET  /metrics                   Prometheus text: requests, tokens, time to first token and tokens/s
                                  histograms, queue, cache hits/misses/loads/bytes moved, per MoE layer
  GET  /v1/moejax/cache           the cache as JSON: residency per layer, the last request's hits and misses
                                  per expert, lifetimes, totals since start
  GET  /                          a dashboard: a prompt box that streams, and a live heat map of the cache

Every routing / cache / miss / prefetch / offload option of ``generate`` sets the server's policy and
cache; a cache is always simulated (N/2 per layer, LRU, original routing unless told otherwise), so the
counters are there to watch. A request may override the routing policy (not the cache) with an extra body
field ``"moejax": {"routing": "cache-prior", "lam": 0.3}`` (keys: routing, lam, top_j, max_rank, cumsum_p,
prune_h, delta). Responses carry an extra ``"moejax"`` field: the request's own cache counters and why it
stopped.

One engine runs batch 1: requests wait in one first-come-first-served queue (at most ``--max-queue`` waiting:
the next gets 429). A streaming client that disconnects frees the engine at the next decode chunk. Prompts
are prefilled in power-of-two pieces and the KV cache is bucketed (``decode.generate(bucketed=True)``), so
a new prompt length costs no compilation once its pieces have been seen.
"""

# no `from __future__ import annotations`: FastAPI reads the route annotations (Request) at run time

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid

from moejax.base import collector, commands, compile_cache, errors, seeds, templates
from moejax.base.typecheck import is_integer, is_number
from moejax.models import hub
from moejax.experts import routing as routing_lib, trace as trace_lib
from moejax.runtime import api, cli_options, decode, offload as offload_lib
from moejax.runtime import sampling as sampling_lib
from moejax.runtime.serve_access import API_KEY_ENV, Access, AccessGuard, access_from_args
from moejax.runtime.serve_engine import ROUTING_OVERRIDE_KEYS, Engine, Job, RequestError


# ------------------------------------------------------------------------------------------------ requests


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    if not is_number(value) or (integer and not float(value).is_integer()):
        raise RequestError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", param=key)
    if not (lo <= value <= hi):  # NaN fails too
        raise RequestError(f"'{key}' must be in [{lo}, {hi}], got {value!r}", param=key)
    return int(value) if integer else float(value)


def _top_k(body: dict) -> int | None:
    """A request's ``top_k``: vLLM's -1 (and 0) mean off; None when not sent."""
    value = _number(body, "top_k", None, -1, 2**31 - 1, integer=True)
    return None if value is None else max(value, 0)


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or a list of up to 4 non-empty strings", param="stop")
    return tuple(stop)


#: request fields the engine takes only at a neutral value: field -> (neutral values, why); the sampling
#: extensions other servers (vLLM, llama.cpp) accept are here too: a client that sends them expects an effect
_ONE_SEQUENCE = "the engine runs one sequence per request"
_NO_PENALTY = "moejax.serve applies no penalty but 'repetition_penalty'"
_SAMPLING = "moejax.serve samples with 'temperature', 'top_p', 'top_k', 'repetition_penalty' and 'seed' only"
NEUTRAL_ONLY = {"n": ((1,), _ONE_SEQUENCE), "best_of": ((1,), _ONE_SEQUENCE),
                "use_beam_search": ((False,), _ONE_SEQUENCE), "length_penalty": ((1,), _ONE_SEQUENCE),
                "frequency_penalty": ((0,), _NO_PENALTY), "presence_penalty": ((0,), _NO_PENALTY),
                "dry_multiplier": ((0,), _NO_PENALTY), "min_p": ((0,), _SAMPLING), "typical_p": ((1,), _SAMPLING),
                "tfs_z": ((1,), _SAMPLING), "mirostat": ((0,), _SAMPLING), "mirostat_mode": ((0,), _SAMPLING),
                "xtc_probability": ((0,), _SAMPLING),
                "min_tokens": ((0,), "generation ends at the end-of-sequence token, 'stop' or 'max_tokens'"),
                "ignore_eos": ((False,), "generation ends at the model's end-of-sequence token"),
                "stop_token_ids": (([],), "give stop strings ('stop')"),
                "include_stop_str_in_output": ((False,), "the text ends before a stop string"),
                "skip_special_tokens": ((True,), "special tokens are left out of the text")}

#: fields that change the output and that the engine does not do at all (refused unless empty or false)
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias", "prompt_logprobs",
               "n_probs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar", "json_schema",
               "logits_processors")


def _is_neutral(value, neutrals: tuple) -> bool:
    """``value`` is one of ``neutrals``, a bool only where a bool is meant (``True == 1`` in Python)."""
    return any((isinstance(value, bool) == isinstance(n, bool)) and value == n for n in neutrals)


def _unsupported(body: dict) -> None:
    """Refuse what the engine does not do rather than silently ignore it."""
    for key, (neutrals, why) in NEUTRAL_ONLY.items():
        if body.get(key) is not None and not _is_neutral(body[key], neutrals):
            shown = " or ".join(json.dumps(n) for n in neutrals)
            raise RequestError(f"'{key}' must be {shown} or absent: {why}", param=key)
    for key in UNSUPPORTED:
        if body.get(key):
            raise RequestError(f"'{key}' is not supported by moejax.serve", param=key)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("'response_format' is not supported by moejax.serve (only {\"type\": \"text\"})",
                           param="response_format")


#: the largest request body read: a context of 128k tokens is well under 1 MiB of text
MAX_BODY_BYTES = 8 << 20
#: seconds a client has to send its whole request body (``--request-timeout``)
BODY_TIMEOUT_S = 30.0
#: the status of a request whose client went away before its answer (nginx's "client closed request")
CLIENT_CLOSED = 499

#: the numeric routing overrides: (low, high, integer); the model checks K-dependent bounds after these
OVERRIDE_RANGES = {"lam": (-1e6, 1e6, False), "top_j": (0, 1024, True), "max_rank": (0, 1024, True),
                   "cumsum_p": (0.0, 1.0, False), "prune_h": (0, 1024, True), "delta": (0.0, 1e6, False)}


def _routing_override(body: dict, served_kind: str = "original") -> dict | None:
    extra = body.get("moejax")
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise RequestError("'moejax' must be an object, e.g. {\"routing\": \"cache-prior\", \"lam\": 0.3}",
                           param="moejax")
    unknown = sorted(set(extra) - set(ROUTING_OVERRIDE_KEYS))
    if unknown:
        raise RequestError(f"'moejax' has unknown keys {unknown}; allowed: {list(ROUTING_OVERRIDE_KEYS)}",
                           param="moejax")
    if all(v is None for v in extra.values()):  # {}: the server's own policy
        return None
    kind = extra.get("routing") or served_kind  # parameters alone adjust the server's own policy
    if extra.get("routing") is not None and (kind not in routing_lib.KINDS or kind == "learned-prior"):
        raise RequestError(f"'moejax.routing' must be one of {[k for k in routing_lib.KINDS if k != 'learned-prior']}"
                           f", got {kind!r}", param="moejax.routing")
    out = {"routing": kind}
    for key, (lo, hi, integer) in OVERRIDE_RANGES.items():
        if extra.get(key) is None:
            continue
        if kind not in cli_options.ROUTING_PARAMS[key][1]:
            raise RequestError(f"'moejax.{key}' only applies to routing {' / '.join(cli_options.ROUTING_PARAMS[key][1])}"
                               f", not {kind!r}", param=f"moejax.{key}")
        out[key] = _number(extra, key, None, lo, hi, integer)
    return out



# ------------------------------------------------------------------------------------------------ the API


def continuation_text(model: api.Model, prefix_ids: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``prefix_ids`` (so that prompt + text reads right: the space between them
    included), or the text of ``ids`` alone when rendering the two together changes the prefix."""
    if prefix_ids:
        before, full = model.text(prefix_ids), model.text(list(prefix_ids) + list(ids))
        if full.startswith(before):
            return full[len(before):]
    return model.text(ids)


class TextDeltas:
    """Streamed text: the rendered text of all new tokens so far, handing out only what cannot change any
    more (held back: trailing whitespace, a partial UTF-8 character, and a tail that could start a stop
    string)."""

    def __init__(self, model: api.Model, stop: tuple[str, ...], prefix_ids: list[int] = ()):
        self.model, self.stop, self.prefix, self.ids, self.sent = model, stop, list(prefix_ids), [], ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def text(self) -> str:
        return decode.cut_at_stops(continuation_text(self.model, self.prefix, self.ids), self.stop)

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        full = continuation_text(self.model, self.prefix, self.ids)
        cut = decode.cut_at_stops(full, self.stop)
        stable = cut if len(cut) < len(full) else full[:max(0, len(full) - self.hold)]
        stable = stable.rstrip().rstrip("\ufffd")
        return self._advance(stable)

    def finish(self) -> str:
        return self._advance(self.text())

    def _advance(self, stable: str) -> str:
        if not stable.startswith(self.sent) or len(stable) <= len(self.sent):
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta


FINISH_REASON = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "context_length": "length",
                 "cancelled": "stop"}


class Server:
    """Request parsing and responses around an ``Engine`` (no web framework in here: ``create_app`` wires
    these to routes)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.model = engine.model
        self.created = int(time.time())

    @property
    def context(self) -> int:
        return self.model.cfg.max_position_embeddings

    @property
    def text_budget(self) -> int:
        """The most characters a prompt's text can have and still fit the context (each token stands for at most
        ``max_token_bytes`` bytes, hence characters): a longer one is refused before the work of tokenising it."""
        return self.context * self.model.tokenizer.max_token_bytes

    def check_text_size(self, chars: int, param: str) -> None:
        if chars > self.text_budget:
            raise RequestError(f"the prompt has {chars:,} characters: more than this model's context of "
                               f"{self.context} tokens can hold (a token here stands for at most "
                               f"{self.model.tokenizer.max_token_bytes} bytes)", param=param,
                               code="context_length_exceeded")

    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise RequestError(f"'model' must be a string, got {name!r}", param="model")
        if name != self.engine.name:
            raise RequestError(f"the model {name!r} does not exist; this server serves {self.engine.name!r}",
                               status=404, param="model", code="model_not_found")

    def models(self) -> dict:
        tok = self.model.tokenizer
        return {"object": "list", "data": [{
            "id": self.engine.name, "object": "model", "created": self.created, "owned_by": "moejax",
            "context_length": self.context, "n_experts": self.model.cfg.n_experts, "top_k": self.model.cfg.top_k,
            "chat_template": "checkpoint" if tok is not None and tok.chat_template else api.PLAIN_CHAT}]}

    def chat_prompt(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}]
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string", param="messages")
            clean.append({"role": m["role"], "content": content})
        if self.model.tokenizer is None:
            raise RequestError(f"{self.engine.name} has no tokenizer: use /v1/completions with token ids")
        self.check_text_size(sum(len(m["content"]) for m in clean), "messages")
        try:
            return self.model.chat_ids(clean, max_chars=self.text_budget)
        except templates.TemplateTooLong:
            raise RequestError(f"the chat template's text for these messages is over {self.text_budget:,} "
                               f"characters: more than this model's context of {self.context} tokens can hold",
                               param="messages", code="context_length_exceeded") from None
        except errors.Failure as e:  # the checkpoint's template is broken, slow or greedy: not the request's fault
            raise RequestError(str(e), status=500) from None
        except ValueError as e:  # the template refused the messages
            raise RequestError(str(e), param="messages") from None

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' is empty", param="prompt")
            if self.model.tokenizer is None:
                raise RequestError(f"{self.engine.name} has no tokenizer: send 'prompt' as a list of token ids",
                                   param="prompt")
            self.check_text_size(len(prompt), "prompt")
            return self.model.encode(prompt)
        if isinstance(prompt, list) and prompt and all(is_integer(t) for t in prompt):
            V = self.model.cfg.vocab_size
            if min(prompt) < 0 or max(prompt) >= V:
                raise RequestError(f"token ids must be in 0..{V - 1}", param="prompt")
            return list(prompt)
        raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")

    def job(self, body: dict, chat: bool) -> Job:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        self.check_model(body)
        _unsupported(body)
        if chat:
            ids = self.chat_prompt(body.get("messages"))
        else:
            if "prompt" not in body:
                raise RequestError("'prompt' is required", param="prompt")
            ids = self.completion_prompt(body["prompt"])
        if len(ids) >= self.context:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model's context is {self.context} tokens "
                               "and at least one must be left to generate", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
        room = self.context - len(ids)
        if not chat and body.get("max_completion_tokens") is not None:  # a chat field: here it was ignored
            raise RequestError("'max_completion_tokens' belongs to /v1/chat/completions; completions take 'max_tokens'",
                               param="max_completion_tokens")
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, min(256, room) if chat else 16, 1, self.context, integer=True)
        if max_tokens > room:
            raise RequestError(f"{key} = {max_tokens} does not fit: the prompt takes {len(ids)} of the "
                               f"{self.context} positions ({room} left)", param=key, code="context_length_exceeded")
        sampling, _ = sampling_lib.resolve_sampling(
            {"temperature": _number(body, "temperature", None, 0.0, 2.0),
             "top_p": _number(body, "top_p", None, 1e-6, 1.0), "top_k": _top_k(body),
             "repetition_penalty": _number(body, "repetition_penalty", None, 1e-6, 100.0)},
            self.engine.sampling_defaults)
        return Job(prompt_ids=ids, max_tokens=max_tokens, **sampling,
                   seed=_number(body, "seed", 0, seeds.SEED_MIN, seeds.SEED_MAX, integer=True),  # all 64 bits count
                   stop=self.stop_strings(body), routing=_routing_override(body, self.engine.policy.kind))

    def stop_strings(self, body: dict) -> tuple[str, ...]:
        stop = _stop_strings(body)
        if stop and self.engine.model.tokenizer is None:
            raise RequestError("this model has no tokenizer: its output is token ids, and stop strings would "
                               "match their decimal digits", param="stop")
        return stop

    def response(self, chat: bool, rid: str, result: dict, text: str) -> dict:
        n_gen = len(result["token_ids"])
        usage = {"prompt_tokens": result["prompt_tokens"], "completion_tokens": n_gen,
                 "total_tokens": result["prompt_tokens"] + n_gen}
        finish = FINISH_REASON[result["stopped"]]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.engine.name, "choices": [choice], "usage": usage, "moejax": self.extension(result)}

    @staticmethod
    def extension(result: dict) -> dict:
        return trace_lib.json_safe({k: result[k] for k in ("stopped", "cache", "time_to_first_token_s",
                                                           "prefill_time_s", "tokens_per_s", "compile_time_s",
                                                           "queued_s", "token_ids")})

    def chunk(self, chat: bool, rid: str, delta: str | None, finish: str | None, first: bool = False) -> dict:
        if chat:
            d = {} if delta is None else {"content": delta}
            if first:
                d["role"] = "assistant"
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.engine.name, "choices": [choice]}


def create_app(engine: Engine, dashboard_html: str | None = None, access: Access = Access(),
               body_timeout_s: float = BODY_TIMEOUT_S):
    """The FastAPI application over ``engine`` (``pip install -e '.[serve]'``), behind ``access``'s rules."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import ClientDisconnect

    server = Server(engine)
    app = FastAPI(title="moejax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(AccessGuard, access=access)
    if access.cors_origins:  # outside the guard: it answers the allowed origins' preflights
        app.add_middleware(CORSMiddleware, allow_origins=list(access.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])

    def error(e: RequestError, endpoint: str) -> JSONResponse:
        engine.telemetry.count(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        e = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
        return JSONResponse(e.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # never a traceback to the client
        e = RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500)
        return JSONResponse(e.body(), status_code=500)

    async def read_raw(request: Request) -> bytearray:
        raw = bytearray()
        async for part in request.stream():  # read up to the limit, never a whole oversized body
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise RequestError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB", status=413)
        return raw

    async def read_body(request: Request) -> dict:
        try:  # a sender that never finishes its body must not hold a connection and a task for ever
            raw = await asyncio.wait_for(read_raw(request), body_timeout_s)
        except ClientDisconnect:  # the client went away mid-body: answered (to no one) instead of a traceback
            raise RequestError("the client disconnected before sending the whole body") from None
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {body_timeout_s:g} s", status=408,
                               code="request_timeout") from None
        try:
            body = json.loads(bytes(raw) or b"null")
        except ValueError as e:  # bad JSON or UTF-8, an integer of over 4300 digits
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError("the request body is nested too deeply") from None
        try:  # "\ud800" escapes parse to lone surrogates, which no tokenizer can encode
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("the request body holds a lone UTF-16 surrogate escape: not text") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    async def disconnected(request: Request) -> None:
        """Returns when the client of ``request`` (its body already read) disconnects."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - the connection is unusable: as good as gone
            return

    async def generate(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await read_body(request)
            job = await asyncio.to_thread(server.job, body, chat)  # tokenising a long prompt: off the event loop
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError(f"'stream' must be true or false, got {stream!r}", param="stream")
            options = body.get("stream_options")
            if options is not None and not (isinstance(options, dict)
                                            and isinstance(options.get("include_usage", False), bool)):
                raise RequestError("'stream_options' must be an object like {\"include_usage\": true}",
                                   param="stream_options")
            include_usage = bool((options or {}).get("include_usage", False))
        except RequestError as e:
            return error(e, endpoint)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        def emit(kind, payload):
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
                pass

        job.emit = emit
        try:
            engine.submit(job)
        except RequestError as e:
            return error(e, endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]

        if not stream:
            gone = asyncio.ensure_future(disconnected(request))
            try:
                while True:
                    getter = asyncio.ensure_future(events.get())
                    await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():  # nobody waits for the answer any more: stop generating it
                        getter.cancel()
                        job.cancelled.set()
                        engine.telemetry.count(endpoint, CLIENT_CLOSED)
                        return Response(status_code=CLIENT_CLOSED)
                    kind, payload = getter.result()
                    if kind == "done":
                        break
                    if kind == "error":
                        raise payload
            except asyncio.CancelledError:
                job.cancelled.set()
                raise
            except RequestError as e:
                return error(e, endpoint)
            except Exception as e:  # noqa: BLE001 - the model failed (e.g. non-finite routing): 500, server lives
                return error(RequestError(f"generation failed: {e}", status=500), endpoint)
            finally:
                gone.cancel()
            text = decode.cut_at_stops(continuation_text(engine.model, [] if chat else job.prompt_ids,
                                                         payload["token_ids"]), job.stop)
            engine.telemetry.count(endpoint, 200)
            return JSONResponse(server.response(chat, rid, payload, text))

        async def sse():
            deltas = TextDeltas(engine.model, job.stop, [] if chat else job.prompt_ids)
            first = True
            try:
                if chat:
                    yield _sse(server.chunk(chat, rid, "", None, first=True))
                    first = False
                while True:
                    kind, payload = await events.get()
                    if kind == "tokens":
                        delta = deltas.add(payload)
                        if delta:
                            yield _sse(server.chunk(chat, rid, delta, None, first=first))
                            first = False
                    elif kind == "error":
                        e = payload if isinstance(payload, RequestError) else RequestError(
                            f"generation failed: {payload}", status=500)
                        engine.telemetry.count(endpoint, e.status)
                        yield _sse(e.body())
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        deltas.ids = list(payload["token_ids"])
                        rest = deltas.finish()
                        final = server.chunk(chat, rid, rest or None, FINISH_REASON[payload["stopped"]])
                        final["moejax"] = server.extension(payload)
                        yield _sse(final)
                        if include_usage:
                            n = len(payload["token_ids"])
                            usage = {"prompt_tokens": payload["prompt_tokens"], "completion_tokens": n,
                                     "total_tokens": payload["prompt_tokens"] + n}
                            yield _sse({**server.chunk(chat, rid, None, None), "choices": [], "usage": usage})
                        yield "data: [DONE]\n\n"
                        engine.telemetry.count(endpoint, 200)
                        return
            finally:  # the client went away (or we are done): a running generation stops at its next chunk
                job.cancelled.set()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(server.models())

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != engine.name:
            e = RequestError(f"the model {name!r} does not exist; this server serves {engine.name!r}", status=404,
                             param="model", code="model_not_found")
            return JSONResponse(e.body(), status_code=404)
        return JSONResponse(server.models()["data"][0])

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/moejax/cache")
    async def cache():
        return JSONResponse(engine.cache_view())

    @app.get("/")
    async def dashboard():
        return HTMLResponse(dashboard_html if dashboard_html is not None else _dashboard_html())

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "busy": engine.busy, "queued": engine.queued})

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _dashboard_html() -> str:
    from importlib import resources

    return resources.files("moejax").joinpath("assets/serve/dashboard.html").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------ the command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("serve"), description=__doc__,
                                formatter_class=commands.HelpFormatter)
    p.add_argument("--model", default=api.DEFAULT_MODEL_NAME,
                   help="moejax or Hugging Face checkpoint folder, or 'default' (the embedded model)")
    p.add_argument("--served-name", default=None, help="the model id clients send (default: the --model argument)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype (default: stored)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; then only requests addressed "
                        "to localhost, 127.0.0.1 or [::1] are served)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and the dashboard page "
                        f"(default: ${API_KEY_ENV} if set; prefer the variable: a command line is visible to "
                        "other users of the machine)")
    p.add_argument("--cors-origins", default=None, metavar="ORIGINS",
                   help="comma-separated origins (e.g. http://localhost:3000) whose pages may call the server from "
                        "a browser, or '*' (default: none but the server's own dashboard)")
    p.add_argument("--request-timeout", type=float, default=BODY_TIMEOUT_S, metavar="SECONDS",
                   help=f"seconds a client has to send its request body (default {BODY_TIMEOUT_S:g})")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait (the next one gets 429)")
    p.add_argument("--warmup", type=int, default=0, metavar="TOKENS",
                   help="before listening, compile everything prompts up to TOKENS tokens need (with up to 256 "
                        "new tokens), so no request waits for XLA (default 0: compile on first use; a few "
                        "seconds per program on a CPU; the compilation cache, MOEJAX_COMPILE_CACHE, keeps them across "
                        "restarts)")
    p.add_argument("--warmup-new-tokens", type=int, default=256, metavar="N",
                   help="the most new tokens a request the warm-up prepares for may ask (default 256)")
    cli_options.add_generation_config_arg(p, "sampling fields a request leaves out")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    cli_options.add_weight_args(p)
    cli_options.add_routing_args(p)
    cli_options.add_offload_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.warmup_new_tokens < 1:
        raise ValueError(f"--warmup-new-tokens must be >= 1, got {args.warmup_new_tokens}")
    if args.served_name is not None and not args.served_name.strip():
        raise ValueError("--served-name is empty")
    if not 0 < args.request_timeout <= 86400:  # NaN fails too
        raise ValueError(f"--request-timeout must be in (0, 86400] seconds, got {args.request_timeout}")


def check_model_arg(model: str) -> None:
    """A ``--model`` path that does not exist: one error line before listening (the model loads after)."""
    if model != api.DEFAULT_MODEL_NAME and not hub.repo_of(model) and not os.path.isdir(model):
        raise errors.Failure(f"--model {model}: no such folder (a moejax or Hugging Face checkpoint folder, a hub "
                             "id org/name, or 'default')")


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a busy port or a bad ``--host`` is one error line
    before any wait (not after loading, behind a line saying where it serves), and with ``--port 0`` the
    line says the port the system chose."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise errors.UsageError(f"--host {host!r} is not an address of this machine: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn sets: restart at once
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise errors.Failure(f"could not listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def build_engine(args: argparse.Namespace) -> Engine:
    offload = cli_options.offload_from_args(args)
    model = api.load(args.model, offload=offload, dtype=args.dtype, **cli_options.weight_kwargs(args))
    policy = cli_options.policy_from_args(args, model.cfg.top_k)
    cache = cli_options.cache_from_args(args, model, offload)  # a bad --cache-size fails here, before the start
    if offload is not None:  # as generate refuses it: at the start, not as a 500 on every request
        offload_lib.check_cache(model.cfg, cache.capacity(model.cfg), cache.eviction)
    served = {k: getattr(args, k) for k in ROUTING_OVERRIDE_KEYS[1:] if getattr(args, k, None) is not None}
    return Engine(model, policy, cache, offload, args.max_queue, args.served_name or args.model, served,
                  cli_options.checkpoint_sampling(args, model))


class Startup:
    """The server from the moment it listens: until the engine is ready, ``/health`` answers 503 with what the
    server is doing (loading the model, compiling: k of n shapes) and every other route 503 ``not_ready``;
    then everything goes to the application (``create_app``). A supervisor, a load balancer or a user's
    ``curl`` sees a live server that says when it will serve, instead of refused connections."""

    def __init__(self, access: Access):
        self.access, self.app, self.engine, self.error = access, None, None, None
        self.started = time.monotonic()
        self.status, self.detail = "loading", "loading the model"
        self.stopping = threading.Event()

    def set(self, status: str, detail: str) -> None:
        self.status, self.detail = status, detail

    def health(self) -> dict:
        return {"status": self.status, "detail": self.detail,
                "elapsed_s": round(time.monotonic() - self.started, 1)}

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        return await AccessGuard(self._not_ready, self.access)(scope, receive, send)

    async def _not_ready(self, scope, receive, send):
        if scope["path"] == "/health":
            body = self.health()
        else:
            body = RequestError(f"the server is not ready: {self.detail} ({self.health()['elapsed_s']:.0f} s so "
                                "far); /health says when it is", status=503, code="not_ready").body()
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                                (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": raw})


def _prepare(args: argparse.Namespace, startup: Startup, server) -> None:
    """The loader thread: load the model, warm up, then open the application; a failure stops the server
    (``main`` reports it)."""
    try:
        t0 = time.monotonic()
        engine = startup.engine = build_engine(args)
        loaded = time.monotonic() - t0
        if args.warmup:
            def progress(done: int, total: int) -> None:
                startup.set("compiling", f"compiling for prompts up to {args.warmup} tokens: {done} of {total} "
                                         "shapes")
                print(f"moejax.serve: {startup.detail} ({time.monotonic() - startup.started:.0f} s)",
                      file=sys.stderr, flush=True)

            engine.warm_up(args.warmup, args.warmup_new_tokens, progress=progress, stop=startup.stopping.is_set)
        if startup.stopping.is_set():
            return
        startup.app = create_app(engine, access=startup.access, body_timeout_s=args.request_timeout)
        startup.set("ok", "ready")
        print(f"moejax.serve: ready after {time.monotonic() - startup.started:.1f} s (loading {loaded:.1f} s"
              + (f", warm-up {time.monotonic() - t0 - loaded:.1f} s" if args.warmup else "") + ")",
              file=sys.stderr, flush=True)
    except errors.HANDLED as e:
        startup.error = e
        startup.set("failed", str(e))
        server.should_exit = True
    except BaseException as e:  # noqa: BLE001 - an unexpected failure must stop the server too, not leave it 503
        startup.error = errors.Failure(f"loading failed: {type(e).__name__}: {e}")
        startup.set("failed", str(startup.error))
        server.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    compile_cache.enable()
    collector.for_compiling()
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        print("error: moejax.serve needs its extra: pip install -e '.[serve]' (FastAPI and uvicorn)",
              file=sys.stderr)
        return errors.FAILURE
    try:  # what can be checked without the model, before listening
        check_args(args)
        access = access_from_args(args.host, args.api_key, args.cors_origins)
        cli_options.offload_from_args(args)
        cli_options.cache_from_args(args)
        sock = listening_socket(args.host, args.port)  # a busy port first: that is what a restart meets
    except errors.HANDLED as e:
        return errors.report(e)
    try:
        check_model_arg(args.model)
    except errors.HANDLED as e:
        sock.close()
        return errors.report(e)
    startup = Startup(access)
    config = uvicorn.Config(startup, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off")
    server = _server_class()(config, startup)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"moejax.serve: {args.served_name or args.model} on http://{host}:{sock.getsockname()[1]} (/health says "
          "when it is ready; Ctrl-C stops)", file=sys.stderr, flush=True)
    loader = threading.Thread(target=_prepare, args=(args, startup, server), name="moejax-loader", daemon=True)
    # uvicorn catches SIGINT/SIGTERM, stops accepting, closes open streams, then raises the signal again
    # with the handlers it found: these, which end the run here with status 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_serving)
    try:
        loader.start()
        server.run(sockets=[sock])
    except _Stopped:
        pass
    except SystemExit:  # uvicorn exits during startup when it cannot listen
        print(f"error: could not listen on {args.host}:{args.port}", file=sys.stderr)
        return errors.FAILURE
    finally:
        sock.close()
        startup.stopping.set()
        _finish(startup, loader)
    if startup.error is not None:
        return errors.report(startup.error)
    return 0


#: seconds uvicorn waits for open requests after Ctrl-C / SIGTERM (a running generation is answered 503 after
#: ``serve_engine.ABANDON_AFTER_S`` if it has not ended by then)
GRACEFUL_SHUTDOWN_S = 5
#: seconds the stopping server then waits for a compilation in progress before it exits without it
COMPILE_WAIT_S = 5.0


def _finish(startup: Startup, loader: threading.Thread) -> None:
    """Let the loader and the engine's worker end before the interpreter does: a thread still inside an XLA
    compilation when Python exits aborts the process (status 134, "terminate called ..."). A compilation cannot
    be interrupted, so the server waits for it, but at most ``COMPILE_WAIT_S`` (a supervisor's SIGTERM must stop
    the server within seconds): then, or at a second Ctrl-C, it exits at once, without the interpreter's
    teardown."""
    templates.close()

    def done(timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        loader.join(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return not loader.is_alive() and (startup.engine is None or startup.engine.close(timeout=left))

    if done(2.0):
        return
    print(f"moejax.serve: waiting up to {COMPILE_WAIT_S:g} s for the compilation in progress to finish "
          "(Ctrl-C again exits now) ...", file=sys.stderr, flush=True)
    try:
        if done(COMPILE_WAIT_S):
            return
        print("moejax.serve: stopped without waiting for the compilation", file=sys.stderr, flush=True)
        status = errors.report(startup.error) if startup.error is not None else 0
    except _Stopped as e:
        status = 128 + e.args[0]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which on Ctrl-C / SIGTERM first cancels the engine's generations: open streams then
        end with their last chunk and [DONE] within the graceful-shutdown wait instead of being cut off."""

        def __init__(self, config, gate: Startup):
            super().__init__(config)
            self.gate = gate  # not "startup": uvicorn.Server has a method of that name

        def handle_exit(self, sig, frame):
            self.gate.stopping.set()  # a warm-up in progress ends after its current program
            if self.gate.engine is not None:
                self.gate.engine.cancel_all()
            templates.close()  # a chat template being rendered stops now, and its request is answered
            super().handle_exit(sig, frame)

    return Server


class _Stopped(Exception):
    """Raised by the signal handler once uvicorn has shut down (see ``main``)."""


def _stop_serving(signum, frame):  # noqa: ARG001 - the signal handler signature
    raise _Stopped(signum)


if __name__ == "__main__":
    sys.exit(main())
