"""Real SGLang 0.5.17 CPU servers in int2 mode: radix-cache hits, chunked prefill, tensor parallelism
(gloo), a soak, the eval drivers and the paged pool (--page-size 64 == page 1; ~2 min on 2 cores). All `slow`: each test starts its own servers (30-60 s each on 2
cores; TP=2/4/8: 56/95/150 s and 4.6/7.0/11.8 GiB RSS). Measured on 2 shared cores: radix 2.5 min,
sink rows 1 min, chunked 1.6 min, TP=1/2 ~8 min (TP=4/8 with OSCAR_TEST_TP=2,4,8: ~4 min more), soak
~6.5 min (500 requests in 366 s in the fresh-clone CI of b675f6b), admission 1 min, eval drivers
2.2 min; the whole file 16.3 min there.

    .venv-serve/bin/python -m pytest -q -m slow -s test/test_srt_server_sglang.py

Skipped without SGLang (.venv; CI runs it in .venv-serve, scripts/test.sh part 2) and, because the whole
file takes ~16 min on 2 cores, also unless `-m` names `slow`. Servers as in test_srt_plugin.py (`_Server`: Path A, Triton
interpreter, `--max-total-tokens 4096`) with --dtype float32, S=4 / W=16 fp32 windows (most of a
~100-token history is INT2) and --context-length 256 (the decode kernel picks its split count from
the request table's width: 256 keeps it at one INT2 split, ~4x faster in the interpreter than 4096).

What "equal" means for a lossy cache. A forward call attends its *own* new tokens at full precision
and reads the cached prefix the way it is stored: BF16/fp32 sink rows for positions < S, the
request's ring rows for the last W positions, INT2 for the rest (backend.py, eval/simulator.py). So
a radix hit (the prefix was written by another request: its ring rows are gone, ring_start = first
computed position) or a chunk boundary (the next chunk reads the previous ones through the cache)
legitimately gives other tokens than one cold unchunked prefill once the prefix reaches past S + W.
The tests therefore check (i) the server against an exact model of those rules (`_reference`: the
HF fp32 model + MixedCacheSimulator, with the server's per-call rules below) for the cold, hot,
shared-prefix and chunked cases, (ii) plain equality where the rules promise it (cold radix server
== --disable-radix-cache server; a hit inside the sink == cold; TP=n == TP=1), and (iii) that the
references for hot / chunked really differ from cold, so matching them is not vacuous.
"""

import http.client
import importlib.util
import json
import os
import random
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed here (these tests run in .venv-serve: scripts/test.sh part 2)",
                allow_module_level=True)
_SHIM = str(Path(__file__).resolve().parent / "sglang_cpu_shim")
if not torch.cuda.is_available():  # before the first sglang import (see test_srt_plugin.py)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if _SHIM not in sys.path:
        sys.path.insert(0, _SHIM)

pytest.importorskip("sglang.srt.plugins.hook_registry")

from sglang_oscar.srt import options  # noqa: E402
from test_srt_plugin import _REPO, _Server  # noqa: E402

pytestmark = pytest.mark.slow

SINK, RECENT = 4, 16
# The servers' rotations: Hadamard with INT4 keys on one KV head of each of the tiny models' two layers (the served
# format's two key widths in one layer, in every test), written to a file per KV-head count by _bundle_files.
K4_HEADS = ((0, 1), (1, 0))
ENV = {options.ENV_BUNDLE: "", options.ENV_HP_DTYPE: "float32", options.ENV_PREFIX: str(SINK),
       options.ENV_RECENT: str(RECENT)}
BUNDLES = {}  # KV heads -> bundle file
FLAGS = ("--attention-backend", "oscar_int2", "--dtype", "float32", "--kv-cache-dtype", "int2",
         "--context-length", "256")
