//! Parameter validation with mlx_lm.server's exact messages.
//!
//! Two tiers, as in mlx-lm:
//! 1. `APIHandler.validate_model_parameters` (server.py): ranges, checked in its order. Typed
//!    params can only fail the range checks; type errors come from [`crate::json`].
//! 2. The checks inside `sample_utils.py` that mlx-lm only hits while generating (top_k against
//!    the vocabulary, XTC threshold <= 0.5, min_tokens_to_keep >= 1). mlx raises them mid-request;
//!    we raise them when the sampler is built, with the same text, so the server can answer 400.
//!
//! NaN passes Python's comparisons; we reject it with the field's range message (JSON cannot carry
//! NaN, so only typed callers see this).

use ferrolm_core::SamplingParams;

/// Largest `top_logprobs` mlx_lm.server accepts (it caps at 11, not OpenAI's 20).
pub const MAX_TOP_LOGPROBS: usize = 11;

/// mlx_lm.server's range checks, in its order, for fields a typed `SamplingParams` carries.
pub fn validate(p: &SamplingParams) -> Result<(), String> {
    at_least("temperature", p.temperature, 0.0)?;
    within("top_p", p.top_p, 0.0, 1.0)?;
    within("min_p", p.min_p, 0.0, 1.0)?;
    if let Some(r) = p.repetition_penalty {
        at_least("repetition_penalty", r, 0.0)?;
    }
    number("presence_penalty", p.presence_penalty)?;
    number("frequency_penalty", p.frequency_penalty)?;
    if let Some(n) = p.logprobs {
        if n > MAX_TOP_LOGPROBS {
            return Err(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"));
        }
    }
    within("xtc_probability", p.xtc_probability, 0.0, 1.0)?;
    within("xtc_threshold", p.xtc_threshold, 0.0, 1.0)?;
    for &(_, b) in &p.logit_bias {
        if b.is_nan() {
            return Err("logit_bias must be a dict of int to float".into());
        }
    }
    Ok(())
}

/// The sampler-time checks of `sample_utils.py`, for a vocabulary (logits width) of `vocab`.
/// Only the parts mlx-lm would run are checked: nothing of the filters when temperature is 0.
/// `vocab` = 0 means unknown: the vocabulary-dependent checks then wait for the first step.
pub fn validate_for_vocab(p: &SamplingParams, vocab: usize) -> Result<(), String> {
    validate(p)?;
    for &(id, _) in &p.logit_bias {
        if vocab != 0 && id as usize >= vocab {
            // mlx-lm does not check; an out-of-range scatter is undefined there.
            return Err(format!("logit_bias token id {id} is out of range for a vocabulary of {vocab}"));
        }
    }
    if p.temperature == 0.0 {
        return Ok(());
    }
    if p.min_p != 0.0 && p.min_tokens_to_keep < 1 {
        return Err(format!("`min_tokens_to_keep` has to be a positive integer, but is {}", p.min_tokens_to_keep));
    }
    if p.xtc_probability > 0.0 && !(0.0..=0.5).contains(&p.xtc_threshold) {
        return Err(format!(
            "`threshold` has to be a float in the [0, 0.5] interval, but is {}",
            py_float(p.xtc_threshold as f64, true)
        ));
    }
    if vocab != 0 && p.top_k > 0 && p.top_k >= vocab {
        return Err(format!("`top_k` has to be an integer in the (0, {vocab}) interval, but is {}.", p.top_k));
    }
    Ok(())
}

fn at_least(name: &str, v: f32, min: f32) -> Result<(), String> {
    if v.is_nan() || v < min {
        return Err(format!("{name} must be at least {}", py_bound(min)));
    }
    Ok(())
}

fn within(name: &str, v: f32, min: f32, max: f32) -> Result<(), String> {
    at_least(name, v, min)?;
    if v > max {
        return Err(format!("{name} must be at most {}", py_bound(max)));
    }
    Ok(())
}

fn number(name: &str, v: Option<f32>) -> Result<(), String> {
    match v {
        Some(x) if x.is_nan() => Err(format!("{name} must be of type ('float', 'int')")),
        _ => Ok(()),
    }
}

/// The bounds in server.py are Python ints (`min_val=0`, `max_val=1`).
fn py_bound(v: f32) -> String {
    format!("{}", v as i64)
}

/// Python's `repr` of a float (`str(x)` of a float is the same): shortest round-trip digits,
/// fixed notation for exponents in [-4, 16), otherwise `1e-05` / `1.5e+16`. `from_f32` picks the
/// shortest digits of the f32 value (what a JSON number looked like before it became f32).
pub fn py_float(v: f64, from_f32: bool) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sci = if from_f32 { format!("{:e}", v as f32) } else { format!("{v:e}") };
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = mant.strip_prefix('-').map_or(("", mant), |m| ("-", m));
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let fixed = if exp >= 0 {
            let e = exp as usize;
            let int: String = format!("{digits:0<width$}", width = e + 1)[..e + 1].to_string();
            let frac = if digits.len() > e + 1 { &digits[e + 1..] } else { "0" };
            format!("{int}.{frac}")
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{fixed}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let s = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{s}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        let cases = [
            (0.7, "0.7"),
            (1.0, "1.0"),
            (100.0, "100.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e16, "1.5e+16"),
            (123.456, "123.456"),
            (-2.5, "-2.5"),
            (0.0, "0.0"),
        ];
        for (v, want) in cases {
            assert_eq!(py_float(v, false), want, "{v}");
        }
        assert_eq!(py_float(0.7f32 as f64, true), "0.7");
    }
}
