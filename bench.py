#!/usr/bin/env python3
"""bench.py: Reame measured side by side with llama-server (or with itself), in one run.

    python3 bench.py                  the engine scenario: qwen2.5-coder-1.5b, 3 repeats, streams 1,2,4,8
    python3 bench.py --quick          gemma3-270m, few tokens: a smoke test (< 1 minute)
    python3 bench.py --no-server      Reame only (no llama-server needed)
    python3 bench.py --variants       also Reame against itself: KV layout x weight repacking
    python3 bench.py --with-http      the engine scenario, then the HTTP one
    python3 bench.py --http --quick --http-clients 1,4     another scenario: --help lists them all
    python3 bench.py --model PATH --threads 4 --repeats 5 --json --save-json out.json

Each scenario is a row of SCENARIOS (section 5): a flag, a run function whose docstring says what
it measures, a print function. Numbers are client-side wall clock, taken alike on both sides, runs
alternate so drift on a shared vCPU hits both, and only a ratio from one run means anything here
(* marks a run during which others took over 10% of a core). llama-server, built from the same tree
(./build_llama.sh --with-server), gets the same GGUF, threads, batch, KV cells, flash attention, KV
layout and repacking as Reame's context (Context.settings), its extra work (RAM prompt cache, context
checkpoints) off and its sampler chain cut to argmax (--server-sampling). Benchmarks are never timed
tests: standard library only. Sections: 1. helpers, 2. processes, 3. clients, 4. scenarios, 5. main.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import http.client
import json
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
from typing import Callable, NamedTuple, Optional

# as `reame.py serve` runs (reame.py sets it when it is the program): no OpenBLAS thread pool
# beside ggml's threads in the in-process measurements
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import reame  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SERVER = os.path.join(HERE, "_llama", "llama-server")
REAME_SCRIPT = os.path.join(HERE, "reame.py")
SIDES = ("reame", "server")
NOISY_FRAC = 0.10  # other CPU use (fraction of one core) above which a run is flagged noisy
GREEDY = {"greedy": {"samplers": ["top_k"], "top_k": 1}}  # --server-sampling: llama-server's chain cut to argmax


# == 1. Helpers: prompts, CPU noise, table cells =============================================

# Prompts for long answers: each repeat and stream gets its own, so no request reuses another's work.
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
    "a simple key-value store with write-ahead log and compaction"]
_WORDS = ("alpha beta gamma delta value index count total buffer state node edge graph "
          "token batch cache queue stream frame layer model weight bias vector matrix "
          "result error handler config option parser reader writer client server request "
          "response session record field table column row key item entry list map set").split()


def log(msg: str) -> None:
    print("[bench] %s" % msg, file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def nearest_rank(xs, q: float):
    """The q-quantile by nearest rank (an observed value; fine for a handful of samples)."""
    xs = sorted(x for x in xs if x is not None)
    return xs[max(1, math.ceil(q * len(xs))) - 1] if xs else None


def ratio(a, b):
    return a / b if a is not None and b else None


def counted(n: int, what: str) -> str:
    return "%d %s%s" % (n, what, "s" if n != 1 else "")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prefill_tokens(model, rng: random.Random, n_tok: int) -> list:
    """n_tok tokens of random Python-looking text: a realistic token mix, never the same twice."""
    n_lines = 16
    while True:
        lines = ["# module %08x" % rng.getrandbits(32)]
        for i in range(n_lines):
            a, b, c, d = (rng.choice(_WORDS) for _ in range(4))
            lines.append("def %s_%s_%d(%s, %s=%d):\n    return %s.%s(%s) + %d"
                         % (a, b, i, c, d, rng.randrange(100), c, a, d, rng.randrange(1000)))
        toks = model.tokenize("\n".join(lines) + "\n")
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
    """CPU time other processes and the hypervisor (steal) took, from Linux /proc: these machines are shared.
    The servers bench.py starts (pids) count as its own."""

    def __init__(self):
        self.pids, self.reaped, self._pid_s = [], set(), {}  # pid -> CPU seconds last read
        self.m0 = self.mark()

    def mark(self) -> tuple:
        """(now, busy CPU seconds of the machine, steal seconds, CPU seconds of this process and its servers)."""
        now, t, hz = time.monotonic(), os.times(), os.sysconf("SC_CLK_TCK")
        for pid in self.pids:
            try:
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                self._pid_s[pid] = (int(fields[11]) + int(fields[12])) / hz  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
        # Once reaped, a server's time is in children_*; until then, count its last reading.
        own = (t.user + t.system + t.children_user + t.children_system
               + sum(self._pid_s.get(p, 0.0) for p in self.pids if p not in self.reaped))
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return now, None, None, own
        user, nice, system, _idle, _iowait, irq, softirq = v[:7]
        return now, (user + nice + system + irq + softirq) / hz, (v[7] if len(v) > 7 else 0) / hz, own

    def since(self, mark: tuple) -> Optional[float]:
        """Fraction of one core that other processes, or the hypervisor (steal), took since mark."""
        t1, busy, steal, own = self.mark()
        if busy is None or mark[1] is None:
            return None
        other = max(0.0, (busy - mark[1]) - (own - mark[3])) + (steal - mark[2])
        return round(other / max(t1 - mark[0], 1e-9), 3)

    def measure(self, fn, *args) -> dict:
        """fn(*args), a dict, with "noise": what others took while it ran."""
        m = self.mark()
        out = fn(*args)
        out["noise"] = self.since(m)
        return out

    def report(self) -> dict:
        (t1, busy, steal, own), m = self.mark(), self.m0
        if busy is None or m[1] is None:
            return {"wall_s": t1 - m[0]}
        other, wall = max(0.0, (busy - m[1]) - (own - m[3])), t1 - m[0]
        return {"wall_s": round(wall, 1), "other_cpu_s": round(other, 1), "cores": os.cpu_count(),
                "other_cpu_frac_of_one_core": round(other / max(wall, 1e-9), 3), "steal_s": round(steal - m[2], 1)}


def _fmt(x, digits=1):
    return "-" if x is None else ("%.*f" % (digits, x)) if isinstance(x, float) else str(x)


def _x(r, digits=2) -> str:
    return "-" if r is None else _fmt(r, digits) + "x"


def runs_cell(xs, noise, digits=1) -> str:
    """Each run's value, with * after a noisy one."""
    return " ".join(_fmt(x, digits) + ("*" if (z or 0) > NOISY_FRAC else "") for x, z in zip(xs, noise))


def print_ratio_table(w, metrics: dict, width: int, legend: str) -> None:
    """metric -> {"reame", "server", "ratio", and each side's "_runs" and "_noise"}, then legend."""
    w("%-*s %10s %10s %8s   runs (Reame | server)\n%s\n" % (width, "metric", "Reame", "server", "ratio", "-" * 100))
    for name, m in metrics.items():
        d = 3 if name.startswith(("time", "TTFT")) else 1
        w("%-*s %10s %10s %8s   %s\n" % (width, name, _fmt(m["reame"], d), _fmt(m["server"], d), _x(m["ratio"]),
                                         " | ".join(runs_cell(m[s + "_runs"], m[s + "_noise"], d) for s in SIDES)))
    w(legend + "(* = a run during which other processes or the hypervisor took > %d%% of one core: noisy)\n"
      % (100 * NOISY_FRAC))


def layout(kv_unified: bool, repack: bool) -> str:
    return "%s KV, repacking %s" % ("unified" if kv_unified else "per-sequence", "on" if repack else "off")


def server_layout(cmd: Optional[str]) -> str:
    """What a llama-server command line says about its KV layout and repacking."""
    return layout("--kv-unified" in cmd.split(), "--no-repack" not in cmd.split()) if cmd else "not run"


# == 2. Processes: llama-server and reame.py serve on loopback ===============================


def _set_pdeathsig():
    """Linux: the server gets SIGTERM if bench.py dies without cleaning up (kill -9)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_clients(srv, n: int, one, barrier: bool = True) -> tuple:
    """one(i, start) in n threads: (results, release time); start: a barrier they and this thread wait on
    (or None). Joins check every 0.5 s that srv lives: a dead server raises here, not hangs the bench."""
    outs, errors = [None] * n, []
    start = threading.Barrier(n + 1) if barrier else None

    def work(i):
        try:
            outs[i] = one(i, start)
        except Exception as e:  # noqa: BLE001 - re-raised below, in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), name="bench-client-%d" % i, daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    if start is not None:
        start.wait()
    for t in threads:
        t.join(0.5)
        while t.is_alive():
            srv.check_alive()
            t.join(0.5)
    if errors:
        raise errors[0]
    return outs, t0


class ServerProcess:
    """A server subprocess on a free loopback port, logging to a file; close() stops it by its handle."""

    name = "server"

    def __init__(self, log_path: str, noise: Optional[CpuNoise]):
        self.log_path, self.noise, self.port = log_path, noise, free_port()
        self.base = "http://127.0.0.1:%d" % self.port

    def _start(self, args: list, env: dict, tag: str = "", cmd_prefix: str = "") -> None:
        self.args, self.cmd, self._log = args, cmd_prefix + " ".join(args), open(self.log_path, "wb")
        # Started from the main thread: prctl(PDEATHSIG) follows the thread that forked.
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None)
        if self.noise is not None:
            self.noise.pids.append(self.proc.pid)
        log("%s%s pid %d on port %d" % (self.name, tag and " (%s)" % tag, self.proc.pid, self.port))

    def ready(self, warmup: Optional[bytes] = None, timeout_s: float = 300.0) -> None:
        """Wait for /health; then one untimed streamed chat request (warmup), to page weights in."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("%s not ready after %.0f s; log tail:\n%s" % (self.name, timeout_s, self.log_tail()))
            time.sleep(0.25)
        if warmup is not None:
            self.guarded(stream, self.port, "/v1/chat/completions", warmup)

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
        """fn(*args) in a worker thread (timed inside fn): if the server dies, this raises."""
        return run_clients(self, 1, lambda i, start: fn(*args), barrier=False)[0][0]

    def close(self, grace_s: float = 15.0) -> Optional[int]:
        """SIGTERM (Reame then finishes its snapshot writes), SIGKILL after grace_s: the exit code."""
        proc = self.proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log("%s pid %d did not stop within %.0f s of SIGTERM: killed" % (self.name, proc.pid, grace_s))
                proc.kill()
                proc.wait()
        self._log.close()
        if self.noise is not None:
            self.noise.reaped.add(proc.pid)
        return proc.returncode


class LlamaServer(ServerProcess):
    """llama-server matching Reame (threads, batch, KV cells and layout, repacking, flash attention, full SWA
    cache), its extra work off; defaults=True: as a user starts it (model, host and port only)."""

    name = "llama-server"

    def __init__(self, binary: str, model_path: str, log_path: str, noise: Optional[CpuNoise] = None, *,
                 threads: int = 0, n_parallel: int = 1, ctx_per_slot: int = 0, n_batch: int = 0,
                 kv_unified: bool = True, repack: bool = True, cache_ram: str = "0",
                 chat_template: Optional[str] = None, defaults: bool = False, tag: str = "", extra: tuple = ()):
        if not os.access(binary, os.X_OK):
            raise SystemExit("llama-server not found at %s: build it with ./build_llama.sh --with-server, "
                             "pass --server PATH, or use --no-server" % binary)
        super().__init__(log_path, noise)
        libdir = os.path.dirname(os.path.abspath(binary))
        env = dict(os.environ, LD_LIBRARY_PATH=libdir + (
            os.pathsep + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else ""))
        args = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(self.port)]
        if not defaults:
            args += ["-t", str(threads), "-tb", str(threads), "-np", str(n_parallel),
                     "-c", str(ctx_per_slot * n_parallel), "-b", str(n_batch), "-ub", str(n_batch), "-ngl", "0"]
            try:  # llama-server's flags vary by build: pass only the ones its --help lists
                out = subprocess.run([binary, "--help"], capture_output=True, timeout=60, env=env)
                known = {tok.strip(",") for tok in (out.stdout + out.stderr).decode("utf-8", "replace").split()}
            except (OSError, subprocess.TimeoutExpired):
                known = set()
            # Match Reame, and switch off work Reame does not do; only flags this build knows.
            for flag, value in (("--kv-unified" if kv_unified else "--no-kv-unified", None),
                                ("--repack" if repack else "--no-repack", None), ("--swa-full", None),
                                ("-fa", "auto"), ("--cache-ram", cache_ram), ("--ctx-checkpoints", "0"),
                                ("--no-cache-idle-slots", None), ("--fit", "off"), ("--no-webui", None)):
                if flag in known:
                    args += [flag] + ([value] if value is not None else [])
            if chat_template and "--chat-template" in known:
                # A built-in template by name (the GGUF has none): llama.cpp's legacy templates, not Jinja.
                args += ["--no-jinja"] * ("--no-jinja" in known) + ["--chat-template", chat_template]
        self._start(args + list(extra), env, tag)


class ReameServer(ServerProcess):
    """``reame.py serve``: it builds its Engine with the same defaults as an in-process one."""

    name = "reame serve"

    def __init__(self, model_path: str, log_path: str, noise: Optional[CpuNoise] = None, *, threads: int,
                 n_parallel: int, ctx_per_slot: int, home: Optional[str] = None, tag: str = ""):
        super().__init__(log_path, noise)
        env, prefix = (dict(os.environ, REAME_HOME=home), "REAME_HOME=%s " % home) if home else (dict(os.environ), "")
        self._start([sys.executable, REAME_SCRIPT, "serve", model_path, "--host", "127.0.0.1", "--port", str(self.port),
                     "--parallel", str(n_parallel), "--threads", str(threads), "--ctx", str(ctx_per_slot),
                     "--grace", "1"], env, tag, prefix)  # --grace 1: close() cancels what is left, no 30 s drain


def matched_server(args, settings: dict, n_parallel: int, ctx_per_slot: int, log_path: str, noise: CpuNoise,
                   **kw) -> LlamaServer:
    """llama-server with Reame's threads, batch, KV layout and repacking (or --server-kv/--server-repack's)."""
    kv = settings["kv_unified"] if args.server_kv == "match" else args.server_kv == "unified"
    rp = settings["repack"] if args.server_repack == "match" else args.server_repack == "on"
    return LlamaServer(args.server, args.model_path, log_path, noise, threads=args.threads, n_parallel=n_parallel,
                       ctx_per_slot=ctx_per_slot, n_batch=settings["n_batch"], kv_unified=kv, repack=rp, **kw)


# == 3. Clients: in-process requests, llama-server's /completion, OpenAI-style streams =========


def reame_decode(eng, tokens: list, max_tokens: int) -> dict:
    """One streamed request: client times of the first piece and of the end."""
    t0, t_first = time.perf_counter(), None
    req = eng.submit(tokens, temperature=0, max_tokens=max_tokens)
    for _piece in req:
        t_first = t_first or time.perf_counter()
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


def reame_prefill(eng, tokens: list) -> dict:
    t0 = time.perf_counter()
    res = eng.submit(tokens, temperature=0, max_tokens=1).wait()
    wall = time.perf_counter() - t0
    return {"tok_s": len(tokens) / wall, "engine_tok_s": len(tokens) / res.ttft_s if res.ttft_s > 0 else None}


