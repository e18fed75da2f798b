"""The Python API: ``model = moejax.load(path)``; ``model.forward(ids)``; ``model.generate(...)``."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import distributed, memory as host_memory, seeds, templates, textproc
from moejax.base.errors import Failure
from moejax.base.typecheck import is_integer, is_number
from moejax.models import assets, checkpoint, gating, layout as layout_lib, weights
from moejax.models import config as config_lib
from moejax.models.config import ModelConfig
from moejax.models.model import forward as model_forward, selection_biases as layer_selection_biases
from moejax.models.attention import init_kv
from moejax.experts import cache as cache_lib, routing as routing_lib
from moejax.experts import capacity as capacity_lib
from moejax.runtime import (decode, expert_store, host_paging, jit_paging, offload as offload_lib, prefill_paging,
                            simulate)
from moejax.runtime import sampling as sampling_lib
from moejax.runtime.decode import CHUNK as DECODE_CHUNK  # a default inside Model, whose decode() hides the module

DEFAULT_MODEL_NAME = assets.DEFAULT_MODEL_NAME  # "default": the embedded model, in every command
ROUTER_STATE_KEYS = frozenset({"cache", "routing", "policy"})  # simulate.init_router_state
resolve_model_path = assets.resolve_model_path


@dataclasses.dataclass
class Output:
    """What ``Model.forward`` returns (numpy arrays)."""

    logits: np.ndarray  # [T, vocab]
    router_logits: np.ndarray  # [moe_layers, T, n_experts]
    experts: np.ndarray  # [moe_layers, T, K] chosen expert ids, highest weight first
    weights: np.ndarray  # [moe_layers, T, K] their mixing weights
    hits: np.ndarray | None = None  # [moe_layers, T, K] bool, when a cache is simulated
    stats: dict | None = None  # cache metrics (simulate.summarize), when a cache is simulated
    state: Any = None  # router state after the pass: pass it as ``state=`` to carry the cache over


class Tokenizer:
    """A ``tokenizer.json`` (HF ``tokenizers``) plus the chat template of ``tokenizer_config.json``."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer as _Tok

        path = os.path.join(folder, "tokenizer.json")
        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # the tokenizers library raises its own Exception type for a damaged file
            raise checkpoint.CheckpointError(f"{path} is not a tokenizers file: {e}") from None
        self.config: dict[str, Any] = {}
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(path):
            self.config = checkpoint.read_json_object(path, "a tokenizer configuration")
        self.chat_template = self.config.get("chat_template")
        self.chat_template_path = path
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            try:
                with open(jinja, encoding="utf-8") as f:
                    self.chat_template = f.read()
            except UnicodeDecodeError as e:
                raise checkpoint.CheckpointError(f"{jinja} is not UTF-8 text: {e}") from None
            self.chat_template_path = jinja

    @functools.cached_property
    def digest(self) -> str:
        """sha1 of the vocabulary, normalisation and merges, and of the chat template and configuration."""
        h = hashlib.sha1(self._tok.to_str().encode())
        h.update(json.dumps(self.config, sort_keys=True, default=str).encode())
        h.update((self.chat_template or "").encode())
        return h.hexdigest()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8 on the command line
            raise ValueError(f"the text is not valid UTF-8 (at character {len(text.encode('utf-8', 'ignore'))}): "
                             f"{text[:40]!r}") from None
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _special(self, name: str) -> str:
        value = self.config.get(name)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            max_chars: int = templates.MAX_CHARS) -> str:
        """The messages through the checkpoint's chat template, rendered in a bounded child process
        (``templates``: an untrusted template may loop); a text over ``max_chars`` is refused while it grows."""
        if not self.chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja); drop --chat")
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))
        try:
            return templates.render(self.chat_template, variables, max_chars=max_chars)
        except templates.TemplateSyntaxError as e:
            raise checkpoint.CheckpointError(f"{self.chat_template_path}: the chat template is not valid Jinja "
                                             f"(line {e.line}: {e})") from None
        except templates.TemplateRefused as e:  # raise_exception(...) in the template: it refuses these messages
            raise ValueError(f"the chat template of {self.chat_template_path} refused the messages: {e}") from None
        except templates.TemplateBudgetError as e:
            raise checkpoint.CheckpointError(f"the chat template of {self.chat_template_path} {e}") from None

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's text can stand for (its vocabulary's longest entry): a text of B bytes
        has at least B / this many tokens, which bounds a prompt before the work of tokenising it."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward_original(params, cfg: ModelConfig, tokens):
    return model_forward(params, cfg, tokens)


def check_output(cfg: ModelConfig, router_logits, logits=None) -> None:
    """``gating.NonFiniteError`` naming the layer when a pass's router logits (or logits) are NaN/inf."""
    gating.check_finite(router_logits, "router logits", cfg)
    if logits is not None:
        gating.check_finite(np.asarray(logits)[None], "output logits", layer_names=["the LM head"])


#: what a checkpoint without a chat template gets (``Model.chat_ids``)
PLAIN_CHAT = "role: content lines, then 'assistant:'"


