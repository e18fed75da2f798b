"""Compiled programs kept between runs of the commands (JAX's persistent compilation cache).

Every ``python -m moejax.*`` command compiles its programs afresh: the default model's generation spends half its
4.4 s of start-up compiling, an offloaded server far more (its prompt programs, every decode stage). With the
cache a second run loads them from disk instead. The commands turn it on (``enable``) unless the user chose:

- ``MOEJAX_COMPILE_CACHE=off`` (or ``0``, ``no``, ``false``): no cache;
- ``MOEJAX_COMPILE_CACHE=/a/folder``: that folder;
- ``JAX_COMPILATION_CACHE_DIR`` (JAX's own setting) or ``jax.config.jax_compilation_cache_dir``: left as it is;
- otherwise ``$XDG_CACHE_HOME/moejax/xla/<machine>`` (``~/.cache`` without XDG_CACHE_HOME), at most
  ``MAX_BYTES`` (least recently used entries evicted, where the ``filelock`` package is installed).

``<machine>`` names the CPU architecture and a digest of its instruction-set flags: XLA's CPU programs are
compiled for the host's instruction set while JAX's cache key names only the platform ("cpu"), so a home
folder shared between an AVX-512 and an AVX2-only machine must not hand one the other's programs. The library
(``moejax.load`` and the rest of the API) never turns the cache on by itself: that is the caller's choice.
"""

from __future__ import annotations

import hashlib
import os
import platform

import jax

ENV = "MOEJAX_COMPILE_CACHE"
OFF = ("0", "off", "no", "false")
MAX_BYTES = 2 << 30
MIN_COMPILE_SECONDS = 0.1  # programs that compile faster than this are not worth a file


def machine_tag() -> str:
    """``<arch>-<digest of the CPU's feature flags>`` (Linux ``/proc/cpuinfo``; the processor name elsewhere)."""
    features = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    features = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return f"{platform.machine() or 'unknown'}-{hashlib.sha256(features.encode()).hexdigest()[:12]}"


def default_folder() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moejax", "xla", machine_tag())


def enable() -> str | None:
    """Turn the persistent compilation cache on for this process as the module docstring says, before anything
    compiles. Returns the folder in use, or None (turned off, or no writable folder: the command then runs as
    it would without, compiling everything)."""
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in OFF:
        return None
    own = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if own:
        return own
    folder = os.path.abspath(os.path.expanduser(choice)) if choice else default_folder()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK | os.X_OK):
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and _has_filelock():
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder


def _has_filelock() -> bool:
    try:
        import filelock  # noqa: F401  - JAX needs it to evict
    except ImportError:
        return False
    return True
