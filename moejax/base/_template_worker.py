"""The child process that renders chat templates for ``moejax.base.templates`` (run as a script, never imported
by the package: it must start fast, so it imports nothing of moejax and nothing but Jinja).

A chat template comes from a checkpoint, often an untrusted hub repository, and Jinja's sandbox bounds what a
template may touch, not how long it runs or how much it allocates (two nested ``range(100000)`` loops are
allowed). Here a template runs under an address-space limit and an output-size limit; the parent bounds its
time by killing this process. Protocol: one JSON object a line on stdin, one JSON reply a line on stdout.
"""

import json
import resource
import sys

#: address space this process may use: a template that allocates more gets a MemoryError, not the host's memory
ADDRESS_SPACE_BYTES = 1 << 30


def _environment():
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env


def _render(env, compiled: dict, request: dict) -> dict:
    import jinja2
    import jinja2.sandbox

    source = request["template"]
    try:
        if source not in compiled:
            compiled.clear()
            compiled[source] = env.from_string(source)
        template = compiled[source]
    except jinja2.TemplateSyntaxError as e:
        return {"syntax": e.message or str(e), "line": e.lineno}
    limit, size, parts = request["max_chars"], 0, []
    try:
        for part in template.generate(**request["variables"]):
            size += len(part)
            if size > limit:
                return {"too_long": limit}
            parts.append(part)
    except jinja2.sandbox.SecurityError as e:  # the template's fault, whatever the messages
        return {"error": f"it reached outside the sandbox: {e}"}
    except jinja2.TemplateError as e:  # raise_exception(...) in the template: it refuses these messages
        return {"refused": str(e)}
    except MemoryError:
        return {"memory": ADDRESS_SPACE_BYTES}
    except RecursionError:
        return {"error": "it recursed too deeply"}
    except Exception as e:  # noqa: BLE001 - whatever a template does wrong is its error, reported, not a crash
        return {"error": f"{type(e).__name__}: {e}"}
    return {"text": "".join(parts)}


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    env, compiled = _environment(), {}
    for line in sys.stdin:
        reply = _render(env, compiled, json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # run by path: its folder (moejax/base) must not shadow the modules Jinja imports
    main()