# Server vs the HF reference: both fp32, but different kernels (Triton-interpreter decode, torch
# einsums) and different K/V rounding: usually <= 2e-5, but a K/V element within rounding of an
# INT2 code boundary may take the other code in one of the two, which moves a logprob by up to
# ~1e-2 (6.2e-3 seen once in CI, on "100 unchunked"). A wrong window or segment is O(0.1-1) and
# changes greedy ids; ids must be equal, and the hot / chunked references are asserted to differ
# from the cold ones in ids, so the checks are not vacuous at this tolerance.
REF_TOL = 2e-2
# Two servers running the same code path on the same single-request batches: bitwise in practice.
SAME_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)  # module scope: runs before the module's server fixtures
def _only_with_m_slow(request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("real-server tests (~20 min on 2 cores): select them with -m slow")


def _bundle(kv_heads, layers=2, head_dim=64):
    from sglang_oscar.rotation.bundle import data_free_bundle

    return data_free_bundle("hadamard", layers, kv_heads, head_dim, head_dim, head_dim, k4_heads=K4_HEADS)


@pytest.fixture(scope="module", autouse=True)
def _bundle_files(tmp_path_factory):
    from sglang_oscar.rotation import save_bundle

    d = tmp_path_factory.mktemp("bundles")
    for h in (2, 8):
        BUNDLES[h] = str(save_bundle(_bundle(h), d / f"hadamard_k4_{h}kv.safetensors"))
    ENV[options.ENV_BUNDLE] = BUNDLES[2]


def _make_model(path, **kw):
    import runpy

    return runpy.run_path(str(_REPO / "scripts" / "make_tiny_model.py"))["make_tiny_model"](path, **kw)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return _make_model(tmp_path_factory.mktemp("tinyq_srv"))


# ---- HTTP helpers -----------------------------------------------------------------------------

def _request(srv, method, path, body=None, timeout=600):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise AssertionError(f"{method} {path} -> {resp.status}: {data[:500]!r}")
        return json.loads(data) if data.strip().startswith((b"{", b"[")) else data
    finally:
        conn.close()


def _generate(srv, ids, n, **extra):
    """Greedy ids, their logprobs and meta_info: n tokens, past the random model's end-of-text token too (the
    references do not stop there)."""
    out = _request(srv, "POST", "/generate", {"input_ids": ids, "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                  "ignore_eos": True, **extra}})
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


def _load(srv):
    """The scheduler's token accounting (/v1/loads, core section): num_used_tokens counts every KV
    slot that is neither free nor held only by the radix cache (evictable)."""
    out = _request(srv, "GET", "/v1/loads?include=core")
    (load,) = out["loads"]
    return load


def _flush(srv, wait_s=60.0):
    """/flush_cache, retried while the scheduler is not idle: SGLang refuses a flush (400 "Flush
    cache failed.") while any request is queued or running, and a /generate reply can reach the
    client before the scheduler has dropped the finished request from its running batch (a race
    that a loaded 2-core CI machine hits). A flush still refused after wait_s fails the test."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            _request(srv, "POST", "/flush_cache")
            return
        except AssertionError as e:
            if "Flush cache failed" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _max_diff(a, b):
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _rand_prompt(rnd, n):
    return [rnd.randrange(3, 1024) for _ in range(n)]


def _start(*servers, timeout=900):
    """Wait for servers launched together; returns seconds from launch to ready. A server whose
    startup died only in SGLang's warmup poll (5 s HTTP timeout, see _Server.startup_warmup_timed_out)
    is launched once more; any other startup failure fails the test."""
    t0 = time.time()
    for s in servers:
        try:
            s.wait_ready(timeout)
        except AssertionError:
            if s.restarts or not s.startup_warmup_timed_out():
                raise
            print(f"\n[startup] SGLang's warmup poll timed out ({s.log_path}); launching once more")
            s.restart()
            s.wait_ready(timeout)
    return time.time() - t0


# ---- reference: the server's window rules on the HF model ----------------------------------------

class _ServerRules:
    """quantized_mask for eval/simulator.py with the server's per-call rules. Exact (not INT2) for a
    query at i and a key at j when j < S, or the key is part of this forward call (j >= c, c = first
    position of the call), or it is a ring row the reader sees:
        extend (backend.forward_extend, gather before write): the prefix's last W rows, j >= c - W;
        decode (kernels/decode.py): i - j < W;
    and in both cases only rows at or after the request's ring_start (the first position the request
    itself computed: rows of a radix-cached prefix were never in its ring)."""

    def __init__(self, no_sink=False):
        self.decode, self.ring_start, self.no_sink = False, 0, no_sink

    def __call__(self, qpos, nkeys, sink, recent, cstart):
        if self.no_sink:  # the request got no sink rows (all taken): positions < S are INT2 only
            sink = 0
        kpos = torch.arange(nkeys, device=qpos.device)[None, :]
        i, c = qpos[:, None], cstart[:, None]
        ring = (i - kpos < recent) if self.decode else (kpos >= c - recent)
        return (kpos >= sink) & ~(ring & (kpos >= self.ring_start)) & (kpos < c)


def _reference(model, *, cached=(), calls, n_new, kv_heads=2, layers=2, head_dim=64, no_sink=False):
    """Greedy ids + logprobs of a request whose prefix rows were written by earlier requests' forward
    calls `cached` (each its own prefill), then runs the forward calls `calls` [(tokens, ring_start)]
    and n_new decode steps. Same bundle as the servers (_bundle: Hadamard, group 64, no clip, INT4 keys on
    K4_HEADS)."""
    from transformers import DynamicCache

    from sglang_oscar.eval import simulator

    b = _bundle(kv_heads, layers, head_dim)
    sim = simulator.MixedCacheSimulator([b.layer_quantizers(i) for i in range(layers)], sink=SINK,
                                        recent=RECENT, mode="prefill")
    rules, saved = _ServerRules(no_sink), simulator.quantized_mask
    simulator.quantized_mask = rules
    ids, lps = [], []
    try:
        with torch.no_grad(), sim.attach(model):
            cache = DynamicCache()
            for toks in cached:
                rules.decode, rules.ring_start = False, 0
                model(torch.tensor([list(toks)]), past_key_values=cache, use_cache=True)
            for toks, ring_start in calls:
                rules.decode, rules.ring_start = False, ring_start
                logits = model(torch.tensor([list(toks)]), past_key_values=cache, use_cache=True).logits[0, -1]
            rules.decode = True
            for k in range(n_new):
                lp = torch.log_softmax(logits.float(), -1)
                t = int(lp.argmax())
                ids.append(t)
                lps.append(float(lp[t]))
                if k + 1 < n_new:
                    logits = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1]
    finally:
        simulator.quantized_mask = saved
    return ids, lps


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _check(name, got, want, tol=REF_TOL):
    (ids, lps), (r_ids, r_lps) = got, want
    d = _max_diff(lps, r_lps)
    print(f"  {name}: ids {'equal' if ids == r_ids else 'DIFFER'}, max |logprob diff| {d:.2e}")
    assert ids == r_ids, (name, ids, r_ids)
    assert d <= tol, (name, d)


def _first_mismatch(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# ---- (c) radix cache ------------------------------------------------------------------------------

def test_radix_hits_follow_the_window_rules(tiny_model, tmp_path):
    """A repeated 100-token prompt (hit of 99 tokens) and one sharing an 80-token prefix, on a radix
    server, vs the same prompts on a --disable-radix-cache server (always cold). Cold runs are
    identical on both servers; the hits read their prefix beyond the sink as INT2 (no ring rows of
    their own yet), so they equal the hot reference, which differs from the cold one."""
    n = 12
    radix = _Server(tiny_model, tmp_path / "radix.log", *FLAGS, "--max-running-requests", "4", env=ENV)
    cold = _Server(tiny_model, tmp_path / "noradix.log", *FLAGS, "--max-running-requests", "4",
                   "--disable-radix-cache", env=ENV)
    try:
        print(f"\n[radix] two servers ready in {_start(radix, cold):.0f} s")
        hf = _hf(tiny_model)
        rnd = random.Random(0)
        a = _rand_prompt(rnd, 100)
        b = a[:80] + _rand_prompt(rnd, 20)
        c = a[:SINK] + _rand_prompt(rnd, 96)  # shares only the sink positions with a

        t = time.time()
        a_cold = _generate(radix, a, n)
        a_off = _generate(cold, a, n)
        a_hot = _generate(radix, a, n)
        a_hot2 = _generate(radix, a, n)
        a_off2 = _generate(cold, a, n)
        b_hot = _generate(radix, b, n)
        b_off = _generate(cold, b, n)
        c_hot = _generate(radix, c, n)
        c_off = _generate(cold, c, n)
        print(f"[radix] 9 requests of {n} tokens in {time.time() - t:.0f} s; cached_tokens: a {a_cold[2]['cached_tokens']}"
              f" -> {a_hot[2]['cached_tokens']}, b {b_hot[2]['cached_tokens']}, c {c_hot[2]['cached_tokens']}; "
              f"radix off: {a_off2[2]['cached_tokens']}")
        assert a_cold[2]["cached_tokens"] == 0
        assert a_hot[2]["cached_tokens"] == 99 and a_hot2[2]["cached_tokens"] == 99  # SGLang recomputes the last
        assert b_hot[2]["cached_tokens"] == 80 and c_hot[2]["cached_tokens"] == SINK
        assert a_off2[2]["cached_tokens"] == b_off[2]["cached_tokens"] == 0

        # Plain equality where the rules promise it.
        for name, x, y in (("a cold radix vs radix off", a_cold, a_off), ("a radix off twice", a_off, a_off2),
                           ("a hot twice", a_hot, a_hot2), ("c hit inside the sink vs cold", c_hot, c_off)):
            _check(name, x[:2], y[:2], tol=SAME_TOL)

        # The window rules, on the HF model.
        ref_cold = _reference(hf, calls=[(a, 0)], n_new=n)
        ref_hot = _reference(hf, cached=[a[:99]], calls=[(a[99:], 99)], n_new=n)
        ref_b_hot = _reference(hf, cached=[a[:80]], calls=[(b[80:], 80)], n_new=n)
        ref_b_cold = _reference(hf, calls=[(b, 0)], n_new=n)
        _check("a cold", a_cold[:2], ref_cold)
        _check("a hot (99 cached)", a_hot[:2], ref_hot)
        _check("b shared prefix (80 cached)", b_hot[:2], ref_b_hot)
        _check("b radix off", b_off[:2], ref_b_cold)

        # Hit vs cold: what the hit costs, and proof the hot references test something.
        for name, hot, cold_ in (("a", a_hot, a_cold), ("b", b_hot, b_off)):
            print(f"  {name} hit vs cold: first differing token {_first_mismatch(hot[0], cold_[0])}, "
                  f"logprob of token 0 {hot[1][0]:.4f} vs {cold_[1][0]:.4f}")
        assert ref_hot[0] != ref_cold[0] and ref_b_hot[0] != ref_b_cold[0]
    finally:
        radix.stop()
        cold.stop()


def test_sink_rows_taken_by_the_radix_cache_are_read_as_int2(tiny_model, tmp_path):
    """Sink rows are a fixed pool of 2·R·S rows (capacity.default_sink_rows), and a cached prefix
    keeps its rows until its slots are evicted. With R = 2 (16 rows, S = 4) four cached prompts take
    them all: a fifth, fresh request gets none and must read its positions < S as INT2 (kernels/
    decode.py and gather.py, "missing sink rows"), i.e. equal the reference without a sink, instead of
    reading row -1. After /flush_cache the same prompt has its sink again (cold reference)."""
    n = 12
    srv = _Server(tiny_model, tmp_path / "sink.log", *FLAGS, "--max-running-requests", "2", env=ENV)
    try:
        print(f"\n[sink rows] server ready in {_start(srv):.0f} s")
        assert "R=2 requests/worker, 16 sink rows" in srv.text()
        hf = _hf(tiny_model)
        rnd = random.Random(4)
        _flush(srv)  # the warmup request's prefix holds 4 rows
        for _ in range(4):
            _generate(srv, _rand_prompt(rnd, 30), 1)
        p = _rand_prompt(rnd, 100)
        starved = _generate(srv, p, n)
        _flush(srv)
        fed = _generate(srv, p, n)
        assert starved[2]["cached_tokens"] == fed[2]["cached_tokens"] == 0
        ref_starved = _reference(hf, calls=[(p, 0)], n_new=n, no_sink=True)
        ref_fed = _reference(hf, calls=[(p, 0)], n_new=n)
        print(f"  no sink rows vs after /flush_cache: first differing token {_first_mismatch(starved[0], fed[0])}")
        _check("no sink rows left", starved[:2], ref_starved)
        _check("after /flush_cache", fed[:2], ref_fed)
        assert ref_starved[0] != ref_fed[0]
    finally:
        srv.stop()


# ---- (d) chunked prefill --------------------------------------------------------------------------

def test_chunked_prefill_follows_the_window_rules(tiny_model, tmp_path):
    """--chunked-prefill-size 32 vs 2048 (the CPU default; page size 1, so any chunk size is
    accepted) on 70/100/130-token prompts: chunk k reads chunks < k through the cache (sink + the
    previous chunk's last W ring rows + INT2), so the chunked server equals the chunked reference and
    the unchunked one the cold reference; the two references differ."""
    n = 12
    chunked = _Server(tiny_model, tmp_path / "chunk32.log", *FLAGS, "--max-running-requests", "4",
                      "--chunked-prefill-size", "32", env=ENV)
    whole = _Server(tiny_model, tmp_path / "chunk2048.log", *FLAGS, "--max-running-requests", "4",
                    "--chunked-prefill-size", "2048", env=ENV)
    try:
        print(f"\n[chunked] two servers ready in {_start(chunked, whole):.0f} s")
        hf = _hf(tiny_model)
        rnd = random.Random(1)
        lengths = (70, 100, 130)
        before = chunked.text().count("#new-token: 32,")
        t = time.time()
        for length in lengths:
            p = _rand_prompt(rnd, length)
            got_c, got_w = _generate(chunked, p, n), _generate(whole, p, n)
            calls = [(p[s:s + 32], 0) for s in range(0, length, 32)]
            ref_c = _reference(hf, calls=calls, n_new=n)
            ref_w = _reference(hf, calls=[(p, 0)], n_new=n)
            print(f"  prompt {length}: chunked vs unchunked first differing token "
                  f"{_first_mismatch(got_c[0], got_w[0])}")
            _check(f"{length} chunked (32)", got_c[:2], ref_c)
            _check(f"{length} unchunked", got_w[:2], ref_w)
            assert ref_c[0] != ref_w[0]
        chunks = chunked.text().count("#new-token: 32,") - before
        print(f"[chunked] {len(lengths)} prompts in {time.time() - t:.0f} s; {chunks} full 32-token chunks logged")
        assert chunks == sum(length // 32 for length in lengths)
        assert "#new-token: 32," not in whole.text()
    finally:
        chunked.stop()
        whole.stop()


# ---- (e) tensor parallelism (gloo) ----------------------------------------------------------------

TP_LENGTHS = (8, 100)  # 8 + 12 new tokens stay inside S + W = 20 (exact); 100 reads INT2 history
TP_NEW = 12


@pytest.fixture(scope="module")
def tiny_model_8kv(tmp_path_factory):
    """8 query heads over 8 KV heads: at TP=8 every rank holds one KV head."""
    return _make_model(tmp_path_factory.mktemp("tinyq_8kv"), heads=8, kv_heads=8)


def _tree_rss_gib(pid):
    import psutil

    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**30


def _run_tp(model, tp, log):
    env = dict(ENV, **{options.ENV_BUNDLE: BUNDLES[8]})
    if tp > 1:  # sglang-on-cpu.md 2.5 / R.6: no NCCL, and more ranks than NUMA nodes
        env.update(SGLANG_NCCL_SO_PATH="/nonexistent/libnccl.so.2",
                   SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r % max(os.cpu_count() or 1, 1)) for r in range(tp)))
    srv = _Server(model, log, *FLAGS, "--max-running-requests", "4", "--tp", str(tp), env=env)
    try:
        start = _start(srv)
        rss = _tree_rss_gib(srv.proc.pid)
        text = srv.text()
        per = 8 // tp
        for r in range(tp):
            assert f"(KV heads [{r * per}, {(r + 1) * per}) of TP rank {r}/{tp})" in text, (tp, r)
        rnd = random.Random(2)
        t = time.time()
        outs = [_generate(srv, _rand_prompt(rnd, length), TP_NEW)[:2] for length in TP_LENGTHS]
        gen = time.time() - t
        print(f"\n[tp={tp}] ready in {start:.0f} s, RSS of the server tree {rss:.1f} GiB, "
              f"{len(TP_LENGTHS)} x {TP_NEW} tokens in {gen:.0f} s")
        return outs
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tp1_outputs(tiny_model_8kv, tmp_path_factory):
    return _run_tp(tiny_model_8kv, 1, tmp_path_factory.mktemp("tp1") / "tp1.log")


def test_tp1_matches_the_reference(tiny_model_8kv, tp1_outputs):
    hf = _hf(tiny_model_8kv)
    rnd = random.Random(2)
    for length, got in zip(TP_LENGTHS, tp1_outputs):
        _check(f"tp=1 prompt {length}", got, _reference(hf, calls=[(_rand_prompt(rnd, length), 0)], n_new=TP_NEW,
                                                        kv_heads=8))


# TP sizes to run (scripts/test.sh sets 2 for CI, issue 4's (e); 4 and 8, one KV head per rank at 8,
# take ~4 more minutes and ~12 GiB: OSCAR_TEST_TP=2,4,8).
TP_SIZES = [int(x) for x in os.environ.get("OSCAR_TEST_TP", "2,4,8").split(",") if x.strip()]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tensor_parallel_matches_tp1(tp, tiny_model_8kv, tp1_outputs, tmp_path):
    """Each rank holds 8/tp KV heads (its own pool, bundle shard and absorbed V rotation); the row-
    parallel all-reduces only reorder fp32 sums (~1e-6), so tokens must equal TP=1. Tolerance: 1e-4
    inside the windows, 1e-2 with INT2 history (a K/V element within rounding of a code boundary
    may take the other 2-bit code; a wrong shard or rotation is off by O(1))."""
    outs = _run_tp(tiny_model_8kv, tp, tmp_path / f"tp{tp}.log")
    for length, (ids, lps), (ids1, lps1) in zip(TP_LENGTHS, outs, tp1_outputs):
        d = _max_diff(lps, lps1)
        print(f"  tp={tp} prompt {length}: ids {'==' if ids == ids1 else '!='} tp=1, max |logprob diff| {d:.2e}")
        assert ids == ids1, (tp, length, ids, ids1)
        assert d <= (1e-4 if length + TP_NEW <= SINK + RECENT else 1e-2), (tp, length, d)


# ---- (f) soak -------------------------------------------------------------------------------------

SOAK_REQUESTS = int(os.environ.get("OSCAR_SOAK_REQUESTS", "500"))
SOAK_CONCURRENCY = 8


def _sse_events(resp):
    """The JSON payloads of a streamed /generate response, in order, up to `data: [DONE]`."""
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def _soak_one(port, i, rnd, bases):
    """One client. Kinds: plain, stream, stream_close (client leaves mid-stream), close_early
    (non-streaming client leaves before the answer), abort_api (POST /abort_request mid-stream).
    Returns (kind, ok, detail)."""
    r = rnd.random()
    kind = ("plain" if r < 0.6 else "stream" if r < 0.8 else "stream_close" if r < 0.9
            else "close_early" if r < 0.95 else "abort_api")
    if rnd.random() < 0.4:  # shares a prefix with another request: radix hits, partial or whole
        base = rnd.choice(bases)
        prompt = base[:rnd.randint(1, len(base))] + _rand_prompt(rnd, rnd.randint(0, 20))
        prompt = prompt[:150]
    else:
        prompt = _rand_prompt(rnd, rnd.randint(1, 150))
    leaving = kind in ("stream_close", "close_early", "abort_api")
    # A decode step costs ~0.45 s per running request in the Triton interpreter, so most requests
    # stop after their prefill token; clients that leave ask for many tokens (still running then).
    n = (rnd.randint(4, 8) if kind == "close_early" else rnd.randint(40, 90) if leaving
         else rnd.choice([1, 1, 1, 1, 1, 1, 2, 2, 4, 8]))
    rid = f"soak-{i:05d}"  # fixed width: the scheduler aborts every rid that *starts with* the given one
    leave_after = rnd.randint(1, 4)
    body = {"input_ids": prompt, "rid": rid, "stream": kind != "plain" and kind != "close_early",
            "sampling_params": {"max_new_tokens": n, "temperature": rnd.choice([0, 0, 0.8]), "ignore_eos": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        if kind == "close_early":
            time.sleep(rnd.uniform(0.05, 1.5))
            return kind, True, "closed"
        resp = conn.getresponse()
        if resp.status != 200:
            return kind, False, f"HTTP {resp.status}: {resp.read()[:300]!r}"
        if kind == "plain":
            out = json.loads(resp.read())
            ok = len(out["output_ids"]) == n and out["meta_info"]["completion_tokens"] == n
            return kind, ok, f"{len(out['output_ids'])}/{n} tokens, finish {out['meta_info'].get('finish_reason')}"
        chunks, last = 0, None
        for last in _sse_events(resp):
            if "error" in last:
                return kind, False, str(last["error"])[:300]
            chunks += 1
            if kind == "stream_close" and chunks >= leave_after:
                return kind, True, f"left after {chunks} chunks"
            if kind == "abort_api" and chunks == 1:
                _abort(port, rid)
        if last is None:
            return kind, False, "no chunk"
        fin = (last["meta_info"].get("finish_reason") or {}).get("type")
        got = last["meta_info"]["completion_tokens"]
        if kind == "stream":
            return kind, fin == "length" and got == n, f"{got}/{n} tokens, finish {fin}"
        return kind, fin == "abort" or got == n, f"{got}/{n} tokens, finish {fin}"  # abort raced the end
    except Exception as e:  # noqa: BLE001
        return kind, False, repr(e)[:300]
    finally:
        conn.close()


def _abort(port, rid):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/abort_request", body=json.dumps({"rid": rid}),
                     headers={"Content-Type": "application/json"})
        conn.getresponse().read()
    finally:
        conn.close()


def _wait_idle(srv, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        load = _load(srv)
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return load
        time.sleep(1)
    raise AssertionError(f"server not idle after {timeout} s: {load}")


def test_soak_mixed_requests_leave_no_kv_behind(tiny_model, tmp_path):
    """500 mixed requests at concurrency 8 (prompts 1..150 tokens, 30% sharing prefixes; greedy and
    sampled; plain, streamed, clients leaving mid-stream or before the answer, /abort_request).
    Afterwards: no request fails, the scheduler holds no KV slot outside the radix cache (SGLang's
    own idle check, strict by default, would have killed the scheduler on a leak), /flush_cache
    brings the free-token count back to the start, and fresh greedy probes give exactly the tokens
    they gave before the soak (sink rows and ring state fully reset)."""
    from concurrent.futures import ThreadPoolExecutor

    srv = _Server(tiny_model, tmp_path / "soak.log", *FLAGS, "--max-running-requests", str(SOAK_CONCURRENCY),
                  env=ENV)
    try:
        print(f"\n[soak] server ready in {_start(srv):.0f} s")
        rnd = random.Random(3)
        probes = [_rand_prompt(rnd, length) for length in (100, 60, 140)]
        bases = [_rand_prompt(rnd, 150) for _ in range(6)]
        _flush(srv)
        start = _load(srv)
        before = [_generate(srv, p, 8)[:2] for p in probes]
        _flush(srv)
        print(f"[soak] start: {start['num_used_tokens']} used of {start['max_total_num_tokens']} tokens")
        assert start["num_used_tokens"] == 0

        seeds = [rnd.randrange(2**31) for _ in range(SOAK_REQUESTS)]
        lock = threading.Lock()
        done = []

        def client(i):
            res = _soak_one(srv.port, i, random.Random(seeds[i]), bases)
            with lock:
                done.append(res)
                if len(done) % 100 == 0:
                    print(f"[soak] {len(done)} requests, {time.time() - t:.0f} s", flush=True)
            return res

        t = time.time()
        with ThreadPoolExecutor(SOAK_CONCURRENCY) as pool:
            results = list(pool.map(client, range(SOAK_REQUESTS)))
        soak_s = time.time() - t
        kinds = {}
        for kind, ok, _ in results:
            kinds.setdefault(kind, [0, 0])[0 if ok else 1] += 1
        failures = [(i, r) for i, r in enumerate(results) if not r[1]]
        idle = _wait_idle(srv)
        after_soak = [_generate(srv, p, 8)[:2] for p in probes]  # cold prompts, cache still full
        # the reply can reach the client before the scheduler has released the last probe (141 tokens held once in
        # CI, 0 after /flush_cache): read the load once nothing runs, as after the soak
        held = _wait_idle(srv)
        _flush(srv)
        end = _load(srv)
        after = [_generate(srv, p, 8)[:2] for p in probes]
        _flush(srv)
        final = _load(srv)
        print(f"[soak] {SOAK_REQUESTS} requests in {soak_s:.0f} s; kinds (ok, failed): {kinds}")
        print(f"[soak] idle after soak: {idle['num_used_tokens']} used tokens outside the radix cache, "
              f"{held['num_used_tokens']} after the probes; after /flush_cache: {end['num_used_tokens']} used "
              f"of {end['max_total_num_tokens']}; final {final['num_used_tokens']}")
        for name, x, y in zip(("probe 100", "probe 60", "probe 140"), after_soak, before):
            print(f"  {name} before /flush_cache (radix cache full) vs before the soak: ids "
                  f"{'==' if x[0] == y[0] else '!='}, max |logprob diff| {_max_diff(x[1], y[1]):.2e}")
        assert not failures, failures[:10]
        assert srv.proc.poll() is None, "server died"
        log = srv.text()
        for bad in ("Traceback", "memory leak detected", "double free", "use-after-free"):
            assert bad not in log, (bad, log[log.find(bad) - 2000:log.find(bad) + 2000])
        assert idle["num_used_tokens"] == 0 and held["num_used_tokens"] == 0
        assert end["num_used_tokens"] == final["num_used_tokens"] == start["num_used_tokens"] == 0
        assert end["max_total_num_tokens"] == start["max_total_num_tokens"]
        for name, x, y in zip(("probe 100", "probe 60", "probe 140"), after, before):
            _check(f"{name} after /flush_cache vs before the soak", x, y, tol=SAME_TOL)
    finally:
        srv.stop()


# ---- (g) admission while a chunked prefill is in flight ------------------------------------------

ADMIT_NEW = 8


def _stream_times(port, ids, n, out, i, t0):
    """Stream one greedy request; out[i] = (seconds to the first chunk, to the last chunk, tokens)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = last = None
        got = 0
        for event in _sse_events(resp):
            now = time.time() - t0
            first = now if first is None else first
            last = now
            got = event["meta_info"]["completion_tokens"]
        out[i] = (first, last, got)
    finally:
        conn.close()


def test_a_request_behind_a_chunked_prefill_is_admitted(tiny_model, tmp_path):
    """--max-running-requests 3 and 3 requests at once whose 100-token prompts take 4 chunks of 32.
    Stock SGLang 0.5.17 counts the chunked request twice while its last chunk is planned (it holds
    a request slot and sits in can_run_list), refuses the third request with one running, and keeps
    refusing until a running request finishes. The plugin's hook (hooks.num_allocatable_reqs_around)
    admits it: all three must have started (first token) before any has finished (last token).
    Without the hook the third's first token comes after the first one's last (checked locally)."""
    srv = _Server(tiny_model, tmp_path / "admit.log", *FLAGS, "--max-running-requests", "3",
                  "--chunked-prefill-size", "32", env=ENV)
    try:
        print(f"\n[admit] server ready in {_start(srv):.0f} s")
        rnd = random.Random(11)
        prompts = [_rand_prompt(rnd, 100) for _ in range(3)]
        out = [None] * 3
        t0 = time.time()
        threads = []
        for i, p in enumerate(prompts):
            threads.append(threading.Thread(target=_stream_times, args=(srv.port, p, ADMIT_NEW, out, i, t0)))
            threads[-1].start()
            time.sleep(0.05)  # arrival order 0, 1, 2: all queued long before request 1's last chunk
        for th in threads:
            th.join(600)
        print("[admit] (first token s, last token s, tokens):", out)
        assert all(o is not None and o[2] == ADMIT_NEW for o in out), out
        firsts, lasts = [o[0] for o in out], [o[1] for o in out]
        assert max(firsts) < min(lasts), f"a request was admitted only after another finished: {out}"
        assert srv.proc.poll() is None, "server died"
    finally:
        srv.stop()


# ---- (h) eval drivers against the int2 server -----------------------------------------------------

EVAL_NEW = 8  # tokens per answer: prompts are 70-200 tokens, --context-length is 256


def _bench_cli(srv, task, out, *args):
    """`python -m sglang_oscar.eval.bench TASK` in a subprocess against srv, as a user runs it: the
    served model name from /v1/models, one repeat, EVAL_NEW tokens with ignore_eos (--extra-body),
    full responses kept. Returns (process, result JSON, the server log written meanwhile, seconds)."""
    import subprocess

    cmd = [sys.executable, "-m", "sglang_oscar.eval.bench", task, "--base-url", f"http://127.0.0.1:{srv.port}",
           "--out", str(out), "--repeats", "1", "--max-tokens", str(EVAL_NEW), "--concurrency", "4",
           "--timeout", "600", "--save-responses", "--extra-body", '{"ignore_eos": true}', *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    before = len(srv.text())
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=str(_REPO))
    secs = time.time() - t
    assert proc.returncode == 0, (task, proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc, json.loads(Path(out).read_text()), srv.text()[before:], secs


def _prefills(log):
    """(requests, prompt tokens) the scheduler prefilled: its `Prefill batch` lines summed."""
    import re

    rows = re.findall(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+),", log)
    return sum(int(s) for s, _, _ in rows), sum(int(n) + int(c) for _, n, c in rows)


def _chat_prompt_tokens(tok, task, data):
    """Prompt lengths of a chat task's requests (repeat 0, seed 0) under the model's chat template."""
    from sglang_oscar.eval import bench
    from sglang_oscar.eval.datasets import load_records

    t = bench.all_tasks()[task]
    return [len(tok(tok.apply_chat_template(t.messages(ex, 0), add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]) for ex in t.examples(load_records(str(data)))]


def _check_bench_doc(task, proc, doc, model, ids):
    """What every driver must write: one record per item, each answered by the server (EVAL_NEW
    tokens, finish "length" under ignore_eos, non-empty text), no API error, scores in [0, 1]."""
    s = doc["summary"]
    assert doc["task"] == task and doc["model"] == model, (doc["task"], doc["model"])
    assert s["errors"] == 0 and s["repeats"] == 1 and s["n"] == len(ids), s
    assert doc["settings"]["max_tokens"] == EVAL_NEW and doc["settings"]["ignore_eos"] is True
    (run,) = doc["runs"]
    recs = run["results"]
    assert sorted(r["id"] for r in recs) == sorted(ids)
    for r in recs:
        assert "error" not in r, r
        assert isinstance(r["score"], float) and 0.0 <= r["score"] <= 1.0, r
        assert r["finish_reason"] == "length" and r["completion_tokens"] == EVAL_NEW, r
        assert isinstance(r["text"], str) and r["text"], r
    assert 0.0 <= s["mean"] <= 100.0 and s["scores"] == [s["mean"]]
    assert f"| {task} | {model} |" in proc.stdout and "wrote " in proc.stdout
    return recs


def test_eval_drivers_run_against_the_int2_server(tiny_model, tmp_path):
    """The accuracy drivers (eval/bench.py CLI) end to end against a real int2 server: gpqa (3
    multiple-choice items, chat API with the tiny tokenizer's ChatML template, the paper's sampling
    defaults: temperature 0.6, top-p 0.95, top-k 20, a seed), humaneval (2 items, greedy, answers run
    in the sandbox) and ruler (niah_single_1 + niah_multikey_2 at 240 tokens, token ids to
    /v1/completions, tokenizer = the served model's directory). A random model answers garbage, so
    the scores are not the point; the plumbing is: exit code 0, one record per item each carrying a
    server response of exactly the requested length, no API errors, scores in [0, 1], and the server's
    log shows it answered exactly those requests on the driver's endpoint with HTTP 200 and prefilled
    exactly the prompt tokens the driver built (chat tasks: the messages under the model's chat
    template; ruler: the token ids), in int2 mode (uint8 pool, the plugin's "int2 KV" line).

    The server is the plain command, `--kv-cache-dtype int2` without --attention-backend,
    --max-running-requests or a rotation source: the plugin selects oscar_int2 and the rotations, sizes R from the KV budget, SGLang's
    running-request limit is that R, and one line states the capacity."""
    from transformers import AutoTokenizer

    from sglang_oscar.eval.tasks.ruler import Ruler

    chat_ok, completion_ok = '"POST /v1/chat/completions HTTP/1.1" 200 OK', '"POST /v1/completions HTTP/1.1" 200 OK'

    plain = tuple(f for f in FLAGS if f not in ("--attention-backend", "oscar_int2"))
    # and no rotation source: the server picks one (the tiny model has no zoo bundle: builtin:hadamard)
    srv = _Server(tiny_model, tmp_path / "eval.log", *plain, env=dict(ENV, **{options.ENV_BUNDLE: ""}))
    try:
        t0 = time.time()
        print(f"\n[eval] server ready in {_start(srv):.0f} s")
        log = srv.text()
        assert "sglang_oscar: rotations: data-free Hadamard (builtin:hadamard): no calibrated bundle for" in log
        assert f"sglang_oscar: int2 KV: sink={SINK} recent={RECENT}" in log
        assert "KV Cache is allocated. dtype: torch.uint8" in log
        assert "sglang_oscar: --attention-backend oscar_int2 selected for --kv-cache-dtype int2" in log
        # --max-total-tokens 4096 (_Server) caps the pool; R comes from the budget (here free RAM: the 2048 cap)
        line = re.search(r"sglang_oscar: int2 KV: 4,096 tokens \(capped by --max-total-tokens; the budget holds "
                         r"[\d,]+, [\d.]+x BF16's [\d,]+\); windows reserved for R=(\d+) requests \(their windows "
                         r"sized to 1/10 of the budget\); fits (\d+) requests of 256 \(context length\)\n", log)
        assert line, log[-3000:]
        reqs = int(line.group(1))
        assert int(line.group(2)) == min(reqs, 4096 // 256) and log.count("windows reserved for R=") == 1
        assert f"R={reqs} requests/worker (sized from the KV budget)" in log  # the rings the pool holds
        assert f"max_running_requests={reqs}," in log  # the scheduler's limit is that R
        state = _request(srv, "GET", "/server_info")["internal_states"][0]
        assert state["effective_max_running_requests_per_dp"] == reqs and state["attention_backend"] == "oscar_int2"
        model = str(tiny_model)  # SGLang serves the model under its path; the drivers ask /v1/models
        tok = AutoTokenizer.from_pretrained(model)

        gpqa = tmp_path / "gpqa.csv"
        gpqa.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3,Record ID\n"
                        "What is the capital of France?,Paris,Rome,Berlin,Madrid,q1\n"
                        "What is 2+2?,4,3,5,22,q2\n"
                        "Which gas do plants take in?,Carbon dioxide,Oxygen,Helium,Neon,q3\n")
        proc, doc, served, secs = _bench_cli(srv, "gpqa", tmp_path / "gpqa.json", "--data", str(gpqa))
        recs = _check_bench_doc("gpqa", proc, doc, model, ["q1", "q2", "q3"])
        st = doc["settings"]
        assert (st["temperature"], st["top_p"], st["top_k"], st["seed"]) == (0.6, 0.95, 20, 0)
        assert all(r["extracted"] in (None, "A", "B", "C", "D") for r in recs)
        lengths = _chat_prompt_tokens(tok, "gpqa", gpqa)
        assert served.count(chat_ok) == 3 and _prefills(served) == (3, sum(lengths)), (_prefills(served), lengths)
        print(f"[eval] gpqa: prompts of {lengths} tokens in {secs:.0f} s, score {doc['summary']['mean']:.1f}; "
              f"e.g. {recs[0]['text']!r}")

        he = tmp_path / "he.jsonl"
        he.write_text("".join(json.dumps(r) + "\n" for r in [
            {"task_id": "t/0", "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "entry_point": "add",
             "test": "def check(f):\n    assert f(1, 2) == 3\n"},
            {"task_id": "t/1", "prompt": "def neg(x):\n    \"\"\"Return -x.\"\"\"\n", "entry_point": "neg",
             "test": "def check(f):\n    assert f(3) == -3\n"}]))
        proc, doc, served, secs = _bench_cli(srv, "humaneval", tmp_path / "he.json", "--data", str(he),
                                             "--temperature", "0")
        recs = _check_bench_doc("humaneval", proc, doc, model, ["t/0", "t/1"])
        assert doc["settings"]["temperature"] == 0.0
        for r in recs:  # `extracted` is the sandbox's status: the program really ran
            assert r["extracted"] in ("ok", "error", "timeout", "output_limit") and r["score"] == float(
                r["extracted"] == "ok"), r
        lengths = _chat_prompt_tokens(tok, "humaneval", he)
        assert served.count(chat_ok) == 2 and _prefills(served) == (2, sum(lengths)), (_prefills(served), lengths)
        print(f"[eval] humaneval: prompts of {lengths} tokens in {secs:.0f} s, sandbox "
              f"{[r['extracted'] for r in recs]}")

        # 240, not 200: the tiny tokenizer is trained on this repository's sources, so its merges (and
        # the niah_multikey_2 template's 160-170 tokens) drift with every code change; 208 prompt tokens
        # leave room, and 208 + EVAL_NEW stays inside --context-length 256.
        tasks, length = ("niah_single_1", "niah_multikey_2"), 240
        proc, doc, served, secs = _bench_cli(srv, "ruler", tmp_path / "ruler.json", "--lengths", str(length),
                                             "--samples", "1", "--niah-tasks", *tasks)
        recs = _check_bench_doc("ruler", proc, doc, model, [f"{t}/{length}/0" for t in tasks])
        assert doc["settings"]["temperature"] == 0.0 and doc["data"].startswith("generated NIAH")
        assert set(doc["summary"]["groups"]) == {f"{t}@{length}" for t in tasks}
        lengths = [len(ex.data["prompt_ids"]) for ex in Ruler().build(tok, [length], 1, tasks)]
        assert all(n + EVAL_NEW <= length for n in lengths), lengths
        assert served.count(completion_ok) == 2 and chat_ok not in served
        assert _prefills(served) == (2, sum(lengths)), (_prefills(served), lengths)
        print(f"[eval] ruler: prompts of {lengths} tokens in {secs:.0f} s, answers "
              f"{[r['extracted'] for r in recs]}")

        assert srv.proc.poll() is None, "server died"
        assert "Traceback" not in srv.text()
        print(f"[eval] total {time.time() - t0:.0f} s")
    finally:
        srv.stop()


# ---- (i) the paged pool: --page-size 64 ------------------------------------------------------------

PAGE = 64


def _exact(model, ids, n):
    """Greedy ids of the HF fp32 model with an exact cache (no INT2 anywhere)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_page_size_64_serves_the_tokens_of_page_size_1(tiny_model, tmp_path):
    """--page-size 64 (what the CUDA history stage runs on) stores codes and params as
    [pages, Hkv, 64, .] (srt/pool.py, kernels/records.py): only the addresses of the records change, so a
    page-64 server must give exactly the page-1 server's greedy tokens and logprobs for the same work:
    cold prompts of 60 (its decode tokens cross the page boundary at 64), 100 and 150 (prefills over 2 and 3
    pages), and a radix hit of a 64-token prefix written by an earlier request (page-aligned, so both servers
    cache the same 64 tokens). S=4 / W=16, so most of the history is INT2: the servers' tokens must differ
    from exact attention for some prompt, or the comparison would not involve the paged INT2 records. (The
    window-rule reference is checked on the page-1 server by the tests above.) SGLang runs page 64 on CPU
    with PagedTokenToKVPoolAllocator, its Triton allocator kernels in the interpreter (TRITON_INTERPRET=1)."""
    n = 12
    flat = _Server(tiny_model, tmp_path / "page1.log", *FLAGS, "--max-running-requests", "4", env=ENV)
    paged = _Server(tiny_model, tmp_path / "page64.log", *FLAGS, "--max-running-requests", "4",
                    "--page-size", str(PAGE), env=ENV)
    try:
        print(f"\n[page 64] two servers ready in {_start(flat, paged):.0f} s")
        # --max-total-tokens 4096 (+ one page for slot 0's page): the pool is built in pages of 64 / of 1
        assert "int2 pool: 4160 slots in pages of 64 per layer (codes (65, 2, 64, 16), params (65, 2, 64, 1, 2))" \
            in paged.text()
        assert "int2 pool: 4097 slots in pages of 1 per layer (codes (4097, 2, 16), params (4097, 2, 1, 2))" \
            in flat.text()
        hf = _hf(tiny_model)
        rnd = random.Random(64)
        prompts = {length: _rand_prompt(rnd, length) for length in (60, 100, 150)}
        int2_changed = []
        t = time.time()
        for length, p in prompts.items():
            got1, got64 = _generate(flat, p, n), _generate(paged, p, n)
            assert got1[2]["cached_tokens"] == got64[2]["cached_tokens"] == 0
            _check(f"prompt {length}: page 64 vs page 1", got64[:2], got1[:2], tol=SAME_TOL)
            int2_changed.append(got64[0] != _exact(hf, p, n))
        assert any(int2_changed), "no prompt's tokens depend on the INT2 history: the comparison is vacuous"

        q = _rand_prompt(rnd, 100)
        for srv in (flat, paged):
            _generate(srv, q[:PAGE], 1)  # writes (and caches) the 64-token prefix
        hot1, hot64 = _generate(flat, q, n), _generate(paged, q, n)
        assert hot1[2]["cached_tokens"] == hot64[2]["cached_tokens"] == PAGE
        _check("radix hit of 64: page 64 vs page 1", hot64[:2], hot1[:2], tol=SAME_TOL)
        # radix keys are whole pages: a repeated 100-token prompt reuses 99 tokens at page 1, 64 at page 64
        again1, again64 = _generate(flat, prompts[100], 1), _generate(paged, prompts[100], 1)
        assert (again1[2]["cached_tokens"], again64[2]["cached_tokens"]) == (99, PAGE)
        print(f"[page 64] {2 * len(prompts) + 6} requests in {time.time() - t:.0f} s; INT2 history changed the "
              f"tokens of {sum(int2_changed)} of {len(prompts)} prompts")
        for srv in (flat, paged):
            _flush(srv)
            assert srv.proc.poll() is None and "Traceback" not in srv.text()
    finally:
        flat.stop()
        paged.stop()
