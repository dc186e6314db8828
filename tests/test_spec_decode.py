"""Speculative decoding in the engine (CPU backend): greedy jobs give exactly the tokens of plain decoding with
n-gram drafts and with SmolLM2 drafting for itself; sampled output follows the target's distribution (a chi-square
test against probabilities computed from the model's own logits, with a draft model of another distribution);
n-gram sampled jobs reproduce plain decoding for the same seed; seeded draft-model jobs do not depend on their
neighbours; mixed batches (speculative, plain, constrained, cancelled, preempted) return every page of both caches;
the adaptive draft length stops a draft that never agrees from costing rows; option errors. Constrained jobs
speculate under their grammar (a synthetic rule through the engine's DraftMaskFn, and llguidance JSON schemas through
Constraint.draft_masks): greedy and seeded n-gram jobs give plain constrained decoding's tokens, a sampled draft model
the masked target's distribution (chi-square)."""

from __future__ import annotations

import json

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp.errors import InvalidArgumentError

torch = pytest.importorskip("torch")
from test_models_hf import make_hf_model

VOCAB = 211  # the tiny models of test_models_hf

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci_memo(n, memo={}):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time, in a small village,",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "<html>\n<head>\n<title>Test</title>\n</head>\n<body>\n",
    "Translate to French: I love cheese.",
    "import numpy as np\nimport",
    "Monday, Tuesday, Wednesday,",
    "The three primary colors are",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "Water boils at",
    "A B C D E F G",
    "SELECT name, age FROM users WHERE",
    "My favourite book is",
    "red, green, blue, red, green,",
    "The sun rises in the",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Point3:\n",
    "Dear Sir or Madam,",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz =",
    "The mitochondria is the",
]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return exl2cpp.load(smollm2_dir, max_seq_len=1024)


@pytest.fixture(scope="module")
def smol_draft(smollm2_dir):
    return exl2cpp.load(smollm2_dir, max_seq_len=1024)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random llama (the target) and a draft: the same weights plus noise, so its distribution q overlaps the
    target's p without equalling it."""
    target_dir = tmp_path_factory.mktemp("spec_target")
    draft_dir = tmp_path_factory.mktemp("spec_draft")
    hf = make_hf_model("llama", {"max_position_embeddings": 512}, target_dir, seed=3)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    hf.save_pretrained(draft_dir, safe_serialization=True)
    return exl2cpp.load(target_dir), exl2cpp.load(draft_dir)


@pytest.fixture(scope="module")
def tiny_other(tmp_path_factory):
    """A tiny random llama of the same vocabulary and other weights: a draft that (almost) never agrees."""
    folder = tmp_path_factory.mktemp("spec_other")
    make_hf_model("llama", {"max_position_embeddings": 512}, folder, seed=99)
    return exl2cpp.load(folder)


def greedy(**kw):
    return _C.SamplerSettings(temperature=0.0, **kw)


def run(core, jobs, cancel_after=None, ruled=(), grammar=None):
    """Submit jobs [(prompt, kwargs)] at once, step until idle; returns ({index: tokens}, {index: reason}).
    cancel_after: {index: step} cancels that job before that step. The jobs of indices `ruled` follow RULE (below:
    a token mask set between steps, as the Python layer does); `grammar` (a RuleGrammar) is the core's DraftMaskFn
    when given."""
    if grammar is not None:
        core.set_draft_masks(grammar)
    grammar = grammar or RuleGrammar()
    ids = {}
    for i, (p, kw) in enumerate(jobs):
        jid = core.submit(p, **kw, **({"token_mask": RULE[p[-1]]} if i in ruled else {}))
        ids[jid] = i
        grammar.last[jid] = p[-1]
    toks = {i: [] for i in range(len(jobs))}
    reasons = {}
    step = 0
    while not core.idle:
        for jid, i in list(ids.items()):
            if cancel_after and cancel_after.get(i) == step:
                core.cancel(jid)
        for jid, token, _lp, _top, finished, reason, error in core.step():
            assert not error, error
            if token >= 0:
                toks[ids[jid]].append(token)
                grammar.last[jid] = token
                if ids[jid] in ruled and not finished:
                    core.set_token_mask(jid, RULE[token])
            if finished:
                reasons[ids[jid]] = reason
        step += 1
        assert step < 20000
    return toks, reasons


