"""CPU checks of the serving benchmark's pure parts (benchmark/serving/): the batch-decode window of
tp_serve.steady_gaps and the --batch-decode spec; bench_serving.py's steady decode window, fitting concurrency,
synthetic tokenizer and rows; collect.py adding a bench_serving call to a device's results."""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark", "serving"))
tp_serve = pytest.importorskip("tp_serve")
bench_serving = pytest.importorskip("bench_serving")
collect = pytest.importorskip("collect")


def stream(t0, step, n, tokens_per_chunk=1):
    """Chunks every `step` seconds from t0, each carrying tokens_per_chunk tokens."""
    return [(t0 + i * step, (i + 1) * tokens_per_chunk) for i in range(n)]


def test_steady_gaps_count_only_the_window_where_all_decode():
    # request a starts at 0 with 10 ms steps; b starts at 0.5 s (its prefill) with 20 ms steps and outlives a
    a = stream(0.0, 0.010, 101)  # last chunk at 1.0 s
    b = stream(0.5, 0.020, 51)  # 0.5 .. 1.5 s
    gaps, window = tp_serve.steady_gaps([a, b])
    assert window == pytest.approx(0.5)
    # a's gaps inside [0.5, 1.0]: 50 of 10 ms; b's: 25 of 20 ms; none of a's before b started
    assert len(gaps) == 75
    assert sorted(set(round(g, 6) for g in gaps)) == [0.01, 0.02]


def test_steady_gaps_per_token_when_a_chunk_carries_several():
    a = stream(0.0, 0.030, 11, tokens_per_chunk=3)  # 3 tokens per 30 ms chunk: 10 ms per token
    gaps, window = tp_serve.steady_gaps([a])
    assert window == pytest.approx(0.3) and len(gaps) == 10
    assert all(g == pytest.approx(0.010) for g in gaps)


def test_steady_gaps_without_overlap_or_data():
    a, b = stream(0.0, 0.01, 10), stream(1.0, 0.01, 10)  # b starts after a has finished
    assert tp_serve.steady_gaps([a, b]) == ([], 0.0)
    assert tp_serve.steady_gaps([]) == ([], 0.0)
    assert tp_serve.steady_gaps([[(0.0, 1)]]) == ([], 0.0)  # a single chunk has no gap


def test_specs_and_modes():
    assert tp_serve.parse_spec("32768x256@8") == (32768, 256, 8)
    assert tp_serve.parse_spec("8192x1024") == (8192, 1024, None)
    with pytest.raises(SystemExit):
        tp_serve.parse_spec("32k x 256")
    # int2 is the served command: --kv-cache-dtype int2, the server picks backend, R, page size and kernels (the
    # CUDA history stage on Hopper by itself: no int2_cuda mode, no SGLANG_OSCAR_HISTORY_KERNEL)
    assert tp_serve.MODES["int2"] == (None, "int2", [])
    assert tp_serve.MODES["int2_eager"] == (None, "int2", ["--disable-cuda-graph"])
    assert "int2_cuda" not in tp_serve.MODES and not hasattr(tp_serve, "MODE_ENV")
    assert bench_serving.MODES["int2"][0] == ["--kv-cache-dtype", "int2"]


# ---- bench_serving.py ---------------------------------------------------------------------------------------------

def details(ttfts, itls, output_lens=None, errors=None):
    n = len(ttfts)
    return dict(ttfts=ttfts, itls=itls, output_lens=output_lens or [len(i) + 1 for i in itls],
                errors=errors or [""] * n)


def test_steady_window_counts_tokens_while_every_request_decodes():
    # a: first token at 1.0 s, then 8 tokens 0.125 s apart (last at 2.0); b: first token at 1.5 s, 8 tokens
    # 0.125 s apart (last at 2.5). Every request decodes in (1.5, 2.0]: a's 4 tokens at 1.625..2.0, b's 4 likewise
    d = details([1.0, 1.5], [[0.125] * 8, [0.125] * 8])
    w = bench_serving.steady_window(d)
    assert (w["start_s"], w["end_s"], w["window_s"], w["tokens"]) == (1.5, 2.0, 0.5, 8)
    assert w["decode_throughput"] == 16.0  # 2 requests x 8 tok/s
    # a chunk of 3 tokens at the first token: 3 tokens at ttft, then one per gap
    assert bench_serving.token_times(1.0, [0.5, 0.5], 4) == [1.0, 1.0, 1.5, 2.0]