def reame_aggregate(eng, prompts: list, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    reqs = [eng.submit(p, temperature=0, max_tokens=max_tokens) for p in prompts]
    lens = [r.wait().n_gen_tok for r in reqs]
    return {"tok_s": sum(lens) / (time.perf_counter() - t0), "lens": lens}


def server_body(prompt_tokens: list, n_predict: int, sampling: str) -> dict:
    """llama-server's own /completion: Reame's tokens and count (ignore_eos), no prompt cache."""
    return dict({"prompt": prompt_tokens, "n_predict": n_predict, "ignore_eos": True, "temperature": 0,
                 "cache_prompt": False, "return_tokens": True, "seed": 0}, **GREEDY.get(sampling, {}))


def server_completion(port: int, body: dict, timeout_s: float = 1800) -> dict:
    """POST /completion (not streamed): the JSON answer plus client wall time."""
    req = urllib.request.Request("http://127.0.0.1:%d/completion" % port, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read())
    out["_wall_s"] = time.perf_counter() - t0
    return out


def server_decode(srv, tokens: list, n_predict: int, sampling: str) -> dict:
    body = json.dumps(dict(server_body(tokens, n_predict, sampling), stream=True)).encode()
    out = srv.guarded(stream, srv.port, "/completion", body, None, 1800)
    timings, span = out["timings"] or {}, out["total_s"] - out["ttft_s"]
    n = out["last"].get("tokens_predicted") or timings.get("predicted_n") or len(out["tokens"])
    return {"n_gen": n, "tokens": out["tokens"], "tok_s": (n - 1) / span if span > 0 and n > 1 else None,
            "server_tok_s": timings.get("predicted_per_second"), "ttft_s": out["ttft_s"]}


def server_prefill(srv, tokens: list, sampling: str) -> dict:
    out = srv.guarded(server_completion, srv.port, server_body(tokens, 1, sampling))
    timings = out.get("timings") or {}
    return {"tok_s": len(tokens) / out["_wall_s"], "server_tok_s": timings.get("prompt_per_second"),
            "n_prompt": timings.get("prompt_n"), "cached": timings.get("cache_n")}


def server_aggregate(srv, prompts: list, lens: list, sampling: str) -> dict:
    outs, t0 = run_clients(srv, len(prompts), lambda i, start: (
        start.wait(), server_completion(srv.port, server_body(prompts[i], lens[i], sampling)))[1])
    wall = time.perf_counter() - t0
    n = [o.get("tokens_predicted") or (o.get("timings") or {}).get("predicted_n") or 0 for o in outs]
    return {"tok_s": sum(n) / wall, "lens": n}


def stream_body(fields: dict, max_tokens: int, sampling: str, cache_prompt: bool) -> bytes:
    """A streamed greedy request with usage and fields (prompt or messages), the same for both servers."""
    return json.dumps(dict(fields, max_tokens=max_tokens, temperature=0, seed=0, stream=True, stream_options={
        "include_usage": True}, cache_prompt=cache_prompt, **GREEDY.get(sampling, {}))).encode()


def stream(port: int, path: str, body: bytes, start: Optional[threading.Barrier] = None,
           timeout_s: float = 900) -> dict:
    """One streaming client of path (OpenAI's completions or chat, llama-server's /completion) up to [DONE]:
    TTFT = send to the first text (or tokens), usage, timings, tokens. Errors raise, and so does passing
    timeout_s (a dead scheduler may keep a stream open with pings). start: a barrier to wait on first."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t_first, n_chunks, usage, timings, finish, text, tokens, last, replayed = (
        None, 0, None, None, None, [], [], {}, False)
    try:
        if start is not None:
            start.wait()
        t0 = time.perf_counter()
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError("HTTP %d from port %d: %r" % (resp.status, port, resp.read(500)))
        for line in iter(resp.readline, b""):
            if time.perf_counter() > t0 + timeout_s:
                raise RuntimeError("no answer from port %d within the time limit" % port)
            if not line.startswith(b"data: "):
                continue
            if line[6:].strip() == b"[DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError("stream error from port %d: %s" % (port, chunk["error"]))
            choices = chunk.get("choices") or []
            pieces = [p for p in [c.get("text") or (c.get("delta") or {}).get("content") for c in choices]
                      + [chunk.get("content")] if p]
            if t_first is None and (pieces or chunk.get("tokens")):
                t_first = time.perf_counter()
            n_chunks, last = n_chunks + len(pieces), chunk
            text += pieces
            tokens += chunk.get("tokens") or []
            usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
            replayed = replayed or bool((chunk.get("reame") or {}).get("replayed"))
            finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), finish)
            if chunk.get("stop"):  # llama-server's own /completion: its last chunk
                break
        t_end = time.perf_counter()
    finally:
        conn.close()
    usage = usage or {}
    return {"t0": t0, "t_end": t_end, "ttft_s": (t_first or t_end) - t0, "total_s": t_end - t0, "last": last,
            "chunks": n_chunks, "finish": finish, "text": "".join(text), "tokens": tokens, "timings": timings,
            "replayed": replayed, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def reame_metrics(srv: ServerProcess) -> dict:
    """Reame's /metrics as {name: value} (unlabelled counters and gauges only); {} when unreadable."""
    try:
        with urllib.request.urlopen(srv.base + "/metrics", timeout=10) as r:
            return reame.parse_metrics(r.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError):
        return {}


# == 4. Scenarios: constants, run_NAME(args, noise) -> dict (its docstring documents it), print_NAME(result, w)


# -- engine (the default): decode, prefill, aggregate in process vs llama-server ----------------
DECODE, TTFT = "decode tok/s (1 stream)", "time to first token s (chat prompt)"
DECODE_ENGINE, PREFILL_ENGINE = "  engine-reported decode tok/s", "  engine-reported prefill tok/s"
VARIANTS = [("%s KV, %s" % (kv, rp), {"kv_unified": kv == "unified", "repack": rp == "repack"})  # Engine keywords
            for rp in ("no repack", "repack") for kv in ("per-seq", "unified")]


def add_runs(metrics: dict, side: str, noise: Optional[float], values: dict) -> None:
    """metric -> each side's runs, their noise, medians and ratio (Reame / server), in the order added."""
    for metric, value in values.items():
        d = metrics.setdefault(metric, {"reame_runs": [], "server_runs": [], "reame_noise": [], "server_noise": []})
        d[side + "_runs"].append(value)
        d[side + "_noise"].append(noise)
        d.update(reame=median(d["reame_runs"]), server=median(d["server_runs"]))
        d["ratio"] = ratio(d["reame"], d["server"])


def run_engine(args, noise: CpuNoise) -> dict:
    """Decode, prefill and N-stream tok/s: an in-process Engine vs llama-server (the default).

    decode: a streamed long answer, decode steps after the first token / their time (llama-server:
    the same tokens in and out, ignore_eos; greedy outputs compared); prefill: a fresh random
    prompt, one token; aggregate: N requests at once. Also Reame's Python time per decode step.
    """
    streams, res, steps, srv = sorted(set(args.streams)), {}, {}, None
    notes = {"decode_lens": [], "decode_prompt_lens": [], "agg_lens": {}, "greedy_match": [],
             "prefill_server_prompt_n": [], "python_ms_per_decode_step": {}}
    t_load = time.perf_counter()
    eng = reame.Engine(args.model_path, n_ctx=args.ctx, n_slots=max(streams), n_threads=args.threads,
                       n_batch=args.batch, spec=args.reame_spec)
    settings = dict(eng.ctx.settings)
    log("Reame engine: %d slots x %d ctx, %d threads, %s, %.1f s to load" % (
        max(streams), eng.n_ctx, args.threads, settings, time.perf_counter() - t_load))

    def timed_steps(label, fn, *a):  # fn measured, and the scheduler's counters around it
        c, keys = eng.counters, ("n_decode_only_steps", "t_decode_only_py_s", "n_steps", "t_decode_s")
        before = [getattr(c, k) for k in keys]
        out = noise.measure(fn, *a)
        steps.setdefault(label, []).append([getattr(c, k) - x for k, x in zip(keys, before)])
        return out

    try:
        if not args.no_server:
            srv = matched_server(args, settings, max(streams), args.ctx, args.server_log or os.path.join(
                tempfile.mkdtemp(prefix="bench-engine-logs-"), "llama-server.log"), noise)
            srv.ready()
        # Untimed warm-up on both sides: page the weights in, spin up thread pools.
        warm = chat_tokens(eng, long_answer_prompt("a hello world program", "warm-up"))
        eng.submit(warm, temperature=0, max_tokens=8).wait()
        if srv:
            srv.guarded(server_completion, srv.port, server_body(warm, 8, args.server_sampling))
        rng = random.Random(args.seed)
        for r in range(args.repeats):
            log("repeat %d/%d" % (r + 1, args.repeats))
            toks = chat_tokens(eng, long_answer_prompt(TOPICS[r % len(TOPICS)], "d%d" % r))
            rd = timed_steps("decode, 1 stream", reame_decode, eng, toks, args.gen_tokens)
            notes["decode_lens"].append(rd["n_gen"])
            notes["decode_prompt_lens"].append(len(toks))
            add_runs(res, "reame", rd["noise"], {DECODE: rd["tok_s"], DECODE_ENGINE: rd["engine_tok_s"],
                                                 TTFT: rd["ttft_s"]})
            if rd["n_gen"] < args.gen_tokens // 2:
                log("note: Reame stopped after %d tokens (%s); the server is asked for the same count"
                    % (rd["n_gen"], rd["finish"]))
            if srv:
                sd = noise.measure(server_decode, srv, toks, max(rd["n_gen"], 2), args.server_sampling)
                add_runs(res, "server", sd["noise"], {DECODE: sd["tok_s"], DECODE_ENGINE: sd["server_tok_s"],
                                                      TTFT: sd["ttft_s"]})
                k = min(len(rd["tokens"]), len(sd["tokens"]))
                diverge = next((i for i in range(k) if rd["tokens"][i] != sd["tokens"][i]), None)
                notes["greedy_match"].append("identical" if diverge is None and k else
                                             ("no server tokens" if not k else "diverge at %d" % diverge))
            ptoks = make_prefill_tokens(eng.model, rng, args.prefill_tokens)
            metric = "prefill tok/s (%d-tok prompt)" % len(ptoks)
            rp = noise.measure(reame_prefill, eng, ptoks)
            add_runs(res, "reame", rp["noise"], {metric: rp["tok_s"], PREFILL_ENGINE: rp["engine_tok_s"]})
            if srv:
                sp = noise.measure(server_prefill, srv, ptoks, args.server_sampling)
                add_runs(res, "server", sp["noise"], {metric: sp["tok_s"], PREFILL_ENGINE: sp["server_tok_s"]})
                notes["prefill_server_prompt_n"].append([sp["n_prompt"], sp["cached"]])
            for n in streams:
                metric = "aggregate tok/s, %s" % counted(n, "stream")
                prompts = [chat_tokens(eng, long_answer_prompt(TOPICS[(r * 7 + i) % len(TOPICS)], "a%d-%d-%d"
                                                               % (r, n, i))) for i in range(n)]
                ra = timed_steps("aggregate, " + counted(n, "stream"), reame_aggregate, eng, prompts, args.gen_tokens)
                notes["agg_lens"].setdefault(n, []).append(ra["lens"])
                add_runs(res, "reame", ra["noise"], {metric: ra["tok_s"]})
                if srv:
                    sa = noise.measure(server_aggregate, srv, prompts, [max(x, 1) for x in ra["lens"]],
                                       args.server_sampling)
                    add_runs(res, "server", sa["noise"], {metric: sa["tok_s"]})
        for label, deltas in steps.items():  # the scheduler's own time around llama_decode, per section
            n_do, py_s, n_st, dec_s = (sum(d[i] for d in deltas) for i in range(4))
            notes["python_ms_per_decode_step"][label] = {
                "python_ms_per_decode_only_step": round(1000 * py_s / n_do, 3) if n_do else None,
                "llama_decode_ms_per_step": round(1000 * dec_s / n_st, 2) if n_st else None, "steps": n_st}
        notes["engine_stats"] = eng.stats()
    finally:
        eng.close()
        if srv is not None:
            srv.close()
    out = {"config": {"prefill_tokens": args.prefill_tokens, "streams": streams, "ctx_per_slot": args.ctx,
                      "n_batch": settings["n_batch"], "slots": max(streams), "reame_settings": settings,
                      "reame_spec": args.reame_spec, "server_cmd": srv and srv.cmd},
           "metrics": res, "notes": notes}
    if args.variants:
        out["variants"] = run_variants(args, settings, noise)
    if args.with_http:
        out["http"] = run_http(args, noise)
    return out


def run_variants(args, default: dict, noise: CpuNoise) -> dict:
    """Reame against itself, KV layout x repacking, alternating; each its own prompts (no cache carries work)."""
    n, rng, engines = max(args.streams), random.Random(args.seed + 1), {}
    metrics = [DECODE, "prefill tok/s (%d-tok prompt)" % args.prefill_tokens, "aggregate tok/s, " + counted(
        n, "stream")]
    runs = {m: {lb: {"runs": [], "noise": []} for lb, _ in VARIANTS} for m in metrics}
    try:
        for label, kw in VARIANTS:
            eng = engines[label] = reame.Engine(args.model_path, n_ctx=args.ctx, n_slots=n, n_threads=args.threads,
                                                n_batch=args.batch, **kw)
            eng.submit(chat_tokens(eng, long_answer_prompt("a hello world program", "warm-up")),
                       temperature=0, max_tokens=8).wait()
        for r in range(args.repeats):
            log("variants repeat %d/%d" % (r + 1, args.repeats))
            nv = len(VARIANTS)
            for vi, (label, _) in enumerate(VARIANTS[r % nv:] + VARIANTS[:r % nv]):  # rotate who goes first
                eng, k = engines[label], r * nv + vi
                for metric, fn, *a in (
                        (metrics[0], reame_decode, eng, chat_tokens(
                            eng, long_answer_prompt(TOPICS[k % len(TOPICS)], "vd%d" % k)), args.gen_tokens),
                        (metrics[1], reame_prefill, eng, make_prefill_tokens(eng.model, rng, args.prefill_tokens)),
                        (metrics[2], reame_aggregate, eng, [chat_tokens(eng, long_answer_prompt(TOPICS[
                            (k * 3 + i) % len(TOPICS)], "va%d-%d" % (k, i))) for i in range(n)], args.gen_tokens)):
                    out = noise.measure(fn, *a)
                    runs[metric][label]["runs"].append(out["tok_s"])
                    runs[metric][label]["noise"].append(out["noise"])
    finally:
        for eng in engines.values():
            eng.close()
    default_label = next(lb for lb, kw in VARIANTS if kw == {k: default[k] for k in kw})
    for metric, by_label in runs.items():
        for d in by_label.values():
            d.update(median=median(d["runs"]), ratio_vs_default=ratio(median(d["runs"]),
                                                                       median(by_label[default_label]["runs"])))
    return {"streams": n, "default": default_label, "metrics": runs}


def print_engine(e: dict, w) -> None:
    c, st, n = e["config"], e["config"]["reame_settings"], e["notes"]
    w("Reame: %s, flash attention %s, speculation %s; llama-server: %s\n(client-side wall clock unless marked "
      "engine-reported; ratio = Reame / server: Reame is faster where it is above 1 for tok/s, below 1 for time to "
      "first token)\n\n" % (layout(st["kv_unified"], st["repack"]), st["flash_attn"], c.get("reame_spec", "auto"),
                              server_layout(c["server_cmd"]) + (
          ", sampler %s" % c["server_sampling"] if c["server_cmd"] else "")))
    print_ratio_table(w, e["metrics"], 42, "")
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
    if "variants" in e:
        v = e["variants"]
        w("\nReame variants, KV layout x weight repacking (median, ratio vs Reame's default = *; runs alternate, "
          "* after a run = noisy):\n%-26s%s\n" % ("variant", "".join("%34s" % m for m in v["metrics"])))
        for lb, _ in VARIANTS:
            w("%-26s" % (lb + (" *" if lb == v["default"] else "")) + "".join("%34s" % ("%s (%sx)  [%s]" % (
                _fmt(d["median"]), _fmt(d["ratio_vs_default"], 2), runs_cell(d["runs"], d["noise"])))
                for d in (v["metrics"][m][lb] for m in v["metrics"])) + "\n")
    if c["server_cmd"]:
        w("server: %s\n" % c["server_cmd"])
    if "http" in e:
        w("\n")
        print_http(e["http"], w)


# -- http: reame.py serve vs llama-server, N streaming clients ------------------------------
def http_clients(srv: ServerProcess, bodies: list) -> dict:
    """A streaming client per body, released together: completion tokens / (last end - first send)."""
    outs, _ = run_clients(srv, len(bodies), lambda i, start: stream(srv.port, "/v1/completions", bodies[i], start,
                                                                    timeout_s=1800))
    wall = max(o["t_end"] for o in outs) - min(o["t0"] for o in outs)
    toks = [o["chunks"] if o["completion_tokens"] is None else o["completion_tokens"] for o in outs]
    return {"tok_s": sum(toks) / wall if wall > 0 else None, "tokens": toks, "ttft_s": [o["ttft_s"] for o in outs],
            "chunks": [o["chunks"] for o in outs], "usage_missing": sum(o["completion_tokens"] is None for o in outs),
            "prompt_tokens": [o["prompt_tokens"] for o in outs], "finish": [o["finish"] for o in outs],
            "texts": [o["text"] for o in outs]}


def run_http(args, noise: CpuNoise) -> dict:
    """reame.py serve --parallel N vs llama-server -np N, N streaming clients (--http-clients).

    Both fresh per N, configured as an Engine built like serve's; N clients released together
    send both the same streamed greedy /v1/completions (a chat-templated raw prompt, tagged per
    client and run). tok/s: completion tokens / (last end - first send); TTFT median and p95.
    """
    clients = sorted(set(args.http_clients))
    # An Engine built as serve builds it (serve has no --batch): its settings for llama-server, its template.
    with reame.Engine(args.model_path, n_ctx=args.ctx, n_slots=max(clients), n_threads=args.threads) as eng:
        settings = dict(eng.ctx.settings)

        def body(k: int, tag: str, max_tokens: int) -> bytes:
            text = long_answer_prompt(TOPICS[k % len(TOPICS)], tag)
            try:
                text = eng.model.apply_chat_template([{"role": "user", "content": text}])
            except reame.ReameError:
                pass
            return stream_body({"prompt": text}, max_tokens, args.server_sampling, False)

        warm = {n: [body(i, "hw%d-%d" % (n, i), 8) for i in range(n)] for n in clients}
        # Every client of every run gets its own topic/tag, so no prefix cache can help.
        bodies = {(n, r): [body(r * 5 + ni * 3 + i, "h%d-%d-%d" % (r, n, i), args.gen_tokens) for i in range(n)]
                  for ni, n in enumerate(clients) for r in range(args.repeats)}
    log_dir, cmds = tempfile.mkdtemp(prefix="bench-http-logs-"), {"reame": {}, "server": {}}
    runs = {n: {"reame": [], "server": []} for n in clients}
    for n in clients:
        sides = []
        try:
            sides.append(("reame", ReameServer(args.model_path, os.path.join(log_dir, "reame-serve-np%d.log" % n),
                                               noise, threads=args.threads, n_parallel=n, ctx_per_slot=args.ctx)))
            if not args.no_server:
                sides.append(("server", matched_server(args, settings, n, args.ctx, os.path.join(
                    log_dir, "llama-server-np%d.log" % n), noise)))
            for side, srv in sides:  # then, untimed, N short requests at once: every slot and thread has run
                cmds[side][n] = srv.cmd
                srv.ready()
                http_clients(srv, warm[n])
            for r in range(args.repeats):
                log("HTTP %s, repeat %d/%d" % (counted(n, "client"), r + 1, args.repeats))
                for side, srv in sides:
                    runs[n][side].append(noise.measure(http_clients, srv, bodies[(n, r)]))
        finally:
            for _, srv in sides:
                srv.close()
    metrics, notes = {}, {k: {} for k in ("tokens_per_client", "prompt_tokens_equal", "text_identical",
                                          "finish_reasons", "usage_missing")}
    for n in clients:
        rr, sr, label = runs[n]["reame"], runs[n]["server"], counted(n, "client")
        ttft = {"reame": [t for x in rr for t in x["ttft_s"]], "server": [t for x in sr for t in x["ttft_s"]]}
        for name, per_run, overall in (  # tok/s: Reame / server; TTFT: server / Reame (> 1: Reame is better)
                ("aggregate tok/s", lambda x: x["tok_s"], lambda side, xs: median(xs)),
                ("TTFT median s", lambda x: median(x["ttft_s"]), lambda side, xs: median(ttft[side])),
                ("TTFT p95 s", lambda x: max(x["ttft_s"]), lambda side, xs: nearest_rank(ttft[side], 0.95))):
            m = metrics["%s, %s" % (name, label)] = {}
            for side, xs in (("reame", rr), ("server", sr)):
                m.update({side + "_runs": [per_run(x) for x in xs], side + "_noise": [x["noise"] for x in xs]})
                m[side] = overall(side, m[side + "_runs"])
            m["ratio"] = ratio(m["reame"], m["server"]) if name.startswith("agg") else ratio(m["server"], m["reame"])
        notes["tokens_per_client"][n] = {"reame": [x["tokens"] for x in rr], "server": [x["tokens"] for x in sr]}
        notes["finish_reasons"][n] = {side: sorted(set(f for x in xs for f in x["finish"] if f))
                                      for side, xs in (("reame", rr), ("server", sr))}
        notes["usage_missing"][n] = sum(x["usage_missing"] for x in rr + sr)
        if sr:
            notes["prompt_tokens_equal"][n] = all(a["prompt_tokens"] == b["prompt_tokens"] for a, b in zip(rr, sr))
            notes["text_identical"][n] = "%d/%d" % (sum(ta == tb for a, b in zip(rr, sr) for ta, tb in zip(
                a["texts"], b["texts"])), sum(len(a["texts"]) for a in rr))
    return {"config": {"clients": clients, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
                       "threads": args.threads, "ctx_per_slot": args.ctx, "n_batch": settings["n_batch"],
                       "reame_settings": settings, "reame_cmd": cmds["reame"], "server_cmd": cmds["server"],
                       "logs": log_dir}, "metrics": metrics, "notes": notes}


def print_http(h: dict, w) -> None:
    c, n, st = h["config"], h["notes"], h["config"]["reame_settings"]
    w("HTTP: N streaming clients at once, POST /v1/completions, max_tokens %d, %d alternating repeats; reame.py "
      "serve --parallel N vs llama-server -np N, fresh per N, %d threads, ctx %d per slot, batch %d\n(Reame: %s; "
      "llama-server: %s; ratio > 1: Reame is better, tok/s Reame / server, TTFT server / Reame)\n\n" % (
          c["gen_tokens"], c["repeats"], c["threads"], c["ctx_per_slot"], c["n_batch"],
          layout(st["kv_unified"], st["repack"]), server_layout(next(iter(c["server_cmd"].values()), None))))
    print_ratio_table(w, h["metrics"], 30, "(aggregate = completion tokens of all clients / first send to last "
                      "finish, median of runs; TTFT = send to first text chunk, median and p95 (nearest rank) over "
                      "all clients of all runs; runs column: per-run median TTFT, and per-run max on the p95 line)\n")
    for k, v in n["tokens_per_client"].items():
        w("tokens per client, %s: Reame %s | server %s\n" % (counted(int(k), "client"), v["reame"], v["server"]))
    if n["prompt_tokens_equal"]:
        w("prompt tokens (usage) equal on both sides: %s; greedy text identical per client: %s\n" % (
            ", ".join("N=%s %s" % (k, "yes" if v else "NO") for k, v in n["prompt_tokens_equal"].items()),
            ", ".join("N=%s %s" % (k, v) for k, v in n["text_identical"].items())))
    w("finish reasons: %s\n" % ", ".join("N=%s Reame %s server %s" % (k, v["reame"], v["server"])
                                         for k, v in n["finish_reasons"].items()))
    if any(n["usage_missing"].values()):
        w("note: some streams had no usage chunk; their tokens were counted as text chunks: %s\n" % n["usage_missing"])
    for side, label in (("server", "server"), ("reame", "Reame ")):
        for k, cmd in c[side + "_cmd"].items():
            w("HTTP %s N=%s: %s\n" % (label, k, cmd))
    w("server logs: %s\n" % c["logs"])


# -- load: the table a user reads: clients 1..16, two request mixes, three servers -------------
LOAD_SIDES = ("reame", "server", "matched")  # reame.py serve; llama-server as a user starts it; matched to Reame
_PEOPLE = ["a lighthouse keeper", "a retired violinist", "a beekeeper", "a night-shift nurse", "a cartographer",
           "a ferry captain", "a glassblower", "a chess tutor", "a mountain guide", "a locksmith", "a baker",
           "a court stenographer", "a radio operator", "a botanist", "a tram driver", "a clockmaker"]
_PLACES = ["Lisbon", "a salt marsh", "Tromso", "an orbiting station", "Marrakesh", "a flooded village", "Kyoto",
           "a desert observatory", "Valparaiso", "an island monastery", "Tbilisi", "a border town", "Hanoi",
           "a mining camp", "Reykjavik", "a river barge"]
_THINGS = ["a letter never sent", "a map with one road missing", "a broken compass", "a jar of old keys",
           "a photograph of a stranger", "a violin without strings", "a coded recipe", "a ticket for 1931",
           "a music box", "a notebook of weather", "a seed vault key", "a silver whistle"]


def stock_server(args) -> str:
    """llama-server as released (./build_llama.sh --stock), else --server's (Reame's patched libraries)."""
    stock = os.path.join(HERE, "_llama-stock", "llama-server")
    return stock if os.access(stock, os.X_OK) and args.server == DEFAULT_SERVER else args.server


def load_chat(rng: random.Random, tag: str) -> str:
    """A short chat asking for new prose: nothing in the prompt to copy, a different story each time."""
    # (the request's own words first: prompts that opened alike gave llama-server's prompt cache
    # the shared opening, which is not fresh text)
    return ("%s in %s finds %s: write their story in about 300 words (%s)." % (
        rng.choice(_PEOPLE).capitalize(), rng.choice(_PLACES), rng.choice(_THINGS), tag))


def load_document(rng: random.Random, tag: str, n_words: int) -> str:
    """A retrieval prompt: n_words of random notes (never the same twice), then a question about them."""
    lines, n = [], 0
    while n < n_words:
        line = "Note %d: %s in %s reported %s on day %d; %s %s, %s." % (
            len(lines) + 1, rng.choice(_PEOPLE), rng.choice(_PLACES), rng.choice(_THINGS), rng.randrange(1, 400),
            rng.choice(_WORDS), rng.choice(_WORDS), " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 9))))
        lines.append(line)
        n += len(line.split())
    return ("Field notes (%s):\n%s\n\nIn your own words, write a short essay on what these notes might have in "
            "common." % (tag, "\n".join(lines)))


def load_stream(srv: ServerProcess, body: bytes, start) -> dict:
    out = stream(srv.port, "/v1/chat/completions", body, start, timeout_s=1800)
    out["n"] = n = out["completion_tokens"] if out["completion_tokens"] is not None else out["chunks"]
    span = out["t_end"] - out["t0"] - out["ttft_s"]
    out["decode_tok_s"] = (n - 1) / span if n > 1 and span > 0 else None
    return out


def load_run(srv: ServerProcess, bodies: list, late: Optional[list] = None, delay_s: float = 0.0) -> dict:
    """bodies at once (and late ones delay_s after): aggregate tok/s, per-stream decode tok/s, TTFTs."""
    all_bodies = bodies + (late or [])

    def one(i, start):
        if i >= len(bodies):
            start.wait()
            time.sleep(delay_s)
            return load_stream(srv, all_bodies[i], None)
        return load_stream(srv, all_bodies[i], start)

    outs, _ = run_clients(srv, len(all_bodies), one)
    wall = max(o["t_end"] for o in outs) - min(o["t0"] for o in outs)
    toks = [o["n"] for o in outs]
    return {"tok_s": sum(toks) / wall, "decode_tok_s": [o["decode_tok_s"] for o in outs], "tokens": toks,
            "ttft_s": [o["ttft_s"] for o in outs], "late": len(late or []), "texts": [o["text"] for o in outs],
            "prompt_tokens": [o["prompt_tokens"] for o in outs]}


def run_load(args, noise: CpuNoise) -> dict:
    """The load table: 1..16 clients, short chats and 1,000-token retrieval prompts, fresh text, three servers.

    Per mix and client count N, each server fresh (Reame with an empty REAME_HOME: no archive, no disk KV;
    "reame": {"replay": false}): reame.py serve --parallel N, llama-server -np N as a user starts it (its
    defaults: weight repacking on), and llama-server matched to Reame's kernels (repacking off, Reame's
    batch and KV layout). N clients released together, each its own prompt (a new story; random notes),
    --gen-tokens greedy chat tokens. Then the long-prompt row: --load-long tokens of notes sent first, and
    4 short chats 0.5 s later: their time to first token while it prefills. Every answer is --gen-tokens
    long on both sides (logit_bias takes the end tokens off), so both do the same work. Sides alternate, medians of
    --repeats runs: aggregate tok/s, decode tok/s per stream (median stream), TTFT p50/p95 over all streams.
    """
    clients = sorted(set(args.http_clients))
    rng = random.Random(args.seed)
    with reame.Model(args.model_path, vocab_only=True) as vocab:
        words_per_tok = 1.0 / max(0.5, len(vocab.tokenize(load_document(random.Random(1), "x", 2000))) / 2000)
        # every answer max_tokens long on both sides: the end tokens biased off (the sides' texts
        # differ, and a story that ends after 12 tokens on one side leaves it fewer streams to batch)
        no_end = {str(t): -100 for t in range(vocab.n_vocab) if vocab.is_eog(t)}

    def body(text: str, max_tokens: int) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                           "logit_bias": no_end, "reame": {"replay": False}}).encode()

    def bodies(mix: str, n: int, tag: str) -> list:
        if mix == "chat":
            return [body(load_chat(rng, "%s-%d" % (tag, i)), args.gen_tokens) for i in range(n)]
        return [body(load_document(rng, "%s-%d" % (tag, i), int(1000 * words_per_tok)), args.gen_tokens)
                for i in range(n)]

    long_words = int(args.load_long * words_per_tok)
    mixes = [m for m in args.load_mixes.split(",") if m]
    if set(mixes) - {"chat", "rag", "long"}:
        raise SystemExit("--load-mixes: a comma-separated list of chat, rag and long")
    cases = [(mix, n) for mix in ("chat", "rag") if mix in mixes for n in clients] + [("long", 5)] * (
        "long" in mixes and args.load_long > 0)
    ctx = max(args.ctx, 1400 + args.gen_tokens, args.load_long + 400 if args.load_long else 0)
    log_dir, cmds, runs, settings = tempfile.mkdtemp(prefix="bench-load-"), {}, {}, {}
    for mix, n in cases:
        sides = []
        try:
            home = tempfile.mkdtemp(prefix="home-", dir=log_dir)
            sides.append(("reame", ReameServer(args.model_path, os.path.join(log_dir, "reame-%s-%d.log" % (mix, n)),
                                               noise, threads=args.threads, n_parallel=n, ctx_per_slot=ctx,
                                               home=home)))
            if not args.no_server:
                sides.append(("server", LlamaServer(stock_server(args), args.model_path, os.path.join(
                    log_dir, "server-%s-%d.log" % (mix, n)), noise, defaults=True,
                    extra=("-np", str(n), "-c", str(n * ctx)))))  # the slots and room the clients need
                if n not in settings:  # what serve builds with n slots: matched's batch, KV layout, repacking
                    with reame.Engine(args.model_path, n_ctx=ctx, n_slots=n, n_threads=args.threads) as eng:
                        settings[n] = dict(eng.ctx.settings)
                sides.append(("matched", matched_server(args, settings[n], n, ctx, os.path.join(
                    log_dir, "matched-%s-%d.log" % (mix, n)), noise)))
            for side, srv in sides:
                srv.ready()
                cmds["%s %s N=%d" % (side, mix, n)] = srv.cmd
                load_run(srv, bodies("chat", min(n, 4), "warm"))  # untimed: every slot and thread has run
            for r in range(args.repeats):
                log("load: %s, %s, repeat %d/%d" % (mix, counted(n, "client"), r + 1, args.repeats))
                if mix == "long":
                    work = ([body(load_document(rng, "long-%d" % r, long_words), 16)], bodies("chat", 4, "l%d" % r))
                else:
                    work = (bodies(mix, n, "%s%d-%d" % (mix, r, n)), None)
                for side, srv in (sides if r % 2 == 0 else sides[::-1]):
                    out = noise.measure(load_run, srv, work[0], work[1], 0.5)
                    runs.setdefault((mix, n), {}).setdefault(side, []).append(out)
        finally:
            for _, srv in sides:
                srv.close()
    return {"config": {"clients": clients, "gen_tokens": args.gen_tokens, "ctx_per_slot": ctx,
                       "load_long": args.load_long, "cmds": cmds, "logs": log_dir,
                       "server_build": "stock llama.cpp" if stock_server(args) != args.server else
                       "Reame's patched libraries: ./build_llama.sh --stock builds stock"},
            "rows": [load_row(mix, n, runs[(mix, n)]) for mix, n in cases]}


