"""Creates random-weight bf16 Llama models in real shapes as Hugging Face folders (GPU machine).
usage: python scripts/gpu/make_models.py OUTDIR TOKENIZER_DIR
TOKENIZER_DIR holds tokenizer.json + tokenizer_config.json (e.g. a SmolLM2 folder made by
scripts/gguf_to_hf.py); they are copied into each model folder for ferrolm's folder loader.
Vocab is kept at 49152 (SmolLM2's tokenizer) for all shapes so the tokenizer stays valid."""
import shutil, sys, torch, transformers
SHAPES = {  # hidden, intermediate, layers, heads, kv_heads, tie
    "smollm2-135m": (576, 1536, 30, 9, 3, True),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, False),
}
out, tok = sys.argv[1], sys.argv[2]
for name, (h, i, l, nh, kv, tie) in SHAPES.items():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=h, intermediate_size=i,
        num_hidden_layers=l, num_attention_heads=nh, num_key_value_heads=kv,
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=tie,
        torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    d = f"{out}/{name}"
    m.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok}/{f}", d)
    print("made", d, flush=True)
