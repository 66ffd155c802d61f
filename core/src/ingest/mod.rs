//! Bytes from outside, read into typed values: nothing here decides, and every reader is total
//! (any input gives a value or an error, never a panic), which the fuzz targets check.

pub mod claim;
pub mod engine;
pub mod image;
pub mod members;
pub mod prometheus;
pub mod prompt;
pub mod rates;
pub mod request;
pub mod response;
pub mod stored;
pub mod telemetry;
