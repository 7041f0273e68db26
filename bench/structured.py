#!/usr/bin/env python3
"""Structured output over HTTP, one machine, one run, ferrolm and llama-server on the same GGUF:

(a) validity: every schema of the SchemaStore corpus (tests/json_schemas) as the
    `response_format` of a chat request asking for an example document; each answer checked
    with the `jsonschema` package (PyPI). Per system: schemas accepted / refused (400), answers
    finished / cut at max_tokens, answers that parse and validate;
(b) jump-forward: greedy generated tokens per second on schemas with long fixed keys, ferrolm
    with jump-forward on and off (the same text), and llama-server.

Requests run `--concurrency` at a time (continuous batching in ferrolm, `-np` slots in
llama-server), so the corpus takes minutes, not hours.

    python bench/structured.py [--model PATH] [--llama-server PATH] [--limit N] [--out bench/results]

Needs `jsonschema` (pip install jsonschema) and httpx.
"""
import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculation import MODELS, ROOT, private_copy, start  # noqa: E402

CORPUS = ROOT / "tests/json_schemas/schemastore"


def corpus(limit):
    files = sorted(CORPUS.glob("*.json"))[: limit or None]
    return [(f.stem, json.loads(f.read_text())) for f in files]


def ask(name):
    return [{"role": "system", "content": "You write JSON documents. Answer with the JSON document only."},
            {"role": "user", "content": f"Write a short, realistic example of a `{name}` JSON file."}]


def one(url, name, schema, max_tokens):
    body = {"model": "m", "messages": ask(name), "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema, "strict": True}}}
    t = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    row = {"schema": name, "status": r.status_code, "seconds": time.monotonic() - t}
    if r.status_code != 200:
        row["error"] = r.text[:300]
        return row
    c = r.json()["choices"][0]
    text = c["message"].get("content") or ""
    row.update(finish=c["finish_reason"], tokens=r.json()["usage"]["completion_tokens"], text=text[:2000])
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        row["valid"] = True
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as e:
        row["valid"] = False
        row["why"] = str(e)[:300]
    return row


def validity(url, schemas, a):
    with cf.ThreadPoolExecutor(a.concurrency) as pool:
        return list(pool.map(lambda s: one(url, s[0], s[1], a.max_tokens), schemas))


LONG_KEYS = {
    "type": "object", "additionalProperties": False,
    "properties": {k: {"type": "string", "maxLength": 24} for k in [
        "customer_full_legal_name", "customer_primary_email_address", "shipping_address_street_line",
        "shipping_address_postal_code", "preferred_delivery_time_window", "special_handling_instructions"]},
}
LONG_KEYS["required"] = list(LONG_KEYS["properties"])


def jump_forward(url, extra, n=3):
    """Greedy generated tokens per second (completion tokens / request time), best of n."""
    body = {"model": "m", "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Fill in a sample order for a customer in Lyon as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": LONG_KEYS}}, **extra}
    best, text = 0.0, None
    for _ in range(n):
        t = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()
        dt = time.monotonic() - t
        best = max(best, r["usage"]["completion_tokens"] / dt)
        text = r["choices"][0]["message"]["content"]
    return best, text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf"))
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--jump-only", action="store_true", help="only the jump-forward speed (for a quiet rerun)")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    a = ap.parse_args()
    binary = private_copy(os.environ.get("FERROLM_BIN") or str(ROOT / "target/release/ferrolm"))
    systems = {"ferrolm": lambda p: [binary, "serve", "--model", a.model, "--port", str(p), "--ctx-size", "8192"]}
    if a.llama_server:
        systems["llama-server"] = lambda p: [a.llama_server, "-m", a.model, "-t", "2", "-c", str(8192 * a.concurrency),
                                             "-np", str(a.concurrency), "--jinja", "--port", str(p), "--host", "127.0.0.1"]
    schemas = [] if a.jump_only else corpus(a.limit)
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": Path(a.model).name,
                       "schemas": len(schemas), "max_tokens": a.max_tokens, "concurrency": a.concurrency,
                       "commit": git("rev-parse", "--short", "HEAD")}, "systems": {}}
    for name, cmd in systems.items():
        proc, url = start(cmd)
        try:
            t = time.monotonic()
            rows = validity(url, schemas, a)
            wall = time.monotonic() - t
            jf = {"on": jump_forward(url, {})}
            if name == "ferrolm":
                jf["off"] = jump_forward(url, {"jump_forward": False})
            result["systems"][name] = {"rows": rows, "wall_s": wall, "jump_forward": jf}
            print(name, summary(rows), f"{wall:.0f} s;", {k: round(v[0], 1) for k, v in jf.items()}, flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    if a.jump_only:
        print(json.dumps({n: {k: v[0] for k, v in s["jump_forward"].items()} for n, s in result["systems"].items()}))
        return
    write(result, Path(a.out))


def summary(rows):
    ok = [r for r in rows if r["status"] == 200]
    done = [r for r in ok if r["finish"] == "stop"]
    return {"schemas": len(rows), "accepted": len(ok), "refused": len(rows) - len(ok), "finished": len(done),
            "cut_at_max_tokens": len(ok) - len(done), "valid_of_finished": sum(r["valid"] for r in done),
            "valid_of_accepted": sum(r["valid"] for r in ok)}


def git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def write(result, out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(result, indent=1))
    m = result["meta"]
    lines = [f"# Structured output over HTTP ({m['date']}, commit {m['commit']})", "",
             f"`python bench/structured.py`: {m['model']}, {m['schemas']} SchemaStore schemas (tests/json_schemas), "
             f"greedy, max_tokens {m['max_tokens']}, {m['concurrency']} requests at a time. Valid = parses and "
             "validates with the `jsonschema` package (formats checked).", "",
             "| system | accepted | refused (400) | finished | cut at max_tokens | valid / finished | valid / accepted | wall |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in result["systems"].items():
        v = summary(s["rows"])
        lines.append(f"| {name} | {v['accepted']} | {v['refused']} | {v['finished']} | {v['cut_at_max_tokens']} | "
                     f"{v['valid_of_finished']} / {v['finished']} | {v['valid_of_accepted']} / {v['accepted']} | {s['wall_s']:.0f} s |")
    lines += ["", "Jump-forward: greedy generated tokens/s (completion tokens / request time, best of 3) on a schema "
              "of six long fixed keys:", "", "| system | tok/s | same text as ferrolm jump-forward off |", "|---|---|---|"]
    ref = result["systems"].get("ferrolm", {}).get("jump_forward", {}).get("off", (0, None))[1]
    for name, s in result["systems"].items():
        for mode, (tps, text) in s["jump_forward"].items():
            label = f"{name} jump-forward {mode}" if name == "ferrolm" else name
            lines.append(f"| {label} | {tps:.1f} | {'yes' if text == ref else 'no'} |")
    (out / "structured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