def _rule_masks():
    """A synthetic grammar over the tiny vocabulary: after token t only the ids i with (7 i + t) % 5 < 2 may follow."""
    out = []
    for t in range(VOCAB):
        m = [0] * ((VOCAB + 31) // 32)
        for i in range(VOCAB):
            if (7 * i + t) % 5 < 2:
                m[i >> 5] |= 1 << (i & 31)
        out.append(m)
    return out


RULE = _rule_masks()


def allowed(mask, t):
    return bool(mask[t >> 5] >> (t & 31) & 1)


class RuleGrammar:
    """The DraftMaskFn of RULE: the masks after each draft, stopping at the first the rule forbids."""

    def __init__(self):
        self.last = {}  # job id -> its last token
        self.calls = self.refused = 0

    def __call__(self, job_id, drafts):
        self.calls += 1
        masks, prev = [], RULE[self.last[job_id]]
        for d in drafts:
            if not allowed(prev, d):
                self.refused += 1
                break
            prev = RULE[d]
            masks.append(prev)
        return masks


class RuleGrammarLateMasks(RuleGrammar):
    """RULE, but no masks for a single draft: with draft_tokens=2 a draft model then proposes its second draft without
    a mask (so the verify step meets a draft of unmasked q that RULE may forbid), and a one-draft row ends at its
    first position (a mask function that refuses what its mask allows)."""

    def __call__(self, job_id, drafts):
        return [] if len(drafts) == 1 else super().__call__(job_id, drafts)


def pages_all_back(core, free0, dfree0=None):
    core.clear_prefix_cache()
    s = core.stats()
    assert s["pages_free"] == free0 == s["pages_total"] and s["pages_reserved"] == 0
    if dfree0 is not None:
        assert s["draft_pages_free"] == dfree0 == s["draft_pages_total"]


# ---- greedy equality on SmolLM2 --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_plain(smol):
    tok = smol.tokenizer
    jobs = [(tok.encode(p), {"max_new_tokens": 24, "sampler": greedy()}) for p in PROMPTS]
    core = _C.Engine(smol._core, cache_tokens=8192, page_size=16)
    toks, reasons = run(core, jobs)
    return jobs, toks, reasons


def test_smollm2_greedy_ngram_equals_plain(smol, smol_plain):
    jobs, want, why = smol_plain
    assert len(jobs) >= 20
    core = _C.Engine(smol._core, cache_tokens=8192, page_size=16, ngram_draft=True, draft_tokens=4)
    free0 = core.stats()["pages_free"]
    toks, reasons = run(core, jobs)
    assert toks == want and reasons == why
    s = core.stats()
    assert s["spec_accepted"] > 0 and s["spec_proposed"] >= s["spec_accepted"]
    pages_all_back(core, free0)


def test_smollm2_greedy_self_draft_equals_plain(smol, smol_draft, smol_plain):
    jobs, want, why = smol_plain
    core = _C.Engine(smol._core, cache_tokens=8192, page_size=16, draft_model=smol_draft._core, draft_tokens=4)
    s0 = core.stats()
    toks, reasons = run(core, jobs)
    assert toks == want and reasons == why
    s = core.stats()
    # The same weights: nearly every draft is the target's token (ties of near-equal logits aside).
    assert s["spec_accepted"] > 0.9 * s["spec_proposed"] > 0
    assert s["draft_steps"] > 0 and s["steps"] < 24 / 3
    pages_all_back(core, s0["pages_free"], s0["draft_pages_free"])


def test_smollm2_python_api(smol, smol_draft):
    """Engine(ngram_draft=True) and Model.generate(draft_model=...) give plain decoding's text; per-job counts."""
    prompt = PROMPTS[1]
    want = smol.generate(prompt, max_new_tokens=20, temperature=0.0)
    with exl2cpp.Engine(smol, cache_tokens=4096, ngram_draft=True, ngram_sizes=[3, 2]) as eng:
        job = eng.submit(prompt, max_new_tokens=20, temperature=0.0)
        assert job.result() == want
        assert job.spec_accepted > 0 and job.spec_proposed >= job.spec_accepted
        assert eng.stats()["spec_accepted"] == job.spec_accepted
    got = smol.generate(prompt, max_new_tokens=20, temperature=0.0, draft_model=smol_draft, draft_tokens=3)
    assert got == want
    assert "".join(smol.stream(prompt, max_new_tokens=20, temperature=0.0, ngram_draft=True)) == want


def test_smollm2_stop_and_banned_strings_with_drafts(smol):
    """Stop strings cut where plain decoding cuts; banned-string rewinds drop the rest of a speculative step."""
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    kw = dict(max_new_tokens=30, temperature=0.0)
    with exl2cpp.Engine(smol, cache_tokens=4096) as plain, exl2cpp.Engine(
        smol, cache_tokens=4096, ngram_draft=True, ngram_sizes=[2, 1]
    ) as spec:
        for extra in ({"stop": [" 13"]}, {"banned_strings": [" 12"]}, {"stop": ["15"], "banned_strings": ["1"]}):
            a, b = plain.submit(prompt, **kw, **extra), spec.submit(prompt, **kw, **extra)
            assert b.result() == a.result() and b.finish_reason == a.finish_reason, extra
            assert b.token_ids == a.token_ids
        assert spec.stats()["spec_accepted"] > 0


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
JSON_PROMPTS = [
    "Give me a JSON record for Alice, 30, tags a b c: ",
    "Person as JSON: name Bob, age 41, tags x y: ",
    "Write a JSON object about a cat called Tom aged 3 with tags grey and lazy.\n",
    "JSON for the user carol (age 25, tags: admin):",
    "Output JSON. name=Dave age=52 tags=[golf, chess]\n",
    "Describe Eve as JSON (age 19, no tags): ",
]


@pytest.fixture(scope="module")
def json_grammar(smol):
    pytest.importorskip("llguidance")
    from exl2cpp.server.grammar import GrammarFactory

    tok = smol.tokenizer
    return GrammarFactory(tok._json, tok.vocab_size, tok.eos_ids).json_schema(SCHEMA)


def test_json_constraint_draft_masks_are_advance_masks(smol, json_grammar):
    """Constraint.draft_masks gives what advance gives token by token, leaves the constraint as it was, stops at the
    first token its grammar refuses, and advance reuses its masks."""
    tok = smol.tokenizer
    ids = tok.encode('{"name":"Al","age":3,"tags":["x"]}', add_bos=False)
    ref = json_grammar.constraint()
    first = ref.mask()
    want = [ref.advance(t) for t in ids]
    c = json_grammar.constraint()
    assert c.mask() == first
    assert c.draft_masks(ids) == want
    assert c.mask() == first and c.draft_masks(ids[:3]) == want[:3]
    bad = tok.encode("{{", add_bos=False)
    assert c.draft_masks(ids[:2] + bad) == want[:2]  # "{" then "{" is not JSON
    c.draft_masks(ids)
    assert [c.advance(t) for t in ids] == want and not c._ahead
    assert c.done


def _json_run(eng, grammar, sampling):
    jobs = [eng.submit(p, max_new_tokens=48, constraint=grammar.constraint(), **sampling) for p in JSON_PROMPTS]
    for j in jobs:
        j.result()
    return [(j.token_ids, j.finish_reason) for j in jobs], jobs


def test_smollm2_json_schema_jobs_speculate_and_equal_plain(smol, smol_draft, json_grammar):
    """Greedy JSON-schema jobs give plain constrained decoding's tokens with n-gram drafts and with SmolLM2 drafting
    for itself (many drafts accepted), seeded ones with n-gram drafts too; every page of both caches returns."""
    for sampling in ({"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9, "seed": 5}):
        with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16) as eng:
            want, _ = _json_run(eng, json_grammar, sampling)
        ended = [t for t, why in want if why == "stop_token"]
        assert ended and all(json.loads(smol.tokenizer.decode(t[:-1])) for t in ended)
        for opts in ({"ngram_draft": True, "ngram_sizes": [2, 1]}, {"draft_model": smol_draft}):
            if "draft_model" in opts and sampling["temperature"] > 0:
                continue  # a sampled draft model keeps the distribution, not the tokens (the chi-square test above)
            with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16, **opts) as eng:
                got, jobs = _json_run(eng, json_grammar, sampling)
                assert got == want, (opts, sampling)
                s = eng.stats()
                assert s["spec_proposed"] > 0 and sum(j.spec_proposed for j in jobs) == s["spec_proposed"]
                if "draft_model" in opts:
                    assert s["spec_accepted"] > 0.5 * s["spec_proposed"], s
                pages_all_back(eng._core, s["pages_total"], s["draft_pages_total"] if "draft_model" in opts else None)


def test_smollm2_mixed_python_jobs_with_drafts(smol, smol_draft, json_grammar):
    """One engine with speculative, plain (speculate=False), JSON-constrained, cancelled and stop-string jobs: each
    gives plain decoding's tokens (a stop string ends the job at the token that completes it, the rest of its
    accepted drafts never shown), and every page of both caches returns."""
    kinds = ["spec", "plain", "json", "cancel", "stop", "json", "spec", "stop"]
    prompts = PROMPTS[:8]

    def submit(eng, i, kind):
        kw = {"max_new_tokens": 30, "temperature": 0.0}
        if kind == "plain":
            kw["speculate"] = False
        if kind == "json":
            return eng.submit(JSON_PROMPTS[i % len(JSON_PROMPTS)], constraint=json_grammar.constraint(), **kw)
        if kind == "stop":
            kw["stop"] = [" 5", "in", "\n"]
        return eng.submit(prompts[i], **kw)

    def go(eng):
        jobs = [submit(eng, i, k) for i, k in enumerate(kinds)]
        for chunk in jobs[3]:
            jobs[3].cancel()
            break
        for j in jobs:
            j.result()
        return jobs

    with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16) as eng:
        want = go(eng)
    for opts in ({"ngram_draft": True, "ngram_sizes": [2, 1]}, {"draft_model": smol_draft}):
        with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16, max_batch_tokens=64, **opts) as eng:
            got = go(eng)
            for i, kind in enumerate(kinds):
                if kind == "cancel":
                    assert got[i].finish_reason == "cancelled"
                    assert got[i].token_ids == want[i].token_ids[: len(got[i].token_ids)]
                    continue
                assert got[i].token_ids == want[i].token_ids, (opts, i, kind)
                assert got[i].result() == want[i].result() and got[i].finish_reason == want[i].finish_reason
            assert {j.finish_reason for j in got} >= {"stop_string", "cancelled"}
            s = eng.stats()
            assert s["spec_accepted"] > 0 and got[1].spec_proposed == 0 and got[2].spec_proposed > 0
            pages_all_back(eng._core, s["pages_total"], s["draft_pages_total"] if "draft_model" in opts else None)


