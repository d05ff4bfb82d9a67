"""eval/: the mixed-cache simulator, perplexity, attention metrics and NIAH (tiny random Llama, CPU)."""

import re

import pytest
import torch

from sglang_oscar import quant
from sglang_oscar.eval.attention_metrics import attention_errors
from sglang_oscar.eval.niah import (NEEDLE, WORDS, NiahSample, make_samples, run_niah, score_niah,
                                    string_match_all)
from sglang_oscar.eval.ppl import perplexity
from sglang_oscar.eval.simulator import MixedCacheSimulator
from sglang_oscar.models import tiny_llama

torch.set_num_threads(1)
D = 64
TOL = 1e-4  # fp32 logits; reordering of sums only


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, q_heads=4, kv_heads=2, head_dim=D, seed=0)


def ids_of(n, seed=1):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def layers_for(kind, bits=2, group=32, clip=0.95, n=2, kv_heads=2):
    """Per-layer (K, V) quantizers. 'hadamard' also gives K a mean, per-head 'random' is non-orthogonal."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        if kind == "identity":
            mk = mv = torch.eye(D)
        elif kind == "hadamard":
            mk = mv = quant.hadamard_matrix(D).float()
        else:  # invertible, non-orthogonal, one per KV head: exercises T^{-T} and T^{-1}
            mk = torch.eye(D) + 0.1 * torch.randn(kv_heads, D, D, generator=g)
            mv = torch.eye(D) + 0.1 * torch.randn(kv_heads, D, D, generator=g)
        mean = None if kind == "identity" else torch.randn(D, generator=g)
        out.append((quant.SideQuantizer(matrix=mk, mean=mean, bits=bits, group=group, clip_ratio=clip),
                    quant.SideQuantizer(matrix=mv, bits=bits, group=group, clip_ratio=clip)))
    return out


def logits(model, ids, sim=None):
    with torch.no_grad():
        if sim is None:
            return model(ids).logits
        with sim.attach(model):
            return model(ids).logits


def stepwise(model, ids, prefill, sim=None):
    """Prefill `prefill` tokens in one call, then one token per call with a DynamicCache."""
    from transformers import DynamicCache

    outs = []
    cache = DynamicCache()
    ctx = sim.attach(model) if sim is not None else None
    with torch.no_grad():
        if ctx:
            ctx.__enter__()
        try:
            out = model(ids[:, :prefill], past_key_values=cache, use_cache=True)
            outs.append(out.logits)
            for i in range(prefill, ids.shape[1]):
                out = model(ids[:, i : i + 1], past_key_values=out.past_key_values, use_cache=True)
                outs.append(out.logits)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------------- simulator
@pytest.mark.parametrize("kind", ["identity", "hadamard", "random"])
def test_simulator_exact_when_windows_cover_everything(model, kind):
    ids = ids_of(48)
    ref = logits(model, ids)
    sim = MixedCacheSimulator(layers_for(kind), sink=16, recent=32, mode="decode", block=10)
    assert (logits(model, ids, sim) - ref).abs().max() < TOL
    # step by step with a cache (T = 1 per call, the whole cache re-sent each step)
    assert (stepwise(model, ids, 20, sim) - ref).abs().max() < TOL


def test_identity_and_hadamard_agree_when_nothing_quantized(model):
    ids = ids_of(40, seed=3)
    a = logits(model, ids, MixedCacheSimulator(layers_for("identity"), sink=8, recent=40))
    b = logits(model, ids, MixedCacheSimulator(layers_for("hadamard"), sink=8, recent=40))
    assert (a - b).abs().max() < TOL


def test_quantized_history_changes_logits_int4_much_smaller(model):
    ids = ids_of(96)
    ref = logits(model, ids)
    err = {}
    for bits in (2, 4):
        # clip 1.0: clipping error does not shrink with more bits and would blur the comparison
        sim = MixedCacheSimulator(layers_for("hadamard", bits=bits, clip=1.0), sink=4, recent=8)
        out = logits(model, ids, sim)
        # positions before sink + recent have no quantized history: still exact
        assert (out[:, :12] - ref[:, :12]).abs().max() < TOL
        err[bits] = (out[:, 12:] - ref[:, 12:]).abs().mean().item()
    assert err[2] > 1e-3
    assert err[4] < 0.35 * err[2], err  # 4 bits: ~1/5 of the INT2 step; allow slack


def test_exact_layer_entries_and_block_size_invariance(model):
    ids = ids_of(64, seed=5)
    lay = layers_for("hadamard")
    base = logits(model, ids, MixedCacheSimulator(lay, sink=4, recent=8, block=512))
    assert (logits(model, ids, MixedCacheSimulator(lay, sink=4, recent=8, block=7)) - base).abs().max() < TOL
    # None layers are exact: all-None == the plain model
    assert (logits(model, ids, MixedCacheSimulator([None, None], sink=4, recent=8)) - logits(model, ids)).abs().max() < TOL
    half = logits(model, ids, MixedCacheSimulator([lay[0], None], sink=4, recent=8))
    assert (half - base).abs().max() > 1e-3


def test_decode_mode_teacher_forced_equals_step_by_step(model):
    """Teacher-forced "decode" == a real decode loop in server ("prefill") semantics with T = 1."""
    ids = ids_of(60, seed=2)
    lay = layers_for("random")
    tf = logits(model, ids, MixedCacheSimulator(lay, sink=4, recent=8, mode="decode"))
    st = stepwise(model, ids, 1, MixedCacheSimulator(lay, sink=4, recent=8, mode="prefill"))
    assert (tf - st).abs().max() < TOL


def test_prefill_mode_single_chunk_exact_then_decode_quantized(model):
    ids = ids_of(70, seed=4)
    ref = logits(model, ids)
    sim = MixedCacheSimulator(layers_for("hadamard"), sink=4, recent=8, mode="prefill")
    out = stepwise(model, ids, 50, sim)
    assert (out[:, :50] - ref[:, :50]).abs().max() < TOL  # one-chunk prefill reads exact K/V
    assert (out[:, 50:] - ref[:, 50:]).abs().max() > 1e-3  # decode reads the quantized history


def test_chunk_mode_matches_chunked_prefill_calls(model):
    ids = ids_of(64, seed=6)
    lay = layers_for("hadamard")
    C = 16
    one_call = logits(model, ids, MixedCacheSimulator(lay, sink=2, recent=4, mode=C))
    ref = logits(model, ids)
    assert (one_call[:, :C] - ref[:, :C]).abs().max() < TOL  # the first chunk is fully exact
    assert (one_call[:, C:] - ref[:, C:]).abs().max() > 1e-3
    # the same thing as the server does it: one forward call per chunk in "prefill" semantics
    from transformers import DynamicCache

    sim = MixedCacheSimulator(lay, sink=2, recent=4, mode="prefill")
    cache, parts = DynamicCache(), []
    with torch.no_grad(), sim.attach(model):
        for a in range(0, 64, C):
            out = model(ids[:, a : a + C], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            parts.append(out.logits)
    assert (torch.cat(parts, 1) - one_call).abs().max() < TOL
    # a chunk as long as the sequence is a single exact prefill
    assert (logits(model, ids, MixedCacheSimulator(lay, sink=2, recent=4, mode=64)) - ref).abs().max() < TOL


def test_simulator_inside_generate(model):
    ids = ids_of(30, seed=8)
    sim = MixedCacheSimulator(layers_for("hadamard"), sink=64, recent=256, mode="prefill")
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False)
        with sim.attach(model):
            simulated = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, simulated)  # windows cover everything: identical greedy tokens


def test_simulator_bad_input(model):
    with pytest.raises(ValueError):
        MixedCacheSimulator([None, None], mode="chunky")
    with pytest.raises(ValueError):
        MixedCacheSimulator([None, None], mode=0)
    with pytest.raises(TypeError):
        MixedCacheSimulator([("k", "v"), None])
    with pytest.raises(ValueError):
        with MixedCacheSimulator([None]).attach(model):
            pass
    k, _ = layers_for("hadamard")[0]
    with pytest.raises(ValueError):
        MixedCacheSimulator([(k, k), None])  # V quantizer with a mean


def test_simulator_state_rebuilds_for_a_new_sequence(model):
    """Reusing a simulator on a different sequence without reset() must not reuse stale rows."""
    lay = layers_for("hadamard")
    sim = MixedCacheSimulator(lay, sink=4, recent=8)
    a, b = ids_of(40, seed=11), ids_of(40, seed=12)
    fresh = logits(model, b, MixedCacheSimulator(lay, sink=4, recent=8))
    with torch.no_grad(), sim.attach(model):
        model(a)
        again = model(b).logits
    assert (again - fresh).abs().max() < TOL


# -------------------------------------------------------------------------------------- ppl
def test_perplexity(model):
    wins = [ids_of(40, seed=s)[0].tolist() for s in (1, 2)]
    exact = perplexity(model, wins, progress=False)
    with torch.no_grad():
        x = torch.tensor([wins[0]])
        nll = torch.nn.functional.cross_entropy(model(x).logits[0, :-1], x[0, 1:])
    assert abs(exact["per_window"][0] - nll.exp().item()) < 1e-3 * exact["per_window"][0]
    assert abs(exact["mean"] - sum(exact["per_window"]) / 2) < 1e-9
    assert exact["min"] <= exact["mean"] <= exact["max"]
    covered = perplexity(model, wins, sim=MixedCacheSimulator(layers_for("hadamard"), sink=8, recent=40), progress=False)
    assert abs(covered["mean"] - exact["mean"]) < 1e-4 * exact["mean"]
    q2 = perplexity(model, wins, sim=MixedCacheSimulator(layers_for("hadamard"), sink=2, recent=4), progress=False)
    assert q2["mean"] != pytest.approx(exact["mean"], rel=1e-4)
    with pytest.raises(ValueError):
        perplexity(model, [[1]], progress=False)


# ---------------------------------------------------------------------------- attention errors
def test_attention_errors(model):
    wins = [ids_of(80, seed=s)[0].tolist() for s in (1, 2)]
    methods = {"exact": None, "int4": layers_for("hadamard", bits=4, clip=1.0),
               "int2": layers_for("hadamard", bits=2, clip=1.0),
               "half": [layers_for("hadamard", bits=2, clip=1.0)[0], None]}
    r = attention_errors(model, wins, methods, sink=4, recent=8, max_queries=20, progress=False)
    assert r["exact"]["kl_mean"] == 0.0 and r["exact"]["relmse_mean"] == 0.0
    for name in ("int4", "int2"):
        assert all(v > 0 for v in r[name]["kl_per_layer"]) and all(v > 0 for v in r[name]["relmse_per_layer"])
    assert r["int4"]["kl_mean"] < 0.2 * r["int2"]["kl_mean"]
    assert r["int4"]["relmse_mean"] < 0.2 * r["int2"]["relmse_mean"]
    assert r["half"]["kl_per_layer"][1] == 0.0 and r["half"]["kl_per_layer"][0] == pytest.approx(r["int2"]["kl_per_layer"][0])
    # all-exact layers give exactly 0; a per-head non-orthogonal transform runs through the same path
    more = attention_errors(model, wins, {"none": [None, None], "random": layers_for("random")}, sink=4, recent=8,
                            max_queries=20, progress=False)
    assert more["none"]["kl_mean"] == 0.0 and more["none"]["relmse_mean"] == 0.0
    assert 0 < more["random"]["kl_mean"] < 10 and 0 < more["random"]["relmse_mean"] < 10
    with pytest.raises(ValueError):
        attention_errors(model, [wins[0][:10]], methods, sink=4, recent=8, progress=False)


# -------------------------------------------------------------------------------------- NIAH
class ByteTokenizer:
    """One token per byte (ids 0..255) + EOS 256: fits the tiny model's 512-token vocabulary."""

    eos_token_id = 256
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2"])
def test_niah_samples_length_needle_determinism(task):
    tok = ByteTokenizer()
    length = 1500
    s = make_samples(tok, task, length, 3, seed=5)
    for x in s:
        n = len(x.prompt_ids)
        assert abs(n - (length - 32)) <= 0.02 * length and n <= length - 32
        text = tok.decode(x.prompt_ids)
        assert NEEDLE.format(key=x.query, value=x.answers[0]) in text
        assert text.count(x.answers[0]) == 1 and len(x.answers[0]) == 7
        assert text.endswith(f"The special magic number for {x.query} mentioned in the provided text is")
        assert 0.0 <= x.depth <= 1.0
    if task == "niah_multikey_2":
        assert text.count("One of the special magic numbers for") > 10  # haystack made of needles
        assert text.count(f"for {x.query} is") == 1
    again = make_samples(tok, task, length, 3, seed=5)
    assert [x.prompt_ids for x in again] == [x.prompt_ids for x in s]
    other = make_samples(tok, task, length, 3, seed=6)
    assert [x.prompt_ids for x in other] != [x.prompt_ids for x in s]
    assert len({x.answers[0] for x in s}) == 3
    # a later range extends an earlier run with the samples one longer run would have made
    tail = make_samples(tok, task, length, 2, seed=5, first=1)
    assert [x.prompt_ids for x in tail] == [x.prompt_ids for x in s[1:]]
    with pytest.raises(ValueError):
        make_samples(tok, task, length, 1, seed=5, first=-1)
    with pytest.raises(ValueError):
        make_samples(tok, "niah_bogus", length, 1)
    with pytest.raises(ValueError):
        make_samples(tok, task, 100, 1)  # shorter than the template