def load_row(mix: str, n: int, by_side: dict) -> dict:
    """One row of the table: each side's medians over runs, and Reame's ratios to the two others."""
    row = {"mix": mix, "clients": n, "sides": {}}
    for side, outs in by_side.items():
        late = [o for o in outs if o["late"]]
        ttft = [t for o in outs for t in (o["ttft_s"][-o["late"]:] if o["late"] else o["ttft_s"])]
        row["sides"][side] = {
            "tok_s": median([o["tok_s"] for o in outs]),
            "decode_tok_s": median([median(o["decode_tok_s"]) for o in outs]),
            "ttft_p50": median(ttft), "ttft_p95": nearest_rank(ttft, 0.95),
            "runs_tok_s": [round(o["tok_s"], 1) for o in outs], "noise": [o["noise"] for o in outs],
            "long_ttft_s": median([o["ttft_s"][0] for o in late]) if late else None,
            "texts_same_each_run": len({tuple(o["texts"][:len(o["texts"]) - o["late"]]) for o in outs}) == 1
            if mix == "long" else None}
    r = row["sides"].get("reame")
    for other in ("server", "matched"):
        o = row["sides"].get(other)
        if r and o:
            row["vs_" + other] = {"tok_s": ratio(r["tok_s"], o["tok_s"]),
                                  "decode_tok_s": ratio(r["decode_tok_s"], o["decode_tok_s"]),
                                  "ttft_p50": ratio(o["ttft_p50"], r["ttft_p50"]),
                                  "ttft_p95": ratio(o["ttft_p95"], r["ttft_p95"])}
    return row


def print_load(ld: dict, w) -> None:
    c = ld["config"]
    w("Load: N clients at once, streamed greedy chat, %d tokens each, fresh text (a new story or 1,000 tokens of new "
      "notes per client; Reame: empty REAME_HOME, replay off), each server fresh per row, %d alternating repeats, "
      "medians.\nserver = llama-server as a user starts it (%s; its defaults: repacking on); matched = llama-server with "
      "Reame's kernels (repacking off) and batch. Ratios: Reame / other for tok/s, other / Reame for TTFT "
      "(> 1: Reame is better).\n\n" % (c["gen_tokens"], c["repeats"], c["server_build"]))
    w("%-6s %3s | %-27s | %-27s | %-27s | %-27s\n" % ("mix", "N", "aggregate tok/s R / S / M", "decode tok/s per stream",
                                                      "TTFT p50 s", "TTFT p95 s"))
    for row in ld["rows"]:
        s = row["sides"]

        def cell(key, digits):
            vals = "/".join(_fmt(s[k][key], digits) if k in s else "-" for k in LOAD_SIDES)
            rs = ",".join(_x(row.get("vs_" + k, {}).get(key)) for k in ("server", "matched") if "vs_" + k in row)
            return "%s (%s)" % (vals, rs)
        w("%-6s %3d | %-27s | %-27s | %-27s | %-27s\n" % (row["mix"], row["clients"], cell("tok_s", 1),
                                                           cell("decode_tok_s", 1), cell("ttft_p50", 2),
                                                           cell("ttft_p95", 2)))
    for row in ld["rows"]:
        if row["mix"] == "long":
            w("long: one %d-token prompt, then 4 short chats 0.5 s later: the TTFT columns are the chats'; the long "
              "prompt's own TTFT: %s s\n" % (c["load_long"], " / ".join(
                  _fmt(row["sides"][k]["long_ttft_s"], 2) for k in LOAD_SIDES if k in row["sides"])))
    for k, cmd in c["cmds"].items():
        w("%s: %s\n" % (k, cmd))
    w("logs: %s\n" % c["logs"])


# -- handbook: the long system prompt of --prefix-cache, --workload and --warm-ahead -------------
# A chat's system message: (title, clauses); "{x|y|z}": x in the handbook, y, z, ... in its regional
# supplements (a longer text), so the text is deterministic and every section reads differently.
HANDBOOK_SECTIONS = [
    ("Working hours", ["Core hours are {10:00 to 16:00|09:30 to 15:30|10:00 to 15:00} local time, Monday to Friday; "
        "outside core hours employees arrange their day with their manager.", "Full-time employees work {40|38|39} "
        "hours per week on average, measured over a {four|six|twelve}-week period.", "Overtime must be approved in "
        "advance in the time-tracking system and is compensated as time off or at {125|130|150}% of the hourly "
        "rate."]),
    ("Annual leave", ["Employees receive {28|26|30} days of paid annual leave per calendar year, rising by one day "
        "for every {three|two|five} years of service up to a maximum of {32|30|33} days.", "Leave requests of more "
        "than five consecutive days must be submitted at least {four|three|six} weeks in advance.", "Up to five "
        "unused days may be carried over to the next year and expire on {31 March|30 April|30 June}."]),
    ("Sick leave", ["Employees who are ill notify their manager before {09:30|09:00|10:00} on the first day of "
        "absence.", "A medical certificate is required from the {third|fourth|second} calendar day of absence "
        "onwards.", "Sick days during approved annual leave are converted back to leave days when a certificate is "
        "provided."]),
    ("Remote work", ["Employees may work remotely up to {three|two|four} days per week if their role allows it and "
        "their manager agrees.", "Remote work from another country is limited to {20|15|30} working days per "
        "calendar year and must be registered with HR at least two weeks before travel, because of tax and social "
        "security rules.", "The company reimburses up to {500|400|600} EUR per year for home office equipment "
        "against receipts."]),
    ("Travel", ["Business travel is booked through the travel portal; economy class is standard for flights under "
        "{six|five|eight} hours.", "Hotel costs are reimbursed up to {180|160|200} EUR per night in major cities and "
        "{120|110|130} EUR elsewhere.", "Per diem rates follow the national tax tables; receipts for meals are not "
        "required."]),
    ("Expenses", ["Expense claims are submitted within {30|45|60} days of the expense with an itemised receipt.",
        "Taxis are reimbursed when public transport is unavailable, after {22:00|21:00|23:00}, or when carrying "
        "company equipment.", "Alcohol, fines, personal entertainment and upgrades are never reimbursed.", "Claims "
        "above {1,000|750|1,500} EUR require the approval of the budget owner in addition to the manager."]),
    ("Company equipment", ["Laptops and phones remain company property and are returned on the last working day.",
        "Loss or theft of equipment is reported to the IT service desk within {24|12|48} hours.", "Personal software "
        "may not be installed without approval from IT security."]),
    ("Information security", ["Passwords are at least {14|12|16} characters long and are never shared or reused "
        "across services.", "Multi-factor authentication is mandatory for email, source code and customer systems.",
        "Confidential documents are stored only in approved company systems, never on personal devices or private "
        "cloud accounts.", "Suspected phishing emails are reported with the report button and not forwarded."]),
    ("Data protection", ["Personal data of customers and colleagues is processed only for the purpose it was "
        "collected for.", "Data subject requests are forwarded to the data protection officer within "
        "{two|three|five} working days.", "Personal data breaches are reported to the security team immediately, at "
        "the latest within {24|12|48} hours of discovery."]),
    ("Code of conduct", ["Employees treat colleagues, customers and partners with respect regardless of origin, "
        "gender, religion, age, disability or sexual orientation.", "Harassment, bullying and discrimination are not "
        "tolerated and lead to disciplinary action.", "Concerns can be raised with a manager, HR or anonymously "
        "through the ethics hotline."]),
    ("Conflicts of interest", ["Employees disclose any financial interest in suppliers, customers or competitors to "
        "HR.", "Secondary employment requires written approval and may not exceed {ten|eight|twelve} hours per week.",
        "Family members may not report to each other directly or indirectly."]),
    ("Gifts and hospitality", ["Gifts with a value above {50|40|35} EUR from business partners are declined or "
        "handed to compliance.", "Invitations to events are accepted only with a clear business purpose and manager "
        "approval.", "Cash or cash equivalents are never accepted, whatever the amount."]),
    ("On-call duty", ["Teams that run production systems maintain an on-call rotation of at least {four|five|six} "
        "people.", "On-call weeks are compensated with a flat allowance of {350|300|400} EUR plus time off for "
        "incidents handled outside working hours.", "Exceptions to the rotation are approved by the head of "
        "engineering."]),
    ("Parental leave", ["Parents are entitled to parental leave under national law; the company tops up statutory "
        "parental pay to {90|85|100}% of net salary for the first {three|two|four} months.", "Parental leave is "
        "announced to HR at least {seven|eight|ten} weeks before it starts.", "Returning parents may work part-time "
        "for up to two years with a right to return to full time."]),
    ("Training and development", ["Each employee has a training budget of {1,500|1,200|2,000} EUR and "
        "{five|four|six} days per year.", "Courses longer than five days or costing more than {3,000|2,500|4,000} "
        "EUR require a repayment agreement if the employee leaves within twelve months.", "Conference talks by "
        "employees are encouraged and count as working time."]),
    ("Performance reviews", ["Performance reviews take place twice a year, in {spring|March|May} and in the autumn.",
        "Goals are agreed between employee and manager and documented in the HR system.", "Salary reviews happen "
        "once a year and take the review results and market data into account."]),
    ("Compensation and payroll", ["Salaries are paid on the last working day of each month by bank transfer.",
        "Payroll questions go to the payroll team; changes of bank details must reach it by the {15th|10th|20th} of "
        "the month.", "Bonuses, where applicable, are paid with the {March|April|February} salary of the following "
        "year."]),
    ("Benefits", ["The company contributes {100|80|120} EUR per month to the company pension plan for every "
        "employee.", "A public transport ticket or a bicycle lease is offered as a tax-free benefit.", "Employees "
        "may use the sports partnership at a reduced monthly fee of {25|20|30} EUR."]),
    ("Health and safety", ["Accidents at work, including near misses, are reported to the safety officer the same "
        "day.", "First aid kits and defibrillators are located next to every kitchen.", "Employees working at "
        "screens are entitled to an eye examination every {three|two|five} years."]),
    ("Office access", ["Badges are personal and must be visible inside the office.", "Visitors are registered at "
        "reception and accompanied at all times.", "The office is open from {06:00 to 22:00|07:00 to 21:00|06:30 to "
        "20:00}; access outside these hours requires approval from facilities."]),
    ("Communication", ["Internal announcements are published on the intranet and in the {weekly|monthly|fortnightly} "
        "newsletter.", "Only the communications team speaks to the press on behalf of the company.", "Employees may "
        "mention their employer on social media but do not share confidential information."]),
    ("Probation and notice periods", ["The probation period is {six|three|four} months, during which either side may "
        "end the contract with two weeks' notice.", "After probation the notice period is {three|two|one} months to "
        "the end of a calendar month unless the contract says otherwise.", "Resignations are submitted in writing to "
        "HR."]),
    ("Disciplinary procedure", ["Minor misconduct leads to an informal conversation, repeated misconduct to a "
        "written warning.", "Serious misconduct such as theft, fraud or violence can lead to immediate dismissal.",
        "Employees may be accompanied by a colleague or works council member in disciplinary meetings."]),
    ("Whistleblowing", ["Reports of illegal conduct can be made through the whistleblowing platform, also "
        "anonymously.", "Reports are acknowledged within {seven|five|ten} days and answered within {three|two|three} "
        "months.", "Retaliation against anyone who reports in good faith is itself a disciplinary offence."]),
    ("Environment", ["Trains are preferred over flights for journeys under {six|five|seven} hours.", "Printers print "
        "double-sided by default; colour printing requires a reason.", "Waste is separated into paper, packaging, "
        "organic and residual waste in every kitchen."]),
    ("Use of AI tools", ["Only AI tools approved by IT security may be used with company data.", "Customer data, "
        "personal data and source code may not be pasted into public AI services.", "Employees remain responsible "
        "for checking any AI-generated content before they use it."]),
    ("Leaving the company", ["Departing employees return all equipment, badges and documents on their last day.",
        "Access to systems ends at {18:00|17:00|20:00} on the last working day.", "A reference letter is issued "
        "within {two|three|four} weeks of the request."])]
