//! Stored responses for `previous_response_id` and `GET /v1/responses/{id}`: in memory, at most
//! `capacity` of them, the least recently used one dropped first (`--responses-store-size`; 0
//! stores nothing). Each entry keeps the response object and the whole conversation up to and
//! including its output, as Responses input items, so a follow-up only prepends it.

use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

#[derive(Debug)]
pub struct Stored {
    pub response: Value,
    /// Earlier turns, this request's input and its output items, in order.
    pub conversation: Vec<Value>,
}

#[derive(Default)]
struct Inner {
    /// id → (entry, last use).
    entries: HashMap<String, (Arc<Stored>, u64)>,
    /// last use → id: the first key is the entry to drop.
    by_use: BTreeMap<u64, String>,
    clock: u64,
}

pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        ResponseStore { capacity, inner: Mutex::new(Inner::default()) }
    }

    pub fn insert(&self, id: String, stored: Stored) {
        if self.capacity == 0 {
            return;
        }
        let mut g = self.lock();
        g.clock += 1;
        let now = g.clock;
        if let Some((_, used)) = g.entries.insert(id.clone(), (Arc::new(stored), now)) {
            g.by_use.remove(&used);
        }
        g.by_use.insert(now, id);
        while g.entries.len() > self.capacity {
            let Some((_, oldest)) = g.by_use.pop_first() else { break };
            g.entries.remove(&oldest);
        }
    }

    /// The entry, now the most recently used.
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        let mut g = self.lock();
        g.clock += 1;
        let now = g.clock;
        let (stored, used) = g.entries.get_mut(id)?;
        let (stored, old) = (stored.clone(), std::mem::replace(used, now));
        g.by_use.remove(&old);
        g.by_use.insert(now, id.to_string());
        Some(stored)
    }

    pub fn remove(&self, id: &str) -> bool {
        let mut g = self.lock();
        match g.entries.remove(id) {
            Some((_, used)) => {
                g.by_use.remove(&used);
                true
            }
            None => false,
        }
    }

    /// A panic while holding the lock leaves the maps consistent (each step is one insert or
    /// remove), so a poisoned lock is still usable.
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn entry(n: i64) -> Stored {
        Stored { response: json!(n), conversation: vec![] }
    }

    #[test]
    fn least_recently_used_goes_first() {
        let s = ResponseStore::new(2);
        s.insert("a".into(), entry(1));
        s.insert("b".into(), entry(2));
        assert_eq!(s.get("a").unwrap().response, 1);
        s.insert("c".into(), entry(3));
        assert!(s.get("b").is_none());
        assert!(s.get("a").is_some() && s.get("c").is_some());
        assert!(s.remove("a"));
        assert!(!s.remove("a"));
        s.insert("c".into(), entry(4));
        assert_eq!(s.get("c").unwrap().response, 4);
        let none = ResponseStore::new(0);
        none.insert("a".into(), entry(1));
        assert!(none.get("a").is_none());
    }
}