class Model:
    """A loaded MoE model: parameters, configuration and (when the folder has one) a tokenizer."""

    def __init__(self, params: dict, cfg: ModelConfig, tokenizer: Tokenizer | None = None,
                 path: str | None = None, generation_config: dict | None = None,
                 offload: "offload_lib.OffloadConfig | None" = None):
        self.params, self.cfg, self.tokenizer, self.path = params, cfg, tokenizer, path
        self.generation_config = generation_config or {}
        self.offload = offload  # the default of forward/generate: a model loaded for offload pages its experts
        self._stores: dict = {}  # expert stores built for this model (a host store reads the experts once)

    def _offload(self, offload):
        """The offload settings of a call: its own (``False``: none), else the model's; refuses to simulate
        a model whose experts were left in the files (that would read them all onto the device)."""
        offload = None if offload is False else offload_config(offload) if offload is not None else self.offload
        if offload is not None and self.offload is None and _int8_experts_in_memory(self.params):
            raise ValueError("this model holds its routed experts as int8 in memory (expert_dtype='int8'), and "
                             "offloading it per call would page dequantised copies (3-4x the bytes its cache "
                             "statistics count): load it for offload instead, moejax.load(path, "
                             "expert_dtype='int8', offload=...)")
        if offload is not None and self.offload is not None and self.offload.slot_dtype != offload.slot_dtype:
            offload = dataclasses.replace(offload, slot_dtype=self.offload.slot_dtype)  # as loaded (int8 experts)
        if offload is None and weights.has_lazy_experts(self.params):
            raise ValueError("this model was loaded with offload (moejax.load(path, offload=...)): its routed "
                             "experts are in the checkpoint files, not on the device; pass offload=... to this "
                             "call, or load the model without offload to simulate")
        return offload

    @property
    def selection_biases(self) -> np.ndarray | None:
        """The MoE layers' selection biases [L, N] float32 on the host (the ``e_score_correction_bias`` of
        DeepSeek-V3, GLM-4.5, dots.llm1 and ERNIE-4.5: added to the scores experts are chosen by, never to their
        weights); None for the other families."""
        b = layer_selection_biases(self.params, self.cfg)
        return None if b is None else np.asarray(b)

    @property
    def fingerprint(self) -> str:
        """What keys results: ``checkpoint.params_fingerprint`` of the weights (cached per params object) with
        the configuration, generation settings and tokenizer, so that a sweep resumed after any of them changed
        at the same path (an edited ``config.json``: another rope, gating or top-k) recomputes its points."""
        cached = getattr(self, "_fingerprint", None)
        if cached is None or cached[0] is not self.params:
            cached = self._fingerprint = (self.params, checkpoint.params_fingerprint(self.params))
        h = hashlib.sha1(cached[1].encode())
        h.update(repr(self.cfg).encode())  # every field that defines the computation (not the verbatim HF dict)
        h.update(json.dumps(self.generation_config, sort_keys=True, default=str).encode())
        h.update((self.tokenizer.digest if self.tokenizer is not None else "no tokenizer").encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        c = self.cfg
        return (f"Model({c.model_type}, layers={c.num_layers}, moe_layers={c.n_moe_layers}, "
                f"experts={c.n_experts}, top_k={c.top_k}, path={self.path!r})")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            return self.cfg.eos_token_ids
        return config_lib.eos_token_ids_of(eos, "generation_config.json")

    @property
    def sampling_defaults(self) -> dict:
        """The decoding this checkpoint's ``generation_config.json`` recommends (``sampling_lib.sampling_defaults``:
        e.g. ``{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}``; empty: greedy).
        ``generate`` decodes greedily unless told: ``model.generate(ids, **model.sampling_defaults)`` decodes as
        transformers' ``generate`` would, and the command line and the server start from these."""
        return sampling_lib.sampling_defaults(self.generation_config)

    def _ids(self, token_ids, name: str) -> np.ndarray:
        """``token_ids`` checked, as int32: a non-empty 1-D sequence of integers in the vocabulary (floats,
        bools, strings and ids past int32 were silently truncated or wrapped)."""
        if isinstance(token_ids, (str, bytes)):
            raise ValueError(f"{name} must be token ids, got text {token_ids!r}: encode it first (model.encode)")
        try:
            ids = np.asarray(token_ids)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name} must be a 1-D sequence of token ids: {e}") from None
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"{name} must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must be integers, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)][0]
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        return ids.astype(np.int32)

    def _tokens(self, token_ids) -> jax.Array:
        ids = self._ids(token_ids, "token_ids")
        self.cfg.check_context(len(ids), "a sequence of length")
        return jnp.asarray(ids)

    def _policy(self, routing):
        policy = routing_lib.as_policy(routing, self.cfg.top_k)
        routing_lib.check_policy_layers(policy, self.cfg.n_moe_layers)  # a per-layer Δ or prior of another model
        return policy

    def cached_expert_bytes(self, offload=None) -> int:
        """Bytes one cached expert occupies: a device slot's when offloading (``offload``, else the model's own
        setting; int8 slots count their scales), otherwise the routed expert as it is held in memory."""
        offload = self._offload(offload) if offload is not False else None
        if offload is None:
            return simulate.expert_bytes(self.params, self.cfg)
        return expert_store.slot_nbytes(self.cfg, self.params["embed"].dtype, offload.slot_dtype == "int8")

    def resolve_cache(self, cache: "simulate.CacheConfig | None", offload=None, tokens: int | None = None,
                      shrink_to_fit: bool = False, logits_rows: int = 0) -> "simulate.CacheConfig | None":
        """``cache`` with its size as a count of experts per layer (global: in the pool) for this model.

        A memory size ("6GiB") becomes the count it holds (``cached_expert_bytes``). When offloading, "auto" is
        the most slots the memory left can hold (``memory_plan``: the device's, on the CPU the process's
        cgroup or the machine's) beside a KV cache of ``tokens`` positions; a size whose slots cannot fit
        there is refused with the count that would — or, with ``shrink_to_fit`` (a default the user did not
        choose), replaced by it with a note on stderr. Counts and fractions are checked against N."""
        if cache is None:
            return None
        if not isinstance(cache, simulate.CacheConfig):
            raise TypeError(f"cache must be a simulate.CacheConfig (e.g. CacheConfig(size={str(cache)!r})), got "
                            f"{type(cache).__name__} {cache!r}")
        offload = self._offload(offload) if offload is not False else None
        spec = str(cache.size).strip()
        if spec.lower() == "auto":
            if offload is None:
                raise ValueError("cache size 'auto' sizes the device slots of an offloaded model (--offload, "
                                 "offload=...); a simulation holds every expert: give a count, a fraction of N "
                                 "or a memory size")
            return self._fit_slots(cache, offload, tokens, "auto", logits_rows)
        if capacity_lib.parse_byte_size(spec) is not None:
            count = cache.capacity(self.cfg, self.cached_expert_bytes(offload))
            cache = dataclasses.replace(cache, size=str(count), memory=spec)
        cache.capacity(self.cfg)
        if offload is not None and not cache.fit_checked:
            cache = self._fit_slots(cache, offload, tokens, "shrink" if shrink_to_fit else "check", logits_rows)
        return cache

    def memory_plan(self, cache: "simulate.CacheConfig", offload, tokens: int | None = None,
                    logits_rows: int = 0) -> dict | None:
        """What an offloaded run has and needs, in bytes: ``headroom`` (what the device can still allocate,
        ``where`` that limit comes from), ``fixed`` (KV cache of ``tokens`` positions, prompt staging, a host
        store not read yet when the device is the host, the float32 logits of ``logits_rows`` positions a
        teacher-forced pass returns (and one prompt piece's, made before they are copied in), and ``reserve``:
        ``offload.reserve_bytes``, the runtime's and the prompt's working memory; a size given is held to
        ``prompt_reserve``, the prompt's alone), ``slot`` (one slot) and ``slot_set`` (one slot in every layer,
        or one in a global pool). None when the device does not say its free memory."""
        offload = self._offload(offload)
        if offload is None or not isinstance(cache, simulate.CacheConfig):
            raise TypeError("memory_plan(cache, offload) plans an offloaded run: cache must be a simulate.CacheConfig "
                            f"and offload an offload.OffloadConfig (or True), got cache={cache!r}, offload={offload!r}")
        free = device_headroom()
        if free is None:
            return None
        headroom, where = free
        device = distributed.local_device()
        slot = self.cached_expert_bytes(offload)
        positions = min(tokens or offload_lib.DEFAULT_FIT_POSITIONS, self.cfg.max_position_embeddings)
        kv = expert_store.tree_nbytes(jax.eval_shape(lambda: init_kv(self.cfg, positions, self.params["embed"].dtype)))
        staging = self.cfg.top_k * slot if offload.paging == "host" else 0
        reserve = offload_lib.reserve_bytes(positions, self.cfg.hidden_size)
        prompt_reserve = offload_lib.reserve_bytes(positions, self.cfg.hidden_size, runtime=False)
        logits = (logits_rows + min(logits_rows, prefill_paging.MAX_PIECE)) * self.cfg.vocab_size * 4
        store = 0
        if (device.platform == "cpu" and offload.store == "host" and weights.has_lazy_experts(self.params)
                and not self._stores):  # the host store will read every expert into this memory
            store = self.cfg.n_moe_layers * self.cfg.n_experts * simulate.expert_bytes(self.params, self.cfg)
        # pages read in place into column-blocked slots, or into int8 slots from a 16-bit folder (quantised on the
        # host), pass through one page buffer the store keeps, of the page's stored dtype
        quantising = offload.slot_dtype == "int8" and not any(
            weights.is_int8_stack(x) for x in weights.leaves(self.params))
        scratch = 0
        if device.platform == "cpu" and offload.store == "flash" and (expert_store.blocked_slots(self.cfg)
                                                                      or quantising):
            scratch = expert_store.slot_nbytes(self.cfg, self.params["embed"].dtype,
                                               offload.slot_dtype == "int8" and not quantising)
        return {"headroom": headroom, "where": where, "kv_cache": kv, "staging": staging, "host_store": store,
                "page_scratch": scratch, "logits": logits, "reserve": reserve, "prompt_reserve": prompt_reserve,
                "fixed": kv + staging + store + scratch + logits + reserve,
                "slot": slot, "slot_set": capacity_lib.slot_sets(self.cfg.n_moe_layers, cache.scope) * slot}

    def _fit_slots(self, cache, offload, tokens, mode: str, logits_rows: int = 0):
        """``resolve_cache``'s memory check (``mode``: "auto", "check", "shrink")."""
        plan = self.memory_plan(cache, offload, tokens, logits_rows)
        if plan is None:
            if mode == "auto":
                raise ValueError("cache size 'auto' needs to know the free memory, and this device does not say: "
                                 "give a count, a fraction of N or a memory size")
            return dataclasses.replace(cache, fit_checked=True)
        gb = host_memory.format_bytes
        limit = capacity_lib.capacity_limit(self.cfg.n_experts, self.cfg.n_moe_layers, cache.scope)
        fit = offload_lib.slots_that_fit(plan["headroom"], plan["fixed"], plan["slot_set"], limit)
        store_note = (f"; the host store's own copy of every expert needs {gb(plan['host_store'])} of that "
                      "(--expert-store flash reads them from the checkpoint instead)" if plan["host_store"] else "")
        per = "per layer" if cache.scope == "layer" else "in the pool"
        smaller = ("" if offload.slot_dtype == "int8" else
                   "; int8 slots (--expert-dtype int8) take about half the bytes")
        if mode == "auto":
            if fit < self.cfg.top_k:
                least = plan["fixed"] + self.cfg.top_k * plan["slot_set"]
                raise ValueError(f"cache size 'auto': {plan['where']} leaves {gb(plan['headroom'])}, and slots for "
                                 f"K={self.cfg.top_k} experts {per} need {gb(least)} with the KV cache, staging and "
                                 f"a {gb(plan['reserve'])} reserve{store_note}{smaller}")
            return dataclasses.replace(cache, size=str(fit), memory="auto", fit_checked=True)
        count = cache.capacity(self.cfg)
        # a size given is held to the prompt's part of the reserve (without it a long prompt was OOM-killed:
        # C = 9 under 8 GiB with 1,024 prompt tokens), not the runtime's margin (C = 4 ran under 5.75 GiB with
        # 8 tokens; docs/benchmarks.md#the-reserve); a default size keeps all of it
        reserve, reserved_for = ((plan["prompt_reserve"], "prompt") if mode == "check"
                                 else (plan["reserve"], "runtime and the prompt"))
        need = count * plan["slot_set"] + plan["fixed"] - plan["reserve"] + reserve  # ``fixed`` holds all of it
        k = self.cfg.top_k
        # what auto, which also keeps the runtime's margin, makes of the same memory
        keeps = f"--cache-size auto keeps {gb(plan['reserve'] - plan['prompt_reserve'])}"
        picks = f"picks {fit}" if fit >= k else f"finds room for {fit}, fewer than K={k}"
        if need <= plan["headroom"]:
            if mode == "check" and count > fit:
                # inside the runtime's margin: ran under 12 GiB (ERNIE-4.5-21B, C = 14 of auto's 13), thrashed
                # under 1.5 GiB (Granite-1B, C = 14 of auto's 7); where it lands depends on the budget's size
                sys.stderr.write(f"note: a cache of {count} experts {per} leaves {gb(plan['headroom'] - need)} of "
                                 f"what {plan['where']} leaves; {keeps} for the runtime and {picks}: under a small "
                                 "budget a size this close can thrash (compiling and paging need room too)\n")
            return dataclasses.replace(cache, fit_checked=True)
        if mode == "shrink" and fit >= k:
            sys.stderr.write(f"note: a cache of {count} experts {per} needs {gb(need)} and {plan['where']} leaves "
                             f"{gb(plan['headroom'])}: using {fit} (--cache-size auto)\n")
            return dataclasses.replace(cache, size=str(fit), memory="auto", fit_checked=True)
        # the sizes this check lets through (held to the same reserve as this one), and auto's, which also keeps
        # the runtime's margin: Granite-1B under 1.5 GiB ran at C = 8 (auto: 7), thrashed at C = 14 (this check: 14)
        given_fit = offload_lib.slots_that_fit(plan["headroom"], plan["fixed"] - plan["reserve"] + reserve,
                                               plan["slot_set"], limit)
        if given_fit == fit and fit >= k:
            hint = f"--cache-size auto picks {fit}"
        elif given_fit >= k:
            hint = (f"sizes up to {given_fit} pass this check, which keeps no margin for the runtime; {keeps} and "
                    f"{picks}" + (smaller if fit < k else ""))
        else:
            hint = f"not even K={k} fit{smaller}"
        raise ValueError(f"cache size {cache.memory or cache.size!r} needs {gb(need)} ({count} slots {per} of "
                         f"{gb(plan['slot'])}, the KV cache, staging and a {gb(reserve)} reserve for the "
                         f"{reserved_for}), but {plan['where']} leaves {gb(plan['headroom'])}{store_note}: {hint}")

    def cache_memory_bytes(self, cache: "simulate.CacheConfig", offload=None) -> int:
        """What the cached experts occupy when the cache is full: capacity × (L per-layer sets, or one pool)
        × ``cached_expert_bytes``."""
        one = self.cached_expert_bytes(offload)
        return cache.capacity(self.cfg, one) * capacity_lib.slot_sets(self.cfg.n_moe_layers, cache.scope) * one

    def router_state(self, routing=None, cache: "simulate.CacheConfig | None" = None, offload=None,
                     tokens: int | None = None, logits_rows: int = 0) -> dict:
        """A fresh router state for ``routing`` (policy or kind name) and ``cache`` (default: N/2 LRU, when
        offloading at most what memory holds); sizes resolved by ``resolve_cache`` for ``offload`` (default:
        the model's own setting) and a run of ``tokens`` positions (``logits_rows`` of them returned)."""
        cache = self.resolve_cache(cache or simulate.CacheConfig(), offload, tokens, shrink_to_fit=cache is None,
                                   logits_rows=logits_rows)
        return simulate.init_router_state(self.cfg, self._policy(routing), cache, self.selection_biases)

    def _resolve_state(self, routing, cache, state: dict | None, offload, tokens: int | None = None,
                       logits_rows: int = 0) -> dict:
        """``state`` carried over (with ``routing``'s policy swapped in, if given), or a fresh one."""
        if state is None:
            return self.router_state(routing, cache, False if offload is None else offload, tokens, logits_rows)
        if not (isinstance(state, dict) and set(state) >= ROUTER_STATE_KEYS
                and isinstance(state["cache"], cache_lib.CacheState)):
            raise TypeError("state must be a router state that this library made (an Output's .state, a "
                            "GenerateResult's .router_state, Model.router_state(...)), got "
                            + (f"a dict with keys {sorted(state)}" if isinstance(state, dict) else type(state).__name__))
        cs = state["cache"]
        if cs.resident.shape != (self.cfg.n_moe_layers, self.cfg.n_experts):
            raise ValueError(f"state is another model's: its cache has {cs.resident.shape[0]} MoE layers of "
                             f"{cs.resident.shape[1]} experts, this model {self.cfg.n_moe_layers} of "
                             f"{self.cfg.n_experts}")
        if cache is not None:
            raise ValueError("give cache= or state=, not both: a carried-over state has its cache already")
        return state if routing is None else {**state, "policy": self._policy(routing)}

    def forward(self, token_ids, *, routing=None, cache=None, state: dict | None = None,
                sequential: bool | None = None, offload=None, route_on_host: bool | None = None) -> Output:
        """Teacher-forced pass over ``token_ids`` (1-D).

        With no ``routing``/``cache``/``state``: the architecture's own routing, no cache. Otherwise the
        routing policy (``routing.make_policy(...)`` or a kind name) runs against a simulated expert cache
        (``simulate.CacheConfig``; default N/2 per layer, LRU), starting from ``state`` when given (e.g.
        ``previous_output.state``: the cache carried over from the previous sequence, statistics
        accumulating). Per-layer caches take the layer-parallel path, global ones the token-sequential
        path (``sequential=True`` forces it; both give the same result for per-layer caches).
        ``route_on_host`` (default: when the model is on an accelerator) runs each layer's routing scan on the
        host CPU between the accelerator's layer programs (``simulate.forward_routed_on_host``): the same
        routing and statistics; on a GPU the scan's per-token steps cost far less there.

        ``offload`` (``offload.OffloadConfig``): the experts live in host memory and each token's misses are
        paged into device slots for real (host-driven; a layer at a time over the whole pass with
        ``OffloadConfig(prefill="batched")``, the default, or token by token with ``prefill="token"``: the same
        result); ``stats["offload"]`` has the
        bytes moved, transfer time and device memory."""
        tokens = self._tokens(token_ids)
        for name, flag in (("sequential", sequential), ("route_on_host", route_on_host)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be True, False or None, got {flag!r}")
        offload = self._offload(offload)
        if offload is not None:
            if offload.paging != "host":
                raise ValueError("forward pages a teacher-forced pass on the host (OffloadConfig(paging='host'), "
                                 "batched a layer at a time or prefill='token'); paging='jit' pages generate's "
                                 "decode loop")
            state = self._resolve_state(routing, cache, state, offload, len(tokens), logits_rows=len(tokens))
            out = host_paging.host_forward(self.params, self.cfg, np.asarray(tokens), state, offload, self._stores)
            check_output(self.cfg, out["router_logits"], out["logits"])
            stats = simulate.summarize(out["router_state"], self.params, self.cfg)
            stats["offload"] = out["offload"]
            return Output(out["logits"], out["router_logits"], out["experts"], out["weights"], out["hits"], stats,
                          out["router_state"])
        if routing is None and cache is None and state is None:
            out = _forward_original(self.params, self.cfg, tokens)
            check_output(self.cfg, out.router_logits, out.logits)
            return Output(np.asarray(out.logits), np.asarray(out.router_logits), np.asarray(out.experts),
                          np.asarray(out.weights))

        state = self._resolve_state(routing, cache, state, offload)
        out = simulate.forward_with_cache(self.params, self.cfg, tokens, state, sequential, route_on_host)
        check_output(self.cfg, out.router_logits, out.logits)
        return Output(np.asarray(out.logits), np.asarray(out.router_logits), np.asarray(out.experts),
                      np.asarray(out.weights), np.asarray(out.records["hits"]),
                      simulate.summarize(out.router_state, self.params, self.cfg), out.router_state)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer.json: pass token ids (--prompt-ids) instead of text")
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids)

    def chat_ids(self, messages: list[dict], max_chars: int = templates.MAX_CHARS) -> list[int]:
        """The token ids of ``messages`` ([{"role", "content"}], text contents) for the model to answer: its
        chat template, or, for a checkpoint without one (the default model), ``PLAIN_CHAT``: one
        "role: content" line per message, then "assistant:" (what the server and ``generate --chat`` share)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer.json, so there is no text to template: pass token ids")
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise TypeError(f"messages must be a non-empty list of {{'role': str, 'content': str}}, got {messages!r}")
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, max_chars=max_chars)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")

    def text(self, ids) -> str:
        """``ids`` as text for a reader: decoded, with WikiText spacing undone for wikitext-style models."""
        raw = self.decode(ids)
        return textproc.wikitext_detokenize(raw) if textproc.is_wikitext_style(self.generation_config) else raw

    def generate(self, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, repetition_penalty: float = 1.0, seed: int = 0, stop_at_eos: bool = True,
                 on_tokens=None, chunk: int = DECODE_CHUNK,
                 routing=None, cache=None, state: dict | None = None,
                 prefill_routing=None, offload=None, stop=(), cancelled=None,
                 bucketed: bool = False, keep_slots: bool = False, on_cache=None) -> decode.GenerateResult:
        """Prefill + scan decode: greedy unless ``temperature`` > 0 (then top-k, then top-p, as ``sampling_lib.Sampling``),
        ``repetition_penalty`` as transformers applies it; ``**model.sampling_defaults`` for the checkpoint's
        own settings. With ``routing``/``cache``/``state`` the expert cache is simulated for
        every token (prompt included) and ``result.stats["cache"]`` holds its metrics. ``prefill_routing``
        routes the prompt with another policy (e.g. "original": the policy then acts during generation
        only, as in the paper's GSM8K protocol). ``offload`` (``offload.OffloadConfig``): experts in host
        memory, misses paged into device slots for real; ``result.stats["offload"]`` has what moved.

        ``stop``: stop strings, matched on ``self.text`` of the new tokens; the tokens end with the one that
        completes the first match (``decode.cut_at_stops(model.text(ids), stop)`` is the text before it)
        and ``stats["stopped"]`` is "stop". ``cancelled()`` is polled between chunks ("cancelled").
        ``bucketed``: compile-friendly shapes for long-running callers (``decode.generate``), and one program
        for every sampling setting (``Sampling.decided_at_run_time``). ``keep_slots``
        (offload, host paging): keep the device slots for a next call that continues from ``result.
        router_state`` (``host_paging.host_generate``), as a server carrying one cache does. ``on_cache``: the
        cache as it changes (``decode.generate``; offloaded: token by token)."""
        prompt_ids = self._ids(prompt_ids, "prompt_ids")
        _check_generate_args(max_new_tokens, temperature, top_p, seed, chunk,
                             dict(on_tokens=on_tokens, cancelled=cancelled, on_cache=on_cache), top_k,
                             repetition_penalty)
        sampling = sampling_lib.Sampling(temperature, top_p, int(top_k), repetition_penalty)
        if bucketed:  # a long-running caller's requests each sample their own way: one program for all
            sampling = sampling.decided_at_run_time()
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())  # one string is one stop string
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: this model's output is token ids (their decimal "
                             "digits would be matched)")
        cfg = dataclasses.replace(self.cfg, eos_token_ids=self.eos_token_ids)
        stop = decode.Stop(stop, self.text if stop else None, cancelled)
        router = None
        offload = self._offload(offload)
        if offload is not None:
            if chunk != DECODE_CHUNK:
                raise ValueError(f"chunk= sets the steps per program of the simulated decode loop; offloaded "
                                 f"generation pages token by token (host) or in chunks of {DECODE_CHUNK} (jit): "
                                 "leave chunk at its default with offload")
            state = self._resolve_state(routing, cache, state, offload, len(prompt_ids) + max_new_tokens)
            prefill_policy = None if prefill_routing is None else self._policy(prefill_routing)
            paged_generate = host_paging.host_generate if offload.paging == "host" else jit_paging.jit_generate
            result = paged_generate(self.params, cfg, prompt_ids, state, offload,
                                    max_new_tokens=max_new_tokens, sampling=sampling,
                                    seed=seed, stop_at_eos=stop_at_eos, on_tokens=on_tokens,
                                    prefill_policy=prefill_policy, stores=self._stores, stop=stop,
                                    bucketed=bucketed, keep_slots=keep_slots, on_cache=on_cache)
            result.stats["cache"] = simulate.summarize(result.router_state, self.params, self.cfg)
            return result
        if routing is not None or cache is not None or state is not None:
            router = simulate.CacheRouter(self.cfg.gating)
            state = self._resolve_state(routing, cache, state, offload)
        prefill_policy = None if prefill_routing is None else self._policy(prefill_routing)
        if prefill_policy is not None and router is None:
            raise ValueError("prefill_routing needs routing=, cache= or state= (an expert cache)")
        result = decode.generate(self.params, cfg, prompt_ids, max_new_tokens=max_new_tokens,
                                 sampling=sampling, seed=seed,
                                 stop_at_eos=stop_at_eos, on_tokens=on_tokens, chunk=chunk, router=router,
                                 router_state=state, prefill_policy=prefill_policy, stop=stop,
                                 bucketed=bucketed, on_cache=on_cache)
        if router is not None:
            result.stats["cache"] = simulate.summarize(result.router_state, self.params, self.cfg)
        return result


def _int8_experts_in_memory(params: dict) -> bool:
    """Whether the routed experts are int8 ``ExpertList`` buffers on the device (not left in the files)."""
    for lp in params["layers"]:
        experts = lp.get("moe", {}).get("experts")
        if isinstance(experts, layout_lib.ExpertList):
            return layout_lib.is_int8(experts.gate_up[0])
    return False


def _check_generate_args(max_new_tokens, temperature, top_p, seed, chunk, callbacks: dict, top_k=0,
                         repetition_penalty=1.0) -> None:
    """``Model.generate``'s scalar and callback arguments, named when wrong (they failed deep inside, or
    were silently truncated: seed=1.5 ran as 1)."""
    for name, v in (("max_new_tokens", max_new_tokens), ("seed", seed), ("chunk", chunk), ("top_k", top_k)):
        if not is_integer(v):
            raise TypeError(f"{name} must be an integer, got {v!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    seeds.check_seed(seed)
    for name, v in (("temperature", temperature), ("top_p", top_p), ("repetition_penalty", repetition_penalty)):
        if not is_number(v):
            raise TypeError(f"{name} must be a number, got {v!r}")
    for name, f in callbacks.items():
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be a function or None, got {f!r}")


def offload_config(offload) -> "offload_lib.OffloadConfig | None":
    """``load``'s ``offload``: None/False, True (host store), a store name ("host", "flash") or a config."""
    if offload is None or offload is False:
        return None
    if offload is True:
        return offload_lib.OffloadConfig()
    if isinstance(offload, str):
        return offload_lib.OffloadConfig(store=offload)
    if isinstance(offload, offload_lib.OffloadConfig):
        return offload
    raise TypeError(f"offload must be None, True, 'host', 'flash' or an offload.OffloadConfig, got {offload!r}")


