"""`python -m moejax.serve` against a real server on 127.0.0.1 (the default model, --max-queue 2): the official
`openai` client, streaming and not, chat and completions, stop strings, seeds, equality with model.generate,
every error status, a bounded load test whose cache counters add up, a client killed mid-stream, SIGTERM,
and the engine's shared cache carried from request to request (in process)."""

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the test extra (openai client)")
pytest.importorskip("fastapi", reason="the serve tests need the serve extra (FastAPI, uvicorn)")

import moejax  # noqa: E402
from moejax.experts import routing  # noqa: E402
from moejax.runtime import serve, serve_engine, simulate  # noqa: E402

PROMPT = "The history of the"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def _post(url: str, body, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _start(port: int, *extra: str, model: str = "default") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "moejax.serve", "--model", model, "--port", str(port),
                             "--max-queue", "2", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read()}")
        try:
            if _get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the server did not come up in 120 s")


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = _start(port)
    base = f"http://127.0.0.1:{port}"
    yield base, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def model():
    return moejax.load("default")


def test_completions_equal_model_generate_streaming_or_not(server, model):
    base, client = server
    assert [m.id for m in client.models.list().data] == ["default"]
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=20)
    served = r.model_extra["moejax"]["token_ids"]
    ids = model.encode(PROMPT)
    # original routing: cache-independent; the server prefills bucketed (bf16 rounding differs from one piece)
    assert served == model.generate(ids, max_new_tokens=20, bucketed=True).token_ids
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 20
    assert r.choices[0].finish_reason == "length"
    text = r.choices[0].text
    assert text == model.text(ids + served)[len(model.text(ids)):]  # prompt + text reads as one
    stream = client.completions.create(model="default", prompt=PROMPT, max_tokens=20, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming_equals_not_streaming_and_stop_strings_cut(server):
    _, client = server
    msgs = [{"role": "user", "content": "Tell me about the city"}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=24)
    full = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and len(full) > 10
    stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    word = full.split()[len(full.split()) // 2]
    stop = " " + word
    cut = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[:full.find(stop)]
    streamed = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:full.find(stop)]


def test_seed_makes_sampling_reproducible(server):
    _, client = server
    kw = dict(model="default", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a
    assert any(client.completions.create(seed=s, **kw).choices[0].text != a for s in (8, 9))


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({}, 400, "'prompt' is required"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 1020}, 400, "does not fit"),
    ({"prompt": [1] * 1024}, 400, "context"),
    ({"prompt": [99999]}, 400, "token ids"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPT, "n": 2}, 400, "'n'"),
    ({"prompt": PROMPT, "n": True}, 400, "'n'"),
    ({"prompt": PROMPT, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": PROMPT, "repetition_penalty": "1.2"}, 400, "repetition_penalty"),
    ({"prompt": PROMPT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"prompt": PROMPT, "max_completion_tokens": 40}, 400, "max_completion_tokens"),
    (b'{"prompt": "a", "max_tokens": ' + b"2" * 5000 + b"}", 400, "not valid JSON"),
    ({"prompt": PROMPT, "logprobs": 3}, 400, "logprobs"),
    ({"prompt": PROMPT, "top_k": -2}, 400, "'top_k' must be in [-1"),
    ({"prompt": PROMPT, "top_k": 1.5}, 400, "'top_k' must be an integer"),
    ({"prompt": PROMPT, "min_p": 0.1}, 400, "'min_p' must be 0"),  # other servers' extensions: not ignored
    ({"prompt": PROMPT, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": PROMPT, "ignore_eos": True}, 400, "ignore_eos"),
    ({"prompt": PROMPT, "skip_special_tokens": 1}, 400, "skip_special_tokens"),
    ({"prompt": PROMPT, "guided_json": {"type": "object"}}, 400, "guided_json"),
    ({"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ({"prompt": PROMPT, "stop": 5}, 400, "stop"),
    ({"prompt": PROMPT, "moejax": {"routing": "telepathy"}}, 400, "moejax.routing"),
    ({"prompt": PROMPT, "moejax": {"lamda": 0.3}}, 400, "unknown keys"),
    ({"prompt": PROMPT, "moejax": "cache-prior"}, 400, "'moejax' must be an object"),
    ({"prompt": PROMPT, "moejax": {"lam": 0.3}}, 400, "only applies to routing cache-prior"),
    ({"prompt": PROMPT, "stream": "yes"}, 400, "'stream'"),
    ({"prompt": PROMPT, "stream_options": 5}, 400, "'stream_options'"),
    ({"prompt": PROMPT, "moejax": {"routing": "max-rank", "max_rank": 99999999999999999999}}, 400, "max_rank"),
    ({"prompt": PROMPT, "moejax": {"routing": "cache-prior", "delta": -1}}, 400, "delta"),
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "surrogate"),
    (b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
    ({"prompt": "x" * (9 << 20)}, 413, "over 8 MiB"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": PROMPT, "model": 5}, 400, "'model' must be a string"),
], ids=lambda value: repr(value)[:40] if isinstance(value, (bytes, dict, list)) else None)  # short ids: a test's id
# goes into PYTEST_CURRENT_TEST, and a 200 kB one made the server subprocess's exec fail (E2BIG)
def test_every_bad_request_gets_an_openai_error_object(server, body, status, words):
    base, _ = server
    code, reply = _post(base + "/v1/completions", body)
    assert code == status and words in reply["error"]["message"], reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_neutral_values_of_other_servers_sampling_fields_are_accepted(server):
    base, _ = server
    body = {"prompt": PROMPT, "max_tokens": 2, "top_k": -1, "min_p": 0.0, "min_tokens": 0, "ignore_eos": False,
            "stop_token_ids": [], "skip_special_tokens": True, "n": 1, "logprobs": None}
    code, reply = _post(base + "/v1/completions", body)
    assert code == 200 and reply["usage"]["completion_tokens"] == 2, reply


def test_chat_and_routes_errors(server):
    base, client = server
    for body, words in (({"messages": []}, "non-empty"), ({"messages": [{"content": "x"}]}, "role"),
                        ({"messages": [{"role": "user", "content": 3}]}, "content")):
        code, reply = _post(base + "/v1/chat/completions", body)
        assert code == 400 and words in reply["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt=PROMPT, max_tokens=-3)
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(base + "/v1/nothing")
    assert e.value.code == 404 and "error" in json.loads(e.value.read())
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(base + "/v1/completions")
    assert e.value.code == 405


def test_load_every_request_completes_or_gets_429_and_the_cache_counters_add_up(server):
    base, _ = server
    before = json.loads(_get(base + "/v1/moejax/cache")[1])["summary"]

    def client(i: int) -> list[tuple[int, dict]]:
        out = []
        for j in range(4):
            body = {"prompt": PROMPT, "max_tokens": 4 + (i + j) % 3}
            if j % 3 == 1:
                body["moejax"] = {"routing": "cache-prior", "lam": 0.5}
            out.append(_post(base + "/v1/completions", body, timeout=120))
        return out

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(client, range(8)) for r in rs]
    assert time.time() - t0 < 240
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429} and codes.count(200) >= 3 and codes.count(429) >= 1, codes
    assert all(r["error"]["code"] == "queue_full" for c, r in results if c == 429)
    after = json.loads(_get(base + "/v1/moejax/cache")[1])["summary"]
    ok = [r["moejax"]["cache"] for c, r in results if c == 200]
    for key in ("accesses", "misses", "loads"):
        assert after[key] - before[key] == sum(o[key] for o in ok), key
    metrics = _get(base + "/metrics")[1]
    assert f'moejax_requests_total{{endpoint="completions",status="429"}} {codes.count(429)}' in metrics \
        or codes.count(429) == 0


def test_a_client_killed_mid_stream_frees_the_engine(server):
    base, client = server
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"prompt": PROMPT, "max_tokens": 900, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b"data:" not in received:  # streaming has begun
        part = sock.recv(4096)
        assert part, "the server closed the stream"
        received += part
    sock.close()  # the client dies
    t0 = time.time()
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=5)
    assert r.usage.completion_tokens == 5 and time.time() - t0 < 30
    generated = [float(line.split()[-1]) for line in _get(base + "/metrics")[1].splitlines()
                 if line.startswith("moejax_generated_tokens_total")][0]
    assert generated < 900  # the abandoned generation did not run to its end


def test_engine_carries_one_cache_across_requests_and_routing_overrides(model):
    """The engine's requests are model.generate calls that carry the router state on (per-request policy
    override, the cache kept); the shared cache changes what cache-prior routes."""
    policy = routing.make_policy("original", model.cfg.top_k)
    cache = simulate.CacheConfig(size="0.25")
    engine = serve_engine.Engine(model, policy, cache, max_queue=4)
    try:
        ids = model.encode(PROMPT)
        jobs = [serve_engine.Job(ids, 12), serve_engine.Job(ids, 12, routing={"routing": "cache-prior", "lam": 0.9}),
                serve_engine.Job(ids[:3], 7, routing={"routing": "cache-prior", "lam": 0.9})]
        served = [engine.run(j) for j in jobs]
        state = model.router_state(policy, cache)
        for job, got in zip(jobs, served):
            p = engine.policy_for(job.routing)
            r = model.generate(job.prompt_ids, max_new_tokens=job.max_tokens, state={**state, "policy": p},
                               bucketed=True)
            state = r.router_state
            assert got["token_ids"] == r.token_ids
        view = engine.cache_view()
        assert np.array_equal(np.asarray(view["resident"], bool), np.asarray(state["cache"].resident))
        assert view["summary"]["accesses"] == sum(s["cache"]["accesses"] for s in served)
        assert sum(map(sum, view["recent"]["hits"])) + sum(map(sum, view["recent"]["misses"])) \
            == served[-1]["cache"]["accesses"]
    finally:
        engine.close()


def test_sigterm_and_sigint_stop_the_server_cleanly():
    """Also: a client that goes away in the middle of its request body leaves no traceback in the log."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        port = _free_port()
        proc = _start(port)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            time.sleep(0.3)
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 200
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "ClientDisconnect" not in err, err
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2)


def test_ctrl_c_ends_an_open_stream_with_its_last_chunk():
    """The generation is cancelled when the signal comes: the client gets a finish_reason and [DONE], not a
    stream cut off mid-way after uvicorn's graceful wait, with 'Event loop is closed' tracebacks."""
    port = _free_port()
    proc = _start(port, "--offload", "--bandwidth-gbps", "0.005")  # slow pages: the stream is still open
    lines: list[str] = []

    def client():
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": PROMPT, "max_tokens": 1000, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            lines.extend(line.decode() for line in r)

    reader = threading.Thread(target=client)
    reader.start()
    deadline = time.time() + 60
    while not any(line.startswith("data: {") for line in lines) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    reader.join(60)
    assert proc.wait(timeout=60) == 0
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-2:] == ["data: [DONE]\n", "\n"] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "Traceback" not in proc.stderr.read()


def test_bad_options_are_one_line_errors(capsys):
    assert serve.main(["--model", "default", "--cache-size", "0"]) == 2
    assert capsys.readouterr().err.startswith("error:")
    assert serve.main(["--model", "/nonexistent/model"]) == 1
    assert serve.main(["--port", "70000"]) == 2
    port = _free_port()
    with socket.socket() as s:  # the port is taken
        s.bind(("127.0.0.1", port))
        s.listen()
        proc = subprocess.run([sys.executable, "-m", "moejax.serve", "--port", str(port)], capture_output=True,
                              text=True, timeout=120)
        # refused before the model loads, and without first saying where it serves
        assert serve.main(["--model", "/nonexistent/model", "--port", str(port)]) == 1
        assert "could not listen" in capsys.readouterr().err
    assert proc.returncode == 1 and "could not listen" in proc.stderr and "Traceback" not in proc.stderr
    assert "http://" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("error:")
    assert serve.main(["--host", "no-such-host.invalid"]) == 2
    assert "--host" in capsys.readouterr().err


def test_a_failing_model_gets_500_and_the_server_goes_on(tmp_path):
    """Damaged weights (NaN router logits): each request is a 500 naming the layer, streamed or not, and the
    server keeps answering."""
    from support.hf_models import get_hf_model
    from safetensors.numpy import load_file, save_file

    folder = str(tmp_path / "model")
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.mlp.gate.weight"][:] = np.nan
    save_file(tensors, path, metadata={"format": "pt"})
    port = _free_port()
    proc = _start(port, "--served-name", "broken", model=folder)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(2):
            code, reply = _post(base + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3})
            assert code == 500 and "MoE layer 1" in reply["error"]["message"], reply
        code, reply = _post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert code == 400 and "no tokenizer" in reply["error"]["message"]
        req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": [1, 2], "max_tokens": 3, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert "MoE layer 1" in json.loads(events[0])["error"]["message"] and events[-1] == "[DONE]"
        assert json.loads(_get(base + "/v1/models")[1])["data"][0]["id"] == "broken"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_warm_up_compiles_every_program_the_requests_within_its_bounds_need():
    """After ``warm_up`` no request within its bounds makes XLA compile anything (counted by JAX's backend-compile
    events, not by time: CI's run once took 0.58 s to lower an already compiled program in a long-lived worker)."""
    from support.hf_models import get_moejax_model
    from support.programs import compile_events

    m = get_moejax_model("qwen3_moe")
    engine = serve_engine.Engine(m, routing.make_policy("cache-prior", m.cfg.top_k), simulate.CacheConfig())
    try:
        with compile_events() as compiles:
            engine.warm_up(max_prompt=20, max_tokens=20)  # one KV bucket: pieces 1..16 and its decode chunk
            assert compiles  # the warm-up compiled (the counting works)
            compiles.clear()
            for n in (1, 3, 17, 20):
                for new in (1, 2, 20):
                    engine.run(serve_engine.Job(list(range(3, 3 + n)), new))
                    assert not compiles, (n, new, compiles)
            for sampling in (dict(temperature=0.8, top_p=0.9), dict(temperature=1.1, top_k=5, repetition_penalty=1.2),
                             dict(repetition_penalty=1.3)):  # warmed greedy: each request's sampling compiles nothing
                engine.run(serve_engine.Job(list(range(3, 13)), 20, **sampling))
                assert not compiles, (sampling, compiles)
            engine.run(serve_engine.Job(list(range(3, 43)), 2))  # past the bounds: compiles (the check can fail)
            assert compiles
            # a second KV bucket: its decode chunk and the growth of the prompt's cache into it, no new prefill
            compiles.clear()
            engine.warm_up(max_prompt=20, max_tokens=100)
            assert compiles and not [c for c in compiles if "prefill" in str(c)], compiles
            compiles.clear()
            for n, new in ((20, 100), (3, 70), (1, 50)):
                engine.run(serve_engine.Job(list(range(3, 3 + n)), new))
                assert not compiles, (n, new, compiles)
            assert engine.cache_view()["summary"]["tokens"] > 0
    finally:
        engine.close()


def test_top_k_and_repetition_penalty_act_as_in_model_generate(server, model):
    _, client = server
    kw = dict(max_tokens=10, temperature=0.9, seed=5)
    extra = {"top_k": 3, "repetition_penalty": 1.3}
    served = client.completions.create(model="default", prompt=PROMPT, extra_body=extra, **kw)
    ref = model.generate(model.encode(PROMPT), max_new_tokens=10, temperature=0.9, seed=5, top_k=3,
                         repetition_penalty=1.3, bucketed=True)
    assert served.model_extra["moejax"]["token_ids"] == ref.token_ids
    plain = client.completions.create(model="default", prompt=PROMPT, **kw)
    assert plain.model_extra["moejax"]["token_ids"] != ref.token_ids


def test_requests_leaving_sampling_out_get_the_checkpoints_settings():
    """As vLLM: the checkpoint's generation_config.json fills the sampling fields a request leaves out
    (``--generation-config none``: the engine gets no defaults); what a request sends wins."""
    from support.hf_models import get_moejax_model

    m = get_moejax_model("qwen3_moe")
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    engine = serve_engine.Engine(m, routing.make_policy("original", m.cfg.top_k), simulate.CacheConfig(),
                                 sampling_defaults=defaults)
    try:
        front = serve.Server(engine)
        job = front.job({"prompt": [3, 4, 5]}, chat=False)
        assert (job.temperature, job.top_p, job.top_k, job.repetition_penalty) == (0.7, 0.8, 20, 1.05)
        job = front.job({"prompt": [3, 4, 5], "temperature": 0, "top_k": -1}, chat=False)
        assert (job.temperature, job.top_p, job.top_k, job.repetition_penalty) == (0.0, 1.0, 0, 1.05)
    finally:
        engine.close()


def test_routing_parameters_alone_adjust_the_served_policy():
    """``"moejax": {"top_j": 1}`` on a cache-prior server was refused as if the server routed 'original'; it
    adjusts the served policy, keeping the parameters the server was started with."""
    from support.hf_models import get_moejax_model

    m = get_moejax_model("qwen3_moe")
    served = routing.make_policy("cache-prior", m.cfg.top_k, lam=0.8, delta=2.0)
    engine = serve_engine.Engine(m, served, simulate.CacheConfig(), routing_params={"lam": 0.8, "delta": 2.0})
    try:
        over = serve._routing_override({"moejax": {"top_j": 1}}, engine.policy.kind)
        assert over == {"routing": "cache-prior", "top_j": 1}
        p = engine.policy_for(over)
        assert p.kind == "cache-prior" and float(p.lam) == pytest.approx(0.8) and float(p.delta_fixed) == 2.0
        assert int(p.top_j) == 1
        other = engine.policy_for(serve._routing_override({"moejax": {"routing": "cumsum"}}, engine.policy.kind))
        assert other.kind == "cumsum" and float(other.cumsum_p) == pytest.approx(0.9)  # another kind: its defaults
        assert serve._routing_override({"moejax": {}}, "learned-prior") is None  # nothing to override
        with pytest.raises(serve_engine.RequestError, match="only applies to routing cache-prior"):
            serve._routing_override({"moejax": {"lam": 0.3}}, "original")
    finally:
        engine.close()


def test_shutdown_answers_a_generation_that_cannot_stop_and_waits_for_it(monkeypatch):
    """Ctrl-C while a request's program compiles (tens of seconds cold): the request is answered 503 after
    ``ABANDON_AFTER_S`` and ``close`` waits for the worker (``serve._close_engine``: with a note), instead of a
    stream cut off and the interpreter exiting under the still-compiling worker (status 134)."""
    from support.hf_models import get_moejax_model

    monkeypatch.setattr(serve_engine, "ABANDON_AFTER_S", 0.2)
    m = get_moejax_model("qwen3_moe")
    engine = serve_engine.Engine(m, routing.make_policy("original", m.cfg.top_k), simulate.CacheConfig())
    started, release = threading.Event(), threading.Event()

    def uninterruptible(job):  # like an XLA compile: deaf to cancellation until done
        started.set()
        release.wait(10)
        return {"token_ids": []}

    engine.run = uninterruptible
    events, waiting = [], []
    engine.submit(serve_engine.Job([3, 4], 2, emit=lambda kind, payload: events.append((kind, payload))))
    engine.submit(serve_engine.Job([3, 4], 2, emit=lambda kind, payload: waiting.append((kind, payload))))
    assert started.wait(10)
    engine.cancel_all()
    assert waiting[0][0] == "error" and waiting[0][1].status == 503  # queued: answered at once
    time.sleep(0.5)
    assert events and events[0][0] == "error" and events[0][1].status == 503  # running: after ABANDON_AFTER_S
    assert engine.close(timeout=0.2) is False  # still "compiling"
    release.set()
    assert engine.close(timeout=None) is True and engine.close(timeout=0) is True


def test_health_answers_while_the_server_loads_and_compiles_and_a_request_after_ready_compiles_nothing():
    """``/health`` answers from the moment the server listens: 503 with what it is doing (loading, then
    compiling k of n programs), 200 when ready; other routes say ``not_ready`` meanwhile. After the warm-up a
    request within its bounds compiles nothing."""
    port = _free_port()
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "moejax.serve", "--port", str(port), "--warmup", "4",
                             "--warmup-new-tokens", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, first_answer, refused_early = [], None, None
    try:
        while time.time() - t0 < 300:
            assert proc.poll() is None, proc.stderr.read()
            try:
                status, body = _get(f"http://127.0.0.1:{port}/health", timeout=5)
            except urllib.error.HTTPError as e:
                status, body = e.code, e.read().decode()
            except OSError:  # not listening yet: only before its first answer
                assert first_answer is None, "/health stopped answering"
                time.sleep(0.1)
                continue
            first_answer = first_answer or time.time() - t0
            state = json.loads(body)
            if status == 200:
                break
            assert status == 503 and state["status"] in ("loading", "compiling"), state
            if not seen or seen[-1] != state["detail"]:
                seen.append(state["detail"])
            if refused_early is None:
                refused_early = _post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
            time.sleep(0.1)
        assert state["status"] == "ok", state
        assert any("compiling" in d and "shapes" in d for d in seen), seen
        assert refused_early[0] == 503 and refused_early[1]["error"]["code"] == "not_ready", refused_early
        code, reply = _post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 16})
        assert code == 200 and reply["moejax"]["compile_time_s"] < 0.5, reply["moejax"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    err = proc.stderr.read()
    assert "ready after" in err and "Traceback" not in err, err
    print(f"/health first answered {first_answer:.1f} s after the start; {len(seen)} states seen")
