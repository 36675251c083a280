#!/usr/bin/env python3
"""bench.py: Reame vs llama-server, measured side by side in one run.

    python3 bench.py                      qwen2.5-coder-1.5b, 3 repeats, streams 1,2,4,8
    python3 bench.py --quick              gemma3-270m, few tokens: a smoke test (< 1 minute)
    python3 bench.py --model PATH --threads 4 --repeats 5 --streams 1,4 --json
    python3 bench.py --no-server          Reame only (no llama-server needed)
    python3 bench.py --variants           also Reame vs itself: KV layout x weight repacking
    python3 bench.py --http               only the HTTP section: reame.py serve vs llama-server,
                                          1, 4 and 8 streaming clients (--http-clients)
    python3 bench.py --quick --http --http-clients 1,4     HTTP smoke test (1-2 minutes)
    python3 bench.py --with-http          the in-process sections, then the HTTP section
    python3 bench.py --prefix-cache       only the prefix-cache section: a ~2,400-token system prompt,
                                          TTFT cold / warm / after a restart / second process
    python3 bench.py --quick --prefix-cache                 prefix-cache smoke test (1-2 minutes)
    python3 bench.py --spec               only the speculation section: tok/s with speculation off,
                                          prompt lookup on, the draft model on, and auto, on three
                                          workloads, idle and with a CPU burner on one core
    python3 bench.py --palimpsest         only the Palimpsest section: the archive on vs off after a
                                          restart (same question, template, function + 1 change,
                                          fresh prose), and the index's build time and memory
    python3 bench.py --conclave           only the Conclave section: an 8-question quiz, one greedy
                                          answer vs 5 sequential samples voted vs the Conclave of 5
    python3 bench.py --step-cost          only the decode step cost by tokens in the step (the
                                          row-by-row kernels that keep greedy output exact);
                                          --against LIBLLAMA compares another build side by side
    python3 bench.py --suggest [--suggest-only TEXT]
                                          only the Suggeritore section: a numbered list, JSON records,
                                          a markdown table, prose, JSON records under a json_schema, and
                                          a tool call forced by name, Il Suggeritore on vs off
    python3 bench.py --workload [--plot trace.png]
                                          only the workload trace: 32 support-desk requests against
                                          llama-server as a user starts it, and reame.py serve cold,
                                          warm and after a restart, 1 and 4 clients
    python3 bench.py --warm-ahead          only the first request after a restart, idle warm-ahead
                                          on vs off (TTFT)
    python3 bench.py --soak [--soak-seconds 600] [--model gemma3-270m] [--soak-attacks A,B]
                                          only the soak: one server under load, attacks and
                                          disconnects; exit status 1 if anything failed

What it measures (every number is client-side wall clock, taken the same way for both):

  decode tok/s      one stream, a prompt that makes the model write a long answer;
                    (decode steps after the first token) / (last token - first token),
                    with streaming on both sides. llama-server gets the same prompt tokens
                    and ``n_predict`` = the tokens Reame generated, with ``ignore_eos``, so
                    both do the same work; their greedy outputs are compared as a check.
  prefill tok/s     a fresh ~768-token prompt (different every repeat, so neither side can
                    reuse a cached prefix; llama-server also gets ``cache_prompt: false`` and
                    ``--cache-ram 0``), one token generated: prompt tokens / wall time.
  aggregate tok/s   N streams at once (continuous batching): Reame gets N requests submitted
                    together to one Engine with n_slots >= N; llama-server gets N concurrent
                    HTTP requests, started with ``-np max(N)``. Sum of generated tokens / wall.
  over HTTP         (--http, --with-http) both as servers: ``reame.py serve --parallel N``
                    and ``llama-server -np N``, each started fresh for every N in
                    --http-clients with the same threads, context per slot and batch. N
                    client threads (http.client) are released together and each sends the
                    same POST /v1/completions to both: a raw prompt string (the model's chat
                    template around a long-answer request, so both tokenize the same text),
                    ``stream``, ``stream_options.include_usage``, temperature 0, max_tokens =
                    --gen-tokens, ``cache_prompt: false``; every client of every run has its
                    own tagged prompt, so no prefix cache helps either side. Reported per N:
                    aggregate tok/s = usage.completion_tokens of all clients / (last client's
                    end - first client's send), median of runs; TTFT = send to the first
                    chunk with text, median and p95 (nearest rank) over all clients of all
                    runs. There every ratio reads "> 1: Reame is better" (tok/s Reame/server,
                    TTFT server/Reame). No ignore_eos (Reame's API has none): tokens received
                    per client, prompt tokens per side and whether the greedy texts match are
                    printed, so unequal work shows. Off in the default run: it costs two
                    server starts per N and minutes more on a 1.5B model.
  prefix cache      (--prefix-cache, only this section) both as servers with one slot
                    (``reame.py serve --parallel 1``, ``llama-server -np 1``), the same
                    threads, batch and context. Workload "handbook": a deterministic employee
                    handbook (numbered policy sections) as the system message, sized so the
                    questions share ~2,400 prompt tokens (--handbook-tokens; --quick:
                    gemma3-270m and ~1,200), then short user questions A, B, C, D. Each is one
                    POST /v1/chat/completions, [system, user], ``stream``,
                    ``stream_options.include_usage``, temperature 0, max_tokens 8
                    (--prefix-gen-tokens), ``cache_prompt: true``; TTFT = send to the first
                    chunk with content. Per repeat (default 1; each cold run of the 1.5B
                    model prefills ~2,400 tokens), alternating Reame, server:
                      cold     A, fresh processes; Reame on a fresh temporary REAME_HOME (the
                               model passed as an absolute .gguf path, so that home holds only
                               kv/) with an empty kv/;
                      warm     B, the same processes (Reame: a free slot's KV; llama-server: its
                               slot's common prefix, which works with --cache-ram 0 at -np 1);
                      restart  C, after Reame's snapshot files are on disk (no temp file, the
                               files unchanged, /metrics: every snapshot handed to the writer
                               written) both are stopped (Reame with SIGTERM, which also
                               flushes its writer) and started again; Reame on the same
                               REAME_HOME. llama-server keeps no prefix across processes;
                      second   D, Reame only: a second ``reame.py serve`` on the same
                               REAME_HOME (another port) while the restarted one still runs.
                    After each Reame request bench.py waits for Reame's writer thread the same
                    way, so its compression never runs inside llama-server's measurement.
                    Every new process gets one untimed short request first (no handbook,
                    under one 128-token chunk), as elsewhere; llama-server's slot may then
                    reuse its first few template tokens in the cold case (cache_n shows it).
                    Reported: TTFT per case with usage.prompt_tokens_details.cached_tokens
                    (llama-server: timings.cache_n) and prompt tokens, Reame cold/restart
                    (goal >= 20x), server warm / Reame warm (goal >= 1: no worse), the
                    snapshot files' sizes per 1k tokens raw vs compressed (read from their
                    headers), Reame's /metrics deltas per request, and in --json
                    "prefix_cache". When the GGUF has no chat template (gemma3-270m), Reame
                    uses its family's built-in template and llama-server is given the same
                    one (--chat-template NAME), so both prefill the same tokens. Restart
                    reads snapshots just written, so they are in the OS page cache.

Soak (--soak, only this section; not a benchmark: a pass/fail run, exit status 1 on a failure):
    one ``reame.py serve MODEL --parallel 4 --ctx 1024`` with two ``--api-key``s (two tenants) on a
    fresh temporary REAME_HOME whose ``models`` is a symlink to the pulled models (nothing
    downloads, nothing else is shared). First each of 12 normal greedy requests (temperature 0,
    max_tokens 16-48: chat and /v1/completions, streamed and not, n=2, a json_schema, two-turn
    sessions, over both keys) is sent alone and its answer kept. Then for --soak-seconds: 8
    clients loop over them in a seeded random order and every answer must equal its solo answer
    exactly (a stream: its deltas concatenated per choice); 2 attackers run the attack table
    (soak_attacks: named attacks from the security issue, in raw bytes where http.client would
    fix the headers, run in table order, cycling), each judged clean only as a 4xx or 503 with
    the error JSON {"error": {"message", "type"}}, a 200 stream whose error event is followed by
    data: [DONE], or a 200 where the table allows one and the answer checks out (a grammar's
    only text, a schema's types, a tenant's data absent); never a 500, an "internal error", a
    timeout (30 s) or a dropped socket (noted but not failed for the HTTP framing attacks); one
    thread abandons requests (a stream closed after its first chunk, a request closed before
    its answer, half a request head, a body shorter than its Content-Length); /health is
    probed every 0.5 s from a process of its own (so the client threads' GIL is not in its
    latency; a probe over 0.25 s lists what was in flight). Afterwards /metrics must read reame_active_sequences, reame_queued_requests
    and reame_kv_cells_used 0 (waited for up to 60 s) and the process must be the one started.
    A server that exits is recorded with what was in flight and ends the run; one that hangs
    makes its requests time out and is killed at the end. --save-json keeps the whole report.

Runs alternate (Reame, server, Reame, server, ...) measurement by measurement, so drift on
a noisy shared vCPU hits both; the table reports medians over ``--repeats`` and the ratio
Reame / server. Only a ratio from one run means anything on these machines. Also reported:
what llama-server says about itself (``timings``), Reame's own per-request numbers, and
Reame's Python time per decode-only step (the scheduler's overhead around llama_decode).

Fairness, written down:
  * Same source tree (``_llama/llama-server`` is built by ``./build_llama.sh --with-server``),
    same GGUF, same threads (-t and -tb), same batch (-b = -ub = Reame's n_batch), flash
    attention auto on both (llama.cpp's default), same total KV cells (-c = ctx * slots),
    full SWA cache on both (--swa-full; Reame keeps it so cached prefixes stay valid for
    sliding-window models), temperature 0.
  * KV layout and weight repacking follow Reame by default (--server-kv/--server-repack
    match): bench.py reads what llama.cpp itself logged while building Reame's context
    (``kv_unified = ...``, a ``CPU_REPACK`` buffer or not) and starts llama-server with
    --kv-unified or --no-kv-unified, --repack or --no-repack to match. The ratios then
    compare the engines (scheduler, batching, sampling, Python) on identical kernels.
    --server-kv unified / --server-repack on compare against llama-server's fastest setup.
  * llama-server's extra work that Reame does not do is switched off: prompt cache in RAM
    (--cache-ram 0), context checkpoints (--ctx-checkpoints 0), and by default its sampler
    chain is cut to top_k=1 (the same argmax as Reame's greedy sampler; --server-sampling
    default keeps its full temperature-0 chain: top-k 40, top-p, min-p, ... then argmax).
  * Reame is driven in-process through its Engine API; llama-server over loopback HTTP.
    That costs the server well under a millisecond per request or streamed token, which
    is why its own ``timings`` are printed next to the client-side numbers.
  * Both get one untimed warm-up request before anything is timed (over HTTP: N short
    requests at once, once per server start).
  * Over HTTP both pay for HTTP, JSON and SSE; Reame's HTTP front is Python
    (ThreadingHTTPServer) in the same process as its scheduler, which is part of what the
    HTTP section measures. The clients run in bench.py's process, the same for both.
  * Noise: bench.py counts the CPU time other processes (and the hypervisor, as steal)
    took during each run and marks runs where that exceeded 10% of one core with ``*``.

KV layout: DESIGN.md planned one unified KV buffer (``kv_unified``) so that
``llama_memory_seq_cp`` can share cells between a cached prefix and a new request, or
between the N candidates of a best-of, instead of copying them; llama.h warns that a
unified buffer can be slower when sequences share nothing. reame.py now defaults to one
KV stream per sequence and no weight repacking, because both make greedy output
independent of who else shares the batch (see Context and Model in reame.py). What that
costs is measured, not guessed: ``--variants`` runs Reame against itself with unified vs
per-sequence KV and repacking on vs off (Engine(kv_unified=..., repack=...)), alternating,
at the largest stream count, and the table prints each next to Reame's default.

Benchmarks are never timed tests: this is a standalone script, standard library only.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import http.client
import inspect
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

import reame

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SERVER = os.path.join(HERE, "_llama", "llama-server")

# Prompts that make an instruct (code) model write long answers. Each repeat and each
# stream gets its own, so nothing one request computed can be reused by another.
TOPICS = [
    "a binary search tree with insert, delete, search and in-order traversal",
    "an LRU cache with a doubly linked list and a dict, with thread safety",
    "a tokenizer and recursive-descent parser for arithmetic expressions",
    "a min-heap priority queue and Dijkstra's shortest path algorithm",
    "a trie with insert, prefix search, delete and autocomplete",
    "a simple HTTP request parser and router with path parameters",
    "a matrix class with addition, multiplication, transpose and determinant",
    "a rate limiter with token bucket and sliding window strategies",
    "a JSON pretty printer and validator written from scratch",
    "a union-find structure and Kruskal's minimum spanning tree",
    "an event scheduler with cron-like rules and a run loop",
    "a text adventure game engine with rooms, items and a command parser",
    "a bank account system with transactions, overdraft rules and a ledger",
    "a CSV reader and writer with quoting, escaping and type inference",
    "a linked list with reverse, merge sort and cycle detection",
    "a simple key-value store with write-ahead log and compaction",
]

NOISY_FRAC = 0.10  # other CPU use (fraction of one core) above which a run is flagged noisy

_WORDS = ("alpha beta gamma delta value index count total buffer state node edge graph "
          "token batch cache queue stream frame layer model weight bias vector matrix "
          "result error handler config option parser reader writer client server request "
          "response session record field table column row key item entry list map set").split()


# -- helpers ---------------------------------------------------------------------------


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefill_text(rng: random.Random, n_lines: int) -> str:
    """Random Python-looking text: realistic token mix, never the same twice."""
    lines = ["# module %08x" % rng.getrandbits(32)]
    for i in range(n_lines):
        a, b, c, d = (rng.choice(_WORDS) for _ in range(4))
        lines.append("def %s_%s_%d(%s, %s=%d):\n    return %s.%s(%s) + %d"
                     % (a, b, i, c, d, rng.randrange(100), c, a, d, rng.randrange(1000)))
    return "\n".join(lines) + "\n"


def make_prefill_tokens(model, rng: random.Random, n_tok: int) -> list:
    text, n_lines = "", 16
    while True:
        text = prefill_text(rng, n_lines)
        toks = model.tokenize(text)
        if len(toks) >= n_tok:
            return list(toks[:n_tok])
        n_lines *= 2


def chat_tokens(eng, text: str) -> list:
    """The model's chat template around one user message (plain text for base models)."""
    try:
        return list(eng.chat_prompt([{"role": "user", "content": text}]))
    except reame.ReameError:
        return list(eng.model.tokenize(text))


def long_answer_prompt(topic: str, tag: str) -> str:
    return ("[%s] Write a complete, well documented Python module implementing %s. "
            "Include type hints, docstrings for every function, and a long set of unittest "
            "test cases. Write the whole file." % (tag, topic))


class CpuNoise:
    """CPU time used by processes other than this one and llama-server (Linux /proc).

    These machines are shared; a number here well above zero means timings are noisy.
    """

    def __init__(self):
        self.pids = []
        self._last_pid_s = {}  # pid -> CPU seconds last read (kept once the process is gone)
        self.reaped = set()
        self.t0 = time.monotonic()
        self.busy0, self.steal0 = self._system()
        self.own0 = self._own()

    @staticmethod
    def _system():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None, None
        hz = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq = v[:7]
        steal = v[7] if len(v) > 7 else 0
        return (user + nice + system + irq + softirq) / hz, steal / hz

    def _own(self):
        t = os.times()
        total = t.user + t.system + t.children_user + t.children_system
        hz = os.sysconf("SC_CLK_TCK")
        for pid in self.pids:
            try:
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                self._last_pid_s[pid] = (int(fields[11]) + int(fields[12])) / hz  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
            # Once reaped, its time is in children_* above; until then, count the last reading.
        return total + sum(self._last_pid_s.get(p, 0.0) for p in self.pids if not self._reaped(p))

    def _reaped(self, pid: int) -> bool:
        return pid in self.reaped

    def mark_reaped(self, pid: int) -> None:
        self.reaped.add(pid)

    def add_pid(self, pid: int) -> None:
        # The server's CPU time so far counts as ours from now on.
        self.pids.append(pid)

    def mark(self) -> tuple:
        busy, steal = self._system()
        return time.monotonic(), busy, steal, self._own()

    def since(self, mark: tuple) -> Optional[float]:
        """Fraction of one core that other processes, or the hypervisor (steal), took since mark."""
        t1, busy, steal, own = self.mark()
        if busy is None or mark[1] is None:
            return None
        other = max(0.0, (busy - mark[1]) - (own - mark[3])) + (steal - mark[2])
        return round(other / max(t1 - mark[0], 1e-9), 3)

    def report(self) -> dict:
        busy, steal = self._system()
        wall = time.monotonic() - self.t0
        if busy is None:
            return {"wall_s": wall}
        other = max(0.0, (busy - self.busy0) - (self._own() - self.own0))
        return {"wall_s": round(wall, 1), "other_cpu_s": round(other, 1),
                "other_cpu_frac_of_one_core": round(other / max(wall, 1e-9), 3),
                "steal_s": round(steal - self.steal0, 1), "cores": os.cpu_count()}


# -- llama-server ----------------------------------------------------------------------


def _set_pdeathsig():
    """Linux: the server gets SIGTERM if bench.py dies without cleaning up (kill -9)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def help_knows(help_text: str, flag: str) -> bool:
    """Whether a --help text lists flag (so bench.py passes only flags a build knows)."""
    return any(tok.strip(",") == flag for line in help_text.splitlines() for tok in line.split())


class ServerProcess:
    """A server as a subprocess on a free loopback port, logging to a file; close() always stops it."""

    name = "server"

    @staticmethod
    def help_text(cmd: list, env: Optional[dict] = None) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, timeout=60, env=env)
            return (out.stdout + out.stderr).decode("utf-8", "replace")
        except (OSError, subprocess.TimeoutExpired):
            return ""

    def _knows(self, flag: str) -> bool:
        return help_knows(self.help, flag)

    def _start(self, env: dict) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s; log tail:\n%s" % (self.name, self.proc.returncode, self.log_tail()))
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError("%s not ready after %.0f s; log tail:\n%s" % (self.name, timeout_s, self.log_tail()))

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 300 * n))
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return ""

    def check_alive(self) -> None:
        """Raise if the server exited (it then never answers)."""
        if self.proc.poll() is not None:
            raise RuntimeError("%s exited with %s; log tail:\n%s" % (self.name, self.proc.returncode, self.log_tail()))

    def guarded(self, fn, *args):
        """Run fn(*args) in a worker thread, so a server that dies mid-request raises here
        instead of hanging the benchmark. Timing happens inside fn, in the worker."""
        box = {}

        def work():
            try:
                box["out"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                box["err"] = e

        t = threading.Thread(target=work, name="bench-http", daemon=True)
        t.start()
        wait_joined(t, self)
        if "err" in box:
            raise box["err"]
        return box["out"]

    def close(self) -> None:
        """Stop the process this object started (by its own Popen handle, never by name)."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()


