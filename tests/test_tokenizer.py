"""Tokenizer: round trips, BOS/EOS rules, SmolLM2's chat template and HF-identical Jinja rendering, StreamDecoder on
multi-byte text, and errors for missing or broken files. Runs on the golden fixture's tokenizer (no import needed)."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest
from exl2cpp.errors import InvalidArgumentError, ModelFileError, ModelFormatError
from exl2cpp.tokenizer import StreamDecoder, Tokenizer

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

TEXTS = [
    "Hello world!",
    "  two leading spaces, trailing  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "digits 0123456789 and 3.14159",
    "ünïcödé café — “quotes” ½ ∑ ≠",
    "日本語のテキスト、中文文本，한국어",
    "emoji 🙂👍🏽🇫🇷 family 👨‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def src(fixtures_dir) -> Path:
    return fixtures_dir / "source"


@pytest.fixture(scope="module")
def tok(src) -> Tokenizer:
    return Tokenizer(src)


@pytest.fixture
def model_copy(src, tmp_path) -> Path:
    """A writable copy of the fixture's tokenizer files."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    return tmp_path


# ---- encode / decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_bos=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_ids_bos_eos_and_specials(tok):
    assert tok.vocab_size == 8192
    assert tok.bos_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_ids == [2] and tok.eos_token == "<|im_end|>"
    # SmolLM2 sets no add_bos_token and its tokenizer has no post-processor: no BOS by default
    assert tok.add_bos_default is False
    assert tok.encode("Hello")[0] != 1
    assert tok.encode("Hello", add_bos=True)[0] == 1
    assert tok.encode("Hello", add_bos=True)[1:] == tok.encode("Hello")
    # never doubled
    assert tok.encode("<|im_start|>user", add_bos=True).count(1) == 1
    # special=True parses control tokens, special=False keeps them as text
    assert tok.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]
    plain = tok.encode("<|im_start|>user<|im_end|>", special=False)
    assert 1 not in plain and 2 not in plain and len(plain) > 3
    assert tok.decode(plain) == "<|im_start|>user<|im_end|>"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2


def test_digits_are_split(tok):
    # SmolLM's pre-tokenizer splits digits one by one: 10 digits -> 10 tokens
    assert len(tok.encode("0123456789")) == 10


def test_bad_inputs(tok):
    with pytest.raises(InvalidArgumentError, match="out of range"):
        tok.decode([5, 8192])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        tok.decode([-1])
    with pytest.raises(InvalidArgumentError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_add_bos_from_config_and_post_processor(model_copy):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(model_copy)
    assert t.encode("hi")[0] == 1 and t.encode("hi", add_bos=False)[0] != 1

    # no add_bos_token, but a post-processor that adds BOS (Llama 3 style): detected
    del cfg["add_bos_token"]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    tj = json.loads((model_copy / "tokenizer.json").read_text())
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
        },
    }
    (model_copy / "tokenizer.json").write_text(json.dumps(tj))
    t = Tokenizer(model_copy)
    assert t.add_bos_default is True
    ids = t.encode("hi")
    assert ids[0] == 1 and ids.count(1) == 1


