/// Errors that cross room boundaries. Rooms keep richer errors inside and convert at the edge.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is invalid (maps to HTTP 400); the message names the field.
    #[error("{0}")]
    InvalidRequest(String),
    /// The model file or folder is missing or malformed.
    #[error("{0}")]
    Model(String),
    /// The generation was cancelled by its consumer.
    #[error("cancelled")]
    Cancelled,
    /// Anything else: a bug or a device failure (maps to HTTP 500 for that request only).
    #[error("{0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn internal(e: impl std::fmt::Display) -> Self {
        Error::Internal(e.to_string())
    }
}
