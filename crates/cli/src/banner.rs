//! What `ferrolm serve` prints under its ready line: what it serves, where, and how to call it.
//! The ready line itself (`ferrolm serve: <model> at http://HOST:PORT (ready in X s)`) stays as
//! it is: scripts and tests parse it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Facts about the served model for the banner.
pub struct Served<'a> {
    pub model_id: &'a str,
    pub architecture: &'a str,
    pub context: usize,
    pub device: &'a str,
    /// Whether the model generates text (else it only embeds).
    pub generates: bool,
}

/// The base URL a client on this machine calls: a wildcard address (`0.0.0.0`, `::`) is
/// reached through the loopback address.
fn base_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

/// The lines under the ready line.
pub fn lines(addr: SocketAddr, s: &Served<'_>) -> String {
    let base = base_url(addr);
    let model = format!(
        "  model      {} ({}, context {} tokens, {})",
        s.model_id, s.architecture, s.context, s.device
    );
    if !s.generates {
        return format!(
            "{model}\n  OpenAI     {base}/v1  (embeddings, models)\n  try        curl {base}/v1/embeddings \
             -H 'content-type: application/json' -d '{{\"input\":\"Hello!\"}}'"
        );
    }
    format!(
        "{model}\n  chat page  {base}/\n  OpenAI     {base}/v1  (chat/completions, completions, responses, models; OPENAI_BASE_URL={base}/v1)\n  \
         Anthropic  {base}/v1/messages  (ANTHROPIC_BASE_URL={base})\n  try        curl {base}/v1/chat/completions \
         -H 'content-type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_model_and_a_call_that_works() {
        let s = Served { model_id: "m", architecture: "qwen2", context: 4096, device: "cpu", generates: true };
        let text = lines("0.0.0.0:8080".parse().unwrap(), &s);
        assert!(text.contains("m (qwen2, context 4096 tokens, cpu)"));
        assert!(text.contains("curl http://127.0.0.1:8080/v1/chat/completions"));
        assert!(text.contains("chat page  http://127.0.0.1:8080/\n"));
        assert!(text.contains("ANTHROPIC_BASE_URL=http://127.0.0.1:8080"));
        let text = lines("[::]:9000".parse().unwrap(), &Served { generates: false, ..s });
        assert!(text.contains("curl http://[::1]:9000/v1/embeddings"));
    }
}
