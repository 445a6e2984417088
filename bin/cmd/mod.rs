//! One module per subcommand: each parses nothing itself, loads what it needs and calls
//! the library crates.

pub mod convert;