_HANDBOOK_REGIONS = ("Hamburg", "Rotterdam", "Gdansk", "Lyon", "Milan", "Vienna")
HANDBOOK_QUESTIONS = [  # A (cold), B (warm), C (after restart), D (second process)
    "How many vacation days do I get in my first year?", "Can I expense a taxi home after working late?",
    "How long may I work remotely from another country?", "Who approves exceptions to the on-call rotation?"]
WARMUP = {"messages": [{"role": "user", "content": "Reply with one word: ready?"}], "max_tokens": 2,
          "temperature": 0, "stream": True}  # under one 128-token chunk: nothing either side could reuse


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
        out += ["%d.%d Questions about this section go to %s; exceptions need written approval and are reviewed "
                "every %d months." % (n, len(clauses) + 1, depts[i % len(depts)], (6, 12, 3)[i % 3]), ""]
    return "\n".join(out).rstrip() + "\n"


def fit_handbook(model, target: int) -> tuple:
    """(handbook, tokens two questions' chats share): the one whose shared prefix is nearest target."""
    def shared(system: str) -> int:
        try:
            a, b = (model.tokenize(model.apply_chat_template([{"role": "system", "content": system},
                                                              {"role": "user", "content": q}]))
                    for q in HANDBOOK_QUESTIONS[:2])
        except reame.ReameError:
            a, b = (model.tokenize(system + "\n\n" + q) for q in HANDBOOK_QUESTIONS[:2])
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    best = None
    for text in (handbook_text(n) for n in range(1, 1001)):
        n_tok = shared(text)
        if best is None or abs(n_tok - target) < abs(best[1] - target):
            best = (text, n_tok)
        if n_tok >= target:
            break
    return best


# -- prefix-cache: a long shared system prompt, cold / warm / after a restart -------------------
PREFIX_METRICS = ("reame_cache_hits_total", "reame_disk_cache_hits_total", "reame_cached_prompt_tokens_total",
                  "reame_disk_cache_snapshots_total", "reame_disk_cache_written_total")
PREFIX_CASES = {"cold": "cold: fresh process + cache (A)", "warm": "warm: same process (B)",
                "restart": "after restart: new process (C)", "second": "second process, same home (D)"}


def kv_files(kv_dir: str) -> list:
    """(path, size) of every finished snapshot (*.kv) and of temp files being written (*.tmp)."""
    out = []
    for root, _dirs, names in os.walk(kv_dir):
        for p in (os.path.join(root, name) for name in names if name.endswith((".kv", ".tmp"))):
            try:
                out.append((p, os.path.getsize(p)))
            except OSError:
                pass
    return sorted(out)


def wait_snapshots(kv_dir: str, srv: ServerProcess, quiet_s: float = 1.0, timeout_s: float = 180.0) -> list:
    """Wait for Reame's writer: no temp file, files unchanged for quiet_s, all written (/metrics) or 10 s quiet."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        files = kv_files(kv_dir)
        if files != last:
            last, since = files, time.monotonic()
        quiet = time.monotonic() - since
        if not any(p.endswith(".tmp") for p, _ in files) and quiet >= quiet_s:
            m = reame_metrics(srv)
            handed, written = m.get("reame_disk_cache_snapshots_total"), m.get("reame_disk_cache_written_total")
            if (handed is not None and written is not None and written >= handed) or quiet >= 10.0:
                return files
        time.sleep(0.2)
    log("prefix cache: snapshots still being written after %.0f s; going on (SIGTERM flushes them)" % timeout_s)
    return last or []


def run_prefix_cache(args, noise: CpuNoise) -> dict:
    """A ~2,400-token system prompt: TTFT cold, warm, after a restart and from a second process.

    One slot each, the handbook as system message, questions A-D with cache_prompt: cold (fresh
    processes, an empty REAME_HOME), warm (same processes), restart (both stopped, Reame by
    SIGTERM, and started again), second (another reame serve on the same home). Goals: Reame
    cold / restart >= 20x, server warm / Reame warm >= 1. Also snapshot sizes per 1k tokens.
    """
    with reame.Model(args.model_path) as model:
        system, sys_tokens = fit_handbook(model, args.handbook_tokens)
        ctx = max(args.ctx, 1 << max(sys_tokens + 256, 1).bit_length())
        # The same questions every repeat: fresh processes and REAME_HOME, so nothing carries over.
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in HANDBOOK_QUESTIONS]
        with reame.Engine(model, n_ctx=ctx, n_slots=1, n_threads=args.threads) as eng:  # as serve builds it
            settings, chunk = dict(eng.ctx.settings), eng.chunk
            try:
                prompt_tokens = [len(eng.chat_prompt(chat)) for chat in chats]
            except reame.ReameError:
                prompt_tokens = []
        # No template in the GGUF (gemma3-270m): Reame uses its family's built-in one; so does llama-server.
        tmpl = model.chat_template
        builtin_template = tmpl if tmpl and "{" not in tmpl and len(tmpl) < 40 else None
    log_dir, runs = tempfile.mkdtemp(prefix="bench-prefix-logs-"), {s: {c: [] for c in PREFIX_CASES} for s in SIDES}
    snapshots, cmds, exit_codes, homes, live = [], {}, [], [], []

    def start(tag: str, home: str, server: bool = True) -> list:
        """reame serve on home and llama-server (None: not run), both ready and warmed up."""
        pair = [ReameServer(args.model_path, os.path.join(log_dir, "reame-%s.log" % tag), noise, threads=args.threads,
                            n_parallel=1, ctx_per_slot=ctx, home=home, tag=tag), None]
        if server and not args.no_server:
            pair[1] = matched_server(args, settings, 1, ctx, os.path.join(log_dir, "llama-server-%s.log" % tag), noise,
                                     cache_ram=args.server_cache_ram, chat_template=builtin_template, tag=tag)
            cmds.setdefault("server", pair[1].cmd)
        cmds.setdefault("reame", pair[0].cmd)
        for srv in filter(None, pair):  # untimed, without the handbook: pages the weights in, starts the threads
            live.append(srv)
            srv.ready(json.dumps(dict(WARMUP, cache_prompt=False)).encode())
        return pair

    def stop(*servers) -> None:
        for srv in filter(None, servers):
            live.remove(srv)
            if isinstance(srv, ReameServer):
                exit_codes.append(srv.close(90.0))
            else:
                srv.close()

    def measure(case: str, srv: Optional[ServerProcess], q: int, kv_dir: str) -> None:
        if srv is None:
            return
        side = "reame" if isinstance(srv, ReameServer) else "server"
        before = reame_metrics(srv) if side == "reame" else {}
        body = stream_body({"messages": chats[q]}, args.prefix_gen_tokens, args.server_sampling, True)
        out = noise.measure(srv.guarded, stream, srv.port, "/v1/chat/completions", body)
        t = out["timings"] or {}
        if side == "reame":
            after = reame_metrics(srv)
            out["metrics_delta"] = {k: after[k] - before.get(k, 0.0) for k in PREFIX_METRICS if k in after}
        elif out["cached_tokens"] is None and "cache_n" in t:
            out["cached_tokens"] = t["cache_n"]
        out["question"] = HANDBOOK_QUESTIONS[q]
        runs[side][case].append(out)
        log("prefix cache: %-6s %-7s TTFT %.3f s, %s of %s prompt tokens cached%s" % (
            side, case, out["ttft_s"], out["cached_tokens"], out["prompt_tokens"],
            (", server prompt_n %s cache_n %s" % (t.get("prompt_n"), t.get("cache_n"))) if t else ""))
        if side == "reame":  # its writer thread compresses and writes snapshots: not in the server's turn
            wait_snapshots(kv_dir, srv)

    try:
        for r in range(args.repeats):
            log("prefix cache: repeat %d/%d" % (r + 1, args.repeats))
            home = tempfile.mkdtemp(prefix="bench-reame-home-")
            homes.append(home)
            kv_dir = os.path.join(home, "kv")
            r1, s1 = start("r%d-first" % r, home)
            if kv_files(kv_dir):
                raise RuntimeError("the fresh REAME_HOME %s already holds KV snapshots" % home)
            for case, srv, q in (("cold", r1, 0), ("cold", s1, 0), ("warm", r1, 1), ("warm", s1, 1)):
                measure(case, srv, q, kv_dir)
            stop(r1, s1)
            # reame.py's own listing of the snapshots (size: the file's bytes, its small header included)
            snapshots.append(sorted(({"file": os.path.basename(e["path"]), "tokens": e["tokens"], "codec": e["codec"],
                                      "raw_size": e["raw_bytes"], "size": e["bytes"], "file_bytes": e["bytes"]}
                                     for e in reame.kv_cache_entries(kv_dir) if not e["bad"]),
                                    key=lambda h: h["tokens"]))
            r2, s2 = start("r%d-restart" % r, home)
            measure("restart", r2, 2, kv_dir)
            measure("restart", s2, 2, kv_dir)
            stop(s2)
            r3 = start("r%d-second" % r, home, server=False)[0]  # beside the restarted one, on the same home
            if r2.proc.poll() is not None:
                raise RuntimeError("the restarted reame serve exited before the second process ran")
            measure("second", r3, 3, kv_dir)
            stop(r3, r2)
    finally:
        stop(*reversed(live))
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    config = {"system_tokens": sys_tokens, "prompt_tokens_reame": prompt_tokens, "system_chars": len(system),
              "questions": HANDBOOK_QUESTIONS, "ctx_per_slot": ctx, "n_batch": settings["n_batch"], "chunk": chunk,
              "logs": log_dir, "max_tokens": args.prefix_gen_tokens, "server_cache_ram": args.server_cache_ram,
              "reame_settings": settings, "reame_cmd": cmds.get("reame"), "server_cmd": cmds.get("server"),
              "reame_exit_codes": exit_codes}
    med = {(side, case): median([x["ttft_s"] for x in runs[side][case]]) for side in runs for case in PREFIX_CASES}
    table = {case: {side: {"ttft_s": med[side, case], "ttft_runs": [x["ttft_s"] for x in xs],
                           "cached_tokens": [x["cached_tokens"] for x in xs],
                           "prompt_tokens": [x["prompt_tokens"] for x in xs], "noise": [x["noise"] for x in xs]}
                    for side, xs in ((s, runs[s][case]) for s in runs) if xs} for case in PREFIX_CASES}
    for case, row in table.items():
        r, s = med["reame", case], med["server", case]
        row["server_over_reame"] = (s / r) if r and s is not None else None
    (rc, rw, rr, rs), sw = (med["reame", c] for c in PREFIX_CASES), med["server", "warm"]
    ratios = {"reame_cold_over_restart": ratio(rc, rr), "reame_cold_over_warm": ratio(rc, rw),
              "reame_cold_over_second": ratio(rc, rs), "server_warm_over_reame_warm": ratio(sw, rw)}
    goals = {"restart_at_most_1_20_of_cold": (rr * 20 <= rc) if rc and rr else None,
             "reame_warm_no_worse_than_server_warm": (rw <= sw) if rw and sw else None}
    # Per 1k tokens, compressed vs raw; headline: the largest (a restart restores it; SWA layers keep a window).
    flat = [h for rep in snapshots for h in rep if h.get("tokens") and h.get("raw_size") and h.get("size")]
    for h in flat:
        h.update(raw_bytes_per_1k_tokens=1000 * h["raw_size"] / h["tokens"], compression_ratio=h["raw_size"] /
                 h["size"], compressed_bytes_per_1k_tokens=1000 * h["size"] / h["tokens"])
    size = {"files": len(flat), "codec": sorted(set(h["codec"] for h in flat if h.get("codec")))}
    if flat:
        big = max(flat, key=lambda h: h["tokens"])
        size.update({k: big[k] for k in ("raw_bytes_per_1k_tokens", "compressed_bytes_per_1k_tokens",
                                         "compression_ratio")},
                    largest_tokens=big["tokens"], disk_bytes_first_repeat=sum(h["file_bytes"] for h in snapshots[0]),
                    all_files_compression_ratio=sum(h["raw_size"] for h in flat) / sum(h["size"] for h in flat))
    texts = {case: "%d/%d" % (sum(a["text"] == b["text"] for a, b in zip(runs["reame"][case], runs["server"][case])),
                              len(runs["server"][case])) for case in PREFIX_CASES if runs["server"][case]}
    return {"config": config, "table": table, "ratios": ratios, "goals": goals, "snapshot_size": size,
            "snapshots": snapshots, "text_identical": texts, "runs": runs}


def print_prefix(p: dict, w) -> None:
    c, r, g, s, mib = p["config"], p["ratios"], p["goals"], p["snapshot_size"], 2 ** 20
    w("Prefix cache: a %d-token system prompt (an employee handbook) + short questions, %s, max_tokens %d, "
      "%d repeat%s\n(reame.py serve --parallel 1 on a fresh temporary REAME_HOME vs llama-server -np 1 --cache-ram "
      "%s, %d threads, ctx %d; TTFT = send to first content chunk, client side)\n\n%-34s %10s %16s %10s %16s %9s\n%s\n"
      % (c["system_tokens"], c["model"], c["max_tokens"], c["repeats"], "" if c["repeats"] == 1 else "s (medians)",
         c["server_cache_ram"], c["threads"], c["ctx_per_slot"], "case (question)", "Reame s", "cached/prompt",
         "server s", "cached/prompt", "srv/Reame", "-" * 100))
    def cells(d: Optional[dict]) -> tuple:  # TTFT (* if noisy), cached/prompt tokens of the first repeat
        if not d:
            return "-", "-"
        return (_fmt(d["ttft_s"], 3) + ("*" if any((z or 0) > NOISY_FRAC for z in d["noise"]) else ""), "%s/%s" % (
            d["cached_tokens"][0] if d["cached_tokens"] else "-", d["prompt_tokens"][0] if d["prompt_tokens"] else "-"))

    for case, row in p["table"].items():
        w("%-34s %10s %16s %10s %16s %9s\n" % (PREFIX_CASES[case], *cells(row.get("reame")), *cells(row.get("server")),
                                                _x(row["server_over_reame"])))
    w("(cached/prompt: usage's cached_tokens (llama-server: timings.cache_n) / prompt_tokens, first repeat; "
      "llama-server's restart is a cold start (no disk tier); srv/Reame > 1: Reame is faster; * = noisy run)\n")
    if c["repeats"] > 1:
        for case, row in p["table"].items():
            w("  runs %-8s Reame %s | server %s\n" % (case, *(" ".join(_fmt(x, 3) for x in row.get(side, {}).get(
                "ttft_runs", [])) for side in SIDES)))
    verdict = {None: "-", True: "met", False: "NOT MET"}
    w("\nReame cold / after-restart TTFT: %sx   (goal >= 20x: %s)\nReame cold / warm TTFT: %sx; cold / second "
      "process: %sx\nReame warm vs llama-server warm: server/Reame %sx   (goal >= 1, no worse: %s)\n" % (
          _fmt(r["reame_cold_over_restart"], 1), verdict[g["restart_at_most_1_20_of_cold"]],
          _fmt(r["reame_cold_over_warm"], 1), _fmt(r["reame_cold_over_second"], 1),
          _fmt(r["server_warm_over_reame_warm"], 2), verdict[g["reame_warm_no_worse_than_server_warm"]]))
    if s["files"]:
        w("snapshot size per 1k tokens (largest snapshot, %d tokens): %.2f MiB raw, %.2f MiB compressed "
          "(%s, %.2fx smaller); all %d files: %.2fx, %.1f MiB on disk after the first process\n"
          % (s["largest_tokens"], s["raw_bytes_per_1k_tokens"] / mib, s["compressed_bytes_per_1k_tokens"] / mib,
             "/".join(s["codec"]), s["compression_ratio"], s["files"], s["all_files_compression_ratio"],
             s["disk_bytes_first_repeat"] / mib))
        for h in p["snapshots"][0]:
            w("  %5d tokens: %7.1f MiB raw -> %7.1f MiB %s (%.2f -> %.2f MiB per 1k tokens)\n" % (
                h["tokens"], h["raw_size"] / mib, h["size"] / mib, h["codec"], h["raw_bytes_per_1k_tokens"] / mib,
                h["compressed_bytes_per_1k_tokens"] / mib))
    else:
        w("no snapshot files were written\n")
    if p["text_identical"]:
        w("greedy text identical Reame vs server: %s\n" % ", ".join("%s %s" % kv for kv in p["text_identical"].items()))
    w("Reame exit codes after SIGTERM: %s\nprefix cache Reame:  %s\n%sserver logs: %s\n" % (
        c["reame_exit_codes"], c["reame_cmd"], "prefix cache server: %s\n" % c["server_cmd"] if c["server_cmd"] else "",
        c["logs"]))


# -- workload: a support desk's trace against llama-server as a user starts it ------------------
WORKLOAD_FAQ = [
    "How many vacation days do I get in my first year?", "Can I expense a taxi home after working late?",
    "How long may I work remotely from another country?", "Who approves overtime?",
    "What is the notice period when I resign?", "Is there a budget for training courses?",
    "How do I report a safety incident in the warehouse?", "Can I bring my dog to the office?"]
WORKLOAD_HOWTO = ["List, as numbered steps, how I request parental leave.",
                  "List, as numbered steps, how I claim travel expenses.",
                  "List, as numbered steps, what I do on my last working day."]
WORKLOAD_TICKETS = [
    "Ticket 4411 from Jana Novak (Gdansk): my laptop screen flickers since Monday, I need it fixed before the "
    "audit on Friday.",
    "Ticket 4412 from Luca Bianchi (Milan): payroll paid me 200 euros too little in March, please correct it.",
    "Ticket 4413 from Emma Weber (Vienna): the badge reader at gate 3 rejects my card every morning."]
WORKLOAD_TICKET_SCHEMA = {
    "type": "object",
    "properties": {"ticket": {"type": "integer"}, "name": {"type": "string"}, "site": {"type": "string"},
                   "department": {"enum": ["HR", "Finance", "IT", "Facilities", "Payroll"]},
                   "urgent": {"type": "boolean"}, "summary": {"type": "string"}},
    "required": ["ticket", "name", "site", "department", "urgent", "summary"]}
_INVOICE = ("def invoice_total(lines, vat_rate):\n    total = 0\n    for qty, price in lines:\n"
            "        total += qty * price\n    vat = total * vat_rate\n    return round(total + vat, 2)\n")
WORKLOAD_CODE = [
    ("Rename the variable `total` to `subtotal` everywhere and return the whole function.", _INVOICE),
    ("Add a `discount` parameter (default 0) subtracted from the total before VAT; return the whole function.",
     _INVOICE)]
WORKLOAD_CODE_SYSTEM = "You are a careful Python assistant. Answer with code only, in one ```python block."
# A support desk's hour: (kind, index), 16 new and 16 repeating an earlier one word for word, leaning late.
WORKLOAD_ORDER = [
    ("faq", 0), ("howto", 0), ("faq", 1), ("ticket", 0), ("faq", 2), ("code", 0), ("howto", 1), ("faq", 3),
    ("faq", 0), ("ticket", 1), ("faq", 4), ("howto", 0), ("faq", 1), ("code", 1), ("faq", 5), ("ticket", 2),
    ("howto", 2), ("faq", 2), ("faq", 6), ("ticket", 0), ("faq", 3), ("howto", 1), ("faq", 7), ("code", 0),
    ("faq", 0), ("faq", 4), ("howto", 2), ("faq", 1), ("ticket", 1), ("faq", 5), ("howto", 0), ("faq", 2)]
WORKLOAD_MAX_TOKENS = {"faq": 64, "howto": 128, "ticket": 96, "code": 160}
WORKLOAD_PHASES = ("server_cold", "server_warm", "reame_cold", "reame_warm", "reame_restart", "reame_restart_noreplay")


def workload_bodies(system: str, replay: bool = True) -> list:
    """The trace's (name, body): streamed greedy chats, the same for both (replay=False: Reame's opt-out)."""
    out = []
    for kind, i in WORKLOAD_ORDER:
        body = {"max_tokens": WORKLOAD_MAX_TOKENS[kind], "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if not replay:
            body["reame"] = {"replay": False}
        if kind == "code":
            body["messages"] = [{"role": "system", "content": WORKLOAD_CODE_SYSTEM}, {
                "role": "user", "content": "```python\n%s```\n%s" % (WORKLOAD_CODE[i][1], WORKLOAD_CODE[i][0])}]
        else:
            q = {"faq": WORKLOAD_FAQ, "howto": WORKLOAD_HOWTO}.get(kind, WORKLOAD_TICKETS)[i]
            if kind == "ticket":
                q = "Extract the ticket as JSON: " + q
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "ticket", "schema": WORKLOAD_TICKET_SCHEMA}}
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        out.append(("%s %d" % (kind, i + 1), json.dumps(body).encode()))
    return out


def in_order(srv: ServerProcess, clients: int, n: int, one) -> list:
    """one(i) for i in 0..n-1 by `clients` threads, each taking the next i in order: the results."""
    results, todo, lock = [None] * n, iter(range(n)), threading.Lock()

    def client(_k, _start):
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = one(i)

    run_clients(srv, clients, client, barrier=False)
    return results


def workload_pass(srv: ServerProcess, bodies: list, clients: int) -> dict:
    """The trace through srv by `clients` threads, each taking the next request in order."""
    t0 = time.perf_counter()
    results = in_order(srv, clients, len(bodies), lambda i: dict(stream(srv.port, "/v1/chat/completions",
                                                                        bodies[i][1]), name=bodies[i][0]))
    total = time.perf_counter() - t0
    if any(r is None for r in results):
        raise RuntimeError("%s: a workload request got no answer" % srv.name)
    walls = [r["total_s"] for r in results]
    return {"total_s": total, "requests": results, "first8_s": sum(walls[:8]) / 8, "last8_s": sum(walls[-8:]) / 8,
            "replayed": sum(r["replayed"] for r in results)}


def run_workload(args, noise: CpuNoise) -> dict:
    """32 support-desk requests: llama-server as a user starts it vs reame.py serve, cold to restarted.

    FAQs asked again word for word, how-tos, tickets to JSON (json_schema), a code edit, the
    handbook as system prompt. llama-server (model, host, port only): cold, again; reame.py serve:
    cold (empty REAME_HOME), again, after a restart, then with replay off. Wall time per phase.
    """
    with reame.Model(args.model_path) as m:
        system, n_sys = fit_handbook(m, args.handbook_tokens)
    bodies, no_replay = workload_bodies(system), workload_bodies(system, replay=False)
    log_dir = tempfile.mkdtemp(prefix="bench-workload-logs-")
    out = {"config": {"handbook_tokens": n_sys, "requests": len(bodies), "clients": args.workload_clients,
                      "repeats_in_trace": len(WORKLOAD_ORDER) - len(set(WORKLOAD_ORDER))}, "runs": {}, "cmds": {}}
    for clients in args.workload_clients:
        runs = out["runs"][str(clients)] = {}
        home = tempfile.mkdtemp(prefix="bench-workload-home-")
        starts = [] if args.no_server else [("server", ("cold", "warm"))]
        for side, phases in starts + [("reame", ("cold", "warm")), ("reame", ("restart", "restart_noreplay"))]:
            path = os.path.join(log_dir, "%s-%d-%s.log" % (side, clients, phases[0]))
            srv = (LlamaServer(args.server, args.model_path, path, noise, defaults=True, tag="defaults")
                   if side == "server" else ReameServer(args.model_path, path, noise, threads=args.threads,
                                                        n_parallel=4, ctx_per_slot=4096, home=home))
            out["cmds"][side] = srv.cmd
            try:
                srv.ready(json.dumps(WARMUP).encode())
                for phase in phases:
                    log("workload: %s, %d client(s), %s" % (side, clients, phase))
                    runs[side + "_" + phase] = workload_pass(srv, no_replay if phase == "restart_noreplay" else bodies,
                                                             clients)
            finally:
                srv.close()
        shutil.rmtree(home, ignore_errors=True)
        texts = [[r["text"] for r in runs[p]["requests"]] for p in WORKLOAD_PHASES[2:]]
        runs["reame_phases_equal"] = all(t == texts[0] for t in texts)
        if "server_cold" in runs:
            runs["same_text_as_server"] = sum(a == b["text"] for a, b in zip(texts[0], runs["server_cold"]["requests"]))
    if args.plot:
        out["plot"] = plot_workload(out, os.path.basename(args.model_path), args.plot)
    return out


def plot_workload(out: dict, model: str, path: str) -> str:
    """Per-request bars of every phase, a panel per client count, as a PNG (if matplotlib is there)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("workload: no matplotlib (python3 -m pip install matplotlib): no plot")
        return ""
    fig, axes = plt.subplots(len(out["runs"]), 1, figsize=(13, 4.2 * len(out["runs"])), squeeze=False)
    for ax, (clients, runs) in zip(axes[:, 0], out["runs"].items()):
        phases = [p for p in WORKLOAD_PHASES if p in runs]
        width = 0.8 / len(phases)
        for k, p in enumerate(phases):
            walls = [r["total_s"] for r in runs[p]["requests"]]
            ax.bar([i + k * width for i in range(len(walls))], walls, width, label="%s (%.0f s in all)"
                   % (p.replace("_", " ").replace("server", "llama-server"), runs[p]["total_s"]))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(WORKLOAD_ORDER))])
        ax.set_xticklabels([r["name"] for r in runs[phases[0]]["requests"]], rotation=70, fontsize=7)
        ax.set_ylabel("seconds per request")
        ax.set_title("%s, %s client(s): the support-desk trace, request by request" % (model, clients))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def print_workload(wl: dict, w) -> None:
    c = wl["config"]
    w("workload: %s, %d requests (%d repeat an earlier one word for word), a %d-token handbook system prompt\n"
      "per phase: seconds for the whole trace; ratio = llama-server cold / this (> 1: faster than llama-server "
      "as a user starts it); mean seconds per request of the first 8 and the last 8; answers replayed\n\n"
      % (c["model"], c["requests"], c["repeats_in_trace"], c["handbook_tokens"]))
    for clients, runs in wl["runs"].items():
        base = runs.get("server_cold", {}).get("total_s")
        w("%s client(s)\n%-22s %9s %8s %9s %9s %9s\n" % (clients, "phase", "total s", "ratio", "first 8", "last 8",
                                                         "replayed"))
        for p, r in ((p, runs[p]) for p in WORKLOAD_PHASES if p in runs):
            w("%-22s %9.1f %8s %9.2f %9.2f %9d\n" % (p.replace("server", "llama-server").replace("_", " "),
                                                     r["total_s"], _x(ratio(base, r["total_s"])), r["first8_s"],
                                                     r["last8_s"], r["replayed"]))
        w("Reame's answers equal in its four phases: %s%s\n\n" % ("yes" if runs["reame_phases_equal"] else "NO", (
            "; the same text as llama-server's: %d of %d" % (runs["same_text_as_server"], c["requests"]))
            if "same_text_as_server" in runs else ""))
    for side, cmd in wl["cmds"].items():
        w("%s: %s\n" % (side, cmd))
    if wl.get("plot"):
        w("plot: %s\n" % wl["plot"])