def test_smollm2_stop_string_inside_accepted_drafts(smol, smol_draft):
    """A stop string completed by a token in the middle of a verify step's accepted drafts ends the job at that token:
    the step's later tokens (counted in tokens_out) are never shown, and the job equals plain decoding's."""
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,"
    kw = dict(max_new_tokens=40, temperature=0.0, stop=["19,"])
    with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16) as plain:
        want = plain.submit(prompt, **kw)
        assert want.result() and want.finish_reason == "stop_string"
        assert plain.stats()["tokens_out"] == len(want.token_ids)
    for opts in ({"ngram_draft": True, "ngram_sizes": [2, 1]}, {"draft_model": smol_draft, "draft_tokens": 6}):
        with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16, **opts) as eng:
            job = eng.submit(prompt, **kw)
            assert job.result() == want.result() and job.token_ids == want.token_ids
            assert job.finish_reason == "stop_string"
            s = eng.stats()
            assert s["tokens_out"] > len(job.token_ids) and job.spec_accepted > 0, s
            pages_all_back(eng._core, s["pages_total"], s["draft_pages_total"] if "draft_model" in opts else None)


# ---- sampling --------------------------------------------------------------------------------------------------
def test_ngram_sampled_equals_plain_for_the_same_seed(tiny_pair):
    """Point-mass drafts: accepting a draft iff the step's draw equals it is rejection sampling, token for token."""
    target, _ = tiny_pair
    rng = np.random.default_rng(4)
    base = rng.integers(0, VOCAB, 12).tolist()
    jobs = []
    for i in range(12):
        prompt = (base * 4)[: int(rng.integers(20, 48))]  # repetitive: the n-grams match
        s = _C.SamplerSettings(temperature=0.7, top_k=8, repetition_penalty=1.1, seed=50 + i)
        if i % 3 == 0:
            s = _C.SamplerSettings(temperature=0.8, dry_multiplier=0.8, seed=50 + i)
        if i % 3 == 1:
            s = _C.SamplerSettings(temperature=1.0, mirostat_mode=2, mirostat_tau=3.0, seed=50 + i)
        jobs.append((prompt, {"max_new_tokens": 30, "sampler": s}))
    want, _ = run(_C.Engine(target._core, cache_tokens=4096, page_size=16), jobs)
    core = _C.Engine(target._core, cache_tokens=4096, page_size=16, ngram_draft=True, ngram_sizes=[2, 1])
    got, _ = run(core, jobs)
    assert got == want
    assert core.stats()["spec_proposed"] > 0