class LlamaServer(ServerProcess):
    """llama-server as a subprocess on a free loopback port; close() always stops it."""

    name = "llama-server"

    def __init__(self, binary: str, model_path: str, *, threads: int, n_parallel: int, ctx_per_slot: int,
                 n_batch: int, log_path: str, kv_unified: bool = True, repack: bool = True, cache_ram: str = "0",
                 chat_template: Optional[str] = None):
        if not os.access(binary, os.X_OK):
            raise SystemExit("llama-server not found at %s: build it with ./build_llama.sh --with-server, "
                             "pass --server PATH, or use --no-server" % binary)
        self.binary = binary
        self.log_path = log_path
        libdir = os.path.dirname(os.path.abspath(binary))
        self.help = self.help_text([binary, "--help"], dict(os.environ, LD_LIBRARY_PATH=libdir))
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        args = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(threads), "-tb", str(threads), "-np", str(n_parallel),
                "-c", str(ctx_per_slot * n_parallel), "-b", str(n_batch), "-ub", str(n_batch),
                "-ngl", "0"]
        self.flags = []
        # Match Reame, and switch off work Reame does not do; only flags this build knows.
        for flag, value in (("--kv-unified" if kv_unified else "--no-kv-unified", None),
                            ("--repack" if repack else "--no-repack", None), ("--swa-full", None), ("-fa", "auto"),
                            ("--cache-ram", cache_ram), ("--ctx-checkpoints", "0"), ("--no-cache-idle-slots", None),
                            ("--fit", "off"), ("--no-webui", None)):
            if self._knows(flag):
                self.flags += [flag] + ([value] if value is not None else [])
        if chat_template and self._knows("--chat-template"):
            # A built-in template by name (the GGUF has none): llama.cpp's legacy templates, not Jinja.
            self.flags += (["--no-jinja"] if self._knows("--no-jinja") else []) + ["--chat-template", chat_template]
        self.args = args + self.flags
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = libdir + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        self._start(env)

    def check_alive(self) -> None:
        """Raise if llama-server exited or began shutting down (it then may never answer)."""
        super().check_alive()
        if "cleaning up before exit" in self.log_tail(5):
            raise RuntimeError("llama-server is shutting down (did something send it SIGINT/SIGTERM?); "
                               "log tail:\n%s" % self.log_tail())

    def completion(self, body: dict, timeout_s: float = 1800) -> dict:
        return self.guarded(self._completion, body, timeout_s)

    def completion_stream(self, body: dict, timeout_s: float = 1800) -> dict:
        return self.guarded(self._completion_stream, body, timeout_s)

    def _completion(self, body: dict, timeout_s: float) -> dict:
        """POST /completion (not streamed): the JSON answer plus client wall time."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.base + "/completion", data=data, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.loads(r.read())
        out["_wall_s"] = time.perf_counter() - t0
        return out

    def _completion_stream(self, body: dict, timeout_s: float) -> dict:
        """POST /completion with stream: client times of the first token and of the end."""
        data = json.dumps(dict(body, stream=True)).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        t0 = time.perf_counter()
        t_first, last, tokens = None, {}, []
        try:
            for chunk in sse_chunks(conn, "/completion", data, self.port):
                toks = chunk.get("tokens") or []
                if t_first is None and (toks or chunk.get("content")):
                    t_first = time.perf_counter()
                tokens.extend(toks)
                last = chunk
                if chunk.get("stop"):
                    break
        finally:
            conn.close()
        t_end = time.perf_counter()
        last["_t_first_s"] = (t_first or t_end) - t0
        last["_t_end_s"] = t_end - t0
        last["_tokens"] = tokens
        return last



def wait_joined(thread: threading.Thread, srv: ServerProcess, poll_s: float = 0.5) -> None:
    """join() that checks every poll_s that the server is still alive (join returns at once
    when the thread ends, so this adds no latency to what is measured)."""
    while True:
        thread.join(poll_s)
        if not thread.is_alive():
            return
        srv.check_alive()


def server_body(prompt_tokens: list, n_predict: int, sampling: str) -> dict:
    body = {"prompt": prompt_tokens, "n_predict": n_predict, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False, "return_tokens": True, "seed": 0}
    if sampling == "greedy":
        body.update({"samplers": ["top_k"], "top_k": 1})
    return body


# -- Reame engines ---------------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _param_default(fn, name):
    try:
        p = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def open_engine(model_path: str, **kw):
    """A reame.Engine, plus what llama.cpp itself says it chose while loading it (KV layout,
    weight repacking, flash attention), so llama-server can be started the same way."""
    lg = logging.getLogger("reame.llama")  # where reame.py sends llama.cpp's log lines
    cap, saved = _Capture(), (lg.level, lg.propagate)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    lg.addHandler(cap)
    try:
        eng = reame.Engine(model_path, **kw)
    finally:
        lg.removeHandler(cap)
        lg.setLevel(saved[0])
        lg.propagate = saved[1]
    text = "\n".join(cap.lines)
    m = re.search(r"kv_unified\s*=\s*(true|false)", text)
    if m:
        kv_unified = m.group(1) == "true"
    else:  # no log lines: fall back to the defaults in reame.py's signatures
        kv_unified = kw.get("kv_unified", _param_default(reame.Context.__init__, "kv_unified"))
        kv_unified = True if kv_unified is None else kv_unified
    if "model buffer size" in text:
        repack = "REPACK" in text
    else:
        repack = kw.get("repack", _param_default(reame.Engine.__init__, "repack"))
        repack = True if repack is None else repack  # older reame.py: llama.cpp's default
    fa = re.search(r"flash_attn\s*=\s*(\w+)", text)
    settings = {"kv_unified": kv_unified, "repack": repack, "flash_attn": fa.group(1) if fa else "auto",
                "from_llama_log": bool(m)}
    return eng, settings


# -- the measurements ------------------------------------------------------------------


def _steps_snapshot(eng) -> tuple:
    return (getattr(eng, "n_decode_only_steps", 0), getattr(eng, "t_decode_only_py_s", 0.0),
            getattr(eng, "n_steps", 0), getattr(eng, "t_decode_s", 0.0), getattr(eng, "t_step_s", 0.0))


def _steps_delta(a: tuple, b: tuple) -> dict:
    n_do, py_s = b[0] - a[0], b[1] - a[1]
    n_steps, dec_s, step_s = b[2] - a[2], b[3] - a[3], b[4] - a[4]
    return {"decode_only_steps": n_do, "py_s": py_s, "steps": n_steps, "decode_s": dec_s, "step_s": step_s}


def reame_decode(eng, tokens: list, max_tokens: int) -> dict:
    """One streamed request: client times of the first piece and of the end."""
    t0 = time.perf_counter()
    req = eng.submit(tokens, temperature=0, max_tokens=max_tokens)
    t_first = None
    for _piece in req:
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    res = req.wait()
    n = res.n_gen_tok
    # Decode steps after the first token: the others, plus the one that sampled the end token.
    steps = n - 1 + (1 if res.finish_reason == "stop" else 0)
    span = t_end - (t_first or t_end)
    return {"n_gen": n, "finish": res.finish_reason, "tokens": list(res.tokens),
            "tok_s": steps / span if span > 0 and steps > 0 else None,
            "engine_tok_s": (steps / (res.total_s - res.ttft_s)) if res.total_s > res.ttft_s and steps > 0 else None,
            "ttft_s": (t_first or t_end) - t0}


def server_decode(srv, tokens: list, n_predict: int, sampling: str) -> dict:
    out = srv.completion_stream(server_body(tokens, n_predict, sampling))
    timings = out.get("timings") or {}
    n = out.get("tokens_predicted") or timings.get("predicted_n") or len(out["_tokens"])
    span = out["_t_end_s"] - out["_t_first_s"]
    return {"n_gen": n, "tokens": out["_tokens"], "n_prompt": timings.get("prompt_n"),
            "tok_s": (n - 1) / span if span > 0 and n > 1 else None,
            "server_tok_s": timings.get("predicted_per_second"), "ttft_s": out["_t_first_s"]}


def reame_prefill(eng, tokens: list) -> dict:
    t0 = time.perf_counter()
    res = eng.submit(tokens, temperature=0, max_tokens=1).wait()
    wall = time.perf_counter() - t0
    return {"tok_s": len(tokens) / wall, "engine_tok_s": len(tokens) / res.ttft_s if res.ttft_s > 0 else None,
            "n_prompt": res.n_prompt_tok}


def server_prefill(srv, tokens: list, sampling: str) -> dict:
    out = srv.completion(server_body(tokens, 1, sampling))
    timings = out.get("timings") or {}
    return {"tok_s": len(tokens) / out["_wall_s"], "server_tok_s": timings.get("prompt_per_second"),
            "n_prompt": timings.get("prompt_n"), "cached": timings.get("cache_n")}


def reame_aggregate(eng, prompts: list, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    reqs = [eng.submit(p, temperature=0, max_tokens=max_tokens) for p in prompts]
    results = [r.wait() for r in reqs]
    wall = time.perf_counter() - t0
    lens = [r.n_gen_tok for r in results]
    return {"tok_s": sum(lens) / wall, "lens": lens, "wall_s": wall}


def server_aggregate(srv, prompts: list, lens: list, sampling: str) -> dict:
    outs, errors = [None] * len(prompts), []
    start = threading.Barrier(len(prompts) + 1)

    def one(i):
        start.wait()
        try:
            outs[i] = srv._completion(server_body(prompts[i], lens[i], sampling), 1800)
        except Exception as e:  # noqa: BLE001 - reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), name="bench-client-%d" % i, daemon=True)
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        wait_joined(t, srv)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    n = [o.get("tokens_predicted") or (o.get("timings") or {}).get("predicted_n") or 0 for o in outs]
    return {"tok_s": sum(n) / wall, "lens": n, "wall_s": wall}


# -- over HTTP: both servers, N streaming clients ----------------------------------------


REAME_SCRIPT = os.path.join(HERE, "reame.py")


class ReameServer(ServerProcess):
    """``reame.py serve`` as a subprocess on a free loopback port; close() always stops it."""

    name = "reame serve"

    def __init__(self, model_path: str, *, threads: int, n_parallel: int, ctx_per_slot: int, n_batch: int,
                 log_path: str, help_text: str, env: Optional[dict] = None, extra_args: tuple = ()):
        self.log_path = log_path
        self.help = help_text
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.args = [sys.executable, REAME_SCRIPT, "serve", model_path, "--host", "127.0.0.1",
                     "--port", str(self.port), "--parallel", str(n_parallel), "--threads", str(threads),
                     "--ctx", str(ctx_per_slot)]
        if self._knows("--batch"):
            self.args += ["--batch", str(n_batch)]
        if self._knows("--grace"):  # close() cancels what is left instead of draining for 30 s
            self.args += ["--grace", "1"]
        self.args += list(extra_args)  # e.g. --api-key KEY (--soak)
        self._start(dict(os.environ) if env is None else env)


def http_body(prompt: str, max_tokens: int, sampling: str) -> bytes:
    """The one request body both servers get (each ignores the other's extra fields:
    Reame ignores cache_prompt and samplers, and is greedy at temperature 0 anyway)."""
    return stream_body({"prompt": prompt}, max_tokens, sampling, cache_prompt=False)


def stream_body(fields: dict, max_tokens: int, sampling: str, cache_prompt: bool) -> bytes:
    """A streaming, greedy request body with usage, plus ``fields`` (prompt or messages)."""
    body = dict(fields, max_tokens=max_tokens, temperature=0, seed=0, stream=True,
                stream_options={"include_usage": True}, cache_prompt=cache_prompt)
    if sampling == "greedy":
        body.update({"samplers": ["top_k"], "top_k": 1})
    return json.dumps(body).encode()


def sse_chunks(conn, path: str, body: bytes, port: int, deadline: Optional[float] = None):
    """POST body to path and yield the parsed SSE chunks up to [DONE] (both servers'
    format); an HTTP error, an error event or passing ``deadline`` raises."""
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError("HTTP %d from port %d: %s" % (resp.status, port,
                                                          resp.read(500).decode("utf-8", "replace")))
    while True:
        line = resp.readline()
        if not line:
            return
        if deadline is not None and time.perf_counter() > deadline:
            raise RuntimeError("no answer from port %d within the time limit" % port)
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError("stream error from port %d: %s" % (port, chunk["error"]))
        yield chunk


def http_stream(port: int, body: bytes, start: threading.Barrier, timeout_s: float = 1800) -> dict:
    """One streaming client (http.client): POST /v1/completions, read SSE chunks to [DONE].

    ttft_s runs from sending the request to the first chunk with text; completion tokens
    come from the usage chunk (the count of text chunks is kept as a fallback and a check).
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        start.wait()
        t0 = time.perf_counter()
        t_first, n_chunks, usage, finish, text = None, 0, None, None, []
        for chunk in sse_chunks(conn, "/v1/completions", body, port):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                if piece:
                    if t_first is None:
                        t_first = time.perf_counter()
                    n_chunks += 1
                    text.append(piece)
                finish = choice.get("finish_reason") or finish
        t_end = time.perf_counter()
    finally:
        conn.close()
    usage = usage or {}
    return {"t0": t0, "t_end": t_end, "ttft_s": (t_first or t_end) - t0, "chunks": n_chunks,
            "completion_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens"),
            "finish": finish, "text": "".join(text)}


def http_clients(srv: ServerProcess, bodies: list) -> dict:
    """len(bodies) streaming clients at once, one thread each, released together.

    Aggregate tok/s = sum of completion tokens / (last client's end - first client's send).
    """
    outs, errors = [None] * len(bodies), []
    start = threading.Barrier(len(bodies) + 1)

    def one(i):
        try:
            outs[i] = http_stream(srv.port, bodies[i], start)
        except Exception as e:  # noqa: BLE001 - reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), name="bench-client-%d" % i, daemon=True)
               for i in range(len(bodies))]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        wait_joined(t, srv)
    if errors:
        raise errors[0]
    wall = max(o["t_end"] for o in outs) - min(o["t0"] for o in outs)
    toks = [o["chunks"] if o["completion_tokens"] is None else o["completion_tokens"] for o in outs]
    return {"tok_s": sum(toks) / wall if wall > 0 else None, "wall_s": wall, "tokens": toks,
            "ttft_s": [o["ttft_s"] for o in outs], "chunks": [o["chunks"] for o in outs],
            "usage_missing": sum(o["completion_tokens"] is None for o in outs),
            "prompt_tokens": [o["prompt_tokens"] for o in outs], "finish": [o["finish"] for o in outs],
            "texts": [o["text"] for o in outs]}


def nearest_rank(xs, q: float):
    """The q-quantile by nearest rank (an observed value; fine for a handful of samples)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[max(1, math.ceil(q * len(xs))) - 1]


def run_http(args, noise: CpuNoise) -> dict:
    """``reame.py serve --parallel N`` vs ``llama-server -np N`` for N in --http-clients.

    Per N both servers are started fresh with the same threads, context per slot and batch,
    then get the same requests from N streaming clients, alternating Reame, server, ...
    """
    model_path = reame.resolve_model(args.model)
    clients = sorted(set(args.http_clients))
    serve_help = ServerProcess.help_text([sys.executable, REAME_SCRIPT, "serve", "--help"])
    if not help_knows(serve_help, "--parallel"):
        raise SystemExit("this reame.py has no 'serve --parallel': the HTTP section needs it")
    # reame.py serve may not take --batch: then both servers use Reame's default here.
    batch = args.batch if help_knows(serve_help, "--batch") else (
        _param_default(reame.Engine.__init__, "n_batch") or 512)
    if batch != args.batch:
        log("HTTP: reame.py serve has no --batch, so both servers use Reame's n_batch %d here" % batch)
    # An Engine built the way serve builds it (same defaults): what llama.cpp reports for KV
    # layout and repacking, so llama-server can be started to match, and the chat template.
    eng, settings = open_engine(model_path, n_ctx=args.ctx, n_slots=max(clients), n_threads=args.threads,
                                n_batch=batch)
    try:
        def prompt(k: int, tag: str) -> str:
            # The model's chat template around a long-answer request, sent as a raw completion
            # prompt, so both servers tokenize the same text (their chat templates may differ).
            text = long_answer_prompt(TOPICS[k % len(TOPICS)], tag)
            try:
                return eng.model.apply_chat_template([{"role": "user", "content": text}])
            except reame.ReameError:
                return text

        warm = {n: [prompt(i, "hw%d-%d" % (n, i)) for i in range(n)] for n in clients}
        # Every client of every run gets its own topic/tag, so no prefix cache can help.
        prompts = {(n, r): [prompt(r * 5 + ni * 3 + i, "h%d-%d-%d" % (r, n, i)) for i in range(n)]
                   for ni, n in enumerate(clients) for r in range(args.repeats)}
    finally:
        eng.close()
    kv = settings["kv_unified"] if args.server_kv == "match" else args.server_kv == "unified"
    rp = settings["repack"] if args.server_repack == "match" else args.server_repack == "on"
    log_dir = tempfile.mkdtemp(prefix="bench-http-logs-")
    runs = {n: {"reame": [], "server": []} for n in clients}
    cmds = {"reame": {}, "server": {}}
    for n in clients:
        rsrv = ssrv = None
        try:
            # Started from the main thread: prctl(PDEATHSIG) follows the thread that forked.
            rsrv = ReameServer(model_path, threads=args.threads, n_parallel=n, ctx_per_slot=args.ctx,
                               n_batch=batch, log_path=os.path.join(log_dir, "reame-serve-np%d.log" % n),
                               help_text=serve_help)
            noise.add_pid(rsrv.proc.pid)
            log("HTTP %d client%s: reame serve pid %d on port %d" % (n, "s" if n > 1 else "", rsrv.proc.pid, rsrv.port))
            cmds["reame"][n] = " ".join(rsrv.args)
            if not args.no_server:
                ssrv = LlamaServer(args.server, model_path, threads=args.threads, n_parallel=n,
                                   ctx_per_slot=args.ctx, n_batch=batch, kv_unified=kv, repack=rp,
                                   log_path=os.path.join(log_dir, "llama-server-np%d.log" % n))
                noise.add_pid(ssrv.proc.pid)
                log("HTTP %d client%s: llama-server pid %d on port %d" % (n, "s" if n > 1 else "", ssrv.proc.pid, ssrv.port))
                cmds["server"][n] = " ".join(ssrv.args)
            sides = [("reame", rsrv)] + ([("server", ssrv)] if ssrv else [])
            for _, srv in sides:
                srv.wait_ready()
            # Untimed warm-up: N short requests at once, so every slot and thread has run.
            for _, srv in sides:
                http_clients(srv, [http_body(p, 8, args.server_sampling) for p in warm[n]])
            for r in range(args.repeats):
                log("HTTP %d client%s, repeat %d/%d" % (n, "s" if n > 1 else "", r + 1, args.repeats))
                bodies = [http_body(p, args.gen_tokens, args.server_sampling) for p in prompts[(n, r)]]
                for side, srv in sides:
                    m = noise.mark()
                    out = http_clients(srv, bodies)
                    out["noise"] = noise.since(m)
                    runs[n][side].append(out)
        finally:
            for srv in (rsrv, ssrv):
                if srv is not None:
                    srv.close()
                    noise.mark_reaped(srv.proc.pid)
            log("HTTP %d client%s: servers stopped" % (n, "s" if n > 1 else ""))
    return http_summary(args, clients, runs, cmds, settings, batch, log_dir)


def http_summary(args, clients: list, runs: dict, cmds: dict, settings: dict, batch: int, log_dir: str) -> dict:
    metrics, notes = {}, {"tokens_per_client": {}, "text_chunks_per_client": {}, "prompt_tokens_equal": {},
                          "text_identical": {},
                          "finish_reasons": {}, "usage_missing": {}}

    def entry(stat, ratio_is, r_runs, s_runs, r_val, s_val, r_noise, s_noise):
        if ratio_is == "reame/server":
            ratio = (r_val / s_val) if r_val is not None and s_val else None
        else:
            ratio = (s_val / r_val) if s_val is not None and r_val else None
        return {"stat": stat, "reame": r_val, "server": s_val, "ratio": ratio, "ratio_is": ratio_is,
                "reame_runs": r_runs, "server_runs": s_runs, "reame_noise": r_noise, "server_noise": s_noise}

    for n in clients:
        rr, sr = runs[n]["reame"], runs[n]["server"]
        rn, sn = [x["noise"] for x in rr], [x["noise"] for x in sr]
        label = "%d client%s" % (n, "s" if n > 1 else "")
        rt, st = [x["tok_s"] for x in rr], [x["tok_s"] for x in sr]
        metrics["aggregate tok/s, %s" % label] = entry(
            "median of runs", "reame/server", rt, st, median(rt), median(st), rn, sn)
        r_ttft = [t for x in rr for t in x["ttft_s"]]
        s_ttft = [t for x in sr for t in x["ttft_s"]]
        metrics["TTFT median s, %s" % label] = entry(
            "median over all clients of all runs", "server/reame", [median(x["ttft_s"]) for x in rr],
            [median(x["ttft_s"]) for x in sr], median(r_ttft), median(s_ttft), rn, sn)
        metrics["TTFT p95 s, %s" % label] = entry(
            "p95, nearest rank over all clients of all runs", "server/reame", [max(x["ttft_s"]) for x in rr],
            [max(x["ttft_s"]) for x in sr], nearest_rank(r_ttft, 0.95), nearest_rank(s_ttft, 0.95), rn, sn)
        metrics["TTFT p95 s, %s" % label]["runs_are"] = "the largest TTFT of each run"
        notes["tokens_per_client"][n] = {"reame": [x["tokens"] for x in rr], "server": [x["tokens"] for x in sr]}
        notes["text_chunks_per_client"][n] = {"reame": [x["chunks"] for x in rr], "server": [x["chunks"] for x in sr]}
        notes["finish_reasons"][n] = {"reame": sorted(set(f for x in rr for f in x["finish"] if f)),
                                      "server": sorted(set(f for x in sr for f in x["finish"] if f))}
        notes["usage_missing"][n] = sum(x["usage_missing"] for x in rr + sr)
        if sr:
            pairs = list(zip(rr, sr))
            notes["prompt_tokens_equal"][n] = all(a["prompt_tokens"] == b["prompt_tokens"] for a, b in pairs)
            same = sum(ta == tb for a, b in pairs for ta, tb in zip(a["texts"], b["texts"]))
            notes["text_identical"][n] = "%d/%d" % (same, sum(len(a["texts"]) for a in rr))
        notes.setdefault("prompt_tokens", {})[n] = rr[0]["prompt_tokens"] if rr else None
    return {"config": {"clients": clients, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
                       "threads": args.threads, "ctx_per_slot": args.ctx, "n_batch": batch,
                       "request": "POST /v1/completions, stream, stream_options.include_usage, temperature 0, "
                                  "cache_prompt false%s; prompt = the model's chat template around a long-answer "
                                  "request, as a raw string" % (", samplers [top_k], top_k 1"
                                                                if args.server_sampling == "greedy" else ""),
                       "reame_settings": settings, "reame_cmd": cmds["reame"], "server_cmd": cmds["server"],
                       "logs": log_dir},
            "metrics": metrics, "notes": notes}


def print_http(h: dict, w) -> None:
    c = h["config"]
    w("HTTP: N concurrent streaming clients (http.client threads), %s, max_tokens %d, %d alternating repeats\n"
      % ("POST /v1/completions", c["gen_tokens"], c["repeats"]))
    w("(reame.py serve --parallel N vs llama-server -np N, each started fresh per N with %d threads, ctx %d per "
      "slot, batch %d)\n" % (c["threads"], c["ctx_per_slot"], c["n_batch"]))
    st = c.get("reame_settings") or {}
    w("(Reame: %s KV, weight repacking %s; llama-server: %s)\n" % (
        "unified" if st.get("kv_unified") else "per-sequence", "on" if st.get("repack") else "off",
        "not run" if not c["server_cmd"] else "%s KV, repacking %s" % (
            "unified" if "--kv-unified" in next(iter(c["server_cmd"].values())).split() else "per-sequence",
            "off" if "--no-repack" in next(iter(c["server_cmd"].values())).split() else "on")))
    w("(ratio > 1 means Reame is better on every line: tok/s is Reame / server, TTFT is server / Reame)\n\n")
    w("%-30s %10s %10s %8s   %s\n" % ("metric", "Reame", "server", "ratio", "runs (Reame | server)"))
    w("-" * 100 + "\n")
    for name, m in h["metrics"].items():
        digits = 3 if name.startswith("TTFT") else 1
        runs = " | ".join(" ".join(_fmt(x, digits) + ("*" if (z or 0) > NOISY_FRAC else "")
                                   for x, z in zip(m[side + "_runs"], m[side + "_noise"])) for side in ("reame", "server"))
        w("%-30s %10s %10s %8s   %s\n" % (name, _fmt(m["reame"], digits), _fmt(m["server"], digits),
                                          (_fmt(m["ratio"], 2) + "x") if m["ratio"] is not None else "-", runs))
    w("(aggregate = completion tokens of all clients / first send to last finish, median of runs; TTFT = send to "
      "first text chunk, median and p95 (nearest rank) over all clients of all runs; runs column: per-run "
      "median TTFT, and per-run max on the p95 line)\n")
    w("(* = a run during which other processes or the hypervisor took > %d%% of one core: noisy)\n"
      % (100 * NOISY_FRAC))
    n = h["notes"]
    for k, v in n["tokens_per_client"].items():
        w("tokens per client, %s client%s: Reame %s | server %s\n" % (k, "s" if int(k) > 1 else "", v["reame"], v["server"]))
    if n["prompt_tokens_equal"]:
        w("prompt tokens (usage) equal on both sides: %s; greedy text identical per client: %s\n" % (
            ", ".join("N=%s %s" % (k, "yes" if v else "NO") for k, v in n["prompt_tokens_equal"].items()),
            ", ".join("N=%s %s" % (k, v) for k, v in n["text_identical"].items())))
    w("finish reasons: %s\n" % ", ".join("N=%s Reame %s server %s" % (k, v["reame"], v["server"])
                                         for k, v in n["finish_reasons"].items()))
    if any(n["usage_missing"].values()):
        w("note: some streams had no usage chunk; their tokens were counted as text chunks: %s\n" % n["usage_missing"])
    for k, cmd in c["server_cmd"].items():
        w("HTTP server N=%s: %s\n" % (k, cmd))
    for k, cmd in c["reame_cmd"].items():
        w("HTTP Reame  N=%s: %s\n" % (k, cmd))
    w("server logs: %s\n" % c["logs"])



# -- prefix cache: a long shared system prompt, cold / warm / after restart ---------------


# An employee handbook as a chat's system message: (title, clauses). "{x|y|z}" picks x in the
# handbook itself and y, z, ... in the regional supplements that follow it when a longer text
# is asked for, so the text is deterministic and every section reads differently.
HANDBOOK_SECTIONS = [
    ("Working hours", [
        "Core hours are {10:00 to 16:00|09:30 to 15:30|10:00 to 15:00} local time, Monday to Friday; outside "
        "core hours employees arrange their day with their manager.",
        "Full-time employees work {40|38|39} hours per week on average, measured over a {four|six|twelve}-week "
        "period.",
        "Overtime must be approved in advance in the time-tracking system and is compensated as time off "
        "or at {125|130|150}% of the hourly rate."]),
    ("Annual leave", [
        "Employees receive {28|26|30} days of paid annual leave per calendar year, rising by one day for every "
        "{three|two|five} years of service up to a maximum of {32|30|33} days.",
        "Leave requests of more than five consecutive days must be submitted at least {four|three|six} weeks "
        "in advance.",
        "Up to five unused days may be carried over to the next year and expire on {31 March|30 April|30 June}."]),
    ("Sick leave", [
        "Employees who are ill notify their manager before {09:30|09:00|10:00} on the first day of absence.",
        "A medical certificate is required from the {third|fourth|second} calendar day of absence onwards.",
        "Sick days during approved annual leave are converted back to leave days when a certificate is "
        "provided."]),
    ("Remote work", [
        "Employees may work remotely up to {three|two|four} days per week if their role allows it and their "
        "manager agrees.",
        "Remote work from another country is limited to {20|15|30} working days per calendar year and must be "
        "registered with HR at least two weeks before travel, because of tax and social security rules.",
        "The company reimburses up to {500|400|600} EUR per year for home office equipment against receipts."]),
    ("Travel", [
        "Business travel is booked through the travel portal; economy class is standard for flights "
        "under {six|five|eight} hours.",
        "Hotel costs are reimbursed up to {180|160|200} EUR per night in major cities and {120|110|130} EUR "
        "elsewhere.",
        "Per diem rates follow the national tax tables; receipts for meals are not required."]),
    ("Expenses", [
        "Expense claims are submitted within {30|45|60} days of the expense with an itemised receipt.",
        "Taxis are reimbursed when public transport is unavailable, after {22:00|21:00|23:00}, or when "
        "carrying company equipment.",
        "Alcohol, fines, personal entertainment and upgrades are never reimbursed.",
        "Claims above {1,000|750|1,500} EUR require the approval of the budget owner in addition to the "
        "manager."]),
    ("Company equipment", [
        "Laptops and phones remain company property and are returned on the last working day.",
        "Loss or theft of equipment is reported to the IT service desk within {24|12|48} hours.",
        "Personal software may not be installed without approval from IT security."]),
    ("Information security", [
        "Passwords are at least {14|12|16} characters long and are never shared or reused across services.",
        "Multi-factor authentication is mandatory for email, source code and customer systems.",
        "Confidential documents are stored only in approved company systems, never on personal devices "
        "or private cloud accounts.",
        "Suspected phishing emails are reported with the report button and not forwarded."]),
    ("Data protection", [
        "Personal data of customers and colleagues is processed only for the purpose it was collected for.",
        "Data subject requests are forwarded to the data protection officer within {two|three|five} working "
        "days.",
        "Personal data breaches are reported to the security team immediately, at the latest within "
        "{24|12|48} hours of discovery."]),
    ("Code of conduct", [
        "Employees treat colleagues, customers and partners with respect regardless of origin, gender, "
        "religion, age, disability or sexual orientation.",
        "Harassment, bullying and discrimination are not tolerated and lead to disciplinary action.",
        "Concerns can be raised with a manager, HR or anonymously through the ethics hotline."]),
    ("Conflicts of interest", [
        "Employees disclose any financial interest in suppliers, customers or competitors to HR.",
        "Secondary employment requires written approval and may not exceed {ten|eight|twelve} hours per week.",
        "Family members may not report to each other directly or indirectly."]),
    ("Gifts and hospitality", [
        "Gifts with a value above {50|40|35} EUR from business partners are declined or handed to compliance.",
        "Invitations to events are accepted only with a clear business purpose and manager approval.",
        "Cash or cash equivalents are never accepted, whatever the amount."]),
    ("On-call duty", [
        "Teams that run production systems maintain an on-call rotation of at least {four|five|six} people.",
        "On-call weeks are compensated with a flat allowance of {350|300|400} EUR plus time off for "
        "incidents handled outside working hours.",
        "Exceptions to the rotation are approved by the head of engineering."]),
    ("Parental leave", [
        "Parents are entitled to parental leave under national law; the company tops up statutory "
        "parental pay to {90|85|100}% of net salary for the first {three|two|four} months.",
        "Parental leave is announced to HR at least {seven|eight|ten} weeks before it starts.",
        "Returning parents may work part-time for up to two years with a right to return to full time."]),
    ("Training and development", [
        "Each employee has a training budget of {1,500|1,200|2,000} EUR and {five|four|six} days per year.",
        "Courses longer than five days or costing more than {3,000|2,500|4,000} EUR require a repayment "
        "agreement if the employee leaves within twelve months.",
        "Conference talks by employees are encouraged and count as working time."]),
    ("Performance reviews", [
        "Performance reviews take place twice a year, in {spring|March|May} and in the autumn.",
        "Goals are agreed between employee and manager and documented in the HR system.",
        "Salary reviews happen once a year and take the review results and market data into account."]),
    ("Compensation and payroll", [
        "Salaries are paid on the last working day of each month by bank transfer.",
        "Payroll questions go to the payroll team; changes of bank details must reach it by the "
        "{15th|10th|20th} of the month.",
        "Bonuses, where applicable, are paid with the {March|April|February} salary of the following year."]),
    ("Benefits", [
        "The company contributes {100|80|120} EUR per month to the company pension plan for every employee.",
        "A public transport ticket or a bicycle lease is offered as a tax-free benefit.",
        "Employees may use the sports partnership at a reduced monthly fee of {25|20|30} EUR."]),
    ("Health and safety", [
        "Accidents at work, including near misses, are reported to the safety officer the same day.",
        "First aid kits and defibrillators are located next to every kitchen.",
        "Employees working at screens are entitled to an eye examination every {three|two|five} years."]),
    ("Office access", [
        "Badges are personal and must be visible inside the office.",
        "Visitors are registered at reception and accompanied at all times.",
        "The office is open from {06:00 to 22:00|07:00 to 21:00|06:30 to 20:00}; access outside these hours "
        "requires approval from facilities."]),
    ("Communication", [
        "Internal announcements are published on the intranet and in the {weekly|monthly|fortnightly} "
        "newsletter.",
        "Only the communications team speaks to the press on behalf of the company.",
        "Employees may mention their employer on social media but do not share confidential "
        "information."]),
    ("Probation and notice periods", [
        "The probation period is {six|three|four} months, during which either side may end the contract "
        "with two weeks' notice.",
        "After probation the notice period is {three|two|one} months to the end of a calendar month unless "
        "the contract says otherwise.",
        "Resignations are submitted in writing to HR."]),
    ("Disciplinary procedure", [
        "Minor misconduct leads to an informal conversation, repeated misconduct to a written warning.",
        "Serious misconduct such as theft, fraud or violence can lead to immediate dismissal.",
        "Employees may be accompanied by a colleague or works council member in disciplinary meetings."]),
    ("Whistleblowing", [
        "Reports of illegal conduct can be made through the whistleblowing platform, also anonymously.",
        "Reports are acknowledged within {seven|five|ten} days and answered within {three|two|three} months.",
        "Retaliation against anyone who reports in good faith is itself a disciplinary offence."]),
    ("Environment", [
        "Trains are preferred over flights for journeys under {six|five|seven} hours.",
        "Printers print double-sided by default; colour printing requires a reason.",
        "Waste is separated into paper, packaging, organic and residual waste in every kitchen."]),
    ("Use of AI tools", [
        "Only AI tools approved by IT security may be used with company data.",
        "Customer data, personal data and source code may not be pasted into public AI services.",
        "Employees remain responsible for checking any AI-generated content before they use it."]),
    ("Leaving the company", [
        "Departing employees return all equipment, badges and documents on their last day.",
        "Access to systems ends at {18:00|17:00|20:00} on the last working day.",
        "A reference letter is issued within {two|three|four} weeks of the request."]),
]
_HANDBOOK_REGIONS = ("Hamburg", "Rotterdam", "Gdansk", "Lyon", "Milan", "Vienna")

HANDBOOK_QUESTIONS = [  # A (cold), B (warm), C (after restart), D (second process), more for repeats
    "How many vacation days do I get in my first year?",
    "Can I expense a taxi home after working late?",
    "How long may I work remotely from another country?",
    "Who approves exceptions to the on-call rotation?",
]


def handbook_text(n_sections: int) -> str:
    """An employee handbook of n_sections numbered sections (past the list: regional supplements)."""
    out = ["You are the HR assistant of Northwind Logistics GmbH. Answer employees' questions about company "
           "policy using only the handbook below. Quote the section number you rely on. If the handbook does "
           "not cover a question, say so and refer the employee to hr@northwind.example. Be brief and "
           "friendly.", "", "NORTHWIND LOGISTICS EMPLOYEE HANDBOOK, version 7.3, valid from 1 January", ""]
    depts = ("HR", "Finance", "IT", "Legal", "Facilities", "Payroll", "Compliance")
    for i in range(n_sections):
        title, clauses = HANDBOOK_SECTIONS[i % len(HANDBOOK_SECTIONS)]
        k = i // len(HANDBOOK_SECTIONS)
        if k:
            title += " (supplement for the %s site)" % _HANDBOOK_REGIONS[(k - 1) % len(_HANDBOOK_REGIONS)]
        n = i + 1
        out.append("Section %d. %s" % (n, title))
        for j, c in enumerate(clauses):
            text = re.sub(r"\{([^{}]*)\}", lambda m: m.group(1).split("|")[k % len(m.group(1).split("|"))], c)
            out.append("%d.%d %s" % (n, j + 1, text))
        out.append("%d.%d Questions about this section go to %s; exceptions need written approval and are "
                   "reviewed every %d months." % (n, len(clauses) + 1, depts[i % len(depts)], (6, 12, 3)[i % 3]))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def shared_prefix_tokens(model, system: str) -> int:
    """Prompt tokens two chats with this system message and different questions share: what a
    prefix cache can reuse (the template may fold the system message into the user turn)."""
    try:
        a, b = (model.tokenize(model.apply_chat_template([{"role": "system", "content": system},
                                                          {"role": "user", "content": q}]))
                for q in HANDBOOK_QUESTIONS[:2])
    except reame.ReameError:
        a, b = (model.tokenize(system + "\n\n" + q) for q in HANDBOOK_QUESTIONS[:2])
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def fit_handbook(model, target: int) -> tuple:
    """The handbook whose shared chat prefix (system message and template) is closest to
    target tokens (within half a section, ~50 tokens). Returns (text, shared prefix tokens)."""
    best, n = None, 1
    while True:
        text = handbook_text(n)
        n_tok = shared_prefix_tokens(model, text)
        if best is None or abs(n_tok - target) < abs(best[1] - target):
            best = (text, n_tok)
        if n_tok >= target or n >= 1000:
            return best
        n += 1


def chat_body(system: str, question: str, max_tokens: int, sampling: str, cache_prompt: bool) -> bytes:
    """POST /v1/chat/completions body, the same for both servers (Reame ignores cache_prompt
    and samplers and is greedy at temperature 0 anyway)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return stream_body({"messages": messages}, max_tokens, sampling, cache_prompt)


