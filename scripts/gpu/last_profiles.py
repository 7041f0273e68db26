"""Filters `ferrolm bench` stderr under FERROLM_CUDA_PROFILE=1: prints the last prefill and the
last decode kernel table, each cut to ROWS rows.   usage: ... | python3 last_profiles.py [ROWS]"""
import sys

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 24
tables, cur = {}, None
for line in sys.stdin:
    line = line.rstrip("\n")
    for kind in ("prefill", "decode"):
        if line.startswith(f"{kind}: kernel profile"):
            cur = tables[kind] = [line]
            break
    else:
        if cur is not None and line.strip():
            cur.append(line)
        elif not line.strip():
            cur = None
for kind in ("prefill", "decode"):
    t = tables.get(kind, [])
    body = [l for l in t[1:] if not l.lstrip().startswith("between")]
    between = [l for l in t[1:] if l.lstrip().startswith("between")]
    print("\n".join(t[:1] + body[:rows] + between))
