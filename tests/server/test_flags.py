"""The flags users bring from llama-server and vLLM (--ctx-size, --threads, --alias,
--chat-template-file), --prompt-cache-bytes, and mlx-lm knobs refused away from their
defaults: each flag that is accepted changes what the server does."""
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import SMOLLM2, Server, binary

MSG = [{"role": "user", "content": "Write one sentence about the sea."}]


def run_cli(*args):
    return subprocess.run([binary(), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def started():
    servers = []

    def start(*flags, **kw):
        s = Server(*flags, **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def chat(s, **kw):
    return httpx.post(s.url + "/v1/chat/completions", timeout=120, json={"messages": MSG, "max_tokens": 4, **kw})


@pytest.mark.parametrize("flag", ["--alias", "--served-model-name"])
def test_alias_names_the_model(started, flag):
    s = started(flag, "my-model")
    models = httpx.get(s.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["my-model"]
    assert httpx.get(s.url + "/v1/models/my-model").status_code == 200
    assert chat(s).json()["model"] == "my-model"


def test_ctx_size_caps_the_context(started):
    s = started("-c", "64")
    assert httpx.get(s.url + "/v1/models").json()["data"][0]["context_window"] == 64
    # The chat prompt is 37 tokens: 27 more fit, 28 do not.
    assert chat(s, max_tokens=27).status_code == 200
    r = chat(s, max_tokens=28)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in r.json()["error"]["message"]


def test_ctx_size_beyond_the_model_is_refused():
    r = run_cli("serve", "--port", "0", "--model", str(SMOLLM2), "--ctx-size", "10000000")
    assert r.returncode == 2
    assert "--ctx-size 10000000 is larger than the model's context of 8192 tokens" in r.stderr


def cpu_threads(pid):
    """The CPU kernels' worker threads (the caller's thread is the pool's first)."""
    names = [Path(t, "comm").read_text().strip() for t in Path(f"/proc/{pid}/task").iterdir()]
    return sum(n.startswith("ferrolm-cpu-") for n in names)


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_sizes_the_cpu_pool(started, threads):
    s = started("-t", str(threads), "--device", "cpu", env={"FERROLM_THREADS": "7"})
    assert chat(s).status_code == 200
    assert cpu_threads(s.proc.pid) == threads - 1


def test_chat_template_file(started, tmp_path):
    source = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}<|im_start|>assistant\n")
    template = tmp_path / "t.jinja"
    template.write_text(source)
    from_file = chat(started("--chat-template-file", str(template))).json()
    inline = chat(started("--chat-template", source)).json()
    assert from_file["choices"] == inline["choices"]
    # SmolLM2's own template adds a system prompt (37 tokens); this one renders only the message.
    assert from_file["usage"]["prompt_tokens"] == inline["usage"]["prompt_tokens"] < 37
    r = run_cli("serve", "--port", "0", "--model", str(SMOLLM2), "--chat-template-file", str(tmp_path / "none"))
    assert r.returncode == 2 and "--chat-template-file" in r.stderr
    r = run_cli("serve", "--port", "0", "--chat-template-file", str(template), "--chat-template", "x")
    assert r.returncode != 0 and "cannot be used with" in r.stderr


def cached(s):
    chat(s)
    return chat(s).json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prompt_cache_bytes(started):
    assert cached(started()) > 0
    assert cached(started("--prompt-cache-bytes", "0")) == 0
    r = run_cli("serve", "--port", "0", "--prompt-cache-bytes", "2TB")
    assert r.returncode == 2 and "unknown unit" in r.stderr


@pytest.mark.parametrize("flag,value", [("--prompt-concurrency", "2"),
                                        ("--prompt-cache-size", "4"),
                                        ("--pipeline", None),
                                        ("--adapter-path", "x")])
def test_mlx_knobs_away_from_their_defaults_are_refused(flag, value):
    r = run_cli("serve", "--port", "0", flag, *([value] if value else []))
    assert r.returncode == 2
    assert f"{flag} is not supported by ferrolm serve yet" in r.stderr


def test_serve_says_what_it_serves_and_how_to_call_it(started):
    s = started("--alias", "m", "-c", "512", "--device", "cpu")
    lines = [s.proc.stdout.readline() for _ in range(5)]
    assert lines[0].split() == ["model", "m", "(llama,", "context", "512", "tokens,", "cpu,"] + lines[0].split()[7:]
    assert lines[1].split() == ["chat", "page", s.url + "/"]
    assert f"{s.url}/v1" in lines[2]
    assert f"ANTHROPIC_BASE_URL={s.url}" in lines[3]
    curl = lines[4].split("try", 1)[1].strip()
    assert curl.startswith(f"curl {s.url}/v1/chat/completions ")
    # The example works as printed.
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and '"object":"chat.completion"' in out.stdout
    # Not a terminal: the load's progress is plain lines on stderr.
    assert any(line.startswith("loading SmolLM2-135M-Instruct.Q4_1.gguf: done in") for line in s.stderr)


def test_turboquant_and_quantized_kv_start_are_honoured(started):
    """--kv-quant turbo and --quantized-kv-start N serve requests; --kv-quant with --kv-bits, or
    with bits it does not have, is refused."""
    for flags in (("--kv-quant", "turbo"), ("--kv-bits", "8", "--quantized-kv-start", "16")):
        s = started(*flags)
        r = chat(s)
        assert r.status_code == 200, (flags, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1
    r = run_cli("serve", "--port", "0", "--model", str(SMOLLM2), "--kv-quant", "turbo", "--kv-bits", "8")
    assert r.returncode == 2 and "--kv-quant" in r.stderr
    r = run_cli("serve", "--port", "0", "--model", str(SMOLLM2), "--kv-quant", "turbo:k9v9")
    assert r.returncode == 2 and "--kv-quant" in r.stderr and "bits" in r.stderr
