"""Banned strings: the engine's rewind (C++: bans per position, cache pages given back or recomputed, resampling)
on a tiny random model, the text layer (held text, rewinds, order with stop strings, validation) on a fake
tokenizer, and end to end on SmolLM2 (streamed pieces, batches, seeds, pages)."""

from __future__ import annotations

import threading

import exl2cpp
import pytest
from exl2cpp import _C
from exl2cpp.engine import Job
from exl2cpp.errors import InvalidArgumentError

torch = pytest.importorskip("torch")
from test_models_hf import make_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_banned")
    make_hf_model("llama", {"max_position_embeddings": 1024}, folder, seed=5)
    return exl2cpp.load(folder)


def greedy():
    return _C.SamplerSettings(temperature=0.0)


def step_until(core, want: dict[int, int], toks: dict[int, list[int]], fin: dict[int, str]):
    """Step until every job id in `want` has want[id] tokens (or finished). Tokens go to toks, reasons to fin."""
    for _ in range(10000):
        if all(len(toks[j]) >= n or j in fin for j, n in want.items()):
            return
        for jid, token, _lp, _top, finished, reason, error in core.step():
            assert not error, error
            if token >= 0:
                toks.setdefault(jid, []).append(token)
            if finished:
                fin[jid] = reason
    raise AssertionError("jobs did not progress")


def run_alone(tiny_core, prompt, n, page_size):
    core = _C.Engine(tiny_core, cache_tokens=1024, page_size=page_size, max_batch_tokens=64)
    jid = core.submit(prompt, max_new_tokens=n, sampler=greedy())
    toks, fin = {jid: []}, {}
    step_until(core, {jid: 10**9}, toks, fin)
    return toks[jid]


def assert_no_pages_left(core):
    s = core.stats()
    assert s["pages_reserved"] == 0 and s["jobs_active"] == 0
    core.clear_prefix_cache()
    assert core.stats()["pages_used"] == 0


# ---- the C++ rewind -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("keep", [0, 3, 9])
def test_rewind_without_ban_regenerates_the_same_tokens(tiny, page_size, prefix_cache, keep):
    # Greedy: after taking tokens back (no ban), the job must produce exactly the tokens it had; any stale or lost
    # K/V row in the pages it kept or recomputed would change them.
    prompt = list(range(7, 20))  # 13 tokens: pages of 4 end mid-prompt
    ref = run_alone(tiny._core, prompt, 30, page_size)
    core = _C.Engine(
        tiny._core,
        cache_tokens=1024,
        page_size=page_size,
        max_batch_tokens=64,
        prefix_cache=prefix_cache,
    )
    if (
        prefix_cache
    ):  # a finished twin first: the job's complete pages then sit in the prefix table too
        core.submit(prompt, max_new_tokens=30, sampler=greedy())
        while not core.idle:
            core.step()
    jid = core.submit(prompt, max_new_tokens=30, sampler=greedy())
    toks, fin = {jid: []}, {}
    step_until(core, {jid: 21}, toks, fin)
    assert toks[jid] == ref[:21]
    assert core.rewind(jid, keep) is True
    assert core.job_tokens(jid) == prompt + ref[:keep]
    del toks[jid][keep:]
    step_until(core, {jid: 10**9}, toks, fin)
    assert toks[jid] == ref and fin[jid] == "length"
    assert core.stats()["rewinds"] == 1
    assert_no_pages_left(core)


def test_rewind_with_ban_resamples_that_position(tiny):
    prompt = list(range(30, 47))
    ref = run_alone(tiny._core, prompt, 20, 8)
    core = _C.Engine(tiny._core, cache_tokens=1024, page_size=8, max_batch_tokens=64)
    jid = core.submit(prompt, max_new_tokens=20, sampler=greedy())
    toks, fin = {jid: []}, {}
    step_until(core, {jid: 12}, toks, fin)
    assert core.rewind(jid, 5, ref[5])
    del toks[jid][5:]
    step_until(core, {jid: 10**9}, toks, fin)
    out = toks[jid]
    assert out[:5] == ref[:5] and out[5] != ref[5] and len(out) == 20
    # with ref[5] banned at index 5 the job is greedy again from index 6 on: a fresh greedy job whose prompt is
    # the new prefix continues identically
    cont = run_alone(tiny._core, prompt + out[:6], 14, 8)
    assert out[6:] == cont
    # and the token at index 5 is the argmax with ref[5] excluded
    alt = _C.Engine(tiny._core, cache_tokens=1024, page_size=8)
    a = alt.submit(
        prompt + out[:5],
        max_new_tokens=1,
        sampler=_C.SamplerSettings(temperature=0.0, banned_tokens=[ref[5]]),
    )
    t2, f2 = {a: []}, {}
    step_until(alt, {a: 10**9}, t2, f2)
    assert t2[a] == [out[5]]
    assert_no_pages_left(core)