def test_steady_window_absent_when_a_request_finishes_before_the_last_first_token():
    d = details([0.125, 5.0], [[0.125] * 8, [0.125] * 8])  # a finishes at 1.125 s, b starts decoding at 5.0 s
    w = bench_serving.steady_window(d)
    assert w["decode_throughput"] is None and w["tokens"] == 0
    # a failed request (error, no output) does not close the window
    d = details([1.0, 1.5, 0.0], [[0.125] * 8, [0.125] * 8, []], output_lens=[9, 9, 0], errors=["", "", "boom"])
    assert bench_serving.steady_window(d)["decode_throughput"] == 16.0


def test_rows_of_one_run():
    d = details([1.0, 1.5], [[0.125] * 8, [0.125] * 8])
    result = dict(d, median_tpot_ms=125.0, median_ttft_ms=1250.0, p99_ttft_ms=1495.0, output_throughput=7.2,
                  completed=2)
    rows = bench_serving.rows_of("int2", "qwen3-8b", 32768, 9, 2, result, "call7")
    by = {r["metric"]: r for r in rows}
    assert set(by) == {"decode_throughput", "steady_window", "tpot_median", "ttft_median", "ttft_p99",
                       "job_output_throughput", "completed_requests"}
    assert by["decode_throughput"] == dict(mode="int2", model="qwen3-8b", context=32768, output_len=9, batch=2,
                                           run="call7", metric="decode_throughput", value=16.0, unit="tok/s")
    assert (by["ttft_median"]["value"], by["ttft_median"]["unit"]) == (1.25, "s")
    assert (by["tpot_median"]["value"], by["job_output_throughput"]["value"]) == (125.0, 7.2)
    # no steady window: the metric is left out, not recorded as 0
    none = dict(details([0.125, 5.0], [[0.125] * 8, [0.125] * 8]), output_throughput=1.0)
    assert "decode_throughput" not in {r["metric"] for r in bench_serving.rows_of("x", "m", 1, 1, 2, none, "r")}


def test_fitting_concurrency_and_workloads():
    # Qwen3-8B int2 at 100 GiB: R = 188, 4,195,942 tokens -> 127 requests of 32k + 256 in pages of 64
    assert bench_serving.fitting_concurrency(188, 4195942, 32768, 256, 64) == 4195942 // 33024 == 127
    assert bench_serving.fitting_concurrency(188, 4195942, 100000, 256, 64) == 4195942 // 100288
    assert bench_serving.fitting_concurrency(16, 4195942, 2048, 16384, 1) == 16  # R bounds short requests
    assert bench_serving.concurrencies([], 127) == [127]
    assert bench_serving.concurrencies(["max", "8", "127"], 127) == [8, 127]  # sorted, max resolved, no repeats
    assert bench_serving.concurrencies(["200", "max"], 20) == [20, 200]  # 200 > fits: recorded as not fitting
    assert bench_serving.parse_workloads("32768:256, 2048:16384") == [(32768, 256, []), (2048, 16384, [])]
    # a workload's own concurrencies replace --concurrency for it alone
    assert bench_serving.parse_workloads("100000:256,32768:256@8/22/max") == [(100000, 256, []),
                                                                             (32768, 256, ["8", "22", "max"])]
    for bad in ("32k:256", "100:0", "", "32768:256@", "32768:256@8,22", "32768:256@8/all", "32768:256@/8"):
        with pytest.raises(SystemExit):
            bench_serving.parse_workloads(bad)


