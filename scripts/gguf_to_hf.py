#!/usr/bin/env python3
"""Convert a GGUF model into a Hugging Face folder that mlx-lm (and transformers) can load:

    config.json, model.safetensors (every tensor dequantized to float32), tokenizer.json,
    tokenizer_config.json (with the chat template), generation_config.json

    python scripts/gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype f32|bf16|f16] [--shard-mb N]

Needs only `gguf` and `numpy` (safetensors are written directly). `--dtype` picks the stored
float type (default f32); `--shard-mb N` splits the weights into files of about N MiB with a
`model.safetensors.index.json`, as large Hugging Face checkpoints are.

Architectures: llama (the first), qwen2 (same layout plus Q/K/V biases, no permutation), gemma3
(`Gemma3ForCausalLM`, model_type gemma3_text; GGUF norm weights hold Gemma's 1 + w, so 1 is
subtracted back).
llama.cpp's converter permutes the rows of llama's Q and K weights for its RoPE layout: they are
reshaped to (heads, 2, head_dim/2) and the middle axes swapped (convert_hf_to_gguf.py
`LlamaModel.permute`); this script applies the inverse. Tokenizers: GGUF `gpt2` (byte-level BPE,
with the pre-tokenizer named by `tokenizer.ggml.pre`) and `llama` (SentencePiece, BPE with byte
fallback). Other architectures or tokenizers fail with a clear message; add them here, keeping
the script general.
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes by `tokenizer.ggml.pre` (from llama.cpp's llama-vocab.cpp and the
# models' own tokenizer.json files).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": use_regex}


def split(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def pre_tokenizer(pre):
    if pre in ("smollm", "starcoder", "refact"):
        # GPT-2 split with every digit on its own (SmolLM2's and StarCoder's tokenizer.json).
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level(True)]}
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return {"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(False)]}
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return {"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(False)]}
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level(True)
    raise SystemExit(f"unsupported tokenizer.ggml.pre {pre!r}: add its pre-tokenizer to gguf_to_hf.py")


class Gguf:
    def __init__(self, path):
        self.reader = GGUFReader(str(path))
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.str("general.architecture")

    def str(self, key, default=None):
        f = self.fields.get(key)
        return bytes(f.parts[f.data[0]]).decode() if f else default

    def num(self, key, default=None):
        f = self.fields.get(key)
        return f.parts[f.data[0]][0].item() if f else default

    def arr_str(self, key):
        f = self.fields.get(key)
        return [bytes(f.parts[i]).decode() for i in f.data] if f else []

    def arr_num(self, key):
        f = self.fields.get(key)
        return [f.parts[i][0].item() for i in f.data] if f else []

    def a(self, key, default=None):
        return self.num(f"{self.arch}.{key}", default)

    def tensor(self, name):
        t = self.tensors[name]
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(x) for x in reversed(t.shape)]
        return w.reshape(shape)


def unpermute(w, heads):
    """Inverse of llama.cpp's `permute` (which views HF rows as (heads, 2, d/2) and swaps the
    middle axes): view the GGUF rows as (heads, d/2, 2) and swap them back."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's sandwich norms: ffn_norm is the pre-feedforward norm there.
GEMMA3_NAMES = LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# architecture -> (HF class, model_type, Q/K rows permuted by llama.cpp, layer names)
ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True, LAYER_NAMES),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False, LAYER_NAMES),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False, GEMMA3_NAMES),
}