# -- warm-ahead: the first request after a restart -------------------------------------------
def run_warm_ahead(args, noise: CpuNoise) -> dict:
    """The first request after a restart: its TTFT with idle warm-ahead on vs off.

    A handbook chat is asked twice (its head on the disk tier); per repeat a new engine on that
    directory idles 3 s, then a new question: warm-ahead on (head restored while idle) vs off.
    """
    kv = tempfile.mkdtemp(prefix="bench-warm-kv-")
    out = {"on": [], "off": [], "cached": {}}

    def ask(eng, q):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        tokens = eng.chat_prompt(msgs)
        t0 = time.perf_counter()  # (submit reads the disk tier, on this thread: part of the wait)
        req = eng.submit_n(tokens, reame.SamplingParams(temperature=0, max_tokens=4), replay=False)[0]
        next(iter(req))
        return time.perf_counter() - t0, req.wait()

    try:
        with reame.Model(args.model_path) as m:
            system, n_sys = fit_handbook(m, args.handbook_tokens)
            kw = dict(n_ctx=4096, n_slots=1, n_threads=args.threads, disk_cache=1 << 31, disk_dir=kv)
            for _ in range(2):  # counted twice in the head history: a head worth warming
                with reame.Engine(m, **kw) as eng:
                    ask(eng, HANDBOOK_QUESTIONS[0])
            for rep in range(args.repeats):
                for mode in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                    with reame.Engine(m, warm_ahead=mode == "on", **kw) as eng:
                        time.sleep(3.0)
                        ttft, res = ask(eng, HANDBOOK_QUESTIONS[1 + rep % 3])
                        out[mode].append(ttft)
                        out["cached"][mode] = res.n_cached_tok
                        log("warm-ahead %s: TTFT %.3f s (%d prompt tokens cached)" % (mode, ttft, res.n_cached_tok))
    finally:
        shutil.rmtree(kv, ignore_errors=True)
    return dict(out, handbook_tokens=n_sys, on_median=median(out["on"]), off_median=median(out["off"]))


def print_warm_ahead(wa: dict, w) -> None:
    w("warm-ahead: the first request after a restart (a %d-token handbook head on the disk tier, 3 s idle)\n"
      "  TTFT with warm-ahead %.3f s, without %.3f s (medians; runs %s | %s): %.1fx\n" % (
          wa["handbook_tokens"], wa["on_median"], wa["off_median"], " ".join("%.3f" % x for x in wa["on"]),
          " ".join("%.3f" % x for x in wa["off"]), wa["off_median"] / max(wa["on_median"], 1e-9)))


# -- spec: speculation on vs off, three workloads, idle and with a CPU burner --------------------
SPEC_REPORT = "\n\n".join("%d. %s" % (i + 1, p) for i, p in enumerate([
    "The Harbour Board met on the third of March to review the winter season. Forty-two vessels used the north "
    "basin between November and February, eleven more than the year before, and the new fuel pontoon handled "
    "just over nine hundred thousand litres without a single reported spill.",
    "Dredging of the approach channel was delayed by six weeks because the contractor's barge was held at "
    "Rotterdam for repairs. The channel depth at low water fell to 7.4 metres in January, and two deep-draught "
    "tankers had to wait for the tide before entering.",
    "The board approved a budget of 1.2 million euros for replacing the timber fenders on the east quay. Work will "
    "start in May, when traffic is lighter, and the quay will stay open to small craft during the works, with a "
    "speed limit of four knots inside the basin.",
    "Complaints about noise from the container crane rose to nineteen this winter. The harbour master proposed "
    "limiting night operations to essential cargo between midnight and five in the morning, and the board asked "
    "for a trial of three months starting in April.",
    "Finally, the board thanked the pilots' association for forty years of service without a serious accident, and "
    "agreed to name the new pilot boat after Captain Ilse Varga, who retired in December after twenty-six years "
    "on the station."]))
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
     "bottle. Do not use any lists.")]


def spec_decode(eng, tokens: list, max_tokens: int, opts=None, archive="shared", **params) -> dict:
    """One greedy request: decode tok/s (after the first token), tokens, (accepted, proposed) by source."""
    before = eng.stats()["spec"]
    r = eng.submit(tokens, reame.SamplingParams(temperature=0, max_tokens=max_tokens, **params), spec=opts,
                   archive=archive).wait()
    after, span = eng.stats()["spec"], r.total_s - r.ttft_s
    return {"tok_s": (r.n_gen_tok - 1) / span if span > 0 and r.n_gen_tok > 1 else None, "tokens": r.tokens,
            "n": r.n_gen_tok, "accepted": {k: (after[k]["accepted"] - before[k]["accepted"],
                                               after[k]["proposed"] - before[k]["proposed"]) for k in after}}


def add_accepted(total: dict, accepted: dict, which=lambda src: True) -> None:
    """Sum spec_decode's (accepted, proposed) per source into total, for the sources `which` takes."""
    for src, (a, p) in accepted.items():
        if which(src):
            total[src] = [x + y for x, y in zip(total.get(src, (0, 0)), (a, p))]


def drafts_text(accepted: dict, name=lambda src: src) -> str:
    return ", ".join("%s %d/%d" % (name(s), a, p) for s, (a, p) in sorted(accepted.items()) if p)


def run_spec(args, noise: CpuNoise) -> dict:
    """Speculation off, prompt lookup on, the draft model on, auto: tok/s on three workloads.

    Quoting the prompt, a code edit, prose; idle and with a CPU burner on core 0; the exact engine,
    then spec_verify="fast", each with its own "off". One engine at a time: two are two OpenMP
    teams on 2 cores (a one-token step of the 1.5B then took 34 ms instead of 19 ms).
    """
    lookup, auto = reame.SpecOptions("on", args.spec_max, ("lookup",)), reame.SpecOptions("auto", args.spec_max)
    configs = {"exact": {"off": reame.SpecOptions("off"), "lookup on": lookup,
                         "draft on": reame.SpecOptions("on", args.spec_draft_k, ("draft",)), "auto": auto},
               "fast": {"off, fast engine": reame.SpecOptions("off"), "lookup on, fast": lookup, "auto, fast": auto}}
    conds, names = ("idle", "burner on core 0"), [name for name, _ in SPEC_WORKLOADS]
    out = {"config": {"draft": args.spec_draft, "spec_max": args.spec_max, "draft_k": args.spec_draft_k},
           "conditions": {cond: {name: {} for name in names} for cond in conds}, "controller": {}, "cost_model_s": {}}
    refs = {}  # (cond, name, rep) -> the exact engine's greedy tokens
    with reame.Model(args.model_path) as model, reame.Model(reame.resolve_model(args.spec_draft)) as draft:
        for verify, phase in configs.items():  # weights shared by both engines
            with reame.Engine(model, n_ctx=args.ctx, n_slots=len(SPEC_WORKLOADS), n_threads=args.threads,
                              draft=draft, spec_verify=verify) as eng:
                prompts = [(name, chat_tokens(eng, text)) for name, text in SPEC_WORKLOADS]
                for name, toks in prompts:  # prefill once: later runs reuse the prompt's KV (target and draft)
                    spec_decode(eng, toks, 2, reame.SpecOptions("off"))
                for cond in conds:
                    burner = None if cond == "idle" else subprocess.Popen(  # an oversubscribed vCPU
                        [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"],
                        preexec_fn=_set_pdeathsig)
                    try:
                        for rep in range(args.repeats):
                            for name, toks in prompts:
                                row = out["conditions"][cond][name]
                                for cname in (list(phase) if rep % 2 == 0 else list(phase)[::-1]):
                                    r = spec_decode(eng, toks, args.gen_tokens, phase[cname])
                                    d = row.setdefault(cname, {"tok_s": [], "accepted": {}})
                                    d["tok_s"].append(r["tok_s"])
                                    add_accepted(d["accepted"], r["accepted"])
                                    same = r["tokens"] == refs.setdefault((cond, name, rep), r["tokens"])
                                    # exact configs and the fast engine's off must agree; the fast ones may not
                                    key = "fast_equal" if verify == "fast" and cname[:3] != "off" else "greedy_equal"
                                    row[key] = row.get(key, True) and same
                                    log("spec [%s] %s / %s: %.2f tok/s (%d tokens)" % (
                                        cond, name, cname, r["tok_s"] or 0, r["n"]))
                    finally:
                        if burner is not None:
                            burner.kill()
                            burner.wait()
                out["controller"][verify] = eng.stats()["spec"]
                out["cost_model_s"][verify] = {str(k): t for k, t in sorted(eng.spec.cost.known().items())}
    for row in (row for table in out["conditions"].values() for row in table.values()):
        base = {v: median(row[next(iter(phase))]["tok_s"]) for v, phase in configs.items()}
        for v, phase in configs.items():
            for c in phase:
                row[c].update(median=median(row[c]["tok_s"]), ratio=ratio(median(row[c]["tok_s"]), base[v]))
    return out


def print_spec(sp: dict, w) -> None:
    c = sp["config"]
    w("Speculation: %s, draft %s (k=%d when forced), lookup up to %d, %d threads, %d tokens, %d repeats\n"
      % (c["model"], c["draft"], c["draft_k"], c["spec_max"], c["threads"], c["gen_tokens"], c["repeats"]))
    for cond, table in sp["conditions"].items():
        w("\n  [%s] decode tok/s (ratio to off); accepted/proposed drafts\n" % cond)
        for name, row in table.items():
            cells = ["%s %s (x%s)%s" % (cname, _fmt(r["median"], 2), _fmt(r["ratio"], 2), " [%s]" % drafts_text(
                r["accepted"]) if drafts_text(r["accepted"]) else "") for cname, r in row.items() if type(r) is dict]
            w("  %-15s\n    %s\n    greedy output: exact configs %s; fast configs %s\n" % (
                name, "\n    ".join(cells), "equal" if row["greedy_equal"] else "MISMATCH (a bug)",
                "equal" if row["fast_equal"] else "differ (allowed: near-ties)"))
    for v, costs in sp["cost_model_s"].items():
        w("\n  cost model, %s (s per target step by tokens): %s\n" % (v, ", ".join(
            "%s: %.3f" % (k, t) for k, t in list(costs.items())[:14])))


# -- step-cost: one decode step's cost by tokens in it ---------------------------------------
STEP_SIZES = (1, 2, 3, 4, 5, 8, 12, 16, 17, 24, 32, 33)
STOCK_PP = (1, 2, 4, 8, 12, 16, 24, 32)
STEP_DEPTH = 300  # tokens in the context before each step (both sides)


def llama_bench(binary: str, model: str, threads: int, repeats: int, *flags: str) -> dict:
    """llama-bench's JSON rows as {"pp<k>": seconds for the k tokens, "tg<n>": seconds per token}."""
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(os.path.abspath(binary)))
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-d", str(STEP_DEPTH), "-r", str(repeats),
                          "-o", "json", *flags], env=env, check=True, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL).stdout
    rows = {}
    for t in json.loads(out):
        if t["n_gen"]:
            rows["tg%d" % t["n_gen"]] = t["avg_ns"] / 1e9 / t["n_gen"]
        else:
            rows["pp%d" % t["n_prompt"]] = t["avg_ns"] / 1e9
    return rows


