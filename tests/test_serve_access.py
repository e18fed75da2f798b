"""What `python -m moejax.serve` must not serve, must not keep doing, and must not wait for, against real servers on
127.0.0.1 with a real HTTP client: requests a web page could send (foreign Host, foreign Origin, non-JSON bodies,
no key), prompts too long to tokenise, a checkpoint's chat template that never ends, clients that go away or never
finish their body, and signals while a worker thread is busy."""

import concurrent.futures
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (FastAPI, uvicorn)")

from test_serve import PROMPT, _free_port, _get, _start  # noqa: E402

from moejax.runtime import serve, serve_access  # noqa: E402

KEY = "k3y-for-tests"
UI = "http://ui.example:3000"
LOOP = '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}'


def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             timeout: float = 120) -> tuple[int, dict, dict]:
    """(status, lower-case headers, JSON body or {}) of one request; ``headers`` replace the defaults (a Host of
    127.0.0.1:port, JSON content for a body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = {"Host": f"127.0.0.1:{port}", **({"Content-Type": "application/json"} if body is not None else {}),
            **(headers or {})}
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    for k, v in sent.items():
        if v is not None:
            conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(body or b"")))
    conn.endheaders(body)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        reply = json.loads(raw) if raw else {}
    except ValueError:
        reply = {"text": raw.decode(errors="replace")}
    return r.status, {k.lower(): v for k, v in r.getheaders()}, reply


def _body(**fields) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": 2, **fields}).encode()


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM, within: float = 30) -> tuple[int, float, str]:
    t0 = time.time()
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the server did not stop within {within} s of {sig!r}") from None
    return rc, time.time() - t0, proc.stderr.read()


def test_requests_a_web_page_could_send_are_refused_and_the_key_is_checked():
    port = _free_port()
    proc = _start(port, "--api-key", KEY, "--cors-origins", UI)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        # the key: every route but /health and the dashboard page; as the OpenAI client sends it
        assert _request(port, "GET", "/health")[0] == 200
        status, _, reply = _request(port, "GET", "/")
        assert status == 200 and "apikey" in reply["text"]
        for path in ("/v1/models", "/v1/moejax/cache", "/metrics", "/v1/models/default"):
            status, headers, reply = _request(port, "GET", path)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key", path
            assert headers["www-authenticate"] == "Bearer"
            assert _request(port, "GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401
            assert _request(port, "GET", path, headers={"Authorization": KEY})[0] == 401  # no scheme
            assert _request(port, "GET", path, headers=auth)[0] == 200, path
        assert _request(port, "POST", "/v1/completions", _body())[0] == 401
        import openai
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        assert client.completions.create(model="default", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="no", max_retries=0).models.list()
        # bodies a page can send without a preflight
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            status, _, reply = _request(port, "POST", "/v1/completions", _body(),
                                        headers={**auth, "Content-Type": kind})
            assert status == 415 and reply["error"]["code"] == "unsupported_media_type", kind
        assert _request(port, "POST", "/v1/completions", _body(),
                        headers={**auth, "Content-Type": "application/json; charset=utf-8"})[0] == 200
        # DNS rebinding: the page's own domain in Host, whatever the key
        for host in ("evil.example", "evil.example:%d" % port, "127.0.0.1.evil.example", "0.0.0.0", "10.0.0.1"):
            status, _, reply = _request(port, "POST", "/v1/completions", _body(), headers={**auth, "Host": host})
            assert status == 403 and reply["error"]["code"] == "forbidden_host", host
            assert _request(port, "GET", "/health", headers={"Host": host})[0] == 403
        for host in ("localhost:%d" % port, "127.0.0.2", "[::1]:%d" % port, "LOCALHOST"):
            assert _request(port, "GET", "/v1/models", headers={**auth, "Host": host})[0] == 200, host
        # Origin: the server's own pages and the listed origins only
        status, _, reply = _request(port, "GET", "/v1/models", headers={**auth, "Origin": "http://evil.example"})
        assert status == 403 and reply["error"]["code"] == "forbidden_origin"
        assert _request(port, "GET", "/v1/models", headers={**auth, "Origin": f"http://127.0.0.1:{port}"})[0] == 200
        status, headers, _ = _request(port, "GET", "/v1/models", headers={**auth, "Origin": UI})
        assert status == 200 and headers["access-control-allow-origin"] == UI
        pre = {"Origin": UI, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = _request(port, "OPTIONS", "/v1/completions", headers=pre)
        assert status == 200 and headers["access-control-allow-origin"] == UI
        assert "authorization" in headers["access-control-allow-headers"].lower()
        status, headers, _ = _request(port, "OPTIONS", "/v1/completions", headers={**pre, "Origin": "http://evil.example"})
        assert status >= 400 and "access-control-allow-origin" not in headers
    finally:
        rc, _, err = _stop(proc)
    assert rc == 0 and "Traceback" not in err


def test_access_rules_from_the_command_line(monkeypatch):
    monkeypatch.delenv(serve_access.API_KEY_ENV, raising=False)
    assert serve_access.access_from_args("127.0.0.1", None, None) == serve_access.Access()
    assert not serve_access.access_from_args("0.0.0.0", None, None).loopback_only
    assert serve_access.access_from_args("::1", None, None).loopback_only
    monkeypatch.setenv(serve_access.API_KEY_ENV, "from-env")
    assert serve_access.access_from_args("127.0.0.1", None, None).api_key == "from-env"
    assert serve_access.access_from_args("127.0.0.1", "given", None).api_key == "given"
    assert serve_access.access_from_args("127.0.0.1", None, "http://a:1, HTTPS://B/").cors_origins == (
        "http://a:1", "https://b")
    for bad in (("--api-key", ""), ("--api-key", "two words"), ("--cors-origins", "evil.example"),
                ("--cors-origins", "http://a/path"), ("--cors-origins", ","), ("--request-timeout", "0"),
                ("--request-timeout", "nan")):
        assert serve.main(["--model", "/nonexistent", *bad]) == 2, bad
    monkeypatch.setenv(serve_access.API_KEY_ENV, " ")
    assert serve.main(["--model", "/nonexistent"]) == 2


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised(server_without_key):
    """Ten concurrent 7 MB prompts: each refused at once, /health answering all along."""
    port = server_without_key
    big = json.dumps({"prompt": "word " * ((7 << 20) // 5), "max_tokens": 2}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "x" * (7 << 20)}]}).encode()

    def post(i):
        t0 = time.time()
        status, _, reply = _request(port, "POST", "/v1/chat/completions" if i % 2 else "/v1/completions",
                                    chat if i % 2 else big)
        return status, reply, time.time() - t0

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(post, i) for i in range(10)]
        t0 = time.time()
        health = _request(port, "GET", "/health", timeout=10)[0]
        health_s = time.time() - t0
        results = [f.result() for f in futures]
    assert health == 200 and health_s < 5, health_s
    for status, reply, took in results:
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert "characters" in reply["error"]["message"] and took < 30


@pytest.fixture(scope="module")
def server_without_key():
    port = _free_port()
    proc = _start(port, "--request-timeout", "3")
    yield port
    rc, _, err = _stop(proc)
    assert rc == 0 and "Traceback" not in err, err


def test_abandoned_requests_stop_and_a_body_that_never_arrives_times_out(server_without_key):
    port = server_without_key
    # a non-streaming request whose client goes away: the generation stops (it ran to max_tokens before)
    generated = lambda: sum(float(line.split()[-1]) for line in _get(f"http://127.0.0.1:{port}/metrics")[1]  # noqa: E731
                            .splitlines() if line.startswith("moejax_generated_tokens_total"))
    before = generated()
    for _ in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", _body(max_tokens=900), {"Content-Type": "application/json"})
        time.sleep(1.0)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    t0 = time.time()
    status, _, reply = _request(port, "POST", "/v1/completions", _body(max_tokens=3))
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    assert time.time() - t0 < 60
    assert generated() - before < 3 * 900 / 2, "the abandoned generations ran on"
    metrics = _get(f"http://127.0.0.1:{port}/metrics")[1]
    assert 'status="499"' in metrics
    # a body that never arrives: answered 408 after --request-timeout and the connection freed
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 1000\r\n\r\n{{\"prompt\": ".encode())
        t0 = time.time()
        reply = s.recv(4096).decode()
        while "did not arrive" not in reply and (part := s.recv(4096)):
            reply += part.decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 3 s" in reply
    assert 2 < time.time() - t0 < 30


def _with_template(tmp_path, template: str) -> str:
    folder = tmp_path / "model"
    shutil.copytree(os.environ["MOEJAX_DEFAULT_MODEL"], folder)
    (folder / "chat_template.jinja").write_text(template)
    return str(folder)


def test_a_chat_template_that_never_ends_is_cut_off_and_signals_still_stop_the_server(tmp_path):
    folder = _with_template(tmp_path, LOOP)
    # generate --chat: one error line within the render bound, not a hang
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "moejax.generate", "--model", folder, "--chat", "--prompt", "hi",
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and time.time() - t0 < 60, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and "within 5 s" in proc.stderr
    assert "Traceback" not in proc.stderr
    port = _free_port()
    server = _start(port, model=folder)
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    t0 = time.time()
    status, _, reply = _request(port, "POST", "/v1/chat/completions", chat)
    assert status == 500 and "within 5 s" in reply["error"]["message"] and time.time() - t0 < 20
    assert _request(port, "POST", "/v1/completions", _body())[0] == 200  # the server goes on
    # SIGTERM while a template renders: the server stops within seconds, without SIGKILL
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_request, port, "POST", "/v1/chat/completions", chat)
        time.sleep(1.5)
        rc, took, err = _stop(server, within=20)
        status = pending.result()[0]
    assert rc == 0 and took < 10 and "Traceback" not in err, (took, err)
    assert status in (500, 503)


def test_an_offload_configuration_generate_refuses_is_refused_at_the_start():
    """The model loads after the server listens: the refusal ends the server with one error line, status 2."""
    proc = subprocess.run([sys.executable, "-m", "moejax.serve", "--port", "0", "--offload", "--cache-size", "2"],
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error:") and "K=" in lines[-1], proc.stderr
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in proc.stderr
