#!/usr/bin/env python3
"""Speculation A/B on a busy machine: several servers up at once, their requests interleaved one
at a time (round after round: plain, then each speculating server), so that every round's
ratios compare requests made within a minute of each other; the median of the rounds' ratios is
reported. Servers idle while another answers.

    FERROLM_BIN_A=old/ferrolm FERROLM_BIN_B=new/ferrolm python bench/speculation_ab.py \
        --draft-model PATH [--model PATH] [--workload chat] [--rounds 6]
    FERROLM_BIN_A=old/ferrolm FERROLM_BIN_B=new/ferrolm python bench/speculation_ab.py \
        --kind ngram --drafts-a 8 --drafts-b 32 --workload "code edit"
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import speculation as sp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(sp.MODELS / "qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("--kind", default="draft", choices=["draft", "ngram"], help="the speculation compared: a draft model or prompt lookup")
    ap.add_argument("--draft-model", help="the draft model (--kind draft)")
    ap.add_argument("--drafts-a", type=int, default=8, help="--num-draft-tokens of A's speculating server")
    ap.add_argument("--drafts-b", type=int, default=8, help="--num-draft-tokens of B's speculating server")
    ap.add_argument("--workload", default="chat", choices=list(sp.WORKLOADS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="/tmp/speculation_ab.json")
    a = ap.parse_args()
    bins = {"A": sp.private_copy(os.environ["FERROLM_BIN_A"]), "B": sp.private_copy(os.environ["FERROLM_BIN_B"])}
    base = lambda b: (lambda p: [b, "serve", "--model", a.model, "--port", str(p)])
    spec = ["--draft-model", a.draft_model] if a.kind == "draft" else ["--draft-kind", "ngram"]
    draft = lambda b, n: (lambda p: base(b)(p) + spec + ["--num-draft-tokens", str(n)])
    systems = {"plain A": base(bins["A"]), f"{a.kind} A": draft(bins["A"], a.drafts_a), f"{a.kind} B": draft(bins["B"], a.drafts_b)}
    servers = {name: sp.start(cmd) for name, cmd in systems.items()}
    messages, max_tokens = sp.WORKLOADS[a.workload]
    rows = []
    try:
        for _, url in servers.values():
            sp.decode(url, [{"role": "user", "content": "Hi"}], 4)
        for r in range(a.rounds):
            row = {"round": r, "load": sp.load_average()}
            for name, (_, url) in servers.items():
                tps, text, usage = sp.decode(url, messages, max_tokens)
                row[name] = {"tps": tps, "text": text, "spec": (usage or {}).get("speculation")}
            rows.append(row)
            print(r, row["load"], "  ".join(f"{n} {row[n]['tps']:.1f} {row[n]['spec'] or ''}" for n in servers), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    for n in (f"{a.kind} A", f"{a.kind} B"):
        ratios = [row[n]["tps"] / row["plain A"]["tps"] for row in rows]
        same = all(row[n]["text"] == row["plain A"]["text"] for row in rows)
        print(f"{n}: median x plain {statistics.median(ratios):.2f} (rounds {', '.join(f'{x:.2f}' for x in ratios)}), same answer: {same}")
    Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "workload": a.workload, "kind": a.kind,
                                  "drafts": [a.drafts_a, a.drafts_b], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