def test_synthetic_tokenizer_round_trips_random_ids(tmp_path):
    import json
    import random

    from transformers import AutoTokenizer

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 5000}))
    served = bench_serving.model_with_tokenizer(model, tmp_path / "work")
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]  # the source directory is not touched
    tok = AutoTokenizer.from_pretrained(str(served))
    assert tok.vocab_size == 5000
    rnd = random.Random(0)
    ids = [0, 4999] + [rnd.randrange(5000) for _ in range(500)]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    # what the server streams back, decoded piecewise, re-encodes to the same count (bench_serving's retokenized len)
    assert len(tok.encode(" ".join(tok.decode([i]) for i in ids), add_special_tokens=False)) == len(ids)


def test_collect_adds_a_call_and_keeps_the_others(tmp_path):
    import json

    old = dict(device="NVIDIA H200", versions={}, commits={"call1": "abc"}, note="n",
               rows=[dict(mode="int2", model="qwen3-8b", context=32768, batch=1, metric="decode_latency", value=6.7,
                          unit="ms/token", run="call1", source="one_batch (in-process, CUDA graphs, bs=1)")])
    path = tmp_path / "serving_NVIDIA_H200.json"
    path.write_text(json.dumps(old))
    d = details([1.0, 1.5], [[0.125] * 8, [0.125] * 8])
    bench = dict(device="NVIDIA H200", commit="def", rows=bench_serving.rows_of(
        "int2", "qwen3-8b", 32768, 9, 2, dict(d, output_throughput=7.2), "20260101-0000"))
    doc = collect.add_call(path, bench, "call9")
    assert doc["rows"][0] == old["rows"][0] and doc["commits"] == {"call1": "abc", "call9": "def"}
    assert "server_flags" not in doc  # no extra flags, none recorded
    assert "server_flags" not in collect.add_call(path, dict(bench, settings=dict(flags="")), "call9")
    path.write_text(json.dumps(collect.add_call(path, dict(bench, settings=dict(flags="--x")), "call8")))
    assert json.loads(path.read_text())["server_flags"] == {"call8": {"int2": "--x"}}
    fi = dict(bench, rows=[dict(r, mode="fi_bf16") for r in bench["rows"]], settings=dict(flags=""))
    path.write_text(json.dumps(collect.add_call(path, fi, "call8")))  # another call's mode, no flags: int2's stay
    assert json.loads(path.read_text())["server_flags"] == {"call8": {"int2": "--x"}}
    assert "server_flags" not in collect.add_call(path, dict(bench, settings=dict(flags="")), "call8")  # re-added
    path.write_text(json.dumps(old))
    doc = collect.add_call(path, bench, "call9")
    added = doc["rows"][1:]
    assert added and all(r["run"] == "call9" and r["source"] == collect.BENCH_SERVING_SOURCE for r in added)
    path.write_text(json.dumps(doc))
    assert collect.add_call(path, bench, "call9")["rows"] == doc["rows"]  # adding twice keeps one copy
    other = dict(bench, rows=[dict(r, mode="fi_bf16") for r in bench["rows"]])  # the next call's mode, same run
    both = collect.add_call(path, other, "call9")["rows"]
    assert both[:len(doc["rows"])] == doc["rows"] and len(both) == len(doc["rows"]) + len(added)
    with pytest.raises(SystemExit, match="holds NVIDIA H200 rows"):
        collect.add_call(path, dict(bench, device="cpu"), "call9")
    pytest.importorskip("matplotlib")
    (png,) = collect.plot_capacity(doc["rows"], tmp_path, "NVIDIA H200")
    assert png.name == "serving_capacity_NVIDIA_H200.png" and png.stat().st_size > 1000