def test_eos_ids_merge_config_and_generation_config(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["eos_token_id"] = [2, 0]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    assert Tokenizer(model_copy).eos_ids == [2, 0, 5]


# ---- chat template ------------------------------------------------------------------------------


def test_smollm2_chat_template(tok):
    assert tok.has_chat_template
    msgs = [{"role": "user", "content": "Hi"}]
    assert (
        tok.apply_chat_template(msgs)
        == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tok.apply_chat_template(msgs, add_generation_prompt=False)
        == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"
    )
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(tok.apply_chat_template(msgs))
    assert ids[0] == 1 and ids.count(1) == 5 and ids.count(2) == 4


# A template that leans on everything HF's renderer provides: trim_blocks/lstrip_blocks whitespace rules,
# tojson (non-ASCII kept, indent), loop controls, namespace, bos/eos tokens, tools and extra keywords.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{% if tools %}
    Tools: {{ tools | tojson }}
    Pretty: {{ tools[0] | tojson(indent=2) }}
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ loop.index }}:{{ m['role'] | upper }}] {{ m['content'] | trim }}
{% endfor %}
count={{ ns.n }} think={{ enable_thinking | default(false) }}
{% if add_generation_prompt %}>>> {% endif %}{{ eos_token if not add_generation_prompt else '' }}"""


def test_rendering_matches_hf_transformers(model_copy):
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = RICH_TEMPLATE
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer(model_copy)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_copy / "tokenizer.json"),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "string"}}}]
    msgs = [
        {"role": "user", "content": "  Bonjour 日本  "},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "Hi\n"},
    ]
    for kw in (
        {"add_generation_prompt": True},
        {"add_generation_prompt": False, "tools": tools},
        {"add_generation_prompt": True, "tools": tools, "enable_thinking": True},
    ):
        want = hf.apply_chat_template(msgs, chat_template=RICH_TEMPLATE, tokenize=False, **kw)
        assert ours.apply_chat_template(msgs, **kw) == want
    assert "météo" in ours.apply_chat_template(msgs, tools=tools)  # tojson keeps non-ASCII


def test_named_templates_and_chat_template_files(model_copy):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(model_copy)
    msgs = [{"role": "user", "content": "x"}]
    assert t.apply_chat_template(msgs) == "D1"
    assert t.apply_chat_template(msgs, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert t.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"
    assert (
        t.apply_chat_template(msgs, chat_template="literal {{ messages[0].content }}")
        == "literal x"
    )
    with pytest.raises(InvalidArgumentError, match="nope"):
        t.apply_chat_template(msgs, chat_template="nope")
    # the newer HF layout: chat_template.jinja beside the tokenizer wins
    (model_copy / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert Tokenizer(model_copy).apply_chat_template(msgs) == "Jx"


def test_template_helpers_and_sandbox(model_copy):
    def with_template(text: str) -> Tokenizer:
        cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
        cfg["chat_template"] = text
        (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
        return Tokenizer(model_copy)

    msgs = [{"role": "user", "content": "x"}]
    t = with_template(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system message') }}{% endif %}"
    )
    with pytest.raises(InvalidArgumentError, match="needs a system message"):
        t.apply_chat_template(msgs)
    t = with_template("{{ strftime_now('%Y') }}")
    assert t.apply_chat_template(msgs) == str(datetime.date.today().year)
    t = with_template("{{ messages.append(1) }}")  # immutable sandbox: no mutation of inputs
    with pytest.raises(InvalidArgumentError):
        t.apply_chat_template(msgs)
    assert msgs == [{"role": "user", "content": "x"}]
    t = with_template("{{ ''.__class__.__mro__ }}")  # no escape through dunder attributes
    with pytest.raises(InvalidArgumentError):
        t.apply_chat_template(msgs)
    t = with_template("{% for %}")
    with pytest.raises(ModelFormatError, match="syntax"):
        t.apply_chat_template(msgs)
    t = with_template("{% generation %}G{{ messages[0].content }}{% endgeneration %}")
    assert t.apply_chat_template(msgs) == "Gx"
    with pytest.raises(InvalidArgumentError, match="list"):
        t.apply_chat_template("hello")  # type: ignore[arg-type]


def test_no_chat_template(model_copy):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(model_copy)
    assert not t.has_chat_template
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


# ---- StreamDecoder ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS[4:7] + ["mixed ascii 🙂 and 日本 then ascii again 👍🏽!"])
def test_stream_decoder_multibyte(tok, text):
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    chunks = [dec.push(i) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + dec.flush() == text
    # multi-byte characters really were split over several tokens here (the 8192-token vocab has few merges)
    assert "" in chunks


def test_stream_decoder_incomplete_tail_and_reset(tok):
    ids = tok.encode("a🙂")
    assert len(ids) >= 3  # 'a' plus the emoji's byte tokens
    dec = StreamDecoder(tok)
    out = [dec.push(i) for i in ids[:-1]]
    assert "".join(out) == "a"
    assert dec.flush() == "\ufffd"  # the unfinished character, made visible at the end
    assert dec.ids == []
    assert dec.push_many(ids) == "a🙂" and dec.flush() == ""


def test_stream_decoder_long_text_and_specials(tok, gpl3_text):
    text = gpl3_text[:3000]
    ids = tok.encode("<|im_start|>" + text + "<|im_end|>")
    dec = StreamDecoder(tok)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)
    dec = StreamDecoder(tok, skip_special=True)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == text


def test_real_smollm2_tokenizer(smollm2_dir):
    t = Tokenizer(smollm2_dir)
    assert t.vocab_size == 49152 and t.bos_id == 1 and t.eos_ids == [2]
    for text in TEXTS:
        assert t.decode(t.encode(text)) == text
    prompt = t.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith(SMOL_SYSTEM)


# ---- errors -------------------------------------------------------------------------------------


def test_missing_files(tmp_path, src):
    with pytest.raises(ModelFileError, match="does not exist"):
        Tokenizer(tmp_path / "nope")
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    t = Tokenizer(tmp_path)  # tokenizer_config.json and config.json are optional
    assert t.bos_id is None and t.eos_ids == [] and not t.has_chat_template
    with pytest.raises(InvalidArgumentError, match="no BOS"):
        t.encode("x", add_bos=True)


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("tokenizer.json", b"{not json", "tokenizer.json"),
        ("tokenizer.json", b'{"model": {"type": "Nope"}}', "tokenizer.json"),
        ("tokenizer.json", b"\xff\xfe\x00bad", "UTF-8"),
        ("tokenizer_config.json", b'{"chat_template": ', "tokenizer_config.json"),
        ("tokenizer_config.json", b"\xc3\x28", "UTF-8"),
        ("config.json", b"[1, 2", "config.json"),
        ("generation_config.json", b"{,}", "generation_config.json"),
    ],
)
def test_broken_files(model_copy, name, content, match):
    (model_copy / name).write_bytes(content)
    with pytest.raises(ModelFormatError, match=match):
        Tokenizer(model_copy)


# ---- hostile chat templates: a model's template is untrusted input ---------------------------------------------

HOSTILE_SLOW = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested list loops": "{% for a in [1] * 1000 %}{% for b in [1] * 1000 %}{% for c in [1] * 1000 %}"
    "{% endfor %}{% endfor %}{% endfor %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    "{{ f(60) }}",
    "recursive loop": "{% for x in [1, 2] recursive %}{{ loop([1, 2]) if loop.depth < 60 }}{% endfor %}",
}
HOSTILE_BIG = {
    "string times": "{{ 'a' * 10**9 }}",
    "list times": "{{ ([1] * 10**9)|length }}",
    "power": "{{ 7 ** (10**9) }}",
    "center filter": "{{ 'x'|center(10**9) }}",
    "center method": "{{ 'x'.center(10**9) }}",
    "percent format": "{{ '%0999999999d' % 1 }}",
    "format method": "{{ '{:>999999999}'.format(1) }}",
    "format filter": "{{ '%999999999s'|format('x') }}",
    "join": "{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|join }}",
    "replace": "{{ ('a' * 1000000).replace('a', 'b' * 1000) }}",
    "concat doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "plus doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "block set doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s %}{{ ns.s }}"
    "{{ ns.s }}{% endset %}{% endfor %}{{ ns.s|length }}",
    "output": "{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}",
}


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", list(HOSTILE_SLOW) + list(HOSTILE_BIG))
def test_hostile_templates_stop_themselves(model_copy, name):
    """Templates that ran for hours or took gigabytes: each render stops itself with a ModelFormatError naming the
    template file and the limit, within the time limit and without allocating the big value."""
    import time

    from exl2cpp.tokenizer import TemplateLimits

    source = {**HOSTILE_SLOW, **HOSTILE_BIG}[name]
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = source
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(model_copy)
    limits = TemplateLimits(timeout_s=0.5, max_chars=4 << 20)
    peak, t0 = _peak_rss_mb(), time.perf_counter()
    limit = "template_timeout_s" if name in HOSTILE_SLOW else "template_max_chars"
    with pytest.raises(ModelFormatError, match=limit) as info:
        t.apply_chat_template([{"role": "user", "content": "x"}], template_limits=limits)
    assert "tokenizer_config.json" in str(info.value)
    assert time.perf_counter() - t0 < 2.0
    assert _peak_rss_mb() - peak < 200, "the render allocated the big value before stopping"


def test_template_limits_leave_normal_templates_alone(tok):
    from exl2cpp.tokenizer import TemplateLimits

    msgs = [{"role": "user", "content": "hello " * 20000}, {"role": "assistant", "content": "hi"}]
    tight = TemplateLimits(timeout_s=5.0, max_chars=1 << 20)
    assert tok.apply_chat_template(msgs, template_limits=tight) == tok.apply_chat_template(msgs)


@pytest.mark.parametrize(
    "source, feature",
    [
        ("{% include 'other.jinja' %}", "include"),
        ("{% extends 'base.jinja' %}", "extends"),
        ("{% import 'macros.jinja' as m %}{{ m.x() }}", "import"),
        ("{% from 'macros.jinja' import x %}{{ x() }}", "import"),
    ],
)
def test_template_loading_other_files_is_a_model_error(model_copy, source, feature):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = source
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=feature) as info:  # was a TypeError (no loader)
        Tokenizer(model_copy).apply_chat_template([{"role": "user", "content": "x"}])
    assert "tokenizer_config.json" in str(info.value)


def test_template_runtime_failures_are_exl2_errors(model_copy):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    for source in (
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # RecursionError
        "{{ messages[0].content.strip() }}",  # None has no strip
        "{{ 1 / 0 }}",
    ):
        cfg["chat_template"] = source
        (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
        with pytest.raises(InvalidArgumentError, match="chat template"):
            Tokenizer(model_copy).apply_chat_template([{"role": "user", "content": None}])
