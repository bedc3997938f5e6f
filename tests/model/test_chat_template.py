"""Chat templates render as their authors wrote them: the GGUF file's own
``tokenizer.chat_template`` (or an HF directory's), with the functions HF templates call."""

from __future__ import annotations

import json

import gguf
import jinja2.sandbox
import pytest

from radixserve.model.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2 + 2?"},
]


def render_as_written(template: str, messages, **context) -> str:
    """The template rendered straight by jinja2's sandbox, as HF's chat templates expect."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(template).render(messages=messages, **context)


def test_the_default_models_template_comes_from_its_gguf_file(default_gguf, default_tokenizer):
    reader = gguf.GGUFReader(str(default_gguf))
    template = reader.fields["tokenizer.chat_template"].contents()
    expected = render_as_written(template, MESSAGES, add_generation_prompt=True)
    assert default_tokenizer.render_chat(MESSAGES) == expected
    ids = default_tokenizer.encode_chat(MESSAGES)
    assert ids == default_tokenizer.encode(expected, add_special_tokens=False)


TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant, got ' + m['role']) }}"
    "{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] | tojson }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[assistant at {{ strftime_now('%Y') }}]{% endif %}"
)


@pytest.fixture(scope="module")
def custom_template_dir(tmp_path_factory, default_tokenizer):
    path = tmp_path_factory.mktemp("template")
    default_tokenizer.hf.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)  # the config's template wins
    return path


def test_an_hf_directorys_template_with_hf_functions(custom_template_dir):
    import time

    tok = Tokenizer.from_model_path(custom_template_dir, [2])
    text = tok.render_chat([{"role": "user", "content": 'say "hi"'}])
    assert text == f'[user] "say \\"hi\\""\n[assistant at {time.strftime("%Y")}]'
    with pytest.raises(ValueError, match="roles must be user or assistant, got system"):
        tok.render_chat([{"role": "system", "content": "x"}])