def chat_stream(port: int, body: bytes, timeout_s: float = 900) -> dict:
    """One streaming chat request: TTFT = send to the first chunk with content; usage and (from
    llama-server) timings from the last chunks. timeout_s bounds the whole request (a server
    whose scheduler died may keep the stream open with keep-alive pings)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        t0 = time.perf_counter()
        t_first, usage, timings, text, replayed = None, None, None, [], False
        for chunk in sse_chunks(conn, "/v1/chat/completions", body, port, deadline=t0 + timeout_s):
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            replayed = replayed or bool((chunk.get("reame") or {}).get("replayed"))
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if t_first is None:
                        t_first = time.perf_counter()
                    text.append(piece)
        t_end = time.perf_counter()
    finally:
        conn.close()
    usage = usage or {}
    return {"ttft_s": (t_first or t_end) - t0, "total_s": t_end - t0, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "timings": timings, "replayed": replayed}


def reame_metrics(srv: ServerProcess, key: Optional[str] = None) -> dict:
    """Reame's /metrics as {name: value} (unlabelled counters and gauges only); {} when it
    cannot be read. A server started with API keys wants one for /metrics too (key)."""
    out = {}
    req = urllib.request.Request(srv.base + "/metrics", headers={"Authorization": "Bearer " + key} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            for line in r.read().decode("utf-8", "replace").splitlines():
                parts = line.split()
                if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
                    try:
                        out[parts[0]] = float(parts[1])
                    except ValueError:
                        pass
    except (urllib.error.URLError, OSError):
        pass
    return out


PREFIX_METRICS = ("reame_cache_hits_total", "reame_disk_cache_hits_total", "reame_cached_prompt_tokens_total",
                  "reame_disk_cache_snapshots_total", "reame_disk_cache_written_total")


def kv_files(kv_dir: str) -> list:
    """(path, size) of every finished snapshot (*.kv) and of temp files being written (*.tmp)."""
    out = []
    for root, _dirs, names in os.walk(kv_dir):
        for name in names:
            if name.endswith(".kv") or name.endswith(".tmp"):
                p = os.path.join(root, name)
                try:
                    out.append((p, os.path.getsize(p)))
                except OSError:
                    pass
    return sorted(out)


def wait_snapshots(kv_dir: str, srv: Optional[ServerProcess] = None, quiet_s: float = 1.0,
                   timeout_s: float = 180.0) -> list:
    """Wait until Reame's writer thread is idle: no temp file, the files unchanged for quiet_s, and
    (from /metrics) every snapshot handed to the writer written; without those counters, or if
    some were skipped (size bound), the files unchanged for 10 s. Returns the files."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        files = kv_files(kv_dir)
        if files != last:
            last, since = files, time.monotonic()
        quiet = time.monotonic() - since
        if not any(p.endswith(".tmp") for p, _ in files) and quiet >= quiet_s:
            m = reame_metrics(srv) if srv is not None else {}
            handed, written = m.get("reame_disk_cache_snapshots_total"), m.get("reame_disk_cache_written_total")
            if (handed is not None and written is not None and written >= handed) or quiet >= 10.0:
                return files
        time.sleep(0.2)
    log("prefix cache: snapshots still being written after %.0f s; going on (SIGTERM flushes them)" % timeout_s)
    return last or []


def read_snapshot_header(path: str) -> Optional[dict]:
    """A Reame KV snapshot's header: magic (8 bytes), version and header length (little-endian
    uint32 each), then a JSON header (raw_size, size, codec, tokens, ...), then the payload."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or not head.startswith(b"REAMEKV"):
                return None
            version, hlen = int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")
            meta = json.loads(f.read(hlen).decode("utf-8"))
        return {"file": os.path.basename(path), "version": version, "header_bytes": 16 + hlen,
                "file_bytes": os.path.getsize(path), "tokens": len(meta.get("tokens") or []),
                "raw_size": meta.get("raw_size"), "size": meta.get("size"), "codec": meta.get("codec")}
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def stop_graceful(srv: ServerProcess, noise: CpuNoise, timeout_s: float = 90.0) -> Optional[int]:
    """SIGTERM (Reame then finishes its snapshot writes), wait, and only then kill. Returns the exit code."""
    proc = srv.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log("%s pid %d did not stop within %.0f s of SIGTERM: killed" % (srv.name, proc.pid, timeout_s))
    srv.close()
    noise.mark_reaped(proc.pid)
    return proc.returncode


def run_prefix_cache(args, noise: CpuNoise) -> dict:
    """--prefix-cache: a long shared system prompt (an employee handbook) and short questions.

    Reame: cold (fresh REAME_HOME), warm (same process, another question), after a restart
    (new process on the same REAME_HOME: the disk tier), and a second process running next
    to the first. llama-server: cold, warm (same slot, cache_prompt), after a restart.
    """
    model_path = reame.resolve_model(args.model, pull=False)
    serve_help = ServerProcess.help_text([sys.executable, REAME_SCRIPT, "serve", "--help"])
    if not help_knows(serve_help, "--no-disk-cache"):
        raise SystemExit("this reame.py has no disk prefix cache ('serve --no-disk-cache' unknown): "
                         "the prefix-cache section needs it")
    batch = args.batch if help_knows(serve_help, "--batch") else (
        _param_default(reame.Engine.__init__, "n_batch") or 512)
    eng, settings = open_engine(model_path, n_ctx=256, n_slots=1, n_threads=args.threads, n_batch=batch)
    try:
        system, sys_tokens = fit_handbook(eng.model, args.handbook_tokens)
        # The same four questions every repeat: each repeat starts from fresh processes and a fresh
        # REAME_HOME, so nothing carries over, and the prompts (and chunk alignment) stay equal.
        questions = list(HANDBOOK_QUESTIONS[:4])
        try:
            prompt_tokens = [len(eng.chat_prompt([{"role": "system", "content": system},
                                                  {"role": "user", "content": q}])) for q in questions]
        except reame.ReameError:
            prompt_tokens = []
        chunk = eng.chunk if hasattr(eng, "chunk") else 128
        # A GGUF without a chat template (gemma3-270m): Reame falls back to its family's built-in
        # template by name; llama-server would fall back to chatml, so it gets the same name.
        tmpl = getattr(eng.model, "chat_template", None)
        builtin_template = tmpl if tmpl and "{" not in tmpl and len(tmpl) < 40 else None
    finally:
        eng.close()
    ctx = max(args.ctx, 1 << max(sys_tokens + 256, 1).bit_length())
    log("prefix cache: handbook system prompt of %d tokens (chat prompts %s), ctx %d, %d threads"
        % (sys_tokens, prompt_tokens, ctx, args.threads))
    kv = settings["kv_unified"] if args.server_kv == "match" else args.server_kv == "unified"
    rp = settings["repack"] if args.server_repack == "match" else args.server_repack == "on"
    log_dir = tempfile.mkdtemp(prefix="bench-prefix-logs-")
    warm_prompt = "Reply with one word: ready?"
    cases = ("cold", "warm", "restart", "second")
    runs = {side: {c: [] for c in cases} for side in ("reame", "server")}
    snapshots, cmds, exit_codes = [], {}, []
    homes = []
    seq = [0]

    def start_reame(home: str, tag: str) -> ReameServer:
        env = dict(os.environ, REAME_HOME=home)
        srv = ReameServer(model_path, threads=args.threads, n_parallel=1, ctx_per_slot=ctx, n_batch=batch,
                          log_path=os.path.join(log_dir, "reame-%s.log" % tag), help_text=serve_help, env=env)
        noise.add_pid(srv.proc.pid)
        cmds.setdefault("reame", "REAME_HOME=%s %s" % (home, " ".join(srv.args)))
        log("prefix cache: reame serve (%s) pid %d on port %d" % (tag, srv.proc.pid, srv.port))
        return srv

    def start_server(tag: str) -> LlamaServer:
        srv = LlamaServer(args.server, model_path, threads=args.threads, n_parallel=1, ctx_per_slot=ctx,
                          n_batch=batch, kv_unified=kv, repack=rp, cache_ram=args.server_cache_ram,
                          chat_template=builtin_template,
                          log_path=os.path.join(log_dir, "llama-server-%s.log" % tag))
        noise.add_pid(srv.proc.pid)
        cmds.setdefault("server", " ".join(srv.args))
        log("prefix cache: llama-server (%s) pid %d on port %d" % (tag, srv.proc.pid, srv.port))
        return srv

    def ready_and_warm(srv: ServerProcess) -> None:
        srv.wait_ready()
        # Untimed: pages the weights in and starts the threads. A short prompt without the
        # handbook: under one 128-token chunk, so it leaves nothing either side could reuse.
        srv.guarded(chat_stream, srv.port, json.dumps(
            {"messages": [{"role": "user", "content": warm_prompt}], "max_tokens": 2, "temperature": 0,
             "stream": True, "cache_prompt": False}).encode())

    def measure(side: str, case: str, srv: ServerProcess, question: str) -> None:
        before = reame_metrics(srv) if side == "reame" else {}
        m = noise.mark()
        out = srv.guarded(chat_stream, srv.port, chat_body(system, question, args.prefix_gen_tokens,
                                                           args.server_sampling, True))
        out["noise"] = noise.since(m)
        if side == "reame":
            after = reame_metrics(srv)
            out["metrics_delta"] = {k: after[k] - before.get(k, 0.0) for k in PREFIX_METRICS if k in after}
        t = out.get("timings") or {}
        if side == "server" and out["cached_tokens"] is None and "cache_n" in t:
            out["cached_tokens"] = t["cache_n"]
        out["question"] = question
        out["order"] = seq[0]
        seq[0] += 1
        runs[side][case].append(out)
        log("prefix cache: %-6s %-7s TTFT %.3f s, %s of %s prompt tokens cached%s" % (
            side, case, out["ttft_s"], out["cached_tokens"], out["prompt_tokens"],
            (", server prompt_n %s cache_n %s" % (t.get("prompt_n"), t.get("cache_n"))) if t else ""))

    try:
        for r in range(args.repeats):
            log("prefix cache: repeat %d/%d" % (r + 1, args.repeats))
            qa, qb, qc, qd = questions
            home = tempfile.mkdtemp(prefix="bench-reame-home-")
            homes.append(home)
            kv_dir = os.path.join(home, "kv")
            r1 = s1 = r2 = s2 = r3 = None
            try:
                # 1. first processes: cold, then warm in the same process.
                r1 = start_reame(home, "r%d-first" % r)
                if not args.no_server:
                    s1 = start_server("r%d-first" % r)
                for srv in (r1, s1):
                    if srv is not None:
                        ready_and_warm(srv)
                if kv_files(kv_dir):
                    raise RuntimeError("the fresh REAME_HOME %s already holds KV snapshots" % home)
                # After each Reame request its writer thread compresses and writes snapshots:
                # wait for it, so that work does not land in llama-server's measurement.
                measure("reame", "cold", r1, qa)
                wait_snapshots(kv_dir, r1)
                if s1:
                    measure("server", "cold", s1, qa)
                measure("reame", "warm", r1, qb)
                # 2. restart: Reame's snapshots must be on disk first (the writer is a thread).
                files = wait_snapshots(kv_dir, r1)
                if s1:
                    measure("server", "warm", s1, qb)
                log("prefix cache: %d snapshot file(s) on disk, %.1f MiB; stopping the first servers"
                    % (len(files), sum(s for _, s in files) / 2 ** 20))
                exit_codes.append(stop_graceful(r1, noise))
                r1 = None
                if s1:
                    s1.close()
                    noise.mark_reaped(s1.proc.pid)
                    s1 = None
                snaps = [h for h in (read_snapshot_header(p) for p, _ in kv_files(kv_dir) if p.endswith(".kv"))
                         if h]
                snapshots.append(sorted(snaps, key=lambda h: h["tokens"]))
                r2 = start_reame(home, "r%d-restart" % r)
                if not args.no_server:
                    s2 = start_server("r%d-restart" % r)
                for srv in (r2, s2):
                    if srv is not None:
                        ready_and_warm(srv)
                measure("reame", "restart", r2, qc)
                wait_snapshots(kv_dir, r2)
                if s2:
                    measure("server", "restart", s2, qc)
                    s2.close()
                    noise.mark_reaped(s2.proc.pid)
                    s2 = None
                # 3. a second Reame process on the same REAME_HOME, while the first still runs.
                r3 = start_reame(home, "r%d-second" % r)
                ready_and_warm(r3)
                if r2.proc.poll() is not None:
                    raise RuntimeError("the restarted reame serve exited before the second process ran")
                measure("reame", "second", r3, qd)
            finally:
                for srv in (r3, r2, r1):
                    if srv is not None:
                        exit_codes.append(stop_graceful(srv, noise))
                for srv in (s1, s2):
                    if srv is not None:
                        srv.close()
                        noise.mark_reaped(srv.proc.pid)
                log("prefix cache: repeat %d servers stopped" % (r + 1))
    finally:
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    return prefix_summary(args, runs, snapshots, cmds, exit_codes, settings, {
        "system_tokens": sys_tokens, "prompt_tokens_reame": prompt_tokens, "system_chars": len(system),
        "questions": questions, "ctx_per_slot": ctx, "n_batch": batch, "chunk": chunk, "logs": log_dir})


def prefix_summary(args, runs: dict, snapshots: list, cmds: dict, exit_codes: list, settings: dict,
                   info: dict) -> dict:
    def med(side, case, key="ttft_s"):
        return median([x[key] for x in runs[side][case]])

    table = {}
    for case in ("cold", "warm", "restart", "second"):
        row = {}
        for side in ("reame", "server"):
            xs = runs[side][case]
            if not xs:
                continue
            row[side] = {"ttft_s": med(side, case), "ttft_runs": [x["ttft_s"] for x in xs],
                         "cached_tokens": [x["cached_tokens"] for x in xs],
                         "prompt_tokens": [x["prompt_tokens"] for x in xs],
                         "noise": [x["noise"] for x in xs]}
        r, s = row.get("reame", {}).get("ttft_s"), row.get("server", {}).get("ttft_s")
        row["server_over_reame"] = (s / r) if r and s is not None else None
        table[case] = row
    rc, rw, rr, rs = (med("reame", c) for c in ("cold", "warm", "restart", "second"))
    sw = med("server", "warm")
    ratios = {"reame_cold_over_restart": (rc / rr) if rc and rr else None,
              "reame_cold_over_warm": (rc / rw) if rc and rw else None,
              "reame_cold_over_second": (rc / rs) if rc and rs else None,
              "server_warm_over_reame_warm": (sw / rw) if sw and rw else None}
    goals = {"restart_at_most_1_20_of_cold": (rr * 20 <= rc) if rc and rr else None,
             "reame_warm_no_worse_than_server_warm": (rw <= sw) if rw and sw else None}
    # Snapshot size per 1k tokens, compressed vs raw. Headline: the largest snapshot (the one a
    # restart restores); sizes need not grow linearly (sliding-window layers keep only their window).
    flat = [h for rep in snapshots for h in rep if h.get("tokens") and h.get("raw_size") and h.get("size")]
    for h in flat:
        h["raw_bytes_per_1k_tokens"] = 1000 * h["raw_size"] / h["tokens"]
        h["compressed_bytes_per_1k_tokens"] = 1000 * h["size"] / h["tokens"]
        h["compression_ratio"] = h["raw_size"] / h["size"]
    size = {"files": len(flat), "codec": sorted(set(h["codec"] for h in flat if h.get("codec")))}
    if flat:
        big = max(flat, key=lambda h: h["tokens"])
        size.update({"largest_tokens": big["tokens"], "raw_bytes_per_1k_tokens": big["raw_bytes_per_1k_tokens"],
                     "compressed_bytes_per_1k_tokens": big["compressed_bytes_per_1k_tokens"],
                     "compression_ratio": big["compression_ratio"],
                     "all_files_compression_ratio": sum(h["raw_size"] for h in flat) / sum(h["size"] for h in flat),
                     "disk_bytes_first_repeat": sum(h["file_bytes"] for h in snapshots[0])})
    texts = {}
    for case in ("cold", "warm", "restart"):
        pairs = list(zip(runs["reame"][case], runs["server"][case]))
        if pairs:
            texts[case] = "%d/%d" % (sum(a["text"] == b["text"] for a, b in pairs), len(pairs))
    return {"config": dict(info, model=os.path.basename(reame.resolve_model(args.model, pull=False)),
                           repeats=args.repeats, threads=args.threads, max_tokens=args.prefix_gen_tokens,
                           parallel=1, server_cache_ram=args.server_cache_ram,
                           request="POST /v1/chat/completions, messages [system handbook, user question], "
                                   "stream, stream_options.include_usage, temperature 0, cache_prompt true%s"
                                   % (", samplers [top_k], top_k 1" if args.server_sampling == "greedy" else ""),
                           reame_settings=settings, reame_cmd=cmds.get("reame"), server_cmd=cmds.get("server"),
                           reame_exit_codes=exit_codes),
            "table": table, "ratios": ratios, "goals": goals, "snapshot_size": size, "snapshots": snapshots,
            "text_identical": texts,
            "runs": runs}


def print_prefix(p: dict, w) -> None:
    c = p["config"]
    w("Prefix cache: a %d-token system prompt (an employee handbook) + short questions, %s, max_tokens %d, "
      "%d repeat%s\n" % (c["system_tokens"], c["model"], c["max_tokens"], c["repeats"],
                         "" if c["repeats"] == 1 else "s (medians)"))
    w("(reame.py serve --parallel 1 on a fresh temporary REAME_HOME vs llama-server -np 1 --cache-ram %s, "
      "%d threads, ctx %d; TTFT = send to first content chunk, client side)\n"
      % (c["server_cache_ram"], c["threads"], c["ctx_per_slot"]))
    w("\n%-34s %10s %16s %10s %16s %9s\n" % ("case (question)", "Reame s", "cached/prompt", "server s",
                                            "cached/prompt", "srv/Reame"))
    w("-" * 100 + "\n")
    labels = {"cold": "cold: fresh process + cache (A)", "warm": "warm: same process (B)",
              "restart": "after restart: new process (C)", "second": "second process, same home (D)"}

    def cell(row, side):
        d = row.get(side)
        if not d:
            return "-", "-"
        ttft = _fmt(d["ttft_s"], 3) + ("*" if any((z or 0) > NOISY_FRAC for z in d["noise"]) else "")
        cached = "/".join(["%s" % (d["cached_tokens"][0] if d["cached_tokens"] else "-"),
                           "%s" % (d["prompt_tokens"][0] if d["prompt_tokens"] else "-")])
        return ttft, cached

    for case, row in p["table"].items():
        rt, rcache = cell(row, "reame")
        st, scache = cell(row, "server")
        ratio = row.get("server_over_reame")
        w("%-34s %10s %16s %10s %16s %9s\n" % (labels[case], rt, rcache, st, scache,
                                                (_fmt(ratio, 2) + "x") if ratio is not None else "-"))
    w("(cached/prompt: usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens of the first repeat; "
      "llama-server: timings.cache_n where usage has none. llama-server has no disk tier: its 'after restart' "
      "is a cold start. srv/Reame > 1 means Reame is faster. * = noisy run)\n")
    if c["repeats"] > 1:
        for case, row in p["table"].items():
            w("  runs %-8s Reame %s | server %s\n" % (case, " ".join(_fmt(x, 3) for x in row.get("reame", {}).get(
                "ttft_runs", [])), " ".join(_fmt(x, 3) for x in row.get("server", {}).get("ttft_runs", []))))
    r, g = p["ratios"], p["goals"]

    def verdict(v):
        return "-" if v is None else ("met" if v else "NOT MET")

    w("\nReame cold / after-restart TTFT: %sx   (goal >= 20x: %s)\n"
      % (_fmt(r["reame_cold_over_restart"], 1), verdict(g["restart_at_most_1_20_of_cold"])))
    w("Reame cold / warm TTFT: %sx; cold / second process: %sx\n"
      % (_fmt(r["reame_cold_over_warm"], 1), _fmt(r["reame_cold_over_second"], 1)))
    w("Reame warm vs llama-server warm: server/Reame %sx   (goal >= 1, no worse: %s)\n"
      % (_fmt(r["server_warm_over_reame_warm"], 2), verdict(g["reame_warm_no_worse_than_server_warm"])))
    s = p["snapshot_size"]
    if s["files"]:
        w("snapshot size per 1k tokens (largest snapshot, %d tokens): %.2f MiB raw, %.2f MiB compressed "
          "(%s, %.2fx smaller); all %d files: %.2fx, %.1f MiB on disk after the first process\n"
          % (s["largest_tokens"], s["raw_bytes_per_1k_tokens"] / 2 ** 20, s["compressed_bytes_per_1k_tokens"] / 2 ** 20,
             "/".join(s["codec"]), s["compression_ratio"], s["files"], s["all_files_compression_ratio"],
             s["disk_bytes_first_repeat"] / 2 ** 20))
        for h in p["snapshots"][0]:
            w("  %5d tokens: %7.1f MiB raw -> %7.1f MiB %s (%.2f -> %.2f MiB per 1k tokens)\n"
              % (h["tokens"], h["raw_size"] / 2 ** 20, h["size"] / 2 ** 20, h["codec"],
                 h["raw_bytes_per_1k_tokens"] / 2 ** 20, h["compressed_bytes_per_1k_tokens"] / 2 ** 20))
    else:
        w("no snapshot files were written\n")
    if p["text_identical"]:
        w("greedy text identical Reame vs server: %s\n" % ", ".join("%s %s" % kv for kv in p["text_identical"].items()))
    w("Reame exit codes after SIGTERM: %s\n" % c["reame_exit_codes"])
    w("prefix cache Reame:  %s\n" % c["reame_cmd"])
    if c["server_cmd"]:
        w("prefix cache server: %s\n" % c["server_cmd"])
    w("server logs: %s\n" % c["logs"])


def run_prefix_only(args) -> dict:
    """--prefix-cache: only the prefix-cache section."""
    noise = CpuNoise()
    pc = run_prefix_cache(args, noise)
    return {"config": {"model": pc["config"]["model"], "threads": args.threads, "repeats": args.repeats,
                       "server_sampling": None if args.no_server else args.server_sampling,
                       "reame_version": getattr(reame, "__version__", "?")},
            "prefix_cache": pc, "noise": noise.report()}


# -- the workload trace (--workload) -------------------------------------------------------

WORKLOAD_FAQ = [
    "How many vacation days do I get in my first year?",
    "Can I expense a taxi home after working late?",
    "How long may I work remotely from another country?",
    "Who approves overtime?",
    "What is the notice period when I resign?",
    "Is there a budget for training courses?",
    "How do I report a safety incident in the warehouse?",
    "Can I bring my dog to the office?",
]
WORKLOAD_HOWTO = [
    "List, as numbered steps, how I request parental leave.",
    "List, as numbered steps, how I claim travel expenses.",
    "List, as numbered steps, what I do on my last working day.",
]
WORKLOAD_TICKETS = [
    "Ticket 4411 from Jana Novak (Gdansk): my laptop screen flickers since Monday, I need it fixed before the "
    "audit on Friday.",
    "Ticket 4412 from Luca Bianchi (Milan): payroll paid me 200 euros too little in March, please correct it.",
    "Ticket 4413 from Emma Weber (Vienna): the badge reader at gate 3 rejects my card every morning.",
]
WORKLOAD_TICKET_SCHEMA = {
    "type": "object",
    "properties": {"ticket": {"type": "integer"}, "name": {"type": "string"}, "site": {"type": "string"},
                   "department": {"enum": ["HR", "Finance", "IT", "Facilities", "Payroll"]},
                   "urgent": {"type": "boolean"}, "summary": {"type": "string"}},
    "required": ["ticket", "name", "site", "department", "urgent", "summary"],
}
WORKLOAD_CODE = [
    ("Rename the variable `total` to `subtotal` everywhere and return the whole function.",
     "def invoice_total(lines, vat_rate):\n    total = 0\n    for qty, price in lines:\n        total += qty * price\n"
     "    vat = total * vat_rate\n    return round(total + vat, 2)\n"),
    ("Add a `discount` parameter (default 0) subtracted from the total before VAT; return the whole function.",
     "def invoice_total(lines, vat_rate):\n    total = 0\n    for qty, price in lines:\n        total += qty * price\n"
     "    vat = total * vat_rate\n    return round(total + vat, 2)\n"),
]
WORKLOAD_CODE_SYSTEM = "You are a careful Python assistant. Answer with code only, in one ```python block."
# The trace: 32 requests a support desk might get in an hour, in this order. A request
# names (kind, index); 16 are new and 16 repeat an earlier one word for word (FAQs get
# asked again), the repeats leaning to the end: the shape of a narrow, repetitive workload.
WORKLOAD_ORDER = [
    ("faq", 0), ("howto", 0), ("faq", 1), ("ticket", 0), ("faq", 2), ("code", 0), ("howto", 1), ("faq", 3),
    ("faq", 0), ("ticket", 1), ("faq", 4), ("howto", 0), ("faq", 1), ("code", 1), ("faq", 5), ("ticket", 2),
    ("howto", 2), ("faq", 2), ("faq", 6), ("ticket", 0), ("faq", 3), ("howto", 1), ("faq", 7), ("code", 0),
    ("faq", 0), ("faq", 4), ("howto", 2), ("faq", 1), ("ticket", 1), ("faq", 5), ("howto", 0), ("faq", 2),
]
WORKLOAD_MAX_TOKENS = {"faq": 64, "howto": 128, "ticket": 96, "code": 160}
WORKLOAD_PHASES = ("server_cold", "server_warm", "reame_cold", "reame_warm", "reame_restart", "reame_restart_noreplay")


def workload_bodies(system: str, replay: bool = True) -> list:
    """The trace's request bodies (streamed chat, temperature 0, usage), the same for both servers
    (llama-server ignores Reame's extension object; replay=False sets "reame": {"replay": false})."""
    out = []
    for kind, i in WORKLOAD_ORDER:
        body = {"max_tokens": WORKLOAD_MAX_TOKENS[kind], "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if not replay:
            body["reame"] = {"replay": False}
        if kind == "code":
            ask, code = WORKLOAD_CODE[i]
            body["messages"] = [{"role": "system", "content": WORKLOAD_CODE_SYSTEM},
                                {"role": "user", "content": "```python\n%s```\n%s" % (code, ask)}]
        else:
            q = {"faq": WORKLOAD_FAQ, "howto": WORKLOAD_HOWTO}.get(kind, WORKLOAD_TICKETS)[i]
            if kind == "ticket":
                q = "Extract the ticket as JSON: " + q
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "ticket", "schema": WORKLOAD_TICKET_SCHEMA}}
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        out.append(("%s %d" % (kind, i + 1), json.dumps(body).encode()))
    return out


