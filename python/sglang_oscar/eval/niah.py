"""Needle-in-a-haystack retrieval in the style of RULER, generated offline by our own code.

Tasks
  niah_single_1   haystack: the five noise sentences "The grass is green. ... There and back again."
                  repeated; one needle "One of the special magic numbers for {key} is: {value}."
                  (key: one common English word, value: a random 7-digit number) inserted at a
                  random depth, at a sentence boundary.
  niah_multikey_1 the niah_single_1 haystack with the needle and 3 distractor needles (other keys,
                  other numbers) at independent random depths; the query asks for one key.
  niah_multivalue the niah_single_1 haystack with 4 needles of the same key and 4 different
                  numbers at independent random depths; the answer must contain every number.
  niah_multikey_2 the haystack is itself made of needles with other keys and numbers (one per
                  line); the query asks for one of them. Hundreds of distinct keys are needed at
                  8k tokens, so in this task every key is a pair of words, "word-word".

Formats for checking that a result generalises (UNSEEN_TASKS: no calibration, selection or tuning
uses them): prose haystack and another needle, question and answer prefix.
  niah_essay_single      haystack: consecutive sentences of the Python Language Reference
                         (data.eval_text, whitespace collapsed) from a random start; needle "The
                         access code for the {key} room is {value}." (value: 7 digits); the query
                         asks for the access code.
  niah_essay_multivalue  the same haystack, 4 needles of one key with different codes; the answer
                         must contain every code.

Prompt (RULER's template), then the answer prefix, so the model only has to write the number:
  "Some special magic numbers are hidden ... afterwards.\n{context}\nWhat is the special magic
   number for {query} mentioned in the provided text?" + " The special magic number for {query}
   mentioned in the provided text is"
With chat=True the question goes in a user turn of the tokenizer's chat template and the answer
prefix opens the assistant turn. Check with the exact SmolLM2-135M-Instruct (3 niah_single_1
samples at 2048, seed 0): raw text 100, chat template 100 (same three answers). Both are usable;
the default is raw text (chat=False), RULER's base-model format, which spends no tokens on the
template's system prompt. Re-check at longer contexts before relying on either.

The prompt is length − 32 tokens (±a few: the haystack is cut at unit boundaries), so
max_new_tokens generation stays within a model's context of `length`. Samples are deterministic
in (seed, task, length, index): random.Random seeded with a string is stable across processes.
"""

from __future__ import annotations

import contextlib
import inspect
import dataclasses
import random
import re
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from .simulator import MixedCacheSimulator

TASKS = ("niah_single_1", "niah_multikey_1", "niah_multivalue", "niah_multikey_2")
UNSEEN_TASKS = ("niah_essay_single", "niah_essay_multivalue")
ALL_TASKS = TASKS + UNSEEN_TASKS
DISTRACTORS = 3  # niah_multikey_1: needles of other keys
VALUES = 4  # niah_multivalue: numbers of the one key
GENERATION_RESERVE = 32

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
TEMPLATE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n{context}\n"
    "What is the special magic number for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic number for {query} mentioned in the provided text is"
TEMPLATE_MV = TEMPLATE.replace("What is the special magic number", "What are all the special magic numbers")
ANSWER_PREFIX_MV = " The special magic numbers for {query} mentioned in the provided text are"


@dataclasses.dataclass(frozen=True)
class _Format:
    needle: str
    template: str
    answer_prefix: str
    template_mv: str
    answer_prefix_mv: str


_MAGIC = _Format(NEEDLE, TEMPLATE, ANSWER_PREFIX, TEMPLATE_MV, ANSWER_PREFIX_MV)
_ESSAY = _Format(
    needle="The access code for the {key} room is {value}.",
    template=("Below is a long document. Somewhere in it are access codes for rooms. Read it carefully; "
              "a question about one of the codes follows.\n{context}\n"
              "What is the access code for the {query} room?"),
    answer_prefix=" The access code for the {query} room is",
    template_mv=("Below is a long document. Somewhere in it are access codes for rooms. Read it carefully; "
                 "a question about the codes follows.\n{context}\n"
                 "What are all the access codes for the {query} room?"),
    # ending in "... are", exact SmolLM2-135M wrote numbered lists of unrelated text (score 0 on 3 samples at 2k);
    # ending in "are the numbers" it scored 92 on the same samples
    answer_prefix_mv=" The access codes for the {query} room are the numbers",
)