def test_niah_words():
    assert len(set(WORDS)) >= 200 and all(w.isalpha() and w.islower() for w in WORDS)


def test_niah_real_tokenizer_lengths():
    from sglang_oscar.models import smollm2_gguf_path

    try:
        p = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("SmolLM2 GGUF not installed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    for task in ("niah_single_1", "niah_multikey_2", "niah_essay_single"):
        for chat in (False, True):
            for x in make_samples(tok, task, 4096, 2, seed=1, chat=chat):
                assert abs(len(x.prompt_ids) - 4064) <= 0.02 * 4096, (task, chat, len(x.prompt_ids))
                assert x.answers[0] in tok.decode(x.prompt_ids)


def test_niah_multikey_1_and_multivalue_samples():
    tok = ByteTokenizer()
    for x in make_samples(tok, "niah_multikey_1", 1500, 3, seed=2):
        text = tok.decode(x.prompt_ids)
        assert len(x.answers) == 1 and text.count(x.answers[0]) == 1
        assert text.count("One of the special magic numbers for") == 4  # the needle + 3 distractors
        assert text.count(f"for {x.query} is") == 1
        assert "The grass is green." in text  # a noise haystack, not one made of needles
    for x in make_samples(tok, "niah_multivalue", 1500, 3, seed=2):
        text = tok.decode(x.prompt_ids)
        assert len(x.answers) == 4 and len(set(x.answers)) == 4
        assert all(text.count(v) == 1 for v in x.answers)
        assert text.count(f"for {x.query} is") == 4
        assert text.endswith(f"The special magic numbers for {x.query} mentioned in the provided text are")
        assert len(x.prompt_ids) <= 1500 - 4 * 32  # room for four answers
    # the single-needle task is unchanged by the new tasks (same samples for the same seed)
    a = make_samples(tok, "niah_single_1", 1500, 2, seed=9)
    assert a[0].answers[0] in tok.decode(a[0].prompt_ids) and len(a[0].answers) == 1


def test_niah_unseen_formats_prose_haystack_and_other_needle():
    from sglang_oscar.data import eval_text
    from sglang_oscar.eval.niah import UNSEEN_TASKS

    tok = ByteTokenizer()
    flat = " ".join(eval_text().split())
    for task in UNSEEN_TASKS:
        multi = task == "niah_essay_multivalue"
        s = make_samples(tok, task, 1500, 3, seed=4)
        for x in s:
            text = tok.decode(x.prompt_ids)
            assert len(x.answers) == (4 if multi else 1) and len(set(x.answers)) == len(x.answers)
            assert all(len(v) == 7 and v.isdigit() for v in x.answers)
            assert all(f"The access code for the {x.query} room is {v}." in text for v in x.answers)
            assert "special magic" not in text and "The grass is green." not in text
            assert text.endswith(f"The access codes for the {x.query} room are the numbers" if multi
                                 else f"The access code for the {x.query} room is")
            # the haystack is the Language Reference's own prose: a stretch of it between the header and the needles
            body = text.split("\n")[1]
            pieces = re.split(r"The access code for the \w+ room is \d{7}\.", body)
            stretch = next(p for p in pieces if len(p) > 200)[:150].strip()
            assert stretch in flat
            gap = 1500 - 32 * len(x.answers) - len(x.prompt_ids)
            assert 0 <= gap <= 400  # at most about one unit of the haystack short of the target
        # samples start at different places of the text, deterministically
        assert len({tok.decode(x.prompt_ids)[200:300] for x in s}) == 3
        assert [x.prompt_ids for x in make_samples(tok, task, 1500, 3, seed=4)] == [x.prompt_ids for x in s]


class DigitTokenizer(ByteTokenizer):
    """Every id decodes to a digit: the tiny random model 'answers' in digits, so the teacher-forced
    check covers every answer position."""

    eos_token_id = 10_000  # outside the tiny model's vocabulary: answers run to max_new_tokens

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"{i:03d}" for i in ids)  # injective: equal text <=> equal tokens