def test_rewind_into_pages_another_job_adopted(tiny):
    # Job A's generated pages are adopted by job B (B's prompt is A's text so far); rewinding A must not write
    # them: A gives them back (B keeps them), recomputes its kept rows into fresh pages, and both jobs produce
    # exactly their solo outputs. Page counts end at zero.
    ps = 4
    prompt_a = list(range(50, 63))  # 13 tokens
    ref_a = run_alone(tiny._core, prompt_a, 40, ps)
    prompt_b = prompt_a + ref_a[:16]
    ref_b = run_alone(tiny._core, prompt_b, 6, ps)
    core = _C.Engine(tiny._core, cache_tokens=512, page_size=ps, max_batch_tokens=64)
    ja = core.submit(prompt_a, max_new_tokens=40, sampler=greedy())
    toks, fin = {ja: []}, {}
    step_until(core, {ja: 22}, toks, fin)
    jb = core.submit(prompt_b, max_new_tokens=6, sampler=greedy())
    toks[jb] = []
    step_until(core, {jb: 1}, toks, fin)
    pages_a, pages_b = core.job_pages(ja), core.job_pages(jb)
    shared = set(pages_a) & set(pages_b)
    assert len(shared) >= 6  # B adopted A's prompt and generated pages
    assert core.rewind(ja, 3)  # L = 16: the page of position 15 is shared with B
    del toks[ja][3:]
    assert not set(core.job_pages(ja)[3:]) & shared
    for p in shared:
        assert core.page_refcount(p) >= 1
    step_until(core, {ja: 10**9, jb: 10**9}, toks, fin)
    assert toks[ja] == ref_a and toks[jb] == ref_b
    assert_no_pages_left(core)


def test_rewind_bad_arguments(tiny):
    core = _C.Engine(tiny._core, cache_tokens=256, page_size=16)
    jid = core.submit(list(range(5, 10)), max_new_tokens=8, sampler=greedy())
    assert core.rewind(jid, 0) is False  # queued, nothing generated
    toks, fin = {jid: []}, {}
    step_until(core, {jid: 3}, toks, fin)
    with pytest.raises(InvalidArgumentError, match="keep"):
        core.rewind(jid, 3)  # only 3 generated: keep must be < 3
    with pytest.raises(InvalidArgumentError, match="ban"):
        core.rewind(jid, 1, 10**6)
    assert core.rewind(12345, 0) is False
    core.cancel(jid)
    core.step()
    assert core.rewind(jid, 0) is False


# ---- the text layer (fake tokenizer: ids are fixed strings) -------------------------------------------------

PIECES = ["The", " cap", "ital", " is", " Par", "is", ".", " Lyon", "s", " P"]


class FakeTok:
    eos_ids: list[int] = []

    def decode(self, ids, skip_special=False):
        return "".join(PIECES[i] for i in ids)


class FakeCore:
    def __init__(self):
        self.rewinds = []
        self.cancels = []

    def rewind(self, job_id, keep, ban=-1):
        self.rewinds.append((keep, ban))
        return True

    def cancel(self, job_id, reason="cancelled"):
        self.cancels.append(reason)
        return True


class FakeEngine:
    def __init__(self):
        self._core = FakeCore()


def fake_job(stop=(), banned=()):
    from exl2cpp.tokenizer import StreamDecoder

    eng = FakeEngine()
    return Job(eng, 1, [0], list(stop), StreamDecoder(FakeTok()), None, list(banned)), eng._core


def feed(job, ids, final=None):
    for i, t in enumerate(ids):
        last = final is not None and i == len(ids) - 1
        job._on_event(t, -0.5, [], last, final or "", "")
    return list(job._chunks)


def test_text_is_held_then_rewound():
    job, core = fake_job(banned=["Paris"])
    assert feed(job, [0, 3]) == ["The", " is"]
    feed(job, [4])  # " Par": could grow into "Paris": held from the token's start
    assert job._chunks == ["The", " is"]
    feed(job, [5])  # "is" completes "Paris": rewind to token 2 (" Par"), banned there
    assert core.rewinds == [(2, 4)] and job.token_ids == [0, 3] and job.text == "The is"
    assert job.rewinds == 1
    feed(job, [7, 6], final="length")
    assert "".join(job._chunks) == "The is Lyon." == job.result()
    assert job.finish_reason == "length"


