"""Concurrent streaming clients against `ferrolm serve` on the GPU machine (stdlib only; issue 38):
N clients each stream /v1/completions requests (a ~512-token prompt, up to 128 greedy tokens) for a fixed time; reports aggregate generated tok/s, p50/p95 time to first token
and inter-token latency, and every error. Writes OUT/serve_load.json.
usage: python scripts/gpu/serve_load.py BIN MODEL_DIR OUT [CLIENTS] [SECONDS]"""
import http.client, json, statistics, subprocess, sys, threading, time, urllib.request

BIN, MODEL, OUT = sys.argv[1:4]
CLIENTS = int(sys.argv[4]) if len(sys.argv) > 4 else 64
SECONDS = float(sys.argv[5]) if len(sys.argv) > 5 else 60
PORT = 8931
WORDS = "the history of the printing press is the history of how ideas learned to travel across the world " * 30


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def one_request(i, rec):
    body = {"prompt": f"{i} {WORDS}", "max_tokens": 128, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        rec["errors"].append(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        return
    times = []
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            rec["errors"].append(str(chunk["error"])[:200])
            return
        if chunk.get("usage"):
            rec["tokens"] += chunk["usage"]["completion_tokens"]
        if chunk["choices"] and chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    if not times:
        rec["errors"].append("no tokens")
        return
    rec["ttft"].append(times[0] - t0)
    rec["itl"].extend(b - a for a, b in zip(times, times[1:]))
    rec["chunks"] += len(times)


def client(c, deadline, rec, lock):
    i = 0
    while time.perf_counter() < deadline:
        mine = {"ttft": [], "itl": [], "chunks": 0, "tokens": 0, "errors": []}
        try:
            one_request(c * 1000 + i, mine)
        except Exception as e:  # a dropped connection is an error of the run, not of the script
            mine["errors"].append(repr(e)[:200])
        with lock:
            for k in ("ttft", "itl", "errors"):
                rec[k].extend(mine[k])
            rec["chunks"] += mine["chunks"]
            rec["tokens"] += mine["tokens"]
            rec["requests"] += 1
        i += 1


server = subprocess.Popen([BIN, "serve", "--model", MODEL, "--device", "cuda", "--port", str(PORT), "--max-seqs", str(CLIENTS),
                           "--queue-size", str(CLIENTS), "--max-batch-tokens", "4096"],
                          stdout=open(f"{OUT}/serve_load.log", "w"), stderr=subprocess.STDOUT)
for _ in range(900):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
        break
    except Exception:
        time.sleep(0.2)
rec = {"ttft": [], "itl": [], "chunks": 0, "tokens": 0, "errors": [], "requests": 0}
lock = threading.Lock()
one_request(0, {"ttft": [], "itl": [], "chunks": 0, "tokens": 0, "errors": []})  # warm-up
start = time.perf_counter()
threads = [threading.Thread(target=client, args=(c, start + SECONDS, rec, lock)) for c in range(CLIENTS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.perf_counter() - start
server.terminate()
server.wait(timeout=30)
summary = {
    "clients": CLIENTS, "seconds": wall, "requests": rec["requests"], "errors": len(rec["errors"]),
    "first_errors": rec["errors"][:5], "generated_tok_per_s": rec["tokens"] / wall,
    "stream_chunks_per_s": rec["chunks"] / wall,
    "ttft_p50_s": percentile(rec["ttft"], 50), "ttft_p95_s": percentile(rec["ttft"], 95),
    "itl_p50_ms": 1e3 * percentile(rec["itl"], 50), "itl_p95_ms": 1e3 * percentile(rec["itl"], 95),
}
json.dump(summary, open(f"{OUT}/serve_load.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
