"""Durable generations (issue 35, docs/durable.md) against a real server: a `kill -9` in the
middle of concurrent seeded streams, then the clients' retries give byte for byte the answers of
an uninterrupted run (also with a server-chosen seed, a torn log, a full disk); SIGTERM
checkpoints and exits in bounded time; a client that leaves keeps its log for its retry; a key
reused for another request is refused; completed and non-durable requests leave no log; expired
logs go. The short CI form of scripts/crash_harness.py (which runs 20 rounds)."""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, SMOLLM2, binary

sys.path.insert(0, str(ROOT / "scripts"))
import crash_harness as ch  # noqa: E402


def harness_args(**kw):
    # 160 tokens: the answers must still be streaming when the kill comes (with 48, a fast
    # machine finished all three within kill_max and nothing was left to resume).
    args = argparse.Namespace(bin=binary(), model=str(SMOLLM2), requests=3, max_tokens=160, every=4,
                              kill_max=0.15, kill_after_chars=40, truncate=False)
    args.reference = ch.References(args.bin, args.model)
    vars(args).update(kw)
    return args


def check_round(res):
    assert res["ok"], res["failures"]
    assert res["resumed"] >= 1, f"no request had checkpointed tokens when killed: {res}"


def test_kill9_then_retries_resume_byte_identical(tmp_path):
    res = ch.run_round(harness_args(), 0, tmp_path, ch.random.Random(1))
    check_round(res)
    assert res["server_seed"] is not None, "the unseeded request's log keeps the server's seed"


def test_a_torn_last_record_is_ignored(tmp_path):
    res = ch.run_round(harness_args(truncate=True), 1, tmp_path, ch.random.Random(2))
    check_round(res)
    assert res["torn"]


def test_a_full_disk_fails_no_generation():
    d = Path(tempfile.mkdtemp(prefix="ferrolm-full-"))
    if not ch.mount_tiny_tmpfs(d, "8k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        res = ch.run_round(harness_args(requests=4, max_tokens=64), 2, d, ch.random.Random(3))
        assert res["ok"], res["failures"]
        assert res["write_warnings"] >= 1, "a failed write says so"
    finally:
        subprocess.run(["umount", str(d)])
        d.rmdir()


def body(content="Write a long story about a lighthouse keeper.", **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 48, "temperature": 0.8,
            "seed": 11, "stream": True, **kw}


def wait_for_chars(progress, n, timeout=60):
    t0 = time.monotonic()
    while len("".join(progress)) < n and time.monotonic() - t0 < timeout:
        time.sleep(0.01)


def test_sigterm_checkpoints_running_generations_and_exits(tmp_path):
    args = harness_args()
    flags = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "64"]
    s = ch.Server(args.bin, args.model, *flags)
    seen = []
    t = ch.threading.Thread(target=ch.stream, args=(s.url, "term-1", body(), seen), daemon=True)
    t.start()
    wait_for_chars(seen, 40)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(15)
    exit_s = time.monotonic() - t0
    assert exit_s < 6, f"exited after {exit_s:.1f} s"
    assert any("checkpointed in" in l for l in s.stderr), "".join(s.stderr)
    # Fewer tokens than --checkpoint-every were emitted: only the shutdown wrote them.
    assert ch.saved_tokens(ch.log_path(tmp_path, "term-1")) > 0
    s2 = ch.Server(args.bin, args.model, *flags)
    try:
        got = ch.stream(s2.url, "term-1", body())
    finally:
        s2.stop()
    want = args.reference.many([body()])
    assert got == list(want.values())[0]
    assert not list(tmp_path.glob("*.ckpt"))