def convert_weights(g, heads, kv_heads):
    _, _, permuted, names = ARCHS[g.arch]
    norm_shift = 1.0 if g.arch == "gemma3" else 0.0
    out = {}
    for name in g.tensors:
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in names:
                raise SystemExit(f"unexpected tensor {name} for {g.arch}")
            hf = f"model.layers.{layer}.{names[rest]}"
        elif name == "rope_freqs.weight":
            continue
        else:
            raise SystemExit(f"unexpected tensor {name}")
        w = g.tensor(name)
        rest = name.split(".", 2)[-1]
        if permuted and rest in ("attn_q.weight", "attn_k.weight"):
            w = unpermute(w, heads if rest == "attn_q.weight" else kv_heads)
        if norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(norm_shift)
        out[hf] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def make_config(g, tied):
    hidden = g.a("embedding_length")
    heads = g.a("attention.head_count")
    tokens = g.arr_str("tokenizer.ggml.tokens")
    hf_class, model_type, _, _ = ARCHS[g.arch]
    head_dim = g.a("attention.key_length", hidden // heads)
    cfg = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": g.a("feed_forward_length"),
        "num_hidden_layers": g.a("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g.a("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": g.a("attention.layer_norm_rms_epsilon", 1e-6 if g.arch == "gemma3" else 1e-5),
        "rope_theta": g.a("rope.freq_base", {"llama": 10000.0}.get(g.arch, 1e6)),
        "max_position_embeddings": g.a("context_length"),
        "vocab_size": g.a("vocab_size", len(tokens)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": g.num("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.num("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if g.arch == "qwen2":
        cfg["attention_bias"] = True
    if g.arch == "gemma3":
        cfg.update(gemma3_config(g, hidden, heads, head_dim))
    return {k: v for k, v in cfg.items() if v is not None}


def gemma3_config(g, hidden, heads, head_dim):
    layers = g.a("block_count")
    scaling = g.str("gemma3.rope.scaling.type")
    return {
        "hidden_act": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": g.a("attention.sliding_window", 512),
        "sliding_window_pattern": 6,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_local_base_freq": g.a("rope.freq_base_swa", 10000.0),
        "rope_scaling": ({"rope_type": "linear", "factor": g.a("rope.scaling.factor")}
                         if scaling == "linear" else None),
        # llama.cpp: 1/sqrt(hidden/heads) for the 27B (62 layers), else 1/sqrt(head_dim).
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": g.a("final_logit_softcapping"),
        "attn_logit_softcapping": g.a("attn_logit_softcapping"),
    }


SAFE_DTYPES = {"f32": ("F32", np.float32), "f16": ("F16", np.float16), "bf16": ("BF16", None)}


def encode(w, dtype):
    """Raw little-endian bytes of `w` (float32) in `dtype`; bf16 rounds to nearest even."""
    if dtype == "bf16":
        u = w.astype(np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
    return w.astype(np.dtype(SAFE_DTYPES[dtype][1]).newbyteorder("<")).tobytes()


def write_safetensors(path, tensors, dtype):
    """The safetensors format: u64 header length, JSON header, then the raw tensor bytes."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, w in tensors.items():
        data = encode(w, dtype)
        header[name] = {"dtype": SAFE_DTYPES[dtype][0], "shape": list(w.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for b in blobs:
            f.write(b)
    return offset


def write_weights(out, weights, dtype, shard_mb):
    if not shard_mb:
        write_safetensors(out / "model.safetensors", weights, dtype)
        return
    per = 2 if dtype in ("bf16", "f16") else 4
    shards, cur, size = [], {}, 0
    for name, w in weights.items():
        if cur and size + w.size * per > shard_mb << 20:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = w
        size += w.size * per
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / fname, shard, dtype)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def added_tokens(tokens, types):
    return [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": ty == CONTROL}
            for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)]


def make_tokenizer(g):
    model = g.str("tokenizer.ggml.model")
    tokens = g.arr_str("tokenizer.ggml.tokens")
    types = g.arr_num("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    base = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": added_tokens(tokens, types)}
    if model == "gpt2":
        merges = g.arr_str("tokenizer.ggml.merges")
        base.update({
            "normalizer": None,
            "pre_tokenizer": pre_tokenizer(g.str("tokenizer.ggml.pre", "default")),
            "post_processor": byte_level(True) | {"type": "ByteLevel"},
            "decoder": byte_level(True),
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges},
        })
    elif model == "llama":
        base.update(sentencepiece_bpe(g, tokens, types, vocab))
    else:
        raise SystemExit(f"unsupported tokenizer.ggml.model {model!r}")
    bos = g.num("tokenizer.ggml.bos_token_id")
    if g.num("tokenizer.ggml.add_bos_token", 0) and bos is not None:
        base["post_processor"] = bos_processor(tokens[bos], bos)
    return base


def bos_processor(text, id):
    """Prepends BOS on encode(add_special_tokens=True), as llama.cpp does with add_bos_token."""
    bos = {"SpecialToken": {"id": text, "type_id": 0}}
    return {"type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {text: {"id": text, "ids": [id], "tokens": [text]}}}


def sentencepiece_bpe(g, tokens, types, vocab):
    """A SentencePiece BPE vocabulary as transformers' LlamaTokenizerFast writes it. Merges are
    rebuilt from the scores: every pair whose concatenation is a token, by that token's score."""
    scores = g.arr_num("tokenizer.ggml.scores")
    merges = []
    for tok, i in vocab.items():
        if types[i] != NORMAL or len(tok) < 2:
            continue
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in vocab and b in vocab:
                merges.append((scores[i] if scores else 0.0, vocab[a], vocab[b], [a, b]))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    add_prefix = bool(g.num("tokenizer.ggml.add_space_prefix", 1))
    normalizers = ([{"type": "Prepend", "prepend": "▁"}] if add_prefix else []) + [
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]
    decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    unk = g.num("tokenizer.ggml.unknown_token_id", 0)
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [m[3] for m in merges]},
    }


def make_tokenizer_config(g):
    tokens = g.arr_str("tokenizer.ggml.tokens")
    tok = lambda key: tokens[g.num(key)] if g.num(key) is not None else None
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(g.num("tokenizer.ggml.add_bos_token", 0)),
        "add_eos_token": bool(g.num("tokenizer.ggml.add_eos_token", 0)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": g.a("context_length"),
    }
    template = g.str("tokenizer.chat_template")
    if template is not None:
        cfg["chat_template"] = template
    return {k: v for k, v in cfg.items() if v is not None}


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=sorted(SAFE_DTYPES), default="f32")
    ap.add_argument("--shard-mb", type=int, default=0)
    args = ap.parse_args()
    g = Gguf(args.gguf)
    if g.arch not in ARCHS:
        raise SystemExit(f"unsupported architecture {g.arch!r} (supported: {', '.join(ARCHS)})")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    heads = g.a("attention.head_count")
    weights = convert_weights(g, heads, g.a("attention.head_count_kv", heads))
    tied = "lm_head.weight" not in weights
    config = make_config(g, tied)
    config["torch_dtype"] = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[args.dtype]
    write_weights(out, weights, args.dtype, args.shard_mb)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(make_tokenizer(g), ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(
        json.dumps(make_tokenizer_config(g), indent=2, ensure_ascii=False) + "\n")
    eos = [i for i in (g.num(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if i is not None]
    eos = list(dict.fromkeys(eos))
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos[0] if len(eos) == 1 else eos}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    print(f"{args.gguf.name} -> {out} ({len(weights)} tensors, {g.arch}, {args.dtype}, tied={tied})")


if __name__ == "__main__":
    main()