# Common English nouns and adjectives used as needle keys (no downloads).
WORDS = tuple("""
apple river mountain garden window bottle candle pencil rabbit tiger forest ocean island desert
valley castle bridge tower market village harbor meadow canyon glacier volcano jungle prairie
orchard cottage palace temple library museum theater stadium factory office kitchen bedroom
basement balcony chimney ladder hammer wrench shovel bucket basket blanket pillow mirror curtain
carpet jacket sweater scarf glove helmet boots wallet ticket letter parcel camera guitar violin
piano trumpet drum flute anchor compass lantern rocket engine wagon bicycle sailboat airplane
tractor subway tunnel highway station airport ferry canoe saddle blossom cactus clover daisy
tulip violet maple willow cedar pine acorn pebble boulder crystal marble copper silver golden
bronze velvet cotton leather paper plastic wooden purple orange yellow scarlet crimson amber
ivory silent gentle brave clever happy lucky quiet bright swift calm eager fancy jolly kind
proud shy witty zealous ancient modern rapid sturdy tiny giant narrow wide shallow deep frozen
sunny windy cloudy stormy misty dusty sandy rocky muddy salty sweet bitter spicy crunchy smooth
rough shiny fluffy hollow heavy light noble humble loyal honest polite rural urban coastal
northern southern eastern western winter summer autumn spring morning evening midnight dawn
falcon eagle sparrow pelican penguin dolphin whale shark turtle lizard beaver badger otter
walrus donkey camel zebra giraffe panda koala lemon cherry peach plum mango melon grape olive
onion pepper carrot potato tomato walnut almond butter cheese bread honey cookie muffin pretzel
noodle pickle sugar coffee doctor farmer sailor artist author singer dancer pilot baker
""".split())

if len(set(WORDS)) != len(WORDS) or len(WORDS) < 200:
    raise RuntimeError("WORDS must hold at least 200 distinct words")


@dataclasses.dataclass
class NiahSample:
    prompt_ids: list[int]
    answers: list[str]
    task: str
    length: int  # the context budget the sample was built for (prompt + generation)
    depth: float  # needle position in the haystack, 0 = start, 1 = end
    query: str = ""


# ------------------------------------------------------------------------------- generation
def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def _prompt_text(tokenizer, context: str, query: str, chat: bool, multi: bool = False, fmt: _Format = _MAGIC) -> str:
    body = (fmt.template_mv if multi else fmt.template).format(context=context, query=query)
    prefix = (fmt.answer_prefix_mv if multi else fmt.answer_prefix).format(query=query)
    if not chat:
        return body + prefix
    turn = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                         tokenize=False)
    return turn + prefix.lstrip()


def _noise_units(n: int) -> list[str]:
    sentences = [s.strip() + "." for s in NOISE.split(".") if s.strip()]
    return [sentences[i % len(sentences)] for i in range(n)]


ESSAY_UNIT_WORDS = 24  # longer sentences (collapsed code blocks) are cut, so a prompt fills its length closely
_ESSAY_SENTENCES: list = []


def _essay_sentences() -> list[str]:
    """The Language Reference as sentences (whitespace collapsed, at most ESSAY_UNIT_WORDS words), computed once."""
    if not _ESSAY_SENTENCES:
        from ..data import eval_text

        flat = re.sub(r"\s+", " ", eval_text())
        for sent in re.split(r"(?<=[.!?]) (?=[A-Z])", flat):
            words = sent.split()
            _ESSAY_SENTENCES.extend(" ".join(words[i:i + ESSAY_UNIT_WORDS])
                                    for i in range(0, len(words), ESSAY_UNIT_WORDS))
    return _ESSAY_SENTENCES


def _seven_digits(rng: random.Random, avoid: set) -> str:
    while True:
        v = str(rng.randint(1_000_000, 9_999_999))
        if v not in avoid:
            avoid.add(v)
            return v