def workload_pass(srv: ServerProcess, bodies: list, clients: int) -> dict:
    """The trace through srv by `clients` threads taking the next request in order."""
    results, cursor, lock = [None] * len(bodies), [0], threading.Lock()

    def client():
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(bodies):
                return
            results[i] = dict(chat_stream(srv.port, bodies[i][1]), name=bodies[i][0])

    def run_all():
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, name="bench-workload-%d" % k, daemon=True) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0
    total = srv.guarded(run_all)
    if any(r is None for r in results):
        raise RuntimeError("%s: a workload request got no answer" % srv.name)
    walls = [r["total_s"] for r in results]
    return {"total_s": total, "requests": results, "first8_s": sum(walls[:8]) / 8, "last8_s": sum(walls[-8:]) / 8,
            "replayed": sum(r["replayed"] for r in results)}


class LlamaServerDefaults(ServerProcess):
    """llama-server as a user starts it: the model, host and port, nothing else (its own
    threads, context, slots, KV layout, repacking and prompt cache)."""

    name = "llama-server (defaults)"

    def __init__(self, binary: str, model_path: str, log_path: str):
        if not os.access(binary, os.X_OK):
            raise SystemExit("llama-server not found at %s: build it with ./build_llama.sh --with-server" % binary)
        self.log_path = log_path
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.args = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(self.port)]
        env = dict(os.environ)
        libdir = os.path.dirname(os.path.abspath(binary))
        env["LD_LIBRARY_PATH"] = libdir + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        self._start(env)


def run_workload(args) -> dict:
    """--workload: the trace against llama-server's defaults (cold, then the trace again in the
    same process) and against `reame.py serve` with its defaults: cold (an empty REAME_HOME),
    warm (the trace again) and after a restart (a new process on the same REAME_HOME), then
    the trace once more in that process with replay off per request (what the disk tier,
    warm-ahead and the archive give a trace that is not word for word), with 1 and 4 clients."""
    model_path = reame.resolve_model(args.model, pull=False)
    with reame.Model(model_path) as m:
        system, n_sys = fit_handbook(m, args.handbook_tokens)
    bodies = workload_bodies(system)
    no_replay = workload_bodies(system, replay=False)
    log_dir = tempfile.mkdtemp(prefix="bench-workload-logs-")
    serve_help = ServerProcess.help_text([sys.executable, REAME_SCRIPT, "serve", "--help"])
    noise = CpuNoise()
    out = {"config": {"model": os.path.basename(model_path), "handbook_tokens": n_sys, "requests": len(bodies),
                      "repeats_in_trace": len(WORKLOAD_ORDER) - len(set(WORKLOAD_ORDER)),
                      "clients": args.workload_clients, "threads": args.threads},
           "runs": {}, "cmds": {}}
    warmup = json.dumps({"messages": [{"role": "user", "content": "Reply with one word: ready?"}], "max_tokens": 2,
                         "temperature": 0, "stream": True}).encode()

    def ready(srv):
        srv.wait_ready()
        srv.guarded(chat_stream, srv.port, warmup)  # untimed: pages the weights in

    for clients in args.workload_clients:
        runs = out["runs"][str(clients)] = {}
        if not args.no_server:
            srv = LlamaServerDefaults(args.server, model_path, os.path.join(log_dir, "server-%d.log" % clients))
            out["cmds"]["server"] = " ".join(srv.args)
            try:
                ready(srv)
                for phase in ("cold", "warm"):
                    log("workload: llama-server, %d client(s), %s" % (clients, phase))
                    runs["server_" + phase] = workload_pass(srv, bodies, clients)
            finally:
                srv.close()
        home = tempfile.mkdtemp(prefix="bench-workload-home-")
        env = dict(os.environ, REAME_HOME=home)
        for start in ("first", "restart"):
            srv = ReameServer(model_path, threads=args.threads, n_parallel=4, ctx_per_slot=4096, n_batch=512,
                              log_path=os.path.join(log_dir, "reame-%d-%s.log" % (clients, start)),
                              help_text=serve_help, env=env)
            out["cmds"]["reame"] = "REAME_HOME=%s %s" % (home, " ".join(srv.args))
            try:
                ready(srv)
                for phase in (("cold", "warm") if start == "first" else ("restart", "restart_noreplay")):
                    log("workload: reame, %d client(s), %s" % (clients, phase))
                    runs["reame_" + phase] = workload_pass(srv, no_replay if phase.endswith("noreplay") else bodies,
                                                           clients)
            finally:
                srv.close()
        shutil.rmtree(home, ignore_errors=True)
        texts = [[r["text"] for r in runs["reame_" + p]["requests"]]
                 for p in ("cold", "warm", "restart", "restart_noreplay")]
        runs["reame_phases_equal"] = all(t == texts[0] for t in texts)
        if "server_cold" in runs:
            runs["same_text_as_server"] = sum(a == b["text"] for a, b in zip(texts[0], runs["server_cold"]["requests"]))
    out["noise"] = noise.report()
    if args.plot:
        out["plot"] = plot_workload(out, args.plot)
    return out


