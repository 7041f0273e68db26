//! Pre-tokenizer regexes per `tokenizer.ggml.pre`, copied from llama.cpp's
//! `llm_tokenizer_bpe` (src/llama-vocab.cpp). Each regex in a list splits the pieces left by the
//! previous one; text between matches stays a piece of its own (Hugging Face "Isolated").

use anyhow::{bail, Result};

/// llama.cpp hand-codes this GPT-2 regex and its custom code also applies the final `|\s+`
/// alternative that its regex string leaves out; we spell it out.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How llama.cpp pre-tokenizes for one `pre` value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PreTokenizer {
    pub regexes: Vec<&'static str>,
    /// A whole pre-token that is itself in the vocabulary skips the merges (llama3 family).
    pub ignore_merges: bool,
}

pub(crate) fn for_pre(pre: Option<&str>) -> Result<PreTokenizer> {
    let plain = |regexes: Vec<&'static str>| PreTokenizer {
        regexes,
        ignore_merges: false,
    };
    let no_merge = |regexes: Vec<&'static str>| PreTokenizer {
        regexes,
        ignore_merges: true,
    };
    Ok(match pre.unwrap_or("default") {
        "default" => plain(vec![
            r"[\p{P}\$\+<=>\^~\|]+",
            GPT2,
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        ]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => no_merge(vec![LLAMA3]),
        "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => plain(vec![LLAMA3]),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais"
        | "trillion" | "granite-docling" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => {
            plain(vec![GPT2])
        }
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => plain(vec![r"\p{N}", GPT2]),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" => plain(vec![QWEN2]),
        "qwen35" => plain(vec![QWEN35]),
        "tekken" => no_merge(vec![TEKKEN]),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => plain(vec![GPT4O]),
        other => bail!("unsupported pre-tokenizer {other:?} (tokenizer.ggml.pre)"),
    })
}
