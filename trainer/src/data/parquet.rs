//! Parquet prompt files (verl's `data.train_files`), read row by row through the parquet
//! crate's record API, without arrow: each row becomes a JSON value and goes through the
//! JSONL loader's fields, so both formats accept the same schemas.

use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};

use super::jsonl::problems_of_rows;
use super::{DataError, Fields, Problem};

/// Reads a parquet file; its rows are numbered from 1 in errors.
pub fn load_parquet(path: &Path, fields: &Fields) -> Result<Vec<Problem>, DataError> {
    let unreadable = |reason: String| DataError::Parquet {
        path: path.display().to_string(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|source| DataError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(|e| unreadable(e.to_string()))?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| unreadable(e.to_string()))?;
    let rows = rows.enumerate().map(|(i, row)| {
        let row = row
            .map(|r| r.to_json_value())
            .map_err(|e| format!("unreadable row: {e}"));
        (i, row)
    });
    problems_of_rows(path, rows, fields)
}