def plot_workload(out: dict, path: str) -> str:
    """Per-request bars of every phase (one panel per client count) as a PNG; matplotlib
    is optional (bench.py only): without it, say so and skip."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("workload: no matplotlib (python3 -m pip install matplotlib): no plot")
        return ""
    panels = list(out["runs"].items())
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4.2 * len(panels)), squeeze=False)
    for ax, (clients, runs) in zip(axes[:, 0], panels):
        phases = [p for p in WORKLOAD_PHASES if p in runs]
        width = 0.8 / len(phases)
        for k, p in enumerate(phases):
            walls = [r["total_s"] for r in runs[p]["requests"]]
            ax.bar([i + k * width for i in range(len(walls))], walls, width, label="%s (%.0f s in all)"
                   % (p.replace("_", " ").replace("server", "llama-server"), runs[p]["total_s"]))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(WORKLOAD_ORDER))])
        ax.set_xticklabels([r["name"] for r in runs[phases[0]]["requests"]], rotation=70, fontsize=7)
        ax.set_ylabel("seconds per request")
        ax.set_title("%s, %s client(s): the support-desk trace, request by request" % (out["config"]["model"], clients))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def print_workload(wl: dict, w) -> None:
    c = wl["config"]
    w("workload: %s, %d requests (%d repeat an earlier one word for word), a %d-token handbook system prompt\n"
      % (c["model"], c["requests"], c["repeats_in_trace"], c["handbook_tokens"]))
    w("per phase: seconds for the whole trace; ratio = llama-server cold / this (> 1: faster than llama-server "
      "as a user starts it); mean seconds per request of the first 8 and the last 8; answers replayed\n\n")
    for clients, runs in wl["runs"].items():
        base = runs.get("server_cold", {}).get("total_s")
        w("%s client(s)\n%-22s %9s %8s %9s %9s %9s\n" % (clients, "phase", "total s", "ratio", "first 8", "last 8",
                                                         "replayed"))
        for p in WORKLOAD_PHASES:
            if p not in runs:
                continue
            r = runs[p]
            w("%-22s %9.1f %8s %9.2f %9.2f %9d\n" % (p.replace("server", "llama-server").replace("_", " "),
                                                     r["total_s"], "%.2fx" % (base / r["total_s"]) if base else "-",
                                                     r["first8_s"], r["last8_s"], r["replayed"]))
        w("Reame's answers equal in its four phases: %s" % ("yes" if runs["reame_phases_equal"] else "NO"))
        if "same_text_as_server" in runs:
            w("; the same text as llama-server's: %d of %d" % (runs["same_text_as_server"], c["requests"]))
        w("\n\n")
    for side, cmd in wl["cmds"].items():
        w("%s: %s\n" % (side, cmd))
    if wl.get("plot"):
        w("plot: %s\n" % wl["plot"])


def run_warm_ahead(args) -> dict:
    """--warm-ahead: the first request after a restart, with and without idle warm-ahead.
    A handbook chat is asked once (its head goes to the disk tier), then `repeats` times:
    a new engine on that cache directory (a restart) sits idle 3 s, and one new question
    comes; time to its first token with warm-ahead on (the head restored into a slot while
    idle) and off (the request restores it itself), alternating."""
    model_path = reame.resolve_model(args.model, pull=False)
    kv = tempfile.mkdtemp(prefix="bench-warm-kv-")
    out = {"on": [], "off": [], "cached": {}}
    try:
        def ask(eng, q):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            tokens = eng.chat_prompt(msgs)
            snap = eng.prefix_boundary(msgs, tokens)
            t0 = time.perf_counter()  # (submit reads the disk tier, on this thread: part of the wait)
            req = eng.submit_n(tokens, reame.SamplingParams(temperature=0, max_tokens=4), snap_at=snap,
                               replay=False)[0]
            next(iter(req))
            ttft = time.perf_counter() - t0
            return ttft, req.wait()
        with reame.Model(model_path) as m:
            system, n_sys = fit_handbook(m, args.handbook_tokens)
            for _ in range(2):  # counted twice in the head history: a head worth warming
                with reame.Engine(m, n_ctx=4096, n_slots=1, n_threads=args.threads, disk_cache=1 << 31,
                                  disk_dir=kv) as eng:
                    ask(eng, HANDBOOK_QUESTIONS[0])
            for rep in range(args.repeats):
                for mode in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                    with reame.Engine(m, n_ctx=4096, n_slots=1, n_threads=args.threads, disk_cache=1 << 31,
                                      disk_dir=kv, warm_ahead=mode == "on") as eng:
                        time.sleep(3.0)
                        ttft, res = ask(eng, HANDBOOK_QUESTIONS[1 + rep % 3])
                        out[mode].append(ttft)
                        out["cached"][mode] = res.n_cached_tok
                        log("warm-ahead %s: TTFT %.3f s (%d prompt tokens cached)" % (mode, ttft, res.n_cached_tok))
    finally:
        shutil.rmtree(kv, ignore_errors=True)
    out.update(handbook_tokens=n_sys, on_median=median(out["on"]), off_median=median(out["off"]))
    return out


def print_warm_ahead(wa: dict, w) -> None:
    w("warm-ahead: the first request after a restart (a %d-token handbook head on the disk tier, 3 s idle)\n"
      % wa["handbook_tokens"])
    w("  TTFT with warm-ahead %.3f s, without %.3f s (medians; runs %s | %s): %.1fx\n" % (
        wa["on_median"], wa["off_median"], " ".join("%.3f" % x for x in wa["on"]),
        " ".join("%.3f" % x for x in wa["off"]), wa["off_median"] / max(wa["on_median"], 1e-9)))


def run_workload_only(args) -> dict:
    return {"config": {"model": args.model, "threads": args.threads}, "workload": run_workload(args)}


def run_warm_ahead_only(args) -> dict:
    return {"config": {"model": args.model, "threads": args.threads}, "warm_ahead": run_warm_ahead(args)}


# -- speculation (--spec) ----------------------------------------------------------------

SPEC_REPORT = "\n\n".join(
    "%d. %s" % (i + 1, p) for i, p in enumerate([
        "The Harbour Board met on the third of March to review the winter season. Forty-two vessels used "
        "the north basin between November and February, eleven more than the year before, and the new "
        "fuel pontoon handled just over nine hundred thousand litres without a single reported spill.",
        "Dredging of the approach channel was delayed by six weeks because the contractor's barge was held "
        "at Rotterdam for repairs. The channel depth at low water fell to 7.4 metres in January, and two "
        "deep-draught tankers had to wait for the tide before entering.",
        "The board approved a budget of 1.2 million euros for replacing the timber fenders on the east quay. "
        "Work will start in May, when traffic is lighter, and the quay will stay open to small craft during "
        "the works, with a speed limit of four knots inside the basin.",
        "Complaints about noise from the container crane rose to nineteen this winter. The harbour master "
        "proposed limiting night operations to essential cargo between midnight and five in the morning, "
        "and the board asked for a trial of three months starting in April.",
        "Finally, the board thanked the pilots' association for forty years of service without a serious "
        "accident, and agreed to name the new pilot boat after Captain Ilse Varga, who retired in December "
        "after twenty-six years on the station."])
)

SPEC_CODE = '''def summarize_orders(orders, min_total=0.0):
    """Group orders by customer and return totals, counts and the largest order."""
    by_customer = {}
    for order in orders:
        customer = order["customer"]
        total = float(order["total"])
        if total < min_total:
            continue
        entry = by_customer.setdefault(customer, {"count": 0, "sum": 0.0, "largest": None})
        entry["count"] += 1
        entry["sum"] += total
        if entry["largest"] is None or total > entry["largest"]["total"]:
            entry["largest"] = order
    result = []
    for customer, entry in sorted(by_customer.items()):
        average = entry["sum"] / entry["count"]
        result.append({
            "customer": customer,
            "orders": entry["count"],
            "total": round(entry["sum"], 2),
            "average": round(average, 2),
            "largest_id": entry["largest"]["id"],
        })
    return result
'''

SPEC_WORKLOADS = [
    ("input-grounded", "Here is the board's report:\n\n" + SPEC_REPORT +
     "\n\nQuote paragraphs 2, 3 and 4 of the report exactly, word for word, with their numbers."),
    ("code edit", "Here is a Python function:\n\n```python\n" + SPEC_CODE + "```\n\nReturn the whole function "
     "with one change: rename the parameter `min_total` to `minimum`. Reply with only the code."),
    ("free prose", "Write a short story (about 300 words) about a lighthouse keeper who finds a message in a "
     "bottle. Do not use any lists."),
]


class CpuBurner:
    """A busy process pinned to one core: an oversubscribed vCPU."""

    def __init__(self, core: int = 0):
        code = "import os\nos.sched_setaffinity(0, {%d})\nwhile True:\n    pass\n" % core
        self.proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=_set_pdeathsig)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def result_tok_s(r) -> Optional[float]:
    """Decode tok/s of a Result: tokens after the first over the time after the first."""
    span = r.total_s - r.ttft_s
    return (r.n_gen_tok - 1) / span if span > 0 and r.n_gen_tok > 1 else None


def spec_decode(eng, tokens: list, max_tokens: int, opts=None, archive="shared", **params) -> dict:
    """One greedy request: its decode tok/s, tokens, and (accepted, proposed) drafts by source.
    params: more SamplingParams fields (grammar, schema)."""
    before = eng.stats()["spec"]
    r = eng.submit(tokens, reame.SamplingParams(temperature=0, max_tokens=max_tokens, **params), spec=opts,
                   archive=archive).wait()
    after = eng.stats()["spec"]
    acc = {name: (after[name]["accepted"] - before[name]["accepted"],
                  after[name]["proposed"] - before[name]["proposed"]) for name in after}
    return {"tok_s": result_tok_s(r),
            "tokens": r.tokens, "n": r.n_gen_tok, "accepted": acc}


def run_spec(args) -> dict:
    """Speculation on vs off on three workloads, without and with a CPU burner on one core.

    One engine at a time: the exact engine's configurations, then the fast engine's,
    each phase with its own "off" (the same one-token steps) as their base. Two live
    engines are two OpenMP thread teams on 2 cores, and libgomp then barely spins at a
    barrier: a one-token step of the 1.5B took 34 ms instead of 19 ms in both."""
    target = reame.resolve_model(args.model)
    draft = reame.resolve_model(args.spec_draft)
    # (name, options, engine): "exact" verifies drafts row by row (the greedy contract);
    # "fast" lets steps with drafts use ggml's tiled matmul (Engine(spec_verify="fast")).
    configs = [("off", reame.SpecOptions("off"), "exact"),
               ("lookup on", reame.SpecOptions("on", args.spec_max, ("lookup",)), "exact"),
               ("draft on", reame.SpecOptions("on", args.spec_draft_k, ("draft",)), "exact"),
               ("auto", reame.SpecOptions("auto", args.spec_max), "exact"),
               ("off, fast engine", reame.SpecOptions("off"), "fast"),
               ("lookup on, fast", reame.SpecOptions("on", args.spec_max, ("lookup",)), "fast"),
               ("auto, fast", reame.SpecOptions("auto", args.spec_max), "fast")]
    noise = CpuNoise()
    model, draft_model = reame.Model(target), reame.Model(draft)  # weights shared by both engines
    out = {"config": {"model": args.model, "draft": args.spec_draft, "threads": args.threads,
                      "repeats": args.repeats, "gen_tokens": args.gen_tokens, "spec_max": args.spec_max,
                      "draft_k": args.spec_draft_k}, "conditions": {}, "controller": {}, "cost_model_s": {}}
    conds = ("idle", "burner on core 0")
    names = [name for name, _ in SPEC_WORKLOADS]
    runs = {cond: {name: {c: [] for c, _, _ in configs} for name in names} for cond in conds}
    accepted = {cond: {name: {c: {} for c, _, _ in configs} for name in names} for cond in conds}
    refs: dict = {}                                              # (cond, name, rep) -> exact greedy tokens
    equal = {cond: {name: True for name in names} for cond in conds}       # exact configs: must hold
    fast_equal = {cond: {name: True for name in names} for cond in conds}  # fast configs: may not
    try:
        for verify in ("exact", "fast"):
            phase = [c for c in configs if c[2] == verify]
            eng = reame.Engine(model, n_ctx=args.ctx, n_slots=len(SPEC_WORKLOADS), n_threads=args.threads,
                               draft=draft_model, spec_verify=verify)
            try:
                prompts = [(name, chat_tokens(eng, text)) for name, text in SPEC_WORKLOADS]
                for name, toks in prompts:  # prefill once: later runs reuse the prompt's KV (target and draft)
                    log("spec: warming %s (%d prompt tokens, %s engine)" % (name, len(toks), verify))
                    spec_decode(eng, toks, 2, configs[0][1])
                for cond in conds:
                    burner = CpuBurner(0) if cond != "idle" else None
                    try:
                        for rep in range(args.repeats):
                            for name, toks in prompts:
                                for cname, opts, _ in (phase if rep % 2 == 0 else phase[::-1]):
                                    r = spec_decode(eng, toks, args.gen_tokens, opts)
                                    runs[cond][name][cname].append(r["tok_s"])
                                    for src, (a, p) in r["accepted"].items():
                                        tot = accepted[cond][name][cname].setdefault(src, [0, 0])
                                        tot[0] += a
                                        tot[1] += p
                                    ref = refs.setdefault((cond, name, rep), r["tokens"])
                                    if verify == "exact" or cname.startswith("off"):
                                        equal[cond][name] = equal[cond][name] and r["tokens"] == ref
                                    else:
                                        fast_equal[cond][name] = fast_equal[cond][name] and r["tokens"] == ref
                                    log("spec [%s] %s / %s: %.2f tok/s (%d tokens)" % (
                                        cond, name, cname, r["tok_s"] or 0, r["n"]))
                    finally:
                        if burner is not None:
                            burner.stop()
                out["controller"][verify] = eng.stats()["spec"]
                out["cost_model_s"][verify] = {str(k): t for k, t in sorted(eng.spec.cost.known().items())}
            finally:
                eng.close()
        for cond in conds:
            table = {}
            for name in names:
                row = runs[cond][name]
                base = {v: median(row["off"] if v == "exact" else row["off, fast engine"]) for v in ("exact", "fast")}
                table[name] = {c: {"tok_s": row[c], "median": median(row[c]),
                                   "ratio": median(row[c]) / base[v] if base[v] else None,
                                   "accepted": accepted[cond][name][c]} for c, _, v in configs}
                table[name]["greedy_equal"] = equal[cond][name]
                table[name]["fast_equal"] = fast_equal[cond][name]
            out["conditions"][cond] = table
    finally:
        model.close()
        draft_model.close()
    out["noise"] = noise.report()
    return out


def print_spec(sp: dict, w) -> None:
    c = sp["config"]
    w("Speculation: %s, draft %s (k=%d when forced), lookup up to %d, %d threads, %d tokens, %d repeats\n"
      % (c["model"], c["draft"], c["draft_k"], c["spec_max"], c["threads"], c["gen_tokens"], c["repeats"]))
    for cond, table in sp["conditions"].items():
        w("\n  [%s] decode tok/s (ratio to off); accepted/proposed drafts\n" % cond)
        for name, row in table.items():
            cells = []
            for cname in ("off", "lookup on", "draft on", "auto", "off, fast engine", "lookup on, fast",
                          "auto, fast"):
                r = row[cname]
                acc = ", ".join("%s %d/%d" % (s, a, p) for s, (a, p) in sorted(r["accepted"].items()) if p)
                cells.append("%s %s (x%s)%s" % (cname, _fmt(r["median"], 2), _fmt(r["ratio"], 2),
                                                " [%s]" % acc if acc else ""))
            w("  %-15s\n    %s\n    greedy output: exact configs %s; fast configs %s\n" % (
                name, "\n    ".join(cells), "equal" if row["greedy_equal"] else "MISMATCH (a bug)",
                "equal" if row["fast_equal"] else "differ (allowed: near-ties)"))
    for v, costs in sp["cost_model_s"].items():
        w("\n  cost model, %s (s per target step by tokens): %s\n" % (v, ", ".join(
            "%s: %.3f" % (k, t) for k, t in list(costs.items())[:14])))


def run_spec_only(args) -> dict:
    """--spec: only the speculation section."""
    return {"spec": run_spec(args), "config": {"model": args.model, "threads": args.threads,
                                               "reame_version": getattr(reame, "__version__", "?")}}


# -- decode step cost by tokens (--step-cost) -------------------------------------------------

def run_step_cost(args) -> dict:
    """Seconds of one decode llama_decode (row by row, as decode steps run) with k tokens
    of one sequence after a 300-token prompt, k = 1..33, rounds alternating, medians."""
    model = reame.Model(reame.resolve_model(args.model))
    ctx = reame.Context(model, n_ctx=2048, n_seq_max=1, n_batch=512, n_threads=args.threads)
    sizes, times = (1, 2, 3, 4, 5, 8, 12, 16, 17, 24, 33), {}
    try:
        toks = model.tokenize("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 30)[:300]
        b = reame.Batch(512)
        for i, tok in enumerate(toks):
            b.add(tok, i, 0, i == len(toks) - 1)
        ctx.decode(b)
        for rnd in range(args.repeats):
            for k in (sizes if rnd % 2 == 0 else sizes[::-1]):
                b.clear()
                for j in range(k):
                    b.add(toks[j], len(toks) + j, 0, True)
                t0 = time.perf_counter()
                ctx.decode(b, rowwise=True)
                times.setdefault(k, []).append(time.perf_counter() - t0)
                ctx.seq_rm(0, len(toks), -1)
    finally:
        ctx.close()
        model.close()
    one = median(times[1])
    return {"config": {"model": args.model, "threads": args.threads, "repeats": args.repeats},
            "step_s": {k: median(v) for k, v in times.items()}, "ratio": {k: median(v) / one for k, v in times.items()}}


def run_step_cost_against(args) -> dict:
    """--step-cost --against LIB: the same step costs with this checkout's libraries and
    with another libllama (an older build, say), one process per library and round, the
    order alternating, so the two are measured side by side on the same noisy machine."""
    libs = [("this", os.environ.get("REAME_LIBLLAMA", "")), ("against", args.against)]
    times = {name: {} for name, _ in libs}
    for rnd in range(args.repeats):
        for name, lib in (libs if rnd % 2 == 0 else libs[::-1]):
            fd, path = tempfile.mkstemp(prefix="bench-step-", suffix=".json")
            os.close(fd)
            try:
                env = dict(os.environ, REAME_LIBLLAMA=lib) if lib else {k: v for k, v in os.environ.items() if k != "REAME_LIBLLAMA"}
                subprocess.run([sys.executable, os.path.abspath(__file__), "--step-cost", "--repeats", "3",
                                "--model", args.model, "--threads", str(args.threads), "--save-json", path],
                               env=env, check=True, stdout=subprocess.DEVNULL)
                with open(path) as f:
                    for k, sec in json.load(f)["step_cost"]["step_s"].items():
                        times[name].setdefault(int(k), []).append(sec)
            finally:
                os.unlink(path)
        log("step cost round %d/%d done" % (rnd + 1, args.repeats))
    out = {"config": {"model": args.model, "threads": args.threads, "repeats": args.repeats, "against": args.against}}
    for name in times:
        one = median(times[name][1])
        out[name] = {"step_s": {k: median(v) for k, v in times[name].items()},
                     "ratio": {k: median(v) / one for k, v in times[name].items()}}
    out["this_vs_against"] = {k: out["this"]["step_s"][k] / out["against"]["step_s"][k] for k in out["this"]["step_s"]}
    return out


def print_step_cost(sc: dict, w) -> None:
    if "against" in sc:
        c = sc["config"]
        w("Decode step cost: %s, %d threads, %d alternating rounds (medians); k tokens in one step as a "
          "multiple of one token:\n" % (c["model"], c["threads"], c["repeats"]))
        for name, label in (("this", "this checkout"), ("against", c["against"])):
            w("  %s (one token %.1f ms):\n    %s\n" % (label, 1e3 * sc[name]["step_s"][1], "  ".join(
                "%d: %.2fx" % (k, r) for k, r in sc[name]["ratio"].items())))
        w("  this checkout's step time / the other's: %s\n" % "  ".join(
            "%d: %.2f" % (k, r) for k, r in sc["this_vs_against"].items()))
        return
    c = sc["config"]
    w("Decode step cost: %s, %d threads, medians of %d; one token %.1f ms; k tokens in one step as a "
      "multiple of one token:\n  %s\n" % (c["model"], c["threads"], c["repeats"], 1e3 * sc["step_s"][1],
                                          "  ".join("%d: %.2fx" % (k, r) for k, r in sc["ratio"].items())))


# -- Il Suggeritore (--suggest) ----------------------------------------------------------------

SUGGEST_RECORD = {"type": "object", "required": ["name", "city", "age", "job", "email"], "properties": {
    "name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"}, "job": {"type": "string", "maxLength": 40},
    "email": {"type": "string", "maxLength": 60}}}
SUGGEST_SCHEMA = {"type": "array", "items": SUGGEST_RECORD, "minItems": 10, "maxItems": 10}
SUGGEST_JSON = ("Invent 10 people. Reply with only a JSON array of 10 objects, each with the fields name, city, "
                "age, job and email.")
# (name, prompt, json_schema or None); each measured run asks about other things (the
# prompt's %s), so no run repeats an earlier one's content
SUGGEST_WORKLOADS = [
    ("numbered list", "List 20 %s, as a numbered list, one per line, a short phrase each, nothing else.", None,
     ["things to pack for a week of hiking", "ideas for a rainy Sunday", "ways to save water at home"]),
    ("JSON records", SUGGEST_JSON + " They all live in %s.", None, ["Norway", "Chile", "Japan"]),
    ("markdown table", "Make a markdown table of 12 %s with the columns Name, Origin, Year and Note. "
     "Reply with only the table.", None, ["famous bridges", "old board games", "classic cars"]),
    ("prose", "Write a short story (about 200 words) about %s. Do not use any lists.", None,
     ["a lighthouse keeper and a lost kite", "a baker who can hear bread rise", "a map that redraws itself"]),
    ("JSON records, json_schema", SUGGEST_JSON + " They all live in %s.", SUGGEST_SCHEMA,
     ["Peru", "Kenya", "Iceland"]),
    ("tool call, named", "Add 8 invented people who live in %s to my contacts.", "tool",
     ["Portugal", "Ghana", "Canada"]),
]
# the tool-call workload: one call of this function, forced by name (tool_choice), its
# arguments constrained by its schema as reame.py serve does it (Qwen2.5's Hermes format)
SUGGEST_TOOL = {"type": "function", "function": {
    "name": "add_contacts", "description": "Add people to the address book.",
    "parameters": {"type": "object", "required": ["people"], "properties": {
        "people": {"type": "array", "items": SUGGEST_RECORD, "minItems": 8, "maxItems": 8}}}}}


def _line_ends_told(ref_text: str):
    """The list rule given the greedy text in advance (an oracle, not a rule): at each
    point, the coming line end and next number too (``\n12.`` after an item's last
    word), which no rule can see. It measures what structure drafts could give here if
    they knew where each item ends: the ceiling above the list rule on this CPU."""
    def told(w) -> str:
        if not ref_text.startswith(w.text):
            return ""
        m = re.match(r"\.?\n\d+[.)]|\d+[.)]", ref_text[len(w.text):])
        return m.group(0) if m else ""
    return told


def run_suggest(args) -> dict:
    """Il Suggeritore on (auto, its rules as the only sources) vs off (no speculation)
    on five workloads, alternating, in one run; greedy outputs compared."""
    model = reame.Model(reame.resolve_model(args.model))
    eng = reame.Engine(model, n_ctx=args.ctx, n_slots=2, n_threads=args.threads, draft=None)
    configs = [("off", reame.SpecOptions("off")), ("on", reame.SpecOptions("auto", args.spec_max, ("suggest",)))]
    out = {"config": {"model": args.model, "threads": args.threads, "repeats": args.repeats,
                      "gen_tokens": args.gen_tokens}, "workloads": {}}
    noise = CpuNoise()
    try:
        for name, prompt, schema, topics in SUGGEST_WORKLOADS:
            if args.suggest_only and args.suggest_only not in name:
                continue
            tool = schema == "tool"
            if tool:
                grammar = reame.tools_grammar("hermes", [SUGGEST_TOOL], "add_contacts", False)
                schema = reame.tool_call_schema("hermes", [SUGGEST_TOOL], "add_contacts")
            else:
                grammar = reame.json_schema_grammar(schema) if schema else None
            runs = {c: [] for c, _ in configs}
            acc, n_gen, equal = {}, 0, True
            for rep in range(args.repeats):
                ask = prompt % topics[rep % len(topics)]
                turns = reame.tool_messages("hermes", [{"role": "user", "content": ask}], [SUGGEST_TOOL])
                toks = eng.chat_prompt(turns) if tool else chat_tokens(eng, ask)
                eng.submit(toks, reame.SamplingParams(temperature=0, max_tokens=1), archive=None).wait()  # warm KV
                ref = None
                for cname, opts in (configs if rep % 2 == 0 else configs[::-1]):
                    r = spec_decode(eng, toks, args.gen_tokens, opts, archive=None, grammar=grammar, schema=schema)
                    runs[cname].append(r["tok_s"])
                    if cname == "on":
                        n_gen += r["n"]
                        for src, (a, p) in r["accepted"].items():
                            if src.startswith("suggest."):
                                tot = acc.setdefault(src, [0, 0])
                                tot[0] += a
                                tot[1] += p
                    equal = equal and (ref is None or r["tokens"] == ref)
                    ref = r["tokens"] if ref is None else ref
                    log("suggest: %s / %s: %.2f tok/s (%d tokens)" % (name, cname, r["tok_s"] or 0, r["n"]))
                if name == "numbered list":  # the ceiling: line ends told (after the pair: it needs the text)
                    src = eng.spec.sources["suggest.list"]
                    rule, src._fn = src._fn, _line_ends_told(eng.model.detokenize(ref))
                    try:
                        r = spec_decode(eng, toks, args.gen_tokens, configs[1][1], archive=None)
                    finally:
                        src._fn = rule
                    runs.setdefault("told", []).append(r["tok_s"])
                    equal = equal and r["tokens"] == ref
                    log("suggest: %s / line ends told: %.2f tok/s" % (name, r["tok_s"] or 0))
            base = median(runs["off"])
            n_acc = sum(a for a, _ in acc.values())
            out["workloads"][name] = {"tok_s": runs, "off": base, "on": median(runs["on"]),
                                      "ratio": median(runs["on"]) / base if base else None,
                                      "told_ratio": median(runs["told"]) / base if "told" in runs and base else None,
                                      "accepted": acc, "accepted_share": n_acc / n_gen if n_gen else None,
                                      "greedy_equal": equal, "constrained": schema is not None}
    finally:
        eng.close()
        model.close()
    out["noise"] = noise.report()
    return out


def print_suggest(sg: dict, w) -> None:
    c = sg["config"]
    w("Il Suggeritore: %s, %d threads, up to %d tokens, %d repeats (a new topic each); decode tok/s, "
      "on = its rules as the only draft sources (auto), off = no speculation\n" % (
          c["model"], c["threads"], c["gen_tokens"], c["repeats"]))
    for name, r in sg["workloads"].items():
        acc = ", ".join("%s %d/%d" % (s[8:], a, p) for s, (a, p) in sorted(r["accepted"].items()) if p)
        w("  %-28s off %s  on %s  (x%s)  drafted share %s  [%s]  greedy %s\n" % (
            name, _fmt(r["off"], 2), _fmt(r["on"], 2), _fmt(r["ratio"], 2),
            "-" if r["accepted_share"] is None else "%.0f%%" % (100 * r["accepted_share"]), acc or "no drafts",
            "equal" if r["greedy_equal"] else "MISMATCH (a bug)"))
        if r.get("told_ratio"):
            w("    (the ceiling: the same rule told each line end in advance, an oracle no rule can be: x%.2f)\n"
              % r["told_ratio"])


def run_suggest_only(args) -> dict:
    return {"suggest": run_suggest(args), "config": {"model": args.model, "threads": args.threads,
                                                     "reame_version": getattr(reame, "__version__", "?")}}


# -- Palimpsest (--palimpsest) -------------------------------------------------------------

PAL_FUNCTION = ("Write a Python function `load_inventory(path)` of about 40 lines that reads a CSV file of "
                "warehouse items (columns: sku, name, quantity, unit_price, location), skips blank and malformed "
                "rows with a warning, and returns a dict mapping each location to a list of item dicts and the "
                "total stock value of that location. Reply with only the code.")
PAL_EMAIL = ("Write a short order confirmation email to %s for order #%d: %d items, delivery on %s. "
             "Sign it 'The Northwind Team'.")
PAL_STORY = "Write a short story (about 200 words) about %s. Do not use any lists."
# (name, prompts generated before (the archive), the measured prompts: one per repeat, cycled;
# new ones where a measured run's own output, archived, would make the next repeat a repeat)
PAL_WORKLOADS = [
    ("same question", ["Explain in about 120 words how a refrigerator keeps food cold."],
     ["Explain in about 120 words how a refrigerator keeps food cold."]),
    ("template",
     [PAL_EMAIL % x for x in (("Alice Moreau", 10442, 3, "Monday"), ("Bruno Kessler", 10451, 5, "Thursday"),
                              ("Chiara Neri", 10468, 2, "Friday"))],
     [PAL_EMAIL % x for x in (("Dmitri Volkov", 10477, 4, "Tuesday"), ("Elena Popescu", 10485, 6, "Wednesday"),
                              ("Farid Haddad", 10490, 1, "Saturday"), ("Greta Lindqvist", 10502, 7, "Monday"))]),
    ("function + 1 change", [PAL_FUNCTION],
     [PAL_FUNCTION + " " + change for change in (
         "Name the function `read_inventory`.", "Use `csv.reader` instead of `csv.DictReader`.",
         "Skip rows whose quantity is zero.", "Round each location's total to two decimals.")]),
    ("fresh prose", [], [PAL_STORY % t for t in (
        "a clockmaker who builds a clock that runs backwards", "a beekeeper on a rooftop in Naples",
        "a cartographer who maps a city that keeps changing", "a night-train conductor who collects lost gloves")]),
]


def archive_index_cost(n_tok: int) -> dict:
    """Build time and bytes of the archive index for n_tok tokens of text-like runs."""
    rng = random.Random(3)
    words = [rng.randrange(150000) for _ in range(5000)]
    idx = reame.ArchiveIndex()
    while len(idx.tokens) < n_tok:  # runs of 200-600 tokens, Zipf-ish word choice
        idx.append([words[min(int(rng.paretovariate(1.1)) - 1, 4999)] for _ in range(rng.randrange(200, 600))])
    t0 = time.perf_counter()
    built = reame.ArchiveIndex.build(idx.tokens, idx.lengths)
    dt = time.perf_counter() - t0
    idx.install(built, len(idx.tokens))
    n = len(idx.tokens)
    return {"tokens": n, "build_s": dt, "bytes": idx.nbytes(), "bytes_per_mtok": idx.nbytes() / n * 1e6,
            "numpy": reame._np is not None}


def run_palimpsest(args) -> dict:
    """Archive on vs off (the request's opt-out) on four workloads, after a restart."""
    root = tempfile.mkdtemp(prefix="bench-palimpsest-")
    model = reame.Model(reame.resolve_model(args.model))
    out = {"config": {"model": args.model, "threads": args.threads, "repeats": args.repeats,
                      "gen_tokens": args.gen_tokens}, "workloads": {}}
    params = reame.SamplingParams(temperature=0, max_tokens=args.gen_tokens)
    noise = CpuNoise()
    try:
        eng = reame.Engine(model, n_ctx=args.ctx, n_slots=1, n_threads=args.threads, archive=256 << 20,
                           archive_dir=root, draft=None)
        for name, before, _ in PAL_WORKLOADS:  # the archive: generations of an earlier process
            for text in before:
                log("palimpsest: archiving %s: %s..." % (name, text[:40]))
                eng.submit(chat_tokens(eng, text), params).wait()
        eng.close()
        eng = reame.Engine(model, n_ctx=args.ctx, n_slots=1, n_threads=args.threads, archive=256 << 20,
                           archive_dir=root, draft=None)  # restarted: reads the archive from disk
        for name, _, texts in PAL_WORKLOADS:
            runs, acc, outs = {"off": [], "on": []}, {"off": [0, 0], "on": [0, 0]}, {"off": [], "on": []}
            equal = True
            for rep in range(args.repeats):
                toks = chat_tokens(eng, texts[rep % len(texts)])
                eng.submit(toks, reame.SamplingParams(temperature=0, max_tokens=2), archive=None).wait()  # warm KV
                ref = None
                for cfg in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    r = spec_decode(eng, toks, args.gen_tokens, archive="shared" if cfg == "on" else None)
                    runs[cfg].append(r["tok_s"])
                    for src in ("archive", "archive.resync"):
                        acc[cfg][0] += r["accepted"][src][0]
                        acc[cfg][1] += r["accepted"][src][1]
                    outs[cfg].append(r["tokens"])
                    equal = equal and (ref is None or r["tokens"] == ref)
                    ref = r["tokens"]
                    log("palimpsest %s / archive %s: %.2f tok/s (%d tokens)" % (name, cfg, runs[cfg][-1] or 0, r["n"]))
                    if cfg == "on":
                        eng.archive.flush()
            off, on = median(runs["off"]), median(runs["on"])
            out["workloads"][name] = {"off": runs["off"], "on": runs["on"], "ratio": on / off if off else None,
                                      "accepted": acc["on"], "tokens": len(outs["on"][0]),
                                      "greedy_equal": equal}
        out["archive"] = eng.stats()["archive"]
        eng.close()
    finally:
        model.close()
        shutil.rmtree(root, ignore_errors=True)
    log("palimpsest: index build cost")
    out["index"] = [archive_index_cost(n) for n in (1_000_000, args.archive_index_tokens)]
    out["noise"] = noise.report()
    return out


def print_palimpsest(pl: dict, w) -> None:
    c = pl["config"]
    w("Palimpsest: %s, %d threads, %d tokens, median of %d alternating repeats, after a restart; "
      "archive on vs the request's opt-out (prompt lookup on in both)\n" % (
          c["model"], c["threads"], c["gen_tokens"], c["repeats"]))
    for name, r in pl["workloads"].items():
        w("  %-22s off %s  on %s  x%s  archive drafts accepted %d/%d  greedy %s\n" % (
            name, _fmt(median(r["off"]), 2), _fmt(median(r["on"]), 2), _fmt(r["ratio"], 2),
            r["accepted"][0], r["accepted"][1], "equal" if r["greedy_equal"] else "MISMATCH (a bug)"))
    for ix in pl["index"]:
        w("  index of %d tokens: built in %.2f s (%s), %.1f MB (%.1f MB per million tokens)\n" % (
            ix["tokens"], ix["build_s"], "numpy" if ix["numpy"] else "standard library", ix["bytes"] / 1e6,
            ix["bytes_per_mtok"] / 1e6))


def run_palimpsest_only(args) -> dict:
    """--palimpsest: only the Palimpsest section."""
    return {"palimpsest": run_palimpsest(args), "config": {"model": args.model, "threads": args.threads,
                                                           "reame_version": getattr(reame, "__version__", "?")}}


# -- the Conclave (--conclave) ------------------------------------------------------------

QUIZ = [("What is 17 multiplied by 23?", "391"),
        ("A train travels at 60 km per hour for 2.5 hours. How many km does it travel?", "150"),
        ("Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples does he have left?", "27"),
        ("What is 144 divided by 12, plus 7?", "19"),
        ("A shirt costs 40 dollars and is discounted by 25 percent. What is the new price in dollars?", "30"),
        ("5 workers build a wall in 12 days. How many days do 10 workers need at the same rate?", "6"),
        ("What is the sum of the whole numbers from 1 to 10?", "55"),
        ("Anna is 3 times as old as her son, who is 12. How old will Anna be in 5 years?", "41")]
QUIZ_SUFFIX = " Reply briefly and end with the final answer as a number on the last line."


def run_conclave_bench(args) -> dict:
    """An 8-question quiz: one greedy answer, 5 sequential samples voted, the Conclave of 5."""
    model = reame.Model(reame.resolve_model(args.model))
    eng = reame.Engine(model, n_ctx=args.ctx, n_slots=args.best_of, n_threads=args.threads, draft=None)
    n, out = args.best_of, {"config": {"model": args.model, "threads": args.threads, "best_of": args.best_of,
                                      "max_tokens": args.gen_tokens, "questions": len(QUIZ)}}
    noise = CpuNoise()
    rows = {"greedy": [], "sequential": [], "conclave": []}
    times = {k: 0.0 for k in rows}
    try:
        prompts = [chat_tokens(eng, q + QUIZ_SUFFIX) for q, _ in QUIZ]
        for p in prompts:  # warm the prompts' KV: every configuration starts from the same cache
            eng.submit(p, reame.SamplingParams(temperature=0, max_tokens=1), archive=None).wait()
        for qi, ((q, right), p) in enumerate(zip(QUIZ, prompts)):
            t0 = time.perf_counter()
            r = eng.submit(p, reame.SamplingParams(temperature=0, max_tokens=args.gen_tokens), archive=None).wait()
            times["greedy"] += time.perf_counter() - t0
            rows["greedy"].append(reame.extract_answer(r.text, "last_number"))
            t0 = time.perf_counter()
            answers = []
            for i in range(n):
                r = eng.submit(p, reame.SamplingParams(temperature=0.7, seed=100 * qi + i,
                                                       max_tokens=args.gen_tokens), archive=None).wait()
                answers.append(reame.extract_answer(r.text, "last_number"))
            times["sequential"] += time.perf_counter() - t0
            rows["sequential"].append(reame.conclave_vote(answers, n)[0])
            t0 = time.perf_counter()
            res = reame.run_conclave(eng, p, reame.SamplingParams(temperature=0.7, seed=100 * qi,
                                                                  max_tokens=args.gen_tokens), n, archive=None)
            times["conclave"] += time.perf_counter() - t0
            rows["conclave"].append(res.answer)
            log("conclave: Q%d (%s): greedy %s, sequential %s, conclave %s (votes %s, %d cancelled)" % (
                qi + 1, right, rows["greedy"][-1], rows["sequential"][-1], res.answer, res.votes, res.n_cancelled))
    finally:
        eng.close()
        model.close()
    out["results"] = {k: {"answers": v, "correct": sum(a == right for a, (_, right) in zip(v, QUIZ)),
                          "wall_s": times[k]} for k, v in rows.items()}
    out["noise"] = noise.report()
    return out


def print_conclave(cb: dict, w) -> None:
    c = cb["config"]
    w("The Conclave: %s, %d threads, %d questions, best of %d, up to %d tokens per answer\n" % (
        c["model"], c["threads"], c["questions"], c["best_of"], c["max_tokens"]))
    seq = cb["results"]["sequential"]["wall_s"]
    for k, label in (("greedy", "one greedy answer"), ("sequential", "%d samples, one after another, voted"
                                                        % c["best_of"]),
                     ("conclave", "the Conclave (%d in one batch, early stop)" % c["best_of"])):
        r = cb["results"][k]
        w("  %-44s %d/%d correct  %6.1f s  (%.2fx the sequential time)\n" % (
            label, r["correct"], c["questions"], r["wall_s"], r["wall_s"] / seq if seq else 0))


def run_conclave_only(args) -> dict:
    """--conclave: only the Conclave section."""
    return {"conclave": run_conclave_bench(args), "config": {"model": args.model, "threads": args.threads,
                                                             "reame_version": getattr(reame, "__version__", "?")}}


# -- soak: one reame.py serve under load, attacks and disconnects --------------------


SOAK_KEYS = ("soak-key-tenant-a", "soak-key-tenant-b")  # two tenants: sessions are scoped per key
SOAK_CTX, SOAK_PARALLEL = 1024, 4
SOAK_CLIENTS, SOAK_ATTACKERS = 8, 2
SOAK_REQUEST_S = 120.0   # a normal request's time limit (8 clients share 4 slots on a small machine)
SOAK_ATTACK_S = 30.0     # an attack's time limit (all ask for <= 48 tokens): past it, 'timeout'
SOAK_HEALTH_MAX_S = 1.0  # /health slower than this fails the soak
SOAK_DRAIN_S = 60.0      # after the load: time for threads to finish and for /metrics to read idle
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class SoakError(Exception):
    """A normal soak request that did not get its answer (HTTP error, error event, cut stream)."""


def soak_owner(key: str) -> str:
    """Reame's identity for an API key (Server.authorized): its session files live under it."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def soak_requests() -> list:
    """The normal requests of --soak: greedy (temperature 0) and short, so each has one right
    answer, the one it gets alone; over both keys, both endpoints, streamed and not, n=2, a
    json_schema, and two-turn sessions (each run gets a fresh session id, so the second turn
    always continues the same first one)."""
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}

    def chat(text, max_tokens, **kw):
        return dict({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0}, **kw)

    def comp(prompt, max_tokens, **kw):
        return dict({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, **kw)

    usage = {"include_usage": True}
    return [
        {"name": "chat", "key": 0, "path": CHAT, "turns": [chat("Name three primary colors.", 24)]},
        {"name": "chat-stream", "key": 1, "path": CHAT,
         "turns": [chat("Write one sentence about the sea.", 32, stream=True)]},
        {"name": "chat-system-stream", "key": 0, "path": CHAT, "turns": [dict(chat(
            "What is 12 times 7?", 16, stream=True, stream_options=usage), messages=[
                {"role": "system", "content": "You answer in one short line."},
                {"role": "user", "content": "What is 12 times 7?"}])]},
        {"name": "completion", "key": 1, "path": COMPLETIONS, "turns": [comp("The capital of France is", 16)]},
        {"name": "completion-stream", "key": 0, "path": COMPLETIONS,
         "turns": [comp("def fibonacci(n):\n", 48, stream=True, stream_options=usage)]},
        {"name": "chat-n2", "key": 1, "path": CHAT, "turns": [chat("Give me a name for a cat.", 20, n=2)]},
        {"name": "completion-n2-stream", "key": 0, "path": COMPLETIONS,
         "turns": [comp("A list of fruits: apple,", 16, n=2, stream=True)]},
        {"name": "chat-json-schema", "key": 0, "path": CHAT,
         "turns": [chat("Describe a person as JSON.", 40, response_format=schema)]},
        {"name": "chat-json-schema-stream", "key": 1, "path": CHAT,
         "turns": [chat("Invent a fictional person; answer as JSON.", 40, response_format=schema, stream=True)]},
        {"name": "completion-long", "key": 1, "path": COMPLETIONS,
         "turns": [comp("Once upon a time, in a small village,", 48)]},
        {"name": "chat-session", "key": 1, "path": CHAT, "session": True,
         "turns": [chat("My name is Ada. Say hello to me.", 24), chat("What is my name?", 16)]},
        {"name": "completion-session-stream", "key": 0, "path": COMPLETIONS, "session": True,
         "turns": [comp("Q: What is 2 + 2?\nA:", 16, stream=True), comp("\nQ: And 3 + 3?\nA:", 16, stream=True)]},
    ]


def soak_call(port: int, key: str, path: str, body: dict, timeout_s: float = SOAK_REQUEST_S) -> str:
    """One normal request; its answer as text: the choices' texts (a stream's deltas
    concatenated per choice) joined by \\x1e in index order. SoakError unless it ended
    cleanly (200; a stream: no error event, and [DONE])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    texts = {}
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
        resp = conn.getresponse()
        if resp.status != 200:
            raise SoakError("HTTP %d: %s" % (resp.status, resp.read(300).decode("utf-8", "replace")))
        if not body.get("stream"):
            for c in json.loads(resp.read()).get("choices") or []:
                texts[c.get("index", 0)] = (c["message"].get("content") if "message" in c else c.get("text")) or ""
        else:
            while True:
                line = resp.readline()
                if not line:
                    raise SoakError("the stream ended without data: [DONE]")
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise SoakError("error event: %s" % json.dumps(chunk["error"])[:300])
                for c in chunk.get("choices") or []:
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    texts[c.get("index", 0)] = texts.get(c.get("index", 0), "") + (piece or "")
    except (OSError, http.client.HTTPException, ValueError, KeyError, AttributeError) as e:
        raise SoakError("%s: %s" % (type(e).__name__, str(e)[:200])) from None
    finally:
        conn.close()
    return "\x1e".join(texts[i] for i in sorted(texts))


