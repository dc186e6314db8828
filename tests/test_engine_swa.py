"""Sliding-window memory in the engine: models with windowed layers get a cache of layer groups (one page table per
group of layers sharing a window) and give back the pages behind each window. Tiny random Gemma 2 / Gemma 3 /
Mistral models past their window against HF transformers fp32 and against the plain cache (every page kept); pages
given back and all returned after mixed batches with cancels, prefix sharing past the window, rewinds past the
margin, n-gram speculative decoding, quantized caches; Gemma 3 270M past its 512-token window; CUDA (marker
`cuda`) against the CPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402
from exl2cpp import _C  # noqa: E402

_HAS_CUDA = _C.cuda_compiled() and _C.cuda_device_count() > 0
VOCAB = 250
WINDOW = 8
PAGE = 16
MARGIN = 64  # engine.cpp kWindowMargin
TEXT = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6)  # fmt: skip
CONFIGS = {
    # 2 windowed + 2 full layers (alternating): 2 groups of 2
    "gemma2": ("Gemma2Config", dict(TEXT, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0), 2),
    # 4 windowed + 2 full: 3 groups of 2
    "gemma3": ("Gemma3TextConfig", dict(TEXT, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
               3),
    # every layer windowed: one group, windowed
    "mistral": ("MistralConfig", dict(TEXT, num_hidden_layers=3, sliding_window=WINDOW), 1),
}  # fmt: skip


def make(kind, folder, seed=0, **changes):
    """The tiny HF model of `kind` (random weights, norms too) saved to folder; returns it (fp32, eval)."""
    cls, cfg, _groups = CONFIGS[kind]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**dict(cfg, **changes)), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double().numpy()


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def ids_of(n, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def greedy():
    return _C.SamplerSettings(temperature=0.0)


def run(core, jobs, cancels=None, check=None, on_step=None):
    """Submit jobs {key: (prompt, kwargs)} (kwargs may hold "at": the step to submit it), step until idle; cancels:
    {step: [key]}. Returns {key: (tokens, logprobs, reason)}."""
    cancels = cancels or {}
    ids, out = {}, {}
    step = 0
    last = max([kw.get("at", 0) for _, kw in jobs.values()] + list(cancels) + [0])
    while step <= last or not core.idle:
        for key, (prompt, kw) in jobs.items():
            if kw.get("at", 0) == step:
                kw = {k: v for k, v in kw.items() if k != "at"}
                kw.setdefault("sampler", greedy())
                ids[core.submit(prompt, **kw)] = key
                out[key] = ([], [], None)
        for key in cancels.get(step, []):
            core.cancel(next(j for j, k in ids.items() if k == key))
        for jid, token, lp, _top, finished, reason, error in core.step():
            assert not error, error
            toks, lps, _ = out[ids[jid]]
            if token >= 0:
                toks.append(token)
                lps.append(lp)
            if finished:
                out[ids[jid]] = (toks, lps, reason)
        if check:
            check(core)
        if on_step:
            on_step(core, ids)
        step += 1
        assert step < 20000, "engine did not finish"
    return out


def check_pages(core):
    s = core.stats()
    assert 0 <= s["pages_used"] <= s["pages_total"] and s["pages_used"] + s["pages_free"] == s["pages_total"]
    assert 0 <= s["pages_reserved"] <= s["pages_free"] + s["pages_evictable"]
    assert s["pages_used"] >= s["pages_cached"] >= s["pages_evictable"]


def engine(model, **kw):
    kw.setdefault("cache_tokens", 2048)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_tokens", 40)
    return _C.Engine(model._core, **kw)


def plain_logits(model, ids, cache_type="auto", chunk=40):
    """Teacher-forced logits through a plain cache (one page table, every page kept), in chunks of `chunk`."""
    core = model._core
    cache = core.make_cache(len(ids) + PAGE, PAGE, cache_type)
    n_pages = -(-len(ids) // PAGE)
    pages = cache.pool.alloc(n_pages)
    out = []
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        out.append(core.forward(cache, part, list(range(s, s + len(part))), [0] * len(part), pages, n_pages))
    return np.concatenate(out, axis=0).astype(np.float64)


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"swa_{request.param}")
    hf = make(request.param, folder)
    return request.param, hf, exl2cpp.load(folder)


def test_layout_groups(tiny):
    kind, _hf, model = tiny
    s = engine(model).stats()
    assert s["layer_groups"] == CONFIGS[kind][2]
    # The pool holds the memory of cache_tokens of every layer: layer_groups times the pages.
    assert s["pages_total"] == 2048 // PAGE * s["layer_groups"]


def test_past_the_window_matches_hf(tiny):
    """Greedy tokens are HF's argmax at every step (teacher-forced on our sequence) and their logprobs HF's, for a
    sequence many windows (and the margin) long; the windowed groups gave pages back on the way."""
    kind, hf, model = tiny
    prompt = ids_of(130, seed=4)
    core = engine(model)
    toks, lps, reason = run(core, {"a": (prompt, {"max_new_tokens": 60})})["a"]
    assert reason == "length" and len(toks) == 60
    ref = log_softmax(hf_logits(hf, prompt + toks))[len(prompt) - 1 : -1]
    assert np.argmax(ref, axis=1).tolist() == toks
    np.testing.assert_allclose(lps, ref[np.arange(60), toks], atol=1e-4)
    s = core.stats()
    assert s["pages_window_freed"] > 0, s
    assert s["pages_used"] == s["pages_cached"]  # finished: what is left is the prefix table's
    assert core.clear_prefix_cache() > 0 and core.stats()["pages_used"] == 0


@pytest.mark.parametrize("executor", ["sequential", "cpu-pad"])
def test_tensor_parallel_gives_back_windowed_pages(tiny, tmp_path, executor):
    """Tensor parallel over 2 CPU ranks gets the same layer groups (every rank its share of the heads in each slot):
    the single device's greedy tokens and logprobs past the window, pages given back, all returned; "cpu-pad" runs
    the decode steps in the padded layout of the CUDA graphs (one table per group)."""
    from exl2cpp import options as exl2_options

    kind, _hf, model = tiny
    exl2_options.set(tp_graphs="cpu-pad" if executor == "cpu-pad" else "off")
    try:
        tp = exl2cpp.load(model.path, device="cpu", tensor_parallel=2)
        prompt = ids_of(130, seed=4)
        jobs = {"a": (prompt, {"max_new_tokens": 40}), "b": (ids_of(70, seed=5), {"max_new_tokens": 30, "at": 3})}
        want = run(engine(model), jobs)
        core = engine(tp)
        got = run(core, jobs, check=check_pages)
        s = core.stats()
        assert s["layer_groups"] == CONFIGS[kind][2], s
        assert s["pages_window_freed"] > 0, s
        for key in jobs:
            assert got[key][0] == want[key][0], key
            np.testing.assert_allclose(got[key][1], want[key][1], atol=1e-5)
        assert core.clear_prefix_cache() >= 0 and core.stats()["pages_used"] == 0
    finally:
        exl2_options.set(tp_graphs="off")


def test_windowed_group_holds_its_window(tiny):
    """While a long job decodes, a windowed group keeps only the pages from n - window + 1 - margin on; a full
    group keeps them all (prefix cache off: what the job gives back is free)."""
    kind, _hf, model = tiny
    core = engine(model, prefix_cache=False)
    windows = [w for w in _group_windows(kind)]
    seen = []

    def on_step(core, ids):
        for jid in ids:
            n = len(core.job_tokens(jid)) - 1  # positions cached once its last token is computed
            if n <= 0:
                continue
            for g, w in enumerate(windows):
                pages = core.job_pages(jid, g)
                if not pages:
                    continue
                live = [p for p in pages if p >= 0]
                if w == 0:
                    assert len(live) == len(pages)
                else:
                    lo = max(0, n - w + 1 - MARGIN)
                    assert all(p < 0 for p in pages[: lo // PAGE]), (g, n)
                    assert all(p >= 0 for p in pages[lo // PAGE :]), (g, n)
                    seen.append(lo // PAGE)

    run(core, {"a": (ids_of(40, seed=2), {"max_new_tokens": 200})}, on_step=on_step)
    assert max(seen) >= 8  # pages were given back
    s = core.stats()
    assert s["pages_used"] == 0 and s["pages_window_freed"] > 0


def _group_windows(kind):
    """The window of each layer group, as cache_layout orders them (by first appearance of a window value)."""
    _cls, cfg, _groups = CONFIGS[kind]
    if kind == "gemma2":
        return [WINDOW, 0]
    if kind == "gemma3":
        return [WINDOW, WINDOW, 0]
    return [WINDOW]


def test_mixed_batch_with_cancels_returns_every_page(tiny):
    """Jobs of many lengths (several past the window), staggered, some cancelled mid-prefill or mid-decode, in a
    cache small enough to preempt: each finished job's tokens are its tokens alone, the accounting holds every
    step, and at the end every page is back."""
    kind, _hf, model = tiny
    rng = np.random.default_rng(7)
    jobs = {}
    for i in range(10):
        n = int(rng.integers(5, 160))
        jobs[f"j{i}"] = (rng.integers(0, VOCAB, n).tolist(), {"max_new_tokens": int(rng.integers(1, 90)), "at": i})
    cancels = {3: ["j1"], 9: ["j4"], 25: ["j6"]}
    core = engine(model, cache_tokens=512, max_batch_tokens=48)
    out = run(core, jobs, cancels=cancels, check=check_pages)
    s = core.stats()
    assert s["jobs_finished"] == 10 and s["pages_window_freed"] > 0
    for key, (prompt, kw) in jobs.items():
        toks, _lps, reason = out[key]
        if reason == "cancelled":
            continue
        alone = run(engine(model), {"a": (prompt, {"max_new_tokens": kw["max_new_tokens"]})})["a"][0]
        assert toks == alone, key
    core.clear_prefix_cache()
    assert core.stats()["pages_used"] == 0


def test_prefix_sharing_past_the_window(tiny):
    """Jobs sharing a prefix longer than the window + margin: the later ones adopt its pages (finished and
    running owners), with the same tokens as without prefix sharing; a small cache evicts windowed pages of the
    table page by page and adoption stops where the window's pages are gone."""
    kind, _hf, model = tiny
    prefix = ids_of(150, seed=5)
    jobs = {f"s{i}": (prefix + ids_of(5 + i, seed=20 + i), {"max_new_tokens": 12, "at": 0 if i == 0 else 20 + i})
            for i in range(4)}  # fmt: skip
    want = {k: run(engine(model, prefix_cache=False), {"a": (p, {"max_new_tokens": 12})})["a"][0]
            for k, (p, _) in jobs.items()}  # fmt: skip
    for cache_tokens in (2048, 240):
        core = engine(model, cache_tokens=cache_tokens)
        out = run(core, jobs, check=check_pages)
        s = core.stats()
        assert s["tokens_reused"] >= (3 if cache_tokens == 2048 else 1) * (150 // PAGE) * PAGE, s
        for k in jobs:
            assert out[k][0] == want[k], (cache_tokens, k)
        core.clear_prefix_cache()
        assert core.stats()["pages_used"] == 0


def test_rewind_within_and_past_the_margin(tiny):
    """A rewind by a few tokens keeps the job's pages; one past the window + margin recomputes the job from
    position 0 (prefix cache off: no page to adopt); either way the job then gives plain decoding's tokens (no
    ban: the same greedy tokens again)."""
    kind, _hf, model = tiny
    prompt = ids_of(30, seed=9)
    want = run(engine(model), {"a": (prompt, {"max_new_tokens": 150})})["a"][0]
    for keep_back, recompute in ((3, False), (140, True)):
        core = engine(model, prefix_cache=False)
        jid = core.submit(prompt, max_new_tokens=150, sampler=greedy())
        toks, rewound = [], False
        while not core.idle:
            for _jid, token, _lp, _top, finished, _reason, error in core.step():
                assert not error
                if token >= 0:
                    toks.append(token)
            if not rewound and len(toks) == 145:
                before = core.stats()["tokens_recomputed"]
                assert core.rewind(jid, len(toks) - keep_back, -1)
                del toks[len(toks) - keep_back :]
                rewound = True
        assert toks == want, keep_back
        recomputed = core.stats()["tokens_recomputed"] - before
        # past the margin: positions [0, 30 + 5 - 1) forwarded again; within it, none (the pages stay)
        assert recomputed == (34 if recompute else 0), recomputed
        assert core.stats()["pages_used"] == 0


def test_ngram_speculation_past_the_window(tiny):
    """n-gram drafts over a repetitive prompt: rejected drafts roll back their own rows only, so the tokens are
    plain decoding's."""
    kind, _hf, model = tiny
    prompt = (ids_of(12, seed=3) * 12)[:140]
    want = run(engine(model), {"a": (prompt, {"max_new_tokens": 80})})["a"][0]
    core = engine(model, ngram_draft=True, draft_tokens=4)
    got = run(core, {"a": (prompt, {"max_new_tokens": 80})}, check=check_pages)["a"][0]
    assert got == want
    s = core.stats()
    assert s["spec_proposed"] > 0 and s["pages_window_freed"] > 0
    core.clear_prefix_cache()
    assert core.stats()["pages_used"] == 0


@pytest.mark.parametrize("cache_type", ["q8", "q6", "q4", "fp32"])
def test_cache_types_match_the_plain_cache(tmp_path, cache_type):
    """Every cache type on a cache of layer groups: the same greedy tokens and logprobs as teacher-forced logits
    through the plain cache (one page table, every page kept) of that type, chunked as the engine's prefill."""
    make("gemma3", tmp_path, head_dim=32)  # quantized caches need head_dim % 32 == 0
    model = exl2cpp.load(tmp_path)
    prompt = ids_of(120, seed=6)
    core = engine(model, cache_type=cache_type)
    toks, lps, _ = run(core, {"a": (prompt, {"max_new_tokens": 50})})["a"]
    assert core.stats()["pages_window_freed"] > 0
    ref = log_softmax(plain_logits(model, prompt + toks, cache_type))[len(prompt) - 1 : -1]
    assert np.argmax(ref, axis=1).tolist() == toks
    np.testing.assert_allclose(lps, ref[np.arange(50), toks], atol=1e-4 if cache_type == "fp32" else 2e-3)


def test_capacity_counts_the_windows(tmp_path):
    """tokens_needed / jobs_that_fit / submit's check count a windowed group's window, not the sequence: a job
    longer than the cache's tokens fits when most layers are windowed; an all-global model's need is the
    sequence."""
    make("gemma3", tmp_path)
    model = exl2cpp.load(tmp_path)
    eng = exl2cpp.Engine(model, cache_tokens=256, page_size=PAGE, max_batch_tokens=32)
    try:
        need = eng.tokens_needed(480)
        # full group: 30 pages; each windowed group at most ceil((8 - 1 + 64 + 32) / 16) + 1 = 8 pages
        assert need == -(-(30 + 2 * 8) * PAGE // 3)
        assert need < 256 < 480
        assert _C.engine_cache_tokens(model._core, 480, PAGE, 32) == need
        assert eng.jobs_that_fit(480) == 16 * 3 // (30 + 16)
        job = eng.submit(ids_of(400, seed=8), max_new_tokens=79, temperature=0.0, ignore_eos=True)
        job.result()
        assert len(job.token_ids) == 79
    finally:
        eng.close()
    make("gemma3", tmp_path, layer_types=["full_attention"] * 6)
    model = exl2cpp.load(tmp_path)
    eng = exl2cpp.Engine(model, cache_tokens=256, page_size=PAGE, max_batch_tokens=32)
    try:
        assert eng.stats()["layer_groups"] == 1 and eng.tokens_needed(480) == 480
        assert _C.engine_cache_tokens(model._core, 480, PAGE, 32) == 480
        with pytest.raises(exl2cpp.OutOfMemoryError):
            eng.submit(ids_of(400, seed=8), max_new_tokens=79)
    finally:
        eng.close()


@pytest.mark.slow
def test_gemma3_270m_past_the_window(gemma3_dir, gpl3_text):
    """Gemma 3 270M (window 512): a 1000-token prompt (the GPL-3) and 16 greedy tokens through the engine are HF
    fp32's, the windowed groups gave pages back; and the memory an 8k-token job needs, before (every page of every
    layer) and after (3 full layers x 8192 + 15 windowed layers x their window, margin and a step's rows)."""
    hf = transformers.Gemma3ForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    model = exl2cpp.load(gemma3_dir, max_seq_len=8192)
    prompt = model.tokenizer.encode(gpl3_text)[:1000]
    eng = exl2cpp.Engine(model, cache_tokens=4096, max_batch_tokens=256)
    try:
        job = eng.submit(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)
        job.result()
        got = list(job.token_ids)
        assert eng.stats()["layer_groups"] == 6 and eng.stats()["pages_window_freed"] > 0
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert got == out[0, len(prompt) :].tolist()
        after = eng.tokens_needed(8192)
    finally:
        eng.close()
    eng = exl2cpp.Engine(model, cache_tokens=2048)  # default page size and step rows
    try:
        default_after = eng.tokens_needed(8192)
    finally:
        eng.close()
    print(f"Gemma 3 270M, 8192-token job: {8192} cache tokens before, {default_after} after (max_batch_tokens "
          f"2048), {after} (max_batch_tokens 256)")
    # 32 full-group pages + 5 windowed groups of at most ceil((511 + 64 + 2048) / 256) + 1 = 12 pages, 3 layers each
    assert default_after == -(-(32 + 5 * 12) * 256 // 6)
    assert after < default_after < 8192 // 2
    # The CPU default cache holds one job of max_seq_len: now its windowed need, not 8192 tokens of every layer.
    from exl2cpp.engine import _default_cache_tokens

    assert _default_cache_tokens(model, 0.9) == max(4096, default_after)


@pytest.mark.cuda
@pytest.mark.skipif(not _HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("cache_type", ["fp16", "q4"])
def test_cuda_windowed_cache_matches_cpu(tmp_path, cache_type):
    """CUDA engine (decode graphs over the per-group page tables, windowed kernels) against the CPU past the
    window. fp16: the CPU engine's greedy tokens (fp16 rounding aside: near ties are not drawn with random weights
    this small). Q4: a code flips wherever fp16 and fp32 keys round to either side of a step, so greedy runs part
    after a few tokens and say nothing about the windowed pages; the CUDA engine's own tokens are teacher-forced
    instead through the CPU's plain Q4 cache (one page table, every page kept): a page read after it was given back
    would show as a large error past the window. The quantized cache's CUDA kernels take head_dim 64, 96, 128 or
    256 (32 is refused when the cache is made)."""
    make("gemma3", tmp_path, head_dim=32 if cache_type == "fp16" else 64)
    prompt = ids_of(150, seed=12)
    cpu_model = exl2cpp.load(tmp_path)
    gpu_model = exl2cpp.load(tmp_path, device="cuda")
    core = engine(gpu_model, cache_type=cache_type)
    gpu = run(core, {"a": (prompt, {"max_new_tokens": 60})}, check=check_pages)["a"]
    assert core.stats()["pages_window_freed"] > 0
    if cache_type == "fp16":
        cpu = run(engine(cpu_model, cache_type=cache_type), {"a": (prompt, {"max_new_tokens": 60})})["a"]
        assert gpu[0] == cpu[0]
        np.testing.assert_allclose(gpu[1][:10], cpu[1][:10], atol=2e-2)
        return
    toks, lps = gpu[0], np.asarray(gpu[1])
    ref = log_softmax(plain_logits(cpu_model, prompt + toks, cache_type))[len(prompt) - 1 : -1]
    top = np.argmax(ref, axis=1)
    assert sum(int(a == b) for a, b in zip(top, toks)) >= 54, (top.tolist(), toks)
    err = np.abs(lps - ref[np.arange(60), toks])
    # (on the CPU, its Q4 engine against an fp16 plain cache: 56 of 60, mean 0.11, max 0.37)
    assert err.mean() < 8e-2 and err.max() < 1.0, err.round(3).tolist()


def test_windowed_pages_evicted_while_the_prefix_runs(tmp_path):
    """A running job's windowed pages behind its window are held by the prefix table only: another job's need
    evicts them (the entries keep their full-group page, which the running job holds), and a later job with the
    running job's prefix still gets plain decoding's tokens (it adopts only a prefix whose windowed pages are all
    there: here none)."""
    make("gemma3", tmp_path)
    model = exl2cpp.load(tmp_path)
    prefix = ids_of(150, seed=13)
    jobs = {
        "a": (prefix, {"max_new_tokens": 100, "at": 0}),
        "b": (ids_of(200, seed=14), {"max_new_tokens": 10, "at": 60}),
        "c": (prefix[:140] + ids_of(7, seed=15), {"max_new_tokens": 10, "at": 75}),
    }
    want = {k: run(engine(model, prefix_cache=False), {"x": (p, {"max_new_tokens": kw["max_new_tokens"]})})["x"][0]
            for k, (p, kw) in jobs.items()}  # fmt: skip
    core = engine(model, cache_tokens=320)
    cached = []

    def on_step(core, ids):
        a = next(j for j, k in ids.items() if k == "a")
        if core.job_pages(a, 2):  # a is running: its full-group pages stay in the table
            cached.append(core.stats()["pages_cached"])

    out = run(core, jobs, check=check_pages, on_step=on_step)
    for k in jobs:
        assert out[k][0] == want[k], k
    peak = cached.index(max(cached))
    assert min(cached[peak:]) < max(cached), cached  # windowed pages of a's entries were evicted while a ran
    # c's windowed pages inside the window of every adoption point were among those evicted: it adopts none (its
    # full-group pages alone would leave the windowed layers without keys)
    assert core.stats()["tokens_reused"] == 0
    core.clear_prefix_cache()
    assert core.stats()["pages_used"] == 0


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory):
    """Tiny targets and drafts over the same vocabulary: Mistral (every layer windowed) and Gemma 2 (full layers
    too)."""
    out = {}
    for kind in ("mistral", "gemma2"):
        folder = tmp_path_factory.mktemp(f"draft_{kind}")
        make(kind, folder)
        out[kind] = exl2cpp.load(folder)
        out[kind + "_draft"] = exl2cpp.load(folder)  # a model of its own drafts for itself
    return out


def _draft_used(core):
    s = core.stats()
    return s["draft_pages_total"] - s["draft_pages_free"]


@pytest.mark.parametrize("target", ["mistral", "gemma2"])
def test_draft_model_gives_back_pages_behind_its_window(draft_models, target):
    """A draft model whose every layer has a window (Mistral, window 8) keeps, once a job decodes, only the draft
    pages from d_cached - window + 1 - margin on: its used draft pages stay within the window + margin + a decode
    row while the job runs 15 pages past it; the tokens are plain decoding's, and the draft (the target model
    itself when the target is Mistral) reads the right K/V through the window: every draft is accepted. Every draft
    page is back at the end (prefix cache off)."""
    model, draft = draft_models[target], draft_models["mistral_draft"]
    prompt = ids_of(40, seed=2)
    want = run(engine(model), {"a": (prompt, {"max_new_tokens": 200})})["a"][0]
    core = engine(model, prefix_cache=False, draft_model=draft._core, draft_tokens=4)
    bound = -(-(WINDOW - 1 + MARGIN + 4 + 1) // PAGE) + 1
    peaks = []

    def on_step(core, ids):
        for jid in ids:
            if len(core.job_tokens(jid)) > len(prompt) + 8:  # decoding, past the first catch-up of the prompt
                peaks.append(_draft_used(core))

    got = run(core, {"a": (prompt, {"max_new_tokens": 200})}, check=check_pages, on_step=on_step)["a"][0]
    assert got == want
    s = core.stats()
    assert s["spec_proposed"] > 0 and s["draft_pages_window_freed"] > 0, s
    if target == "mistral":
        assert s["spec_accepted"] == s["spec_proposed"], s
    assert peaks and max(peaks) <= bound < -(-(len(prompt) + 200) // PAGE), (max(peaks), bound)
    assert _draft_used(core) == 0 and s["pages_used"] == 0


def test_draft_model_with_full_layers_keeps_every_page(draft_models):
    """A draft model with full layers (Gemma 2) gives nothing back behind its windowed layers (one page table):
    same tokens as plain decoding, no draft page freed on the way, all returned at the end."""
    model = draft_models["mistral"]
    prompt = ids_of(40, seed=5)
    want = run(engine(model), {"a": (prompt, {"max_new_tokens": 150})})["a"][0]
    core = engine(model, prefix_cache=False, draft_model=draft_models["gemma2_draft"]._core, draft_tokens=3)
    assert run(core, {"a": (prompt, {"max_new_tokens": 150})}, check=check_pages)["a"][0] == want
    s = core.stats()
    assert s["spec_proposed"] > 0 and s["draft_pages_window_freed"] == 0
    assert _draft_used(core) == 0


def test_draft_window_with_prefix_sharing_and_rewinds(draft_models):
    """Draft pages behind the window with the prefix cache on (full draft pages registered before they are given
    back; a second job adopts them) and rewinds within and past the margin (past it the job's draft pages are
    dropped and its draft recomputes from position 0): tokens are plain decoding's, every draft accepted, and after
    clear_prefix_cache no draft page is held."""
    model = draft_models["mistral"]
    prompt = ids_of(30, seed=9)
    want = run(engine(model), {"a": (prompt, {"max_new_tokens": 150})})["a"][0]
    core = engine(model, draft_model=draft_models["mistral_draft"]._core, draft_tokens=4)
    out = run(core, {"a": (prompt, {"max_new_tokens": 150}), "b": (prompt, {"max_new_tokens": 150, "at": 200})},
              check=check_pages)  # fmt: skip
    assert out["a"][0] == want and out["b"][0] == want
    s = core.stats()
    assert s["draft_pages_window_freed"] > 0 and s["spec_accepted"] == s["spec_proposed"] > 0, s
    for keep_back in (3, 140):
        core = engine(model, prefix_cache=False, draft_model=draft_models["mistral_draft"]._core, draft_tokens=4)
        jid = core.submit(prompt, max_new_tokens=150, sampler=greedy())
        toks, rewound = [], False
        while not core.idle:
            for _jid, token, _lp, _top, _finished, _reason, error in core.step():
                assert not error
                if token >= 0:
                    toks.append(token)
            if not rewound and len(toks) >= 145:
                assert core.rewind(jid, len(toks) - keep_back, -1)
                del toks[len(toks) - keep_back :]
                rewound = True
        assert toks == want[: len(toks)] and len(toks) == 150, keep_back
        s = core.stats()
        assert s["spec_accepted"] == s["spec_proposed"] > 0 and _draft_used(core) == 0, (keep_back, s)
    core.clear_prefix_cache()


@pytest.mark.cuda
@pytest.mark.skipif(not _HAS_CUDA, reason="no CUDA device")
def test_cuda_draft_model_gives_back_pages_behind_its_window(draft_models):
    """On CUDA (draft forwards with pages behind the window read as the scratch page): the draft model drafting for
    itself keeps its used draft pages within the window + margin + a decode row, nearly every draft is accepted (f16
    numerics of a batch vs a row may split a near-tie), and every draft page is back at the end."""
    folder = draft_models["mistral"].path
    model, draft = exl2cpp.load(folder, device="cuda:0"), exl2cpp.load(folder, device="cuda:0")
    prompt = ids_of(40, seed=2)
    core = engine(model, prefix_cache=False, draft_model=draft._core, draft_tokens=4)
    bound = -(-(WINDOW - 1 + MARGIN + 4 + 1) // PAGE) + 1
    peaks = []

    def on_step(core, ids):
        for jid in ids:
            if len(core.job_tokens(jid)) > len(prompt) + 8:
                peaks.append(_draft_used(core))

    toks = run(core, {"a": (prompt, {"max_new_tokens": 200})}, check=check_pages, on_step=on_step)["a"][0]
    assert len(toks) == 200
    s = core.stats()
    assert s["draft_pages_window_freed"] > 0 and s["spec_accepted"] >= 0.9 * s["spec_proposed"] > 0, s
    assert peaks and max(peaks) <= bound, (max(peaks), bound)
    assert _draft_used(core) == 0 and s["pages_used"] == 0
