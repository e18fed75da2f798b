"""Untrusted chat templates render with bounded time, memory and output (``moejax.base.templates``): each way a
template can run away ends in its own error, the renderer recovers for the next template, and ``close`` releases a
render in progress at once."""

import threading
import time

import pytest

from moejax.base import templates

CHAT = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def test_a_chat_template_renders_as_jinja_renders_it():
    import jinja2.sandbox

    variables = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "é\u2028"}],
                 "add_generation_prompt": True}
    expected = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(CHAT).render(**variables)
    assert templates.render(CHAT, variables) == expected


@pytest.mark.parametrize("template, error, words", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     templates.TemplateBudgetError, "within 1 s"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
     templates.TemplateTooLong, "1,000 characters"),
    ("{{ 'x' * 2000000000 }}", templates.TemplateBudgetError, "MiB of memory"),
    ("{{ 'x' | center(1500000000) }}", templates.TemplateBudgetError, "MiB of memory"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", templates.TemplateBudgetError, "recursed"),
    ("{{ raise_exception('only user turns') }}", templates.TemplateRefused, "only user turns"),
    ("{% for %}", templates.TemplateSyntaxError, "Expected an expression"),
    ("{{ messages.__class__.__mro__ }}", templates.TemplateBudgetError, "unsafe"),
])
def test_each_runaway_template_is_cut_off_and_the_next_renders(template, error, words):
    t0 = time.time()
    with pytest.raises(error, match=words):
        templates.render(template, {"messages": []}, max_chars=1000, timeout_s=1.0)
    assert time.time() - t0 < 10
    assert templates.render("ok {{ 1 + 1 }}", {}) == "ok 2"


def test_close_releases_a_render_in_progress_and_refuses_later_ones(monkeypatch):
    worker = templates._Worker()
    monkeypatch.setattr(templates, "_WORKER", worker)
    caught = []

    def loop():
        try:
            templates.render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                             {}, timeout_s=60)
        except templates.TemplateBudgetError as e:
            caught.append((time.time(), str(e)))

    thread = threading.Thread(target=loop)
    thread.start()
    deadline = time.time() + 30
    while not (worker.lock.locked() and worker.proc is not None) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the render is under way
    t0 = time.time()
    templates.close()
    thread.join(10)
    assert not thread.is_alive() and caught and caught[0][0] - t0 < 3 and "stopping" in caught[0][1], caught
    with pytest.raises(templates.TemplateBudgetError, match="shut down"):
        templates.render("x", {})