def soak_delete_session(port: int, key: str, sid: str) -> None:
    """Best effort: sessions the soak made go away, so the server's session table stays small."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("DELETE", "/v1/sessions/" + sid, headers={"Authorization": "Bearer " + key})
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        pass
    finally:
        conn.close()


def soak_answer(port: int, req: dict) -> str:
    """A normal request's answer; a session's turns (on a fresh session id) joined by \\x1d."""
    key = SOAK_KEYS[req["key"]]
    if not req.get("session"):
        return soak_call(port, key, req["path"], req["turns"][0])
    sid = "soak-%s" % os.urandom(6).hex()
    try:
        return "\x1d".join(soak_call(port, key, req["path"], dict(b, session_id=sid)) for b in req["turns"])
    finally:
        soak_delete_session(port, key, sid)


# Attacks speak raw bytes: http.client would normalize the very headers they get wrong.

def raw_head(method: str, path: str, key: Optional[str] = None, body: bytes = b"", headers=(),
             length: bool = True) -> bytes:
    """An HTTP/1.1 request as bytes: Authorization for key, Content-Length for body unless
    length is False (the caller then frames the body itself in headers), then the body."""
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: 127.0.0.1"]
    if key is not None:
        lines.append("Authorization: Bearer " + key)
    if body:
        lines.append("Content-Type: application/json")
    if length and (body or method == "POST"):
        lines.append("Content-Length: %d" % len(body))
    lines += ["%s: %s" % kv for kv in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _recv(sock, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline")
    sock.settimeout(left)
    return sock.recv(65536)


def read_raw_response(sock, deadline: float, linger_s: float = 0.0) -> dict:
    """One HTTP response from sock: {"status": int, or "dropped" (closed or reset without a
    whole response head) or "timeout", "headers" (lower-case names), "body", "extra": bytes
    that came after it within linger_s on a connection left open}."""
    out = {"status": "dropped", "headers": {}, "body": b"", "extra": b""}
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            got = _recv(sock, deadline)
            if not got:
                return out
            buf += got
    except socket.timeout:
        return dict(out, status="timeout")
    except OSError:
        return out
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    m = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
    if not m:
        return dict(out, status="garbage", body=buf[:200])
    out["status"] = int(m.group(1))
    for line in lines[1:]:
        name, _, value = line.partition(":")
        out["headers"][name.strip().lower()] = value.strip()
    n = out["headers"].get("content-length")
    closed = False
    try:
        while (n is None or len(rest) < int(n)) and not closed:
            got = _recv(sock, deadline)
            closed = not got
            rest += got
    except (socket.timeout, OSError, ValueError):
        out["truncated"] = True
        closed = True
    cut = len(rest) if n is None or not n.isdigit() else int(n)
    out["body"], extra = rest[:cut], rest[cut:]
    end = time.monotonic() + linger_s
    try:
        while linger_s and not closed and time.monotonic() < end:
            got = _recv(sock, end)
            closed = not got
            extra += got
    except (socket.timeout, OSError):
        pass
    out["extra"] = extra
    return out


def raw_exchange(port: int, data: bytes, timeout_s: float = SOAK_ATTACK_S, linger_s: float = 0.0) -> dict:
    """Send data on a fresh connection and read one response (read_raw_response, plus
    "wall_s"). A second thread sends, so an answer that comes before the body is all sent
    (413 to a body over the limit) is read at once, before the server's close can reset it."""
    t0 = time.monotonic()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    except OSError as e:
        return {"status": "refused", "headers": {}, "body": str(e).encode(), "extra": b"", "wall_s": 0.0}
    sender = threading.Thread(target=lambda: _send_quietly(sock, data), name="soak-send", daemon=True)
    sender.start()
    try:
        out = read_raw_response(sock, t0 + timeout_s, linger_s)
    finally:
        _close_hard(sock)
        sender.join(5)
    out["wall_s"] = time.monotonic() - t0
    return out


def _send_quietly(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the server answered and closed before reading it all: that is allowed
        pass


def _close_hard(sock) -> None:
    """shutdown() first: it wakes a sendall blocked in another thread, close() alone does not."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def sse_events(body: bytes) -> tuple:
    """(the parsed data: payloads, whether data: [DONE] came) of an SSE body."""
    events, done = [], False
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                events.append(json.loads(payload))
            except ValueError:
                events.append({"unparsed": payload[:100].decode("utf-8", "replace")})
    return events, done


def is_sse(resp: dict) -> bool:
    return "text/event-stream" in resp["headers"].get("content-type", "")


def error_shape(body: bytes) -> Optional[str]:
    """None if body is the OpenAI error JSON {"error": {"message": str, "type": str}}, else what is wrong."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return "not JSON: %r" % body[:80]
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return "no error.message / error.type: %r" % body[:80]
    return None


def internal_error(err) -> Optional[str]:
    """What is wrong with an error object that reports an exception inside the server (Reame's
    "internal error ..." messages: a bug that a 503 or an error event only dresses up), or None."""
    msg = err.get("message") if isinstance(err, dict) else str(err)
    return "internal error: %s" % str(msg)[:120] if "internal error" in str(msg).lower() else None


def resp_choices(resp: dict) -> list:
    """[(text, finish_reason)] per choice of a 200 answer, JSON or SSE; ValueError if it has none."""
    if is_sse(resp):
        texts, finish = {}, {}
        for ev in sse_events(resp["body"])[0]:
            for c in ev.get("choices") or []:
                i = c.get("index", 0)
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                texts[i] = texts.get(i, "") + (piece or "")
                finish[i] = c.get("finish_reason") or finish.get(i)
        if not texts:
            raise ValueError("a stream without choices")
        return [(texts[i], finish.get(i)) for i in sorted(texts)]
    choices = json.loads(resp["body"]).get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError("no choices")
    return [((c["message"].get("content") if "message" in c else c.get("text")) or "", c.get("finish_reason"))
            for c in choices]


def judge(resp: dict, ok200=None, also=()) -> tuple:
    """(label, problem) of an attack's response: label the status ('dropped', 'timeout', ...);
    problem None when clean. Clean: 4xx or 503 (or a status in also) with the error JSON; a
    200 stream whose error event is followed by data: [DONE]; a 200 where the attack table
    allows one, when ok200(resp) finds nothing wrong with it (returns None)."""
    st = resp["status"]
    if not isinstance(st, int):
        return st, "no response (%s)" % st
    if 400 <= st < 500 or st == 503 or st in also:
        why = error_shape(resp["body"]) or internal_error(json.loads(resp["body"])["error"])
        return str(st), None if why is None else "%d %s" % (st, why)
    if st != 200:
        return str(st), "HTTP %d" % st
    if is_sse(resp):
        events, done = sse_events(resp["body"])
        errors = [e["error"] for e in events if "error" in e]
        if errors:
            why = internal_error(errors[0]) or (None if done else "an error event without data: [DONE] after it")
            return "200+sse-error", why
        if not done:
            return "200", "a stream cut short (no data: [DONE])"
    if ok200 is None:
        return "200", "200 where an error was due"
    try:
        why = ok200(resp)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = "unreadable answer (%s)" % e
    return "200", None if why is None else "200: %s" % why


def any_answer(resp: dict) -> Optional[str]:
    """ok200 for attacks a server may simply answer (within the time limit): a completion."""
    resp_choices(resp)
    return None


def only_texts(*allowed):
    """ok200: every choice's text is one of allowed (all a grammar lets through)."""
    def check(resp):
        bad = [t for t, _ in resp_choices(resp) if t not in allowed]
        return None if not bad else "text %r is outside the grammar" % bad[0][:60]
    return check


def nullable_person(resp: dict) -> Optional[str]:
    """ok200 for schema-nullable: a finished answer is JSON with name a string or null and age
    an integer or null."""
    for text, finish in resp_choices(resp):
        if finish == "length":
            continue
        obj = json.loads(text)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), (str, type(None)))
                and (obj.get("age") is None or type(obj.get("age")) is int)):
            return "answer %r does not match the schema" % text[:80]
    return None


def soak_post(port: int, path: str, body, key: Optional[str] = SOAK_KEYS[0], ok200=None, **kw) -> tuple:
    """An attack that is one POST: judged."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return judge(raw_exchange(port, raw_head("POST", path, key, data)), ok200, **kw)


_VICTIMS: dict = {}  # port -> (session id, secret): made once per server (each costs generations)
_VICTIMS_LOCK = threading.Lock()


def soak_victim(port: int) -> tuple:
    """(session id, secret): tenant B's session whose history holds a secret, made on first use
    and again whenever B cannot read it any more (an attack deleted it); tenant A also gets a
    session of its own first, so A's session directory exists (a path through it resolves)."""
    with _VICTIMS_LOCK:
        if port in _VICTIMS and not _victim_there(port, *_VICTIMS[port]):
            del _VICTIMS[port]
        if port not in _VICTIMS:
            _VICTIMS[port] = _make_victim(port)
        return _VICTIMS[port]


def _victim_there(port: int, sid: str, secret: str) -> bool:
    mine = raw_exchange(port, raw_head("GET", "/v1/sessions/" + sid, SOAK_KEYS[1]))
    return mine["status"] == 200 and secret.encode() in mine["body"]


def _make_victim(port: int) -> tuple:
    secret = "soak-secret-%s" % os.urandom(6).hex()
    sid = "soak-victim-%s" % os.urandom(4).hex()
    for key, s, text in ((SOAK_KEYS[0], "soak-own-%s" % os.urandom(4).hex(), "Hello."),
                         (SOAK_KEYS[1], sid, "Remember the code word %s." % secret)):
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0, "session_id": s}
        r = raw_exchange(port, raw_head("POST", CHAT, key, json.dumps(body).encode()))
        if r["status"] != 200:
            raise SoakError("creating the tenants' sessions: %s" % r["status"])
        if key == SOAK_KEYS[0]:
            soak_delete_session(port, key, s)  # its directory stays
    return sid, secret


def attack_session(port: int, method: str, path_fmt: str) -> tuple:
    """Tenant A reads (GET) or deletes (DELETE) tenant B's session through path_fmt ({sid}:
    B's session id, {owner}: B's directory). Clean: a 4xx, no byte of B's history in the
    answer, and (DELETE) B's session still there for B."""
    try:
        sid, secret = soak_victim(port)
    except SoakError as e:
        return "setup-failed", str(e)
    r = raw_exchange(port, raw_head(method, path_fmt.format(sid=sid, owner=soak_owner(SOAK_KEYS[1])), SOAK_KEYS[0]))
    label, problem = judge(r)
    if secret.encode() in r["body"]:
        problem = "LEAK: tenant B's session history in the answer to tenant A"
    if method == "DELETE" and not _victim_there(port, sid, secret):
        problem = problem or "tenant A's DELETE removed tenant B's session"
    return label, problem


def attack_smuggle(port: int) -> tuple:
    """A 401 (wrong key) POST on a keep-alive connection whose body is itself a request (with
    a valid key): the server must answer 401 once and never answer the body as a request."""
    inner = raw_head("GET", "/v1/models", SOAK_KEYS[1])
    r = raw_exchange(port, raw_head("POST", COMPLETIONS, "wrong-key", inner, headers=(("Connection", "keep-alive"),)),
                     linger_s=1.5)
    label, problem = judge(r)
    if r["status"] != 401:
        problem = problem or "%s, not 401, to a wrong key" % r["status"]
    if b"HTTP/1." in r["extra"]:
        problem = "SMUGGLED: the 401's body was answered as a second request: %r" % r["extra"][:60]
    return label, problem


def _framed(port: int, head_and_body: bytes, ok200=None, also=()) -> tuple:
    """A framing attack on a keep-alive connection: judged, and a second response (the
    server read part of the body as the next request) is a desync."""
    r = raw_exchange(port, head_and_body, linger_s=1.5)
    label, problem = judge(r, ok200, also)
    if b"HTTP/1." in r["extra"]:
        problem = "DESYNC: part of the body was answered as another request: %r" % r["extra"][:60]
    return label, problem


def _small_completion(size: Optional[int] = None) -> bytes:
    """A valid one-token completion request body, padded with spaces to size bytes."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
    return body + b" " * max(0, (size or 0) - len(body))


def attack_chunked(port: int) -> tuple:
    """Transfer-Encoding: chunked and no Content-Length: a 4xx or 501 (or a real answer:
    chunked is HTTP/1.1), never the chunk framing read as the next request."""
    body = _small_completion()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return _framed(port, raw_head("POST", COMPLETIONS, SOAK_KEYS[0], chunked, length=False,
                                  headers=(("Transfer-Encoding", "chunked"),)), any_answer, also=(501,))


def attack_content_length(port: int, *values: str) -> tuple:
    """Content-Length headers with the given values around a 64-byte valid body: a 400 (a
    lenient parser takes 6_4 as 64, or the first of two, and answers 200)."""
    body = _small_completion(64)
    return _framed(port, raw_head("POST", COMPLETIONS, SOAK_KEYS[0], body, length=False,
                                  headers=[("Content-Length", v) for v in values]))


def attack_big_body(port: int) -> tuple:
    """A body just over 8 MiB, all of it sent: 413 (a dropped socket is only noted: the server
    may close after answering while the body is still coming)."""
    body = b'{"prompt": "' + b"x" * (8 << 20) + b'", "max_tokens": 1}'
    return judge(raw_exchange(port, raw_head("POST", COMPLETIONS, SOAK_KEYS[0], body)))


def attack_idle_connections(port: int, n: int = 300) -> tuple:
    """n connections opened at once (non-blocking connects, all in flight together) that send
    nothing, then GET /health on one more: it must answer (200, or 503 from a connection cap)
    within 5 x SOAK_HEALTH_MAX_S. The label says how many of the n the kernel completed
    within 2 s (a server that caps connections leaves the rest in its backlog)."""
    import selectors
    socks, sel = [], selectors.DefaultSelector()
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
            sel.register(s, selectors.EVENT_WRITE)
        opened, deadline = 0, time.monotonic() + 2.0
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                sel.unregister(key.fileobj)
                opened += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        r = raw_exchange(port, raw_head("GET", "/health"), timeout_s=30)
    finally:
        sel.close()
        for s in socks:
            s.close()
    st = r["status"]
    label = "%s (%d/%d open)" % (st, opened, n)
    if st not in (200, 503):
        return label, "/health with %d idle connections open: %s" % (opened, st)
    if r["wall_s"] > 5 * SOAK_HEALTH_MAX_S:
        return label, "/health took %.1f s with %d idle connections open" % (r["wall_s"], opened)
    return label, None


DEAD_END = 'root ::= "a" <[999999]>'  # parses; after "a" no token (no such id), nor the end, is allowed
# A class that matches no character: llama.cpp still lets through tokens that are the first
# bytes of a character (a partial UTF-8 sequence might complete into one), so the text is
# "a" and replacement characters until max_tokens: answered, not refused.
EMPTY_CLASS = r'root ::= "a" [^\x00-\U0010FFFF]'


def soak_exponential_schema(levels: int = 6) -> dict:
    """Objects nested levels deep whose type is ["object"] x 4: expanded per type naively, the
    grammar grows 4^levels; the schema is ~600 bytes."""
    node = {"type": "string"}
    for i in range(levels):
        node = {"type": ["object"] * 4, "properties": {"k%d" % i: node, "v": {"type": ["string", "null"]}},
                "required": ["k%d" % i]}
    return node


def soak_attacks() -> list:
    """(name, framing, attack(port) -> (label, problem)). Framing attacks may end in a dropped
    socket (noted, not failed: a server may close on a request it cannot frame). The order is
    the run order: what only answers wrong first, what may crash or freeze the server last."""
    def chat(text, **kw):
        return dict({"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 8}, **kw)

    def comp(prompt, **kw):
        return dict({"prompt": prompt, "temperature": 0, "max_tokens": 8}, **kw)

    nullable = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": ["string", "null"]}, "age": {"type": ["integer", "null"]}}}
    deep = "root ::= " + "(" * 200000 + '"a"' + ")" * 200000
    redos = {"best_of": 2, "temperature": 0.8, "seed": 1, "max_tokens": 48, "reame": {"vote": "regex:(a+)+$"}}
    a = [
        ("session-other-key-get", False, lambda p: attack_session(p, "GET", "/v1/sessions/{sid}")),
        ("session-traversal-get", False, lambda p: attack_session(p, "GET", "/v1/sessions/../{owner}/{sid}")),
        ("session-traversal-get-encoded", False,
         lambda p: attack_session(p, "GET", "/v1/sessions/..%2F{owner}%2F{sid}")),
        ("session-traversal-delete", False,
         lambda p: attack_session(p, "DELETE", "/v1/sessions/../{owner}/{sid}")),
        ("session-traversal-delete-encoded", False,
         lambda p: attack_session(p, "DELETE", "/v1/sessions/..%2F{owner}%2F{sid}")),
        ("smuggle-in-401-body", True, attack_smuggle),
        ("transfer-encoding-chunked", True, attack_chunked),
        ("content-length-6_4", True, lambda p: attack_content_length(p, "6_4")),
        ("content-length-twice", True, lambda p: attack_content_length(p, "64", "71")),
        ("body-over-8mib", True, attack_big_body),
        ("idle-connections-300", True, attack_idle_connections),
        ("json-nested-100k", False, lambda p: soak_post(
            p, COMPLETIONS, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}")),
        ("stop-list-5000", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "Count: 1, 2, 3,", stop=["stop-%05d-%s" % (i, "x" * 80) for i in range(5000)]), ok200=any_answer)),
        ("stop-strings-long", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "Count: 1, 2, 3,", stop=[c * 250000 for c in "yzw"]), ok200=any_answer)),
        ("max-tokens-huge", False, lambda p: soak_post(p, CHAT, chat("Say OK.", max_tokens=10 ** 18),
                                                       ok200=any_answer)),
        ("unknown-fields", False, lambda p: soak_post(p, CHAT, chat(
            "Say OK.", logit_bias={"1": 100, "2": -100}, logprobs=True, top_logprobs=5, user="x",
            metadata={"k": "v"}, frobnicate={"x": [1, 2, 3]}), ok200=any_answer)),
        ("schema-nullable", False, lambda p: soak_post(p, CHAT, chat(
            "Describe a person as JSON.", max_tokens=48, response_format={
                "type": "json_schema", "json_schema": {"name": "p", "schema": nullable}}), ok200=nullable_person)),
        ("schema-exponential", False, lambda p: soak_post(p, CHAT, chat(
            "Answer with JSON.", max_tokens=32, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": soak_exponential_schema()}}),
            ok200=any_answer)),
        ("grammar-deep-parens", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "Answer:", grammar=deep, max_tokens=4), ok200=only_texts("a"))),
        ("grammar-empty-class", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "a", grammar=EMPTY_CLASS, repeat_penalty=1.1), ok200=any_answer)),
        ("grammar-dead-end-penalty", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "a", grammar=DEAD_END, repeat_penalty=1.1), ok200=only_texts("", "a"))),
        ("grammar-dead-end-stream", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "a", grammar=DEAD_END, stream=True), ok200=only_texts("", "a"))),
        ("grammar-dead-end-n2", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "a", grammar=DEAD_END, n=2), ok200=only_texts("", "a"))),
        ("grammar-dead-end-n4-stream", False, lambda p: soak_post(p, COMPLETIONS, comp(
            "a", grammar=DEAD_END, n=4, repeat_penalty=1.1, stream=True), ok200=only_texts("", "a"))),
        ("vote-regex-redos", False, lambda p: soak_post(p, COMPLETIONS, dict(
            redos, prompt="Write the letter a sixty times: " + "a" * 30), ok200=any_answer)),
        ("vote-regex-redos-grammar", False, lambda p: soak_post(p, COMPLETIONS, dict(
            redos, prompt="aaaa", grammar='root ::= "a"{40,60} "!"'), ok200=any_answer)),
    ]
    return a


# Disconnects: requests the client abandons; Reame must notice (or finish) and free the slot.

def _disconnect(port: int, data: bytes, wait_for: Optional[bytes] = None, hold_s: float = 0.0) -> str:
    """Send data, wait until wait_for arrives (or hold_s passes), close. Returns what happened."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    except OSError as e:
        return "refused (%s)" % e
    try:
        sock.sendall(data)
        if wait_for is not None:
            buf, deadline = b"", time.monotonic() + 30
            while wait_for not in buf:
                got = _recv(sock, deadline)
                if not got:
                    return "closed by the server first"
                buf += got
        time.sleep(hold_s)
        return "made"
    except OSError as e:
        return "error (%s)" % type(e).__name__
    finally:
        sock.close()


