"""Chat templates are user code: the same text as transformers for normal templates, and every
hostile one stopped (time, output, value and integer caps) as that request's error."""

from __future__ import annotations

import itertools
import tracemalloc

import pytest

from llmctl.batch.loop import BatchLoop
from llmctl.batch.outputs import encode_record, simple_record
from llmctl.batch.rows import InputRow
from llmctl.engine.params import SamplingParams
from llmctl.errors import RequestError
from llmctl.runtime.chat_template import ChatTemplate, TemplateLimits
from llmctl.runtime.loader import Runtime
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from tests.fakes import FakeEngine

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% endif %}{% endfor %}"
)
# namespace, loops with filters, tojson, indent, format, str.format, macros, map/join, generation
RICH = (
    "{%- set ns = namespace(sys='') -%}{%- for m in messages if m.role == 'system' -%}"
    "{%- set ns.sys = ns.sys ~ m.content -%}{%- endfor -%}{{ ns.sys | tojson }}"
    "{% for m in messages | rejectattr('role', 'equalto', 'system') %}"
    "{{ '<%s>' | format(m.role) }}"
    "{% generation %}{{ m.content | indent(2) }}{% endgeneration %}"
    "{{ '{:>6}'.format(loop.index) }}"
    "{% endfor %}{% macro f(x) %}[{{ x | upper }}]{% endmacro %}{{ f('end') }}"
    "{{ messages|map(attribute='role')|join(', ') }}{{ (messages|length * 3) ~ ('-' * 3) }}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "Who art thou?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi\nthere "},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More ünïcode ✓ {{ x }}"},
    ],
]


def _demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


def _runtime(tok) -> Runtime:
    return Runtime(
        model=None,
        config=None,
        tokenizer=tok,
        model_path=DEMO_MODEL_DIR,
        dtype=None,
        device="cpu",
        eos_token_ids=(),
    )


def _their_ids(tok, chat) -> list[int]:
    out = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize(
    "template",
    [None, CHATML, LLAMA3, MISTRAL, RICH],
    ids=["demo", "chatml", "llama3", "mistral", "rich"],
)
def test_normal_templates_render_exactly_as_transformers(template):
    tok = _demo_tokenizer()
    if template is not None:
        tok.chat_template = template
    chats = CHATS[:1] + [CHATS[1][1:]] if template == MISTRAL else CHATS
    rt = _runtime(tok)
    for chat in chats:
        text = ChatTemplate(tok).render(chat)
        assert text == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert rt.apply_chat_template(chat) == _their_ids(tok, chat)


def test_another_models_tokenizer_renders_as_transformers(shakespeare_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shakespeare_model))  # it ships no template: give one
    for template in (CHATML, RICH):
        tok.chat_template = template
        assert _runtime(tok).apply_chat_template(CHATS[1]) == _their_ids(tok, CHATS[1])


def _fake_clock(step: float = 0.01):
    ticks = itertools.count()
    return lambda: next(ticks) * step


HOSTILE = {  # template -> what must stop it
    (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ): "longer than",
    "{% macro f(n) %}{% for i in range(100000) %}{{ f(n) if n else '' }}{% endfor %}{% endmacro %}"
    "{{ f(0) }}{% for i in range(100000) %}{{ f(0) }}{% endfor %}": "longer than",
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}": "output passed",
    "{{ 'x' * 100000000 }}": "would build",
    "{% set l = ['x' * 1000] * 100000 %}{{ l | join('') }}": "would build",
    "{{ 10 ** 100000000 }}": "bits",
    "{% set ns = namespace(x=10**1000) %}{% for i in range(30) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}": "bits",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}": "larger than",
    "{% set ns = namespace(s=['x']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}": "larger than",
    "{{ 'x'.center(1000000000) }}": "argument of",
    "{{ 'x' | center(100000000) }}": "argument of",
    "{{ '{:>1000000000}'.format('x') }}": "would build",
    "{{ '%1000000000s' % 'x' }}": "would build",
    "{{ '%*s' | format(100000000, 'x') }}": "argument of",
    "{% set s = 'a' * 100000 %}{{ s.replace('', 'b' * 100000) }}": "would build",
    "{% set s = '\n' * 1000000 %}{{ s | indent(1000) }}": "would build",
    "{% set s = 'x' * 1000000 %}{% set t %}{% for i in range(100000) %}{{ s }}{% endfor %}"
    "{% endset %}": "would build",
    "{% macro f(x) %}{{ f(x ~ x) }}{% endmacro %}{{ f('a') }}": "larger than",
    "{{ lipsum(1000000) }}": "would build",
    "{{ (1).to_bytes(100000000000, 'big') }}": "argument of",
    "{{ [1] | batch(100000, 'x' * 100000) | list }}": "would build",
    "{% set l = [[1] * 1000] * 1000 %}{{ l | sum(start=[]) | length }}": "steps",
    "{{ ('<>' * 500000) | striptags }}": "steps",
    "{% set l = [['x' * 1000] * 1000] * 1000 %}{{ l | tojson }}": "would build",
    "{{ range(100000) | map('replace', '', 'x' * 100000) | join }}": "in all",
    (
        "{% set s = 'x'.center(1000000) %}"
        "{% for i in range(100000) %}{% set t = s ~ '' %}{% endfor %}"
    ): "in all",
}