class LineDigitTokenizer(DigitTokenizer):
    """DigitTokenizer whose ids divisible by 83 also start a new line: answers span lines (the tiny model's
    answers use ids 495 and 249 = 3 x 83: the exact answer stays on one line, the lossy caches' break)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(("\n" if i % 83 == 0 else "") + f"{i:03d}" for i in ids)


@pytest.mark.parametrize("answer", ["first_line", "whole"])
def test_score_niah_scores_each_methods_own_greedy_answer(model, answer):
    """score_niah is run_niah in fewer calls: every method's answer and score equal its own greedy
    decode's, kept <=> that answer equals bf16's, and a diverged answer is decoded on, not zeroed; under
    either answer rule (the first line, or every line)."""
    tok = LineDigitTokenizer()
    samples = make_samples(ByteTokenizer(), "niah_single_1", 400, 6, seed=3)
    lay = layers_for("identity", clip=0.5)
    methods = {"exact": None, "covered": MixedCacheSimulator(lay, sink=64, recent=512),
               "int2": MixedCacheSimulator(lay, sink=4, recent=8),
               "int2_tight": MixedCacheSimulator(lay, sink=0, recent=6)}
    greedy = run_niah(model, tok, samples, methods, max_new_tokens=6, progress=False, answer=answer)
    fast = score_niah(model, tok, samples, methods, max_new_tokens=6, progress=False, answer=answer)
    preds = [p for name in methods for p in fast[name]["predictions"]]
    assert all(fast[name]["answer"] == greedy[name]["answer"] == answer for name in methods)
    if answer == "whole":  # some answers run past a line break, and are scored whole
        assert any("\n" in p.strip("\n") for p in preds)
    else:
        assert not any("\n" in p for p in preds)
    for name in methods:
        for i in range(len(samples)):
            same = greedy[name]["predictions"][i] == greedy["exact"]["predictions"][i]
            assert fast[name]["kept"][i] == same, (name, i)
            assert fast[name]["predictions"][i] == greedy[name]["predictions"][i], (name, i)
            assert fast[name]["per_sample"][i] == greedy[name]["per_sample"][i], (name, i)
            assert (fast[name]["diverged_at"][i] is None) == same
    assert all(fast["covered"]["kept"]) and all(fast["exact"]["kept"])
    assert not all(fast["int2_tight"]["kept"])  # a cache this lossy changes some answers
    with pytest.raises(ValueError, match="recent window"):  # answers must stay inside the BF16 window
        score_niah(model, tok, samples[:1], {"w": MixedCacheSimulator(lay, sink=0, recent=2)}, max_new_tokens=6,
                   progress=False)
    # a sample whose answer the exact model writes scores 100 for every method that keeps it
    fake = NiahSample(prompt_ids=samples[0].prompt_ids, answers=[greedy["exact"]["predictions"][0]],
                      task="niah_single_1", length=400, depth=0.5)
    r = score_niah(model, tok, [fake], methods, max_new_tokens=6, progress=False, answer=answer)
    assert r["exact"]["score"] == 100.0 and r["covered"]["score"] == 100.0
    with pytest.raises(ValueError, match="answer must be one of"):
        score_niah(model, tok, [fake], methods, max_new_tokens=6, progress=False, answer="last_line")
    with pytest.raises(ValueError, match="answer must be one of"):
        run_niah(model, tok, [fake], methods, max_new_tokens=6, progress=False, answer="all")


def test_string_match_all():
    assert string_match_all(" 1234567.", ["1234567"]) == 100.0
    assert string_match_all("nothing here", ["1234567"]) == 0.0
    assert string_match_all("1111111 and 3333333", ["1111111", "2222222", "3333333", "4444444"]) == 50.0
    assert string_match_all("The Key is ALPHA-beta", ["alpha-BETA"]) == 100.0
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_run_niah_end_to_end(model):
    tok = ByteTokenizer()
    samples = make_samples(tok, "niah_single_1", 400, 2, seed=0)
    lay = layers_for("hadamard")
    methods = {"exact": None, "covered": MixedCacheSimulator(lay, sink=64, recent=512),
               "int2": MixedCacheSimulator(lay, sink=4, recent=8)}
    r = run_niah(model, tok, samples, methods, max_new_tokens=5, progress=False)
    for name in methods:
        assert len(r[name]["per_sample"]) == 2 and len(r[name]["predictions"]) == 2
        assert all(0.0 <= v <= 100.0 for v in r[name]["per_sample"]) and 0.0 <= r[name]["score"] <= 100.0
        assert all(isinstance(p, str) and "\n" not in p for p in r[name]["predictions"])
    assert r["covered"]["predictions"] == r["exact"]["predictions"]
    # methods share one prefill cache, cut back after each: order must not matter
    rev = run_niah(model, tok, samples, dict(reversed(list(methods.items()))), max_new_tokens=5, progress=False)
    assert all(rev[n]["predictions"] == r[n]["predictions"] for n in methods)
    alone = run_niah(model, tok, samples, {"int2": methods["int2"]}, max_new_tokens=5, progress=False)
    assert alone["int2"]["predictions"] == r["int2"]["predictions"]
    # a sample whose answer the prediction contains scores 100
    fake = NiahSample(prompt_ids=samples[0].prompt_ids, answers=[r["exact"]["predictions"][0].strip() or "x"],
                      task="niah_single_1", length=400, depth=0.5)
    if fake.answers[0] != "x":
        assert run_niah(model, tok, [fake], {"exact": None}, max_new_tokens=5, progress=False)["exact"]["score"] == 100.0
    stress = run_niah(model, tok, samples[:1], {"exact": None, "int2": methods["int2"]}, max_new_tokens=5,
                      progress=False, prompt_mode="decode")
    assert stress["exact"]["predictions"] == r["exact"]["predictions"][:1]
    assert methods["int2"].mode == "decode"  # the stress run restores the simulator's own mode
    with pytest.raises(ValueError):
        run_niah(model, tok, samples, methods, prompt_mode="sideways")


def test_attention_errors_match_brute_force(model):
    """Layer 0 metrics vs a dense, independent computation from the captured q/k/v (identity T, no mean)."""
    from sglang_oscar.hf_attention import attention_override, causal_attention

    w = ids_of(40, seed=9)[0].tolist()
    sink, recent = 3, 6
    lay = layers_for("identity", bits=2, clip=1.0)
    got = attention_errors(model, [w], {"m": lay}, sink=sink, recent=recent, max_queries=None, progress=False)["m"]
    seen = {}

    def capture(module, q, k, v, scaling=None):
        seen.setdefault(module.layer_idx, (q.float(), k.float(), v.float(), scaling))
        return causal_attention(q, k, v, scaling, module.num_key_value_groups)

    with torch.no_grad(), attention_override(model, capture):
        model(torch.tensor([w]))
    q, k, v, scaling = seen[0]
    kq, vq = lay[0][0].fake_transformed(k), lay[0][1].fake_transformed(v)
    G = q.shape[1] // k.shape[1]
    kl_vals, num, den = [], 0.0, 0.0
    for i in range(sink + recent, len(w)):
        for h in range(q.shape[1]):
            kv = h // G
            kk = torch.stack([kq[0, kv, j] if (j >= sink and i - j >= recent) else k[0, kv, j] for j in range(i + 1)])
            vv = torch.stack([vq[0, kv, j] if (j >= sink and i - j >= recent) else v[0, kv, j] for j in range(i + 1)])
            pe = torch.softmax(q[0, h, i] @ k[0, kv, : i + 1].T * scaling, -1)
            pm = torch.softmax(q[0, h, i] @ kk.T * scaling, -1)
            kl_vals.append(float((pe * (pe.log() - pm.log())).sum()))
            oe, om = pe @ v[0, kv, : i + 1], pm @ vv
            num += float(((om - oe) ** 2).sum())
            den += float((oe**2).sum())
    assert got["kl_per_layer"][0] == pytest.approx(sum(kl_vals) / len(kl_vals), rel=1e-3)
    assert got["relmse_per_layer"][0] == pytest.approx(num / den, rel=1e-3)


def test_decode_fast_path_equals_blocked_mixed_attention():
    """The flash-attention fast path (whole sequence, decode semantics) == the generic blocked path."""
    from sglang_oscar.eval.simulator import chunk_starts, decode_full_sequence, mixed_attention, quantized_mask

    torch.manual_seed(7)
    B, Hkv, G, T, D, sink, recent = 1, 2, 3, 301, 16, 5, 37
    qt = torch.randn(B, Hkv, G, T, D)
    ke, ve = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    kq, vq = ke + 0.3 * torch.randn_like(ke), ve + 0.3 * torch.randn_like(ve)
    qpos = torch.arange(T)
    quant = quantized_mask(qpos, T, sink, recent, chunk_starts(qpos, "decode", 0))
    ref = mixed_attention(qt, ke, ve, kq, vq, qpos, quant, 0.25)
    rep = lambda x: x.repeat_interleave(G, dim=1)  # noqa: E731
    fast = decode_full_sequence(qt.reshape(B, Hkv * G, T, D), rep(ke), rep(ve), rep(kq), rep(vq), sink, recent, 0.25)
    assert torch.allclose(fast.reshape(B, Hkv, G, T, D), ref, atol=2e-5)


def test_perplexity_prefix_equals_shorter_window():
    """PPL of a window's first n tokens (same forward) == PPL of the n-token window (causality)."""
    from sglang_oscar.eval.ppl import perplexity
    from sglang_oscar.models import tiny_llama

    torch.manual_seed(5)
    model = tiny_llama()
    w = torch.randint(0, 512, (80,)).tolist()
    r = perplexity(model, [w], progress=False, prefixes=(33,))
    short = perplexity(model, [w[:33]], progress=False)
    assert abs(r["prefix"][33]["mean"] - short["mean"]) < 1e-4 * short["mean"]
