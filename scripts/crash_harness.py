#!/usr/bin/env python3
"""Crash harness for durable generations (issue 35, docs/durable.md).

Each round: start `ferrolm serve --checkpoint-dir D`, send N concurrent streaming chat requests
(seeded sampling, each with an Idempotency-Key; one leaves the seed to the server), `kill -9`
the server at a random moment, restart it, retry every request — and check that every final
answer equals the uninterrupted reference byte for byte, that the text each client saw before
the crash is a prefix of it, that no request is lost, and that D holds no log afterwards.
Variants: `--truncate` cuts one log mid-record before the restart; `--full-disk` puts D on a
tmpfs far too small for the logs (writes fail: generations must go on, with a warning).

    python3 scripts/crash_harness.py --rounds 20            # the issue's 20 rounds
    python3 scripts/crash_harness.py --rounds 5 --truncate
    python3 scripts/crash_harness.py --rounds 3 --full-disk  # needs root (mount)

Prints one line per round and a JSON summary; exits 1 on any mismatch. tests/server/
test_durable.py runs short forms of the same rounds in CI.
"""
import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache" / "ferrolm" / "models")
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
READY = re.compile(r"at (http://\S+) \(ready in ([0-9.]+) s\)")
TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the history of bread", "a city under the sea",
          "a dragon who collects clocks", "the first winter on Mars", "a library that never closes",
          "two rival chess players"]