def _build_one(tokenizer, task: str, length: int, rng: random.Random, chat: bool) -> NiahSample:
    used: set = set()
    value = _seven_digits(rng, used)
    multi = task in ("niah_multivalue", "niah_essay_multivalue")
    essay = task in UNSEEN_TASKS
    fmt = _ESSAY if essay else _MAGIC
    if task == "niah_multikey_2":
        a, b = rng.sample(WORDS, 2)
        key = f"{a}-{b}"
    else:
        key = rng.choice(WORDS)
    needle = fmt.needle.format(key=key, value=value)
    depth = rng.random()
    # Extra needles of the noise-haystack tasks, each at its own depth: (depth, sentence).
    extra: list[tuple[float, str]] = []
    values = [value]
    if task == "niah_multikey_1":
        others = [w for w in WORDS if w != key]
        for k in rng.sample(others, DISTRACTORS):
            extra.append((rng.random(), fmt.needle.format(key=k, value=_seven_digits(rng, used))))
    elif multi:
        for _ in range(VALUES - 1):
            v = _seven_digits(rng, used)
            values.append(v)
            extra.append((rng.random(), fmt.needle.format(key=key, value=v)))
    target = length - GENERATION_RESERVE * (VALUES if multi else 1)
    all_needles = " ".join([needle] + [e for _, e in extra])
    base = len(_encode(tokenizer, _prompt_text(tokenizer, all_needles, key, chat, multi, fmt), chat))
    if base > target:
        raise ValueError(f"length {length} is too short for the {task} template ({base} tokens + "
                         f"{GENERATION_RESERVE} reserved)")

    # Haystack units (sentences or distractor needles), generated lazily up to the largest n tried.
    units: list[str] = []
    sep = "\n" if task == "niah_multikey_2" else " "

    seen_keys = {key}
    essay_start = rng.randrange(len(_essay_sentences())) if essay else 0

    def grow(n: int) -> None:
        if n <= len(units):
            return
        if essay:
            sents = _essay_sentences()
            units[:] = [sents[(essay_start + i) % len(sents)] for i in range(n)]
            return
        if task != "niah_multikey_2":
            units[:] = _noise_units(n)
            return
        while len(units) < n:
            a, b = rng.sample(WORDS, 2)
            k = f"{a}-{b}"
            if k not in seen_keys:
                seen_keys.add(k)
                units.append(fmt.needle.format(key=k, value=_seven_digits(rng, used)))

    def prompt_ids(n: int):
        grow(n)
        at = round(depth * n)
        # Insert from the deepest position down so earlier insertions do not shift later ones;
        # the scored needle goes last among equal positions.
        placed = sorted([(round(d * n), 1, e) for d, e in extra] + [(at, 0, needle)], reverse=True)
        hay = list(units[:n])
        for pos, _, sentence in placed:
            hay.insert(pos, sentence)
        return _encode(tokenizer, _prompt_text(tokenizer, sep.join(hay), key, chat, multi, fmt), chat), at

    # Largest n with len(prompt) <= target: grow an upper bound, then bisect.
    lo, hi = 0, 16
    while len(prompt_ids(hi)[0]) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(prompt_ids(mid)[0]) <= target:
            lo = mid
        else:
            hi = mid
    ids, at = prompt_ids(lo)
    return NiahSample(prompt_ids=ids, answers=values, task=task, length=length,
                      depth=at / lo if lo else 0.0, query=key)


def make_samples(tokenizer, task: str, length: int, n: int, seed: int = 0, *, chat: bool = False,
                 first: int = 0) -> list[NiahSample]:
    """Samples first..first+n-1 of `task` whose prompts fill `length` − 32 tokens.

    Sample i depends only on (task, length, seed, i), so runs over disjoint index ranges (several
    processes, or more samples later) add up to the same set as one run over the union."""
    if task not in ALL_TASKS:
        raise ValueError(f"unknown NIAH task {task!r}; choose from {ALL_TASKS}")
    if n < 1 or length < 1 or first < 0:
        raise ValueError(f"need n >= 1, length >= 1 and first >= 0, got n={n} length={length} first={first}")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True but the tokenizer has no chat template")
    return [_build_one(tokenizer, task, length, random.Random(f"{task}|{length}|{seed}|{i}"), chat)
            for i in range(first, first + n)]


