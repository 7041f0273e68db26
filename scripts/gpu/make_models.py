"""Creates random-weight bf16 Llama models in real shapes as Hugging Face folders (GPU machine).
usage: python scripts/gpu/make_models.py OUTDIR TOKENIZER_DIR [NAME ...]
TOKENIZER_DIR holds tokenizer.json + tokenizer_config.json (SmolLM2's, carried in gpu-carry/);
they are copied into each model folder for ferrolm's folder loader. The vocabularies are the real
ones (49,152 for SmolLM2, 128,256 for Llama 3): token ids beyond the tokenizer's are never
detokenized by the checks and benchmarks, and the weight bytes (the roofline) stay real."""
import shutil, sys, time, torch, transformers
SHAPES = {  # vocab, hidden, intermediate, layers, heads, kv_heads, tie
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, True),
    "llama-3.2-1b": (128256, 2048, 8192, 16, 32, 8, True),
    "llama-3.1-8b": (128256, 4096, 14336, 32, 32, 8, False),
}
out, tok = sys.argv[1], sys.argv[2]
names = sys.argv[3:] or list(SHAPES)
for name in names:
    vocab, h, i, l, nh, kv, tie = SHAPES[name]
    t0 = time.time()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=i,
        num_hidden_layers=l, num_attention_heads=nh, num_key_value_heads=kv,
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):  # random init on the GPU: seconds instead of minutes for 8B
        m = transformers.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    d = f"{out}/{name}"
    m.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok}/{f}", d)
    del m
    torch.cuda.empty_cache()
    print(f"made {d} in {time.time() - t0:.1f} s", flush=True)
