#!/usr/bin/env python3
"""Sends the same requests to mlx_lm.server and to ferrolm and reports every difference in
status codes, response fields (paths and JSON types), the values that carry meaning (text,
finish reasons, usage, logprob ids, stream event order) and error messages. Differences that are
deliberate are listed in KNOWN with the reason; anything else is reported as UNEXPECTED.

    python scripts/compat/compat.py [--mlx-url URL] [--ferrolm-url URL] [--out bench/results]

Without URLs it starts both itself: ferrolm (target/release/ferrolm or $FERROLM_BIN) on the
default GGUF, and mlx_lm.server (the oracle venv: WITH_MLX=1 scripts/oracle-env.sh) on the same
model converted to a Hugging Face folder by scripts/gguf_to_hf.py (f32). Greedy decoding; both
compute in f32 on the same dequantized weights, so greedy texts are expected to agree.
Writes <out>/compat-mlx-lm.md and .json.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compat_cases import CASES  # noqa: E402

IGNORED = {"id", "created", "system_fingerprint"}  # differ on every response by design
# Paths whose values must agree (after the stream is folded into one message).
VALUES = re.compile(r"(finish_reason|content|text|reasoning|usage\.[a-z_.]+|object|role|"
                    r"logprobs\.content\.\d+\.(id|top_logprobs\.\d+\.id)|function\.(name|arguments)|"
                    r"error\.message|status|data\.\d+\.object)$")

# Deliberate differences: (case glob, kind, path regex) -> why.
KNOWN = [
    ("*", "value", r"^model$", "mlx echoes the request's `model` (default 'default_model'); ferrolm "
     "answers with the id of the model it serves (what /v1/models lists)"),
    ("*", "value", r"usage\.prompt_tokens_details\.cached_tokens$", "mlx-lm reuses its prompt cache "
     "across requests; ferrolm's engine has no prompt cache yet and reports 0"),
    ("*", "extra", r"^usage\.prompt_tokens_details", "ferrolm always reports cached_tokens (0 until the "
     "prompt cache lands); mlx reports it only when its prompt cache was consulted"),
    ("*", "missing", r"^usage\.prompt_tokens_details", "ferrolm always reports cached_tokens (0 until the "
     "prompt cache lands); mlx reports it only when its prompt cache was consulted"),
    ("err:*", "type", r"^error$", "errors are OpenAI's object {message, type, param, code}; mlx sends "
     "{'error': '<message>'} (the message text is compared separately)"),
    ("err:*", "extra", r"^error\.", "OpenAI's error object (message text compared separately)"),
    ("err:malformed-json", "value", r"^error\.message$", "Python's json decoder and serde_json word "
     "the parse error differently; the prefix 'Invalid JSON in request body: ' is the same"),
    ("err:missing-*", "status", r"", "mlx answers a missing messages/prompt via an uncaught assertion "
     "(still 400 with the same text)"),
    ("err:unknown-path", "*", r"^body$", "mlx answers 404 with the plain text 'Not Found'; ferrolm "
     "with an OpenAI error object"),
    ("err:get-post-endpoint", "status", r"", "mlx answers GET on a POST endpoint with 404; ferrolm "
     "with 405 Method Not Allowed"),
    ("err:get-post-endpoint", "*", r"^body$", "mlx answers GET on a POST endpoint with 404; ferrolm "
     "with 405 Method Not Allowed"),
    ("err:image-part", "status", r"", "mlx raises the same ValueError inside generation and answers "
     "404; ferrolm validates up front: 400 with the same message"),
    ("*stream*", "extra", r"^chunks\.N\.usage", "without stream_options.include_usage ferrolm still "
     "puts usage on the final chunk (mlx-bun's superset); with it, both send the usage chunk"),
    ("*stream*", "*", r"^usage", "without stream_options.include_usage ferrolm still "
     "puts usage on the final chunk (mlx-bun's superset); with it, both send the usage chunk"),
    ("*stream*", "value", r"^events$", "mlx repeats `role` in every delta and sends no empty role "
     "chunk first; ferrolm sends OpenAI's sequence: a role chunk, content deltas, a final chunk"),
    ("*", "extra", r"logprobs\.content\.\d+\.(token|bytes|top_logprobs)(\.\d+)?$", "ferrolm's "
     "logprob entries are a superset (OpenAI's token/bytes/top_logprobs beside mlx's id/logprob)"),
    ("*", "extra", r"logprobs\.content\.\d+\.top_logprobs\.\d+\.bytes(\.\d+)?$", "ferrolm's "
     "logprob entries are a superset (OpenAI's token/bytes/top_logprobs beside mlx's id/logprob)"),
    ("*top-logprobs", "value", r"logprobs\.content\.\d+\.(id|top_logprobs\.\d+\.id)$", "mlx lists "
     "the top alternatives in argpartition order and makes the first of them the outer entry; ferrolm "
     "sorts them by logprob and the outer entry is the sampled token. The sets of ids are compared "
     "separately (a different set is reported as UNEXPECTED)"),
    ("*", "extra", r"choices\.0\.logprobs$", "ferrolm's text_completion choices carry logprobs: null "
     "when none were asked for (OpenAI's completions shape)"),
    ("*", "type", r"choices\.0\.logprobs$", "ferrolm's text_completion choices carry logprobs: null "
     "when none were asked for (OpenAI's completions shape)"),
    ("completion*", "value", r"(text|content)$", "mlx-lm's detokenizer drops the leading space of "
     "the output also for raw completions ('Paris.'); ferrolm keeps the text the model produced "
     "(' Paris.', OpenAI's completions; prompt + text is the real continuation). Chat answers drop "
     "it in both"),
    ("models", "*", r"", "mlx lists the Hugging Face cache plus the --model path; ferrolm lists the "
     "one model it serves, with owned_by and context_window"),
    ("tools:*", "*", r"", "SmolLM2's template ignores tools: mlx-lm passes them and the model never "
     "sees them; ferrolm describes them in the system message (Hermes format), so the prompt, the "
     "output and the tool_calls differ"),
    ("ctx:*", "*", r"", "mlx-lm does not check the context window (it would generate past it); "
     "ferrolm answers 400 context_length_exceeded (sent to ferrolm only)"),
    ("seeded", "value", r"(content|text)$", "the random streams differ (mlx's global key vs "
     "ferrolm's per-request streams); the distributions are the same"),
    ("chat-stop*", "*", r"(content|finish_reason|usage\.|events)", "mlx-lm stops generating only when the "
     "stop word's own tokenization appears in the token stream (it strips the text wherever it "
     "appears but keeps generating); ferrolm matches stop strings on the decoded text across "
     "token boundaries and stops there"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, timeout=600):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start_servers(args):
    procs = []
    models = Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache/ferrolm/models")
    gguf = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not args.ferrolm_url:
        port = free_port()
        binary = os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm")
        p = subprocess.Popen([binary, "serve", "--model", str(gguf), "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        args.ferrolm_url = f"http://127.0.0.1:{port}"
        wait_ready(args.ferrolm_url, p)
    if not args.mlx_url:
        oracle = os.environ.get("ORACLE_PY") or str(Path.home() / ".cache/ferrolm/oracle-venv/bin/python")
        hf = models / "hf" / "SmolLM2-135M-Instruct-f32"
        if not (hf / "config.json").exists():
            subprocess.run([oracle, str(ROOT / "scripts/gguf_to_hf.py"), str(gguf), str(hf)], check=True)
        port = free_port()
        env = dict(os.environ)
        blas = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
        if Path(blas).exists():
            env["LD_PRELOAD"] = blas  # mlx-cpu's reference BLAS is 15x slower (PEERS.md)
        p = subprocess.Popen([oracle, "-m", "mlx_lm", "server", "--model", str(hf), "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        procs.append(p)
        args.mlx_url = f"http://127.0.0.1:{port}"
        wait_ready(args.mlx_url, p)
    return procs


def send(base, case):
    """(status, parsed view) of one request: JSON body, SSE events folded, or raw text."""
    method, path, body = case["method"], case["path"], case.get("body")
    kw = {"timeout": 600}
    if isinstance(body, (bytes, str)):
        kw["content"] = body
    elif body is not None:
        kw["json"] = body
    with httpx.Client() as c:
        if case.get("stream"):
            with c.stream(method, base + path, **kw) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                return r.status_code, fold_stream(lines) if r.status_code == 200 else try_json(r.read())
        r = c.request(method, base + path, **kw)
        return r.status_code, try_json(r.content)


def try_json(raw):
    try:
        return json.loads(raw)
    except ValueError:
        return {"body": raw.decode("utf-8", "replace")}


def fold_stream(lines):
    """Stream view: the chunks, the event order, and the deltas joined into one message."""
    events, chunks, text, reasoning, calls, finish, usage = [], [], "", "", [], None, None
    for ln in lines:
        data = ln[6:]
        if data == "[DONE]":
            events.append("done")
            continue
        ch = json.loads(data)
        chunks.append(ch)
        if "error" in ch:
            events.append("error")
            continue
        if not ch.get("choices"):
            events.append("usage")
            usage = ch.get("usage")
            continue
        c = ch["choices"][0]
        d = c.get("delta", {})
        kind = "finish" if c.get("finish_reason") else ("role" if d.get("role") and not d.get("content") else "delta")
        if not events or events[-1] != kind:
            events.append(kind)
        text += d.get("content") or c.get("text") or ""
        reasoning += d.get("reasoning") or ""
        calls += d.get("tool_calls") or []
        finish = c.get("finish_reason") or finish
        usage = ch.get("usage") or usage
    folded = {"content": text, "finish_reason": finish, "usage": usage, "events": ",".join(events)}
    if reasoning:
        folded["reasoning"] = reasoning
    if calls:
        folded["tool_calls"] = calls
    return {"stream": folded, "chunks": chunks}


def flatten(v, prefix="", out=None):
    out = {} if out is None else out
    if isinstance(v, dict):
        for k, x in v.items():
            if k in IGNORED and prefix.count(".") < 2:
                continue
            flatten(x, f"{prefix}{k}.", out)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            flatten(x, f"{prefix}{i}.", out)
        if not v:
            out[prefix[:-1]] = ("list", [])
    else:
        out[prefix[:-1]] = (type(v).__name__, v)
    return out


def normalize(v):
    """mlx's `{"error": "msg"}` and OpenAI's `{"error": {"message": msg}}` compare by message."""
    if isinstance(v, dict) and isinstance(v.get("error"), str):
        return {"error": {"message": v["error"]}}
    return v


def chunk_shape(path):
    return re.sub(r"^chunks\.\d+\.", "chunks.N.", path)


def compare(case, mlx, ours):
    diffs = []
    (ms, mb), (fs, fb) = mlx, ours
    if ms != fs:
        diffs.append(("status", "", f"mlx {ms}, ferrolm {fs}"))
    a, b = flatten(normalize(mb)), flatten(normalize(fb))
    if case.get("stream"):
        # Chunk fields: compare the set of shapes, not chunk by chunk.
        sa = {chunk_shape(p): t for p, (t, _) in a.items() if p.startswith("chunks.")}
        sb = {chunk_shape(p): t for p, (t, _) in b.items() if p.startswith("chunks.")}
        diffs += shape_diffs(sa, sb)
        a = {p: x for p, x in a.items() if not p.startswith("chunks.")}
        b = {p: x for p, x in b.items() if not p.startswith("chunks.")}
        for p in ("stream.events",):
            if p in a and p in b and a[p][1] != b[p][1]:
                diffs.append(("value", "events", f"mlx {a[p][1]!r}, ferrolm {b[p][1]!r}"))
        a.pop("stream.events", None)
        b.pop("stream.events", None)
    diffs += shape_diffs({p: t for p, (t, _) in a.items()}, {p: t for p, (t, _) in b.items()})
    diffs += top_set_diffs(a, b)
    for p in sorted(set(a) & set(b)):
        if VALUES.search(p) and a[p][1] != b[p][1]:
            diffs.append(("value", strip_stream(p), f"mlx {short(a[p][1])}, ferrolm {short(b[p][1])}"))
    return diffs


def top_set_diffs(a, b):
    """Per logprob entry, the set of top alternative ids must agree (their order may not)."""
    def sets(flat):
        out = {}
        for p, (_, v) in flat.items():
            m = re.search(r"logprobs\.content\.(\d+)\.top_logprobs\.\d+\.id$", p)
            if m:
                out.setdefault(int(m.group(1)), set()).add(v)
        return out
    sa, sb = sets(a), sets(b)
    return [("value", f"logprobs.content.{i}.top_logprobs (set)", f"mlx {sorted(sa.get(i, []))}, "
             f"ferrolm {sorted(sb.get(i, []))}") for i in sorted(set(sa) | set(sb)) if sa.get(i) != sb.get(i)]


def strip_stream(p):
    return p[len("stream."):] if p.startswith("stream.") else p


def shape_diffs(a, b):
    out = []
    for p in sorted(set(a) - set(b)):
        out.append(("missing", strip_stream(p), f"only mlx has it ({a[p]})"))
    for p in sorted(set(b) - set(a)):
        out.append(("extra", strip_stream(p), f"only ferrolm has it ({b[p]})"))
    for p in sorted(set(a) & set(b)):
        if a[p] != b[p] and not {a[p], b[p]} <= {"int", "float"}:
            out.append(("type", strip_stream(p), f"mlx {a[p]}, ferrolm {b[p]}"))
    return out


def short(v, n=90):
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= n else s[:n] + "…"


def explain(case_name, kind, path):
    from fnmatch import fnmatch
    for pat, k, rx, why in KNOWN:
        if fnmatch(case_name, pat) and k in (kind, "*") and re.search(rx, path):
            return why
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mlx-url")
    ap.add_argument("--ferrolm-url")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--only", help="run the cases whose name contains this")
    args = ap.parse_args()
    procs = start_servers(args)
    rows, unexpected = [], 0
    try:
        for case in CASES:
            if args.only and args.only not in case["name"]:
                continue
            ours = send(args.ferrolm_url, case)
            mlx = (None, {}) if case.get("ferrolm_only") else send(args.mlx_url, case)
            diffs = [("status", "", f"not sent to mlx; ferrolm {ours[0]}")] if mlx[0] is None else compare(case, mlx, ours)
            for kind, path, detail in diffs:
                why = explain(case["name"], kind, path)
                unexpected += why is None
                rows.append({"case": case["name"], "kind": kind, "path": path, "detail": detail,
                             "verdict": "deliberate" if why else "UNEXPECTED", "why": why or ""})
            print(f"{case['name']}: {len(diffs)} difference(s)", flush=True)
    finally:
        for p in procs:
            p.terminate()
    write_report(Path(args.out), rows, args)
    print(f"{len(rows)} differences, {unexpected} unexpected")
    sys.exit(1 if unexpected else 0)


def write_report(out, rows, args):
    """All rows in the JSON; in the markdown, rows that differ only by case or index are one."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "compat-mlx-lm.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    groups = {}
    for r in rows:
        key = (r["kind"], re.sub(r"\.\d+(?=\.|$)", ".N", r["path"]), r["verdict"], r["why"])
        groups.setdefault(key, []).append(r)
    unexpected = sum(r["verdict"] == "UNEXPECTED" for r in rows)
    lines = ["# ferrolm vs mlx_lm.server: compatibility report", "",
             f"Generated by `scripts/compat/compat.py` on {time.strftime('%Y-%m-%d')}: {len(CASES)} "
             "requests sent to both (SmolLM2-135M-Instruct, greedy; ferrolm on the Q4_1 GGUF, mlx-lm "
             "0.32.2 on CPU on the same weights dequantized to f32). Every difference in status, "
             "response fields (paths and JSON types) and meaningful values (text, finish reasons, "
             "usage, logprob ids, stream event order, error messages) is listed; rows that differ only "
             f"by case or index are merged. {len(rows)} differences, {unexpected} unexpected. Cases "
             "without a row gave the same result on both servers.", "",
             "| kind | path | cases | example | verdict |", "|---|---|---|---|---|"]
    for (kind, path, verdict, why), rs in groups.items():
        cases = sorted({r["case"] for r in rs})
        shown = ", ".join(cases[:6]) + (f" (+{len(cases) - 6})" if len(cases) > 6 else "")
        detail = rs[0]["detail"].replace("|", "\\|")
        verdict = f"deliberate: {why}" if why else verdict
        lines.append(f"| {kind} | `{path}` | {shown} | {detail} | {verdict} |")
    same = [c["name"] for c in CASES if not any(r["case"] == c["name"] for r in rows)]
    lines += ["", "Identical on both: " + (", ".join(same) or "none") + "."]
    (out / "compat-mlx-lm.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
