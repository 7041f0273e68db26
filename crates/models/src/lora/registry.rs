//! The adapters mounted on a served model, by name, and a request's `"adapter"` resolved to the
//! stack it runs with. Mounting and unmounting happen while requests run: a running sequence
//! holds its adapters (`Arc`), so an unmounted one stays alive until they finish.

use super::{LoraAdapter, LoraStack};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

/// What a request's `"adapter"` names when it means the base model alone.
pub const NONE: &str = "none";

#[derive(Default)]
pub struct Adapters {
    mounted: RwLock<BTreeMap<String, Arc<LoraAdapter>>>,
}

/// Why a name cannot be an adapter's: requests spell stacks `a+b` and the base `none`.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 64 || !name.chars().all(ok) || name == NONE {
        return Err(format!("adapter name {name:?} is not valid: 1-64 letters, digits, '-', '_' or '.', and not \"{NONE}\""));
    }
    Ok(())
}

impl Adapters {
    /// Mounts `adapter` under its name; an error when the name is taken (unmount it first).
    pub fn insert(&self, adapter: LoraAdapter) -> Result<Arc<LoraAdapter>, String> {
        check_name(&adapter.name)?;
        let mut mounted = self.mounted.write().unwrap_or_else(|e| e.into_inner());
        if mounted.contains_key(&adapter.name) {
            return Err(format!("an adapter named {:?} is already mounted", adapter.name));
        }
        let adapter = Arc::new(adapter);
        mounted.insert(adapter.name.clone(), adapter.clone());
        Ok(adapter)
    }

    /// Unmounts `name`; None when no adapter has that name.
    pub fn remove(&self, name: &str) -> Option<Arc<LoraAdapter>> {
        self.mounted.write().unwrap_or_else(|e| e.into_inner()).remove(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.mounted.read().unwrap_or_else(|e| e.into_inner()).contains_key(name)
    }

    /// Every mounted adapter, by name.
    pub fn list(&self) -> Vec<Arc<LoraAdapter>> {
        self.mounted.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// A request's `"adapter"`: `none` (the base model: None), a mounted adapter's name, or
    /// names joined by `+` (applied in that order). An unknown name is an error naming it and
    /// what is mounted.
    pub fn resolve(&self, spec: &str) -> Result<Option<Arc<LoraStack>>, String> {
        if spec == NONE {
            return Ok(None);
        }
        let mounted = self.mounted.read().unwrap_or_else(|e| e.into_inner());
        let mut adapters: Vec<Arc<LoraAdapter>> = Vec::new();
        for name in spec.split('+') {
            let Some(a) = mounted.get(name) else {
                let names: Vec<&str> = mounted.keys().map(String::as_str).collect();
                let known = if names.is_empty() { "none are mounted".to_string() } else { format!("mounted: {}", names.join(", ")) };
                return Err(format!("unknown adapter {name:?} ({known}; \"{NONE}\" for the base model, \"a+b\" to stack)"));
            };
            if adapters.iter().any(|b| b.name == name) {
                return Err(format!("adapter {name:?} appears twice in {spec:?}"));
            }
            adapters.push(a.clone());
        }
        Ok(Some(Arc::new(LoraStack { adapters })))
    }
}
