"""On the GPU machine (stdlib only): `ferrolm serve` on a model folder with the prompt cache and
speculation, plain and with prompt lookup; a two-turn chat; prints what each answered, cached
tokens and drafts accepted (GPU rows are not bit-identical between one and several rows, so
answers may part at near-ties: this checks that the paths run and report).
usage: python scripts/gpu/serve_check.py BIN MODEL_DIR"""
import json, subprocess, sys, time, urllib.request

BIN, MODEL = sys.argv[1], sys.argv[2]


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))


def run(port, flags):
    p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--device", "cuda", "--port", str(port), *flags],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except Exception:
            time.sleep(0.2)
    msgs = [{"role": "user", "content": "Repeat after me: " + "the quick brown fox jumps over the lazy dog " * 8}]
    out = []
    for turn in range(2):
        r = post(port, {"messages": msgs, "max_tokens": 48, "temperature": 0})
        msgs += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}, {"role": "user", "content": "Again."}]
        out.append(r["usage"])
    p.terminate()
    p.wait()
    return out


for flags in ([], ["--draft-kind", "ngram", "--num-draft-tokens", "6"]):
    print(" ".join(flags) or "plain", run(18900 + len(flags), flags), flush=True)