SHARDINGS = ("experts",)


class ModelTooLargeError(Failure):
    """The weights ``load`` would place do not fit in the memory the device has left."""


def device_headroom(swap: bool = False) -> tuple[int, str] | None:
    """What the device can still allocate, in bytes, and that limit in words; on the CPU the host's (machine and
    cgroups; ``swap``: free swap counts, what a process can hold without being killed however slowly). None when
    the device does not say."""
    device = distributed.local_device()
    if device.platform == "cpu":
        return host_memory.headroom(swap=swap)
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)),
            f"{device.device_kind} memory ({int(stats['bytes_limit']) / 2**30:.1f} GiB)")


def check_fits_in_memory(tree, experts: str, layout: str, quantization, path: str) -> None:
    """Refuse, before a byte is read, weights that cannot fit in what the device has left (a model larger than
    memory, loaded without offload, was read until the kernel killed the process), naming what would fit."""
    free = device_headroom(swap=True)
    if free is None:
        return
    headroom, where = free
    on_cpu = distributed.local_device().platform == "cpu"

    def need(experts, quantization) -> int:
        total, largest = weights.placed_nbytes(tree, experts, layout, quantization)
        return total + (largest if on_cpu else 0)  # on the CPU a tensor's host copy sits beside the placed one

    needed = need(experts, quantization)
    if needed <= headroom:
        return
    gb = host_memory.format_bytes
    offloaded = experts == "lazy"
    int8 = layout_lib.Quantization(experts=True, matrices=True)
    options = []
    if not offloaded and need("lazy", quantization) <= headroom:
        options.append(f"offload the routed experts (--offload; Python: moejax.load(path, offload=\"flash\")): they "
                       f"stay in the checkpoint's files and a cache of them is paged in; the rest needs "
                       f"{gb(need('lazy', quantization))}")
    if layout == "serving" and quantization != int8 and need(experts, int8) <= headroom:
        options.append(f"hold every matrix as int8 (--weight-dtype int8): {gb(need(experts, int8))}")
    if not options and layout == "serving" and need("lazy", int8) <= headroom:
        options.append(f"offload the routed experts and hold the other matrices as int8 (--offload --weight-dtype "
                       f"int8): {gb(need('lazy', int8))}")
    what = "the weights other than the routed experts" if offloaded else "the model's weights"
    raise ModelTooLargeError(f"{path}: {what} need {gb(needed)} in memory, and {where} leaves {gb(headroom)}"
                             + (": " + "; or ".join(options) if options else ": nothing moejax offers fits there"))


