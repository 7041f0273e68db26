"""Startup, health, models, metrics, CORS and the CLI's flag handling."""
import subprocess

import httpx
import pytest

from conftest import Server, binary


def test_starts_within_a_second_and_says_where(server):
    assert server.url.startswith("http://127.0.0.1:")
    assert server.ready_s < 1.0, f"ready in {server.ready_s} s"


def test_health_is_byte_identical_to_mlx_lm(http):
    r = http.get("/health")
    assert r.status_code == 200
    assert r.content == b'{"status": "ok"}'
    assert r.headers["content-type"] == "application/json"


def test_models_list_the_served_model(client, http):
    models = client.models.list().data
    assert len(models) == 1
    m = models[0]
    assert m.id == "SmolLM2-135M-Instruct.Q4_1"
    assert m.object == "model"
    assert client.models.retrieve(m.id).id == m.id
    r = http.get("/v1/models/nope")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_metrics_are_prometheus_text(server, client, http):
    client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ["ferrolm_requests_total", "ferrolm_prompt_tokens_total",
                 "ferrolm_generation_tokens_total", "ferrolm_queue_depth",
                 "ferrolm_time_to_first_token_seconds_bucket",
                 "ferrolm_inter_token_latency_seconds_bucket"]:
        assert f"\n{name}" in text, name
    assert 'ferrolm_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    m = server.metrics()
    assert m["ferrolm_generation_tokens_total"] >= 3
    assert m["ferrolm_time_to_first_token_seconds_count"] >= 1


def test_cors_is_off_by_default(http):
    # mlx_lm.server allows every origin; ferrolm none unless --cors-origin (test_access.py).
    r = http.get("/health", headers={"Origin": "http://example.com"})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers
    r = http.post("/v1/chat/completions", headers={"Origin": "http://example.com"}, json={})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "origin_not_allowed"


def test_unknown_paths_and_methods_are_openai_errors(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405
    assert "error" in r.json()


def run_cli(*args):
    return subprocess.run([binary(), *args], capture_output=True, text=True, timeout=60)


def test_unknown_flag_is_an_error():
    r = run_cli("serve", "--port", "0", "--no-such-flag")
    assert r.returncode != 0
    assert "--no-such-flag" in r.stderr


def test_unsupported_mlx_flags_are_refused_not_ignored():
    r = run_cli("serve", "--port", "0", "--prompt-concurrency", "2")
    assert r.returncode == 2
    assert "--prompt-concurrency is not supported" in r.stderr


def test_mlx_lm_flags_are_accepted():
    s = Server("--temp", "0.0", "--top-p", "1.0", "--top-k", "0", "--min-p", "0.0",
               "--max-tokens", "7", "--chat-template-args", '{"enable_thinking": false}',
               "--prefill-step-size", "512", "--decode-concurrency", "4",
               # mlx-lm knobs without a ferrolm equivalent: accepted at their defaults only.
               "--prompt-concurrency", "8", "--prompt-cache-size", "10", "--log-level", "INFO",
               "--allowed-origins", "http://a.example,http://b.example", "--num-draft-tokens", "2",
               "--kv-group-size", "64", "--quantized-kv-start", "5000", "--prompt-cache-bytes", "1GB",
               "--trust-remote-code", "--host", "127.0.0.1")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Count to twenty."}]},
            headers={"Origin": "http://b.example"})
        assert r.status_code == 200
        body = r.json()
        # --max-tokens is the default cap.
        assert body["usage"]["completion_tokens"] <= 7
        assert r.headers["access-control-allow-origin"] == "http://b.example"
        r = httpx.get(s.url + "/health", headers={"Origin": "http://c.example"})
        assert "access-control-allow-origin" not in r.headers
    finally:
        s.stop()


def test_bad_flag_values_are_errors():
    r = run_cli("serve", "--port", "0", "--top-p", "2")
    assert r.returncode == 2
    assert "top_p must be at most 1" in r.stderr
    r = run_cli("serve", "--port", "0", "--chat-template-args", "[1]")
    assert r.returncode == 2


def test_port_in_use_is_refused(server):
    port = server.url.rsplit(":", 1)[1]
    r = run_cli("serve", "--port", port)
    assert r.returncode != 0
    assert "cannot listen" in r.stderr