def test_collect_adds_a_one_batch_call_beside_the_capacity_rows(tmp_path):
    import json

    old = dict(device="NVIDIA H200", versions={}, commits={"s1": "abc"}, note="n",
               rows=[dict(mode="int2", model="qwen3-8b", context=32768, batch=130, metric="decode_throughput",
                          value=2998.0, unit="tok/s", run="s1", source=collect.BENCH_SERVING_SOURCE, output_len=256)])
    path = tmp_path / "serving_NVIDIA_H200.json"
    path.write_text(json.dumps(old))
    one = dict(device="NVIDIA H200", commit="def", rows=[
        dict(mode=m, model="qwen3-8b", context=c, batch=1, metric="decode_latency", value=v, unit="ms/token")
        for m, c, v in (("int2", 32768, 6.2), ("fi_bf16", 32768, 7.6), ("int2", 100000, 6.8))])
    doc = collect.add_call(path, one, "call4", "one_batch_")
    assert doc["rows"][0] == old["rows"][0] and doc["commits"] == {"s1": "abc", "call4": "def"}
    added = doc["rows"][1:]
    assert [(r["mode"], r["context"], r["value"]) for r in added] == [("int2", 32768, 6.2), ("fi_bf16", 32768, 7.6),
                                                                      ("int2", 100000, 6.8)]
    assert all(r["run"] == "call4" and r["source"].startswith("one_batch") for r in added)
    path.write_text(json.dumps(doc))
    again = collect.add_call(path, dict(one, rows=one["rows"][:1]), "call4", "one_batch_")["rows"]
    assert again == doc["rows"][:1] + [added[1], added[0]]  # the re-added mode replaces all its rows; fi_bf16 stays
    with pytest.raises(SystemExit, match="--add takes"):
        collect.add_call(path, one, "call4", "kernel_table")
    pytest.importorskip("matplotlib")
    (png,) = collect.plot(added, tmp_path, "NVIDIA H200")
    assert png.name == "serving_decode_latency_NVIDIA_H200.png" and png.stat().st_size > 1000


def decode_line(running, tokens, rate, stamp="2026-12-03 07:50:00"):
    return (f"[{stamp}] Decode batch, #running-req: {running}, #token: {tokens}, token usage: 0.50, cuda graph: True, "
            f"gen throughput (token/s): {rate}, #queue-req: 0")


def test_scheduler_rows_bin_the_servers_rate_by_context_per_request():
    log = "\n".join([
        decode_line(1, 0, 1.5),  # the warmup request: not the batch
        decode_line(4, 4 * 2100, 900.0), decode_line(4, 4 * 2500, 800.0), decode_line(4, 4 * 2900, 700.0),
        decode_line(3, 3 * 3000, 999.0),  # a request finished: not all running
        decode_line(4, 4 * 3100, 600.0),
        "[2026-12-03 07:50:01] Prefill batch, #new-seq: 4, #new-token: 8192",
    ])
    rows = bench_serving.scheduler_rows(log, "int2", "qwen3-8b", 2048, 16384, 4, "r1")
    assert [(r["at_context"], r["value"], r["lines"]) for r in rows] == [(2500, 800.0, 3), (3100, 600.0, 1)]
    assert all(r["metric"] == "scheduler_decode_throughput" and r["batch"] == 4 and r["context"] == 2048
               and r["unit"] == "tok/s" for r in rows)
    assert bench_serving.scheduler_rows(log, "int2", "m", 2048, 16384, 8, "r1") == []  # no line at batch 8


def test_collect_reads_scheduler_rows_from_server_logs(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "int2.log").write_text("\n".join(decode_line(2, 2 * c, 100.0 - c / 100) for c in (2100, 3100, 4100)))
    bench = dict(device="NVIDIA H200", commit="abc", run="r1", model="qwen3-8b", rows=[],
                 runs=[dict(mode="int2", workloads=[dict(context=2048, output_len=16384, batch=2)]),
                       dict(mode="fi_bf16", workloads=[dict(context=2048, output_len=16384, batch=1)])])
    out = collect.add_server_logs(bench, logs)
    assert [r["at_context"] for r in out["rows"]] == [2100, 3100, 4100] and {r["mode"] for r in out["rows"]} == {"int2"}
    assert len(collect.add_server_logs(out, logs)["rows"]) == 3  # rows already there are not added again
    pytest.importorskip("matplotlib")
    rows = out["rows"] + [dict(r, mode="fi_bf16", batch=1, value=r["value"] / 4) for r in out["rows"]]
    (png,) = collect.plot_scheduler(rows, tmp_path, "NVIDIA H200")
    assert png.name == "serving_scheduler_NVIDIA_H200.png" and png.stat().st_size > 1000


