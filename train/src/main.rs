//! `dflash-train`: train DFlash drafters against a frozen target and compare drafters.
//! anyhow lives only here and in the subcommands' `run` functions.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "dflash-train",
    version,
    about = "Train DFlash drafters against a frozen Qwen target and compare drafters by acceptance"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a drafter (fresh from a config, or resumed from a checkpoint).
    Train(Box<dflash_train::train::TrainArgs>),
    /// Compare drafters side by side by acceptance (offline streaks or live decoding).
    Eval(dflash_train::eval::EvalArgs),
    /// Rewrite the assistant turns of a chat dataset with the target's own outputs (resumable).
    Regenerate(dflash_train::regenerate::RegenerateArgs),
}

fn main() -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    match Cli::parse().command {
        Command::Train(args) => dflash_train::train::run(*args),
        Command::Eval(args) => dflash_train::eval::run(args),
        Command::Regenerate(args) => dflash_train::regenerate::run(args),
    }
}
