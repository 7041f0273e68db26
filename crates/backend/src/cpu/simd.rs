//! Run-time selection among builds of the same portable kernel for x86 feature levels.

/// Feature levels, ordered: a CPU that supports a level supports those below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Portable,
    Avx2,
    Avx512,
}

/// The best level this CPU supports. `FERROLM_CPU_LEVEL=avx2|portable` caps it (for tests and
/// comparisons); it is read once.
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = std::env::var("FERROLM_CPU_LEVEL").unwrap_or_default();
        let detected = detect();
        match (cap.as_str(), detected) {
            ("portable", _) => Level::Portable,
            ("avx2", Level::Avx512) => Level::Avx2,
            _ => detected,
        }
    })
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        let has = |f: &str| match f {
            "avx512f" => is_x86_feature_detected!("avx512f"),
            "avx512bw" => is_x86_feature_detected!("avx512bw"),
            "avx512vl" => is_x86_feature_detected!("avx512vl"),
            "avx2" => is_x86_feature_detected!("avx2"),
            "fma" => is_x86_feature_detected!("fma"),
            "f16c" => is_x86_feature_detected!("f16c"),
            _ => false,
        };
        let avx2 = has("avx2") && has("fma") && has("f16c");
        if avx2 && has("avx512f") && has("avx512bw") && has("avx512vl") {
            return Level::Avx512;
        }
        if avx2 {
            return Level::Avx2;
        }
    }
    Level::Portable
}

/// a·b + c. Kernels are generic over it so that builds with FMA fuse the multiply-add while
/// the portable build (where `mul_add` would be a slow library call) does not.
pub trait MulAdd {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

pub struct Fused;
pub struct Plain;

impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

impl MulAdd for Plain {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// Defines `$name::<B>(level, args)` dispatching to `$imp::<B, Fused>(level, args)` compiled for
/// AVX-512 or AVX2, or `$imp::<B, Plain>` portable. `$imp` and its helpers must be
/// `#[inline(always)]`. The caller passes the level (normally `level()`; tests pass others).
macro_rules! multiversion {
    ($vis:vis fn $name:ident<$B:ident : $bound:path>($($arg:ident : $ty:ty),* $(,)?) => $imp:ident) => {
        $vis fn $name<$B: $bound>(level: $crate::cpu::simd::Level, $($arg: $ty),*) {
            use $crate::cpu::simd::{Fused, Level, Plain};
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn avx512<$B: $bound>(level: Level, $($arg: $ty),*) {
                    $imp::<$B, Fused>(level, $($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2<$B: $bound>(level: Level, $($arg: $ty),*) {
                    $imp::<$B, Fused>(level, $($arg),*)
                }
                assert!(level <= $crate::cpu::simd::level(), "{level:?} is not supported by this CPU");
                match level {
                    // SAFETY: the assert above checked that the CPU supports the level.
                    Level::Avx512 => return unsafe { avx512::<$B>(level, $($arg),*) },
                    Level::Avx2 => return unsafe { avx2::<$B>(level, $($arg),*) },
                    Level::Portable => {}
                }
            }
            $imp::<$B, Plain>(level, $($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// `multiversion!` for kernels without a block type: `$imp::<F: MulAdd>(level, args)`.
macro_rules! multiversion_plain {
    ($vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) => $imp:ident) => {
        $vis fn $name(level: $crate::cpu::simd::Level, $($arg: $ty),*) {
            use $crate::cpu::simd::{Fused, Level, Plain};
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn avx512($($arg: $ty),*) {
                    $imp::<Fused>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2($($arg: $ty),*) {
                    $imp::<Fused>($($arg),*)
                }
                assert!(level <= $crate::cpu::simd::level(), "{level:?} is not supported by this CPU");
                match level {
                    // SAFETY: the assert above checked that the CPU supports the level.
                    Level::Avx512 => return unsafe { avx512($($arg),*) },
                    Level::Avx2 => return unsafe { avx2($($arg),*) },
                    Level::Portable => {}
                }
            }
            $imp::<Plain>($($arg),*)
        }
    };
}
pub(crate) use multiversion_plain;
