//! One module per subcommand: each loads what it needs and calls the library crates.

pub mod bench;
pub mod bench_serve;
pub mod compare;
pub mod config;
pub mod convert;
pub mod doctor;
pub mod eval;
pub mod generate;
pub mod load_args;
pub mod memory;
pub mod ranks;
pub mod reward_args;
pub mod run;
pub mod score;
pub mod serve;

pub use dppo_trainer::run::load_policy;