class Server:
    """A `ferrolm serve` process; stderr is kept (warnings are checked)."""

    def __init__(self, binary, model, *flags):
        cmd = [binary, "serve", "--port", "0", "--model", str(model), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr = []
        threading.Thread(target=self._drain, daemon=True).start()
        line = self.proc.stdout.readline()
        m = READY.search(line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {''.join(self.stderr)}")
        self.url = m.group(1)

    def _drain(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def requests_for(round_no, n, max_tokens):
    """N chat bodies with their Idempotency-Keys: seeded sampling, the last one unseeded."""
    out = []
    for i in range(n):
        topic = TOPICS[(round_no + i) % len(TOPICS)]
        body = {"messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
                "max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "stream": True}
        if i < n - 1:
            body["seed"] = 1000 * round_no + i
        out.append((f"round{round_no}-req{i}-{random.getrandbits(32):08x}", body))
    return out


def stream(url, key, body, progress=None, timeout=300):
    """Runs one streaming request; returns (status, content, finish_reason). `progress` (a list)
    gets the content as it arrives, so a killed stream leaves what it saw."""
    headers = {"Idempotency-Key": key} if key else {}
    text, finish = [], None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.text, None
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") or ""
                    text.append(piece)
                    if progress is not None:
                        progress.append(piece)
                    finish = c.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError):
        return None, "".join(text), None
    return 200, "".join(text), finish


def log_path(ckdir, key):
    """The log file of an Idempotency-Key (crates/server/src/durable.rs)."""
    digest = hashlib.sha256(f"idempotency-key\0{key}".encode()).digest()[:16].hex()
    return Path(ckdir) / f"{digest}.ckpt"


def header_seed(path):
    """The seed in a log's header (frame 0: length, 8-byte check, JSON)."""
    data = Path(path).read_bytes()
    n = int.from_bytes(data[8:12], "little")
    return json.loads(data[20:20 + n])["seed"]


def references(binary, model, bodies):
    """Each request run to its end, concurrently, on a server without checkpoints (the
    uninterrupted answer: a sequence's tokens do not depend on what else is batched)."""
    s = Server(binary, model)
    out = [None] * len(bodies)

    def one(i):
        out[i] = stream(s.url, None, bodies[i])

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out
    finally:
        s.stop()


def saved_tokens(path):
    """Tokens the intact records of a log hold (the format of crates/engine/src/durable/log.rs)."""
    data, at, n = Path(path).read_bytes(), 8, 0
    first = True
    while at + 12 <= len(data):
        size = int.from_bytes(data[at:at + 4], "little")
        payload = data[at + 12:at + 12 + size]
        if len(payload) < size or hashlib.sha256(payload).digest()[:8] != data[at + 4:at + 12]:
            break
        if not first:
            n += len(json.loads(payload)["tokens"])
        first, at = False, at + 12 + size
    return n


def truncate_one_log(ckdir):
    """Cuts the largest log that holds records a few bytes short: its last record is torn (a
    header alone is never torn: a log is created whole and renamed into place)."""
    logs = sorted((p for p in Path(ckdir).glob("*.ckpt") if saved_tokens(p) > 0), key=lambda p: p.stat().st_size)
    if not logs:
        return None
    p = logs[-1]
    size = p.stat().st_size
    os.truncate(p, max(size - 7, 0))
    return p.name


def run_round(args, round_no, ckdir, rng):
    """One crash round; returns a dict of what happened (ok: every check passed)."""
    reqs = requests_for(round_no, args.requests, args.max_tokens)
    binary, model = args.bin, args.model
    flags = ["--checkpoint-dir", str(ckdir), "--checkpoint-every", str(args.every)]
    s = Server(binary, model, *flags)
    seen = [[] for _ in reqs]
    threads = [threading.Thread(target=stream, args=(s.url, k, b, seen[i]), daemon=True) for i, (k, b) in enumerate(reqs)]
    for t in threads:
        t.start()
    # A random moment while the answers stream: once every stream has shown kill_after_chars
    # characters (at least one chunk), then up to kill_max s later.
    t0 = time.monotonic()
    need = max(args.kill_after_chars, 1)
    ready = lambda: all(len("".join(x)) >= need or not t.is_alive() for x, t in zip(seen, threads))
    while not ready() and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, args.kill_max))
    s.kill9()
    for t in threads:
        t.join(30)
    partial = ["".join(x) for x in seen]
    logs_after_kill = sorted(p.name for p in Path(ckdir).glob("*.ckpt"))
    saved = [saved_tokens(log_path(ckdir, k)) if log_path(ckdir, k).exists() else None for k, _ in reqs]
    # The server chose the last request's seed: its log keeps it (none: killed before it started).
    seed_log = log_path(ckdir, reqs[-1][0])
    server_seed = header_seed(seed_log) if seed_log.exists() else None
    torn = truncate_one_log(ckdir) if args.truncate else None
    s2 = Server(binary, model, *flags)
    t1 = time.monotonic()
    finals = [None] * len(reqs)

    def retry(i):
        finals[i] = stream(s2.url, reqs[i][0], reqs[i][1])

    rthreads = [threading.Thread(target=retry, args=(i,)) for i in range(len(reqs))]
    for t in rthreads:
        t.start()
    for t in rthreads:
        t.join()
    retry_s = time.monotonic() - t1
    # Completed generations' logs are removed by the writer thread: give it a moment.
    deadline = time.monotonic() + 5
    while list(Path(ckdir).glob("*.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    stale = sorted(p.name for p in Path(ckdir).glob("*.ckpt"))
    s2.stop()
    failures = []
    want_bodies = []
    for _, body in reqs:
        want_body = dict(body)
        if "seed" not in body:
            want_body["seed"] = server_seed
        want_bodies.append(want_body if want_body["seed"] is not None else None)
    wants = args.reference.many([b for b in want_bodies if b])
    for i, ((key, body), final, want_body) in enumerate(zip(reqs, finals, want_bodies)):
        if want_body is None:
            continue
        want = wants[json.dumps(want_body, sort_keys=True)]
        if final is None or final[0] != 200:
            failures.append(f"req{i}: retry failed: {final}")
        elif final[1:] != want[1:]:
            failures.append(f"req{i}: answer differs from the reference ({final[1][:60]!r}… vs {want[1][:60]!r}…)")
        elif not want[1].startswith(partial[i]):
            failures.append(f"req{i}: what the client saw before the crash is not a prefix of the answer")
    if stale:
        failures.append(f"stale logs: {stale}")
    warnings = [l for l in s.stderr + s2.stderr if "without checkpoints" in l]
    return {
        "round": round_no, "ok": not failures, "failures": failures,
        "seen_chars": [len(p) for p in partial], "logs_after_kill": len(logs_after_kill), "saved_tokens": saved,
        "resumed": sum(1 for n in saved if n), "torn": torn,
        "server_seed": server_seed, "retry_s": round(retry_s, 2), "write_warnings": len(warnings),
    }


class References:
    """Uninterrupted answers, computed on first use and kept (by body)."""

    def __init__(self, binary, model):
        self.binary, self.model, self.cache = binary, model, {}

    def many(self, bodies):
        keys = [json.dumps(b, sort_keys=True) for b in bodies]
        missing = [(k, b) for k, b in zip(keys, bodies) if k not in self.cache]
        if missing:
            got = references(self.binary, self.model, [b for _, b in missing])
            self.cache.update((k, g) for (k, _), g in zip(missing, got))
        return {k: self.cache[k] for k in keys}


def mount_tiny_tmpfs(path, size="12k"):
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    return r.returncode == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--kill-max", type=float, default=4.0, help="latest kill, seconds after the first chunk")
    ap.add_argument("--kill-after-chars", type=int, default=0, help="kill only once every stream showed this much")
    ap.add_argument("--truncate", action="store_true")
    ap.add_argument("--full-disk", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bin", default=os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm"))
    ap.add_argument("--model", default=str(SMOLLM2))
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    args.reference = References(args.bin, args.model)
    ckdir = Path(tempfile.mkdtemp(prefix="ferrolm-ckpt-"))
    mounted = args.full_disk and mount_tiny_tmpfs(ckdir)
    if args.full_disk and not mounted:
        sys.exit("--full-disk: could not mount a tmpfs (needs root)")
    results = []
    try:
        for r in range(args.rounds):
            res = run_round(args, r, ckdir, rng)
            results.append(res)
            print(json.dumps(res), flush=True)
    finally:
        if mounted:
            subprocess.run(["umount", str(ckdir)])
        shutil.rmtree(ckdir, ignore_errors=True)
    ok = all(r["ok"] for r in results)
    summary = {"rounds": len(results), "ok": ok, "requests": args.requests * len(results),
               "resumed": sum(r["resumed"] for r in results), "truncate": args.truncate, "full_disk": args.full_disk,
               "write_warnings": sum(r["write_warnings"] for r in results)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": results}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
