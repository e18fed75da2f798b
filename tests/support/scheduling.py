"""The order CI's two xdist workers take the test files in: the heaviest first."""

from __future__ import annotations

import collections

#: Seconds each test file's slow tests took in CI's two passes together (CI's machine: AMD EPYC, 2 cores,
#: ``--durations``: tests of 2 s or more in the main pass, 1 s or more in the numerics pass), for the order below;
#: ``QUICK_TEST_SECONDS`` for each of its tests stands for the many quick ones. Refresh when a file's share
#: changes a lot.
FILE_SECONDS = {
    "test_hf_parity.py": 210, "test_offload.py": 171, "test_layout.py": 167, "test_simulate.py": 129,
    "test_generate.py": 95, "test_serve.py": 84, "test_column_blocks.py": 76, "test_prior.py": 67,
    "test_overlap.py": 67, "test_train.py": 64, "test_sampling.py": 63, "test_scale.py": 55,
    "test_default_model.py": 55, "test_distributed.py": 47, "test_int8.py": 45, "test_routing.py": 44,
    "test_attention.py": 41, "test_studies.py": 37, "test_tasks.py": 35, "test_hub.py": 30, "test_sweep.py": 24,
    "test_trace.py": 23, "test_compile_cache.py": 22, "test_full_disk.py": 21, "test_evaluate.py": 20,
    "test_convert.py": 20, "test_cache.py": 18, "test_cache_memory.py": 16, "test_plots.py": 15,
    "test_prefill_paging.py": 15, "test_quant.py": 14, "test_page_writes.py": 14, "test_dispatch.py": 13,
    "test_random_checkpoint.py": 12, "test_serve_access.py": 95, "test_signals.py": 45, "test_output_paths.py": 20,
    "test_safetensors_headers.py": 10, "test_templates.py": 5,
}


QUICK_TEST_SECONDS = 0.35


def heaviest_files_first(items) -> None:
    """Sort pytest ``items`` by their file's weight (``FILE_SECONDS`` + ``QUICK_TEST_SECONDS`` a test), each file's
    tests in their own order."""
    tests = collections.Counter(item.path.name for item in items)
    items.sort(key=lambda item: -(FILE_SECONDS.get(item.path.name, 0) + QUICK_TEST_SECONDS * tests[item.path.name]))
