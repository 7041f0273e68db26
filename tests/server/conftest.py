"""Fixtures: a real `ferrolm serve` on SmolLM2-135M-Instruct Q4_1 (the fast test model, named
explicitly with --model so the tests do not depend on the default model), on a free port chosen
by the server itself (`--port 0`), and OpenAI SDK clients pointed at it.

The binary is $FERROLM_BIN, else target/release/ferrolm (scripts/test.sh builds it).
"""
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache" / "ferrolm" / "models")
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
READY = re.compile(r"at (http://\S+) \(ready in ([0-9.]+) s\)")


def binary() -> str:
    b = os.environ.get("FERROLM_BIN") or str(ROOT / "target" / "release" / "ferrolm")
    if not Path(b).exists():
        pytest.exit(f"{b} not found: build it with `cargo build --release -p ferrolm-cli`", 2)
    return b


class Server:
    """A running `ferrolm serve`; its stderr is collected for diagnostics."""

    def __init__(self, *flags, env=None, model=SMOLLM2):
        cmd = [binary(), "serve", "--port", "0", "--model", str(model), *flags]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})
        self.stderr = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        line = self.proc.stdout.readline()
        m = READY.search(line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {''.join(self.stderr)}")
        self.url = m.group(1)
        self.ready_s = float(m.group(2))
        self.wall_ready_s = time.monotonic() - self.started

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="not-needed", **kw)

    def metrics(self) -> dict:
        """Unlabelled samples of /metrics as {name: value}."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def server():
    s = Server(env={"FERROLM_TEST_FAULTS": "1"})
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client(max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