def run_step_cost(args, noise: CpuNoise) -> dict:
    """Seconds of one decode step (row by row, as decode steps run) by tokens in it, 1 to 33, beside stock.

    After a 300-token prompt, alternating order, medians, as multiples of one token. Beside it, when
    ./build_llama.sh --stock has built _llama-stock: stock llama-bench's pp1..pp32 at depth 300 (its
    defaults: weight repacking on) and tg64, and llama-bench on Reame's libraries (--repack 0, Reame's
    one-token kernel) tg64, alternating with Reame's rounds. --against LIBLLAMA: also that library (a
    process per library and round, alternating) and the ratio.
    """
    times = {"this": {}, "against": {}} if args.against else {"this": {}}
    stock = os.path.join(HERE, "_llama-stock", "llama-bench")
    ours = os.path.join(HERE, "_llama", "llama-bench")
    benches = {}  # name -> [rows per round]
    last = {}  # k -> seconds of a k-token step computing only the last token's logits (llama-bench pp-k's work)
    if args.against:
        libs = [("this", os.environ.get("REAME_LIBLLAMA")), ("against", args.against)]
        for rnd in range(args.repeats):
            for name, lib in (libs if rnd % 2 == 0 else libs[::-1]):
                env = {k: v for k, v in os.environ.items() if k != "REAME_LIBLLAMA"}
                env.update({"REAME_LIBLLAMA": lib} if lib else {})
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--step-cost", "--repeats", "3",
                                      "--model", args.model, "--threads", str(args.threads), "--json"],
                                     env=env, check=True, stdout=subprocess.PIPE).stdout
                for k, sec in json.loads(out)["step_cost"]["this"]["step_s"].items():
                    times[name].setdefault(int(k), []).append(sec)
            log("step cost round %d/%d done" % (rnd + 1, args.repeats))
    else:
        with reame.Model(args.model_path) as model, reame.Context(model, n_ctx=2048, n_seq_max=1, n_batch=512,
                                                                  n_threads=args.threads) as ctx:
            toks = model.tokenize("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 30)[:STEP_DEPTH]
            b = reame.Batch(512)
            for i, tok in enumerate(toks):
                b.add(tok, i, 0, i == len(toks) - 1)
            ctx.decode(b)

            def step(k: int, all_logits: bool) -> float:
                """Seconds of one k-token decode step after the prompt (then taken back out of the KV)."""
                b.clear()
                for j in range(k):
                    b.add(toks[j], len(toks) + j, 0, all_logits or j == k - 1)
                t0 = time.perf_counter()
                ctx.decode(b, rowwise=True)
                sec = time.perf_counter() - t0
                ctx.seq_rm(0, len(toks), -1)
                return sec
            for rnd in range(args.repeats):
                for k in (STEP_SIZES if rnd % 2 == 0 else STEP_SIZES[::-1]):
                    times["this"].setdefault(k, []).append(step(k, True))
                    if k in STOCK_PP and k > 1:  # the same step with only the last token's logits: pp-k's work
                        last.setdefault(k, []).append(step(k, False))
                if os.access(stock, os.X_OK) and not args.no_server:  # llama-bench between Reame's rounds
                    pp = ",".join(map(str, STOCK_PP))
                    for name, binary, flags in (("stock", stock, ("-p", pp, "-n", "64")),
                                                ("reame_libs", ours, ("--repack", "0", "-p", "0", "-n", "64"))):
                        if os.access(binary, os.X_OK):
                            benches.setdefault(name, []).append(llama_bench(binary, args.model_path, args.threads,
                                                                            2, *flags))
                    log("step cost round %d/%d done" % (rnd + 1, args.repeats))
    out = {name: {"step_s": {k: median(v) for k, v in t.items()},
                  "ratio": {k: median(v) / median(t[1]) for k, v in t.items()}} for name, t in times.items()}
    if last:
        out["this"]["last_logits_s"] = {k: median(v) for k, v in last.items()}
    out["controller"] = controller_choices(out["this"]["step_s"])
    if args.against:
        out.update(config={"against": args.against}, this_vs_against={
            k: out["this"]["step_s"][k] / out["against"]["step_s"][k] for k in out["this"]["step_s"]})
    elif benches:
        out["llama_bench"] = {name: {key: median([r[key] for r in rows]) for key in rows[0]}
                              for name, rows in benches.items()}
    elif not args.no_server:
        out["llama_bench_missing"] = "no stock llama-bench at %s: ./build_llama.sh --stock builds it" % stock
    return out


SPEC_ACCEPTANCE = (0.5, 0.7, 0.8, 0.9)  # per draft token, for the controller's reading of a step-cost curve


def controller_choices(step_s: dict) -> dict:
    """What the speculation controller makes of a step-cost curve: its CostModel fed these
    costs, the draft length choose_k picks for one sequence (up to SpecOptions' default max_k)
    and its expected speedup, at each acceptance of SPEC_ACCEPTANCE (the same for every
    draft position): steeper costs (a MoE model's experts) buy shorter drafts."""
    cm = reame.CostModel()
    for k in sorted(step_s):
        cm.observe(k, step_s[k])
    max_k = reame.SpecOptions().max_k
    out = {str(a): dict(zip(("k", "gain"), reame.choose_k([a] * max_k, cm.cost, 1, max_k)))
           for a in SPEC_ACCEPTANCE}
    # the lowest acceptance (in hundredths) at which drafting clears the controller's margin
    out["break_even"] = next((a / 100 for a in range(1, 100) if reame.worth_it(
        reame.choose_k([a / 100] * max_k, cm.cost, 1, max_k)[1], reame._SPEC_MARGIN)), None)
    return out


def print_step_cost(sc: dict, w) -> None:
    c = sc["config"]
    w("Decode step cost: %s, %d threads, %d alternating rounds (medians); k tokens in one step as a multiple of one "
      "token:\n" % (c["model"], c["threads"], c["repeats"]))
    for name, label in (("this", "this checkout"), ("against", c.get("against"))):
        if name in sc:
            w("  %s (one token %.1f ms):\n    %s\n" % (label, 1e3 * sc[name]["step_s"][1], "  ".join(
                "%d: %.2fx" % (k, r) for k, r in sc[name]["ratio"].items())))
    if "this_vs_against" in sc:
        w("  this checkout's step time / the other's: %s\n" % "  ".join(
            "%d: %.2f" % (k, r) for k, r in sc["this_vs_against"].items()))
    lb = sc.get("llama_bench")
    if lb and "stock" in lb:
        st, ours = lb["stock"], sc["this"]["step_s"]
        last = {int(k): v for k, v in sc["this"].get("last_logits_s", {}).items()}
        last[1] = ours.get(1)
        w("\nBeside stock llama.cpp (the same source, unpatched, its defaults: repacking on), %d tokens in the "
          "context (llama-bench -d %d; ratio > 1: Reame is faster). A decode step computes every token's logits "
          "(k sequences, or k drafts to verify); llama-bench's pp-k computes the last token's only, so the step "
          "with only the last token's logits is beside it, the same work:\n  %-4s %14s %14s %7s %16s %7s\n" % (
              STEP_DEPTH, STEP_DEPTH, "k", "Reame step ms", "stock pp-k ms", "ratio", "last logits ms", "ratio"))
        for k in STOCK_PP:
            if "pp%d" % k in st and k in ours:
                pp = st["pp%d" % k]
                w("  %-4d %14.1f %14.1f %6.2fx %16s %7s\n" % (
                    k, 1e3 * ours[k], 1e3 * pp, pp / ours[k], "%.1f" % (1e3 * last[k]) if last.get(k) else "-",
                    "%.2fx" % (pp / last[k]) if last.get(k) else "-"))
        tg = [("stock llama-bench (repacking on)", st.get("tg64"))]
        if "reame_libs" in lb:
            tg.insert(0, ("llama-bench on Reame's libraries (--repack 0: Reame's kernel)", lb["reame_libs"].get("tg64")))
        w("  tg64: %s\n" % "; ".join("%s %.1f tok/s" % (n, 1 / v) for n, v in tg if v))
    elif sc.get("llama_bench_missing"):
        w("  (%s)\n" % sc["llama_bench_missing"])
    if sc.get("controller"):
        w("\nThe speculation controller on this curve (one sequence; draft length chosen, expected speedup), by "
          "acceptance per draft token:\n  %s\n  it drafts from an acceptance of %s on\n" % ("  ".join(
              "%s: k=%d %.2fx" % (a, c["k"], c["gain"]) for a, c in sc["controller"].items() if a != "break_even"),
              sc["controller"]["break_even"]))


# -- suggest: Il Suggeritore on vs off ---------------------------------------------------------
SUGGEST_RECORD = {"type": "object", "required": ["name", "city", "age", "job", "email"], "properties": {
    "name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"}, "job": {"type": "string", "maxLength": 40},
    "email": {"type": "string", "maxLength": 60}}}
SUGGEST_SCHEMA = {"type": "array", "items": SUGGEST_RECORD, "minItems": 10, "maxItems": 10}
SUGGEST_JSON = ("Invent 10 people. Reply with only a JSON array of 10 objects, each with the fields name, city, "
                "age, job and email.")
# (name, prompt, json_schema, topics): each repeat asks about another topic (%s), so none repeats another
SUGGEST_WORKLOADS = [
    ("numbered list", "List 20 %s, as a numbered list, one per line, a short phrase each, nothing else.", None,
     ["things to pack for a week of hiking", "ideas for a rainy Sunday", "ways to save water at home"]),
    ("JSON records", SUGGEST_JSON + " They all live in %s.", None, ["Norway", "Chile", "Japan"]),
    ("markdown table", "Make a markdown table of 12 %s with the columns Name, Origin, Year and Note. "
     "Reply with only the table.", None, ["famous bridges", "old board games", "classic cars"]),
    ("prose", "Write a short story (about 200 words) about %s. Do not use any lists.", None,
     ["a lighthouse keeper and a lost kite", "a baker who can hear bread rise", "a map that redraws itself"]),
    ("JSON records, json_schema", SUGGEST_JSON + " They all live in %s.", SUGGEST_SCHEMA, ["Peru", "Kenya", "Iceland"]),
    ("tool call, named", "Add 8 invented people who live in %s to my contacts.", "tool",
     ["Portugal", "Ghana", "Canada"])]
# the tool call: forced by name, its arguments constrained by its schema as serve does it (Hermes format)
SUGGEST_TOOL = {"type": "function", "function": {
    "name": "add_contacts", "description": "Add people to the address book.",
    "parameters": {"type": "object", "required": ["people"], "properties": {
        "people": {"type": "array", "items": SUGGEST_RECORD, "minItems": 8, "maxItems": 8}}}}}


def run_suggest(args, noise: CpuNoise) -> dict:
    """Il Suggeritore on (auto, its rules the only draft sources) vs off, six structured workloads.

    A numbered list, JSON records, a markdown table, prose, records under a json_schema, a tool
    call by name; a new topic each repeat. For the list also the ceiling: the rule told each
    line end in advance. --suggest-only TEXT: only the workloads whose name contains TEXT.
    """
    configs = {"off": reame.SpecOptions("off"), "on": reame.SpecOptions("auto", args.spec_max, ("suggest",))}
    out = {"workloads": {}}
    with reame.Model(args.model_path) as model, reame.Engine(model, n_ctx=args.ctx, n_slots=2, n_threads=args.threads,
                                                              draft=None) as eng:
        for name, prompt, schema, topics in SUGGEST_WORKLOADS:
            if args.suggest_only and args.suggest_only not in name:
                continue
            tool = schema == "tool"
            grammar = (reame.tools_grammar("hermes", [SUGGEST_TOOL], "add_contacts", False) if tool else
                       reame.json_schema_grammar(schema) if schema else None)
            schema = reame.tool_call_schema("hermes", [SUGGEST_TOOL], "add_contacts") if tool else schema
            runs, acc, n_gen, equal = {c: [] for c in configs}, {}, 0, True
            for rep in range(args.repeats):
                ask = prompt % topics[rep % len(topics)]
                turns = reame.tool_messages("hermes", [{"role": "user", "content": ask}], [SUGGEST_TOOL])
                toks = eng.chat_prompt(turns) if tool else chat_tokens(eng, ask)
                eng.submit(toks, reame.SamplingParams(temperature=0, max_tokens=1), archive=None).wait()  # warm KV
                ref = None
                for cname in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
                    r = spec_decode(eng, toks, args.gen_tokens, configs[cname], archive=None, grammar=grammar,
                                    schema=schema)
                    runs[cname].append(r["tok_s"])
                    if cname == "on":
                        n_gen += r["n"]
                        add_accepted(acc, r["accepted"], lambda src: src.startswith("suggest."))
                    ref = r["tokens"] if ref is None else ref
                    equal = equal and r["tokens"] == ref
                    log("suggest: %s / %s: %.2f tok/s (%d tokens)" % (name, cname, r["tok_s"] or 0, r["n"]))
                if name == "numbered list":
                    # The ceiling: the list rule told the greedy text's next line end and number (an oracle).
                    src, ref_text = eng.spec.sources["suggest.list"], eng.model.detokenize(ref)
                    rule = src._fn

                    def told(w) -> str:
                        m = ref_text.startswith(w.text) and re.match(r"\.?\n\d+[.)]|\d+[.)]", ref_text[len(w.text):])
                        return m.group(0) if m else ""

                    src._fn = told
                    try:
                        r = spec_decode(eng, toks, args.gen_tokens, configs["on"], archive=None)
                    finally:
                        src._fn = rule
                    runs.setdefault("told", []).append(r["tok_s"])
                    equal = equal and r["tokens"] == ref
            base, n_acc = median(runs["off"]), sum(a for a, _ in acc.values())
            out["workloads"][name] = {"tok_s": runs, "off": base, "on": median(runs["on"]),
                                      "ratio": ratio(median(runs["on"]), base),
                                      "told_ratio": ratio(median(runs["told"]), base) if "told" in runs else None,
                                      "accepted": acc, "accepted_share": n_acc / n_gen if n_gen else None,
                                      "greedy_equal": equal, "constrained": schema is not None}
    return out


def print_suggest(sg: dict, w) -> None:
    c = sg["config"]
    w("Il Suggeritore: %s, %d threads, up to %d tokens, %d repeats (a new topic each); decode tok/s, on = its "
      "rules the only draft sources (auto), off = none\n" % (c["model"], c["threads"], c["gen_tokens"], c["repeats"]))
    for name, r in sg["workloads"].items():
        w("  %-28s off %s  on %s  (x%s)  drafted share %s  [%s]  greedy %s\n" % (
            name, _fmt(r["off"], 2), _fmt(r["on"], 2), _fmt(r["ratio"], 2),
            "-" if r["accepted_share"] is None else "%.0f%%" % (100 * r["accepted_share"]),
            drafts_text(r["accepted"], lambda s: s[8:]) or "no drafts", "equal" if r["greedy_equal"] else "MISMATCH"))
        if r.get("told_ratio"):
            w("    (the ceiling: the same rule told each line end in advance, an oracle no rule can be: x%.2f)\n"
              % r["told_ratio"])


# -- palimpsest: the archive on vs off after a restart --------------------------------------------
PAL_FUNCTION = ("Write a Python function `load_inventory(path)` of about 40 lines that reads a CSV file of "
                "warehouse items (columns: sku, name, quantity, unit_price, location), skips blank and malformed "
                "rows with a warning, and returns a dict mapping each location to a list of item dicts and the "
                "total stock value of that location. Reply with only the code.")
PAL_EMAIL = ("Write a short order confirmation email to %s for order #%d: %d items, delivery on %s. "
             "Sign it 'The Northwind Team'.")
PAL_STORY = "Write a short story (about 200 words) about %s. Do not use any lists."
# (name, prompts answered before: the archive, measured prompts: one per repeat, new where an archived one would repeat)
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
        "a cartographer who maps a city that keeps changing", "a night-train conductor who collects lost gloves")])]