def text_model_folder(path: str, why: str) -> str:
    """The folder of model argument ``path`` (``resolve_model_path``: a hub id is fetched once, here), for commands
    that score text: a ``Failure`` before loading when it holds a checkpoint but no ``tokenizer.json`` (loading
    first cost the 61 GB Qwen3-30B-A3B folder 3 s and 4.8 GB to be told; a hub repository without one is refused
    before its weights are fetched). Anything else wrong with it is left to ``load``, which names it; the folder
    loads as ``path`` would."""
    folder = resolve_model_path(path, needs=("tokenizer.json",), why=why)  # a hub id: refused before its weights
    if os.path.isfile(os.path.join(folder, "config.json")) and not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise Failure(f"{path} has no tokenizer.json: {why}")
    return folder


def load(path: str, dtype=None, offload=None, layout: str = "serving", weight_dtype: str | None = None,
         expert_dtype: str | None = None, shard: str | None = None, devices: int | None = None) -> Model:
    """Load a moejax checkpoint folder, a Hugging Face folder (read in place), or ``"default"``.

    Non-expert weights go to the device one tensor at a time. Without ``offload`` the routed experts do
    too (every pass can then simulate any cache). With ``offload`` (True, "host", "flash" or an
    ``offload.OffloadConfig``) they never reach the device: they stay in the checkpoint's files, and
    forward/generate page them into the cache's device slots — from host memory (read once) or straight
    from the files' memory maps ("flash": no copy, no temporary file).

    ``layout``: "serving" (default: matrices ``[out, in]``, one buffer per expert, read in place in their
    stored dtype: see ``moejax.models.layout``) or "canonical" (``x @ W``, experts stacked: what training and the
    checkpoint formats use). Both compute the same model.

    ``weight_dtype="int8"`` holds every matrix (attention, MLPs, routed experts, LM head) as int8 with one
    scale per output row, quantised as it is placed (half the memory of bf16; decode reads half the bytes);
    ``expert_dtype`` ("int8" or "stored") overrides it for the routed experts alone. A moejax folder saved with
    int8 experts (``python -m moejax.convert ... --expert-dtype int8``) loads them int8 as stored, without
    requantising (and pages half the bytes from storage when offloading). Serving layout only;
    see ``moejax.models.layout`` for the scheme and its error bound. With ``offload`` the experts stay in the files
    and int8 experts mean int8 device slots (``offload.OffloadConfig.slot_dtype``): every page is quantised
    as it arrives (on the CPU on the host, into the slot's memory), so the cache holds twice the experts in the
    same memory.

    ``shard="experts"``: for models larger than one device, each MoE layer's experts are split over the first
    ``devices`` devices (default all; N must divide evenly), every device reading only its own experts from
    the files, the rest replicated (``moejax.base.distributed``); forward, generate and sweeps then run on all."""
    if dtype is not None:
        try:
            kind = jnp.dtype(dtype)
        except TypeError:
            raise ValueError(f"dtype {dtype!r} is not a data type (float32, bfloat16 or float16)") from None
        if kind not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError(f"dtype {dtype!r} must be a floating type JAX computes in: float32, bfloat16 or float16 "
                             "(float64 loaded float32 without a word); int8 weights are weight_dtype='int8'")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a checkpoint folder, a Hugging Face folder or 'default', got {path!r}")
    if devices is not None and (not is_integer(devices)):
        raise TypeError(f"devices must be an integer, got {devices!r}")
    path = resolve_model_path(path)
    offload = offload_config(offload)
    mesh = None
    if shard is not None:
        if shard not in SHARDINGS:
            raise ValueError(f"unknown sharding {shard!r}; expected one of {', '.join(SHARDINGS)}")
        if offload is not None:
            raise ValueError("shard='experts' spreads the experts over device memory; offload pages them into one "
                             "device: use one or the other")
        mesh = distributed.experts_mesh(devices)
    elif devices is not None:
        raise ValueError("devices= goes with shard='experts'")
    if expert_dtype in (None, "stored") and layout == "serving" and checkpoint.stored_expert_dtype(path) == "int8":
        expert_dtype = "int8"  # a folder with int8 experts keeps them int8 (the canonical layout dequantises)
    quantization = layout_lib.Quantization.from_dtypes(weight_dtype, expert_dtype)
    if quantization is not None and layout != "serving":
        raise ValueError(f"int8 weights (weight_dtype/expert_dtype) need layout='serving', got layout={layout!r}")
    if quantization is not None and quantization.experts and offload is not None:
        offload = dataclasses.replace(offload, slot_dtype="int8")  # the experts stay in the files; slots hold int8
    tree, cfg = checkpoint.open_params(path, dtype)
    experts = "lazy" if offload is not None else "device"
    if mesh is None:  # spread over devices, each holds a part (forced CPU devices share one memory)
        check_fits_in_memory(tree, experts, layout, quantization, path)
    params = weights.place(tree, experts, layout, quantization, mesh)
    folder = os.path.abspath(os.path.expanduser(path))
    tokenizer = Tokenizer(folder) if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None
    gen_path = os.path.join(folder, "generation_config.json")
    generation_config = {}
    if os.path.isfile(gen_path):
        generation_config = checkpoint.read_json_object(gen_path, "a generation configuration")
        config_lib.eos_token_ids_of(generation_config.get("eos_token_id"), gen_path)  # refused at load, not mid-run
        try:
            sampling_lib.sampling_defaults(generation_config)
        except ValueError as e:
            raise checkpoint.CheckpointError(f"{gen_path}: {e}") from None
    return Model(params, cfg, tokenizer, folder, generation_config, offload)