def _exact_joint(target, prompt, settings, n, rule=False):
    """p(t_1 .. t_n | prompt) for every sequence of the sampler's support, from the model's logits (rule: under
    RULE's mask after each context's last token)."""
    out = {}

    def walk(seq, p):
        if len(seq) == n:
            out[tuple(seq)] = p
            return
        ctx = prompt + seq
        row = np.array(target.forward(ctx)[-1], np.float32)
        if rule:
            row[[i for i in range(VOCAB) if not allowed(RULE[ctx[-1]], i)]] = -np.inf
        probs = _C.sampler_probs(settings, row, ctx, seq)
        for t in np.nonzero(probs)[0]:
            walk(seq + [int(t)], p * float(probs[t]))

    walk([], 1.0)
    return out


def test_draft_model_sampled_output_follows_the_target(tiny_pair):
    """Chi-square: tokens 1..3 of 4000 seeded jobs (the first from the prefill, 2 and 3 from a verify step with a
    sampled draft model whose q differs from p) against the exact joint distribution of plain sampling."""
    pytest.importorskip("scipy.stats")
    target, draft = tiny_pair
    prompt = np.random.default_rng(7).integers(0, VOCAB, 9).tolist()
    kw = dict(temperature=1.0, top_k=3)
    exact = _exact_joint(target, prompt, _C.SamplerSettings(**kw), 3)
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    n_jobs = 4000
    core = _C.Engine(target._core, cache_tokens=8192, page_size=16, max_batch_tokens=512, draft_model=draft._core,
                     draft_tokens=2)
    jobs = [(prompt, {"max_new_tokens": 3, "sampler": _C.SamplerSettings(**kw, seed=1000 + i)})
            for i in range(n_jobs)]
    toks, _ = run(core, jobs)
    s = core.stats()
    # the draft is close but not equal: many acceptances and many rejections
    assert 0.2 * s["spec_proposed"] < s["spec_accepted"] < 0.98 * s["spec_proposed"]
    _check_follows(exact, [tuple(t) for t in toks.values()])