# ---------------------------------------------------------------------------------- scoring
def string_match_all(prediction: str, references: list[str]) -> float:
    """100 × the fraction of references that occur in the prediction (case-insensitive)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    p = prediction.lower()
    return 100.0 * sum(r.lower() in p for r in references) / len(references)


# ------------------------------------------------------------------------------- generation
def _step(model, token: int, cache):
    dev = next(model.parameters()).device
    out = model(input_ids=torch.tensor([[token]], device=dev), past_key_values=cache, use_cache=True)
    return int(out.logits[0, -1].argmax()), out.past_key_values


_ANSWER_DONE = re.compile(r"\d{7}\D")


def _answer_done(text: str, n_answers: int) -> bool:
    """n_answers 7-digit numbers written, the last one closed by a non-digit."""
    return len(_ANSWER_DONE.findall(text)) >= n_answers


def _truncate(cache, length: int) -> None:
    """Cut a DynamicCache back to `length` positions (crop's argument changed across transformers versions)."""
    cur = cache.get_seq_length()
    if cur == length:
        return
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(length - cur)  # transformers 5.x: a negative count of tokens to drop
    else:
        cache.crop(length)  # 4.x: the length to keep
    if cache.get_seq_length() != length:
        raise RuntimeError(f"cache crop to {length} left {cache.get_seq_length()} positions")


# What an answer is scored on: "first_line", its first line (the greedy decode stops at a newline), or "whole",
# every line up to the token budget (RULER's string_match_all over the whole output: an answer written as a list,
# one value per line, counts).
ANSWER_RULES = ("first_line", "whole")


def _check_rule(answer: str) -> None:
    if answer not in ANSWER_RULES:
        raise ValueError(f"answer must be one of {ANSWER_RULES}, got {answer!r}")


def _greedy_tokens(model, tokenizer, first: int, cache, max_new_tokens: int, n_answers: int = 1,
                   prefix: Sequence[int] = (), answer: str = "first_line") -> list[int]:
    """Greedy continuation from `first` (already chosen), EOS dropped; stops at EOS, a newline (rule first_line),
    or once n_answers 7-digit numbers are complete (a non-digit follows the last: more tokens cannot change the
    score). `prefix`: answer tokens already in `cache` before `first` (they count towards max_new_tokens and the
    stopping rule, and lead the returned answer)."""
    eos = tokenizer.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    toks = [*prefix, first]
    while (len(toks) < max_new_tokens and toks[-1] not in eos
           and not (answer == "first_line" and "\n" in tokenizer.decode(toks))
           and not _answer_done(tokenizer.decode(toks), n_answers)):
        nxt, cache = _step(model, toks[-1], cache)
        toks.append(nxt)
    return [t for t in toks if t not in eos]


def _answer_text(tokenizer, toks: list[int], answer: str = "first_line") -> str:
    """What an answer scores on: its first line, or all of it (ANSWER_RULES)."""
    text = tokenizer.decode(toks, skip_special_tokens=True)
    return text.split("\n")[0] if answer == "first_line" else text


def _greedy(model, tokenizer, first: int, cache, max_new_tokens: int, n_answers: int = 1,
            answer: str = "first_line") -> str:
    """The greedy answer as it is scored (see _greedy_tokens, _answer_text)."""
    return _answer_text(tokenizer, _greedy_tokens(model, tokenizer, first, cache, max_new_tokens, n_answers,
                                                  answer=answer), answer)


@contextlib.contextmanager
def _with_mode(sim: Optional[MixedCacheSimulator], model, mode):
    if sim is None:
        yield
        return
    saved = sim.mode
    sim.mode = mode
    try:
        with sim.attach(model):
            yield
    finally:
        sim.mode = saved


@torch.no_grad()
def run_niah(model, tokenizer, samples: list[NiahSample], methods: dict[str, Optional[MixedCacheSimulator]],
             max_new_tokens: int = 12, progress: bool = True, prompt_mode: str = "prefill",
             answer: str = "first_line") -> dict:
    """Greedy NIAH under each method: {name: dict(score, per_sample, predictions, answer)}; answer: what is scored
    (ANSWER_RULES).

    prompt_mode="prefill" (server semantics, default): the whole prompt is prefilled once with the
    exact model (a one-chunk server prefill reads exact K/V), which also fixes the first answer
    token for every method; each method then decodes from its own copy of that cache, with its
    simulator quantizing the history beyond the sink and recent windows.
    prompt_mode="decode" (stress): each method also runs the prompt through its simulator in
    "decode" semantics (every prompt position sees a quantized history), then decodes.
    """
    if prompt_mode not in ("prefill", "decode"):
        raise ValueError(f'prompt_mode must be "prefill" or "decode", got {prompt_mode!r}')
    _check_rule(answer)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    dev = next(model.parameters()).device
    res = {name: dict(score=0.0, per_sample=[], predictions=[], answer=answer) for name in methods}
    for s in tqdm(samples, desc="niah", disable=not progress):
        ids = torch.tensor([s.prompt_ids], device=dev)
        n_ans = len(s.answers)  # max_new_tokens is per answer
        if prompt_mode == "prefill":
            shared = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            first = int(shared.logits[0, -1].argmax())
        for name, sim in methods.items():
            if prompt_mode == "prefill":
                # Every method decodes from the same exact prefill cache; cut it back afterwards
                # instead of deep-copying it per method (hundreds of MB at 8k).
                with _with_mode(sim, model, "prefill"):
                    pred = _greedy(model, tokenizer, first, shared.past_key_values, max_new_tokens * n_ans, n_ans,
                                   answer)
                _truncate(shared.past_key_values, len(s.prompt_ids))
            else:
                with _with_mode(sim, model, "decode"):
                    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                    pred = _greedy(model, tokenizer, int(out.logits[0, -1].argmax()), out.past_key_values,
                                   max_new_tokens * n_ans, n_ans, answer)
            res[name]["predictions"].append(pred)
            res[name]["per_sample"].append(string_match_all(pred, s.answers))
    for r in res.values():
        r["score"] = sum(r["per_sample"]) / len(r["per_sample"]) if r["per_sample"] else 0.0
    return res


def _last_digit_index(tokenizer, toks: list[int]) -> int:
    """Index of the last token of `toks` that holds a digit (-1 if none)."""
    last = -1
    for i, t in enumerate(toks):
        if any(ch.isdigit() for ch in tokenizer.decode([t])):
            last = i
    return last


@torch.no_grad()
def score_niah(model, tokenizer, samples: list[NiahSample], methods: dict[str, Optional[MixedCacheSimulator]],
               max_new_tokens: int = 12, progress: bool = True, on_sample=None, answer: str = "first_line") -> dict:
    """NIAH under each method: each method's own greedy answer (server semantics), as run_niah, in
    fewer model calls.

    Per sample: the prompt is prefilled once with the exact model (a one-chunk server prefill reads
    exact K/V, so the first answer token is the same for every method) and the exact model decodes
    its greedy answer (its score is the bf16 score). Each quantized method then reads that answer
    teacher-forced in one call, its queries seeing the INT2 history beyond the sink and recent
    windows. It *keeps* the sample when its argmax equals the exact answer at every position up to
    the answer's last digit: its greedy decode writes the same answer and scores what bf16 scores.
    Otherwise it greedily decodes on from its first differing token (the answer's rows stay in the
    BF16 window, as in a served decode), and that answer is scored: a method that writes the
    needle's values in another order or after another separator is not counted as a miss.

    answer: what is scored (ANSWER_RULES), the first line or the whole answer.

    Returns {name: dict(score, per_sample, kept, predictions, diverged_at, answer)}; diverged_at is the
    answer position of the first differing token (None when kept). on_sample(result so far) runs
    after every sample (a long run cut short keeps the samples it finished)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    _check_rule(answer)
    dev = next(model.parameters()).device
    res = {name: dict(score=0.0, per_sample=[], kept=[], predictions=[], diverged_at=[], answer=answer)
           for name in methods}
    for s in tqdm(samples, desc="niah", disable=not progress):
        n_ans = len(s.answers)  # max_new_tokens is per answer
        ids = torch.tensor([s.prompt_ids], device=dev)
        shared = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        first = int(shared.logits[0, -1].argmax())
        ref = _greedy_tokens(model, tokenizer, first, shared.past_key_values, max_new_tokens * n_ans, n_ans,
                             answer=answer)
        _truncate(shared.past_key_values, len(s.prompt_ids))
        text = _answer_text(tokenizer, ref, answer)
        ref_score = string_match_all(text, s.answers)
        last = _last_digit_index(tokenizer, ref)
        n0 = len(s.prompt_ids)
        for name, sim in methods.items():
            r = res[name]
            kept, at, own = True, None, text
            if sim is not None and last >= 1:  # else exact, or nothing after the first (exact) token to check
                if max(last, max_new_tokens * n_ans) > sim.recent:
                    # the answer's own rows must stay in the BF16 window, as in a real decode
                    raise ValueError(f"an answer of up to {max(last + 1, max_new_tokens * n_ans)} tokens does not "
                                     f"fit the recent window of {sim.recent}; lower max_new_tokens")
                inp = torch.tensor([ref[:last]], device=dev)
                with _with_mode(sim, model, "prefill"):
                    out = model(input_ids=inp, past_key_values=shared.past_key_values, use_cache=True)
                    pred = out.logits[0].argmax(-1).tolist()
                    diff = [j for j in range(last) if pred[j] != ref[j + 1]]
                    if diff:
                        # its own answer: ref[:at], then its token at `at` and its greedy decode from there
                        kept, at = False, diff[0] + 1
                        _truncate(shared.past_key_values, n0 + at)
                        own = _answer_text(tokenizer, _greedy_tokens(
                            model, tokenizer, pred[at - 1], shared.past_key_values, max_new_tokens * n_ans, n_ans,
                            prefix=ref[:at], answer=answer), answer)
                _truncate(shared.past_key_values, n0)
            r["kept"].append(kept)
            r["diverged_at"].append(at)
            r["per_sample"].append(ref_score if kept else string_match_all(own, s.answers))
            r["predictions"].append(own)
        for r in res.values():
            r["score"] = sum(r["per_sample"]) / len(r["per_sample"])
        if on_sample is not None:
            on_sample(res)
    return res