def test_bin_ratios_pair_the_modes_by_their_1k_bin():
    # medians of one bin round to different thousands (6503 -> 7000, 6488 -> 6000): pairing must use the bin
    got = collect.bin_ratios([(2543, 11452.0), (6503, 8737.0), (9100, 10.0)], [(2528, 4106.0), (6488, 2508.0)])
    assert [a for a, _ in got] == [2543, 6503]
    assert got[0][1] == pytest.approx(11452 / 4106) and got[1][1] == pytest.approx(8737 / 2508)


def test_scheduler_plot_draws_one_line_per_concurrency():
    # a run sweeping 8 and 130 requests has rows of both at the same context bins: never one zig-zag line
    rows = [dict(batch=b, at_context=a, value=v) for b, a, v in
            [(130, 33500, 3000.0), (8, 32500, 1000.0), (130, 32500, 3100.0), (8, 33500, 990.0)]]
    assert collect.lines_by_batch(rows) == {8: [(32500, 1000.0), (33500, 990.0)],
                                            130: [(32500, 3100.0), (33500, 3000.0)]}
    assert list(collect.lines_by_batch(rows)) == [8, 130]


def test_scheduler_mean_is_the_line_weighted_harmonic_mean():
    rows = [dict(metric="scheduler_decode_throughput", value=100.0, lines=1),
            dict(metric="scheduler_decode_throughput", value=50.0, lines=2),
            dict(metric="decode_throughput", value=1e9)]
    # 3 lines of equal steps: time 1/100 + 2/50 per step-unit -> 3 / 0.05 = 60 tok/s
    assert bench_serving.scheduler_mean(rows) == pytest.approx(60.0)
    assert bench_serving.scheduler_mean(rows[2:]) is None


# ---- bench_serving --profile-steps and kernel_table.py on a served trace ---------------------------------------

def test_profile_request_waits_for_the_full_batch(tmp_path):
    """The watcher ignores log lines from before the workload and lines with fewer requests running, then posts one
    /start_profile with the steps, prefix, GPU activity and the trace folder, and notes the context it started at."""
    import http.server
    import json
    import threading

    posts = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            posts.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Start profiling.\n")

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    line = "Decode batch, #running-req: {}, #token: {}, token usage: 0.50, gen throughput (token/s): 100.00\n"
    log = tmp_path / "srv.log"
    log.write_text(line.format(4, 4000))  # an earlier workload's batch of 4: before log_from, ignored

    class Srv:
        port = httpd.server_address[1]

        def text(self):
            return log.read_text()

    note, done = {}, threading.Event()
    t = threading.Thread(target=bench_serving.profile_when_full,
                         args=(Srv(), 4, 3, tmp_path / "tr", "int2_32768_256_4", len(log.read_text()), done, note))
    t.start()
    with open(log, "a") as f:
        f.write(line.format(3, 3000))  # not all 4 running yet
    t.join(3.0)
    assert t.is_alive() and not posts
    with open(log, "a") as f:
        f.write(line.format(4, 131072 + 8))
    t.join(10.0)
    httpd.shutdown()
    assert not t.is_alive() and len(posts) == 1
    path, body = posts[0]
    assert path == "/start_profile" and body["num_steps"] == 3 and body["activities"] == ["GPU"]
    assert body["profile_prefix"] == "int2_32768_256_4" and body["output_dir"] == str(tmp_path / "tr")
    started = note.pop("profile_started")
    assert note == dict(profile_prefix="int2_32768_256_4", profile_steps=3, profile_at_context=32770)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", started)
    done.set()  # a watcher told to stop before the batch fills posts nothing
    bench_serving.profile_when_full(Srv(), 9, 3, tmp_path / "tr", "x", 0, done, {})
    assert len(posts) == 1