def _check_follows(exact, samples):
    """Chi-square of the samples (sequences) against the exact distribution, and the same against a wrong one
    (the test has power)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    n_jobs = len(samples)
    counts = {}
    for t in samples:
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(exact)
    # cells with an expected count below 5 are pooled
    keys = sorted(exact, key=lambda k: -exact[k])
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        e = exact[k] * n_jobs
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    chi2, pval = scipy_stats.chisquare(obs, exp)
    assert pval > 1e-3, (chi2, pval, len(obs))
    # ... and the same experiment where the target's distribution is wrong for it must fail: the test has power
    shifted = np.roll(np.asarray(exp), 1)
    assert scipy_stats.chisquare(obs, shifted * (sum(obs) / shifted.sum()))[1] < 1e-6


@pytest.mark.parametrize("constrained", [False, True])
def test_seeded_draft_model_jobs_do_not_depend_on_neighbours(tiny_pair, constrained):
    """Alone or among other jobs (constrained ones, one cancelled, for a constrained job), a seeded job gives the
    same tokens, with a draft model and with n-gram drafts."""
    target, draft = tiny_pair
    rng = np.random.default_rng(8)
    job = (rng.integers(0, VOCAB, 30).tolist(),
           {"max_new_tokens": 40, "sampler": _C.SamplerSettings(temperature=0.9, top_p=0.95, seed=77)})
    others = [(rng.integers(0, VOCAB, int(rng.integers(5, 60))).tolist(),
               {"max_new_tokens": int(rng.integers(5, 50)),
                "sampler": _C.SamplerSettings(temperature=1.0, seed=int(rng.integers(1, 1 << 30)))})
              for _ in range(9)]
    for opts in ({"draft_model": draft._core}, {"ngram_draft": True, "ngram_sizes": [1]}):
        mk = lambda: _C.Engine(target._core, cache_tokens=4096, page_size=16, **opts)  # noqa: E731
        if not constrained:
            alone, _ = run(mk(), [job])
            mixed, _ = run(mk(), others[:4] + [job] + others[4:])
        else:
            alone, _ = run(mk(), [job], ruled={0}, grammar=RuleGrammar())
            mixed, _ = run(mk(), others[:4] + [job] + others[4:], cancel_after={7: 3}, ruled={1, 4, 6},
                           grammar=RuleGrammar())
        assert mixed[4] == alone[0] and len(alone[0]) == 40


# ---- constrained jobs ------------------------------------------------------------------------------------------
def _ruled_jobs(seed, n, repetitive=False):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, VOCAB, 10).tolist()
    jobs = []
    for i in range(n):
        prompt = (base * 5)[: int(rng.integers(20, 50))] if repetitive else rng.integers(0, VOCAB, 30).tolist()
        s = greedy() if i % 2 == 0 else _C.SamplerSettings(temperature=0.8, top_k=12, seed=30 + i)
        jobs.append((prompt, {"max_new_tokens": 32, "sampler": s}))
    return jobs


@pytest.mark.parametrize("drafts", ["ngram", "draft_model"])
def test_constrained_jobs_speculate_and_equal_plain(tiny_pair, drafts):
    """Every token obeys the rule; greedy jobs (and seeded ones with n-gram drafts) give plain constrained decoding's
    tokens; drafts the rule forbids are refused by the DraftMaskFn and rejected at their position."""
    target, draft = tiny_pair
    jobs = _ruled_jobs(21, 12, repetitive=drafts == "ngram")
    ruled = set(range(len(jobs)))
    want, why = run(_C.Engine(target._core, cache_tokens=4096, page_size=16), jobs, ruled=ruled)
    opts = {"ngram_draft": True, "ngram_sizes": [2, 1]} if drafts == "ngram" else {"draft_model": draft._core}
    core = _C.Engine(target._core, cache_tokens=4096, page_size=16, **opts)
    s0 = core.stats()
    grammar = RuleGrammar()
    got, reasons = run(core, jobs, ruled=ruled, grammar=grammar)
    for i, (prompt, kw) in enumerate(jobs):
        seq = prompt[-1:] + got[i]
        assert all(allowed(RULE[a], b) for a, b in zip(seq, seq[1:])), i
        if kw["sampler"].temperature == 0.0 or drafts == "ngram":
            assert got[i] == want[i] and reasons[i] == why[i], i
    s = core.stats()
    # n-gram drafts meet the rule only when verified; a draft model proposes under it (its drafts are never refused)
    assert grammar.calls > 0 and (grammar.refused > 0) == (drafts == "ngram")
    assert s["spec_accepted"] > 0 and s["spec_proposed"] > s["spec_accepted"]
    pages_all_back(core, s0["pages_free"], s0["draft_pages_free"] if drafts == "draft_model" else None)


def test_constrained_jobs_without_a_draft_mask_function_do_not_speculate(tiny_pair):
    target, _ = tiny_pair
    jobs = _ruled_jobs(22, 4, repetitive=True)
    core = _C.Engine(target._core, cache_tokens=4096, page_size=16, ngram_draft=True, ngram_sizes=[2, 1])
    want, _ = run(_C.Engine(target._core, cache_tokens=4096, page_size=16), jobs, ruled={0, 1, 2, 3})
    got, _ = run(core, jobs, ruled={0, 1, 2, 3})
    assert got == want and core.stats()["spec_proposed"] == 0


@pytest.mark.parametrize("grammar_type", [RuleGrammar, RuleGrammarLateMasks])
def test_constrained_sampled_draft_model_follows_the_masked_target(tiny_pair, grammar_type):
    """Chi-square: tokens 1..3 of 3000 seeded constrained jobs verified against a sampled draft model (proposing under
    the masks, or its second draft without them) follow the exact joint distribution of plain sampling under the
    rule's masks."""
    pytest.importorskip("scipy.stats")
    target, draft = tiny_pair
    prompt = np.random.default_rng(23).integers(0, VOCAB, 9).tolist()
    kw = dict(temperature=1.0, top_k=3)
    exact = _exact_joint(target, prompt, _C.SamplerSettings(**kw), 3, rule=True)
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    core = _C.Engine(target._core, cache_tokens=8192, page_size=16, max_batch_tokens=512, draft_model=draft._core,
                     draft_tokens=2)
    # 4 tokens: the verify step after the prefill's token has two drafts (tokens 2 and 3 are verified ones)
    jobs = [(prompt, {"max_new_tokens": 4, "sampler": _C.SamplerSettings(**kw, seed=5000 + i)}) for i in range(3000)]
    grammar = grammar_type()
    toks, _ = run(core, jobs, ruled=set(range(len(jobs))), grammar=grammar)
    s = core.stats()
    assert s["spec_accepted"] > 0.1 * s["spec_proposed"] > 0 and grammar.calls > 0
    assert (grammar.refused > 0) == (grammar_type is RuleGrammarLateMasks)
    _check_follows(exact, [tuple(t[:3]) for t in toks.values()])


