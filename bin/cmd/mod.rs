//! One module per subcommand: each loads what it needs and calls the library crates.

pub mod bench;
pub mod convert;
pub mod eval;
pub mod generate;
pub mod run;
pub mod score;
pub mod serve;