def test_a_client_that_left_keeps_its_log_and_a_reused_key_is_refused(tmp_path):
    """Cancelled (the client closed the stream) after some tokens: the log stays, another body
    under its key is refused, and a non-streaming retry returns the whole answer."""
    args = harness_args()
    s = ch.Server(args.bin, args.model, "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4")
    try:
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body(), headers={"Idempotency-Key": "left"}, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 30:
                    break
        time.sleep(0.5)
        log = ch.log_path(tmp_path, "left")
        assert log.exists() and ch.saved_tokens(log) > 0
        other = httpx.post(s.url + "/v1/chat/completions", json=body(content="Something else.", stream=False),
                           headers={"Idempotency-Key": "left"}, timeout=60)
        assert other.status_code == 400 and other.json()["error"]["param"] == "Idempotency-Key", other.text
        # The retry need not stream: a non-streaming one returns the whole answer.
        r = httpx.post(s.url + "/v1/chat/completions", json=body(stream=False), headers={"Idempotency-Key": "left"}, timeout=60)
        time.sleep(0.5)
        assert not log.exists(), "a completed generation removes its log"
    finally:
        s.stop()
    choice = r.json()["choices"][0]
    want = list(args.reference.many([body()]).values())[0]
    assert (200, choice["message"]["content"], choice["finish_reason"]) == want


def test_non_durable_requests_run_and_leave_no_log(tmp_path):
    """n > 1, logprobs: answered as usual, no log; a completed durable request leaves none."""
    s = ch.Server(binary(), str(SMOLLM2), "--checkpoint-dir", str(tmp_path))
    try:
        for extra in [{"n": 2}, {"logprobs": True, "top_logprobs": 1}, {}]:
            r = httpx.post(s.url + "/v1/chat/completions", json=body(stream=False, **extra), timeout=60)
            assert r.status_code == 200, r.text
        time.sleep(0.3)
        assert not list(tmp_path.glob("*.ckpt"))
        # An unseeded request without a key writes no log even when its client leaves: a resend
        # may be a "regenerate" and must not continue the earlier draw.
        unseeded = body(max_tokens=200)
        del unseeded["seed"]
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=unseeded, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 20:
                    break
        time.sleep(0.5)
        assert not list(tmp_path.glob("*.ckpt"))
    finally:
        s.stop()


def test_expired_logs_are_removed_at_start(tmp_path):
    old = tmp_path / ("0" * 32 + ".ckpt")
    old.write_bytes(b"FLMCKPT1")
    past = time.time() - 7200
    os.utime(old, (past, past))
    fresh = tmp_path / ("1" * 32 + ".ckpt")
    fresh.write_bytes(b"FLMCKPT1")
    s = ch.Server(binary(), str(SMOLLM2), "--checkpoint-dir", str(tmp_path), "--checkpoint-ttl", "3600")
    s.stop()
    assert not old.exists() and fresh.exists()


def test_shutdown_refuses_new_generations_with_503_and_exits(tmp_path):
    """SIGTERM while a long prompt is in its prefill step (the engine answers the checkpoint
    request between steps): every generation request meanwhile gets 503 with Retry-After, and
    the process exits 0 within the bound."""
    s = ch.Server(binary(), str(SMOLLM2), "--checkpoint-dir", str(tmp_path), "--max-batch-tokens", "2048")
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 150)
    busy = {"messages": [{"role": "user", "content": long}], "max_tokens": 20, "seed": 1, "stream": True}
    ch.threading.Thread(target=ch.stream, args=(s.url, "long", busy), daemon=True).start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    statuses = set()
    with httpx.Client(base_url=s.url, timeout=5) as c:
        while time.monotonic() - t0 < 10:
            try:
                r = c.post("/v1/chat/completions", json=body(stream=False, max_tokens=2))
            except httpx.HTTPError:
                break
            statuses.add((r.status_code, r.headers.get("retry-after")))
    assert s.proc.wait(10) == 0
    assert time.monotonic() - t0 < 6.5
    assert statuses == {(503, "1")}, statuses


def test_requests_refused_by_a_full_queue_leave_no_log(tmp_path):
    s = ch.Server(binary(), str(SMOLLM2), "--checkpoint-dir", str(tmp_path), "--queue-size", "1", "--max-seqs", "1")
    statuses = []

    def one(i):
        r = httpx.post(s.url + "/v1/chat/completions", json=body(stream=False, seed=i, max_tokens=16), timeout=120)
        statuses.append(r.status_code)

    try:
        threads = [ch.threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.5)
    finally:
        s.stop()
    assert 429 in statuses and 200 in statuses, statuses
    assert not list(tmp_path.glob("*.ckpt")), "a refused request's log was left behind"