def test_held_text_is_released_when_it_diverges():
    job, core = fake_job(banned=["Paris"])
    feed(job, [0, 4])
    assert job._chunks == ["The"]
    feed(job, [7])  # " Par Lyon": no longer a prefix of "Paris"
    assert "".join(job._chunks) == "The Par Lyon" and core.rewinds == []


def test_banned_string_inside_one_token_and_across_three():
    job, core = fake_job(banned=["al is P"])
    feed(job, [0, 1, 2, 3])  # "The capital is": "al is" may still become "al is P"
    assert "".join(job._chunks) == "The cap"
    feed(job, [4])  # " Par" completes it: it began in token 2 ("ital")
    assert core.rewinds == [(2, 2)] and job.text == "The cap"


def test_stop_string_before_banned_string_wins():
    # stop " is" starts (3) before banned "is Lyon" (4): the job stops there; the banned text is never shown
    job, core = fake_job(stop=[" is"], banned=["is Lyon"])
    feed(job, [0, 3])
    assert core.cancels == ["stop_string"] and job.finish_reason == "stop_string"
    job._on_event(-1, 0.0, [], True, "stop_string", "")
    assert job.result() == "The" and core.rewinds == []


def test_banned_string_before_stop_string_rewinds():
    # banned "Paris" starts (4) before the stop string "is" inside it (7): rewind, not stop
    job, core = fake_job(stop=["is."], banned=["Paris"])
    feed(job, [0, 4, 5])
    assert core.rewinds == [(1, 4)] and core.cancels == [] and job.text == "The"


def test_banned_string_completed_by_the_last_token_is_cut():
    job, _core = fake_job(banned=["Paris"])
    feed(
        job, [0, 4, 5], final="length"
    )  # the engine already finished the job: no rewind, cut instead
    assert job.result() == "The" and job.token_ids == [0] and job.finish_reason == "length"


# ---- SmolLM2 end to end ---------------------------------------------------------------------------------------

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return exl2cpp.load(smollm2_dir, max_seq_len=2048)


@pytest.fixture(scope="module")
def engine(smol):
    eng = exl2cpp.Engine(smol, cache_tokens=4096, page_size=16, max_batch_tokens=256)
    yield eng
    eng.close()


def collect(job):
    pieces = list(job)
    return pieces, job.result()


def test_smollm2_banned_word_never_appears(engine):
    base = engine.generate(PROMPT, max_new_tokens=24, temperature=0.0)
    assert "Paris" in base
    job = engine.submit(PROMPT, max_new_tokens=24, temperature=0.0, banned_strings=["Paris"])
    pieces, text = collect(job)
    assert job.finish_reason in ("length", "stop_token") and job.rewinds >= 1
    assert "".join(pieces) == text and text.strip()
    assert "Paris" not in text and not any("Paris" in p for p in pieces)
    assert engine.tokenizer.decode(job.token_ids) == text
    # a multi-token banned string and a second one that the model turns to next
    job = engine.submit(
        PROMPT, max_new_tokens=24, temperature=0.0, banned_strings=["Paris", "capital of"]
    )
    pieces, text = collect(job)
    assert "".join(pieces) == text and "Paris" not in text and "capital of" not in text
    s = engine.stats()
    assert s["jobs_active"] == 0 and s["pages_reserved"] == 0
    engine.clear_prefix_cache()
    assert engine.stats()["pages_used"] == 0  # rewinds leaked no page


def test_smollm2_banned_job_in_a_batch_leaves_neighbours_unchanged(engine):
    prompts = ["The capital of Italy is", PROMPT, "Water boils at", "The largest planet is"]
    alone = [engine.generate(p, max_new_tokens=16, temperature=0.0) for p in prompts]
    jobs = [
        engine.submit(
            p, max_new_tokens=16, temperature=0.0, banned_strings=["Paris"] if p == PROMPT else None
        )
        for p in prompts
    ]
    outs = [j.result() for j in jobs]
    for p, a, o in zip(prompts, alone, outs):
        if p == PROMPT:
            assert "Paris" not in o and o != a
        else:
            assert o == a
    assert jobs[1].rewinds >= 1


