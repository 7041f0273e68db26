#!/usr/bin/env python3
"""The Hugging Face folders the tests use, converted from the fetched GGUF models by
scripts/gguf_to_hf.py (needs `gguf` and `numpy`; scripts/test.sh provides them).

    python3 scripts/hf_folders.py [NAME ...]      (default: every folder whose GGUF is present)

Folders land in $FERROLM_MODELS/hf/<name> (default ~/.cache/ferrolm/models/hf). A folder is made
in <name>.partial and renamed when complete, so a present folder is a whole one; it is remade
when gguf_to_hf.py or its GGUF is newer.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent

# name, source GGUF, dtype, shard size (MiB, 0 = one file), prompts compared with mlx-lm
FOLDERS = [
    {"name": "SmolLM2-135M-Instruct-f32", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "f32",
     "shard_mb": 0, "mlx": ["chat_capital", "raw_code", "chat_long"]},
    {"name": "SmolLM2-135M-Instruct-bf16", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "bf16",
     "shard_mb": 0, "mlx": ["chat_capital", "raw_cjk"]},
    {"name": "SmolLM2-135M-Instruct-f16", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "f16",
     "shard_mb": 0, "mlx": ["chat_capital", "raw_cyrillic"]},
    # Sharded on purpose: the index path is exercised with real weights.
    {"name": "gemma-3-270m-f32", "gguf": "gemma-3-270m-Q4_K_M.gguf", "dtype": "f32",
     "shard_mb": 300, "mlx": ["raw_english", "raw_code", "raw_long_2k"]},
    {"name": "qwen2.5-coder-0.5b-instruct-f32", "gguf": "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf", "dtype": "f32",
     "shard_mb": 0, "mlx": ["chat_capital", "chat_tools", "raw_cjk"]},
    # SmolLM2's weights under a `mistral` config with a 64-token sliding window on all layers but
    # the last (no real Mistral model is available here): the windowed llama path and its
    # rotating cache against mlx-lm, which maps mistral to its llama with `layer_types` (and
    # needs one full-attention layer).
    {"name": "SmolLM2-135M-mistral-window64", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
     "from": "SmolLM2-135M-Instruct-f32", "dtype": "f32",
     "config": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64,
                "layer_types": ["sliding_attention"] * 29 + ["full_attention"]},
     "mlx": ["chat_capital", "chat_long"]},
]


def models_dir() -> Path:
    return Path(os.environ.get("FERROLM_MODELS") or Path.home() / ".cache" / "ferrolm" / "models")


def folder_path(spec) -> Path:
    return models_dir() / "hf" / spec["name"]


def derive(spec) -> None:
    """A folder sharing another folder's files (symlinks) under a modified config.json."""
    base, out = models_dir() / "hf" / spec["from"], folder_path(spec)
    if not (base / "config.json").exists():
        print(f"{spec['name']}: skipped, {base} not present")
        return
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((base / "config.json").read_text()) | spec["config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{spec['name']}: {out}")


def make(spec) -> None:
    if "from" in spec:
        return derive(spec)
    src = models_dir() / spec["gguf"]
    out = folder_path(spec)
    if not src.exists():
        print(f"{spec['name']}: skipped, {src} not present")
        return
    newest = max(src.stat().st_mtime, (SCRIPTS / "gguf_to_hf.py").stat().st_mtime)
    if out.exists() and (out / "config.json").stat().st_mtime >= newest:
        print(f"{spec['name']}: {out} (up to date)")
        return
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [sys.executable, str(SCRIPTS / "gguf_to_hf.py"), str(src), str(partial), "--dtype", spec["dtype"]]
    if spec["shard_mb"]:
        cmd += ["--shard-mb", str(spec["shard_mb"])]
    subprocess.run(cmd, check=True)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    print(f"{spec['name']}: {out}")


def main() -> None:
    names = sys.argv[1:] or [f["name"] for f in FOLDERS]
    known = {f["name"]: f for f in FOLDERS}
    for name in names:
        if name not in known:
            sys.exit(f"unknown folder {name!r}; known: {', '.join(known)}")
        make(known[name])


if __name__ == "__main__":
    main()