def run_palimpsest(args, noise: CpuNoise) -> dict:
    """The archive (Palimpsest) on vs the request's opt-out, four workloads, after a restart.

    One engine archives earlier answers; a restarted one answers new prompts (the same question,
    a template, a function with one change, prose), prompt lookup on in both. Then the index's
    build time and memory (--archive-index-tokens).
    """
    root, out = tempfile.mkdtemp(prefix="bench-palimpsest-"), {"workloads": {}}
    kw = dict(n_ctx=args.ctx, n_slots=1, n_threads=args.threads, archive=256 << 20, archive_dir=root, draft=None)
    try:
        with reame.Model(args.model_path) as model:
            with reame.Engine(model, **kw) as eng:
                for name, before, _ in PAL_WORKLOADS:  # the archive: generations of an earlier process
                    for text in before:
                        eng.submit(chat_tokens(eng, text), reame.SamplingParams(temperature=0,
                                                                                max_tokens=args.gen_tokens)).wait()
            with reame.Engine(model, **kw) as eng:  # restarted: reads the archive from disk
                for name, _, texts in PAL_WORKLOADS:
                    runs, acc, first_on, equal = {"off": [], "on": []}, {}, None, True
                    for rep in range(args.repeats):
                        toks = chat_tokens(eng, texts[rep % len(texts)])
                        eng.submit(toks, reame.SamplingParams(temperature=0, max_tokens=2), archive=None).wait()
                        ref = None
                        for cfg in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                            r = spec_decode(eng, toks, args.gen_tokens, archive="shared" if cfg == "on" else None)
                            runs[cfg].append(r["tok_s"])
                            ref = r["tokens"] if ref is None else ref
                            equal = equal and r["tokens"] == ref
                            log("palimpsest %s / archive %s: %.2f tok/s (%d tokens)" % (name, cfg, r["tok_s"] or 0,
                                                                                        r["n"]))
                            if cfg == "on":  # (its answer is archived before the next run starts)
                                add_accepted(acc, r["accepted"], lambda src: src in ("archive", "archive.resync"))
                                first_on = r["tokens"] if first_on is None else first_on
                                eng.part("archive").archive.flush()
                    out["workloads"][name] = {"off": runs["off"], "on": runs["on"], "greedy_equal": equal,
                                              "ratio": ratio(median(runs["on"]), median(runs["off"])),
                                              "accepted": [sum(x) for x in zip((0, 0), *acc.values())],
                                              "tokens": len(first_on)}
                out["archive"] = eng.stats()["archive"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["index"] = []
    for n_tok in (1_000_000, args.archive_index_tokens):  # runs of 200-600 tokens, Zipf-ish word choice
        rng = random.Random(3)
        words, idx = [rng.randrange(150000) for _ in range(5000)], reame.ArchiveIndex()
        while len(idx.tokens) < n_tok:
            idx.append([words[min(int(rng.paretovariate(1.1)) - 1, 4999)] for _ in range(rng.randrange(200, 600))])
        t0 = time.perf_counter()
        built = reame.ArchiveIndex.build(idx.tokens, idx.lengths)
        dt = time.perf_counter() - t0
        idx.install(built, len(idx.tokens))
        out["index"].append({"tokens": len(idx.tokens), "build_s": dt, "bytes": idx.nbytes(),
                             "numpy": reame._np is not None, "bytes_per_mtok": idx.nbytes() / len(idx.tokens) * 1e6})
    return out


def print_palimpsest(pl: dict, w) -> None:
    c = pl["config"]
    w("Palimpsest: %s, %d threads, %d tokens, median of %d alternating repeats, after a restart; archive on vs the "
      "request's opt-out (prompt lookup on in both)\n" % (c["model"], c["threads"], c["gen_tokens"], c["repeats"]))
    for name, r in pl["workloads"].items():
        w("  %-22s off %s  on %s  x%s  archive drafts accepted %d/%d  greedy %s\n" % (
            name, _fmt(median(r["off"]), 2), _fmt(median(r["on"]), 2), _fmt(r["ratio"], 2),
            r["accepted"][0], r["accepted"][1], "equal" if r["greedy_equal"] else "MISMATCH (a bug)"))
    for ix in pl["index"]:
        w("  index of %d tokens: built in %.2f s (%s), %.1f MB (%.1f MB per million tokens)\n" % (
            ix["tokens"], ix["build_s"], "numpy" if ix["numpy"] else "standard library", ix["bytes"] / 1e6,
            ix["bytes_per_mtok"] / 1e6))


# -- conclave: best of 5, sequential samples voted vs the Conclave ------------------------------
QUIZ = [("What is 17 multiplied by 23?", "391"),
        ("A train travels at 60 km per hour for 2.5 hours. How many km does it travel?", "150"),
        ("Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples does he have left?", "27"),
        ("What is 144 divided by 12, plus 7?", "19"),
        ("A shirt costs 40 dollars and is discounted by 25 percent. What is the new price in dollars?", "30"),
        ("5 workers build a wall in 12 days. How many days do 10 workers need at the same rate?", "6"),
        ("What is the sum of the whole numbers from 1 to 10?", "55"),
        ("Anna is 3 times as old as her son, who is 12. How old will Anna be in 5 years?", "41")]
QUIZ_SUFFIX = " Reply briefly and end with the final answer as a number on the last line."


def run_conclave(args, noise: CpuNoise) -> dict:
    """An 8-question quiz: one greedy answer vs 5 sequential samples voted vs the Conclave of 5.

    Correct answers (last_number) and wall time; samples at temperature 0.7, seeded per question.
    """
    n, rows, times = args.best_of, {"greedy": [], "sequential": [], "conclave": []}, {}

    def answer(p, temperature, seed=None):
        return eng.submit(p, reame.SamplingParams(temperature=temperature, seed=seed, max_tokens=args.gen_tokens),
                          archive=None).wait().text

    with reame.Model(args.model_path) as model, reame.Engine(model, n_ctx=args.ctx, n_slots=n, n_threads=args.threads,
                                                              draft=None) as eng:
        prompts = [chat_tokens(eng, q + QUIZ_SUFFIX) for q, _ in QUIZ]
        for p in prompts:  # warm the prompts' KV: every configuration starts from the same cache
            eng.submit(p, reame.SamplingParams(temperature=0, max_tokens=1), archive=None).wait()
        for qi, ((q, right), p) in enumerate(zip(QUIZ, prompts)):
            t0 = time.perf_counter()
            greedy = answer(p, 0)
            t1 = time.perf_counter()
            samples = [answer(p, 0.7, 100 * qi + i) for i in range(n)]
            t2 = time.perf_counter()
            res = reame.run_conclave(eng, p, reame.SamplingParams(temperature=0.7, seed=100 * qi,
                                                                  max_tokens=args.gen_tokens), n, archive=None)
            t3 = time.perf_counter()
            for key, got, dt in (("greedy", reame.extract_answer(greedy, "last_number"), t1 - t0),
                                 ("sequential", reame.conclave_vote([reame.extract_answer(t, "last_number")
                                                                     for t in samples], n)[0], t2 - t1),
                                 ("conclave", res.answer, t3 - t2)):
                rows[key].append(got)
                times[key] = times.get(key, 0.0) + dt
            log("conclave: Q%d (%s): greedy %s, sequential %s, conclave %s (votes %s, %d cancelled)" % (
                qi + 1, right, rows["greedy"][-1], rows["sequential"][-1], res.answer, res.votes, res.n_cancelled))
    return {"config": {"best_of": n, "questions": len(QUIZ)}, "results": {k: {
        "answers": v, "correct": sum(a == right for a, (_, right) in zip(v, QUIZ)), "wall_s": times[k]}
        for k, v in rows.items()}}


def print_conclave(cb: dict, w) -> None:
    c = cb["config"]
    w("The Conclave: %s, %d threads, %d questions, best of %d, up to %d tokens per answer\n" % (
        c["model"], c["threads"], c["questions"], c["best_of"], c["gen_tokens"]))
    seq = cb["results"]["sequential"]["wall_s"]
    for k, label in (("greedy", "one greedy answer"), ("sequential", "%d samples, one after another, voted"
                                                        % c["best_of"]),
                     ("conclave", "the Conclave (%d in one batch, early stop)" % c["best_of"])):
        r = cb["results"][k]
        w("  %-44s %d/%d correct  %6.1f s  (%.2fx the sequential time)\n" % (
            label, r["correct"], c["questions"], r["wall_s"], r["wall_s"] / seq if seq else 0))


# == 5. The scenario table and main ============================================================


# -- tools under auto: how often an answer is a proper call, on 20 fixed prompts --------

_AUTO_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current local time in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount of money",
                                      "parameters": {"type": "object", "properties": {
                                          "amount": {"type": "number"}, "from_currency": {"type": "string"},
                                          "to_currency": {"type": "string"}},
                                          "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web for recent information",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}}]
_AUTO_NEED = ["What's the weather in Paris?", "Is it raining in London right now?", "What time is it in Tokyo?",
              "Convert 100 US dollars to euros.", "How many yen is 50 pounds?",
              "Search the web for the latest Python release.", "What's the temperature in Berlin in fahrenheit?",
              "Tell me the current time in New York.", "Find recent news about the Mars rover.",
              "Weather forecast for Madrid please."]
_AUTO_NONE = ["Hello! How are you?", "What is 17 times 3?", "Write a haiku about the sea.", "What does JSON stand for?",
              "Explain what a function is in Python in one sentence.", "Say thank you in French.",
              "What is the capital of Italy?", "Reverse the string 'abc'.", "Give me a synonym for happy.",
              "Is 7 a prime number?"]


def run_tools_auto(args, noise: CpuNoise) -> dict:
    """Tools under tool_choice auto: of 10 prompts that need one of 4 tools, how many answers are proper calls (a declared tool, arguments a JSON object); of 10 that need none, how many stay text (greedy, over HTTP)."""
    import http.client
    eng = reame.Engine(args.model_path, n_ctx=args.ctx, n_slots=1, n_threads=args.threads)
    srv = reame.Server(eng, "m", host="127.0.0.1", port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    names = {t["function"]["name"] for t in _AUTO_TOOLS}
    rows = []
    try:
        for q in _AUTO_NEED + _AUTO_NONE:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
            conn.request("POST", "/v1/chat/completions", json.dumps({
                "messages": [{"role": "user", "content": q}], "tools": _AUTO_TOOLS, "tool_choice": "auto",
                "temperature": 0, "max_tokens": 96}), {"Content-Type": "application/json"})
            msg = json.loads(conn.getresponse().read())["choices"][0]["message"]
            conn.close()
            calls = msg.get("tool_calls") or []
            proper = bool(calls) and all(c["function"]["name"] in names and
                                         isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
            rows.append({"prompt": q, "needs_tool": q in _AUTO_NEED, "call": calls[0]["function"] if calls else None,
                         "proper": proper, "text": msg.get("content")})
            log("%-5s %s" % ("call" if calls else "text", q))
    finally:
        srv.shutdown()
        eng.close()
    return {"rows": rows, "calls": sum(r["proper"] for r in rows if r["needs_tool"]),
            "texts": sum(r["call"] is None for r in rows if not r["needs_tool"])}


def print_tools_auto(res: dict, w) -> None:
    w("tools under auto, %s, greedy: 20 fixed prompts\n" % res["config"]["model"])
    for r in res["rows"]:
        what = json.dumps(r["call"]) if r["call"] else repr((r["text"] or "")[:70])
        w("  %-4s %-5s %-52s %s\n" % ("tool" if r["needs_tool"] else "", "call" if r["call"] else "text",
                                      r["prompt"][:52], what[:90]))
    w("%d/10 prompts that need a tool answered with a proper call; %d/10 others answered with text\n"
      % (res["calls"], res["texts"]))


# -- past one box: HAProxy in front of 3 replicas, prompt affinity vs round robin; a projection --

CLUSTER_REPLICAS, CLUSTER_APPS, CLUSTER_CLIENTS, CLUSTER_GEN = 3, 6, 4, 16


def cluster_system(app: int) -> str:
    """App app's help-desk system prompt, about 330 tokens (a disk snapshot is taken at 256)."""
    rules = " ".join("Rule %d of app %d: answer politely, name the order number, and never promise a date "
                     "for item %d." % (i, app, i * 7 + app) for i in range(1, 14))
    return "You are the help desk of shop number %d. %s" % (app, rules)


def cluster_trace(rng: random.Random, n: int) -> list:
    """n (app, question): apps drawn with Zipf weights (app k: 1/(k+1)), each question new."""
    weights = [1.0 / (k + 1) for k in range(CLUSTER_APPS)]
    return [(rng.choices(range(CLUSTER_APPS), weights)[0], "Customer %d asks about order %d: where is it?"
             % (i, 1000 + rng.randrange(9000))) for i in range(n)]


def cluster_body(app: int, question: str) -> bytes:
    return json.dumps({"messages": [{"role": "system", "content": cluster_system(app)},
                                    {"role": "user", "content": question}],
                       "max_tokens": CLUSTER_GEN, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "reame": {"replay": False}}).encode()


def round_robin(config: str) -> str:
    """The affinity configuration with its balancing replaced by round robin."""
    lines = [ln for ln in config.splitlines() if not ln.strip().startswith(("hash-type", "hash-balance-factor"))]
    return "\n".join("  balance roundrobin" if ln.strip().startswith("balance ") else ln for ln in lines) + "\n"


def cluster_costs(args, noise: CpuNoise, tmp: str) -> dict:
    """This machine's costs for the projection, from one replica alone and then a second on its
    REAME_HOME: seconds per prompt token computed, per token restored from disk, per token decoded."""
    home = os.path.join(tmp, "costs")
    srv = ReameServer(args.model_path, os.path.join(tmp, "costs-a.log"), noise, threads=args.threads,
                      n_parallel=2, ctx_per_slot=1024, home=home, tag="costs")
    try:
        srv.ready()
        cold = stream(srv.port, "/v1/chat/completions", cluster_body(0, "Where is order 1?"))
        body = json.loads(cluster_body(1, "Please tell me a long story about order 2."))
        body["max_tokens"] = 64
        dec = stream(srv.port, "/v1/chat/completions", json.dumps(body).encode())
        time.sleep(2.0)  # (the snapshot writes)
    finally:
        srv.close()
    srv = ReameServer(args.model_path, os.path.join(tmp, "costs-b.log"), noise, threads=args.threads,
                      n_parallel=2, ctx_per_slot=1024, home=home, tag="costs, disk")
    try:
        srv.ready()
        disk = stream(srv.port, "/v1/chat/completions", cluster_body(0, "Where is order 3?"))
    finally:
        srv.close()
    c_prefill = cold["ttft_s"] / cold["prompt_tokens"]
    cached = disk["cached_tokens"] or 0
    c_restore = max(0.0, disk["ttft_s"] - (disk["prompt_tokens"] - cached) * c_prefill) / max(cached, 1)
    c_decode = (dec["total_s"] - dec["ttft_s"]) / max(dec["completion_tokens"] - 1, 1)
    return {"prefill_s_per_token": c_prefill, "restore_s_per_token": c_restore, "decode_s_per_token": c_decode,
            "prompt_tokens": cold["prompt_tokens"], "disk_cached_tokens": cached}


CLUSTER_POLICIES = [("affinity", True), ("round robin", True), ("affinity", False), ("round robin", False)]


def cluster_name(policy: str, shared: bool) -> str:
    return "%s, %s" % (policy, "one disk" if shared else "own disks")


def cluster_pass(args, noise: CpuNoise, tmp: str, policy: str, shared: bool, trace: list) -> dict:
    """The trace through HAProxy (policy: affinity or round robin) to 3 fresh replicas on one new
    REAME_HOME (shared) or one each, by CLUSTER_CLIENTS clients taking the next request in order."""
    home = os.path.join(tmp, cluster_name(policy, shared).replace(" ", "-").replace(",", ""))
    threads = max(1, args.threads // CLUSTER_REPLICAS)
    reps = []
    proxy = None
    try:
        for i in range(CLUSTER_REPLICAS):
            reps.append(ReameServer(args.model_path, os.path.join(tmp, "%s-r%d.log" % (policy[:5], i + 1)), noise,
                                    threads=threads, n_parallel=2, ctx_per_slot=1024,
                                    home=home if shared else os.path.join(home, "r%d" % (i + 1)),
                                    tag="%s r%d" % (policy, i + 1)))
        for r in reps:
            r.ready()
        front = free_port()
        config = reame.haproxy_config(["127.0.0.1:%d" % r.port for r in reps], "127.0.0.1:%d" % front, check_s=0.5)
        path = os.path.join(tmp, "haproxy-%s.cfg" % policy[:5])
        with open(path, "w") as f:
            f.write(config if policy == "affinity" else round_robin(config))
        proxy = subprocess.Popen(["haproxy", "-db", "-f", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", front), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proxy.poll() is not None:
                    raise RuntimeError("HAProxy did not start (%s)" % path)
                time.sleep(0.1)
        time.sleep(1.5)  # (its first health checks)
        t0 = time.perf_counter()
        results = in_order(reps[0], CLUSTER_CLIENTS, len(trace),
                           lambda i: stream(front, "/v1/chat/completions", cluster_body(*trace[i])))
        wall = time.perf_counter() - t0
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait()
        for r in reps:
            r.close()
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] or 0 for r in results)
    ttft = [r["ttft_s"] for r in results]
    return {"requests": len(results), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt, "prefill_tokens": prompt - cached, "wall_s": wall,
            "ttft_p50_s": nearest_rank(ttft, 0.5), "ttft_p95_s": nearest_rank(ttft, 0.95)}


def simulate_cluster(costs: dict, n_boxes: int, policy: str, shared: bool, rng: random.Random, load: float,
                     n_requests: int = 4000, apps_per_box: int = 2, slots: int = 2, balance: float = 1.5) -> dict:
    """A projection, not a measurement: n_boxes boxes, each answering one request at a time (FIFO),
    keeping the KV of its last `slots` apps in memory; a disk holds every prefix computed (shared:
    one for all boxes; else each box its own). Requests of apps_per_box x n_boxes apps (Zipf) arrive as a Poisson stream at `load`
    times what the boxes answer with every prompt cached. Costs are this machine's (cluster_costs).
    Routing: round robin, or consistent hashing (64 points per box) with load bounded at
    `balance` x the average outstanding requests. Returns throughput and TTFT percentiles."""
    import bisect
    cp, cr, cd = costs["prefill_s_per_token"], costs["restore_s_per_token"], costs["decode_s_per_token"]
    sys_tok, user_tok = costs["prompt_tokens"] - 20, 20
    n_apps = apps_per_box * n_boxes
    weights = [1.0 / (k + 1) for k in range(n_apps)]
    service_hit = user_tok * cp + CLUSTER_GEN * cd
    rate = load * n_boxes / service_hit
    ring = sorted((int(hashlib.md5(b"%d:%d" % (b, v)).hexdigest()[:8], 16), b)
                  for b in range(n_boxes) for v in range(64))
    points = [p for p, _ in ring]
    free_at = [0.0] * n_boxes
    queue_ends: list = [[] for _ in range(n_boxes)]  # per box: end times of requests not yet finished
    memory = [[] for _ in range(n_boxes)]              # per box: its last `slots` apps, most recent last
    one_disk = set()
    disks = [one_disk if shared else set() for _ in range(n_boxes)]
    ttfts, t, rr, last_end = [], 0.0, 0, 0.0
    apps = rng.choices(range(n_apps), weights, k=n_requests)
    for app in apps:
        t += rng.expovariate(rate)
        for ends in queue_ends:
            while ends and ends[0] <= t:
                ends.pop(0)
        if policy == "round robin":
            box, rr = rr % n_boxes, rr + 1
        else:
            bound = math.ceil(balance * (sum(len(e) for e in queue_ends) + 1) / n_boxes)
            i = bisect.bisect(points, int(hashlib.md5(b"app%d" % app).hexdigest()[:8], 16)) % len(ring)
            for k in range(len(ring)):
                box = ring[(i + k) % len(ring)][1]
                if len(queue_ends[box]) < bound:
                    break
        if app in memory[box]:
            prefill = user_tok * cp
            memory[box].remove(app)
        elif app in disks[box]:
            prefill = user_tok * cp + sys_tok * cr
        else:
            prefill = (sys_tok + user_tok) * cp
        memory[box] = (memory[box] + [app])[-slots:]
        disks[box].add(app)
        start = max(t, free_at[box])
        free_at[box] = start + prefill + CLUSTER_GEN * cd
        queue_ends[box].append(free_at[box])
        ttfts.append(start + prefill - t)
        last_end = max(last_end, free_at[box])
    return {"throughput_rps": n_requests / last_end, "ttft_p50_s": nearest_rank(ttfts, 0.5),
            "ttft_p95_s": nearest_rank(ttfts, 0.95)}


def run_cluster(args, noise: CpuNoise) -> dict:
    """Past one box: one trace (6 apps' system prompts, Zipf, new questions, 4 clients) through Debian's HAProxy to 3 `serve` replicas on one REAME_HOME, with `reame.py haproxy-config`'s prompt affinity against round robin: prompt tokens served from cache, prefill tokens computed, TTFT p50/p95 (3 replicas share this box's cores: the cache numbers are the point). Then a projection to 4, 16 and 64 boxes with this machine's measured costs."""
    if shutil.which("haproxy") is None:
        raise RuntimeError("--cluster needs HAProxy (Debian: apt-get install haproxy)")
    rng = random.Random(args.seed)
    trace = cluster_trace(rng, 24 if args.quick else 60)
    out = {"trace": {"requests": len(trace), "apps": CLUSTER_APPS, "clients": CLUSTER_CLIENTS,
                     "gen_tokens": CLUSTER_GEN, "replicas": CLUSTER_REPLICAS}}
    with tempfile.TemporaryDirectory(prefix="reame-cluster-") as tmp:
        out["costs"] = cluster_costs(args, noise, tmp)
        log("costs: %s" % out["costs"])
        for policy, shared in CLUSTER_POLICIES:
            name = cluster_name(policy, shared)
            out[name] = cluster_pass(args, noise, tmp, policy, shared, trace)
            log("%s: %s" % (name, out[name]))
    projection = {}
    for n in (4, 16, 64):
        for policy, shared in CLUSTER_POLICIES:
            sat = simulate_cluster(out["costs"], n, policy, shared, random.Random(n), load=3.0)
            calm = simulate_cluster(out["costs"], n, policy, shared, random.Random(n), load=0.5)
            projection["%d %s" % (n, cluster_name(policy, shared))] = {
                "throughput_rps": sat["throughput_rps"], "ttft_p50_s": calm["ttft_p50_s"],
                "ttft_p95_s": calm["ttft_p95_s"]}
    out["projection"] = projection
    return out


def print_cluster(cl: dict, w) -> None:
    t, c = cl["trace"], cl["costs"]
    w("past one box, %s: %d requests of %d apps (Zipf) by %d clients through HAProxy to %d replicas "
      "(one REAME_HOME, %d tokens each)\n" % (cl["config"]["model"], t["requests"], t["apps"], t["clients"],
                                              t["replicas"], t["gen_tokens"]))
    w("%-25s %10s %16s %13s %13s %9s\n" % ("routing, cache", "hit rate", "prefill tokens", "TTFT p50 s",
                                            "TTFT p95 s", "wall s"))
    for policy, shared in CLUSTER_POLICIES:
        r = cl[cluster_name(policy, shared)]
        w("%-25s %9.1f%% %16d %13.3f %13.3f %9.1f\n" % (cluster_name(policy, shared), 100 * r["hit_rate"],
                                                        r["prefill_tokens"], r["ttft_p50_s"], r["ttft_p95_s"],
                                                        r["wall_s"]))
    w("\nprojection (a simulation with this machine's costs: %.2f ms per prompt token computed, %.3f ms per "
      "token restored from disk, %.1f ms per token decoded; each box one request at a time, 2 apps per box, "
      "Zipf; TTFT at half load):\n" % (1000 * c["prefill_s_per_token"], 1000 * c["restore_s_per_token"],
                                      1000 * c["decode_s_per_token"]))
    w("%-6s %-25s %12s %13s %13s\n" % ("boxes", "routing, cache", "requests/s", "TTFT p50 s", "TTFT p95 s"))
    for key, r in cl["projection"].items():
        n, name = key.split(" ", 1)
        w("%-6s %-25s %12.2f %13.3f %13.3f\n" % (n, name, r["throughput_rps"], r["ttft_p50_s"], r["ttft_p95_s"]))


# -- MoE models Reame makes itself: random weights, the real architectures --------------------
# A MoE GGUF with random weights computes exactly what a trained one of the same shape does:
# a faithful test of correctness and speed (not of answers). Written with llama.cpp's own gguf
# package from the pinned source, quantized by the same tree's libllama (llama_model_quantize,
# what llama-quantize calls); the tokenizer and chat template are copied from a real GGUF.

MOE_GENERATOR = 2  # bump when make_moe_gguf writes other bytes: cached files are keyed by it
MOE_SHAPES = {  # name: (arch, layers, n_embd, heads, kv heads, expert ff, experts, used, shared ff)
    "tiny-qwen2moe": ("qwen2moe", 2, 256, 4, 2, 224, 8, 2, 256),  # experts 224 wide: Q5_0/Q8_0 down experts
    "tiny-olmoe": ("olmoe", 2, 256, 4, 4, 256, 8, 2, 0),
    "olmoe-1b-7b-shaped": ("olmoe", 16, 2048, 16, 16, 1024, 64, 8, 0),
    "qwen2moe-704-shaped": ("qwen2moe", 8, 1024, 8, 4, 704, 32, 4, 2816)}  # Q5_0/Q8_0 down experts, 650 MB


class _QuantizeParams(ctypes.Structure):
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("output_tensor_type", ctypes.c_int),
                ("token_embedding_type", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
                ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
                ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t)]


def _gguf_package():
    """llama.cpp's gguf package, from the source the libraries were built from."""
    with open(os.path.join(os.path.dirname(reame.lib().path), "manifest.json")) as f:
        src = json.load(f)["source_dir"]
    sys.path.insert(0, os.path.join(src, "gguf-py"))
    import gguf
    return gguf


def make_moe_gguf(name: str, out_path: str, tokenizer_from: str, seed: int = 0, ftype: int = 15,
                  pure: bool = False) -> str:
    """Write MOE_SHAPES[name] with random weights (seeded) and the tokenizer and chat template
    of the GGUF tokenizer_from, as F16, then quantize it (ftype 15: Q4_K_M) to out_path."""
    import numpy as np
    gguf = _gguf_package()
    arch, n_layer, n_embd, n_head, n_head_kv, n_ff, n_expert, n_used, n_ff_sh = MOE_SHAPES[name]
    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(tokenizer_from)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tmp = out_path + ".f16.tmp"
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name("reame %s (random weights)" % name)
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff if arch == "olmoe" else n_ff * n_used)  # (olmoe: each expert's)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(n_ff)
    if n_ff_sh:
        w.add_expert_shared_feed_forward_length(n_ff_sh)
    w.add_file_type(1)  # F16
    for key, field in reader.fields.items():  # the tokenizer and chat template, as they are
        if key.startswith("tokenizer."):
            value = field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                w.add_array(key, value)
            elif kind == gguf.GGUFValueType.STRING:
                w.add_string(key, value)
            elif kind == gguf.GGUFValueType.BOOL:
                w.add_bool(key, value)
            else:
                w.add_uint32(key, int(value))
    head = n_embd // n_head

    def mat(*shape, fan_in, dtype=np.float16):  # numpy order: ggml's dims reversed
        return lambda: (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(dtype)

    def ones(n):
        return lambda: np.ones(n, dtype=np.float32)

    def small(n):
        return lambda: rng.standard_normal(n, dtype=np.float32) * 0.02
    # (name, numpy shape, dtype, maker): described first, then made and written one at a time,
    # so an OLMoE-sized model never sits in memory whole
    tensors = [("token_embd.weight", (n_vocab, n_embd), np.float16, mat(n_vocab, n_embd, fan_in=1)),
               ("output_norm.weight", (n_embd,), np.float32, ones(n_embd)),
               ("output.weight", (n_vocab, n_embd), np.float16, mat(n_vocab, n_embd, fan_in=n_embd))]
    kv = head * n_head_kv
    for i in range(n_layer):
        b = "blk.%d." % i
        layer = [("attn_norm.weight", (n_embd,), np.float32, ones(n_embd)),
                 ("attn_q.weight", (n_embd, n_embd), np.float16, mat(n_embd, n_embd, fan_in=n_embd)),
                 ("attn_k.weight", (kv, n_embd), np.float16, mat(kv, n_embd, fan_in=n_embd)),
                 ("attn_v.weight", (kv, n_embd), np.float16, mat(kv, n_embd, fan_in=n_embd)),
                 ("attn_output.weight", (n_embd, n_embd), np.float16, mat(n_embd, n_embd, fan_in=n_embd))]
        if arch == "qwen2moe":
            layer += [("attn_q.bias", (n_embd,), np.float32, small(n_embd)),
                      ("attn_k.bias", (kv,), np.float32, small(kv)), ("attn_v.bias", (kv,), np.float32, small(kv))]
        else:
            layer += [("attn_q_norm.weight", (n_embd,), np.float32, ones(n_embd)),
                      ("attn_k_norm.weight", (kv,), np.float32, ones(kv))]
        layer += [("ffn_norm.weight", (n_embd,), np.float32, ones(n_embd)),
                  ("ffn_gate_inp.weight", (n_expert, n_embd), np.float32,
                   mat(n_expert, n_embd, fan_in=n_embd, dtype=np.float32)),
                  ("ffn_gate_exps.weight", (n_expert, n_ff, n_embd), np.float16,
                   mat(n_expert, n_ff, n_embd, fan_in=n_embd)),
                  ("ffn_up_exps.weight", (n_expert, n_ff, n_embd), np.float16,
                   mat(n_expert, n_ff, n_embd, fan_in=n_embd)),
                  ("ffn_down_exps.weight", (n_expert, n_embd, n_ff), np.float16,
                   mat(n_expert, n_embd, n_ff, fan_in=n_ff))]
        if n_ff_sh:
            layer += [("ffn_gate_inp_shexp.weight", (n_embd,), np.float32, mat(n_embd, fan_in=n_embd, dtype=np.float32)),
                      ("ffn_gate_shexp.weight", (n_ff_sh, n_embd), np.float16, mat(n_ff_sh, n_embd, fan_in=n_embd)),
                      ("ffn_up_shexp.weight", (n_ff_sh, n_embd), np.float16, mat(n_ff_sh, n_embd, fan_in=n_embd)),
                      ("ffn_down_shexp.weight", (n_embd, n_ff_sh), np.float16, mat(n_embd, n_ff_sh, fan_in=n_ff_sh))]
        tensors += [(b + name, shape, dtype, make) for name, shape, dtype, make in layer]
    for name, shape, dtype, _make in tensors:
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, _shape, _dtype, make in tensors:
        w.write_tensor_data(make())
    w.close()
    try:
        q = reame.lib()._cdlls[-1]
        q.llama_model_quantize_default_params.restype = _QuantizeParams
        q.llama_model_quantize.restype = ctypes.c_uint32
        q.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_QuantizeParams)]
        params = q.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.pure = ftype, reame.pick_threads(), pure
        part = out_path + ".q.tmp"
        if q.llama_model_quantize(tmp.encode(), part.encode(), ctypes.byref(params)) != 0:
            raise RuntimeError("llama_model_quantize failed for %s" % name)
        os.replace(part, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


def moe_model(name: str, tokenizer_from: str, cache_dir: Optional[str] = None) -> str:
    """MOE_SHAPES[name] as a Q4_K_M GGUF, made once and cached under $REAME_HOME/moe (keyed by
    the shape, the seed, the tokenizer's file and the libraries' build)."""
    key = hashlib.sha256(json.dumps([MOE_GENERATOR, MOE_SHAPES[name], os.path.basename(tokenizer_from),
                                     os.path.getsize(tokenizer_from), reame.lib().build_id()]).encode()).hexdigest()
    folder = cache_dir or os.path.join(reame.Config.from_env().home, "moe")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "%s-%s.gguf" % (name, key[:12]))
    if not os.path.exists(path):
        log("making %s (random weights) at %s" % (name, path))
        make_moe_gguf(name, path, tokenizer_from)
        for old in os.listdir(folder):  # (the same shape made for another build or generator)
            if old.startswith(name + "-") and old.endswith(".gguf") and old != os.path.basename(path):
                os.remove(os.path.join(folder, old))
    return path