def test_smollm2_seeded_sampling_with_banned_strings_is_reproducible(engine):
    kw = {
        "max_new_tokens": 24,
        "temperature": 1.0,
        "top_k": 20,
        "seed": 1234,
        "banned_strings": ["Paris", " the"],
    }
    outs = []
    for _ in range(2):
        job = engine.submit(PROMPT, **kw)
        pieces, text = collect(job)
        assert "".join(pieces) == text
        assert "Paris" not in text and " the" not in text
        outs.append((text, list(job.token_ids)))
    # and the same next to other jobs
    other = engine.submit("Once upon a time", max_new_tokens=30, temperature=0.9, seed=5)
    job = engine.submit(PROMPT, **kw)
    assert (job.result(), list(job.token_ids)) == outs[0] == outs[1]
    other.result()


def test_smollm2_model_generate_and_stream_take_banned_strings(smol):
    text = smol.generate(PROMPT, max_new_tokens=12, temperature=0.0, banned_strings=["Paris"])
    pieces = list(smol.stream(PROMPT, max_new_tokens=12, temperature=0.0, banned_strings=["Paris"]))
    assert "Paris" not in text and "".join(pieces) == text


def test_banned_strings_validation(engine):
    for bad, match in [
        ([""], "non-empty"),
        ([1], "non-empty string"),
        (["x"] * 1025, "at most 1024"),
        (["x" * 513], "at most 512"),
        (42, "list of non-empty strings"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            engine.submit(PROMPT, max_new_tokens=2, banned_strings=bad)

    class Constraint:
        def mask(self):
            return []

        def advance(self, token):
            return []

    with pytest.raises(InvalidArgumentError, match="constrained decoding"):
        engine.submit(PROMPT, max_new_tokens=2, banned_strings=["a"], constraint=Constraint())
    # a single string is one banned string
    assert "Paris" not in engine.generate(
        PROMPT, max_new_tokens=8, temperature=0.0, banned_strings="Paris"
    )


def test_smollm2_cancel_during_banned_generation_returns_pages(engine):
    job = engine.submit(
        PROMPT, max_new_tokens=200, temperature=0.0, banned_strings=["Paris", "."], ignore_eos=True
    )
    done = threading.Event()

    def consume():
        for _ in job:
            job.cancel()
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert done.wait(60)
    assert job.finish_reason == "cancelled"
    engine.clear_prefix_cache()
    s = engine.stats()
    assert s["pages_used"] == 0 and s["pages_reserved"] == 0


def test_smollm2_rewind_cap_ends_a_job_the_model_keeps_steering_into(engine):
    # Nearly every token SmolLM2 would write here holds a space: without a cap the job would rewind for ever.
    job = engine.submit(PROMPT, max_new_tokens=24, temperature=0.0, banned_strings=[" "])
    pieces, text = collect(job)
    assert job.finish_reason == "banned_string_limit" and job.rewinds == 16  # the default cap
    assert " " not in text and "".join(pieces) == text
    job = engine.submit(
        PROMPT, max_new_tokens=24, temperature=0.0, banned_strings=["e"], max_rewinds=3
    )
    pieces, text = collect(job)
    assert job.finish_reason == "banned_string_limit" and job.rewinds == 3
    assert "e" not in text and "".join(pieces) == text and text.strip()
    # what it kept is the greedy text up to the 4th banned string: the same job with a larger cap goes further
    longer = engine.generate(
        PROMPT, max_new_tokens=24, temperature=0.0, banned_strings=["e"], max_rewinds=-1
    )
    assert longer.startswith(text) and len(longer) > len(text)
    with pytest.raises(InvalidArgumentError, match="max_rewinds"):
        engine.submit(PROMPT, max_new_tokens=2, banned_strings=["e"], max_rewinds=-2)
    s = engine.stats()
    assert s["jobs_active"] == 0 and s["pages_reserved"] == 0


def test_server_max_rewinds_extension_field(engine):
    pydantic = pytest.importorskip("pydantic")
    from exl2cpp.server.app import _sampling
    from exl2cpp.server.schemas import CompletionRequest

    req = CompletionRequest(prompt=PROMPT, temperature=0.0, banned_strings=["e"], max_rewinds=2)
    s = _sampling(req, engine.model.tokenizer, engine.model.vocab_size)
    assert s["max_rewinds"] == 2
    job = engine.submit(PROMPT, max_new_tokens=24, **s)
    assert (
        "e" not in job.result() and job.finish_reason == "banned_string_limit" and job.rewinds == 2
    )
    assert "max_rewinds" not in _sampling(CompletionRequest(prompt=PROMPT), engine.model.tokenizer, engine.model.vocab_size)
    with pytest.raises(pydantic.ValidationError, match="max_rewinds"):
        CompletionRequest(prompt=PROMPT, max_rewinds=-2)
