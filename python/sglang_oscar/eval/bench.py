"""Accuracy benchmarks against any OpenAI-compatible server (the int2 server, a BF16 baseline, ...).

    python -m sglang_oscar.eval.bench gpqa --base-url http://127.0.0.1:30000 --data gpqa_diamond.csv \
        --out results/gpqa_int2.json
    python -m sglang_oscar.eval.bench ruler --base-url ... --tokenizer /models/Qwen3-8B --lengths 4096 131072
    python -m sglang_oscar.eval.bench summarize results/*.json

Tasks: gpqa, aime, math500, humaneval, livecodebench (chat API), ruler (completions API, token
ids). Defaults are the paper's reasoning settings: 5 repeats (seeds seed..seed+4), up to 32768
generated tokens, temperature 0.6, top-p 0.95, top-k 20 (Qwen3's recommendation); RULER is
greedy, one repeat, 32 tokens. All (repeat, example) requests go through one thread pool so the
server sees --concurrency requests at all times. Output: one JSON (settings, every result, the
summary) and a markdown table line on stdout: mean ± std over repeats (sample std, n-1).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from .datasets import DatasetError, load_records
from .openai_client import ApiError, OpenAIClient
from .tasks import Task, registry
from .tasks.ruler import DEFAULT_LENGTHS, Ruler

PAPER = dict(repeats=5, max_tokens=32768, temperature=0.6, top_p=0.95, top_k=20)
RULER = dict(repeats=1, max_tokens=32, temperature=0.0, top_p=None, top_k=None)
TAIL = 600  # characters of each response kept in the JSON unless --save-responses


def all_tasks() -> dict[str, Task]:
    tasks = registry()
    tasks["ruler"] = Ruler()
    return tasks


# ------------------------------------------------------------------------------------- running
def _one(task: Task, client: OpenAIClient, model: str, ex, repeat: int, seed: int, sampling: dict,
         system: Optional[str], save: bool) -> dict:
    rec = dict(id=ex.id, repeat=repeat, seed=seed)
    if "group" in ex.data:
        rec["group"] = ex.data["group"]
    t0 = time.time()
    try:
        if task.api == "completion":
            out = client.complete(task.prompt(ex, seed), model, seed=seed, **sampling)
        else:
            msgs = task.messages(ex, seed)
            if system:
                msgs = [{"role": "system", "content": system}] + msgs
            out = client.chat(msgs, model, seed=seed, **sampling)
    except ApiError as e:
        rec.update(score=0.0, error=str(e), seconds=round(time.time() - t0, 2))
        return rec
    text = out["text"]
    score, extracted = task.score(ex, text, seed)
    rec.update(score=float(score), extracted=extracted if isinstance(extracted, (int, float, str, type(None)))
               else str(extracted), finish_reason=out["finish_reason"], completion_tokens=out["completion_tokens"],
               seconds=round(time.time() - t0, 2))
    if save:
        rec.update(text=text, reasoning=out["reasoning"])
    else:
        rec["text_tail"] = text[-TAIL:]
    return rec


def run(task: Task, examples, client: OpenAIClient, model: str, *, repeats: int, seed: int, sampling: dict,
        concurrency: int, system: Optional[str] = None, save_responses: bool = False, progress: bool = True) -> dict:
    """Every (repeat, example) through one pool; returns dict(runs=[...], summary={...})."""
    jobs = [(r, seed + r, ex) for r in range(repeats) for ex in examples]
    results: list[Optional[dict]] = [None] * len(jobs)
    t0 = time.time()
    with cf.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futs = {pool.submit(_one, task, client, model, ex, r, s, sampling, system, save_responses): i
                for i, (r, s, ex) in enumerate(jobs)}
        step = max(1, len(jobs) // 10)
        for done, fut in enumerate(cf.as_completed(futs), 1):
            results[futs[fut]] = fut.result()
            if progress and (done % step == 0 or done == len(jobs)):
                print(f"[{task.name}] {done}/{len(jobs)} done, {time.time() - t0:.0f}s", file=sys.stderr)
    runs = []
    for r in range(repeats):
        rows = [x for x in results if x["repeat"] == r]
        runs.append(dict(repeat=r, seed=seed + r, n=len(rows), score=_mean([x["score"] for x in rows]),
                         errors=sum("error" in x for x in rows),
                         truncated=sum(x.get("finish_reason") == "length" for x in rows), results=rows))
    return dict(runs=runs, summary=summarize_runs(runs), seconds=round(time.time() - t0, 1))


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def summarize_runs(runs: list[dict]) -> dict:
    scores = [100.0 * r["score"] for r in runs]
    out = dict(mean=_mean(scores), std=statistics.stdev(scores) if len(scores) > 1 else 0.0, scores=scores,
               repeats=len(runs), n=runs[0]["n"] if runs else 0, errors=sum(r["errors"] for r in runs),
               truncated=sum(r["truncated"] for r in runs))
    groups: dict[str, list] = {}
    for r in runs:
        for x in r["results"]:
            if "group" in x:
                groups.setdefault(x["group"], []).append(x["score"])
    if groups:
        out["groups"] = {g: 100.0 * _mean(v) for g, v in sorted(groups.items(), key=lambda kv: _group_key(kv[0]))}
    return out


def _group_key(g: str):
    name, _, length = g.partition("@")
    return (name, int(length) if length.isdigit() else 0)


def table(docs: list[dict]) -> str:
    lines = ["| task | model | label | n | repeats | score (mean ± std) | per repeat | errors | truncated |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in docs:
        s = d["summary"]
        per = " ".join(f"{x:.1f}" for x in s["scores"])
        lines.append(f"| {d['task']} | {d['model']} | {d.get('label') or ''} | {s['n']} | {s['repeats']} | "
                     f"{s['mean']:.2f} ± {s['std']:.2f} | {per} | {s['errors']} | {s['truncated']} |")
        for g, v in (s.get("groups") or {}).items():
            lines.append(f"| {d['task']}:{g} | {d['model']} | {d.get('label') or ''} | | | {v:.2f} | | | |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- CLI
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server URL (with or without /v1)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name sent to the server (default: the first served one)")
    p.add_argument("--label", default=None, help="free text stored with the results (e.g. int2-oscar, bf16)")
    p.add_argument("--out", default=None, help="results JSON (default results/<task>_<time>.json)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r (choice order; the request's sampling seed, which SGLang 0.5.17 applies only when the server runs with --enable-deterministic-inference)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N examples only")
    p.add_argument("--system", default=None, help="system message (default: none)")
    p.add_argument("--extra-body", default=None,
                   help='JSON merged into every request, e.g. \'{"chat_template_kwargs": {"enable_thinking": true}}\'')
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--save-responses", action="store_true", help="keep full responses (default: the last 600 chars)")
    p.add_argument("--quiet", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_oscar.eval.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="task", required=True)
    for name, task in all_tasks().items():
        s = sub.add_parser(name, help=f"{name} over the OpenAI API")
        _common(s)
        if name == "ruler":
            s.add_argument("--tokenizer", default=None, help="tokenizer path/id (default: --model)")
            s.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
            s.add_argument("--samples", type=int, default=50, help="samples per (task, length)")
            s.add_argument("--niah-tasks", nargs="+", default=["niah_single_1", "niah_multikey_2"])
            s.add_argument("--chat", action="store_true", help="wrap the question in the chat template")
            s.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                           help="send token ids (exact length; default) or the decoded text")
        else:
            s.add_argument("--data", default=None, help=f"JSONL/JSON/CSV/parquet file or hf:OWNER/REPO/FILE "
                                                        f"(default {task.default_data})")
        if hasattr(task, "add_args"):
            task.add_args(s)
    s = sub.add_parser("summarize", help="markdown table of result JSON files")
    s.add_argument("files", nargs="+")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.task == "summarize":
        print(table([json.loads(Path(f).read_text()) for f in args.files]))
        return 0
    task = all_tasks()[args.task]
    if hasattr(task, "configure"):
        task.configure(args)
    defaults = RULER if args.task == "ruler" else PAPER
    repeats = args.repeats if args.repeats is not None else defaults["repeats"]
    sampling = dict(max_tokens=args.max_tokens or defaults["max_tokens"],
                    temperature=defaults["temperature"] if args.temperature is None else args.temperature,
                    top_p=defaults["top_p"] if args.top_p is None else args.top_p,
                    top_k=defaults["top_k"] if args.top_k is None else args.top_k)
    if args.extra_body:
        try:
            sampling.update(json.loads(args.extra_body))
        except ValueError as e:
            raise SystemExit(f"error: --extra-body is not JSON: {e}")
    client = OpenAIClient(args.base_url, args.api_key, timeout=args.timeout)
    try:
        model = args.model or client.wait_ready(timeout=60)[0]
    except (ApiError, IndexError) as e:
        raise SystemExit(f"error: cannot ask {client.base_url} for its model: {e}")

    try:
        if args.task == "ruler":
            tok = _tokenizer(args.tokenizer or model)
            examples = task.build(tok, args.lengths, args.samples, tuple(args.niah_tasks), args.seed, args.chat)
            if args.prompt_format == "text":
                task.text_tokenizer = tok
            data = f"generated NIAH ({', '.join(args.niah_tasks)})"
        else:
            data = args.data or task.default_data
            examples = task.examples(load_records(data))
    except (DatasetError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    if args.limit:
        examples = examples[: args.limit]
    if not examples:
        raise SystemExit("error: no examples selected")

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res = run(task, examples, client, model, repeats=repeats, seed=args.seed, sampling=sampling,
              concurrency=args.concurrency, system=args.system, save_responses=args.save_responses,
              progress=not args.quiet)
    doc = dict(task=args.task, model=model, label=args.label, base_url=client.base_url, data=data, started=started,
               settings=dict(repeats=repeats, seed=args.seed, concurrency=args.concurrency, system=args.system,
                             **sampling),
               summary=res["summary"], seconds=res["seconds"], runs=res["runs"])
    out = Path(args.out or f"results/{args.task}_{started.replace(':', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table([doc]))
    print(f"wrote {out}")
    return 1 if res["summary"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
