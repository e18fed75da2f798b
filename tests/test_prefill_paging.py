"""Batched offloaded prefill (``moejax.runtime.prefill_paging``): the plan of what each layer pages, its rounds,
and the programs it compiles.

The plan is checked against the real cache: random router logits routed through a one-layer cache (any
capacity, empty or random start, with or without prefetch) give the slot tables before and after a piece and
the experts its tokens use; the plan must compute every used expert exactly once, from a buffer that holds it
at that moment, leave the slots as the cache says, and never page more than the token-by-token cache loads.
End-to-end equality with the simulation (tokens, routing, bytes) is in test_offload.py and test_scale.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moejax.experts import cache as cache_lib, routing as routing_lib
from moejax.experts.router import route_tokens
from moejax.models.gating import SoftmaxTopK
from moejax.runtime import prefill_paging
from moejax.runtime.prefill_paging import plan_layer, round_ids, rounds

T, N, K = 20, 8, 2


@functools.partial(jax.jit, static_argnames=("prefetch",))
def _route(z, z_pred, cs, rs, policy, prefetch: bool):
    gating = SoftmaxTopK(n_experts=N, top_k=K, normalize=False)
    experts, _, _, cs, rs = route_tokens(z, 0, cs, rs, policy, gating, z_pred=z_pred if prefetch else None)
    return experts, cs


def routed_piece(seed: int, capacity: int, init: str, prefetch: bool, lam: float):
    """(slot table before [N], after [N], experts [T, K], loads + prefetch loads) of a piece of T tokens."""
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(size=(T, N)) * 3, jnp.float32)
    z_pred = z + jnp.asarray(rng.normal(size=(T, N)), jnp.float32)  # a noisy prediction
    cs = cache_lib.init_cache(1, N, capacity, "layer", "lru", init, seed,
                              prefetcher=cache_lib.PrefetchConfig(1.0 if prefetch else 0.0))
    policy = routing_lib.make_policy("cache-prior", K, lam=lam)
    experts, after = _route(z, z_pred, cs, routing_lib.init_routing_state(1), policy, prefetch)
    made = int(after.stats.loads[0] + after.stats.prefetch_loads[0])
    return np.asarray(cs.slot[0]), np.asarray(after.slot[0]), np.asarray(experts), made


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(K, N), init=st.sampled_from(["empty", "random"]),
       prefetch=st.booleans(), lam=st.sampled_from([0.0, 0.5, 2.0]), staging=st.integers(1, 3))
# found by CI's draw: nothing to load and more streamed experts than one staging round holds (the second
# round was marked "after the loads" all the same)
@example(seed=1496, capacity=2, init="random", prefetch=False, lam=0.0, staging=1)
def test_plan_computes_every_used_expert_once_from_a_buffer_holding_it(seed, capacity, init, prefetch, lam, staging):
    before, after, experts, made = routed_piece(seed, capacity, init, prefetch, lam)
    plan = plan_layer(before, after, experts)
    used = set(np.unique(experts[experts >= 0]).tolist())

    # the slots' contents as the rounds run: start as before, loads written when the plan says
    slot_content = {int(s): e for e, s in enumerate(before) if s >= 0}
    computed = []
    loaded = 0
    for in_slots, streamed, after_loads in rounds(plan, staging):
        if after_loads:
            loaded += 1
            for e, s in plan.loads:
                slot_content[s] = e
        assert len(streamed) <= staging
        for e, s in in_slots.items():
            assert slot_content[s] == e  # read from a slot that holds it now
        computed += list(in_slots) + list(streamed)
        ids = round_ids(experts, in_slots, streamed, capacity, N)
        for (t, k), e in np.ndenumerate(experts):  # every assignment of this round's experts, none other
            mine = e in in_slots or e in streamed
            assert (ids[t, k] >= 0) == (e >= 0 and mine)
            if ids[t, k] >= 0:
                assert ids[t, k] == (in_slots[e] if e in in_slots else capacity + streamed.index(e))
    assert loaded == (1 if plan.loads else 0)
    assert sorted(computed) == sorted(used)  # each used expert exactly once
    assert slot_content == {int(s): e for e, s in enumerate(after) if s >= 0}  # the slots end as the cache says
    assert plan.pages <= made  # never more than the token-by-token cache moved


def test_plan_of_a_piece_whose_experts_all_stay_resident_pages_nothing():
    before = np.array([0, -1, 1, -1])
    plan = plan_layer(before, before, np.array([[0, 2], [2, -1]]))
    assert plan.pages == 0 and plan.resident == {0: 0, 2: 1}
    assert rounds(plan, 2) == [({0: 0, 2: 1}, (), False)]


def test_an_expert_moved_to_another_slot_is_computed_from_its_old_slot_and_paged_into_its_new_one():
    before = np.array([0, 1, -1])  # expert 0 in slot 0, expert 1 in slot 1
    after = np.array([1, -1, 0])  # 0 was evicted and reloaded into slot 1; 2 took slot 0
    plan = plan_layer(before, after, np.array([[0, 2], [1, 0]]))
    assert plan.resident == {0: 0, 1: 1} and plan.paged == {2: 0} and plan.streamed == ()
    assert sorted(plan.loads) == [(0, 1), (2, 0)]
    (first, _, load_first), (second, _, load_second) = rounds(plan, 1)
    assert first == {0: 0, 1: 1} and not load_first and second == {2: 0} and load_second


@pytest.mark.parametrize("n,bucketed,expected", [(37, True, [32, 4, 1]), (37, False, [37]),
                                                 (1100, False, [512, 512, 76]), (1100, True, [512, 512, 64, 8, 4])])
def test_prefill_pieces(n, bucketed, expected):
    assert prefill_paging.prefill_pieces(n, bucketed) == expected


def test_batched_prefill_falls_back_to_tokens_where_the_cache_couples_tokens():
    plain = cache_lib.init_cache(2, N, 3)
    assert prefill_paging.batched_prefill_supported(plain) is None
    assert "global" in prefill_paging.batched_prefill_supported(cache_lib.init_cache(2, N, 3, "global"))
    cascade = cache_lib.init_cache(2, N, 3, miss=cache_lib.MissConfig("cascade", (1,), (8,)))
    assert "cascade" in prefill_paging.batched_prefill_supported(cascade)


def test_the_warm_up_compiles_every_program_the_timed_prompt_runs(monkeypatch):
    """Time to first token measures the model: every program of the batched prefill is compiled before the
    clock starts (``HostPager.compile_prefill``: lowered from committed shapes, so the calls hit the cache)."""
    import moejax
    from support.hf_models import get_hf_model
    from support.programs import compile_events
    from moejax.runtime import host_paging
    from moejax.runtime.simulate import CacheConfig

    folder = get_hf_model("olmoe_clip").folder
    m = moejax.load(folder, offload="flash")  # pages read from the files straight into the serving layout
    marks = []
    real = host_paging.storage_read_bytes
    prompt, cache = np.arange(3, 70, dtype=np.int32), CacheConfig(size="7", prefetch=1.0)
    with compile_events() as compiles:  # a prompt length and cache size no other test uses: these programs are new
        # storage_read_bytes is read when the clock starts and when the prompt is done (decode starts)
        monkeypatch.setattr(host_paging, "storage_read_bytes", lambda: (marks.append(len(compiles)), real())[1])
        out = m.generate(prompt, 3, stop_at_eos=False, cache=cache, routing="cache-prior")
    assert out.stats["offload"]["prefill"] == "batched" and out.stats["offload"]["prefill_pages"] > 0
    assert out.stats["offload"]["store"] == "flash" and m._stores and next(iter(m._stores.values())).reads_serving
    assert marks[0] > 0  # the warm-up compiled
    assert compiles[marks[0]:marks[1]] == []  # the prompt compiled nothing
    # a long prompt (several staging rounds per layer, 16 experts top-4 in 7 slots): the simulation's tokens
    ref = moejax.load(folder).generate(prompt, 3, stop_at_eos=False, cache=cache, routing="cache-prior")
    assert out.token_ids == ref.token_ids
    np.testing.assert_array_equal(out.trace()["experts"], ref.trace()["experts"])
    assert out.stats["cache"]["misses"] == ref.stats["cache"]["misses"]


def test_pages_are_read_exactly_from_the_files(tmp_path):
    """``SafetensorsFile.read`` (what a flash store pages with) gives the mapped tensor's bytes, into a given
    buffer too; a flash store over Hugging Face files reads a page straight into the serving layout
    (``gate_up`` = gate rows then up rows, ``down`` as stored), also through its background reads."""
    import ml_dtypes

    import moejax
    from support.hf_models import get_hf_model
    from moejax.models import safetensors_io
    from moejax.runtime import expert_store

    rng = np.random.default_rng(0)
    tensors = [("a", rng.normal(size=(5, 7)).astype(ml_dtypes.bfloat16)), ("b", rng.integers(-9, 9, (3, 4), np.int8))]
    safetensors_io.write(str(tmp_path / "t.safetensors"), tensors, {})
    f = safetensors_io.SafetensorsFile(str(tmp_path / "t.safetensors"))
    for key, want in tensors:
        got = f.read(f.get(key))
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    both = np.zeros((10, 7), ml_dtypes.bfloat16)
    f.read(f.get("a"), both[5:])
    assert both[5:].tobytes() == tensors[0][1].tobytes() and not both[:5].astype(np.float32).any()
    with pytest.raises(ValueError, match="read into"):
        f.read(f.get("a"), both[:, :3])
    # GPT-OSS's gate and up are alternate columns of one [D, 2F] block: strided views read exactly too
    a = f.get("a")
    for view in (a[:, 0::2], a[1:4, 1::2], a[2]):
        got = f.read(view)
        assert got.tobytes() == np.ascontiguousarray(view).tobytes()
        into = np.zeros(view.shape, view.dtype)
        f.read(view, into)
        assert into.tobytes() == got.tobytes()

    m = moejax.load(get_hf_model("qwen3_moe").folder, offload="flash")
    store = expert_store.ExpertStore(m.params, m.cfg, "flash")
    assert store.reads_serving
    store.prefetch(1, [3, 0], serving=True)  # read in the background
    for e in (3, 0, 5):  # 5 was not announced: read on the spot
        gate_up, down = store.get(1, e, serving=True)
        plain = store.get(1, e)
        np.testing.assert_array_equal(gate_up, np.concatenate([plain["gate"], plain["up"]]))
        np.testing.assert_array_equal(down, plain["down"])