def test_draft_mask_function_that_refuses_what_its_mask_allows(tiny_pair):
    """A mask function that stops before a draft its own mask allows: that draft, accepted, ends the row as its last
    token (its K/V recomputed next step), and the output is still plain decoding's."""
    target, _ = tiny_pair
    prompt = list(range(5, 45)) * 3
    everything = [0xFFFFFFFF] * ((VOCAB + 31) // 32)
    kw = {"max_new_tokens": 40, "sampler": greedy(), "token_mask": everything}
    want, _ = run(_C.Engine(target._core, cache_tokens=4096, page_size=16), [(prompt, kw)])
    for fn in (lambda j, d: [], lambda j, d: [everything] * (len(d) - 1), lambda j, d: [everything] * len(d)):
        core = _C.Engine(target._core, cache_tokens=4096, page_size=16, ngram_draft=True, ngram_sizes=[4])
        core.set_draft_masks(fn)
        got, _ = run(core, [(prompt, kw)])
        s = core.stats()
        assert got == want and s["spec_proposed"] > 0
        assert s["steps"] < 40 - 5 or fn(0, [1]) == []  # several tokens a step unless no position has a mask
        pages_all_back(core, s["pages_total"])


def test_draft_mask_function_errors(tiny_pair):
    target, _ = tiny_pair
    prompt = list(range(5, 25)) * 3

    def boom(job_id, drafts):
        raise RuntimeError("grammar exploded")

    for fn, message in ((boom, "grammar exploded"), (lambda j, d: [RULE[0]] * (len(d) + 1), "at most one per")):
        core = _C.Engine(target._core, cache_tokens=1024, page_size=16, ngram_draft=True, ngram_sizes=[4])
        core.set_draft_masks(fn)
        ok = core.submit(prompt, max_new_tokens=20, sampler=greedy())
        bad = core.submit(prompt, max_new_tokens=20, sampler=greedy(), token_mask=[0xFFFFFFFF] * 7)
        errors = {}
        while not core.idle:
            for jid, _t, _lp, _top, finished, reason, error in core.step():
                if finished:
                    errors[jid] = (reason, error)
        assert errors[ok] == ("length", "")
        assert errors[bad][0] == "error" and message in errors[bad][1]
        pages_all_back(core, core.stats()["pages_total"])
        with pytest.raises(InvalidArgumentError, match="before|after jobs"):
            core.set_draft_masks(None)


# ---- pages, mixing, preemption, adaptivity ---------------------------------------------------------------------
def test_mixed_batch_returns_every_page(tiny_pair):
    """Speculative (greedy and sampled), plain (speculate=False), constrained (RULE, speculating through the mask
    function) and cancelled jobs in one engine, prefills mixed with verify rows; greedy ones equal plain decoding;
    every page of both caches returns."""
    target, draft = tiny_pair
    rng = np.random.default_rng(9)
    jobs, kinds = [], []
    for i in range(16):
        prompt = rng.integers(0, VOCAB, int(rng.integers(3, 70))).tolist()
        kind = ["spec", "sampled", "plain", "masked"][i % 4]
        kw = {"max_new_tokens": int(rng.integers(10, 40)), "sampler": greedy()}
        if kind == "sampled":
            kw["sampler"] = _C.SamplerSettings(temperature=0.8, seed=i + 1)
        if kind == "plain":
            kw["speculate"] = False
        jobs.append((prompt, kw))
        kinds.append(kind)
    ruled = {i for i, kind in enumerate(kinds) if kind == "masked"}
    cancel = {3: 2, 6: 5, 13: 9}  # job index: step
    for ngram in (False, True):
        opts = {"ngram_draft": True, "ngram_sizes": [1]} if ngram else {"draft_model": draft._core}
        core = _C.Engine(target._core, cache_tokens=2048, page_size=16, max_batch_tokens=128, **opts)
        s0 = core.stats()
        got, reasons = run(core, jobs, cancel_after=cancel, ruled=ruled, grammar=RuleGrammar())
        ref, _ = run(_C.Engine(target._core, cache_tokens=2048, page_size=16), jobs, ruled=ruled)
        for i, kind in enumerate(kinds):
            exact = kind != "sampled" or ngram  # a sampled draft model: the target's distribution, not its tokens
            if i in cancel:
                assert reasons[i] == "cancelled" and (not exact or got[i] == ref[i][: len(got[i])])
            elif exact:
                assert got[i] == ref[i], (i, kind)
            if kind == "masked":
                seq = jobs[i][0][-1:] + got[i]
                assert all(allowed(RULE[a], b) for a, b in zip(seq, seq[1:]))
        s = core.stats()
        assert s["spec_proposed"] > 0
        pages_all_back(core, s0["pages_free"], s0["draft_pages_free"] if not ngram else None)


def test_preemption_with_drafts_returns_pages_and_matches(tiny_pair):
    target, draft = tiny_pair
    rng = np.random.default_rng(10)
    jobs = [(rng.integers(0, VOCAB, int(rng.integers(20, 60))).tolist(),
             {"max_new_tokens": 60, "sampler": greedy(), "priority": i % 3}) for i in range(10)]
    want, _ = run(_C.Engine(target._core, cache_tokens=4096, page_size=16), jobs)
    core = _C.Engine(target._core, cache_tokens=320, page_size=16, max_batch_tokens=64, draft_model=draft._core)
    s0 = core.stats()
    got, _ = run(core, jobs)
    assert got == want
    s = core.stats()
    assert s["preemptions"] > 0 and s["spec_accepted"] > 0
    pages_all_back(core, s0["pages_free"], s0["draft_pages_free"])


def test_rewind_with_draft_model(tiny_pair):
    """A rewind (banned string) takes back the draft's KV too: the resampled continuation equals plain decoding's."""
    target, draft = tiny_pair
    prompt = np.random.default_rng(12).integers(0, VOCAB, 40).tolist()
    out = {}
    for opts in ({}, {"draft_model": draft._core}):
        core = _C.Engine(target._core, cache_tokens=2048, page_size=16, **opts)
        jid = core.submit(prompt, max_new_tokens=40, sampler=greedy())
        toks, rewound = [], False
        while not core.idle:
            for _jid, token, _lp, _top, _fin, _reason, err in core.step():
                assert not err
                if token >= 0:
                    toks.append(token)
            if not rewound and len(toks) >= 20:
                assert core.rewind(jid, 18, toks[18])
                del toks[18:]
                rewound = True
        out[bool(opts)] = toks
        pages_all_back(core, core.stats()["pages_total"], core.stats()["draft_pages_total"] if opts else None)
    assert out[True] == out[False] and len(out[True]) == 40


def test_adaptive_length_makes_a_disagreeing_draft_cheap(tiny_pair, tiny_other):
    target, _ = tiny_pair
    rng = np.random.default_rng(13)
    jobs = [(rng.integers(0, VOCAB, 20).tolist(), {"max_new_tokens": 300, "sampler": greedy()}) for _ in range(2)]
    want, _ = run(_C.Engine(target._core, cache_tokens=4096, page_size=16), jobs)
    core = _C.Engine(target._core, cache_tokens=4096, page_size=16, draft_model=tiny_other._core, draft_tokens=8)
    got, _ = run(core, jobs)
    assert got == want
    s = core.stats()
    # a rejected probe halves the length, then waits 8, 16, ... 256 tokens: a few dozen drafts in 600 tokens
    assert s["spec_proposed"] < 0.15 * s["tokens_out"], s
    assert s["draft_steps"] < 0.25 * s["steps"], s


def test_ngram_drafts_from_the_prompt(tiny_pair):
    """A job that copies its prompt (greedy on a model that repeats) accepts n-gram drafts."""
    target, _ = tiny_pair
    prompt = list(range(5, 45)) * 3
    core = _C.Engine(target._core, cache_tokens=4096, page_size=16, ngram_draft=True, ngram_sizes=[4])
    want, _ = run(_C.Engine(target._core, cache_tokens=4096, page_size=16), [(prompt, {"max_new_tokens": 40,
                                                                                     "sampler": greedy()})])
    got, _ = run(core, [(prompt, {"max_new_tokens": 40, "sampler": greedy()})])
    assert got == want
    assert core.stats()["spec_proposed"] > 0
    with exl2cpp.Engine(target, cache_tokens=4096, ngram_draft=True, ngram_sizes=[4]) as eng:
        on = eng.submit(prompt, max_new_tokens=40, temperature=0.0)
        off = eng.submit(prompt, max_new_tokens=40, temperature=0.0, speculate=False)
        on.result(), off.result()
        assert on.token_ids == off.token_ids == want[0]
        assert on.spec_accepted > 0 and off.spec_proposed == 0


# ---- options ---------------------------------------------------------------------------------------------------
def test_option_errors(tiny_pair, smol):
    target, draft = tiny_pair
    with pytest.raises(InvalidArgumentError, match="draft_tokens"):
        exl2cpp.Engine(target, cache_tokens=1024, ngram_draft=True, draft_tokens=0)
    with pytest.raises(InvalidArgumentError, match="not both"):
        exl2cpp.Engine(target, cache_tokens=1024, ngram_draft=True, draft_model=draft)
    with pytest.raises(InvalidArgumentError, match="itself"):
        exl2cpp.Engine(target, cache_tokens=1024, draft_model=target)
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        exl2cpp.Engine(target, cache_tokens=1024, draft_model=smol)
    with pytest.raises(InvalidArgumentError, match="ngram_sizes"):
        exl2cpp.Engine(target, cache_tokens=1024, ngram_draft=True, ngram_sizes=[0])
    with pytest.raises(InvalidArgumentError, match="max_jobs"):
        _C.Engine(target._core, cache_tokens=1024, ngram_draft=True, draft_tokens=4, max_batch_tokens=64, max_jobs=16)
    # auto max_jobs: as many as fit with their drafts
    core = _C.Engine(target._core, cache_tokens=1024, ngram_draft=True, draft_tokens=4, max_batch_tokens=64)
    assert core.stats()["jobs_active"] == 0


# ---- server ----------------------------------------------------------------------------------------------------
def test_serve_flags_config_and_metrics(tiny_pair):
    pytest.importorskip("prometheus_client")
    from exl2cpp.cli import build_parser
    from exl2cpp.server.app import _draft_options
    from exl2cpp.server.config import load_config
    from exl2cpp.server.metrics import Metrics

    target, _ = tiny_pair
    draft_dir = str(tiny_pair[1].path)
    args = build_parser().parse_args(["serve", "smollm2", "--draft-model", draft_dir, "--draft-tokens", "3"])
    assert (args.draft_model, args.draft_tokens, args.ngram_draft) == (draft_dir, 3, None)
    assert build_parser().parse_args(["serve", "--ngram-draft"]).ngram_draft is True
    cfg = load_config(None, draft_model=args.draft_model, draft_tokens=args.draft_tokens, ngram_draft=None)
    opts = _draft_options(cfg, target)
    assert opts["draft_tokens"] == 3 and not opts["ngram_draft"]
    assert opts["draft_model"].vocab_size == VOCAB and opts["draft_model"].max_seq_len == target.max_seq_len
    eng = exl2cpp.Engine(target, cache_tokens=1024, **opts)
    job = eng.submit(list(range(3, 30)), max_new_tokens=12, temperature=0.0)
    job.result()
    s = eng.stats()
    eng.close()
    assert s["spec_proposed"] > 0 and job.spec_proposed == s["spec_proposed"]
    assert load_config(None, ngram_draft=True).ngram_draft is True
    assert _draft_options(load_config(None), target) == {"draft_tokens": 4, "ngram_draft": False}
    text = Metrics(lambda: s).render().decode()
    assert f"exl2cpp_spec_proposed {float(s['spec_proposed'])}" in text
    assert f"exl2cpp_spec_accepted {float(s['spec_accepted'])}" in text


# ---- CUDA (run on a GPU by the lead) ---------------------------------------------------------------------------
has_cuda = getattr(_C, "cuda_device_count", lambda: 0)() > 0


@pytest.fixture(scope="module")
def smol_cuda_pair(smollm2_dir):
    if not has_cuda:
        pytest.skip("no CUDA device")
    return (exl2cpp.load(smollm2_dir, device="cuda", max_seq_len=1024),
            exl2cpp.load(smollm2_dir, device="cuda", max_seq_len=1024))


def _near_tie_or_equal(model, prompt, want, got, gap=0.05):
    """got == want, or they first differ where the model's own logits (a plain forward of the common prefix) have
    their two best within `gap`: a verify batch of several rows may round differently from a one-row decode."""
    if got == want:
        return True
    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    row = np.sort(model.forward(prompt + want[:i])[-1].astype(np.float64))
    return row[-1] - row[-2] < gap


@pytest.mark.cuda
def test_cuda_greedy_spec_equals_plain(smol_cuda_pair):
    target, draft = smol_cuda_pair
    tok = target.tokenizer
    jobs = [(tok.encode(p), {"max_new_tokens": 32, "sampler": greedy()}) for p in PROMPTS]
    want, _ = run(_C.Engine(target._core, cache_tokens=16384), jobs)
    for opts in ({"ngram_draft": True}, {"draft_model": draft._core}):
        core = _C.Engine(target._core, cache_tokens=16384, **opts)
        s0 = core.stats()
        got, _ = run(core, jobs)
        for i, (prompt, _kw) in enumerate(jobs):
            assert _near_tie_or_equal(target, prompt, want[i], got[i]), (opts, i)
        assert sum(got[i] == want[i] for i in want) >= len(want) - 2
        s = core.stats()
        assert s["spec_accepted"] > 0
        if "draft_model" in opts:
            assert s["spec_accepted"] > 0.8 * s["spec_proposed"]
        pages_all_back(core, s0["pages_free"], s0["draft_pages_free"] if "draft_model" in opts else None)


@pytest.mark.cuda
def test_cuda_seeded_ngram_sampled_equals_plain(smol_cuda_pair):
    """Device argmax / sampling flags per verify row: seeded n-gram jobs give plain decoding's tokens."""
    target, _ = smol_cuda_pair
    tok = target.tokenizer
    jobs = [(tok.encode(p), {"max_new_tokens": 24, "sampler": _C.SamplerSettings(temperature=0.8, top_p=0.9,
                                                                                   seed=i + 1)})
            for i, p in enumerate(PROMPTS[:8])]
    want, _ = run(_C.Engine(target._core, cache_tokens=8192), jobs)
    core = _C.Engine(target._core, cache_tokens=8192, ngram_draft=True, ngram_sizes=[3, 2, 1])
    got, _ = run(core, jobs)
    assert sum(got[i] == want[i] for i in want) >= len(want) - 1
    assert core.stats()["spec_proposed"] > 0


@pytest.mark.cuda
def test_cuda_json_schema_jobs_speculate(smol_cuda_pair, json_grammar):
    """Constrained verify rows on the device (host sampling under each position's mask, draft proposals under the
    masks): greedy JSON-schema jobs give plain constrained decoding's tokens (near ties aside), many drafts accepted."""
    target, draft = smol_cuda_pair
    tok = target.tokenizer
    with exl2cpp.Engine(target, cache_tokens=8192) as eng:
        want, _ = _json_run(eng, json_grammar, {"temperature": 0.0})
    for opts in ({"ngram_draft": True, "ngram_sizes": [2, 1]}, {"draft_model": draft}):
        with exl2cpp.Engine(target, cache_tokens=8192, **opts) as eng:
            got, jobs = _json_run(eng, json_grammar, {"temperature": 0.0})
            same = sum(g == w for g, w in zip(got, want))
            assert same >= len(want) - 1, (opts, same)
            for toks, why in got:
                if why == "stop_token":
                    json.loads(tok.decode(toks[:-1]))
            s = eng.stats()
            assert s["spec_accepted"] > 0
            if "draft_model" in opts:
                assert s["spec_accepted"] > 0.5 * s["spec_proposed"]
            pages_all_back(eng._core, s["pages_total"], s["draft_pages_total"] if "draft_model" in opts else None)


def _budget(smol, budget, inside=True, message=""):
    from exl2cpp.server.reasoning import ReasoningBudget

    tok = smol.tokenizer
    return ReasoningBudget(tok, tok.vocab_size, "<think>", "</think>", inside, budget, message)


def test_reasoning_budget_draft_masks_are_advance_masks(smol):
    """ReasoningBudget.draft_masks gives what advance gives token by token ([] where every token is allowed, the
    forced tokens' single-bit masks after the budget), leaves the constraint as it was, and stops at the first draft
    the forced text refuses."""
    tok = smol.tokenizer
    ids = tok.encode(" one two three four five six", add_bos=False)
    forced = tok.encode(" (cut)</think>", add_bos=False)
    ref = _budget(smol, 3, message=" (cut)")
    want = [ref.advance(t) for t in ids[:3] + forced]
    assert want[:2] == [[], []] and want[2] and want[-1] == []  # the budget's third token starts the forcing
    c = _budget(smol, 3, message=" (cut)")
    assert c.draft_masks(ids[:3] + forced) == want
    assert c.state == "reasoning" and c.count == 0 and c.mask() == []
    assert c.draft_masks(ids[:3] + [forced[0] + 1]) == want[:3]  # not the forced token: refused there
    assert [c.advance(t) for t in ids[:3] + forced] == want and c.state == "done"


def test_smollm2_reasoning_budget_jobs_speculate_and_equal_plain(smol):
    """Greedy jobs under a reasoning budget (the reply starts inside its reasoning; the budget ends it mid-draft or
    between drafts) give plain decoding's tokens with n-gram drafts, which are proposed and accepted, and every page
    returns; the budget's cut is where plain decoding puts it."""
    prompts = [smol.tokenizer.encode(f"Count: {' '.join(str(k % 5) for k in range(n))}", add_bos=False)
               for n in (20, 31, 40)]  # fmt: skip
    budgets = (5, 9, 14)

    def jobs(eng):
        js = [eng.submit(p, max_new_tokens=32, temperature=0.0, constraint=_budget(smol, b, message=" ok"))
              for p, b in zip(prompts, budgets)]  # fmt: skip
        for j in js:
            j.result()
        return js

    with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16) as eng:
        want = [j.token_ids for j in jobs(eng)]
    end = smol.tokenizer.encode(" ok</think>", add_bos=False)
    for w, b in zip(want, budgets):
        assert w[b:b + len(end)] == end, (w, b)
    with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16, ngram_draft=True, ngram_sizes=[2, 1]) as eng:
        js = jobs(eng)
        assert [j.token_ids for j in js] == want
        s = eng.stats()
        assert s["spec_proposed"] > 0 and s["spec_accepted"] > 0, s
        pages_all_back(eng._core, s["pages_total"])
