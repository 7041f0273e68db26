//! `GET /`: the chat page, one self-contained HTML file compiled into the binary (no CDN, no
//! external fonts). Its Content-Security-Policy allows only its own inline script (by hash),
//! its inline styles and requests to this server, so even a rendering bug could not load or
//! run anything else.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sha2::{Digest, Sha256};

const PAGE: &str = include_str!("../page/chat.html");

pub async fn chat() -> Response {
    let headers = [
        (header::CONTENT_TYPE, "text/html; charset=utf-8".to_string()),
        (header::CONTENT_SECURITY_POLICY, policy(PAGE)),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_string()),
        (header::CACHE_CONTROL, "no-cache".to_string()),
    ];
    (headers, PAGE).into_response()
}

/// The policy for `page`: its one inline script allowed by its sha256, nothing external.
fn policy(page: &str) -> String {
    let script = page
        .split_once("<script>")
        .and_then(|(_, rest)| rest.split_once("</script>"))
        .map_or("", |(body, _)| body);
    let hash = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(script.as_bytes()));
    format!(
        "default-src 'none'; script-src 'sha256-{hash}'; style-src 'unsafe-inline'; connect-src 'self'; \
         img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_is_self_contained_and_its_script_allowed_by_hash() {
        // Nothing fetched from elsewhere: no external scripts, styles, fonts or images.
        for needle in ["http://", "https://", "<script src", "@import", "url("] {
            assert!(!PAGE.contains(needle), "the page references {needle}");
        }
        assert_eq!(PAGE.matches("<script>").count(), 1);
        let csp = policy(PAGE);
        assert!(csp.contains("script-src 'sha256-") && csp.contains("connect-src 'self'"), "{csp}");
        // The hash of "" would mean the script was not found.
        assert!(!csp.contains("47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="), "{csp}");
    }
}