@pytest.mark.parametrize("template,reason", HOSTILE.items(), ids=range(len(HOSTILE)))
def test_hostile_templates_are_stopped_before_they_cost_memory(template, reason):
    tok = _demo_tokenizer()
    tok.chat_template = template
    # the time cases on a clock that moves 0.01 s per check, the others on one that stands still
    clock = _fake_clock() if reason == "longer than" else (lambda: 0.0)
    chat = ChatTemplate(tok, TemplateLimits(clock=clock))
    tracemalloc.start()
    try:
        with pytest.raises(RequestError) as e:
            chat.render(CHATS[0])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.code == "chat_template_limit" and reason in e.value.message
    assert peak < 64 << 20  # each would have built hundreds of MB or more


def test_template_errors_name_the_problem_and_the_next_render_works():
    tok = _demo_tokenizer()
    tok.chat_template = MISTRAL
    chat = ChatTemplate(tok)
    with pytest.raises(RequestError, match="roles must alternate") as e:
        chat.render(CHATS[1])
    assert e.value.code == "chat_template_error"
    assert chat.render(CHATS[0]).startswith("<|endoftext|>[INST] Who art thou?")
    for template, message in [
        ("{% for %}", "cannot be used: TemplateSyntaxError"),
        ("{{ foo() }}", "UndefinedError"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "nests too deeply"),
        ("{{ ''.__class__.__mro__() }}", "failed"),
    ]:
        tok.chat_template = template
        with pytest.raises(RequestError, match=message) as e:
            ChatTemplate(tok).render(CHATS[0])
        assert e.value.code == "chat_template_error"


def test_a_hostile_template_fails_its_rows_and_the_job_serves_the_others():
    tok = _demo_tokenizer()
    tok.chat_template = "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"
    given = [
        {"prompt": "ROMEO:"},
        {"messages": CHATS[0]},
        {"prompt": "JULIET:"},
        {"messages": CHATS[1]},
    ]
    rows = [
        InputRow(index=i, position=i, end_position=i + 1, id=i + 1, **kw)
        for i, kw in enumerate(given)
    ]
    out = []

    class Sink:
        def write(self, data):
            out.append(data)

        def commit(self):
            return 0

    job = BatchLoop(
        FakeEngine(),
        _runtime(tok),
        iter(rows),
        Sink(),
        lambda row, r: encode_record(simple_record(row, r)),
        SamplingParams(max_tokens=2),
    )
    stats = job.run()
    assert stats.rows == 4 and stats.errors_by_code == {"chat_template_limit": 2}
    assert [b'"error":null' in line for line in out] == [True, False, True, False]


def test_run_batch_on_a_model_whose_template_builds_gigabytes(tmp_path):
    """The issue's case end to end: `'x' * 100000000` reached 19.6 GB and ignored SIGTERM."""
    import json
    import shutil

    from llmctl.cli import main

    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ 'x' * 100000000 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    inp, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    inp.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [{"prompt": "ROMEO:"}, {"messages": CHATS[0]}, {"prompt": "JULIET:"}]
        )
    )
    assert (
        main(
            [
                "run-batch",
                str(inp),
                "-o",
                str(out),
                "--model",
                str(model),
                "--max-tokens",
                "2",
                "--device",
                "cpu",
                "--report-json",
                str(summary),
                "-q",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["error"]["code"] if r["error"] else None for r in rows] == [
        None,
        "chat_template_limit",
        None,
    ]
    s = json.loads(summary.read_text())
    assert s["input_format"] == "jsonl" and s["errors_by_code"] == {"chat_template_limit": 1}
