"""The dashboard (`GET /` of `python -m moejax.serve`) in a real browser: headless Chromium loads the page from a
real server on 127.0.0.1 (the default model), types a prompt, clicks Send, waits for the streamed completion to
finish, and checks that the output is there and that the heat map, refreshed from /v1/moejax/cache, shows the
request's hits and misses cell for cell as the server reports them, with no JavaScript exception on the way;
then that a second Send clears the finished mark at once, and that a request the server refuses ends marked
"error" with the server's message shown.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages ended by a
NUL byte, read by the browser on its fd 3 and written on its fd 4), so the test needs nothing beyond the standard
library and a Chromium binary; it is skipped when none is on PATH. Set ``MOEJAX_DASHBOARD_SCREENSHOT=path.png``
to save a screenshot of the page after the request (1280 x 800); by default nothing is written.
"""

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from test_serve import PROMPT, _free_port, _start  # skips this module too without the serve and test extras

MAX_TOKENS = 20  # PROMPT and 20 tokens, as test_serve's first request: in one run the compiled programs are shared
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTH, HEIGHT = 1280, 800

# becomes Chromium: moves the two pipe ends it was given (numbered >= 10) onto fds 3 and 4, then execs the browser
_EXEC_WITH_PIPE = "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); " \
                  "os.execv(sys.argv[3], sys.argv[3:])"


def _browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """A headless Chromium and one page of it, driven over the DevTools protocol on a pipe (stdlib only)."""

    def __init__(self, exe: str, profile: str):
        to_browser_r, self._w = os.pipe()
        self._r, from_browser_w = os.pipe()
        # the browser's ends move to fds >= 10 first, so that putting them on 3 and 4 cannot overwrite either
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w)]
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                 f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--mute-audio", "about:blank"]
        self.log = open(os.path.join(profile, "chromium.log"), "w+")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _EXEC_WITH_PIPE, *map(str, ends), exe, *flags],
                                         pass_fds=ends, stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            for fd in (to_browser_r, from_browser_w, *ends):
                os.close(fd)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session = None
        try:
            target = self.send("Target.createTarget", {"url": "about:blank"}, timeout=60)["targetId"]
            self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            self.send("Emulation.setDeviceMetricsOverride",
                      {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
            self.send("Runtime.enable")
            self.send("Page.enable")
        except BaseException:
            self.close()
            raise

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError(f"Chromium went away (status {self.proc.poll()}): {self.log.read()[-2000:]}")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, timeout: float = 30, page: bool = True) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if page and self.session:
            message["sessionId"] = self.session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._w, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") != self._next_id:
                self.events.append(reply)
                continue
            if "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            return reply.get("result", {})

    def eval(self, expression: str):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout} s for {what}")
            time.sleep(0.2)

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the middle of the element."""
        x, y = self.eval(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                         ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def type_into(self, selector: str, text: str) -> None:
        """Focuses the field, selects what is in it, and types ``text`` over it (as keyboard input)."""
        self.eval(f"(() => {{ const t = document.querySelector({json.dumps(selector)}); t.focus(); t.select(); }})()")
        self.send("Input.insertText", {"text": text})

    def screenshot(self, path: str) -> None:
        png = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        with open(path, "wb") as f:
            f.write(png)

    def exceptions(self) -> list[str]:
        """The uncaught JavaScript exceptions the page has thrown so far."""
        return [e["params"]["exceptionDetails"].get("exception", {}).get("description")
                or e["params"]["exceptionDetails"].get("text") for e in self.events
                if e.get("method") == "Runtime.exceptionThrown"]

    def close(self) -> None:
        try:
            self.send("Browser.close", page=False, timeout=5)
        except Exception:  # noqa: BLE001 - it is killed below either way
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:  # the browser and whatever it started (its own process group): nothing is left running
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        os.close(self._r)
        os.close(self._w)
        self.log.close()


def _states(cache: dict) -> dict:
    """What each heat-map cell should say for the cache view the server reports (the dashboard's own rule)."""
    out = {}
    for layer in range(cache["layers"]):
        for expert in range(cache["experts"]):
            h, m = cache["recent"]["hits"][layer][expert], cache["recent"]["misses"][layer][expert]
            resident = cache["resident"][layer][expert]
            out[f"{layer},{expert}"] = "miss" if m > 0 and m >= h else "hit" if h > 0 else \
                "resident" if resident else "empty"
    return out


CELLS = ("Object.fromEntries([...document.querySelectorAll('#heatmap td')]"
         ".map(td => [td.dataset.layer + ',' + td.dataset.expert, td.dataset.state]))")


def test_dashboard_streams_a_completion_and_shows_its_hits_and_misses():
    exe = _browser()
    if exe is None:
        pytest.skip(f"the dashboard test needs Chromium: none of {', '.join(BROWSERS)} is on PATH")
    profile = tempfile.mkdtemp(prefix="moejax-dashboard-chromium-")
    server = browser = None
    try:
        port = _free_port()
        server = _start(port)
        base = f"http://127.0.0.1:{port}"
        browser = Chromium(exe, profile)
        browser.send("Page.navigate", {"url": base + "/"})
        browser.wait_for("document.readyState === 'complete' && document.querySelectorAll('#heatmap td').length > 0"
                         " && $('model').textContent !== '…'", 30,
                         "the page to load its model and its first heat map")
        with urllib.request.urlopen(base + "/v1/moejax/cache", timeout=30) as r:
            before = json.loads(r.read())
        cells = browser.eval(CELLS)
        assert cells == _states(before)  # a fresh server: one cell per (layer, expert), no hit or miss yet
        assert len(cells) == before["layers"] * before["experts"] and {"hit", "miss"}.isdisjoint(cells.values())

        browser.type_into("#prompt", PROMPT)
        browser.type_into("#max_tokens", str(MAX_TOKENS))
        assert browser.eval("[$('prompt').value, $('max_tokens').value]") == [PROMPT, str(MAX_TOKENS)]
        browser.click("#send")
        done = browser.wait_for("$('output').dataset.done", 90, "the streamed completion")
        output = browser.eval("$('output').textContent")
        assert done == "1", f"the request ended badly: {output!r}"
        assert output.strip(), "the completion is empty"
        assert "tokens" in browser.eval("$('stats').textContent")

        with urllib.request.urlopen(base + "/v1/moejax/cache", timeout=30) as r:
            after = json.loads(r.read())
        assert after["requests_finished"] == 1
        expected = _states(after)
        deadline = time.monotonic() + 10  # the heat map catches up within its one-second refresh
        while (cells := browser.eval(CELLS)) != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cells == expected, "the heat map does not show what /v1/moejax/cache reports"
        states = list(cells.values())
        assert "hit" in states and "miss" in states, states
        assert browser.exceptions() == []

        shot = os.environ.get("MOEJAX_DASHBOARD_SCREENSHOT")
        if shot:
            browser.screenshot(shot)

        # Send again: the done mark of the last request goes at once (click() runs send() up to its first await)
        assert browser.eval("(() => { $('send').click(); return $('output').dataset.done ?? null; })()") is None
        assert browser.wait_for("$('output').dataset.done", 30, "the second completion") == "1"
        assert browser.eval("$('output').textContent").strip()

        # a request the server refuses (400) ends too, marked "error", with the server's message shown
        browser.type_into("#max_tokens", "0")
        browser.click("#send")
        assert browser.wait_for("$('output').dataset.done", 30, "the refused request to end") == "error"
        assert "max_tokens" in browser.eval("$('output').textContent")
        assert browser.exceptions() == []
    finally:
        if browser is not None:
            browser.close()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(profile, ignore_errors=True)