SOAK_DISCONNECTS = (  # name, disconnect(port) -> "made" or what happened instead
    ("stream-closed-after-first-chunk", lambda p: _disconnect(p, raw_head("POST", CHAT, SOAK_KEYS[0], json.dumps(
        {"messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}], "max_tokens": 64,
         "temperature": 0, "stream": True}).encode()), wait_for=b"data: ")),
    ("closed-before-answer", lambda p: _disconnect(p, raw_head("POST", COMPLETIONS, SOAK_KEYS[1], json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}).encode()), hold_s=0.3)),
    ("half-request-head", lambda p: _disconnect(
        p, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bea", hold_s=1.0)),
    ("body-shorter-than-content-length", lambda p: _disconnect(p, raw_head(
        "POST", COMPLETIONS, SOAK_KEYS[0], b'{"prompt": "Hi", "max_tokens": 1}', length=False,
        headers=(("Content-Length", "200"),)), hold_s=0.3)),
)


class SoakLog:
    """What the soak's threads saw, under one lock. Once closed (the load stopped, or the
    server died) nothing more is recorded: errors from requests cut by the end or the crash
    are not the server's answers, and are only counted (ignored)."""

    def __init__(self, srv: ServerProcess):
        self.srv = srv
        self.lock = threading.Lock()
        self.closed = False
        self.ignored = 0
        self.normal = {}      # name -> {"ok", "mismatch", "error", "examples"}
        self.attacks = {}     # name -> {"runs", "statuses": {label: n}, "problems": {problem: n}}
        self.disconnects = {}  # name -> {what happened: n}
        self.health = []      # latency of each good /health
        self.slow_probes = []  # (latency, what was in flight) of probes over a quarter of the limit
        self.health_failures = []
        self.in_flight = {}   # thread name -> (what, name, t0): what a crash interrupted
        self.recent = collections.deque(maxlen=64)  # (t_end, what, name): what ended just before it

    def _open(self) -> bool:
        if self.closed or self.srv.proc.poll() is not None:
            self.ignored += 1
            return False
        return True

    def normal_result(self, name: str, outcome: str, detail: Optional[str] = None) -> None:
        with self.lock:
            if not self._open():
                return
            d = self.normal.setdefault(name, {"ok": 0, "mismatch": 0, "error": 0, "examples": []})
            d[outcome] += 1
            if detail and len(d["examples"]) < 3:
                d["examples"].append(detail)

    def attack_result(self, name: str, label: str, problem: Optional[str]) -> None:
        with self.lock:
            if not self._open():
                return
            d = self.attacks.setdefault(name, {"runs": 0, "statuses": {}, "problems": {}})
            d["runs"] += 1
            d["statuses"][label] = d["statuses"].get(label, 0) + 1
            if problem:
                d["problems"][problem] = d["problems"].get(problem, 0) + 1

    def disconnect_result(self, name: str, what: str) -> None:
        with self.lock:
            if self._open():
                d = self.disconnects.setdefault(name, {})
                d[what] = d.get(what, 0) + 1

    def health_result(self, latency: float, failure: Optional[str]) -> None:
        with self.lock:
            if not self._open():
                return
            if failure is None:
                self.health.append(latency)
            else:
                self.health_failures.append("%s after %.2f s" % (failure, latency))

    def begin(self, what: str, name: str) -> None:
        with self.lock:
            self.in_flight[threading.current_thread().name] = (what, name, time.monotonic())

    def end(self) -> None:
        with self.lock:
            what, name, _ = self.in_flight.pop(threading.current_thread().name, (None, None, None))
            if what is not None:
                self.recent.append((time.monotonic(), what, name))


def soak_normal_client(i: int, port: int, reqs: list, solo: dict, lg: SoakLog, stop: threading.Event,
                       seed: int) -> None:
    """Loop over the normal requests in a seeded random order; each answer must be its solo answer."""
    rng = random.Random(seed * 1000 + i)
    while not stop.is_set():
        req = rng.choice(reqs)
        lg.begin("request", req["name"])
        try:
            got = soak_answer(port, req)
        except SoakError as e:
            time.sleep(0.5)  # a server that is dying cuts requests before it can be reaped: then
            lg.normal_result(req["name"], "error", str(e))  # this is not recorded (the crash is)
            continue
        finally:
            lg.end()
        if got == solo[req["name"]]:
            lg.normal_result(req["name"], "ok")
        else:
            lg.normal_result(req["name"], "mismatch", "solo %r, under load %r" % (solo[req["name"]][:120], got[:120]))


def soak_attacker(port: int, attacks: list, cursor: list, lg: SoakLog, stop: threading.Event) -> None:
    """Take the next attack of the shared cycle (attackers together run the table in order)."""
    while not stop.is_set() and attacks:
        with lg.lock:
            name, _framing, fn = attacks[cursor[0] % len(attacks)]
            cursor[0] += 1
        lg.begin("attack", name)
        try:
            label, problem = fn(port)
        except Exception as e:  # noqa: BLE001 - a harness bug must show, not kill the thread
            label, problem = "harness-error", "%s: %s" % (type(e).__name__, e)
        finally:
            lg.end()
        lg.attack_result(name, str(label), problem)
        time.sleep(0.1)


def soak_disconnecter(port: int, lg: SoakLog, stop: threading.Event) -> None:
    k = 0
    while not stop.is_set():
        name, fn = SOAK_DISCONNECTS[k % len(SOAK_DISCONNECTS)]
        k += 1
        lg.begin("disconnect", name)
        try:
            what = fn(port)
        finally:
            lg.end()
        lg.disconnect_result(name, what)
        stop.wait(0.5)  # a non-streamed request's slot stays busy until its answer: keep them few


# The /health prober runs in a process of its own: in bench.py's, its latency would include
# waiting for the GIL behind the 11 client threads, which is the client's delay, not the server's.
SOAK_PROBE_CHILD = r"""
import http.client, sys, time
port, every_s = int(sys.argv[1]), float(sys.argv[2])
while True:
    t0 = time.perf_counter()
    failure = "-"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            failure = "HTTP_%d" % r.status
    except (OSError, http.client.HTTPException) as e:
        failure = type(e).__name__
    finally:
        conn.close()
    dt = time.perf_counter() - t0
    print("%.6f %s" % (dt, failure), flush=True)
    time.sleep(max(0.5 if failure != "-" else 0.0, every_s - dt))
"""


def soak_prober(port: int, lg: SoakLog, stop: threading.Event, every_s: float = 0.5) -> None:
    """GET /health every every_s on a fresh connection, from a child process: latency, or
    what went wrong; a probe slower than a quarter of the limit notes what was in flight."""
    child = subprocess.Popen([sys.executable, "-c", SOAK_PROBE_CHILD, str(port), str(every_s)],
                             stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if stop.is_set():
                break
            dt_s, failure = line.split()
            dt = float(dt_s)
            if dt > SOAK_HEALTH_MAX_S / 4:
                with lg.lock:
                    flight = sorted({"%s %s" % (w, n) for w, n, _ in lg.in_flight.values()})
                lg.slow_probes.append((round(dt, 3), flight))
            lg.health_result(dt, None if failure == "-" else failure)
    finally:
        child.kill()
        child.wait()


def wait_soak_idle(srv: ServerProcess, timeout_s: float = SOAK_DRAIN_S) -> dict:
    """/metrics once reame_active_sequences and reame_queued_requests read 0 (or the last reading
    at timeout_s, {} if none could be read, or the server exited)."""
    deadline, m = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline and srv.proc.poll() is None:
        m = reame_metrics(srv, SOAK_KEYS[0]) or m
        if m.get("reame_active_sequences") == 0 and m.get("reame_queued_requests") == 0:
            return m
        time.sleep(0.5)
    return m


def soak_crash(srv: ServerProcess, lg: SoakLog, t_load: float) -> dict:
    """The server's exit, with what was in flight when it was seen gone, and the attacks and
    disconnects that ended in the 2 s before (the request that killed it may be answered
    'dropped' before the exit is seen)."""
    with lg.lock:
        lg.closed = True
        now = time.monotonic()
        flight = sorted({"%s %s" % (what, name) for what, name, _ in lg.in_flight.values()})
        flight += sorted({"%s %s (just ended)" % (what, name) for t, what, name in lg.recent
                          if now - t < 2.0 and what != "request"})
    return {"returncode": srv.proc.returncode, "at_s": round(time.monotonic() - t_load, 1), "in_flight": flight,
            "log_tail": srv.log_tail(15)}


def run_soak(args) -> dict:
    """--soak: one ``reame.py serve`` with two API keys under normal load, attacks and
    disconnects for --soak-seconds; every normal answer must equal its solo answer, every
    attack get a clean refusal, /health stay fast, and the server end idle (see the module
    docstring). A crash is recorded and ends the run."""
    reame.resolve_model(args.model, pull=False)  # pulled already: the soak never downloads
    home = tempfile.mkdtemp(prefix="bench-soak-home-")
    os.symlink(reame.Config.from_env().models_dir, os.path.join(home, "models"))
    log_dir = tempfile.mkdtemp(prefix="bench-soak-logs-")
    serve_help = ServerProcess.help_text([sys.executable, REAME_SCRIPT, "serve", "--help"])
    keys = [x for k in SOAK_KEYS for x in ("--api-key", k)]
    if help_knows(serve_help, "--no-replay"):  # the same normal requests again and again: computed, not replayed
        keys.append("--no-replay")
    all_attacks = soak_attacks()
    attacks = [a for a in all_attacks if args.soak_attacks is None or a[0] in args.soak_attacks]
    reqs = soak_requests()
    srv = ReameServer(args.model, threads=args.threads, n_parallel=SOAK_PARALLEL, ctx_per_slot=SOAK_CTX,
                      n_batch=args.batch, log_path=os.path.join(log_dir, "reame-serve.log"), help_text=serve_help,
                      env=dict(os.environ, REAME_HOME=home), extra_args=tuple(keys))
    lg = SoakLog(srv)
    out = {"config": {"model": args.model, "cmd": "REAME_HOME=%s %s" % (home, " ".join(srv.args)),
                      "seconds": args.soak_seconds, "clients": SOAK_CLIENTS, "attackers": SOAK_ATTACKERS,
                      "attacks": [a[0] for a in attacks], "log": srv.log_path, "seed": args.seed},
           "solo": {}, "solo_errors": {}, "crash": None}
    stop = threading.Event()
    threads = []
    try:
        srv.wait_ready()
        log("soak: reame serve pid %d on port %d (REAME_HOME %s); solo answers" % (srv.proc.pid, srv.port, home))
        for req in reqs:
            try:
                out["solo"][req["name"]] = soak_answer(srv.port, req)
            except SoakError as e:
                out["solo_errors"][req["name"]] = str(e)
            if srv.proc.poll() is not None:
                out["crash"] = soak_crash(srv, lg, time.monotonic())
                break
        live = [r for r in reqs if r["name"] in out["solo"]]
        if out["crash"] is None and any(a[0].startswith("session-") for a in attacks):
            try:  # before the load, so the session attacks do not wait behind it for their victim
                soak_victim(srv.port)
            except SoakError as e:
                log("soak: %s (the session attacks will try again)" % e)
        t_load = time.monotonic()
        if out["crash"] is None and live:
            log("soak: %d s of load: %d clients, %d attackers (%d attacks), 1 disconnecter, /health every 0.5 s"
                % (args.soak_seconds, SOAK_CLIENTS, SOAK_ATTACKERS, len(attacks)))
            cursor = [0]
            work = [(soak_normal_client, (i, srv.port, live, out["solo"], lg, stop, args.seed), "soak-client-%d" % i)
                    for i in range(SOAK_CLIENTS)]
            work += [(soak_attacker, (srv.port, attacks, cursor, lg, stop), "soak-attacker-%d" % i)
                     for i in range(SOAK_ATTACKERS if attacks else 0)]
            work += [(soak_disconnecter, (srv.port, lg, stop), "soak-disconnecter"),
                     (soak_prober, (srv.port, lg, stop), "soak-health")]
            for fn, fargs, name in work:
                t = threading.Thread(target=fn, args=fargs, name=name, daemon=True)
                t.start()
                threads.append(t)
            end = t_load + args.soak_seconds
            while time.monotonic() < end and srv.proc.poll() is None:
                time.sleep(0.2)
            if srv.proc.poll() is not None:
                out["crash"] = soak_crash(srv, lg, t_load)
                log("soak: the server exited with %s after %.1f s" % (srv.proc.returncode, out["crash"]["at_s"]))
        stop.set()
        log("soak: load stopped; waiting for the threads and for /metrics to read idle")
        drain = time.monotonic() + SOAK_DRAIN_S  # a dead server's sockets fail at once: no wait then
        for t in threads:
            t.join(max(0.0, drain - time.monotonic()))
        with lg.lock:
            out["stuck"] = sorted("%s %s (%.0f s)" % (what, name, time.monotonic() - t0)
                                  for what, name, t0 in lg.in_flight.values()) if out["crash"] is None else []
            lg.closed = True
        if out["crash"] is None and srv.proc.poll() is not None:
            out["crash"] = soak_crash(srv, lg, t_load)
        out["metrics_end"] = wait_soak_idle(srv) if out["crash"] is None else {}
        if out["crash"] is None and srv.proc.poll() is not None:
            out["crash"] = soak_crash(srv, lg, t_load)
        out["alive_at_end"] = srv.proc.poll() is None
    finally:
        stop.set()
        srv.close()
        shutil.rmtree(home, ignore_errors=True)
    out.update(normal=lg.normal, attacks=lg.attacks, disconnects=lg.disconnects, ignored_after_end=lg.ignored,
               health={"probes": len(lg.health) + len(lg.health_failures),
                       "max_s": max(lg.health) if lg.health else None,
                       "p99_s": nearest_rank(lg.health, 0.99), "failures": lg.health_failures[:10],
                       "n_failures": len(lg.health_failures),
                       "slow": sorted(lg.slow_probes, reverse=True)[:5]})
    out["log_tracebacks"] = count_tracebacks(srv.log_path)
    out["failures"] = soak_failures(out, {a[0]: a[1] for a in all_attacks})
    out["passed"] = not out["failures"]
    return out


def count_tracebacks(path: str) -> dict:
    """Python tracebacks in the server log by their last line (the exception): not failures by
    themselves (a client that left mid-write makes one in http.server), but where to look."""
    out = {}
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return out
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            last = lines[j][:100] if j < len(lines) else "?"
            out[last] = out.get(last, 0) + 1
    return out


def soak_failures(s: dict, framing: dict) -> list:
    """Everything that fails the soak, one line each."""
    f = []
    if s["crash"]:
        c = s["crash"]
        f.append("CRASH: the server exited with %s after %s s of load; in flight: %s"
                 % (c["returncode"], c["at_s"], ", ".join(c["in_flight"]) or "nothing"))
    f += ["solo answer of %s failed: %s" % kv for kv in sorted(s["solo_errors"].items())]
    for name, d in sorted(s["normal"].items()):
        if d["mismatch"] or d["error"]:
            f.append("normal %s: %d mismatched, %d errored (%s)" % (name, d["mismatch"], d["error"],
                                                                   "; ".join(d["examples"][:1])))
    for name, d in s["attacks"].items():
        for problem, n in sorted(d["problems"].items()):
            if framing.get(name) and problem == "no response (dropped)":
                continue  # noted in the table, not failed
            f.append("attack %s: %s (x%d)" % (name, problem, n))
    h = s["health"]
    if h["n_failures"]:
        f.append("/health failed %d times (%s)" % (h["n_failures"], "; ".join(h["failures"][:3])))
    if h["max_s"] is not None and h["max_s"] > SOAK_HEALTH_MAX_S:
        f.append("/health took up to %.2f s (limit %.1f s)" % (h["max_s"], SOAK_HEALTH_MAX_S))
    if s.get("stuck"):
        f.append("still running %.0f s after the load stopped: %s" % (SOAK_DRAIN_S, ", ".join(s["stuck"])))
    if not s["crash"]:
        m = s.get("metrics_end") or {}
        if not m:
            f.append("/metrics could not be read after the load")
        for metric in ("reame_active_sequences", "reame_queued_requests", "reame_kv_cells_used"):
            if m and m.get(metric) != 0:
                f.append("LEAK: %s is %s after the load" % (metric, m.get(metric)))
        if not s.get("alive_at_end"):
            f.append("the server was gone at the end")
    return f


def print_soak(s: dict, w) -> None:
    c = s["config"]
    w("Soak: %s for %d s: %d clients, %d attackers, 1 disconnecter, /health every 0.5 s\n  %s\n"
      % (c["model"], c["seconds"], c["clients"], c["attackers"], c["cmd"]))
    w("\n%-28s %6s %11s %8s\n" % ("normal request (vs solo)", "ok", "mismatched", "errored"))
    for name in sorted(set(s["solo"]) | set(s["solo_errors"]) | set(s["normal"])):
        if name in s["solo_errors"]:
            w("  %-26s solo answer failed: %s\n" % (name, s["solo_errors"][name][:80]))
            continue
        d = s["normal"].get(name, {"ok": 0, "mismatch": 0, "error": 0})
        w("  %-26s %6d %11d %8d\n" % (name, d["ok"], d["mismatch"], d["error"]))
    w("\n%-34s %5s  %-26s %s\n" % ("attack", "runs", "statuses", "problems"))
    for name in c["attacks"]:
        d = s["attacks"].get(name)
        if d is None:
            w("  %-32s %5s\n" % (name, "-"))
            continue
        st = ", ".join("%s x%d" % kv for kv in sorted(d["statuses"].items()))
        probs = "; ".join("%s (x%d)" % (p[:90], n) for p, n in sorted(d["problems"].items())) or "clean"
        w("  %-32s %5d  %-26s %s\n" % (name, d["runs"], st, probs))
    w("\ndisconnects: %s\n" % (", ".join("%s %s" % (name, ", ".join("%s x%d" % kv for kv in sorted(d.items())))
                                          for name, d in sorted(s["disconnects"].items())) or "none"))
    h = s["health"]
    w("/health (probed from its own process): %d probes, max %s s, p99 %s s, %d failures\n"
      % (h["probes"], _fmt(h["max_s"], 3), _fmt(h["p99_s"], 3), h["n_failures"]))
    for dt, flight in h.get("slow", ()):
        w("  a %.3f s probe; in flight: %s\n" % (dt, ", ".join(flight) or "nothing"))
    if s["crash"]:
        cr = s["crash"]
        w("server: CRASHED (exit %s) after %s s; in flight: %s\n  log tail:\n    %s\n"
          % (cr["returncode"], cr["at_s"], ", ".join(cr["in_flight"]) or "nothing",
             "\n    ".join(cr["log_tail"].splitlines()[-8:])))
    else:
        m = s.get("metrics_end") or {}
        w("server: %s; after the load: active sequences %s, queued %s, KV cells used %s (cached %s)\n"
          % ("alive, never restarted" if s.get("alive_at_end") else "GONE",
             *(_fmt(m.get(k), 0) for k in ("reame_active_sequences", "reame_queued_requests",
                                           "reame_kv_cells_used", "reame_kv_cells_cached"))))
    tb = s.get("log_tracebacks") or {}
    w("server log: %s (%s)\n" % (c["log"], "tracebacks: " + "; ".join(
        "%s x%d" % kv for kv in sorted(tb.items(), key=lambda kv: -kv[1])) if tb else "no tracebacks"))
    if s["failures"]:
        w("\nFAILED (%d):\n" % len(s["failures"]))
        for line in s["failures"]:
            w("  - %s\n" % line)
    else:
        w("\nPASSED\n")


def run_soak_only(args) -> dict:
    """--soak: only the soak."""
    return {"soak": run_soak(args), "config": {"model": args.model, "threads": args.threads,
                                               "reame_version": getattr(reame, "__version__", "?")}}



# -- the run ---------------------------------------------------------------------------


class Results:
    """metric -> {"reame": [...], "server": [...], "unit": str} plus side notes."""

    def __init__(self):
        self.metrics = {}
        self.order = []

    def add(self, metric: str, side: str, value, noise: Optional[float] = None) -> None:
        if metric not in self.metrics:
            self.metrics[metric] = {"reame": [], "server": [], "reame_noise": [], "server_noise": []}
            self.order.append(metric)
        self.metrics[metric][side].append(value)
        self.metrics[metric][side + "_noise"].append(noise)

    def summary(self) -> dict:
        out = {}
        for m in self.order:
            d = self.metrics[m]
            r, s = median(d["reame"]), median(d["server"])
            out[m] = {"reame": d["reame"], "server": d["server"], "reame_median": r, "server_median": s,
                      "ratio": (r / s) if r is not None and s else None,
                      # per run: fraction of one core taken by other processes + steal while it ran
                      "reame_noise": d["reame_noise"], "server_noise": d["server_noise"]}
        return out


def log(msg: str) -> None:
    sys.stderr.write("[bench] %s\n" % msg)
    sys.stderr.flush()


def run(args) -> dict:
    model_path = reame.resolve_model(args.model)
    streams = sorted(set(args.streams))
    n_slots = max(streams + [1])
    res = Results()
    notes = {"decode_lens": [], "agg_lens": {}, "greedy_match": [], "prefill_server_prompt_n": [],
             "python_ms_per_decode_step": {}}
    noise = CpuNoise()
    srv = None
    eng = None
    settings = {}
    try:
        t_load = time.perf_counter()
        eng, settings = open_engine(model_path, n_ctx=args.ctx, n_slots=n_slots, n_threads=args.threads,
                                    n_batch=args.batch)
        log("Reame engine: %s, %d slots x %d ctx, %d threads, batch %d, %s KV, repack %s, flash attn %s "
            "(%.1f s to load)" % (os.path.basename(model_path), n_slots, eng.n_ctx, args.threads, args.batch,
                                  "unified" if settings["kv_unified"] else "per-sequence",
                                  "on" if settings["repack"] else "off", settings["flash_attn"],
                                  time.perf_counter() - t_load))
        if not args.no_server:
            kv = settings["kv_unified"] if args.server_kv == "match" else args.server_kv == "unified"
            rp = settings["repack"] if args.server_repack == "match" else args.server_repack == "on"
            # Started from the main thread: prctl(PDEATHSIG) follows the thread that forked.
            srv = LlamaServer(args.server, model_path, threads=args.threads, n_parallel=n_slots,
                              ctx_per_slot=args.ctx, n_batch=args.batch, log_path=args.server_log,
                              kv_unified=kv, repack=rp)
            log("llama-server pid %d on port %d: %s" % (srv.proc.pid, srv.port, " ".join(srv.args[1:])))
            noise.add_pid(srv.proc.pid)
            srv.wait_ready()
            log("llama-server ready")

        # Untimed warm-up on both sides: page the weights in, spin up thread pools.
        warm = chat_tokens(eng, long_answer_prompt("a hello world program", "warm-up"))
        eng.submit(warm, temperature=0, max_tokens=8).wait()
        if srv:
            srv.completion(server_body(warm, 8, args.server_sampling))

        rng = random.Random(args.seed)
        for r in range(args.repeats):
            log("repeat %d/%d" % (r + 1, args.repeats))
            # 1. single-stream decode
            toks = chat_tokens(eng, long_answer_prompt(TOPICS[r % len(TOPICS)], "d%d" % r))
            a, m = _steps_snapshot(eng), noise.mark()
            rd = reame_decode(eng, toks, args.gen_tokens)
            nz = noise.since(m)
            notes.setdefault("_decode_steps", []).append(_steps_delta(a, _steps_snapshot(eng)))
            notes["decode_lens"].append(rd["n_gen"])
            notes.setdefault("decode_prompt_lens", []).append(len(toks))
            res.add("decode tok/s (1 stream)", "reame", rd["tok_s"], nz)
            res.add("  engine-reported decode tok/s", "reame", rd["engine_tok_s"], nz)
            res.add("time to first token s (chat prompt)", "reame", rd["ttft_s"], nz)
            if rd["n_gen"] < args.gen_tokens // 2:
                log("note: Reame stopped after %d tokens (%s); the server is asked for the same count"
                    % (rd["n_gen"], rd["finish"]))
            if srv:
                m = noise.mark()
                sd = server_decode(srv, toks, max(rd["n_gen"], 2), args.server_sampling)
                nz = noise.since(m)
                res.add("decode tok/s (1 stream)", "server", sd["tok_s"], nz)
                res.add("  engine-reported decode tok/s", "server", sd["server_tok_s"], nz)
                res.add("time to first token s (chat prompt)", "server", sd["ttft_s"], nz)
                k = min(len(rd["tokens"]), len(sd["tokens"]))
                diverge = next((i for i in range(k) if rd["tokens"][i] != sd["tokens"][i]), None)
                notes["greedy_match"].append("identical" if diverge is None and k else
                                             ("no server tokens" if not k else "diverge at %d" % diverge))
            # 2. prefill
            ptoks = make_prefill_tokens(eng.model, rng, args.prefill_tokens)
            m = noise.mark()
            rp = reame_prefill(eng, ptoks)
            nz = noise.since(m)
            res.add("prefill tok/s (%d-tok prompt)" % len(ptoks), "reame", rp["tok_s"], nz)
            res.add("  engine-reported prefill tok/s", "reame", rp["engine_tok_s"], nz)
            if srv:
                m = noise.mark()
                sp = server_prefill(srv, ptoks, args.server_sampling)
                nz = noise.since(m)
                res.add("prefill tok/s (%d-tok prompt)" % len(ptoks), "server", sp["tok_s"], nz)
                res.add("  engine-reported prefill tok/s", "server", sp["server_tok_s"], nz)
                notes["prefill_server_prompt_n"].append([sp["n_prompt"], sp["cached"]])
            # 3. aggregate throughput with N streams
            for n in streams:
                prompts = [chat_tokens(eng, long_answer_prompt(TOPICS[(r * 7 + i) % len(TOPICS)], "a%d-%d-%d" % (r, n, i)))
                           for i in range(n)]
                a, m = _steps_snapshot(eng), noise.mark()
                ra = reame_aggregate(eng, prompts, args.gen_tokens)
                nz = noise.since(m)
                notes.setdefault("_agg_steps_%d" % n, []).append(_steps_delta(a, _steps_snapshot(eng)))
                notes["agg_lens"].setdefault(n, []).append(ra["lens"])
                res.add("aggregate tok/s, %d stream%s" % (n, "s" if n > 1 else ""), "reame", ra["tok_s"], nz)
                if srv:
                    m = noise.mark()
                    sa = server_aggregate(srv, prompts, [max(x, 1) for x in ra["lens"]], args.server_sampling)
                    nz = noise.since(m)
                    res.add("aggregate tok/s, %d stream%s" % (n, "s" if n > 1 else ""), "server", sa["tok_s"], nz)
        # Python time per decode-only step, from Reame's own counters, per section.
        for key in [k for k in notes if k.startswith("_")]:
            d = notes.pop(key)
            n_do = sum(x["decode_only_steps"] for x in d)
            n_st = sum(x["steps"] for x in d)
            n_str = key.rsplit("_", 1)[1]
            label = ("decode, 1 stream" if key == "_decode_steps" else
                     "aggregate, %s stream%s" % (n_str, "" if n_str == "1" else "s"))
            notes["python_ms_per_decode_step"][label] = {
                "python_ms_per_decode_only_step": round(1000 * sum(x["py_s"] for x in d) / n_do, 3) if n_do else None,
                "llama_decode_ms_per_step": round(1000 * sum(x["decode_s"] for x in d) / n_st, 2) if n_st else None,
                "steps": n_st}
        notes["engine_stats"] = eng.stats()
    finally:
        if eng is not None:
            eng.close()
        if srv is not None:
            srv.close()
            noise.mark_reaped(srv.proc.pid)
            log("llama-server stopped")
    if args.variants:
        variants = run_variants(args, model_path, settings, noise)
    http = run_http(args, noise) if args.with_http else None
    out = {
        "config": {"model": os.path.basename(model_path), "threads": args.threads, "repeats": args.repeats,
                   "gen_tokens": args.gen_tokens, "prefill_tokens": args.prefill_tokens, "streams": streams,
                   "ctx_per_slot": args.ctx, "n_batch": args.batch, "slots": n_slots,
                   "server_sampling": None if args.no_server else args.server_sampling,
                   "server_cmd": None if srv is None else " ".join(srv.args),
                   "reame_version": getattr(reame, "__version__", "?"), "reame_settings": settings},
        "metrics": res.summary(),
        "notes": notes,
        "noise": noise.report(),
    }
    if args.variants:
        out["variants"] = variants
    if http is not None:
        out["http"] = http
    return out


def run_http_only(args) -> dict:
    """--http: only the HTTP section."""
    noise = CpuNoise()
    http = run_http(args, noise)
    return {"config": {"model": os.path.basename(reame.resolve_model(args.model)), "threads": args.threads,
                       "repeats": args.repeats, "gen_tokens": args.gen_tokens,
                       "server_sampling": None if args.no_server else args.server_sampling,
                       "reame_version": getattr(reame, "__version__", "?")},
            "http": http, "noise": noise.report()}


VARIANTS = [  # label, Engine keyword arguments (reame.py passes kv_unified on to its Context)
    ("per-seq KV, no repack", {"kv_unified": False, "repack": False}),
    ("unified KV, no repack", {"kv_unified": True, "repack": False}),
    ("per-seq KV, repack", {"kv_unified": False, "repack": True}),
    ("unified KV, repack", {"kv_unified": True, "repack": True}),
]


def run_variants(args, model_path: str, default: dict, noise: CpuNoise) -> dict:
    """Reame against itself: KV layout x weight repacking, alternating like the main runs.

    Every variant gets its own prompts (same lengths), so no cache can carry work over.
    """
    n = max(args.streams)
    engines, skipped = {}, {}
    metrics = ["decode tok/s (1 stream)", "prefill tok/s (%d-tok prompt)" % args.prefill_tokens,
               "aggregate tok/s, %d stream%s" % (n, "s" if n > 1 else "")]
    vals = {m: {} for m in metrics}
    noisy = {m: {} for m in metrics}
    try:
        for label, kw in VARIANTS:
            try:
                eng, st = open_engine(model_path, n_ctx=args.ctx, n_slots=n, n_threads=args.threads,
                                      n_batch=args.batch, **kw)
            except TypeError as e:  # an older reame.py without these options
                skipped[label] = str(e)
                continue
            if (st["kv_unified"], st["repack"]) != (kw["kv_unified"], kw["repack"]):
                log("variant %s: llama.cpp reports kv_unified=%s repack=%s" % (label, st["kv_unified"], st["repack"]))
            engines[label] = eng
            eng.submit(chat_tokens(eng, long_answer_prompt("a hello world program", "warm-up")),
                       temperature=0, max_tokens=8).wait()
        rng = random.Random(args.seed + 1)
        labels = list(engines)
        for r in range(args.repeats):
            log("variants repeat %d/%d" % (r + 1, args.repeats))
            order = labels[r % len(labels):] + labels[:r % len(labels)]  # rotate who goes first
            for vi, label in enumerate(order):
                eng = engines[label]
                k = r * len(labels) + vi
                for metric, fn in (
                        (metrics[0], lambda: reame_decode(
                            eng, chat_tokens(eng, long_answer_prompt(TOPICS[k % len(TOPICS)], "vd%d" % k)),
                            args.gen_tokens)),
                        (metrics[1], lambda: reame_prefill(eng, make_prefill_tokens(eng.model, rng, args.prefill_tokens))),
                        (metrics[2], lambda: reame_aggregate(
                            eng, [chat_tokens(eng, long_answer_prompt(TOPICS[(k * 3 + i) % len(TOPICS)], "va%d-%d" % (k, i)))
                                  for i in range(n)], args.gen_tokens))):
                    m = noise.mark()
                    value = fn()["tok_s"]
                    vals[metric].setdefault(label, []).append(value)
                    noisy[metric].setdefault(label, []).append(noise.since(m))
    finally:
        for eng in engines.values():
            eng.close()
    default_label = next((lb for lb, kw in VARIANTS if kw["kv_unified"] == default.get("kv_unified")
                          and kw["repack"] == default.get("repack")), None)
    table = {}
    for metric in metrics:
        base = median(vals[metric].get(default_label, []))
        table[metric] = {lb: {"runs": v, "noise": noisy[metric][lb], "median": median(v),
                              "ratio_vs_default": (median(v) / base) if base else None}
                         for lb, v in vals[metric].items()}
    return {"streams": n, "default": default_label, "metrics": table, "skipped": skipped}


def print_variants(v: dict, w) -> None:
    w("\nReame variants, KV layout x weight repacking (median, ratio vs Reame's default = *; "
      "runs alternate, * after a run = noisy):\n")
    metrics = list(v["metrics"])
    labels = [lb for lb, _ in VARIANTS if any(lb in v["metrics"][m] for m in metrics)]
    w("%-26s" % "variant" + "".join("%34s" % m for m in metrics) + "\n")
    for lb in labels:
        cells = []
        for m in metrics:
            d = v["metrics"][m].get(lb)
            cells.append("%34s" % ("-" if not d else "%s (%sx)  [%s]" % (
                _fmt(d["median"]), _fmt(d["ratio_vs_default"], 2),
                " ".join(_fmt(x) + ("*" if (z or 0) > NOISY_FRAC else "") for x, z in zip(d["runs"], d["noise"])))))
        w("%-26s" % (lb + (" *" if lb == v["default"] else "")) + "".join(cells) + "\n")
    for lb, why in v["skipped"].items():
        w("  skipped %s: %s\n" % (lb, why))


def _fmt(x, digits=1):
    if x is None:
        return "-"
    return ("%.*f" % (digits, x)) if isinstance(x, float) else str(x)


def print_table(out: dict, stream=sys.stdout) -> None:
    c = out.get("config")
    w = stream.write
    # the sections that run alone print alone (spec: Reame against itself; the burner's CPU time is
    # the point there, not noise)
    for key, section in (("soak", print_soak), ("workload", print_workload), ("warm_ahead", print_warm_ahead),
                         ("spec", print_spec), ("palimpsest", print_palimpsest), ("conclave", print_conclave),
                         ("suggest", print_suggest), ("step_cost", print_step_cost)):
        if key in out:
            section(out[key], w)
            return
    w("Reame vs llama-server: %s, %d threads, median of %d alternating repeats, temperature 0\n"
      % (c["model"], c["threads"], c["repeats"]))
    if "metrics" in out:
        print_engine(out, w)
    if "http" in out:
        w("\n")
        print_http(out["http"], w)
    if "prefix_cache" in out:
        w("\n")
        print_prefix(out["prefix_cache"], w)
    nz = out["noise"]
    if "other_cpu_s" in nz:
        w("\nnoise: other processes used %.1f CPU-s over %.1f s (%.0f%% of one core), steal %.1f s, %s cores%s\n"
          % (nz["other_cpu_s"], nz["wall_s"], 100 * nz["other_cpu_frac_of_one_core"], nz["steal_s"], nz["cores"],
             "  <- NOISY: other work ran during the benchmark"
             if (nz["other_cpu_s"] + nz["steal_s"]) / max(nz["wall_s"], 1e-9) > NOISY_FRAC else ""))
    if c.get("server_cmd"):
        w("server: %s\n" % c["server_cmd"])


def print_engine(out: dict, w) -> None:
    """The in-process sections: decode, prefill, aggregate (and --variants)."""
    c = out["config"]
    st = c.get("reame_settings") or {}
    if st:
        w("Reame: %s KV, weight repacking %s, flash attention %s; llama-server: %s\n" % (
            "unified" if st.get("kv_unified") else "per-sequence", "on" if st.get("repack") else "off",
            st.get("flash_attn"), "not run" if not c.get("server_cmd") else "%s KV, repacking %s, sampler %s" % (
                "unified" if "--kv-unified" in c["server_cmd"].split() else "per-sequence",
                "off" if "--no-repack" in c["server_cmd"].split() else "on", c.get("server_sampling"))))
    w("(client-side wall clock unless marked engine-reported; ratio = Reame / server, for tok/s > 1 means "
      "Reame is faster)\n\n")
    w("%-42s %10s %10s %8s   %s\n" % ("metric", "Reame", "server", "ratio", "runs (Reame | server)"))
    w("-" * 100 + "\n")
    for name, m in out["metrics"].items():
        digits = 3 if name.startswith("time") else 1
        ratio = m["ratio"]
        runs = " | ".join(" ".join(_fmt(x, digits) + ("*" if (z or 0) > NOISY_FRAC else "")
                                   for x, z in zip(m[side], m[side + "_noise"])) for side in ("reame", "server"))
        w("%-42s %10s %10s %8s   %s\n" % (name, _fmt(m["reame_median"], digits), _fmt(m["server_median"], digits),
                                          (_fmt(ratio, 2) + "x") if ratio is not None else "-", runs))
    w("(time to first token: lower is better, so there a ratio < 1 means Reame is faster)\n")
    w("(* = a run during which other processes or the hypervisor took > %d%% of one core: noisy)\n"
      % (100 * NOISY_FRAC))
    n = out["notes"]
    w("\nReame Python time around llama_decode (the scheduler's own overhead):\n")
    for label, d in n["python_ms_per_decode_step"].items():
        w("  %-20s python %s ms per decode-only step, llama_decode %s ms per step (%s steps)\n"
          % (label, _fmt(d["python_ms_per_decode_only_step"], 3), _fmt(d["llama_decode_ms_per_step"], 2), d["steps"]))
    w("\ntokens generated per decode run: %s (server asked for the same count, ignore_eos)\n" % n["decode_lens"])
    if n["greedy_match"]:
        w("greedy output Reame vs server, single stream: %s\n" % ", ".join(n["greedy_match"]))
    for k, v in n["agg_lens"].items():
        w("tokens per stream, %s streams: %s\n" % (k, v))
    if n["prefill_server_prompt_n"]:
        w("server prefill [prompt_n, cache_n] per repeat: %s (cache_n should be 0)\n" % n["prefill_server_prompt_n"])
    if "variants" in out:
        print_variants(out["variants"], w)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Reame vs llama-server, side by side (see the module docstring).")
    p.add_argument("--model", default=None, help="alias or path (default qwen2.5-coder-1.5b; --quick: gemma3-270m)")
    p.add_argument("--threads", type=int, default=None, help="threads for both (default reame.pick_threads())")
    p.add_argument("--repeats", type=int, default=None, help="alternating repeats (default 3; --quick: 2)")
    p.add_argument("--gen-tokens", type=int, default=None, help="tokens per generation (default 128; --quick: 32)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="prefill prompt length (default 768; --quick: 256)")
    p.add_argument("--streams", default=None, help="concurrent streams, comma-separated (default 1,2,4,8; --quick: 1,4)")
    p.add_argument("--ctx", type=int, default=2048, help="context per slot, both sides (default 2048)")
    p.add_argument("--batch", type=int, default=512, help="n_batch = n_ubatch, both sides (default 512)")
    p.add_argument("--server", default=DEFAULT_SERVER, help="llama-server binary (default _llama/llama-server)")
    p.add_argument("--server-sampling", choices=("greedy", "default"), default="greedy",
                   help="greedy: server sampler chain cut to top_k=1 (same work as Reame); default: the server's "
                        "full temperature-0 chain")
    p.add_argument("--server-kv", choices=("match", "unified", "split"), default="match",
                   help="llama-server KV layout: match (what Reame's context reports; default), unified "
                        "(--kv-unified) or split (one stream per slot)")
    p.add_argument("--server-repack", choices=("match", "on", "off"), default="match",
                   help="llama-server weight repacking: match Reame (default), on, or off (--no-repack)")
    p.add_argument("--variants", action="store_true",
                   help="also run Reame against itself: unified vs per-sequence KV x repack on/off "
                        "(decode, prefill, aggregate at the largest --streams)")
    p.add_argument("--http", action="store_true",
                   help="only the HTTP section: reame.py serve vs llama-server, N streaming clients")
    p.add_argument("--with-http", action="store_true", help="the in-process sections, then the HTTP section")
    p.add_argument("--http-clients", default=None,
                   help="concurrent HTTP clients, comma-separated (default 1,4,8; --quick: 1,4)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="only the prefix-cache section: a long shared system prompt (an employee handbook) and "
                        "short chat questions; TTFT cold, warm, after a server restart (Reame's disk tier) and "
                        "from a second Reame process, vs llama-server cold, warm and restarted (repeats default 1)")
    p.add_argument("--handbook-tokens", type=int, default=None,
                   help="--prefix-cache: tokens the questions share (system prompt + chat template), to the "
                        "nearest handbook section (default 2400; --quick: 1200)")
    p.add_argument("--prefix-gen-tokens", type=int, default=8,
                   help="--prefix-cache: max_tokens per question (default 8)")
    p.add_argument("--server-cache-ram", default="0", metavar="MIB",
                   help="--prefix-cache: llama-server --cache-ram (default 0, as in the other sections: its "
                        "slot keeps the prefix with -np 1 anyway; -1 or 8192 enable its RAM prompt cache)")
    p.add_argument("--spec", action="store_true",
                   help="only the speculation section: input-grounded, code-edit and prose workloads with "
                        "speculation off, prompt lookup forced on, the draft model forced on, and auto; then "
                        "again with a CPU burner pinned to core 0 (repeats default 2, gen-tokens 96)")
    p.add_argument("--spec-draft", default="qwen2.5-coder-0.5b", help="--spec: the draft model")
    p.add_argument("--palimpsest", action="store_true",
                   help="only the Palimpsest section: archive on vs off after a restart on four workloads "
                        "(the same question, a template, a function with one change, fresh prose), and the "
                        "archive index's build time and memory")
    p.add_argument("--conclave", action="store_true",
                   help="only the Conclave section: an 8-question quiz answered greedily, by 5 sequential "
                        "samples voted, and by the Conclave of 5 (correct answers and wall time)")
    p.add_argument("--best-of", type=int, default=5, help="--conclave: candidates (default 5)")
    p.add_argument("--step-cost", action="store_true",
                   help="only the decode step cost by tokens in the step, 1 to 33 (repeats default 7)")
    p.add_argument("--against", default=None, metavar="LIBLLAMA",
                   help="with --step-cost: also measure with this libllama (e.g. an older build's), "
                        "alternating, and print the ratio of step times")
    p.add_argument("--suggest", action="store_true",
                   help="only the Suggeritore section: a 20-item numbered list, 10 JSON records, a markdown "
                        "table, prose, the JSON records under a json_schema, and a tool call forced by name "
                        "(8 records as its arguments), Il Suggeritore on vs off (repeats default 2, gen-tokens 400)")
    p.add_argument("--suggest-only", default=None, metavar="TEXT",
                   help="--suggest: only the workloads whose name contains TEXT (e.g. 'tool call')")
    p.add_argument("--archive-index-tokens", type=int, default=25_000_000,
                   help="--palimpsest: tokens of the synthetic archive whose index build is timed "
                        "(default 25M: a 100 MB archive)")
    p.add_argument("--spec-max", type=int, default=16, help="--spec: most drafts per step for lookup and auto")
    p.add_argument("--spec-draft-k", type=int, default=4, help="--spec: drafts per step, draft model forced on")
    p.add_argument("--soak", action="store_true",
                   help="only the soak: one 'reame.py serve MODEL --parallel 4 --ctx 1024' with two API keys; "
                        "8 clients check every greedy answer against its solo answer while 2 attackers send "
                        "the attack table (--soak-attacks), 1 thread drops connections and /health is probed "
                        "every 0.5 s; then the server must be alive and idle (no leaked slots or KV cells). "
                        "Exit status 1 on any failure (default model gemma3-270m)")
    p.add_argument("--soak-seconds", type=float, default=600, help="--soak: seconds of load (default 600)")
    p.add_argument("--soak-attacks", default=None, metavar="NAMES",
                   help="--soak: only these attacks, comma-separated (default all; 'none': load and "
                        "disconnects only). Names: " + ", ".join(a[0] for a in soak_attacks()))
    p.add_argument("--workload", action="store_true",
                   help="only the workload trace: 32 support-desk requests (a ~2,400-token handbook system prompt, "
                        "FAQs asked again, numbered how-tos, JSON extraction under a json_schema, a code edit) "
                        "against llama-server with its defaults (cold, then again) and reame.py serve (cold, "
                        "again, after a restart), 1 and 4 clients (default model qwen2.5-coder-0.5b)")
    p.add_argument("--warm-ahead", action="store_true",
                   help="only the warm-ahead measurement: TTFT of the first request after a restart, idle "
                        "warm-ahead on vs off, alternating (default model qwen2.5-coder-0.5b, repeats 4)")
    p.add_argument("--workload-clients", default="1,4", help="--workload: client counts (default 1,4)")
    p.add_argument("--plot", default=None, metavar="PNG", help="--workload: per-request bars as a PNG "
                   "(needs matplotlib)")
    p.add_argument("--server-log", default=None, help="llama-server log file (default: a temp file)")
    p.add_argument("--no-server", action="store_true", help="Reame only")
    p.add_argument("--quick", action="store_true", help="smoke test: gemma3-270m, few tokens, under a minute")
    p.add_argument("--seed", type=int, default=1234, help="seed for the random prefill prompts")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    p.add_argument("--save-json", default=None, metavar="PATH", help="also write the JSON to PATH")
    args = p.parse_args(argv)
    q = args.quick
    args.model = args.model or ("gemma3-270m" if q or args.soak else "qwen2.5-coder-0.5b" if args.workload
                                or args.warm_ahead else "qwen2.5-coder-1.5b")
    if args.warm_ahead:
        args.repeats = args.repeats or 4
    args.workload_clients = [int(x) for x in args.workload_clients.split(",") if x.strip()]
    if not args.workload_clients or min(args.workload_clients) < 1:
        p.error("--workload-clients needs positive integers")
    args.threads = args.threads or reame.pick_threads()
    if args.prefix_cache:  # cold runs of a 1.5B model take ~40 s each
        args.repeats = args.repeats or 1
    if args.spec:
        args.repeats = args.repeats or 2
        args.gen_tokens = args.gen_tokens or (48 if q else 96)
    if args.conclave:
        args.gen_tokens = args.gen_tokens or (64 if q else 160)
    if args.step_cost:
        args.repeats = args.repeats or 7
    if args.against and (not args.step_cost or not os.path.exists(args.against)):
        p.error("--against needs --step-cost and an existing libllama file")
    if args.suggest:
        args.repeats = args.repeats or 2
        args.gen_tokens = args.gen_tokens or (96 if q else 400)
    if args.palimpsest:
        args.repeats = args.repeats or 2
        args.gen_tokens = args.gen_tokens or (64 if q else 160)
    args.repeats = args.repeats or (2 if q else 3)
    args.handbook_tokens = args.handbook_tokens or (1200 if q else 2400)
    if args.repeats < 1 or args.handbook_tokens < 1 or args.prefix_gen_tokens < 1:
        p.error("--repeats, --handbook-tokens and --prefix-gen-tokens need positive integers")
    args.gen_tokens = args.gen_tokens or (32 if q else 128)
    args.prefill_tokens = args.prefill_tokens or (256 if q else 768)
    args.streams = [int(x) for x in (args.streams or ("1,4" if q else "1,2,4,8")).split(",") if x.strip()]
    if not args.streams or min(args.streams) < 1:
        p.error("--streams needs positive integers")
    args.http_clients = [int(x) for x in (args.http_clients or ("1,4" if q else "1,4,8")).split(",") if x.strip()]
    if not args.http_clients or min(args.http_clients) < 1:
        p.error("--http-clients needs positive integers")
    if args.http and (args.with_http or args.variants):
        p.error("--http runs only the HTTP section: use --with-http to add it to the full run")
    if args.prefix_cache and (args.http or args.with_http or args.variants):
        p.error("--prefix-cache runs only the prefix-cache section: not with --http, --with-http or --variants")
    if args.soak:
        others = [f for f in ("http", "with_http", "variants", "prefix_cache", "spec", "palimpsest", "conclave",
                              "step_cost", "suggest") if getattr(args, f)]
        if others:
            p.error("--soak runs only the soak: not with --%s" % others[0].replace("_", "-"))
        if args.soak_seconds <= 0:
            p.error("--soak-seconds must be positive")
    if args.soak_attacks is not None:
        names = [a[0] for a in soak_attacks()]
        args.soak_attacks = [x.strip() for x in args.soak_attacks.split(",") if x.strip() and x.strip() != "none"]
        unknown = [x for x in args.soak_attacks if x not in names]
        if unknown:
            p.error("--soak-attacks: unknown attack %r (known: %s)" % (unknown[0], ", ".join(names)))
    if args.prefill_tokens + 8 > args.ctx:
        p.error("--prefill-tokens must fit in --ctx")
    if args.server_log is None:
        fd, args.server_log = tempfile.mkstemp(prefix="bench-llama-server-", suffix=".log")
        os.close(fd)
    return args


def _sigterm(signum, frame):
    """SIGTERM behaves like Ctrl-C, so the finally blocks stop llama-server."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        out = (run_workload_only(args) if args.workload else run_warm_ahead_only(args) if args.warm_ahead else run_soak_only(args) if args.soak else
               run_prefix_only(args) if args.prefix_cache else run_http_only(args) if args.http else
               run_spec_only(args) if args.spec else run_palimpsest_only(args) if args.palimpsest else
               run_conclave_only(args) if args.conclave else run_suggest_only(args) if args.suggest else
               {"step_cost": run_step_cost_against(args) if args.against else run_step_cost(args)}
               if args.step_cost else run(args))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(out, f, indent=2)
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_table(out)
    if args.soak and not out["soak"]["passed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
