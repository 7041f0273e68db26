"""The fuzz and abuse suite in its short form (the full run: scripts/fuzz.sh): 300+ generated
malformed requests over every route and field, special-token injections, bodies at and past the
limit, half-sent heads and stalled bodies, 1,000 idle connections; no 5xx, every error in the
API's shape, /health under 50 ms throughout, the server alive, peak RSS under model + KV budget
+ 256 MB."""
import time

import fuzz
from conftest import Server
from hardening_util import rss_mb

KV_MB = 128


def test_fuzz_short():
    fuzz.raise_fd_limit()
    limit = 1 << 20
    s = Server("--kv-budget-mb", str(KV_MB), "--ctx-size", "1024", "--max-tokens", "16", "--prompt-cache-bytes", "0",
               "--header-timeout", "3", "--read-timeout", "3", "--max-body-bytes", str(limit))
    try:
        time.sleep(0.3)
        base = rss_mb(s.proc.pid)
        r = fuzz.run(s.url, s.proc.pid, count=300, idle=1000, slow=8, limit=limit)
        alive = s.proc.poll() is None
    finally:
        s.stop()
    print(r)
    assert alive, "the server died"
    assert r["requests"] >= 300
    assert r["failure_count"] == 0, r["failures"]
    assert r["idle_connections"] == 1000
    assert not r["health_errors"], r["health_errors"]
    assert r["health_max_ms"] < 50, r
    assert r["peak_rss_mb"] < base + KV_MB + 256, r