class Scenario(NamedTuple):
    """A benchmark: flag selects it (none: the first row); run(args, noise) -> result (JSON: under name),
    print(result, w); doc: run's docstring's first line. defaults: argument defaults, a value or
    (with --quick, without). side_by_side: Reame vs llama-server, under one header, with the noise line."""

    name: str
    flag: Optional[str]
    run: Callable
    print: Callable
    defaults: dict = {}
    side_by_side: bool = False

    @property
    def doc(self) -> str:
        return self.run.__doc__.strip().splitlines()[0]


SMALL = ("gemma3-270m", "qwen2.5-coder-0.5b")
SCENARIOS = [
    Scenario("engine", None, run_engine, print_engine, side_by_side=True),
    Scenario("http", "--http", run_http, print_http, side_by_side=True),
    Scenario("load", "--load", run_load, print_load, {"model": SMALL, "http_clients": "1,2,4,8,16"}),
    Scenario("prefix_cache", "--prefix-cache", run_prefix_cache, print_prefix, {"repeats": 1}, side_by_side=True),
    Scenario("workload", "--workload", run_workload, print_workload, {"model": SMALL}),
    Scenario("warm_ahead", "--warm-ahead", run_warm_ahead, print_warm_ahead, {"model": SMALL, "repeats": 4}),
    Scenario("spec", "--spec", run_spec, print_spec, {"repeats": 2, "gen_tokens": (48, 96)}),
    Scenario("palimpsest", "--palimpsest", run_palimpsest, print_palimpsest, {"repeats": 2, "gen_tokens": (64, 160)}),
    Scenario("conclave", "--conclave", run_conclave, print_conclave, {"gen_tokens": (64, 160)}),
    Scenario("step_cost", "--step-cost", run_step_cost, print_step_cost, {"repeats": 7}),
    Scenario("suggest", "--suggest", run_suggest, print_suggest, {"repeats": 2, "gen_tokens": (96, 400)}),
    Scenario("tools_auto", "--tools-auto", run_tools_auto, print_tools_auto, {"model": SMALL}),
    Scenario("cluster", "--cluster", run_cluster, print_cluster, {"model": SMALL})]
DEFAULTS = {"model": ("gemma3-270m", "qwen2.5-coder-1.5b"), "repeats": (2, 3), "gen_tokens": (32, 128),
            "prefill_tokens": (256, 768), "handbook_tokens": (1200, 2400), "streams": ("1,4", "1,2,4,8"),
            "http_clients": ("1,4", "1,4,8")}
OPTIONS = [  # flag, default (False: a switch; a tuple: the choices, the first the default; a type: see DEFAULTS), help
    ("--model", str, "alias or path (default qwen2.5-coder-1.5b; --workload, --warm-ahead qwen2.5-coder-0.5b)"),
    ("--threads", int, "threads for both (default reame.pick_threads())"),
    ("--repeats", int, "alternating repeats (default 3, or the scenario's own)"),
    ("--gen-tokens", int, "tokens per generation (default 128, or the scenario's own)"),
    ("--ctx", 2048, "context per slot, both sides"), ("--batch", 512, "n_batch = n_ubatch, both sides"),
    ("--quick", False, "a smoke test: gemma3-270m, few tokens, small defaults (a minute or two)"),
    ("--no-server", False, "Reame only"), ("--server", DEFAULT_SERVER, "the llama-server binary"),
    ("--server-sampling", ("greedy", "default"), "greedy: its sampler chain cut to top_k=1, Reame's work; "
     "default: its full temperature-0 chain"),
    ("--server-kv", ("match", "unified", "split"), "llama-server's KV layout: match what Reame's context reports"),
    ("--server-repack", ("match", "on", "off"), "llama-server's weight repacking: match Reame's"),
    ("--reame-spec", ("auto", "off", "on"), "engine: Reame's speculation (auto as it ships; off: its kernels alone)"),
    ("--server-log", "", "llama-server's log file (engine; default a temp file)"),
    ("--seed", 1234, "seed for the random prefill prompts"), ("--json", False, "print the JSON, not the tables"),
    ("--save-json", "", "also write the JSON to this file"),
    ("--prefill-tokens", int, "engine: prefill prompt length (default 768; --quick 256)"),
    ("--streams", str, "engine: concurrent streams (default 1,2,4,8; --quick 1,4)"),
    ("--variants", False, "engine: then Reame against itself, KV layout x repacking, at the largest --streams"),
    ("--with-http", False, "engine: then the HTTP scenario"),
    ("--http-clients", str, "--http, --load: concurrent clients (default 1,4,8; --load 1,2,4,8,16; --quick 1,4)"),
    ("--load-long", 4000, "--load: the long prompt's tokens in its last row (0: no such row)"),
    ("--load-mixes", "chat,rag,long", "--load: the rows to run"),
    ("--handbook-tokens", int, "--prefix-cache, --workload, --warm-ahead: the handbook's shared prompt tokens "
     "(default 2400; --quick 1200)"),
    ("--prefix-gen-tokens", 8, "--prefix-cache: max_tokens per question"),
    ("--server-cache-ram", "0", "--prefix-cache: llama-server's --cache-ram in MiB (-1 or 8192: its RAM cache on)"),
    ("--workload-clients", "1,4", "--workload: client counts"),
    ("--plot", "", "--workload: per-request bars to this PNG (needs matplotlib)"),
    ("--spec-draft", "qwen2.5-coder-0.5b", "--spec: the draft model"),
    ("--spec-max", 16, "--spec, --suggest: most drafts per step for lookup, auto and the rules"),
    ("--spec-draft-k", 4, "--spec: drafts per step with the draft model forced on"),
    ("--archive-index-tokens", 25_000_000, "--palimpsest: tokens of the synthetic archive whose index is timed"),
    ("--best-of", 5, "--conclave: candidates"),
    ("--against", "", "--step-cost: also this libllama (an older build's, say), alternating: the ratio"),
    ("--suggest-only", "", "--suggest: only the workloads whose name contains this text"),
    ("--make-moe", "", "make (or find cached) the MoE GGUF of this shape with random weights, print its path and "
     "exit: tiny-qwen2moe, tiny-olmoe, olmoe-1b-7b-shaped (about 4 GB, minutes), qwen2moe-704-shaped (650 MB); "
     "then --model PATH")]


def parse_args(argv=None) -> tuple:
    """(the arguments, the scenario they select)."""
    p = argparse.ArgumentParser(description="Reame measured side by side: one scenario per run. Each scenario's "
                                            "run_* docstring in bench.py says what it measures and how.")
    g = p.add_argument_group("scenarios (one per run; none: the engine scenario)", SCENARIOS[0].doc)
    g = g.add_mutually_exclusive_group()
    for sc in SCENARIOS[1:]:
        g.add_argument(sc.flag, dest="scenario", action="store_const", const=sc.name, help=sc.doc)
    for flag, default, text in OPTIONS:
        if default is False:
            p.add_argument(flag, action="store_true", help=text)
        elif isinstance(default, tuple):
            p.add_argument(flag, choices=default, default=default[0], help=text + " (default %s)" % default[0])
        elif isinstance(default, type):
            p.add_argument(flag, type=default, help=text)
        else:
            p.add_argument(flag, type=type(default), default=default, help=text + (" (default %s)" % default) * (
                default != ""))
    args = p.parse_args(argv)
    sc = next(s for s in SCENARIOS if s.name == (args.scenario or "engine"))
    for key, value in dict(DEFAULTS, **sc.defaults).items():
        if getattr(args, key) is None:
            value = DEFAULTS[key] if key == "model" and args.quick else value
            setattr(args, key, value[0 if args.quick else 1] if isinstance(value, tuple) else value)
    args.threads = args.threads or reame.pick_threads()
    for key in ("streams", "http_clients", "workload_clients"):
        setattr(args, key, [int(x) for x in getattr(args, key).split(",") if x.strip()] or [0])
    if min(args.repeats, args.handbook_tokens, args.prefix_gen_tokens, *args.streams, *args.http_clients,
           *args.workload_clients) < 1:
        p.error("--repeats, --handbook-tokens, --prefix-gen-tokens and the counts need positive integers")
    if args.against and (sc.name != "step_cost" or not os.path.exists(args.against)):
        p.error("--against needs --step-cost and an existing libllama file")
    if (args.variants or args.with_http) and sc is not SCENARIOS[0]:
        p.error("--variants and --with-http add to the default scenario: not with %s" % sc.flag)
    if args.prefill_tokens + 8 > args.ctx:
        p.error("--prefill-tokens must fit in --ctx")
    return args, sc


def _sigterm(signum, frame):
    """SIGTERM behaves like Ctrl-C, so the finally blocks stop the servers."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args, sc = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    if args.make_moe:
        if args.make_moe not in MOE_SHAPES:
            sys.exit("--make-moe: one of %s" % ", ".join(MOE_SHAPES))
        print(moe_model(args.make_moe, reame.resolve_model("qwen2.5-coder-0.5b")))
        return 0
    args.model_path = os.path.abspath(reame.resolve_model(args.model))
    noise = CpuNoise()
    try:
        result = sc.run(args, noise)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    result["config"] = dict({"scenario": sc.name, "model": os.path.basename(args.model_path), "threads": args.threads,
                             "repeats": args.repeats, "gen_tokens": args.gen_tokens, "reame_version": reame.__version__,
                             "server_sampling": None if args.no_server else args.server_sampling},
                            **result.get("config", {}))
    out = {sc.name: result, "noise": noise.report()}
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(out, f, indent=2)
    w, c, nz = sys.stdout.write, result["config"], out["noise"]
    if args.json:
        w(json.dumps(out, indent=2) + "\n")
        return 0
    if sc.side_by_side:
        w("Reame vs llama-server: %s, %d threads, median of %d alternating repeats, temperature 0\n"
          % (c["model"], c["threads"], c["repeats"]))
    sc.print(result, w)
    if sc.side_by_side and "other_cpu_s" in nz:
        w("\nnoise: other processes used %.1f CPU-s over %.1f s (%.0f%% of one core), steal %.1f s, %s cores%s\n"
          % (nz["other_cpu_s"], nz["wall_s"], 100 * nz["other_cpu_frac_of_one_core"], nz["steal_s"], nz["cores"],
             "  <- NOISY: other work ran during the benchmark"
             if (nz["other_cpu_s"] + nz["steal_s"]) / max(nz["wall_s"], 1e-9) > NOISY_FRAC else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