def test_kernel_table_counts_steps_wall_and_idle_of_a_served_trace(tmp_path):
    """Two steps of two layers: attention, write and GEMM kernels; 40 us of host gap between the steps. Steps come
    from the attention kernel's calls / layers; wall = first start to last end; idle = wall - union of the kernels."""
    import gzip
    import json

    kernel_table = pytest.importorskip("kernel_table")
    ev, t = [], 0.0
    for step in range(2):
        for layer in range(2):
            for name, dur in (("cutlass_gemm", 50.0), ("_oscar_write_kernel", 5.0), ("int2_history_kernel", 20.0),
                              ("_oscar_decode_merge", 5.0)):
                ev.append(dict(ph="X", cat="kernel", name=name, ts=t, dur=dur))
                t += dur
        t += 40.0  # the host's gap before the next step
    path = tmp_path / "int2_32768_256_4-1.0-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=ev), f)
    row = kernel_table.summarize(path, steps=0, layers=2)
    assert row["steps"] == 2 and row["attention_calls_per_step"] == 2
    # step 0's first attention call to step 1's: one step of 2 x 80 us of kernels and the 40 us gap
    assert row["wall_ms_per_step"] == pytest.approx(0.2)
    assert row["busy_ms_per_step"] == pytest.approx(0.16)
    assert row["idle_ms_per_step"] == pytest.approx(0.04)
    given = kernel_table.summarize(path, steps=2)  # without the layer count: first kernel to last, per step
    assert given["wall_ms_per_step"] == pytest.approx((2 * 2 * 80 + 40) / 2 / 1e3)
    assert given["idle_ms_per_step"] == pytest.approx(0.02)
    assert row["groups_ms_per_step"]["attention: oscar decode"] == pytest.approx(0.05)
    with pytest.raises(SystemExit, match="whole number"):
        kernel_table.summarize(path, steps=0, layers=3)
    with pytest.raises(SystemExit, match="--layers"):
        kernel_table.summarize(path, steps=0)


def test_served_bundle_has_the_served_formats_int4_share(tmp_path, monkeypatch):
    """The speed benchmarks' dummy-weight int2 servers get the served format (INT4 keys on a quarter of the pairs,
    every rank its share), not the INT2-only builtin; a user's $SGLANG_OSCAR_BUNDLE wins."""
    served_bundle = pytest.importorskip("served_bundle")
    from sglang_oscar.config import max_k4_heads
    from sglang_oscar.rotation.bundle import load_bundle

    for layers, heads in ((36, 8), (30, 3), (5, 2), (92, 8)):
        pairs = served_bundle.k4_pairs(layers, heads)
        assert len(pairs) == len(set(pairs)) == max_k4_heads(layers, heads)
        assert all(0 <= layer < layers and 0 <= h < heads for layer, h in pairs)
    for heads in (8, 4):
        by_head = [h for _, h in served_bundle.k4_pairs(36, heads)]
        for tp in (2, 4, 8)[: 2 + (heads == 8)]:  # KV heads split into tp contiguous blocks: equal counts per rank
            counts = [sum(r * heads // tp <= h < (r + 1) * heads // tp for h in by_head) for r in range(tp)]
            assert len(set(counts)) == 1, (heads, tp, counts)
    cfg = os.path.join(os.path.dirname(__file__), "..", "benchmark", "serving", "configs", "qwen3-8b")
    monkeypatch.delenv("SGLANG_OSCAR_BUNDLE", raising=False)
    path, label = served_bundle.int2_bundle(cfg, tmp_path)
    b = load_bundle(path, expect_layers=36, expect_kv_heads=8, expect_head_dim=128)
    assert int((b.k_bits == 4).sum()) == 72 and set(b.k_bits.unique().tolist()) == {2, 4}
    assert b.k_group == b.v_group == 64 and "INT4" in label
    monkeypatch.setenv("SGLANG_OSCAR_BUNDLE", "builtin:hadamard")
    assert served_bundle.int2_bundle(cfg, tmp_path) == ("builtin:hadamard", "builtin:hadamard")
    with pytest.raises(SystemExit, match="config.json"):
        served_bundle.write_served_bundle(tmp_path / "nowhere", tmp_path / "x.safetensors")
